"""The systems the benchmark compares, each behind the same small interface.

Every system wraps one freshly built GPT-2-style model and exposes

    forward(x) -> loss, backward(loss), step(), zero_grad(),
    model_state_bytes() (None = not measurable), comm_elements() / reset_comm()
    (elements per rank, counted the paper's way; None = not measurable), close()

so ``bench_core`` runs all of them through one training loop.  Systems:

* ``ddp``: torch DistributedDataParallel (bf16 = autocast over fp32 parameters);
* ``zero0`` .. ``zero3``: this repository's ``zero_strategy``;
* ``fsdp2_zero2`` / ``fsdp2_zero3``: ``torch.distributed.fsdp.fully_shard`` on every
  GPT2Block and then the root, ``reshard_after_forward`` False / True (bf16 =
  ``MixedPrecisionPolicy`` with fp32 sharded master parameters);
* ``deepspeed1`` .. ``deepspeed3``: DeepSpeed ZeRO with its default buckets, on the CPU
  accelerator (``DS_ACCELERATOR=cpu``) over the same gloo process group.
"""
from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

ZERO_SYSTEMS = ("zero0", "zero1", "zero2", "zero3")
FSDP_SYSTEMS = ("fsdp2_zero2", "fsdp2_zero3")
DS_SYSTEMS = ("deepspeed1", "deepspeed2", "deepspeed3")
ALL_SYSTEMS = ("ddp",) + ZERO_SYSTEMS + FSDP_SYSTEMS + DS_SYSTEMS

# GPT-2 shapes (no dropout, tied embedding).  Ψ counts the tied matrix once.
PRESETS = {
    # 6 x 3.15M blocks + 6.3M embedding = 25.27M
    "25m": dict(n_layer=6, n_embd=512, n_head=8, vocab=12288, seq=128, micro_batch=4),
    # 12 x 7.09M blocks + 15.7M embedding = 100.88M
    "100m": dict(n_layer=12, n_embd=768, n_head=12, vocab=20480, seq=128, micro_batch=4),
    # GPT-2 medium's shape: 24 x 12.6M blocks + 51.5M embedding = 354.0M
    "350m": dict(n_layer=24, n_embd=1024, n_head=16, vocab=50304, seq=128, micro_batch=4),
    # smoke runs: 0.4M parameters
    "quick": dict(n_layer=2, n_embd=128, n_head=4, vocab=1024, seq=32, micro_batch=2),
}


def equivalent_stage(system: str) -> int:
    """The ZeRO stage whose paper formula a system is compared with."""
    if system == "ddp":
        return 0
    return int(system[-1])


def label(system: str) -> str:
    if system == "ddp":
        return "DDP"
    if system.startswith("zero"):
        return f"zero_strategy stage {system[-1]}"
    if system.startswith("fsdp2"):
        return f"FSDP2 ({'reshard' if system.endswith('3') else 'no reshard'} after fwd)"
    return f"DeepSpeed stage {system[-1]}"


def deepspeed_status() -> str:
    """'' when DeepSpeed can run here, else why not (checked in a worker process)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed  # noqa: F401
        from deepspeed.accelerator import get_accelerator

        name = get_accelerator()._name
    except Exception as e:  # noqa: BLE001 - any import failure means "skip"
        return f"import deepspeed failed: {type(e).__name__}: {e}".splitlines()[0]
    if name != "cpu":
        return f"DeepSpeed picked accelerator {name!r}, not cpu"
    return ""


# ---------------------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------------------
def build_model(args):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=args.n_layer,
        n_embd=args.n_embd,
        n_head=args.n_head,
        vocab_size=args.vocab,
        n_positions=args.seq,
        # No dropout: every system must compute exactly the same function.
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
    )
    torch.manual_seed(args.seed)  # same weights for every system and rank
    return GPT2LMHeadModel(config)


def trainable_numel(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def make_optimizer(params, args):
    return torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)


def local_bytes(t) -> int:
    """Bytes this rank holds for ``t`` (a DTensor's local shard, or the tensor)."""
    if t is None:
        return 0
    t = getattr(t, "_local_tensor", t)
    return t.numel() * t.element_size()


def optimizer_bytes(optimizer) -> int:
    return sum(local_bytes(v) for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))


# ---------------------------------------------------------------------------------------
# counting torch.distributed collectives (FSDP2 and DeepSpeed call them from Python)
# ---------------------------------------------------------------------------------------
# name -> how many elements the call moves, the paper's way (full tensor for gather /
# scatter, twice the tensor for all-reduce).
def _numel_list(ts):
    return sum(t.numel() for t in ts)


_COUNTED = {
    "all_reduce": lambda a, k: 2 * (k.get("tensor") if "tensor" in k else a[0]).numel(),
    "all_gather_into_tensor": lambda a, k: (k.get("output_tensor") if "output_tensor" in k else a[0]).numel(),
    "all_gather_single": lambda a, k: (k.get("output_tensor") if "output_tensor" in k else a[0]).numel(),
    "_all_gather_base": lambda a, k: (k.get("output_tensor") if "output_tensor" in k else a[0]).numel(),
    "all_gather": lambda a, k: _numel_list(k.get("tensor_list") if "tensor_list" in k else a[0]),
    "reduce_scatter_tensor": lambda a, k: (k.get("input") if "input" in k else a[1]).numel(),
    "reduce_scatter_single": lambda a, k: (k.get("input") if "input" in k else a[1]).numel(),
    "_reduce_scatter_base": lambda a, k: (k.get("input") if "input" in k else a[1]).numel(),
    "reduce_scatter": lambda a, k: _numel_list(k.get("input_list") if "input_list" in k else a[1]),
    "broadcast": lambda a, k: (k.get("tensor") if "tensor" in k else a[0]).numel(),
    "reduce": lambda a, k: (k.get("tensor") if "tensor" in k else a[0]).numel(),
    "all_to_all_single": lambda a, k: (k.get("input") if "input" in k else a[1]).numel(),
}
# Calls below this size are flags and norms, not model states (zero's "control" kind).
CONTROL_NUMEL = 1024


class CollectiveCounter:
    """Wraps torch.distributed's tensor collectives while installed.

    Nested calls (a deprecated name forwarding to its replacement) count once."""

    def __init__(self):
        self.elements = 0
        self.by_kind = {}
        self._depth = 0
        self._saved = []

    def install(self):
        import torch.distributed.distributed_c10d as c10d

        for module in (dist, c10d):
            for name, count in _COUNTED.items():
                fn = getattr(module, name, None)
                if fn is None or getattr(fn, "_bench_counted", False):
                    continue
                self._saved.append((module, name, fn))
                setattr(module, name, self._wrap(name, fn, count))
        return self

    def _wrap(self, name, fn, count):
        def wrapper(*args, **kwargs):
            outer = self._depth == 0
            self._depth += 1
            try:
                if outer:
                    try:
                        n = count(args, kwargs)
                    except Exception:  # noqa: BLE001 - an unusual signature: do not count
                        n = 0
                    if n >= CONTROL_NUMEL and name != "broadcast":
                        self.elements += n
                    self.by_kind[name] = self.by_kind.get(name, 0) + n
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1

        wrapper._bench_counted = True
        return wrapper

    def reset(self):
        self.elements = 0
        self.by_kind = {}

    def uninstall(self):
        for module, name, fn in reversed(self._saved):
            setattr(module, name, fn)
        self._saved = []


# ---------------------------------------------------------------------------------------
# systems
# ---------------------------------------------------------------------------------------
class DDPSystem:
    def __init__(self, args, world_size):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.model = build_model(args)
        self.psi = trainable_numel(self.model)
        self.ddp = DDP(self.model)
        self.counter = {"elements": 0}

        def counting_allreduce(state, bucket):
            # Count what DDP all-reduces, then do exactly its default (averaging all-reduce).
            self.counter["elements"] += bucket.buffer().numel()
            return default_hooks.allreduce_hook(None, bucket)

        self.ddp.register_comm_hook(None, counting_allreduce)
        self.optimizer = make_optimizer(self.ddp.parameters(), args)
        self.bf16 = args.precision == "bf16"

    def forward(self, x):
        # bf16 for DDP = autocast with fp32 parameters (the usual PyTorch mixed precision).
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
            return self.ddp(input_ids=x, labels=x).loss

    def backward(self, loss):
        loss.backward()

    def step(self):
        self.optimizer.step()

    def zero_grad(self):
        # Keep the gradient tensors, like zero_strategy's flat gradient buffers.
        self.optimizer.zero_grad(set_to_none=False)

    def model_state_bytes(self):
        ps = list(self.model.parameters())
        return sum(local_bytes(p) + local_bytes(p.grad) for p in ps) + optimizer_bytes(self.optimizer)

    def reset_comm(self):
        self.counter["elements"] = 0

    def comm_elements(self):
        return 2 * self.counter["elements"]  # all-reduce = reduce-scatter + all-gather

    def comm_by_kind(self):
        return {"all_reduce": self.counter["elements"]}

    def close(self):
        del self.ddp, self.model, self.optimizer


class _EngineDriven:
    """Systems whose engine object runs backward and step (and zeroes in step)."""

    def backward(self, loss):
        self.engine.backward(loss)

    def step(self):
        self.engine.step()

    def zero_grad(self):
        pass  # engine.step() does it


class ZeroSystem(_EngineDriven):
    def __init__(self, args, world_size, stage):
        import zero_strategy

        self.model = build_model(args)
        self.psi = trainable_numel(self.model)  # before initialize: stage 3 shards in place
        self.optimizer = make_optimizer(self.model.parameters(), args)
        config = {"stage": stage, "precision": args.precision}
        config.update(getattr(args, "zero_config", None) or {})
        self.engine = zero_strategy.initialize(self.model, self.optimizer, config)

    def forward(self, x):
        return self.model(input_ids=x, labels=x).loss

    # Stages 2-3 free their gradient shards in step(): the harness measures before it.
    states_before_step = True

    def model_state_bytes(self):
        r = self.engine.memory_report()
        return sum(r[k] for k in ("parameters", "gradients", "master_weights", "optimizer_state"))

    def reset_comm(self):
        self.engine.reset_comm_report()

    def comm_elements(self):
        return self.engine.comm_report().paper_volume

    def comm_by_kind(self):
        # "total" is the intra/cross-node byte sums, not a kind
        return {k: v["elements"] for k, v in self.engine.comm_report().as_dict().items() if "elements" in v}

    def close(self):
        self.engine.close()
        del self.engine, self.model, self.optimizer


class _CountsCollectives:
    """For systems whose traffic is counted by wrapping torch.distributed (self.counter)."""

    def reset_comm(self):
        self.counter.reset()

    def comm_elements(self):
        return self.counter.elements

    def comm_by_kind(self):
        return dict(self.counter.by_kind)


def fsdp2_shard(model, world_size: int, precision: str, reshard_after_forward: bool) -> None:
    """``fully_shard`` on every GPT2Block and then the root; bf16 = bf16 parameters and
    reductions over fp32 sharded masters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    if precision == "bf16":
        # zero_strategy's default reduce dtype is the compute dtype (ZeroConfig.reduce_dtype=None).
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    else:
        policy = MixedPrecisionPolicy()
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)


class FSDP2System(_CountsCollectives):
    def __init__(self, args, world_size, reshard_after_forward):
        self.model = build_model(args)
        self.psi = trainable_numel(self.model)
        fsdp2_shard(self.model, world_size, args.precision, reshard_after_forward)
        self.optimizer = make_optimizer(self.model.parameters(), args)
        self.counter = CollectiveCounter().install()

    def forward(self, x):
        return self.model(input_ids=x, labels=x).loss

    def backward(self, loss):
        loss.backward()

    def step(self):
        self.optimizer.step()

    def zero_grad(self):
        self.optimizer.zero_grad()  # FSDP2's usual set_to_none=True

    def model_state_bytes(self):
        # Measured between step() and zero_grad(): sharded fp32 params + sharded grads + Adam.
        ps = list(self.model.parameters())
        return sum(local_bytes(p) + local_bytes(p.grad) for p in ps) + optimizer_bytes(self.optimizer)

    def close(self):
        self.counter.uninstall()
        del self.model, self.optimizer


class DeepSpeedSystem(_EngineDriven, _CountsCollectives):
    def __init__(self, args, world_size, stage):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed

        self.model = build_model(args)
        self.psi = trainable_numel(self.model)
        # Installed before deepspeed.initialize: DeepSpeed looks its collectives up once.
        self.counter = CollectiveCounter().install()
        optimizer = make_optimizer(self.model.parameters(), args)
        config = {
            "train_micro_batch_size_per_gpu": args.micro_batch,
            "gradient_accumulation_steps": 1,
            # Buckets and thresholds as zero_strategy's defaults (ZeroConfig): DeepSpeed's
            # own 5e8-element buckets would allocate a 2 GB gradient buffer for any model.
            "zero_optimization": {
                "stage": stage,
                "overlap_comm": True,
                "contiguous_gradients": True,
                "reduce_bucket_size": 5_000_000,
                "allgather_bucket_size": 25_000_000,
                "stage3_prefetch_bucket_size": 50_000_000,
                "stage3_param_persistence_threshold": 100_000,
            },
            "zero_allow_untested_optimizer": True,  # torch.optim.AdamW, as for every system
            "bf16": {"enabled": args.precision == "bf16"},
            "steps_per_print": 10 ** 9,
            "wall_clock_breakdown": False,
        }
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=self.model, optimizer=optimizer, config=config, dist_init_required=False)

    def forward(self, x):
        return self.engine(input_ids=x, labels=x).loss

    def model_state_bytes(self):
        return None  # no public accounting: the harness reports resident tensor bytes instead

    def close(self):
        self.counter.uninstall()
        try:
            self.engine.destroy()
        except Exception:  # noqa: BLE001 - older releases have no destroy()
            pass
        del self.engine, self.model, self.optimizer


def make_system(name, args, world_size):
    if name == "ddp":
        return DDPSystem(args, world_size)
    if name in ZERO_SYSTEMS:
        return ZeroSystem(args, world_size, int(name[-1]))
    if name in FSDP_SYSTEMS:
        return FSDP2System(args, world_size, reshard_after_forward=name.endswith("3"))
    if name in DS_SYSTEMS:
        return DeepSpeedSystem(args, world_size, int(name[-1]))
    raise ValueError(f"unknown system {name!r}; known: {', '.join(ALL_SYSTEMS)}")


# ---------------------------------------------------------------------------------------
# memory probes
# ---------------------------------------------------------------------------------------
def malloc_trim():
    """Hand freed heap pages back to the OS so RSS follows live memory (glibc only)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except Exception:  # noqa: BLE001
        pass


def _proc_status_kb(key):
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def rss_bytes():
    return _proc_status_kb("VmRSS")


def reset_peak_rss() -> bool:
    """Linux: writing 5 to clear_refs resets VmHWM (peak RSS) to the current RSS."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes():
    return _proc_status_kb("VmHWM")


def profiled_step(fn):
    """Run ``fn()`` under the profiler's memory tracking; return (result, peak bytes
    allocated above the level at the start, seconds).  Every CPU allocation and free made
    through torch's allocator is an event; the running sum's maximum is the peak."""
    from torch.profiler import ProfilerActivity, profile

    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = prof.profiler.kineto_results.events()
    mem = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    running = peak = 0
    for _, nbytes in mem:
        running += nbytes
        peak = max(peak, running)
    return out, peak, time.perf_counter() - t0
