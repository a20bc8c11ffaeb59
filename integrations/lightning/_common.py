"""What the Trainer strategy and the Fabric strategy share: configuration, precision
mapping, and the engine's life cycle around a module.  Nothing here partitions
anything: every model-state operation goes through zero_strategy's public API.
"""
from __future__ import annotations

import logging
import os
import sys
import contextlib
from contextlib import contextmanager
from typing import Any, Mapping, Optional

import torch

log = logging.getLogger("zero_strategy.integrations.lightning")

# Lightning precision flag -> engine precision.  The engine does its own mixed
# precision (16-bit parameters for compute, fp32 master shards, input casting at the
# root forward, fp16 loss scaling), so Lightning must neither autocast nor scale.
LIGHTNING_TO_ENGINE_PRECISION = {
    "32-true": "fp32",
    "32": "fp32",
    "bf16-mixed": "bf16",
    "16-mixed": "fp16",
}
ENGINE_TO_LIGHTNING_PRECISION = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}

# Registered names: name -> (ZeroConfig overrides, description).
STRATEGY_NAMES = {
    "zero1": ({"stage": 1}, "ZeRO stage 1: optimizer state partitioned (zero_strategy)"),
    "zero2": ({"stage": 2}, "ZeRO stage 2: optimizer state and gradients partitioned (zero_strategy)"),
    "zero3": ({"stage": 3}, "ZeRO stage 3: optimizer state, gradients and parameters partitioned (zero_strategy)"),
    "zero2_offload": ({"stage": 2, "offload_optimizer": "cpu"},
                      "ZeRO stage 2 with the optimizer state and step in host memory (ZeRO-Offload) (zero_strategy)"),
    "zero3_offload": ({"stage": 3, "offload_optimizer": "cpu"},
                      "ZeRO stage 3 with the optimizer state and step in host memory (ZeRO-Offload) (zero_strategy)"),
    "zero2_offload_nvme": ({"stage": 2, "offload_optimizer": "nvme"},
                           "ZeRO stage 2 with the optimizer state in files under nvme_path and the step on the host "
                           "(ZeRO-Infinity; nvme_path from $ZERO_STRATEGY_NVME_PATH or the config) (zero_strategy)"),
    "zero3_offload_nvme": ({"stage": 3, "offload_optimizer": "nvme", "offload_param": "nvme"},
                           "ZeRO stage 3 with the optimizer state and the 16-bit parameter shards in files under nvme_path "
                           "(ZeRO-Infinity; nvme_path from $ZERO_STRATEGY_NVME_PATH or the config) (zero_strategy)"),
    "zero": ({}, "ZeRO with the configuration's stage (default 2) (zero_strategy)"),
}

NVME_PATH_ENV = "ZERO_STRATEGY_NVME_PATH"
"""Where the *_offload_nvme names put their files when neither the config nor the
strategy's options give nvme_path (a name carries no path of its own)."""


def base_config(stage: Optional[int], config: Any, options: Mapping[str, Any]):
    """Validate the strategy's arguments now (a typo fails when the Trainer is built,
    not inside a collective) and return the ZeroConfig before precision is known.
    Keyword options override the config (file); None means "the config's value"
    (what LightningCLI passes for every option the user did not set)."""
    from zero_strategy import ZeroConfig

    cfg = ZeroConfig.coerce(config)
    changes = {k: v for k, v in options.items() if v is not None}
    # Lightning's loops (and Fabric users) call zero_grad() themselves: gradients stay
    # readable through .grad after step(), as under DDP, unless a ZeroConfig, a mapping or
    # an option says otherwise.
    given = isinstance(config, ZeroConfig) or (isinstance(config, Mapping) and "step_clears_gradients" in config)
    if "step_clears_gradients" not in changes and not given:
        changes["step_clears_gradients"] = False
    if stage is not None:
        changes["stage"] = stage
    merged = {**cfg.to_dict(), **changes}
    if "nvme" in (merged["offload_optimizer"], merged["offload_param"]) and merged["nvme_path"] is None:
        if not os.environ.get(NVME_PATH_ENV):
            raise ValueError(
                "disk offload (offload_optimizer='nvme') needs a directory for its files: set nvme_path (e.g. "
                f"ZeroStrategy(..., nvme_path='/local_nvme/zero')) or the environment variable {NVME_PATH_ENV}")
        changes["nvme_path"] = os.environ[NVME_PATH_ENV]
    return cfg.replace(**changes) if changes else cfg


def with_node_layout(config, num_nodes: int, num_processes: int):
    """``Trainer(num_nodes=N, devices=D)`` / ``Fabric(num_nodes=N, devices=D)`` -> the
    engine's ``ranks_per_node`` ([Note: node structure] in
    zero_strategy/communication/topology.py).  Lightning's own launcher sets no
    ``LOCAL_WORLD_SIZE``, so on more than one node the engine would otherwise see one
    node holding every rank; Lightning numbers ranks node by node
    (``node_rank * D + local_rank``), so each node holds ``D`` consecutive ranks.  A
    ``ranks_per_node`` the user set (config, option) is kept; one node changes nothing."""
    if num_nodes > 1 and num_processes > 0 and config.ranks_per_node is None:
        return config.replace(ranks_per_node=num_processes)
    return config


def with_config_options(cls: type) -> type:
    """Give ``cls.__init__`` a signature that names every ZeroConfig field.

    Why: the strategies take ZeRO options as ``**options`` (the config decides what
    exists), but tools that build objects from signatures -- LightningCLI through
    jsonargparse, ``--trainer.strategy.init_args.param_persistence_threshold 0`` or a
    YAML ``class_path``/``init_args`` -- reject a name the signature does not list.  The
    advertised signature replaces ``**options`` with one keyword-only parameter per field
    (annotated with the field's type, default None = the config's value); the real
    ``__init__`` still takes ``**options``, so nothing else changes."""
    import dataclasses
    import inspect
    import typing

    from zero_strategy import ZeroConfig

    init = cls.__init__
    signature = inspect.signature(init)
    params = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    taken = {p.name for p in params}
    hints = typing.get_type_hints(ZeroConfig)
    for field in dataclasses.fields(ZeroConfig):
        if field.name in taken:
            continue
        kind = hints.get(field.name, Any)
        if kind is tuple:  # names of module classes, e.g. unit_modules
            kind = typing.Tuple[str, ...]
        params.append(inspect.Parameter(field.name, inspect.Parameter.KEYWORD_ONLY, default=None,
                                        annotation=Optional[kind]))
    init.__signature__ = signature.replace(parameters=params)
    return cls


def engine_precision(flag: str, config_precision: str) -> str:
    """The engine precision for a Lightning precision flag.

    The Trainer/Fabric flag decides.  A strategy config asking for a 16-bit precision is
    honoured when the flag was left at its default "32-true"; two different 16-bit
    requests are an error."""
    flag = str(flag)
    if flag not in LIGHTNING_TO_ENGINE_PRECISION:
        raise ValueError(
            f"zero_strategy supports precision '32-true', 'bf16-mixed' and '16-mixed' (fp32 master weights, "
            f"16-bit compute); got {flag!r}. '16-true'/'bf16-true' (no fp32 master) and '64-true' are not supported."
        )
    requested = LIGHTNING_TO_ENGINE_PRECISION[flag]
    if requested == "fp32":
        return config_precision
    if config_precision not in ("fp32", requested):
        raise ValueError(
            f"precision conflict: the Trainer/Fabric asks for {flag!r} but the ZeRO config says "
            f"precision={config_precision!r}; set it in one place"
        )
    return requested


def requested_precision_flag() -> Optional[str]:
    """The precision the user passed to ``Trainer``/``Fabric``, read from the connector.

    [Note: 16-mixed on CPU]
    Both Lightning connectors turn ``precision="16-mixed"`` into "bf16-mixed" when the
    accelerator is the CPU (torch autocast has no fp16 on CPU) before the strategy sees
    the precision plugin.  The engine does fp16 on CPU fine, so the strategy's precision
    setter -- which the connector calls from inside its ``__init__`` -- reads the
    original argument from that frame.  Returns None when no connector is found."""
    try:
        frame = sys._getframe(1)
    except Exception:  # noqa: BLE001 - interpreters without frames
        return None
    for _ in range(25):  # from a log filter inside the connector it is ~12 frames up
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        if frame.f_code.co_name == "__init__" and type(owner).__name__ in ("_AcceleratorConnector", "_Connector"):
            value = frame.f_locals.get("precision")
            return None if value is None else str(value)
        frame = frame.f_back
    return None


def resolve_plugin_flag(plugin_flag: str) -> str:
    """Undo the connector's CPU fallback from 16-mixed to bf16-mixed (see the note)."""
    if plugin_flag == "bf16-mixed":
        raw = requested_precision_flag()
        if raw in ("16-mixed", "16"):
            log.info("zero_strategy: using fp16 with dynamic loss scaling as requested (precision=%r); "
                     "ignore Lightning's message about falling back to bf16 on CPU", raw)
            return "16-mixed"
    return plugin_flag


# ----------------------------------------------------------------------------------------
# engines and the modules they manage
# ----------------------------------------------------------------------------------------
# A LightningModule keeps its engine across Trainer runs and across Trainers (its
# parameters stay sharded after fit); the next strategy finds it with the core's
# ``zero_strategy.engine_of``.


def engine_of(module: torch.nn.Module):
    import zero_strategy

    return zero_strategy.engine_of(module)


def has_meta_parameters(module) -> bool:
    return any(p.device.type == "meta" for p in module.parameters())


def initialize_engine(module, optimizer, config, device=None):
    """``zero_strategy.initialize`` with every rank starting from rank 0's values
    (``sync_module_states``, as DDP does at wrap time), after releasing an engine that
    still manages ``module``.

    Parameters still on the meta device are materialised by the engine directly into
    shards on ``device``: those deferred by :func:`partitioned_init` get the values an
    eager build gives them (their recorded initialisation, replayed with rank 0's random
    states, see zero_strategy/materialize/recording.py); others (modules built on the meta device elsewhere) from
    each module's initialiser (or the innermost enclosing ``_init_weights``)."""
    import zero_strategy

    from .. import pretrained

    release_engine(module)
    # transformers models loaded in configure_model (stage 3) come unallocated, with the
    # folder to read each rank's slices from.  Parameters deferred by partitioned_init
    # get the values recorded while they were built, exactly an eager build's
    # (zero_strategy.init_context records them; the engine replays them).
    sources = pretrained.sources_in(module) if has_meta_parameters(module) else None
    return zero_strategy.initialize(module, optimizer, config, device=device, sync_module_states=True, pretrained=sources)


@contextmanager
def partitioned_init(config):
    """Stage 3: parameters created inside are deferred (meta) until ``initialize``
    materialises them partitioned, so no rank ever holds the whole model.  Stages 0-2
    keep every parameter on every rank anyway: build normally (then rank 0's values
    are broadcast, as DDP does)."""
    import zero_strategy
    from zero_strategy.materialize import in_init_context

    if config.stage == 3 and in_init_context():
        yield  # nested (Lightning enters tensor_init_context, then model_sharded_context): already on
    elif config.stage == 3:
        from .. import pretrained

        # from_pretrained inside: partitioned too (when transformers is in use at all;
        # otherwise importing it here would cost every user its import time).
        loading = pretrained.partitioned_loading() if "transformers" in sys.modules else contextlib.nullcontext()
        # init_context records how each deferred parameter got its values, which the
        # engine replays ([Note: recorded initialisation] in zero_strategy/materialize/recording.py).
        with zero_strategy.init_context(), loading:
            yield
    else:
        yield


def release_engine(module) -> None:
    """Give ``module`` back its whole parameters and drop its engine (collective).

    Needed when a new optimizer arrives (every ``fit`` calls configure_optimizers) while
    the module is still partitioned by an earlier engine.

    ``engine.close(unshard=True)`` hands every parameter back whole in its original
    dtype, from the fp32 masters under mixed precision (frozen ones cast back too)."""
    engine = engine_of(module)
    if engine is not None:
        engine.close(unshard=True)


def setup_line(engine) -> str:
    """The one line logged on rank 0 when a strategy builds an engine (the core's
    :func:`zero_strategy.startup.startup_line`: what runs, beside the paper's formula)."""
    from zero_strategy.startup import startup_line

    return startup_line(engine)


def backward_kwargs(args: tuple, kwargs: dict) -> dict:
    """Positional arguments of ``Tensor.backward`` as keywords (the engine takes keywords)."""
    names = ("gradient", "retain_graph", "create_graph", "inputs")
    if len(args) > len(names):
        raise TypeError(f"backward() takes at most {len(names)} positional arguments, got {len(args)}")
    out = dict(zip(names, args))
    out.update(kwargs)
    return out


# Saved in client_state.pt: the module's state-dict key order.  The shard files list the
# tensors in the engine's flat-unit layout order; ``consolidate_checkpoint`` (which has no
# module) puts the weights back in the order ``module.state_dict()`` has them, as every
# other strategy's single file does (Lightning's tests zip parameters() with the values).
STATE_DICT_KEYS = "__zero_strategy_state_dict_keys__"


def state_dict_keys(module) -> list:
    """``list(module.state_dict())`` without calling ``state_dict`` (which would touch the
    partitioned tensors): parameters, then persistent buffers, module by module in
    registration order, shared modules under every name, as torch's ``state_dict`` does."""
    keys = []
    for prefix, m in module.named_modules(remove_duplicate=False):
        prefix = f"{prefix}." if prefix else ""
        keys.extend(prefix + n for n, p in m._parameters.items() if p is not None)
        keys.extend(prefix + n for n, b in m._buffers.items()
                    if b is not None and n not in getattr(m, "_non_persistent_buffers_set", ()))
    return keys


def split_client_state(checkpoint: Mapping[str, Any], module=None) -> dict:
    """Lightning's checkpoint dict without what the shard files hold (plus the module's
    state-dict key order, see STATE_DICT_KEYS)."""
    client = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    if module is not None:
        client[STATE_DICT_KEYS] = state_dict_keys(module)
    return client


# Saved in client_state.pt too: the name of every parameter in the optimizer's order, per
# param group, so ``consolidate_checkpoint`` can write the optimizer state in torch's format
# (indices in that order, what ddp's optimizer loads) without the module or the engine.
OPTIMIZER_NAMES = "__zero_strategy_optimizer_param_names__"
PRIVATE_KEYS = (STATE_DICT_KEYS, OPTIMIZER_NAMES)


def optimizer_order(engine) -> dict:
    """``{OPTIMIZER_NAMES: {"param_groups": [...]}}``: each group's hyper-parameters as
    Python has them (the manifest's JSON turns tuples such as Adam's betas into lists),
    which the consolidated file restores; {} without an optimizer.  With several
    optimizers: ``{OPTIMIZER_NAMES: {"optimizers": [that dict per optimizer]}}``."""
    count = len(engine.inner_optimizers)
    if count == 0:
        return {}
    orders = [_order_of(engine, k) for k in range(count)]
    return {OPTIMIZER_NAMES: orders[0] if count == 1 else {"optimizers": orders}}


def recorded_orders(names) -> list:
    """:func:`optimizer_order`'s record read back: one entry per optimizer (an empty
    list when nothing was recorded)."""
    if not isinstance(names, dict):
        return []
    return list(names["optimizers"]) if "optimizers" in names else [names]


def _order_of(engine, k: int) -> dict:
    groups = [{key: v for key, v in g.items() if key != "params" and _plain(v)}
              for g in engine.inner_optimizers[k].param_groups]
    return {"param_groups": groups}


def _plain(value) -> bool:
    """What ``torch.load(weights_only=True)`` reads back (client_state.pt is read restricted)."""
    if value is None or isinstance(value, (bool, int, float, str, torch.Tensor)):
        return True
    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    return False


def strip_private(client: dict) -> dict:
    for key in PRIVATE_KEYS:
        client.pop(key, None)
    return client


def refuse_file_inside_checkpoint(path) -> None:
    """A file inside one of our checkpoint directories given as the checkpoint (as
    DeepSpeed's strategies do, name the directory to load instead)."""
    from pathlib import Path

    path = Path(path)
    for parent in path.parents:
        if (parent / "manifest.json").is_file() and (parent / "client_state.pt").exists():
            raise FileNotFoundError(
                f"{path} is a file inside the ZeroStrategy checkpoint directory {parent}. "
                f"Try to load using this parent directory instead: {parent}"
            )
        break  # only the immediate parent: our directories are flat
