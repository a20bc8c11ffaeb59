"""One unit's parameter storage: this rank's shard, the fp32 master, the gathered buffer.

[Note: what a parameter shard holds]
A unit's parameters are views into one flat, padded buffer ``full`` of the compute
dtype.  What else exists depends on two facts fixed at construction:

* ``whole`` (stages 0-2, and stage-3 units below the persistence threshold): ``full``
  is always allocated; this rank's ``shard`` is a view of it.
* partitioned (stage 3): ``full`` is allocated only while gathered
  (``ShardState.GATHERED``); its storage is freed with ``untyped_storage().resize_(0)``
  so the parameter views, and tensors autograd saved for backward, stay valid objects.

``master`` is the fp32 copy of this rank's slice that the optimizer updates, kept for
mixed precision and for optimizer offload (then on the host).  A partitioned unit whose
master lives on the compute device keeps no 16-bit shard at all: the compute-dtype
copy is made from the master for the all-gather and exists only while gathering
(model states between steps: 12 bytes/parameter/N with Adam instead of the paper's 16).
With fp32 training there is no master: the shard is what the optimizer updates.

[Note: one read/write API]
Every value that enters or leaves a shard goes through :meth:`ParamShard.write`
(elements of one parameter, wherever this rank keeps them) or
:meth:`ParamShard.local_values` (this rank's slice, at its best precision).  State
dicts, checkpoints, pretrained loading, deferred initialisation and
``gathered_parameters`` all use these, so there is one place where the copies
(full, shard, master) are kept consistent.

[Note: ZeRO++ in a shard]
Two of ZeRO++'s three changes live here, because they change how a unit is gathered,
not when (the gatherer decides that, and asks for them):

* hpZ (``secondary_partition``): a unit released at the end of a grad-enabled
  forward keeps ``secondary``, its node's slice of the gathered buffer (one
  ``ranks_per_node``-th of the unit, this rank's local-rank chunk).  Its next gather
  (in backward) copies it back and all-gathers over the node communicator only; the
  secondary is dropped then, by any write to the shard, and at the end of backward
  or of the step, so it never outlives the values it copied.  Backward therefore
  computes with exactly the values forward used.
* qwZ (``weight_quantization``): a gather asked to quantize sends this rank's values
  as block-quantized integers with fp32 scales (communication/quantize.py) and every
  rank, this one included, dequantizes every chunk, so all ranks hold the same
  weights.  ``exact`` says whether ``full`` holds the shard's values unchanged;
  :meth:`adopt_gathered` refuses a quantized buffer (it would write the rounding into
  the master).
"""
from __future__ import annotations

import enum
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from ..communication import quantize as Q
from .layout import FlatLayout


def set_parameter_data(p: nn.Parameter, data: torch.Tensor) -> None:
    """``p.data = data``, also across device types (a meta parameter materialised on a
    real device), keeping the Parameter object itself: optimizers, tied modules and
    user references still point at it."""
    if p.device.type == data.device.type:
        p.data = data
    else:
        torch.utils.swap_tensors(p, nn.Parameter(data, requires_grad=p.requires_grad))


class ShardState(enum.Enum):
    SHARDED = "sharded"  # only this rank's slice exists
    GATHERING = "gathering"  # an all-gather into ``full`` is in flight
    GATHERED = "gathered"  # ``full`` holds every rank's data


def _nbytes(t: Optional[torch.Tensor]) -> int:
    # Storage bytes, so that freed (resized-to-0) buffers count as what they hold: nothing.
    return 0 if t is None else min(t.numel() * t.element_size(), t.untyped_storage().nbytes())


class ParamShard:
    """Owns a unit's parameter buffers and their :class:`ShardState`; never decides when
    to communicate (the gatherer does) and never calls a collective except the one it is
    asked to start."""

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        layout: FlatLayout,
        shard_index: int,
        *,
        whole: bool,
        compute_dtype: torch.dtype,
        keep_master: bool,
        device: torch.device,
        master_device: torch.device,
        master_alloc: Optional[Callable[[int, torch.dtype], torch.Tensor]] = None,
        shard_alloc: Optional[Callable[[int, torch.dtype], torch.Tensor]] = None,
        after_gather: Optional[Callable[[], None]] = None,
        after_write: Optional[Callable[[int], None]] = None,
    ) -> None:
        self.params = list(params)
        self.shapes = [tuple(p.shape) for p in self.params]
        self.layout = layout
        self.whole = whole
        self.compute_dtype = compute_dtype
        self.device = device
        self.lo, self.hi = layout.shard_range(shard_index)
        self._gather_work = None
        self.secondary: Optional[torch.Tensor] = None  # hpZ ([Note: ZeRO++ in a shard])
        self.secondary_range: Optional[Tuple[int, int]] = None  # set by enable_secondary
        self.exact = True  # ``full`` (when gathered) holds the unquantized values
        n = layout.shard_numel
        pin = master_device != device and device.type == "cuda"
        self.master: Optional[torch.Tensor] = None
        if keep_master:  # disk offload: ``master_alloc`` gives a file-backed tensor (disk_offload.py)
            self.master = (master_alloc(n, torch.float32) if master_alloc is not None
                           else torch.zeros(n, dtype=torch.float32, device=master_device, pin_memory=pin))
        self._after_gather = after_gather  # disk offload: drop the file-backed shard's pages again
        self._after_write = after_write  # disk offload: told how many bytes were written (bounds dirty pages)
        # A partitioned unit whose master sits beside it needs no 16-bit shard: the
        # master is cast into the gather's own chunk when gathering (start_gather).  A master on disk is
        # not beside it (reading it each gather would page it in).
        keeps_compute_shard = whole or self.master is None or master_device != device or master_alloc is not None
        # A partitioned unit's full buffer is freed below without ever being written:
        # ``empty`` never touches its pages, so building (or loading) a model bigger
        # than one rank's memory never needs the whole of it resident.
        make = torch.zeros if whole else torch.empty
        self.full = make(layout.padded_numel, dtype=compute_dtype, device=device)
        if whole:
            self.shard: Optional[torch.Tensor] = self.full[self.lo : self.hi]
        else:
            self.shard = None
            self._shard_on_disk = keeps_compute_shard and shard_alloc is not None
            if keeps_compute_shard:
                self.shard = shard_alloc(n, compute_dtype) if shard_alloc is not None else torch.zeros(n, dtype=compute_dtype, device=device)
        self.state = ShardState.GATHERED
        # Parameters built on the meta device (deferred init) get their values later,
        # one tensor at a time, through ``write``; others are copied in now.
        for i, p in enumerate(self.params):
            if p.device.type != "meta":
                self.write(i, p.detach().reshape(-1))
        for p, off, shape in zip(self.params, layout.offsets, self.shapes):
            set_parameter_data(p, self.full[off : off + p.numel()].view(shape))
        if not whole:
            self._free_full()

    # -- the tensor the optimizer updates --------------------------------------------------
    @property
    def optimizer_target(self) -> torch.Tensor:
        """The fp32 master, or (fp32 training) the shard itself."""
        return self.master if self.master is not None else self.shard

    # -- reading and writing values ----------------------------------------------------------
    def owned_range(self, i: int) -> Optional[Tuple[int, int]]:
        """``(start, end)`` within parameter ``i`` (flattened) that this rank holds, or
        None: the whole tensor for whole units, else the overlap with the shard."""
        off, n = self.layout.offsets[i], self.layout.numels[i]
        if self.whole:
            return (0, n)
        a, b = max(self.lo, off), min(self.hi, off + n)
        return (a - off, b - off) if a < b else None

    def write(self, i: int, values: torch.Tensor, start: int = 0) -> None:
        """Store elements ``[start, start + len(values))`` of parameter ``i`` (flattened)
        in every copy this rank keeps of them: the whole buffer (if kept), the shard,
        the master.  ``values`` may cover more than this rank's slice; the rest is ignored."""
        values = values.reshape(-1).detach()
        self.secondary = None
        off = self.layout.offsets[i] + start
        end = off + values.numel()
        if self.whole:
            self.full[off:end].copy_(values)
        a, b = max(self.lo, off), min(self.hi, end)
        if a >= b:
            return
        piece = values[a - off : b - off]
        if self.shard is not None and not self.whole:
            self.shard[a - self.lo : b - self.lo].copy_(piece)
        if self.master is not None:
            self.master[a - self.lo : b - self.lo].copy_(piece)
        if self._after_write is not None:
            self._after_write((b - a) * 6)  # fp32 master + a 16-bit shard, at most

    def local_values(self) -> torch.Tensor:
        """This rank's slice at its best precision (the master if there is one)."""
        return self.master if self.master is not None else self.shard

    def write_local(self, values: torch.Tensor) -> None:
        """Replace this rank's whole slice (a resumed shard); whole units must also
        have every other rank's part rewritten, by :meth:`write` or an all-gather."""
        values = values.reshape(-1)
        self.secondary = None
        if self.master is not None:
            self.master.copy_(values)
        if self.shard is not None:
            self.shard.copy_(values)
        if self._after_write is not None:
            self._after_write(values.numel() * 6)

    def refresh_compute_copy(self) -> None:
        """After the optimizer updated the master: bring the compute-dtype shard in line
        (partitioned units without one cast at the next gather)."""
        self.secondary = None
        if self.master is not None and self.shard is not None:
            self.shard.copy_(self.master)

    def adopt_gathered(self) -> None:
        """``full`` was changed while gathered (and agreed on by every rank): make this
        rank's shard and master match it."""
        if not self.exact:
            raise RuntimeError(
                "these parameters are gathered with quantized values (weight_quantization, inside a training forward "
                "or backward): changing them here would store the rounding in the fp32 master. Modify parameters "
                "outside forward/backward (after step() or zero_grad())."
            )
        self.secondary = None
        own = self.full[self.lo : self.hi]
        if self.shard is not None and not self.whole:
            self.shard.copy_(own)
        if self.master is not None:
            self.master.copy_(own.to(self.master.device, torch.float32))

    def view_of(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        off, n = self.layout.offsets[i], self.layout.numels[i]
        return flat[off : off + n].view(self.shapes[i])

    # -- gathering (partitioned units) ---------------------------------------------------------
    def start_gather(self, comm, label: str, quantization: Optional[Tuple[int, int]] = None) -> None:
        """Grow the full buffer, write this rank's values into its own chunk (the 16-bit
        shard, or the master cast straight from fp32) and gather in place: the unit's own
        buffer is all a gather in flight holds, with no shard-sized temporary and no
        staging (on gloo the header travels beside it, [Note: headers beside in-place
        gathers] in collectives.py).  With a secondary partition kept from forward the
        gather stays inside the node; ``quantization`` ``(bits, block)``: qwZ
        ([Note: ZeRO++ in a shard])."""
        if self.state is not ShardState.SHARDED:
            return
        self._allocate_full()
        if self.secondary is not None:
            lo, hi = self.secondary_range
            own = self.full.data[lo:hi]
            own.copy_(self.secondary)
            self.secondary = None
            self._gather_work = comm.node_comm.all_gather(self.full.data, own, async_op=True,
                                                          label=f"{label} (secondary partition)")
            self.state = ShardState.GATHERING  # ``exact`` stays what the forward gather made it
            return
        src = self.shard if self.shard is not None else self.master
        if quantization is not None and comm.world_size > 1:
            self._gather_work = _QuantizedGather(self, src, comm, label, *quantization)
            self.exact = False
        else:
            own = self.full.data[self.lo : self.hi]  # through ``.data``: no autograd version bump
            own.copy_(src)  # a host shard is copied over here
            self._gather_work = comm.all_gather(self.full.data, own, async_op=True, label=label)
            self.exact = True
        self.state = ShardState.GATHERING

    def enable_secondary(self, local_rank: int, ranks_per_node: int) -> None:
        """hpZ: this rank keeps chunk ``local_rank`` of ``ranks_per_node`` of the gathered
        unit between forward and backward."""
        n = self.layout.padded_numel // ranks_per_node
        self.secondary_range = (local_rank * n, (local_rank + 1) * n)

    def drop_secondary(self) -> None:
        self.secondary = None

    def _allocate_full(self) -> None:
        self.full.untyped_storage().resize_(self.layout.padded_numel * self.full.element_size())

    def finish_gather(self) -> None:
        if self.state is ShardState.GATHERING:
            self._gather_work.wait()
            self._gather_work = None
            self.state = ShardState.GATHERED
            if self._after_gather is not None:
                self._after_gather()

    def release(self, keep_secondary: bool = False) -> None:
        """Free the gathered buffer; ``keep_secondary`` (hpZ, a backward will follow):
        keep this rank's node chunk of it first."""
        if self.whole or self.state is ShardState.SHARDED:
            return
        self.finish_gather()
        if keep_secondary and self.secondary_range is not None:
            lo, hi = self.secondary_range
            self.secondary = self.full.data[lo:hi].clone()
        self._free_full()

    on_free = None  # stage 3: puts the parameters' guard back before their values go (guard.py)

    def _free_full(self) -> None:
        if self.on_free is not None:
            self.on_free()
        self.full.untyped_storage().resize_(0)
        self.state = ShardState.SHARDED

    # -- accounting ------------------------------------------------------------------------------
    _shard_on_disk = False  # disk offload's offload_param: the 16-bit shard is file-backed

    def bytes(self) -> dict:
        params = _nbytes(self.full) + (0 if self.whole else _nbytes(self.shard))
        parts = {"parameters": params, "master_weights": _nbytes(self.master)}
        if self.secondary_range is not None:  # hpZ: reported beside the paper's terms
            parts["secondary_parameters"] = _nbytes(self.secondary)
        if self._shard_on_disk:
            parts["offloaded"] = _nbytes(self.shard)  # counted in ``parameters``, kept in a file
        return parts


class _QuantizedGather:
    """qwZ's gather of one unit: this rank's values quantized into its rows of a payload
    and a scales buffer, both gathered in place; ``wait`` dequantizes every rank's
    chunk (its own too) into ``full`` and frees the two buffers."""

    # Rows dequantized at a time: bounds the fp32 temporary beside ``full``.
    ROWS_ELEMENTS = 1 << 22

    def __init__(self, shard: ParamShard, src: torch.Tensor, comm, label: str, bits: int, block: int) -> None:
        self.shard, self.bits, self.block = shard, bits, block
        n, c = comm.world_size, shard.layout.shard_numel
        self.q_row, self.s_row = Q.payload_bytes(c, block, bits), Q.blocks_for(c, block)  # one chunk each
        self.q = torch.empty(n * self.q_row, dtype=torch.uint8, device=shard.device)
        self.s = torch.empty(n * self.s_row, dtype=torch.float32, device=shard.device)
        r = comm.rank
        Q.quantize_into(src.to(shard.device), self.q[r * self.q_row : (r + 1) * self.q_row],
                        self.s[r * self.s_row : (r + 1) * self.s_row], block, bits)
        self.work = comm.all_gather_quantized(self.q, self.q[r * self.q_row : (r + 1) * self.q_row], self.s,
                                              self.s[r * self.s_row : (r + 1) * self.s_row],
                                              numel=shard.layout.padded_numel, bits=bits, label=label)

    def wait(self) -> bool:
        self.work.wait()
        c = self.shard.layout.shard_numel
        n = self.q.numel() // self.q_row
        rows = self.shard.full.data.view(n, c)
        step = max(1, self.ROWS_ELEMENTS // max(c, 1))
        for a in range(0, n, step):
            b = min(n, a + step)
            values = Q.dequantize(self.q[a * self.q_row : b * self.q_row], self.s[a * self.s_row : b * self.s_row],
                                  (b - a) * self.s_row * self.block, self.block, self.bits)
            rows[a:b].copy_(values.view(b - a, self.s_row * self.block)[:, :c])
        self.q = self.s = None
        return True


def whole_values(shard: ParamShard, comm, label: str) -> torch.Tensor:
    """Every rank's slice at best precision, concatenated (collective for partitioned
    layouts; at world size 1 the local slice itself)."""
    src = shard.local_values()
    if shard.layout.world_size == 1:
        return src
    full = torch.empty(shard.layout.padded_numel, dtype=src.dtype, device=src.device)
    own = full[shard.lo : shard.hi]
    own.copy_(src)  # gathered in place: on gloo no staging buffer beside ``full``
    comm.all_gather_for_state(full, own, label=label)
    return full


__all__: List[str] = ["ParamShard", "ShardState", "set_parameter_data", "whole_values"]
