"""Partitioned ``from_pretrained`` for stage 3 (Accelerate's ``zero3_init_flag``, and
Lightning's ``configure_model``).

While active, ``PreTrainedModel.from_pretrained`` (and every
``AutoModel*.from_pretrained``, which ends there) no longer reads the whole checkpoint
in each process:

1. the keywords are checked: every keyword of the stock signature is accepted at its
   default value; a value this loader cannot honour (``state_dict=``, quantisation,
   a ``device_map`` that moves or splits the model, tensor parallelism, ...) raises
   :class:`UnsupportedArgument` naming it, on every rank alike, and so does a keyword
   that a newer transformers added, unless it is off (None or False);
2. the config is read as usual and the model is built inside
   :func:`zero_strategy.init_context`: its parameters live on the meta device (no memory;
   buffers are built normally);
3. which checkpoint tensor fills which parameter is decided now, by name, as the stock
   loader matches them (``output_loading_info=True`` returns that match, in the stock
   format), and kept on the model by object (:class:`~zero_strategy.materialize.CheckpointBinding`);
4. the integration that builds the engine passes :func:`sources_in` of the model to
   ``zero_strategy.initialize(pretrained=)``: each rank reads from the files only the
   slice of each tensor it keeps, and parameters missing from the files are initialised
   by the model's own initialiser with values that do not depend on the world size.

Between 3 and 4 the model can be moved (``model.to(device)``, which the Trainer does:
the meta parameters stay where they are and the engine places them) and wrapped (PEFT:
the binding follows the parameters, not their names; adapters keep the values PEFT
gives them).  If a checkpoint tensor has lost its parameter by then, or a parameter its
values, :func:`sources_in` raises, listing them.  Positional model arguments,
``use_safetensors=False`` and checkpoints with only ``pytorch_model.bin`` fall back to
the stock loader (whole model in every process) with a warning.

Who activates it: the Accelerate integration (``zero3_init_flag``, see
:mod:`zero_strategy.integrations.accelerate.loading`) and the Lightning strategies (around
``configure_model`` at stage 3).  This module imports transformers lazily.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import logging
import os
import re
import warnings
import weakref
from typing import Optional

SOURCE_ATTR = "_zero_strategy_pretrained_source"
"""Set on a model built partitioned: the folder its weights are loaded from."""
BINDING_ATTR = "_zero_strategy_binding"
"""Set on a model built partitioned: its :class:`zero_strategy.materialize.CheckpointBinding`."""

_log = logging.getLogger(__name__)
_active = False

# Every keyword of PreTrainedModel.from_pretrained (transformers 5.25, checked against the
# installed signature by tests/core/test_pretrained_kwargs.py), by what partitioned loading does
# with it.  Keywords not listed are config attributes, as for the stock loader, unless the
# installed loader reads them (a newer transformers): see check_arguments.
_HUB_KWARGS = ("cache_dir", "revision", "token", "local_files_only", "force_download", "proxies", "subfolder")
# The stock loader ignores these in 5.x (or they only steer how it reads files we do not
# read: pickles, its progress bar, its own loading path), so every value is accepted.
_IGNORED = ("low_cpu_mem_usage", "from_tf", "from_flax", "mirror", "_fast_init", "offload_state_dict",
            "_from_auto", "_from_pipeline", "_commit_hash", "user_agent", "trust_remote_code", "weights_only",
            "tqdm_class", "adapter_kwargs", "adapter_name")
# Keyword -> its stock default: any other value asks for something partitioned loading
# cannot do, and is refused with an error naming it.
_DEFAULT_ONLY = {
    "state_dict": None, "quantization_config": None, "gguf_file": None, "max_memory": None, "offload_folder": None,
    "offload_buffers": False, "variant": None, "distributed_config": None, "device_mesh": None, "tp_plan": None,
    "tp_size": None, "key_mapping": None, "fusion_config": None, "disable_mmap": None, "use_kernels": False,
    "kernel_config": None, "kernels_mode": None, "allow_all_kernels": False, "load_in_8bit": False, "load_in_4bit": False,
}
# Handled below: config, dtype / torch_dtype, attn_implementation, experts_implementation,
# device_map, use_safetensors, ignore_mismatched_sizes, output_loading_info, generation_config.
_HANDLED = ("config", "dtype", "torch_dtype", "attn_implementation", "experts_implementation", "device_map",
            "use_safetensors", "ignore_mismatched_sizes", "output_loading_info", "generation_config")
_WHY = {
    "state_dict": "the weights are read from the checkpoint's safetensors files, slice by slice",
    "quantization_config": "quantised weights cannot be partitioned by zero_strategy",
    "gguf_file": "only safetensors checkpoints are read",
    "max_memory": "placement is zero_strategy's: each process keeps 1/N of the model",
    "offload_folder": "parameter offload is not implemented",
    "offload_buffers": "parameter offload is not implemented",
    "variant": "only the default weights files (model.safetensors or its index) are read",
    "distributed_config": "tensor parallelism cannot be combined with ZeRO-3",
    "device_mesh": "tensor parallelism cannot be combined with ZeRO-3",
    "tp_plan": "tensor parallelism cannot be combined with ZeRO-3",
    "tp_size": "tensor parallelism cannot be combined with ZeRO-3",
    "key_mapping": "checkpoint keys are matched by name as saved",
    "fusion_config": "fused modules are not built by partitioned loading",
    "disable_mmap": "safetensors files are read through memory maps",
    "use_kernels": "hub kernels are not applied by partitioned loading",
    "kernel_config": "hub kernels are not applied by partitioned loading",
    "allow_all_kernels": "hub kernels are not applied by partitioned loading",
    "kernels_mode": "hub kernels are not applied by partitioned loading",
    "load_in_8bit": "quantised weights cannot be partitioned by zero_strategy",
    "load_in_4bit": "quantised weights cannot be partitioned by zero_strategy",
}

_TESTED_WITH = "5.25"


def stock_keywords(fn) -> frozenset:
    """Every keyword the installed ``from_pretrained`` reads: those in its signature and
    each ``kwargs.pop("name"...)`` in its body (how transformers 5.x takes most of them),
    with the "not used anymore" names it drops (the signature's alone where its source
    cannot be read)."""
    sig = inspect.signature(fn)
    names = {n for n, p in sig.parameters.items()
             if p.kind == p.KEYWORD_ONLY or (p.kind == p.POSITIONAL_OR_KEYWORD and n not in ("cls", "pretrained_model_name_or_path"))}
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):  # an install without sources: the signature is all there is
        return frozenset(names)
    names |= set(re.findall(r'kwargs\.pop\("(\w+)"', source))
    for listed in re.findall(r'for name in \[([^\]]*)\]', source):
        names |= set(re.findall(r'"(\w+)"', listed))
    return frozenset(names)


def _classified_keywords() -> frozenset:
    return frozenset((*_HUB_KWARGS, *_IGNORED, *_DEFAULT_ONLY, *_HANDLED))


@functools.lru_cache(maxsize=None)
def _unclassified_keywords(stock) -> frozenset:
    """Keywords of the installed loader with no rule here: a transformers newer than the
    one this module was checked against.  A config attribute of the same name is not
    one of them (the stock loader pops its own keywords before the config sees the rest)."""
    return stock_keywords(stock) - _classified_keywords()


# Modules awaiting their engine: while there is one, moving a module that holds values to
# the meta device keeps the values (see _to_keeping_values).
_awaiting = weakref.WeakSet()


class UnsupportedArgument(ValueError):
    """A from_pretrained keyword whose value partitioned loading cannot honour."""


def activate() -> None:
    """From now on (until :func:`deactivate`), ``from_pretrained`` builds partitioned."""
    global _active
    _patch()
    _active = True


def deactivate() -> None:
    global _active
    _active = False


@contextlib.contextmanager
def partitioned_loading():
    """Active inside (restores the previous state on exit)."""
    global _active
    previous = _active
    activate()
    try:
        yield
    finally:
        _active = previous


def _patch() -> None:
    from transformers import modeling_utils

    cls = modeling_utils.PreTrainedModel
    original = cls.__dict__["from_pretrained"]
    if getattr(original.__func__, "_zero_strategy", False):
        return
    stock = original.__func__

    def from_pretrained(klass, pretrained_model_name_or_path, *model_args, **kwargs):
        if not _active:
            return stock(klass, pretrained_model_name_or_path, *model_args, **kwargs)
        # Refused before anything is read, identically on every rank.
        check_arguments(kwargs)
        reason = _fallback_reason(pretrained_model_name_or_path, model_args, kwargs)
        folder = None if reason else _weights_folder(pretrained_model_name_or_path, kwargs)
        if folder is None:
            reason = reason or "no .safetensors weights were found"
            warnings.warn(
                f"zero3_init_flag: loading {pretrained_model_name_or_path!r} whole in every process ({reason}); "
                "it is partitioned by accelerator.prepare",
                stacklevel=2,
            )
            return stock(klass, pretrained_model_name_or_path, *model_args, **kwargs)
        return _build_partitioned(klass, pretrained_model_name_or_path, folder, kwargs)

    # The stock signature, docstring and source stay visible (help(), IDEs, and code
    # that inspects from_pretrained's keywords see the real ones).
    from_pretrained = functools.wraps(stock)(from_pretrained)
    from_pretrained._zero_strategy = True
    cls.from_pretrained = classmethod(from_pretrained)


def _short(value) -> str:
    """A value for an error message: a state dict is not printed whole."""
    text = repr(value)
    return text if len(text) <= 60 else f"<{type(value).__name__}>"


def _is_default(value, default) -> bool:
    # A switch that is off by default (False) is off at None too: the stock loader tests
    # it for truth, and its own default moves between the two (use_kernels is None in 5.25).
    if default is False and value is None:
        return True
    return value is None if default is None else (value is default or value == default)


def check_arguments(kwargs) -> None:
    """Raise :class:`UnsupportedArgument`, naming the keyword, for a value partitioned
    loading cannot honour; default values (``device_map=None``, ...) pass."""
    for key, default in _DEFAULT_ONLY.items():
        if key in kwargs and not _is_default(kwargs[key], default):
            raise UnsupportedArgument(
                f"zero3_init_flag: from_pretrained({key}={_short(kwargs[key])}) is not supported with partitioned loading "
                f"({_WHY[key]}); drop {key}= or load without zero3_init_flag"
            )
    # A keyword a newer transformers added: what it asks for is unknown here, so only
    # "off" passes (None / False, what callers that forward every keyword pass).
    for key in sorted(_unclassified_keywords(_stock_loader()) & kwargs.keys()):
        if not _is_default(kwargs[key], False):
            import transformers

            raise UnsupportedArgument(
                f"zero3_init_flag: from_pretrained({key}={_short(kwargs[key])}) is a keyword of transformers "
                f"{transformers.__version__} that partitioned loading has no rule for (it was checked against "
                f"transformers {_TESTED_WITH}); drop {key}= or load without zero3_init_flag"
            )
    _check_device_map(kwargs.get("device_map"))


def _stock_loader():
    """The stock ``from_pretrained`` function (ours wraps it once patched)."""
    from transformers import modeling_utils

    fn = modeling_utils.PreTrainedModel.__dict__["from_pretrained"].__func__
    return getattr(fn, "__wrapped__", fn) if getattr(fn, "_zero_strategy", False) else fn


_SPREADING = ("auto", "balanced", "balanced_low_0", "sequential")


def _check_device_map(device_map) -> None:
    """A device_map is accepted when it keeps the model whole on one device: prepare then
    places each rank's partition on the Accelerator's device, where Accelerate would
    have moved the stock-loaded model too.  A map that splits the model ("auto" and the
    other spreading strategies on a machine with GPUs, several devices, "disk") is
    refused: ZeRO-3 partitions the model across the processes itself (DeepSpeed's ZeRO-3
    refuses every device_map).  "auto" on a machine without GPUs means the CPU (TRL
    passes it there).  The rule gives the same answer on every rank."""
    if device_map is None:
        return
    import torch

    if isinstance(device_map, str) and device_map in _SPREADING:
        if not torch.cuda.is_available():
            return
        problem = "it spreads the model over this machine's GPUs"
    else:
        values = set(device_map.values()) if isinstance(device_map, dict) else {device_map}
        try:
            devices = {torch.device("cuda", v) if isinstance(v, int) else torch.device(v) for v in values}
        except (RuntimeError, TypeError, ValueError):
            devices = None
        if devices is not None and len(devices) == 1:
            return
        problem = "it splits the model over several devices (or the disk)"
    raise UnsupportedArgument(
        f"zero3_init_flag: from_pretrained(device_map={_short(device_map)}) is not supported: {problem}, while ZeRO-3 "
        "partitions the model across the processes itself; drop device_map= (or pass device_map=None)"
    )


def _fallback_reason(name, model_args, kwargs) -> Optional[str]:
    """Why the stock loader (whole model in every process, partitioned by prepare) must
    serve this call; None when partitioned loading can."""
    if model_args:
        return "positional model arguments were given"
    if kwargs.get("use_safetensors") is False:
        return "use_safetensors=False"
    if name is None:
        return "no checkpoint was named"
    return None


def _weights_folder(name, kwargs) -> Optional[str]:
    """The local folder holding the checkpoint's safetensors weights, or None."""
    subfolder = kwargs.get("subfolder") or ""
    if os.path.isdir(str(name)):
        folder = os.path.join(str(name), subfolder)
    elif os.path.isfile(str(name)):
        return None  # a single file: leave it to the stock loader
    else:
        try:
            from huggingface_hub import snapshot_download

            pattern = f"{subfolder}/" if subfolder else ""
            root = snapshot_download(
                str(name),
                revision=kwargs.get("revision"),
                cache_dir=kwargs.get("cache_dir"),
                token=kwargs.get("token"),
                local_files_only=bool(kwargs.get("local_files_only", False)),
                allow_patterns=[f"{pattern}*.json", f"{pattern}*.safetensors"],
            )
        except Exception as exc:  # no network, unknown repo, ...: the stock loader reports it
            _log.info("zero3_init_flag: could not resolve %r locally (%s)", name, exc)
            return None
        folder = os.path.join(root, subfolder)
    has_weights = os.path.isdir(folder) and any(f.endswith(".safetensors") for f in os.listdir(folder))
    return folder if has_weights else None


def _build_partitioned(klass, name, folder, kwargs):
    import zero_strategy
    from transformers import PretrainedConfig

    from zero_strategy.materialize import CheckpointBinding

    kwargs = dict(kwargs)
    hub = {k: kwargs.pop(k) for k in _HUB_KWARGS if k in kwargs}
    for key in (*_IGNORED, *_DEFAULT_ONLY, *_unclassified_keywords(_stock_loader()), "device_map", "use_safetensors"):
        kwargs.pop(key, None)  # checked by check_arguments / _fallback_reason
    output_loading_info = bool(kwargs.pop("output_loading_info", False))
    ignore_mismatched_sizes = bool(kwargs.pop("ignore_mismatched_sizes", False))
    generation_config = kwargs.pop("generation_config", None)
    experts = kwargs.pop("experts_implementation", None)
    build_kwargs = {k: kwargs.pop(k) for k in ("dtype", "torch_dtype", "attn_implementation") if k in kwargs}
    config = kwargs.pop("config", None)
    if not isinstance(config, PretrainedConfig):
        source = config if isinstance(config, (str, os.PathLike)) else name
        config, kwargs = klass.config_class.from_pretrained(source, return_unused_kwargs=True, **hub, **kwargs)
    else:
        config = copy.deepcopy(config)  # as the stock loader: the caller's config is not modified
        for key in list(kwargs):
            if hasattr(config, key):
                setattr(config, key, kwargs.pop(key))
    if kwargs:
        raise TypeError(f"from_pretrained got arguments that are neither config attributes nor loading options: {sorted(kwargs)}")
    # As the stock loader: model.name_or_path / config._name_or_path name the source,
    # which TRL's trainers read to load the tokenizer of a model passed by name.
    config.name_or_path = name
    if experts is not None:
        config._experts_implementation = experts
    dtype = build_kwargs.pop("dtype", None)
    torch_dtype = build_kwargs.pop("torch_dtype", None)
    dtype = dtype if dtype is not None else torch_dtype
    if dtype is None or dtype == "auto":
        # transformers 5.x: None means "auto", the checkpoint's own dtype.
        dtype = _checkpoint_dtype(config, folder)
    elif isinstance(dtype, str):  # "bfloat16", as the stock loader accepts it
        import torch

        dtype = getattr(torch, dtype)
    if dtype is not None:
        build_kwargs["dtype"] = dtype
    with zero_strategy.init_context(record=False):  # every value comes from the checkpoint (or its initialiser)
        model = klass._from_config(config, **build_kwargs)
    # Which file tensor fills which parameter is decided now, by the names the stock
    # loader would match, and kept by object: wrappers added before prepare (PEFT) may
    # rename modules.  A shape mismatch is an error here unless ignore_mismatched_sizes.
    binding = CheckpointBinding(model, folder, ignore_mismatched_sizes=ignore_mismatched_sizes,
                                ignore_unexpected=klass._keys_to_ignore_on_load_unexpected or (),
                                ignore_missing=klass._keys_to_ignore_on_load_missing or ())
    zero_strategy.keep_meta_on_moves(model)
    model.eval()  # as the stock loader returns it
    _load_generation_config(model, folder)
    if generation_config is not None and hasattr(model, "generation_config"):
        model.generation_config = generation_config
    setattr(model, SOURCE_ATTR, folder)
    setattr(model, BINDING_ATTR, binding)
    _awaiting.add(model)
    _install_meta_guard()
    if output_loading_info:
        return model, binding.loading_info()
    return model


def _checkpoint_dtype(config, folder):
    """What the stock loader's ``dtype="auto"`` picks: the config's ``dtype``, else the
    dtype of the first floating-point tensor in the files (read from their headers)."""
    import torch

    value = getattr(config, "dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value, None)
    if isinstance(value, torch.dtype):
        return value if value.is_floating_point else None
    from safetensors import safe_open

    from zero_strategy.materialize import weight_files

    names = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
    for key, file in sorted(weight_files(folder).items()):
        with safe_open(str(file), framework="pt") as h:
            found = names.get(h.get_slice(key).get_dtype())
        if found is not None:
            return found
    return None


def _load_generation_config(model, folder) -> None:
    if not os.path.exists(os.path.join(folder, "generation_config.json")) or not hasattr(model, "generation_config"):
        return
    try:
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(folder)
    except (OSError, ValueError) as exc:
        _log.warning("zero3_init_flag: generation_config.json in %s not loaded: %s", folder, exc)


def _install_meta_guard() -> None:
    """While a partitioned model awaits its engine, ``module.to("meta")`` on a module that
    holds values keeps them (a dtype in the same call is still applied).

    Wrappers place what they add on the device of the weights they wrap: PEFT builds
    and initialises its LoRA matrices, then moves them to the base layer's device, which
    is 'meta' here.  Values moved to meta are gone, and would have to be invented at
    prepare.  Kept where they are (they are small), they are partitioned by prepare with
    the values the wrapper gave them."""
    import torch.nn as nn

    if getattr(nn.Module.to, "_zero_strategy", False):
        return
    original = nn.Module.to

    def to(self, *args, **kwargs):
        if len(_awaiting):
            import torch

            device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
            if device is not None and device.type == "meta" and any(not t.is_meta for t in self.parameters()):
                _log.debug("zero3_init_flag: %s keeps its values instead of moving to 'meta'", type(self).__name__)
                return original(self, dtype=dtype, non_blocking=non_blocking) if dtype is not None else self
        return original(self, *args, **kwargs)

    to._zero_strategy = True
    nn.Module.to = to


def source_of(model) -> Optional[str]:
    """The weights folder a partitioned ``from_pretrained`` left on ``model`` (None if none)."""
    return getattr(model, SOURCE_ATTR, None)


def sources_in(module):
    """What ``initialize(pretrained=...)`` needs for the models inside ``module`` (the
    root included) that a partitioned ``from_pretrained`` built: their checkpoint tensors
    bound to ``module``'s current parameters (:class:`zero_strategy.materialize.BoundWeights`),
    or None when there is none.  Raises ValueError, naming them, if a checkpoint tensor
    has lost its parameter or a parameter has lost its values (see
    :func:`zero_strategy.materialize.bind`)."""
    from zero_strategy.materialize import bind

    owners = [m for m in module.modules() if getattr(m, BINDING_ATTR, None) is not None]
    if not owners:
        return None
    bound = bind(module, [getattr(m, BINDING_ATTR) for m in owners])
    for m in owners:
        _awaiting.discard(m)
    return bound
