"""ZeRO-R activation memory: checkpointing of repeated blocks, optionally offloaded.

Each chosen block's forward runs under torch's non-reentrant activation checkpoint:
only the block's inputs (the *activation checkpoints*) are kept between forward and
backward, and the block is recomputed when backward reaches it.  With
``offload_activations`` those inputs are stored as pinned host copies (copied out on a
side stream during forward) and brought back for the recomputation one block ahead of
it (P_a+cpu, :class:`OffloadSchedule`).  The forward graph itself is built from the
device inputs, so gradients flow exactly as without offload; the host copies are only
the data the recomputation starts from.  On a CPU-only machine the host *is* the
device and nothing is copied.

P_a proper (partitioning checkpoints across model-parallel ranks) needs tensor
parallelism; under pure data parallelism there is nothing to partition, so it is not
offered.
"""
from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Callable, List, Optional, Tuple

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint, get_device_states, set_device_states

from ..sharding.planner import find_unit_module_classes


class _Stored:
    """One block call's tensor inputs: host copies, and once fetched back, device copies."""

    __slots__ = ("args", "host", "devices", "requires_grad", "on_device", "ready", "__weakref__")

    def __init__(self, args) -> None:
        self.args = args
        self.host: List[Optional[torch.Tensor]] = []
        self.devices: List[Optional[torch.device]] = []
        self.requires_grad: List[bool] = []
        self.on_device: Optional[List[Optional[torch.Tensor]]] = None
        self.ready = None  # CUDA event after which ``on_device`` may be read


class OffloadSchedule:
    """Moves the activation checkpoints of one model's blocks to the host during forward
    and back during backward, one block ahead.

    Forward: each checkpointed block's floating-point inputs are copied to pinned host
    memory on a side stream (the device copies can be freed as soon as the block is done).
    Backward runs the blocks in reverse: when block k is recomputed, the copy back of
    block k-1's inputs is started on the side stream, so it overlaps block k's
    recomputation and backward.  On a CPU-only machine the host is the device: nothing
    is copied, but the same bookkeeping runs (and is what the tests check).
    """

    def __init__(self) -> None:
        self._live: "weakref.WeakValueDictionary[int, _Stored]" = weakref.WeakValueDictionary()
        self._tickets = 0
        self._stream = None
        self.prefetch_hits = 0  # recomputations whose inputs were already on their way back
        self.fetches = 0

    def _copy_stream(self):
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return self._stream

    def store(self, args) -> Tuple[int, _Stored]:
        entry = _Stored(None)
        stream = None
        for a in args:
            on_accelerator = isinstance(a, torch.Tensor) and a.is_floating_point() and a.device.type == "cuda"
            if not on_accelerator:
                entry.host.append(a.detach() if isinstance(a, torch.Tensor) else a)
                entry.devices.append(None)
                entry.requires_grad.append(isinstance(a, torch.Tensor) and a.requires_grad)
                continue
            if stream is None:
                stream = self._copy_stream()
                stream.wait_stream(torch.cuda.current_stream(a.device))
            with torch.cuda.stream(stream):
                host = torch.empty(a.shape, dtype=a.dtype, pin_memory=True)
                host.copy_(a.detach(), non_blocking=True)
            a.record_stream(stream)  # the allocator must not reuse it before the copy ran
            entry.host.append(host)
            entry.devices.append(a.device)
            entry.requires_grad.append(a.requires_grad)
        if stream is not None:
            entry.ready = stream.record_event()
        self._tickets += 1
        self._live[self._tickets] = entry
        return self._tickets, entry

    def _bring_back(self, entry: _Stored, stream=None) -> None:
        if entry.on_device is not None:
            return
        if entry.ready is not None:
            # The D2H copy of forward must be complete before the host copy is read.
            (stream or torch.cuda.current_stream()).wait_event(entry.ready)
        out = []
        for h, d in zip(entry.host, entry.devices):
            if d is None:
                out.append(h)
                continue
            dst = torch.empty(h.shape, dtype=h.dtype, device=d)
            if stream is not None:
                with torch.cuda.stream(stream):
                    dst.copy_(h, non_blocking=True)
                dst.record_stream(stream)
            else:
                dst.copy_(h, non_blocking=True)
            out.append(dst)
        entry.on_device = out
        entry.ready = stream.record_event() if stream is not None else None

    def fetch(self, ticket: int, entry: _Stored) -> list:
        """The inputs of block ``ticket`` on their devices, for its recomputation; starts
        bringing back the block that backward reaches next."""
        self.fetches += 1
        if entry.on_device is not None:
            self.prefetch_hits += 1
            if entry.ready is not None:
                torch.cuda.current_stream().wait_event(entry.ready)
        else:
            self._bring_back(entry)
        earlier = [t for t in list(self._live.keys()) if t < ticket]
        if earlier:
            following = self._live.get(max(earlier))
            if following is not None:
                uses_cuda = any(d is not None for d in following.devices)
                stream = self._copy_stream() if uses_cuda else None
                if stream is not None:
                    stream.wait_stream(torch.cuda.current_stream())
                self._bring_back(following, stream)
        self._live.pop(ticket, None)
        values = entry.on_device
        entry.on_device, entry.host = None, []  # the graph may outlive this recomputation
        return [v.detach().requires_grad_(rg) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                for v, rg in zip(values, entry.requires_grad)]


class _DeviceRng:
    """The random-generator states of the accelerators that a block's tensor inputs,
    positional or keyword, are on, as they were when its forward began.

    torch's checkpoint replays the CPU generator, but an accelerator's only for the
    devices of the positional tensors handed to it. A block called with keywords only
    (BERT's embeddings: ``input_ids=...``), or the offloaded body, which is handed no
    tensors at all, would otherwise draw new dropout masks in its recomputation on a GPU,
    and its gradients would be wrong."""

    __slots__ = ("device_type", "ids", "states")

    def __init__(self, args, kwargs) -> None:
        # One tensor per device, looking inside containers (Llama's layers take their
        # rotary tables as a keyword tuple), as torch's checkpoint walks its arguments.
        one_per_device = {}
        for leaf in tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor) and leaf.device.type not in ("cpu", "meta"):
                one_per_device.setdefault(leaf.device, leaf)
        types = {d.type for d in one_per_device}
        # One device type, as torch's checkpoint (which prefers CUDA when there are more).
        self.device_type = "cuda" if "cuda" in types else next(iter(types), None)
        tensors = [t for d, t in one_per_device.items() if d.type == self.device_type]
        self.ids, self.states = get_device_states(*tensors) if tensors else ([], [])

    @contextlib.contextmanager
    def replayed(self):
        if not self.ids:
            yield
            return
        # fork_rng puts the generators back afterwards: backward's own draws continue
        # from where they were, as with torch's checkpoint.
        with torch.random.fork_rng(devices=self.ids, device_type=self.device_type):
            set_device_states(self.ids, self.states, device_type=self.device_type)
            yield


def checkpointed(fn: Callable, offload: bool = False, schedule: Optional[OffloadSchedule] = None) -> Callable:
    """Wrap ``fn`` (a block's forward) in activation checkpointing; usable directly
    on hand-written models: ``block.forward = checkpointed(block.forward)``.  With
    ``offload`` the block's inputs are kept on the host between forward and backward;
    blocks sharing one ``schedule`` are brought back one ahead of the recomputation."""
    if offload and schedule is None:
        schedule = OffloadSchedule()

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        # Saved before the forward draws from the generators (see _DeviceRng).
        rng = _DeviceRng(args, kwargs)
        if not offload:
            calls = 0

            def replaying(*a, **k):
                nonlocal calls
                calls += 1
                if calls == 1:  # the forward itself
                    return fn(*a, **k)
                with rng.replayed():
                    return fn(*a, **k)

            return checkpoint(replaying, *args, use_reentrant=False, **kwargs)
        ticket, entry = schedule.store(args)
        entry.args = args

        def body():
            if entry.args is not None:
                # The first call is the forward itself: its inputs are still on the device.
                # Drop them, so only the host copies outlive it.
                first, entry.args = entry.args, None
                return fn(*first, **kwargs)
            inputs = schedule.fetch(ticket, entry)
            with rng.replayed():
                return fn(*inputs, **kwargs)

        return checkpoint(body, use_reentrant=False)

    return run


def apply_activation_checkpointing(model: nn.Module, classes, offload: bool) -> List[Callable[[], None]]:
    """Checkpoint every module of the given classes; returns undo callbacks."""
    names = set(find_unit_module_classes(model, classes, field="activation_checkpointing"))
    schedule = OffloadSchedule() if offload else None
    undo = []
    for module in model.modules():
        if module is model or type(module).__name__ not in names:
            continue
        had_attr = "forward" in module.__dict__
        original = module.forward
        module.forward = checkpointed(original, offload, schedule)

        def restore(m=module, o=original, had=had_attr):
            if had:
                m.forward = o
            else:
                del m.forward

        undo.append(restore)
    # A model that caches keys/values would append to its cache twice (forward and
    # recomputation); transformers disables the cache when checkpointing for this reason.
    config = getattr(model, "config", None)
    if undo and config is not None and getattr(config, "use_cache", False):
        config.use_cache = False
    return undo
