"""ZeRO settings as one validated, immutable value.

Every entry point (plain PyTorch, Lightning, Accelerate, the Trainer, the CLI) goes
through `ZeroConfig.coerce`, so a typo or an out-of-range number fails here, once,
with a message that says what is allowed -- not deep inside a collective call.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import numbers
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, NamedTuple, Optional, Union

PRECISIONS = ("fp32", "bf16", "fp16")

# Spellings used by Lightning, Accelerate and torch, so a user can paste what they
# already have in another framework's config.
_PRECISION_ALIASES = {
    "fp32": "fp32", "32": "fp32", "float32": "fp32",
    "bf16": "bf16", "bf16-mixed": "bf16", "bfloat16": "bf16",
    "fp16": "fp16", "16": "fp16", "16-mixed": "fp16", "fp16-mixed": "fp16", "float16": "fp16",
}

# Integer fields: name -> (minimum, maximum or None, what the number means).
_INT_RULES = {
    "stage": (0, 3, "0 = replicate like DDP, 1 = shard optimizer state, 2 = + gradients, "
                    "3 = + parameters"),
    "reduce_bucket_size": (1, None, "elements per gradient-reduction bucket"),
    "allgather_bucket_size": (1, None, "elements per parameter all-gather bucket"),
    "prefetch_bucket_size": (0, None, "elements to prefetch; 0 disables prefetch"),
    "param_persistence_threshold": (0, None, "elements; smaller stage-3 params stay whole"),
    "keep_gathered_max_bytes": (0, None, "bytes of stage-3 parameters keep_gathered() may hold gathered; 0 = never"),
    "min_gather_numel": (0, None, "elements; smaller sibling stage-3 unit modules are gathered together"),
    "initial_scale_power": (0, 64, "the dynamic loss scale starts at 2**initial_scale_power"),
    "loss_scale_window": (1, None, "steps without overflow before the scale doubles"),
    "hysteresis": (1, None, "overflows tolerated before the scale is lowered"),
    "nvme_inflight_bytes": (1, None, "bytes of disk-offloaded state in memory during step()"),
    "quantization_block_size": (8, None, "elements per quantization block, one fp32 scale each"),
}

MIN_COLLECTIVE_TIMEOUT = 0.1  # seconds: shorter waits fail healthy collectives
MAX_COLLECTIVE_TIMEOUT = 1e7  # seconds (about 115 days): some backends overflow beyond
# Gradients are unscaled by multiplying with 1/scale in fp32: a scale outside fp32's normal
# range makes that factor (or the scaled loss) infinite, and every gradient NaN.
SMALLEST_LOSS_SCALE = 2.0 ** -126
LARGEST_LOSS_SCALE = 2.0 ** 126


class FloatRule(NamedTuple):
    low: float  # the smallest value allowed (or, when not inclusive, the bound it must exceed)
    inclusive: bool
    meaning: str
    smallest_positive: Optional[float] = None  # for fields where 0 means "off": the least other value
    highest: Optional[float] = None


_FLOAT_RULES = {
    "loss_scale": FloatRule(0.0, True, "0 = dynamic loss scaling, > 0 = static scale; a static scale must "
                            "lie in fp32's normal range, since gradients are unscaled by 1/scale in fp32",
                            smallest_positive=SMALLEST_LOSS_SCALE, highest=LARGEST_LOSS_SCALE),
    "min_loss_scale": FloatRule(SMALLEST_LOSS_SCALE, True,
                                "the dynamic loss scale never drops below this; below fp32's normal range "
                                "1/scale is infinite and every unscaled gradient NaN"),
    "gradient_clipping": FloatRule(0.0, True, "0 = off, else the max global gradient norm"),
    "collective_timeout": FloatRule(MIN_COLLECTIVE_TIMEOUT, True,
                                    "seconds a collective may wait for the other ranks; a shorter wait fails "
                                    "healthy collectives, and below a microsecond some backends read it as no "
                                    "timeout at all; for no practical limit use a large value, at most 1e7",
                                    highest=MAX_COLLECTIVE_TIMEOUT),
}

_MIN_LOSS_SCALE_POLICIES = ("raise", "skip")


def canonical_precision(value: Any, name: str = "precision") -> str:
    """Map a precision spelling ("16-mixed", "bfloat16", 32, ...) to fp32/bf16/fp16."""
    # Lightning accepts precision=32 / 16 as ints; bools are ints too but never meant.
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        value = str(int(value)) if abs(int(value)) < 10**6 else "out of range"
    if isinstance(value, str) and value.strip().lower() in _PRECISION_ALIASES:
        return _PRECISION_ALIASES[value.strip().lower()]
    raise ValueError(
        f"{name} must be one of {', '.join(PRECISIONS)} "
        f"(aliases: {', '.join(sorted(set(_PRECISION_ALIASES) - set(PRECISIONS)))}), "
        f"got {value!r}"
    )


_LARGEST = 2**62  # no size, count or power here is meaningful beyond this


def _type_error(name: str, value: Any, expected: str) -> ValueError:
    try:
        shown = repr(value)
    except ValueError:  # e.g. an int too long to format
        shown = "<a value too large to print>"
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return ValueError(f"ZeroConfig.{name} must be {expected}, got {shown} ({type(value).__name__})")


def _bounded(name: str, value: int) -> int:
    if abs(value) > _LARGEST:
        raise ValueError(f"ZeroConfig.{name} is out of range: its magnitude must be at most 2**62")
    return value


def _as_int(name: str, value: Any) -> int:
    """Accept ints, whole floats (5e8 from JSON) and numeric strings (PyYAML reads 5e8
    as the string "5e8"); anything else is a ValueError naming the field."""
    expected = "an integer"
    if isinstance(value, bool):  # True would silently become 1
        raise _type_error(name, value, expected)
    if isinstance(value, numbers.Integral):
        return _bounded(name, int(value))
    if isinstance(value, str):
        text = value.strip()
        try:
            return _bounded(name, int(text))
        except ValueError as exc:
            if "out of range" in str(exc):
                raise
        try:
            value = float(text)
        except ValueError:
            raise _type_error(name, value, expected) from None
    if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral):
        value = float(value)  # numpy scalars too: nan/inf are caught below, not by int()
    if isinstance(value, float):
        if math.isfinite(value) and value.is_integer():
            return _bounded(name, int(value))
        raise _type_error(name, value, expected)
    if isinstance(value, numbers.Real) and int(value) == value:
        return int(value)
    raise _type_error(name, value, expected)


def _as_float(name: str, value: Any) -> float:
    expected = "a finite number"
    if isinstance(value, bool):
        raise _type_error(name, value, expected)
    try:
        if isinstance(value, str):
            result = float(value.strip())
        elif isinstance(value, numbers.Real):
            result = float(value)
        else:
            raise _type_error(name, value, expected)
    except (ValueError, OverflowError):
        raise _type_error(name, value, expected) from None
    if not math.isfinite(result):
        raise _type_error(name, value, expected)
    return result


def _as_method_names(value: Any, name: str = "keep_gathered_methods") -> tuple:
    if value is None or value is False or (isinstance(value, (str, list, tuple)) and not value):
        return ()
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v.strip().isidentifier() for v in value):
        raise _type_error(name, value, "a list of method names (Python identifiers), e.g. ['generate'], or [] for none")
    return tuple(dict.fromkeys(v.strip() for v in value))  # without repeats, in the given order


def _as_class_names(value: Any, name: str = "elementwise_optimizers") -> tuple:
    if value is None or value is False or (isinstance(value, (str, list, tuple)) and not value):
        return ()
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v.strip().isidentifier() for v in value):
        raise _type_error(name, value, "a list of optimizer class names, e.g. ['MyAdam'], or [] for none")
    return tuple(dict.fromkeys(v.strip() for v in value))


def _as_unit_modules(value: Any, name: str = "unit_modules") -> tuple:
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, (list, tuple)):
        raise _type_error(name, value, "a class name or a list of class names")
    if not value or not all(isinstance(v, str) and v.strip() for v in value):
        raise _type_error(name, value, "a non-empty list of non-empty class names")
    result = tuple(v.strip() for v in value)
    # "auto" picks the units itself; mixing it with explicit names has no clear meaning.
    if "auto" in result and len(result) > 1:
        raise ValueError(
            f"ZeroConfig.{name}: 'auto' must be used alone, got {list(result)!r}"
        )
    return result


@dataclass(frozen=True)
class ZeroConfig:
    """How ZeRO partitions model states and how it communicates them.

    Sizes are in elements, not bytes, so one setting means the same amount of
    work whatever the dtype.
    """

    stage: int = 2
    """0 = replicate everything like DDP, 1 = partition optimizer state and the fp32
    master copy (P_os), 2 = also partition gradients (P_os+g), 3 = also partition
    parameters (P_os+g+p). Allowed: 0..3."""

    precision: str = "fp32"
    """Dtype of the parameters used in forward/backward: "fp32", "bf16" or "fp16".
    Aliases such as "bf16-mixed", "16-mixed", "float16" or "32" are normalised."""

    reduce_dtype: Optional[str] = None
    """Dtype gradients are reduced in; None = the same as `precision` (fp32 with
    `autocast`). Reducing in fp32 while computing in bf16 trades bandwidth for accuracy
    of the sum."""

    autocast: bool = False
    """False: bf16/fp16 `precision` computes with 16-bit copies of the parameters next
    to fp32 master weights (DeepSpeed's and FSDP2's mixed precision; the least memory
    and communication). True: parameters, gradients and collectives stay fp32 and the
    model's forward runs under ``torch.autocast`` in `precision`'s dtype (what stock
    Accelerate and Lightning do with ``mixed_precision``: the same numbers as their
    autocast training, at fp32's memory and all-gather bytes). fp16 scales the loss
    either way. With `precision` fp32 there is nothing to autocast: plain fp32 (so a
    framework's precision flag can decide, as Lightning's and Accelerate's do)."""

    reduce_bucket_size: int = 5_000_000
    """Elements of gradients gathered into one reduce(-scatter) call (>= 1). Bigger
    buckets mean fewer, more efficient calls but more memory held by the buffers, and
    fewer chances to overlap with backward (the default, 20 MB of fp32, is about DDP's)."""

    allgather_bucket_size: int = 25_000_000
    """Elements of updated parameters gathered in one all-gather call after step() (>= 1)."""

    overlap_comm: bool = True
    """Launch gradient reductions during backward instead of after it, hiding
    communication behind computation at the cost of one more bucket of memory."""

    no_sync_reduces: bool = True
    """Stages 2-3: whether a backward inside no_sync() still reduce-scatters its gradients.
    True: each micro-batch is reduced as it is produced and only this rank's slice is
    kept (the paper's memory, as DeepSpeed does; no_sync() saves no communication there).
    False: inside no_sync() the gradients stay whole and local in .grad, summed over the
    micro-batches as under DDP and FSDP2, and the first backward outside no_sync()
    reduces their sum once: one reduce-scatter per step instead of one per micro-batch,
    for whole gradients (Ψ elements in the compute dtype) held while accumulating.
    Stages 0-1 always keep local gradients inside no_sync()."""

    step_clears_gradients: bool = True
    """Whether step() ends by clearing the gradients (True, as DeepSpeed's engine.step()
    does) or leaves them, readable through .grad, until zero_grad() (False, as torch's
    optimizers and DDP do; a backward before zero_grad() then adds to them). The
    Lightning and Accelerate integrations default to False: those frameworks call
    zero_grad() themselves."""

    prefetch_bucket_size: int = 5_000_000
    """Stage 3: elements of parameters gathered ahead of the module that needs them
    (>= 0; 0 disables prefetch). The next module is always prefetched (when > 0), more
    only while they fit, so the default keeps one block ahead for most models, as
    FSDP2 does; raise it to hide more latency at the cost of memory."""

    param_persistence_threshold: int = 100_000
    """Stage 3: parameters with fewer elements than this stay whole on every rank, since
    gathering many tiny tensors costs more in latency than it saves in memory (>= 0)."""

    unit_modules: tuple = ("auto",)
    """Stage 3: class names of the modules whose parameters are gathered together, e.g.
    ("GPT2Block",). ("auto",) = the blocks the model declares (transformers'
    _no_split_modules), else its outermost repeated module classes."""

    min_gather_numel: int = 1_000_000
    """Stage 3: consecutive sibling unit modules (e.g. the layers of one ModuleList) are
    gathered together until one gather holds at least this many elements (>= 0; 0 = one
    gather per unit module). Every collective has a fixed latency, so a model of many
    small blocks spends its step in latency; blocks of real models (millions of elements
    each) are left alone, and the extra memory held is below one such gather. A whole
    model smaller than this is gathered as one unit."""

    keep_gathered_methods: tuple = ("generate",)
    """Stage 3: names of model methods that run inside engine.keep_gathered(), on the
    model and on every submodule that has them (e.g. transformers' generate, which
    otherwise gathers every layer again for each new token). () = none."""

    keep_gathered_max_bytes: int = 4 * 2**30
    """Stage 3: the most bytes engine.keep_gathered() may hold, counted as every partitioned
    parameter gathered in the compute dtype (bytes, not elements: this bounds memory). A
    larger model is gathered layer by layer as usual, with a one-time warning (>= 0; 0 =
    never keep gathered, no warning)."""

    exact_frozen_weights: bool = True
    """bf16/fp16: parameters without an optimizer (frozen, or no optimizer at all) keep
    an fp32 copy of this rank's slice, so state dicts and checkpoints give back exactly
    the values that were loaded. False keeps them only in the compute dtype (rounded),
    saving 4 bytes per frozen parameter / N (stages 1-3) or 4 bytes (stage 0)."""

    loss_scale: float = 0.0
    """fp16 only: 0 = dynamic loss scaling, > 0 = a static scale applied to every loss,
    between 2**-126 and 2**126 (gradients are unscaled by 1/scale in fp32, which must
    stay finite)."""

    initial_scale_power: int = 16
    """fp16 dynamic scaling starts at 2**initial_scale_power (0..64)."""

    loss_scale_window: int = 1000
    """fp16 dynamic scaling: steps without overflow before the scale doubles (>= 1)."""

    hysteresis: int = 2
    """fp16 dynamic scaling: overflows tolerated before the scale is lowered (>= 1)."""

    min_loss_scale: float = 1.0
    """fp16 dynamic scaling never lowers the scale below this (at least 2**-126, for the
    same reason)."""

    gradient_clipping: float = 0.0
    """Clip the global gradient norm to this in step() (>= 0; 0 = off). Done by ZeRO
    itself because with partitioned gradients no rank sees the whole norm."""

    offload_optimizer: str = "none"
    """ZeRO-Offload: "cpu" keeps the fp32 master shard and the optimizer state in host
    memory (pinned on CUDA) and runs the optimizer step there; "nvme" keeps them in files
    under `nvme_path` (ZeRO-Infinity), read ahead and written back unit by unit around a
    host step; "none" keeps them on the training device."""

    host_optimizer_step: str = "fused"
    """With offload_optimizer "cpu" or "nvme": how the host step runs. "fused" steps each
    unit's flat fp32 buffers with torch's fused CPU kernel when the optimizer is exactly
    torch's Adam, AdamW, SGD or Adagrad (and its group does not set fused=False,
    differentiable or capturable); "optimizer" always calls the optimizer's own step()
    over one tensor per parameter piece."""

    elementwise_optimizers: tuple = ()
    """Class names (``type(opt).__name__``) of optimizers of yours that update every
    element from that element's gradient and state alone (as Adam does), so that they
    may be handed flat shard pieces. Every other optimizer class outside torch's built-in
    per-element ones gets whole parameters ([Note: whole-parameter optimizers] in
    whole_params.py): correct for Adafactor, Muon, LAMB and the like, at some extra
    communication. Declaring a shape-aware optimizer here makes its update wrong."""

    offload_param: str = "none"
    """Stage 3 with offload_optimizer "nvme": "nvme" also keeps this rank's 16-bit
    parameter shards in files under `nvme_path` (read for each all-gather); "none" keeps
    them in memory."""

    nvme_path: Optional[str] = None
    """The directory for disk offload (needed by "nvme" offload, refused otherwise). Each
    rank creates its own subdirectory there and removes it when the engine is closed or
    garbage-collected; nothing else in the directory is touched."""

    nvme_inflight_bytes: int = 256 * 2**20
    """Disk offload: the most bytes of fp32 master and optimizer state held in memory
    during step() at once -- the unit being updated, the ones read ahead and the ones
    still being written back (bytes, not elements: this bounds disk traffic; >= 1). One
    unit is always allowed, however large; more overlaps disk I/O with the update."""

    activation_checkpointing: tuple = ()
    """ZeRO-R: class names of the blocks whose activations are recomputed in backward
    instead of stored (e.g. ("GPT2Block",)); ("auto",) = the largest repeated module
    class; () = off."""

    offload_activations: bool = False
    """ZeRO-R P_a+cpu: move the activation checkpoints (block inputs) to host memory
    between forward and backward. Needs activation_checkpointing."""

    ranks_per_node: Optional[int] = None
    """Ranks per node (consecutive global ranks share a node). None = what the launcher
    says (torchrun's LOCAL_WORLD_SIZE, Slurm's SLURM_NTASKS_PER_NODE, Lightning's
    num_nodes), else one node. Set it to simulate nodes on one host, or where a launcher
    says nothing. Decides which traffic comm_report() counts as cross-node and which
    ranks `secondary_partition` and `gradient_quantization` group together."""

    secondary_partition: Optional[str] = None
    """Stage 3, ZeRO++'s hpZ: "node" keeps, from each unit's forward until its backward,
    a second partition of its 16-bit parameters across the ranks of this node only
    (1/ranks_per_node of the unit per rank), so backward's all-gather never leaves the
    node. Costs that much memory per unit between forward and backward; None = off."""

    weight_quantization: Optional[str] = None
    """Stage 3, ZeRO++'s qwZ: "int8" sends parameters in training all-gathers as
    block-quantized int8 with one fp32 scale per `quantization_block_size` elements
    (8.125 bits per element at 256), dequantized alike on every rank (this rank's own
    chunk too, so every rank computes with the same weights). The fp32 masters, state
    dicts, checkpoints, evaluation (no-grad) forwards and gathered_parameters() stay
    exact. None = off."""

    gradient_quantization: Optional[str] = None
    """Stages 2-3, ZeRO++'s qgZ: "int8" or "int4" reduces gradients in two levels: a
    full-precision reduce-scatter inside each node, then an all-to-all of block-quantized
    pieces between the ranks with the same local rank on every node, dequantized and
    summed in fp32. Only cross-node bytes shrink; needs more than one node (see
    `ranks_per_node`). No error feedback. None = off."""

    quantization_block_size: int = 256
    """Elements per quantization block (one fp32 scale each) for `weight_quantization`
    and `gradient_quantization` (>= 8). Smaller blocks: smaller error, more scale bytes."""

    collective_timeout: float = 600.0
    """Seconds any ZeRO collective may wait for the other ranks (at least 0.1). When it runs out,
    or a peer dies, every rank raises CollectiveError saying which collective (module,
    step) each rank was in, instead of hanging. Bounded on gloo; on NCCL the process
    group's own timeout and watchdog apply."""

    check_call_order: bool = False
    """Debug: before every collective the ranks compare what they are about to do, so the
    first call where they diverge (a module run on some ranks only) fails on every rank
    with each rank's module named. Costs one tiny all-gather per collective."""

    on_min_loss_scale: str = "raise"
    """fp16: what happens when a step overflows while the dynamic scale is already at
    min_loss_scale: "raise" stops with FloatingPointError naming the parameters whose
    gradients overflowed; "skip" keeps skipping such steps."""

    check_finite_loss: bool = False
    """Stop with FloatingPointError (naming the step) when the loss given to backward()
    is NaN or infinite on any rank. Costs one host sync per backward."""

    def __post_init__(self) -> None:
        # Frozen dataclass: normalised values have to be written with object.__setattr__.
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        for name, (low, high, meaning) in _INT_RULES.items():
            value = _as_int(name, getattr(self, name))
            if value < low or (high is not None and value > high):
                allowed = f"between {low} and {high}" if high is not None else f">= {low}"
                raise ValueError(f"ZeroConfig.{name} must be {allowed} ({meaning}), got {value}")
            put(name, value)

        for name, rule in _FLOAT_RULES.items():
            value = _as_float(name, getattr(self, name))
            too_low = value < rule.low or (value == rule.low and not rule.inclusive)
            if rule.smallest_positive is not None and 0 < value < rule.smallest_positive:
                too_low = True
            if too_low or (rule.highest is not None and value > rule.highest):
                allowed = f"{'>=' if rule.inclusive else '>'} {rule.low:g}"
                if rule.smallest_positive is not None:
                    allowed = f"{rule.low:g} or >= {rule.smallest_positive:g}"
                if rule.highest is not None:
                    allowed += f" and at most {rule.highest:g}"
                raise ValueError(f"ZeroConfig.{name} must be {allowed} ({rule.meaning}), got {value:g}")
            put(name, value)

        put("precision", canonical_precision(self.precision, "ZeroConfig.precision"))
        if self.reduce_dtype is not None:
            put("reduce_dtype", canonical_precision(self.reduce_dtype, "ZeroConfig.reduce_dtype"))
        if not isinstance(self.overlap_comm, bool):
            raise _type_error("overlap_comm", self.overlap_comm, "true or false")
        put("unit_modules", _as_unit_modules(self.unit_modules))
        put("keep_gathered_methods", _as_method_names(self.keep_gathered_methods))
        if self.host_optimizer_step not in ("fused", "optimizer"):
            raise ValueError(f"ZeroConfig.host_optimizer_step must be 'fused' or 'optimizer', got {self.host_optimizer_step!r}")
        put("elementwise_optimizers", _as_class_names(self.elementwise_optimizers))
        _check_offload(self)
        ac = self.activation_checkpointing
        if ac in (None, False, "", (), []):
            put("activation_checkpointing", ())
        else:
            put("activation_checkpointing", _as_unit_modules(ac, "activation_checkpointing"))
        for flag in ("autocast", "offload_activations", "check_call_order", "check_finite_loss", "exact_frozen_weights",
                     "no_sync_reduces", "step_clears_gradients"):
            if not isinstance(getattr(self, flag), bool):
                raise _type_error(flag, getattr(self, flag), "true or false")
        if self.on_min_loss_scale not in _MIN_LOSS_SCALE_POLICIES:
            raise ValueError(
                f"ZeroConfig.on_min_loss_scale must be one of {', '.join(map(repr, _MIN_LOSS_SCALE_POLICIES))}, "
                f"got {self.on_min_loss_scale!r}"
            )
        _check_multi_node(self)
        if self.offload_activations and not self.activation_checkpointing:
            raise ValueError(
                "ZeroConfig.offload_activations needs activation_checkpointing (the checkpoints are what is "
                "offloaded): set activation_checkpointing to block class names or ['auto']"
            )

    # -- construction -----------------------------------------------------------------

    def replace(self, **changes: Any) -> "ZeroConfig":
        """A validated copy with `changes` applied (unknown names get a suggestion)."""
        return ZeroConfig.from_dict({**self.to_dict(), **changes})

    def to_dict(self) -> dict:
        """Plain JSON/YAML-safe values; `from_dict(to_dict())` gives an equal config."""
        result = dataclasses.asdict(self)
        result["unit_modules"] = list(self.unit_modules)  # yaml.safe_dump rejects tuples
        result["activation_checkpointing"] = list(self.activation_checkpointing)
        result["keep_gathered_methods"] = list(self.keep_gathered_methods)
        result["elementwise_optimizers"] = list(self.elementwise_optimizers)
        return result

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ZeroConfig":
        if not isinstance(data, Mapping):
            raise ValueError(
                f"a ZeroConfig must be built from a mapping of field names to values, "
                f"got {type(data).__name__}"
            )
        valid = [f.name for f in dataclasses.fields(cls)]
        for key in data:
            if key not in valid:
                raise ValueError(_unknown_key_message(key, valid))
        return cls(**data)

    @classmethod
    def from_file(cls, path: Union[str, os.PathLike]) -> "ZeroConfig":
        """Read a .json, .yaml or .yml file whose top level maps field names to values."""
        path = Path(path)
        suffix = path.suffix.lower()
        if suffix not in (".json", ".yaml", ".yml"):
            raise ValueError(
                f"cannot read ZeroConfig from {str(path)!r}: unsupported file type "
                f"{suffix or '(no suffix)'!r}; use .json, .yaml or .yml"
            )
        if not path.is_file():
            raise FileNotFoundError(f"ZeroConfig file not found: {str(path)!r}")
        text = path.read_text(encoding="utf-8")
        try:
            if suffix == ".json":
                data = json.loads(text)
            else:
                import yaml  # only needed for YAML files

                data = yaml.safe_load(text)
        except Exception as exc:  # JSON and YAML raise unrelated types
            raise ValueError(f"cannot parse ZeroConfig file {str(path)!r}: {exc}") from exc
        if not isinstance(data, Mapping):
            raise ValueError(
                f"ZeroConfig file {str(path)!r} must contain a mapping of field names to "
                f"values at the top level, got {type(data).__name__}"
            )
        try:
            return cls.from_dict(data)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from exc

    @classmethod
    def coerce(cls, value: Union[None, "ZeroConfig", Mapping, str, os.PathLike]) -> "ZeroConfig":
        """The one way other modules turn user input into a ZeroConfig."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            return cls.from_dict(value)
        if isinstance(value, (str, os.PathLike)):
            return cls.from_file(value)
        raise TypeError(
            "expected None, a ZeroConfig, a dict or a path to a .json/.yaml file, "
            f"got {type(value).__name__}"
        )


def _check_offload(config: "ZeroConfig") -> None:
    """offload_optimizer / offload_param / nvme_path: values, and the combinations that work."""
    opt, param, path = config.offload_optimizer, config.offload_param, config.nvme_path
    if opt not in ("none", "cpu", "nvme"):
        raise ValueError(f"ZeroConfig.offload_optimizer must be 'none', 'cpu' or 'nvme', got {opt!r}")
    if param not in ("none", "nvme"):
        hint = (" (with 'cpu' the 16-bit parameters stay where they are computed; parameter offload is "
                "to disk only: 'nvme')") if param == "cpu" else ""
        raise ValueError(f"ZeroConfig.offload_param must be 'none' or 'nvme', got {param!r}{hint}")
    if opt != "none" and config.stage == 0:
        raise ValueError(f"ZeroConfig.offload_optimizer={opt!r} needs stage 1, 2 or 3 (stage 0 keeps a full "
                         "replica of everything)")
    if param == "nvme" and (config.stage != 3 or opt != "nvme"):
        raise ValueError("ZeroConfig.offload_param='nvme' needs stage 3 (only stage 3 partitions parameters) and "
                         f"offload_optimizer='nvme' (got stage {config.stage}, offload_optimizer={opt!r})")
    uses_disk = "nvme" in (opt, param)
    if path is not None and (not isinstance(path, (str, os.PathLike)) or not str(path).strip()):
        raise _type_error("nvme_path", path, "a directory path")
    if uses_disk and path is None:
        raise ValueError("ZeroConfig.offload_optimizer='nvme' needs nvme_path, the directory (on a fast local disk) "
                         "where each rank keeps its offload files, e.g. nvme_path='/local_nvme/zero_offload'")
    if path is not None and not uses_disk:
        raise ValueError(f"ZeroConfig.nvme_path={str(path)!r} is only used by disk offload: set "
                         "offload_optimizer='nvme' (and at stage 3 optionally offload_param='nvme'), or drop nvme_path")
    if path is not None:
        object.__setattr__(config, "nvme_path", os.fspath(path))


def _check_multi_node(config: "ZeroConfig") -> None:
    """ranks_per_node and ZeRO++'s three options: values, and the stages they need."""
    if config.ranks_per_node is not None:
        value = _as_int("ranks_per_node", config.ranks_per_node)
        if value < 1:
            raise ValueError(f"ZeroConfig.ranks_per_node must be >= 1 or None (from the launcher), got {value}")
        object.__setattr__(config, "ranks_per_node", value)
    choices = {"secondary_partition": ("node",), "weight_quantization": ("int8",),
               "gradient_quantization": ("int8", "int4")}
    for name, allowed in choices.items():
        value = getattr(config, name)
        if value in ("none", "None", False, ""):
            object.__setattr__(config, name, None)
        elif value is not None and value not in allowed:
            raise ValueError(f"ZeroConfig.{name} must be None or one of {', '.join(map(repr, allowed))}, got {value!r}")
    for name in ("secondary_partition", "weight_quantization"):
        if getattr(config, name) is not None and config.stage != 3:
            raise ValueError(f"ZeroConfig.{name}={getattr(config, name)!r} needs stage 3 (only stage 3 gathers "
                             f"parameters), got stage {config.stage}")
    if config.gradient_quantization is not None and config.stage < 2:
        raise ValueError(f"ZeroConfig.gradient_quantization={config.gradient_quantization!r} needs stage 2 or 3 "
                         f"(a reduce-scatter of gradients), got stage {config.stage}")


def _unknown_key_message(key: Any, valid: list) -> str:
    close = difflib.get_close_matches(str(key), valid, n=1) if isinstance(key, str) else []
    if close:
        return f"unknown ZeroConfig key {key!r}; did you mean {close[0]!r}?"
    return f"unknown ZeroConfig key {key!r}; valid keys are {', '.join(valid)}"
