"""The ``zero_config:`` section of an accelerate config file, validated once.

The section travels from the launcher to the worker processes as JSON in one
environment variable (:data:`ENV_VAR`); both sides parse it with
:func:`parse_section`, so a typo fails in the launcher, before any worker starts.

Key names follow Accelerate's DeepSpeed plugin where the meaning is the same
(``zero_stage``, ``gradient_clipping``, ``offload_optimizer_device``,
``offload_param_device``, ``offload_optimizer_nvme_path``, ``offload_param_nvme_path``,
``zero3_init_flag``, ``zero3_save_16bit_model``); every other
key is a :class:`zero_strategy.ZeroConfig` field with the core's own name.  The
precision is not set here: it is accelerate's own top-level ``mixed_precision``.

Stdlib and ``zero_strategy.config`` only: this module is imported inside the
``accelerate launch`` process.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional

ENV_VAR = "ZERO_STRATEGY_ACCELERATE_CONFIG"
"""JSON of the ``zero_config:`` section, set by the launcher (or the runner) for the workers."""

TRACE_ENV_VAR = "ZERO_STRATEGY_COMM_TRACE"
"""A directory: when set, each worker appends one JSON line per ``accelerator.backward``
to ``rank<r>.jsonl`` there, with the gradient-communication volume of that backward."""

SECTION = "zero_config"

# Accelerate's DeepSpeed-plugin names this section accepts (the meaning is the same).
_PLUGIN_KEYS = (
    "zero_stage",
    "gradient_clipping",
    "offload_optimizer_device",
    "offload_param_device",
    "offload_optimizer_nvme_path",
    "offload_param_nvme_path",
    "zero3_init_flag",
    "zero3_save_16bit_model",
)
_OFFLOAD_DEVICES = ("none", "cpu", "nvme")

# Accelerate's mixed_precision values -> the core's precision names.
_PRECISION_FROM_ACCELERATE = {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}


def _engine_fields() -> tuple:
    from zero_strategy import ZeroConfig

    return tuple(f.name for f in dataclasses.fields(ZeroConfig))


def valid_keys() -> tuple:
    """Every key the section accepts, in the order the docs list them."""
    core = tuple(k for k in _engine_fields() if k not in ("stage", "precision"))
    return _PLUGIN_KEYS + ("stage",) + core


@dataclass(frozen=True)
class ZeroSettings:
    """What the integration needs from the section."""

    engine: Mapping[str, Any]
    """ZeroConfig fields (without ``precision``, which comes from ``mixed_precision``)."""

    zero3_init_flag: bool = False
    """Stage 3: ``from_pretrained`` builds the model unallocated and ``prepare`` loads each
    rank's slice of the weights (:mod:`zero_strategy.integrations.accelerate.loading`)."""

    zero3_save_16bit_model: bool = False
    """``get_state_dict`` / ``save_model`` / the Trainer's checkpoints write floating-point
    weights in the 16-bit compute dtype (bf16/fp16 runs) instead of their original dtype."""

    def zero_config(self, mixed_precision: str):
        """The engine's :class:`ZeroConfig` for accelerate's ``mixed_precision`` value."""
        from zero_strategy import ZeroConfig

        check_mixed_precision(mixed_precision)
        precision = _PRECISION_FROM_ACCELERATE[str(mixed_precision or "no").lower()]
        # Accelerate's loops (and the Trainer's) call zero_grad() themselves: gradients stay
        # readable through .grad after step(), as under DDP, unless the section says otherwise.
        return ZeroConfig.from_dict({"step_clears_gradients": False, **self.engine, "precision": precision})


def check_mixed_precision(mixed_precision: Any) -> None:
    """Accelerate's ``mixed_precision`` must be one the engine implements.  Checked before
    Accelerate's own checks, which would ask for an fp8 library zero_strategy never uses."""
    value = str(mixed_precision or "no").strip().lower()
    if value == "fp8":
        raise ValueError(
            "zero_config: mixed_precision 'fp8' is not supported by zero_strategy (its engine computes in bf16 or "
            "fp16 with fp32 master weights, and does not drive Transformer Engine, MS-AMP or torchao); set "
            "mixed_precision to bf16, fp16 or no, or remove the zero_config section to use Accelerate's fp8"
        )
    if value not in _PRECISION_FROM_ACCELERATE:
        raise ValueError(f"zero_config supports mixed_precision 'no', 'bf16' or 'fp16', got {mixed_precision!r}")


def command_line_mixed_precision(argv) -> Optional[str]:
    """The value of ``--mixed_precision`` on an ``accelerate launch`` command line (it
    overrides the config file's), or None."""
    for i, arg in enumerate(argv):
        if arg == "--mixed_precision" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--mixed_precision="):
            return arg.split("=", 1)[1]
        if not arg.startswith("-") and arg.endswith(".py"):
            break  # the training script: what follows are its own arguments
    return None


def _error(key: str, message: str) -> ValueError:
    return ValueError(f"{SECTION}.{key}: {message}")


def _as_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise _error(key, f"must be true or false, got {value!r}")


def _offload_device(key: str, value: Any) -> str:
    device = "none" if value is None else str(value).strip().lower()
    if device not in _OFFLOAD_DEVICES:
        raise _error(key, f"must be one of {', '.join(_OFFLOAD_DEVICES)}, got {value!r}")
    if key == "offload_param_device" and device == "cpu":
        raise _error(
            key,
            "parameter offload to host memory is not implemented in zero_strategy (the 16-bit parameters stay "
            "where they are computed); use none, or nvme (stage 3, with offload_optimizer_device: nvme)",
        )
    return device


def _nvme_path(section: Mapping) -> Optional[str]:
    """Accelerate names one NVMe path per offload; the engine keeps both in one directory."""
    given = {k: section[k] for k in ("offload_optimizer_nvme_path", "offload_param_nvme_path", "nvme_path")
             if section.get(k) not in (None, "", "none")}
    paths = {str(v) for v in given.values()}
    if len(paths) > 1:
        listed = ", ".join(f"{k}: {v!r}" for k, v in given.items())
        raise _error(next(iter(given)), f"zero_strategy keeps every offload file of a rank in one directory, but "
                                        f"the section names several ({listed}); give one path")
    return paths.pop() if paths else None


def parse_section(section: Any) -> ZeroSettings:
    """Validate a ``zero_config:`` mapping; errors name the key and, for an unknown key,
    the closest valid one."""
    if section is None:
        section = {}
    if not isinstance(section, Mapping):
        raise ValueError(
            f"{SECTION} must be a mapping of keys to values (e.g. 'zero_stage: 3'), "
            f"got {type(section).__name__}: {section!r}"
        )
    engine_fields = _engine_fields()
    keys = valid_keys()
    engine: dict = {}
    flags = {"zero3_init_flag": False, "zero3_save_16bit_model": False}
    for key, value in section.items():
        if not isinstance(key, str) or key not in keys:
            if key == "precision":
                raise _error(
                    "precision",
                    "set the precision with accelerate's own top-level 'mixed_precision' "
                    "(no / bf16 / fp16), not inside zero_config",
                )
            close = difflib.get_close_matches(str(key), keys, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}?" if close else f"valid keys are: {', '.join(keys)}"
            raise ValueError(f"unknown {SECTION} key {key!r}; {hint}")
        if key == "offload_optimizer_device":
            engine["offload_optimizer"] = _offload_device(key, value)
        elif key == "offload_param_device":
            engine["offload_param"] = _offload_device(key, value)
        elif key in ("offload_optimizer_nvme_path", "offload_param_nvme_path", "nvme_path"):
            path = _nvme_path(section)
            # Accelerate's own configs carry a path whatever the device ('none' offload):
            # the engine takes one only when something is offloaded to disk.
            if path is not None:
                engine["nvme_path"] = path
        elif key in flags:
            flags[key] = _as_bool(key, value)
        elif key == "zero_stage":
            engine["stage"] = value
        else:
            assert key in engine_fields
            engine[key] = value
    if "nvme_path" in engine and "nvme" not in (engine.get("offload_optimizer"), engine.get("offload_param")):
        if "nvme_path" not in section:
            del engine["nvme_path"]  # an accelerate-style path with nothing offloaded to disk
    for plugin_key, core_key in (("zero_stage", "stage"), ("offload_optimizer_device", "offload_optimizer"),
                                 ("offload_param_device", "offload_param")):
        if plugin_key in section and core_key in section and str(section[plugin_key]).lower() != str(section[core_key]).lower():
            raise _error(plugin_key, f"{section[plugin_key]!r} disagrees with {core_key}: {section[core_key]!r}; give one of them")
    # Let the core check every value now (with some precision; the real one comes later).
    from zero_strategy import ZeroConfig

    try:
        ZeroConfig.from_dict({**engine, "precision": "fp32"})
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{SECTION}: {_yaml_names(str(exc))}") from None
    return ZeroSettings(engine=engine, **flags)


def _yaml_names(message: str) -> str:
    # The core speaks of ZeroConfig.stage; the user wrote zero_stage.
    return message.replace("ZeroConfig.stage", "zero_stage (ZeroConfig.stage)")


def export(section: Any, environ=os.environ) -> ZeroSettings:
    """Validate ``section`` and publish it for the worker processes."""
    settings = parse_section(section)
    environ[ENV_VAR] = json.dumps(dict(section or {}), sort_keys=True)
    return settings


def from_environment(environ=os.environ) -> Optional[ZeroSettings]:
    """The settings the launcher exported, or None when ZeRO was not requested."""
    raw = environ.get(ENV_VAR)
    if raw is None or raw.strip() == "":
        return None
    try:
        section = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"{ENV_VAR} must hold the zero_config section as JSON: {exc}") from None
    return parse_section(section)


def read_file(path: str) -> Any:
    """The section from a file: an accelerate config with a ``zero_config:`` section, or a
    file that is only the section's mapping (yaml or json)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.endswith(".json"):
        data = json.loads(text)
    else:
        import yaml

        data = yaml.safe_load(text)
    if isinstance(data, Mapping) and SECTION in data:
        return data[SECTION]
    if isinstance(data, Mapping) and "distributed_type" in data:
        raise ValueError(f"{path} is an accelerate config file without a '{SECTION}:' section")
    return data


def check_distributed_type(distributed_type: Any) -> None:
    """ZeRO replaces DDP; it cannot be combined with DeepSpeed, FSDP, Megatron or XLA."""
    value = str(getattr(distributed_type, "value", distributed_type) or "NO").upper()
    if value in ("DEEPSPEED", "FSDP", "MEGATRON_LM", "XLA"):
        raise ValueError(
            f"{SECTION} replaces data-parallel training and cannot be combined with "
            f"distributed_type: {value}; use MULTI_GPU (or MULTI_CPU / NO)"
        )
