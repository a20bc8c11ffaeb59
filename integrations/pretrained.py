"""Partitioned ``from_pretrained`` for stage 3 (Accelerate's ``zero3_init_flag``, and
Lightning's ``configure_model``).

While active, ``PreTrainedModel.from_pretrained`` (and every
``AutoModel*.from_pretrained``, which ends there) no longer reads the whole checkpoint
in each process:

1. the config is read as usual and the model is built inside
   :func:`zero_strategy.init_context`: its parameters live on the meta device (no memory;
   buffers are built normally);
2. the folder holding the safetensors weights is remembered on the model;
3. the integration that builds the engine passes :func:`sources_in` of the model (a
   ``{submodule name: folder}`` mapping, so a transformers model held inside a
   LightningModule works too) to ``zero_strategy.initialize(pretrained=)``: each rank
   reads from the files only the slice of each tensor it keeps, and parameters missing
   from the files are initialised by the model's own initialiser with values that do
   not depend on the world size.

Between 1 and 3 the model can be moved (``model.to(device)``, which the Trainer does):
the meta parameters stay where they are and the engine places them.  Calls this cannot
serve (``device_map``, quantisation, an explicit ``state_dict``, weights only in
``pytorch_model.bin``, ...) fall back to the stock loader with a warning.

Who activates it: the Accelerate integration (``zero3_init_flag``, see
:mod:`zero_strategy.integrations.accelerate.loading`) and the Lightning strategies (around
``configure_model`` at stage 3).  This module imports transformers lazily.
"""
from __future__ import annotations

import contextlib
import logging
import os
import warnings
from typing import Dict, Optional

SOURCE_ATTR = "_zero_strategy_pretrained_source"
"""Set on a model built partitioned: the folder (or file) its weights are loaded from."""

_log = logging.getLogger(__name__)
_active = False

# Keyword arguments of from_pretrained that only say where the files are.
_HUB_KWARGS = ("cache_dir", "revision", "token", "local_files_only", "force_download", "proxies", "subfolder")
# Keyword arguments this loader cannot honour: the stock loader handles them.
_UNSUPPORTED = ("device_map", "quantization_config", "state_dict", "gguf_file", "tp_plan", "output_loading_info",
                "from_tf", "from_flax", "load_in_8bit", "load_in_4bit", "max_memory", "offload_folder")
# Keyword arguments with no meaning once the loading is ours.
_IGNORED = ("low_cpu_mem_usage", "use_safetensors", "ignore_mismatched_sizes", "trust_remote_code",
            "_from_auto", "_from_pipeline", "_commit_hash", "adapter_kwargs", "user_agent", "key_mapping")


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
        reason = _unsupported_reason(pretrained_model_name_or_path, model_args, kwargs)
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

    from_pretrained._zero_strategy = True
    cls.from_pretrained = classmethod(from_pretrained)


def _unsupported_reason(name, model_args, kwargs) -> Optional[str]:
    if model_args:
        return "positional model arguments were given"
    for key in _UNSUPPORTED:
        if kwargs.get(key) not in (None, False):
            return f"{key}= is not supported with partitioned loading"
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

    kwargs = dict(kwargs)
    hub = {k: kwargs.pop(k) for k in _HUB_KWARGS if k in kwargs}
    for key in _IGNORED:
        kwargs.pop(key, None)
    build_kwargs = {k: kwargs.pop(k) for k in ("dtype", "torch_dtype", "attn_implementation") if k in kwargs}
    config = kwargs.pop("config", None)
    if not isinstance(config, PretrainedConfig):
        source = config if isinstance(config, (str, os.PathLike)) else name
        config, kwargs = klass.config_class.from_pretrained(source, return_unused_kwargs=True, **hub, **kwargs)
    elif kwargs:
        for key in list(kwargs):
            if hasattr(config, key):
                setattr(config, key, kwargs.pop(key))
    if kwargs:
        raise TypeError(f"from_pretrained got arguments that are neither config attributes nor loading options: {sorted(kwargs)}")
    dtype = build_kwargs.pop("dtype", build_kwargs.pop("torch_dtype", None))
    if dtype is not None and dtype != "auto":
        build_kwargs["dtype"] = dtype
    with zero_strategy.init_context():
        model = klass._from_config(config, **build_kwargs)
    zero_strategy.keep_meta_on_moves(model)
    model.eval()  # as the stock loader returns it
    _load_generation_config(model, folder)
    setattr(model, SOURCE_ATTR, folder)
    return model


def _load_generation_config(model, folder) -> None:
    if not os.path.exists(os.path.join(folder, "generation_config.json")) or not hasattr(model, "generation_config"):
        return
    try:
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(folder)
    except (OSError, ValueError) as exc:
        _log.warning("zero3_init_flag: generation_config.json in %s not loaded: %s", folder, exc)


def source_of(model) -> Optional[str]:
    """The weights folder a partitioned ``from_pretrained`` left on ``model`` (None if none)."""
    return getattr(model, SOURCE_ATTR, None)


def sources_in(module) -> Optional[Dict[str, str]]:
    """``{submodule name: weights folder}`` for every submodule (the root is ``""``) that a
    partitioned ``from_pretrained`` built, ready for ``initialize(pretrained=...)``; None
    when there is none."""
    found = {name: source_of(m) for name, m in module.named_modules() if source_of(m) is not None}
    return found or None
