"""``ZeroFabricStrategy``: the same engine behind ``Fabric(strategy="zero3")``.

Covers ``fabric.setup(model, optimizer)`` (jointly: the engine re-points the optimizer
at the shards), ``fabric.setup_module(model)`` for evaluation, ``fabric.backward``
(fp16 loss scale), ``optimizer.step()`` (skipped on every rank after an fp16
overflow), ``fabric.clip_gradients`` (global norm over the shards, or by value),
``fabric.no_backward_sync`` (gradient accumulation) and ``fabric.save`` / ``fabric.load``
(a checkpoint directory of per-rank shards; other state goes into ``client_state.pt``).

Written against ``lightning.fabric``; ``fabric_standalone`` is its twin for the
standalone ``lightning_fabric`` package, made from this same code (see ``_twin``).
"""
from __future__ import annotations

from contextlib import ExitStack, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict, Optional

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl, _Sharded
from lightning.fabric.utilities.init import _EmptyInit
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.fabric.utilities.types import _Stateful
from torch import nn

from ._common import (
    LIGHTNING_TO_ENGINE_PRECISION,
    backward_kwargs,
    base_config,
    engine_of,
    engine_precision,
    has_meta_parameters,
    initialize_engine,
    partitioned_init,
    STATE_DICT_KEYS,
    optimizer_order,
    resolve_plugin_flag,
    setup_line,
    state_dict_keys,
    strip_private,
    with_config_options,
    with_node_layout,
)
from ._fabric_files import OBJECTS_KEY as _OBJECTS_KEY
from ._fabric_files import load_single_file
from ._messages import install_precision_note
from ._process_group import ZeroProcessGroupMixin

__all__ = ["ZeroFabricStrategy", "ZeroFabricPrecision"]

class ZeroFabricPrecision(Precision):
    """No autocast, no scaler: the engine owns mixed precision (see the Trainer plugin)."""

    def __init__(self, precision: str = "32-true") -> None:
        if precision not in LIGHTNING_TO_ENGINE_PRECISION:
            engine_precision(precision, "fp32")  # raises with the supported list
        self.precision = precision
        self._strategy = None

    def backward(self, tensor, model, *args, **kwargs) -> None:
        engine = self._strategy._engine_for(model)
        engine.backward(tensor, **backward_kwargs(args, kwargs))


class _EngineNoSync(_BackwardSyncControl):
    """``fabric.no_backward_sync``: the engine's own ``no_sync`` (accumulation)."""

    def no_backward_sync(self, module: nn.Module, enabled: bool):
        engine = engine_of(module)
        if not enabled or engine is None:
            return nullcontext()
        return engine.no_sync()


@with_config_options
class ZeroFabricStrategy(ZeroProcessGroupMixin, ParallelStrategy, _Sharded):
    """ZeRO data parallelism (zero_strategy) for Lightning Fabric; options as ZeroStrategy."""

    script_launcher_class = _SubprocessScriptLauncher

    def __init__(
        self,
        stage: Optional[int] = None,
        config: Any = None,
        accelerator=None,
        parallel_devices=None,
        cluster_environment=None,
        checkpoint_io=None,
        precision=None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        **options: Any,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=None,
        )
        self._base_config = base_config(stage, config, options)
        self._precision = None
        if precision is not None:
            self.precision = precision
        self._num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._backward_sync_control = _EngineNoSync()
        self._engines = []
        self._forwarded = set()

    # -- properties ------------------------------------------------------------------
    @property
    def engine(self):
        """The engine of the (last) module set up."""
        return self._engines[-1] if self._engines else None

    @property
    def config(self):
        """The ZeroConfig in use: the engine's after setup, else the requested one."""
        return self.engine.config if self.engine is not None else self._base_config

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, value: int) -> None:
        self._num_nodes = value

    @property
    def precision(self):
        if self._precision is None:
            self._precision = ZeroFabricPrecision("32-true")
            self._precision._strategy = self
        return self._precision

    @precision.setter
    def precision(self, plugin) -> None:
        if plugin is None:
            self._precision = None
            return
        if not isinstance(plugin, ZeroFabricPrecision):
            plugin = ZeroFabricPrecision(resolve_plugin_flag(str(getattr(plugin, "precision", "32-true"))))
        plugin._strategy = self
        self._precision = plugin

    # -- processes -------------------------------------------------------------------
    def setup_environment(self) -> None:
        super().setup_environment()
        self._publish_world_ranks()
        self._init_process_group()

    # -- model and optimizer ---------------------------------------------------------
    def _config(self):
        precision = engine_precision(self.precision.precision, self._base_config.precision)
        return with_node_layout(self._base_config.replace(precision=precision), self.num_nodes, self.num_processes)

    def _remember(self, engine):
        rank_zero_info(setup_line(engine))  # a new engine: say once, on rank 0, what runs
        self._engines = [e for e in self._engines if e.module is not engine.module] + [engine]
        # Which modules ran a forward since their last backward: fabric.backward(loss) without
        # model= goes to that one when several are set up (Lightning's other strategies need no
        # model there either).
        engine.module.register_forward_pre_hook(lambda *_: self._forwarded.add(id(engine)))
        return engine

    def _engine_for(self, module: Optional[nn.Module]):
        if module is not None:
            engine = engine_of(getattr(module, "_forward_module", module))
            if engine is not None:
                return engine
        if len(self._engines) == 1:
            return self._engines[0]
        pending = [e for e in self._engines if id(e) in self._forwarded]
        if len(pending) == 1:
            return pending[0]
        raise RuntimeError(
            "pass the model to fabric.backward(loss, model=model): several modules are set up and "
            f"{'none' if not pending else len(pending)} of them ran a forward since their last backward"
        )

    def setup_module_and_optimizers(self, module, optimizers, scheduler=None):
        """``fabric.setup(model, opt)`` or ``fabric.setup(model, opt_a, opt_b, ...)``: one
        engine for the module, stepping each optimizer's parameters."""
        if not optimizers:
            raise ValueError("ZeroFabricStrategy.setup_module_and_optimizers needs at least one optimizer")
        optimizers = list(optimizers)
        engine = self._remember(initialize_engine(module, optimizers[0] if len(optimizers) == 1 else optimizers,
                                                  self._config(), device=self.root_device))
        return module, list(engine.optimizers), scheduler

    def setup_module(self, module):
        """Evaluation only (no optimizer): the module is partitioned for inference."""
        if engine_of(module) is None:
            self._remember(initialize_engine(module, None, self._config(), device=self.root_device))
        return module

    def setup_optimizer(self, optimizer):
        raise NotImplementedError(self._err_msg_joint_setup_required())

    def module_to_device(self, module) -> None:
        if engine_of(module) is None and not has_meta_parameters(module):
            module.to(self.root_device)

    def module_init_context(self, empty_init: Optional[bool] = None):
        """``fabric.init_module()``: under stage 3 parameters stay deferred (meta)
        until ``fabric.setup`` materialises them partitioned on the device (and
        initialised there, as FSDP and DeepSpeed stage 3 do).  Stages 0-2 build whole
        parameters; ``empty_init=True`` skips their initialisation, as Lightning's
        other strategies do (the weights are expected to come from a checkpoint)."""
        config = self._config()
        stack = ExitStack()
        stack.enter_context(self.root_device)
        if config.stage != 3:
            stack.enter_context(_EmptyInit(enabled=bool(empty_init)))
        stack.enter_context(self.precision.module_init_context())
        stack.enter_context(partitioned_init(config))
        return stack

    def module_sharded_context(self):
        return partitioned_init(self._config())

    def backward(self, tensor, module, *args, **kwargs) -> None:
        self.precision.pre_backward(tensor, module)
        self.precision.backward(tensor, module, *args, **kwargs)
        self.precision.post_backward(tensor, module)
        self._forwarded.discard(id(self._engine_for(module)))

    def clip_gradients_norm(self, module, optimizer, max_norm, norm_type=2.0, error_if_nonfinite=True):
        engine = self._engine_for(module)
        # that optimizer's parameters, as Fabric's other strategies clip them
        norm = engine.clip_grad_norm_(float(max_norm), norm_type=float(norm_type),
                                      optimizer=self._index_in(engine, optimizer))
        # An fp16 overflow gives an inf norm by design (the step will be skipped).
        if error_if_nonfinite and not engine.policies.precision.loss_scaling and not torch.isfinite(norm):
            raise RuntimeError(f"the total norm of order {norm_type} for gradients is non-finite ({norm.item()})")
        return norm

    def clip_gradients_value(self, module, optimizer, clip_val) -> None:
        engine = self._engine_for(module)
        engine.clip_grad_value_(float(clip_val), optimizer=self._index_in(engine, optimizer))

    # -- collectives -------------------------------------------------------------------
    def all_reduce(self, tensor, group=None, reduce_op="mean"):
        return self._sync_tensor(tensor, group, reduce_op)

    # -- checkpoints ---------------------------------------------------------------------
    def _module_entry(self, state: dict):
        modules = [(k, v) for k, v in state.items() if isinstance(v, nn.Module)]
        if len(modules) != 1:
            raise ValueError(f"ZeroFabricStrategy saves/loads a state with exactly one model, found {len(modules)}")
        key, module = modules[0]
        return key, self._engine_for(module)

    def save_checkpoint(self, path, state, storage_options=None, filter=None) -> None:
        """All ranks: a checkpoint directory (shards + manifest); non-model state goes
        into ``client_state.pt``."""
        if storage_options is not None or filter is not None:
            raise TypeError(
                "ZeroFabricStrategy.save_checkpoint takes neither storage_options nor filter: each rank writes its own "
                "shards into a checkpoint directory (consolidate_checkpoint makes one file, which can then be filtered)"
            )
        key, engine = self._module_entry(state)
        client: Dict[str, Any] = {_OBJECTS_KEY: {"module": key, "optimizers": []},
                                  STATE_DICT_KEYS: state_dict_keys(engine.module), **optimizer_order(engine)}
        # The key of each optimizer in the engine's order (None: not in the saved state).
        client[_OBJECTS_KEY]["optimizers"] = [None] * len(engine.optimizers)
        for k, v in state.items():
            if isinstance(v, nn.Module):
                continue
            if isinstance(v, torch.optim.Optimizer):
                index = self._index_in(engine, v)
                if index is not None:
                    client[_OBJECTS_KEY]["optimizers"][index] = k
            elif isinstance(v, _Stateful):
                client[k] = v.state_dict()
            else:
                client[k] = v
        # Rank 0's path, as Lightning's own strategies do (a name may be formatted per rank).
        engine.save_checkpoint(Path(self.broadcast(str(path))), client_state=client)

    def load_checkpoint(self, path, state=None, strict: bool = True, weights_only=None):
        """Restore into ``state`` in place; returns what the checkpoint holds beyond the
        requested keys.  A checkpoint directory written by ``fabric.save`` restores the
        sharded model and optimizer; an ordinary single file (``torch.save``'d by another
        strategy, or consolidated) is read whole on every rank, as the Trainer strategy does."""
        path = Path(path)
        if not (path.is_dir() or path.with_name(path.name + ".old").is_dir()):
            return load_single_file(self, path, state, strict, weights_only, rank_zero_warn)
        if not isinstance(state, dict) or not state:
            raise ValueError(
                f"{path} is a ZeroFabricStrategy checkpoint directory: pass the state to restore into, e.g. "
                "fabric.load(path, {'model': model, 'optimizer': optimizer}) (fabric.load_raw takes single files)"
            )
        _, engine = self._module_entry(state)
        client = strip_private(dict(engine.load_checkpoint(path, weights_only=weights_only) or {}))
        client.pop(_OBJECTS_KEY, None)
        for k, obj in list(state.items()):
            if isinstance(obj, (nn.Module, torch.optim.Optimizer)):
                continue  # restored by the engine
            if k not in client:
                if strict:
                    raise KeyError(
                        f"The requested state contains a key {k!r} that does not exist in the loaded checkpoint. "
                        "To disable strict loading, set `strict=False`."
                    )
                continue
            if isinstance(obj, _Stateful):
                obj.load_state_dict(client.pop(k))
            else:
                state[k] = client.pop(k)
        return client

    def get_module_state_dict(self, module) -> dict:
        """Consolidated weights (collective: call on every rank)."""
        return self._engine_for(module).full_state_dict(rank0_only=False)

    def load_module_state_dict(self, module, state_dict, strict: bool = True) -> None:
        """A full state dict, passed on every rank (each keeps its own slices)."""
        engine = engine_of(module)
        if engine is None:  # not set up yet: an ordinary module
            module.load_state_dict(state_dict, strict=strict)
        else:
            engine.load_full_state_dict(state_dict, strict=strict)

    def _engine_of_optimizer(self, optimizer):
        """The engine whose ZeroOptimizer ``optimizer`` is (None: not set up)."""
        for engine in self._engines:
            if self._index_in(engine, optimizer) is not None:
                return engine
        return None

    @staticmethod
    def _index_in(engine, optimizer) -> Optional[int]:
        """Which of ``engine``'s optimizers ``optimizer`` is (a _FabricOptimizer, the
        ZeroOptimizer or the user's optimizer), None if none."""
        inner = getattr(optimizer, "optimizer", None)  # _FabricOptimizer -> ZeroOptimizer
        for k, (zero, user) in enumerate(zip(engine.optimizers, engine.inner_optimizers)):
            if optimizer is zero or optimizer is user or (inner is not None and inner is zero):
                return k
        return None

    def get_optimizer_state(self, optimizer) -> dict:
        return {}  # sharded: saved by save_checkpoint (a collective here would make optimizer.state_dict() one)


# Lightning logs its AMP line before the strategy sees the plugin (see _messages).
install_precision_note()
