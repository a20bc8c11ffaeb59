"""``ZeroStrategy`` for the Lightning Trainer.

Written against ``lightning.pytorch``; ``trainer_standalone`` is its twin for the
standalone ``pytorch_lightning`` package, made from this same code (see ``_twin``).
Framework imports must therefore stay in the form ``from lightning.<x> import <name>``.

[Note: how a training step reaches the engine]
``zero_strategy.initialize`` manages the LightningModule itself (parameter names stay
the module's own).  Its root-forward hooks (16-bit input casting, stage-3 gathering and
release) must fire around ``training_step`` / ``validation_step`` / ... and not only
when the user happens to call ``self(x)``.  So ``strategy.model`` is a thin
:class:`_StepRouter` around the module: Lightning's forward redirection then calls
``router(*args)`` -> ``lightning_module(*args)`` (hooks fire) -> ``training_step``.

Per step, Lightning calls: precision ``optimizer_step`` -> the closure (training_step,
then ``backward`` -> ``engine.backward``, with the fp16 loss scale) -> clipping
(``engine.clip_grad_norm_`` / ``clip_grad_value_``: global over the shards) ->
``engine.step()``.  Accumulation micro-batches run inside ``block_backward_sync`` ->
``engine.no_sync()``.  A step skipped for an fp16 overflow also skips the step-interval
LR schedulers (see ``_guard_schedulers``).  Under stage 3, ``configure_model`` runs inside
``zero_strategy.init_context()`` (``model_sharded_context``): parameters stay on the meta
device until ``setup`` materialises them partitioned.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
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
    release_engine,
    resolve_plugin_flag,
    optimizer_order,
    refuse_file_inside_checkpoint,
    setup_line,
    split_client_state,
    strip_private,
    with_config_options,
    with_node_layout,
)
from ._messages import install_precision_note
from ._process_group import ZeroProcessGroupMixin

__all__ = ["ZeroStrategy", "ZeroPrecision"]


class _StepRouter(nn.Module):
    """``strategy.model``: routes Lightning's step calls through the module's ``__call__``."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


def _inside_checkpoint_dump() -> bool:
    """Whether Lightning's ``_CheckpointConnector.dump_checkpoint`` is asking (via
    ``_get_lightning_module_state_dict``).  If Lightning renames them this returns False
    and the state dict is gathered anyway: slower, never wrong."""
    frame = sys._getframe(2)
    for _ in range(4):
        if frame is None:
            return False
        if frame.f_code.co_name == "dump_checkpoint" and type(frame.f_locals.get("self")).__name__ == "_CheckpointConnector":
            return True
        frame = frame.f_back
    return False


class ZeroPrecision(Precision):
    """Hands precision to the engine: no autocast, no GradScaler.

    The engine keeps 16-bit parameters for compute and fp32 master shards, casts
    floating inputs at the root forward, and applies the fp16 loss scale in
    ``engine.backward``.  ``precision`` is Lightning's flag ("32-true",
    "bf16-mixed" or "16-mixed")."""

    def __init__(self, precision: str = "32-true") -> None:
        if precision not in LIGHTNING_TO_ENGINE_PRECISION:
            engine_precision(precision, "fp32")  # raises with the supported list
        self.precision = precision
        self._strategy = None
        self._warned_backward = False

    def _engine(self):
        engine = None if self._strategy is None else self._strategy.engine
        if engine is None:
            raise RuntimeError("ZeroPrecision is used before ZeroStrategy.setup() created the engine")
        return engine

    def backward(self, tensor, model, optimizer, *args, **kwargs) -> None:
        # Like DeepSpeed's plugin this bypasses LightningModule.backward: the loss
        # scale and the end-of-backward reduction belong to the engine.
        if not self._warned_backward and is_overridden("backward", model):
            self._warned_backward = True
            rank_zero_warn(
                f"{type(model).__name__}.backward is overridden but ZeroStrategy never calls it: the ZeRO engine runs "
                "the backward pass itself (fp16 loss scaling, gradient reduction into this rank's shards). Move what "
                "it does into the on_before_backward / on_after_backward hooks, which are called as usual, or use "
                "strategy='ddp' if the override must replace loss.backward()."
            )
        self._engine().backward(tensor, **backward_kwargs(args, kwargs))

    def optimizer_step(self, optimizer, model, closure, **kwargs):
        closure_result = closure()
        self._after_closure(model, optimizer)  # on_before_optimizer_step hooks + clipping
        engine = self._engine()
        # With several optimizers (manual optimization) only this one steps: its part of
        # the engine's step round.  False after an fp16 overflow: skipped on every rank.
        engine.step(None if len(engine.optimizers) == 1 else engine.optimizer_index(optimizer))
        return closure_result

    # With several optimizers, clip_gradients(opt, ...) clips that optimizer's parameters,
    # as under ddp; with one, every parameter.
    def clip_grad_by_norm(self, optimizer, clip_val) -> None:
        self._engine().clip_grad_norm_(float(clip_val), optimizer=optimizer)

    def clip_grad_by_value(self, optimizer, clip_val) -> None:
        self._engine().clip_grad_value_(float(clip_val), optimizer=optimizer)


@with_config_options
class ZeroStrategy(ZeroProcessGroupMixin, ParallelStrategy):
    """ZeRO data parallelism (zero_strategy) for the Lightning Trainer.

    ``ZeroStrategy(stage=3, overlap_comm=True, ...)`` or ``ZeroStrategy(config="zero.yaml")``:
    keyword options are ZeroConfig fields and override the config's values.
    Registered under the names in ``_common.STRATEGY_NAMES``.  Precision comes from the
    Trainer's ``precision=`` ("32-true", "bf16-mixed", "16-mixed")."""

    strategy_name = "zero"
    script_launcher_class = _SubprocessScriptLauncher

    def __init__(
        self,
        stage: Optional[int] = None,
        config: Any = None,
        accelerator=None,
        parallel_devices=None,
        cluster_environment=None,
        checkpoint_io=None,
        precision_plugin=None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        **options: Any,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=None,
        )
        self._base_config = base_config(stage, config, options)
        # Left None unless given: the connector then hands us the plugin for the
        # Trainer's precision flag through the setter below.
        self._precision_plugin = None
        if precision_plugin is not None:
            self.precision_plugin = precision_plugin
        self.num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._engine = None
        self._warned_directory = False

    # -- what Lightning asks about the strategy ------------------------------------
    @property
    def engine(self):
        """The ZeroEngine managing the LightningModule (None before setup)."""
        return self._engine

    @property
    def config(self):
        """The ZeroConfig in use: the engine's after setup, else the requested one."""
        return self._engine.config if self._engine is not None else self._base_config

    @property
    def is_distributed(self) -> bool:
        # Without it Lightning injects no DistributedSampler and sync_dist does nothing.
        return True

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the engine (and its optimizer shards) must exist first

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # optimizer shards come back in load_checkpoint

    @property
    def precision_plugin(self):
        if self._precision_plugin is None:
            self._precision_plugin = ZeroPrecision("32-true")
            self._precision_plugin._strategy = self
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin) -> None:
        if plugin is None:
            self._precision_plugin = None
            return
        if not isinstance(plugin, ZeroPrecision):
            flag = resolve_plugin_flag(str(getattr(plugin, "precision", "32-true")))
            plugin = ZeroPrecision(flag)
        plugin._strategy = self
        self._precision_plugin = plugin

    # -- processes -------------------------------------------------------------------
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        self._init_process_group()

    def set_world_ranks(self) -> None:
        self._publish_world_ranks()

    # -- model and optimizer ---------------------------------------------------------
    def _resolved_config(self):
        precision = engine_precision(self.precision_plugin.precision, self._base_config.precision)
        return with_node_layout(self._base_config.replace(precision=precision), self.num_nodes, self.num_processes)

    def model_to_device(self) -> None:
        module = self.lightning_module
        # A partitioned module must not be moved; a deferred one is materialised
        # on the device by the engine.
        if engine_of(module) is None and not has_meta_parameters(module):
            module.to(self.root_device)

    def setup(self, trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        config = self._resolved_config()
        if trainer.state.fn == TrainerFn.FITTING and self._layer_sync is not None:
            self._apply_layer_sync(module)
        self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING:
            # configure_optimizers sees the module's own parameters (whole, or the
            # same objects still partitioned by an earlier engine).
            self.setup_optimizers(trainer)
            optimizers = self._user_optimizers()
            self._engine = initialize_engine(module, optimizers[0] if len(optimizers) == 1 else optimizers, config,
                                             device=self.root_device)
            rank_zero_info(setup_line(self._engine))
            self.optimizers = list(self._engine.optimizers)
            self._guard_schedulers(module)
        else:
            existing = engine_of(module)
            same = existing is not None and (existing.config.stage, existing.config.precision) == (config.stage, config.precision)
            self._engine = existing if same else initialize_engine(module, None, config, device=self.root_device)
            if not same:
                rank_zero_info(setup_line(self._engine))
        self.model = _StepRouter(module)
        self.setup_precision_plugin()
        self.barrier("ZeroStrategy.setup")

    def _apply_layer_sync(self, module) -> None:
        """``Trainer(sync_batchnorm=True)`` (or a LayerSync plugin), applied as DDP does:
        when fitting, before the optimizer and the engine exist.  The layers are swapped
        on a plain module (an earlier engine is released first: its hooks sit on the
        modules being replaced).  Unlike DDP, teardown does not revert them: the module
        stays managed by the engine after ``fit``."""
        release_engine(module)
        converted = self._layer_sync.apply(module)
        if converted is not module:
            raise RuntimeError(
                f"{type(self._layer_sync).__name__}.apply returned a new root module; ZeroStrategy needs the "
                "LightningModule itself back (convert its submodules in place)"
            )

    def _user_optimizers(self) -> list:
        """configure_optimizers' optimizers: one engine steps them all (several need manual
        optimization, which Lightning itself enforces, as under ddp)."""
        optimizers = list(self.optimizers)
        if not optimizers or any(type(o).__name__ == "_MockOptimizer" for o in optimizers):
            raise ValueError("ZeroStrategy needs an optimizer to fit: configure_optimizers returned none")
        return optimizers

    def _guard_schedulers(self, module) -> None:
        """Skip step-interval LR schedulers after a step the engine skipped (fp16 overflow).

        Lightning steps schedulers through ``LightningModule.lr_scheduler_step`` whatever
        happened to the optimizer step; the guard wraps that hook on this module
        instance for the duration of the run (removed in teardown)."""
        self._unguard_schedulers(module)
        step_ids = {id(c.scheduler) for c in self.lr_scheduler_configs if c.interval == "step"}
        if not step_ids or not self._engine.policies.precision.loss_scaling:
            return
        original = module.lr_scheduler_step
        engine = self._engine

        def lr_scheduler_step(scheduler, metric=None):
            if id(scheduler) in step_ids and engine.last_step_skipped:
                return None
            return original(scheduler, metric)

        lr_scheduler_step._zero_strategy_guard = True
        module.__dict__["lr_scheduler_step"] = lr_scheduler_step

    @staticmethod
    def _unguard_schedulers(module) -> None:
        hook = module.__dict__.get("lr_scheduler_step") if module is not None else None
        if getattr(hook, "_zero_strategy_guard", False):
            del module.__dict__["lr_scheduler_step"]

    @contextmanager
    def block_backward_sync(self):
        """Accumulation micro-batches: stages 0/1 skip gradient communication."""
        if self._engine is None:
            yield
            return
        with self._engine.no_sync():
            yield

    @contextmanager
    def tensor_init_context(self, empty_init: Optional[bool] = None):
        """``trainer.init_module()``: as ``fabric.init_module()`` with ZeRO -- under stage 3
        the parameters stay deferred (meta) until ``setup`` materialises them partitioned
        (and initialised there, as DeepSpeed's zero.Init); stages 0-2 build whole
        parameters on the device, ``empty_init=True`` skipping their initialisation."""
        config = self._resolved_config()
        if config.stage != 3:
            with super().tensor_init_context(empty_init=empty_init):
                yield
            return
        with self.root_device, self.precision_plugin.tensor_init_context(), partitioned_init(config):
            yield

    @contextmanager
    def model_sharded_context(self):
        """Around ``configure_model``: under stage 3 the parameters created there stay
        on the meta device until ``setup`` materialises them partitioned."""
        with partitioned_init(self._resolved_config()):
            yield

    # -- collectives -------------------------------------------------------------------
    def reduce(self, tensor, group=None, reduce_op="mean"):
        return self._sync_tensor(tensor, group, reduce_op)

    # -- checkpoints ---------------------------------------------------------------------
    def lightning_module_state_dict(self) -> dict:
        """The consolidated state dict on rank 0, ``{}`` on the other ranks (as FSDP's
        full state dict).  Collective: every rank calls it.

        Inside ``trainer.save_checkpoint`` it returns ``{}`` without gathering: the
        weights go into the shard files, and a full copy on rank 0 at every checkpoint
        would cost the whole model in host memory for nothing."""
        if self._engine is None:
            return self.lightning_module.state_dict()
        if _inside_checkpoint_dump():
            return {}
        return self._engine.full_state_dict(rank0_only=True)

    def optimizer_state(self, optimizer) -> dict:
        """The optimizer state in torch's format (whole tensors, the user's parameter order:
        what ddp's optimizer holds) on rank 0, ``{}`` on the other ranks, as FSDP's full
        optimizer state.  Collective.  Inside ``trainer.save_checkpoint`` it is ``{}``: the
        optimizer shards are in the checkpoint directory."""
        if self._engine is None or not self._engine.optimizers or _inside_checkpoint_dump():
            return {}
        return self._engine.full_optimizer_state_dict(rank0_only=True, optimizer=optimizer)

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        """All ranks: write a checkpoint *directory* at ``filepath`` (per-rank shards,
        a manifest, and Lightning's other state in ``client_state.pt``)."""
        if storage_options is not None:
            raise TypeError("ZeroStrategy.save_checkpoint does not take storage_options (it writes a directory)")
        if self._engine is None:
            raise RuntimeError("ZeroStrategy.save_checkpoint before setup: there is no engine to save")
        # Rank 0's path, as Lightning's own strategies do: ModelCheckpoint formats the
        # name from metrics, which may differ per rank (logged without sync_dist).
        path = Path(self.broadcast(str(filepath)))
        if not self._warned_directory:
            self._warned_directory = True
            rank_zero_warn(
                f"ZeroStrategy: each rank saves its shard of the checkpoint within a directory ({path}). For one "
                "ordinary file (weights and optimizer state in torch's format, which any strategy loads), run "
                "`python -m zero_strategy.integrations.lightning.consolidate DIR OUT.ckpt`."
            )
        client = split_client_state(checkpoint, self.lightning_module)
        client.update(optimizer_order(self._engine))
        self._engine.save_checkpoint(path, client_state=client)

    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> dict:
        """A ZeRO checkpoint directory restores weights, optimizer shards and loss scale
        here.  An ordinary single-file checkpoint (another strategy's, or consolidated) is
        read whole on every rank: its optimizer state (torch's format) is restored here
        into this rank's shards, its weights in ``load_model_state_dict``."""
        path = Path(checkpoint_path)
        if path.is_dir() or path.with_name(path.name + ".old").is_dir():
            client = self._engine.load_checkpoint(path, weights_only=weights_only) or {}
            checkpoint = strip_private(dict(client))
            checkpoint["state_dict"] = {}
            return checkpoint
        refuse_file_inside_checkpoint(path)
        checkpoint = self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)
        states = checkpoint.get("optimizer_states")
        if states and self._engine is not None and self._engine.optimizers:
            count = len(self._engine.optimizers)
            if len(states) != count:
                raise RuntimeError(
                    f"ZeroStrategy has {count} optimizers but the checkpoint contains {len(states)} optimizers to "
                    f"load ({path})"
                )
            for k, state in enumerate(states):
                self._engine.load_full_optimizer_state_dict(state, optimizer=k)
        return checkpoint

    def remove_checkpoint(self, filepath) -> None:
        """Rank 0 removes (a replaced top-k checkpoint directory), then every rank waits, so
        no rank sees a directory that is about to go (ModelCheckpoint calls it on all ranks)."""
        super().remove_checkpoint(filepath)
        self.barrier("ZeroStrategy.remove_checkpoint")

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        state_dict = checkpoint.get("state_dict") or {}
        if state_dict:  # a single-file checkpoint; directories were loaded already
            self._engine.load_full_state_dict(state_dict, strict=strict)

    def load_optimizer_state_dict(self, checkpoint) -> None:
        pass  # never called (lightning_restore_optimizer is False)

    # -- end of a run --------------------------------------------------------------------
    def teardown(self) -> None:
        """Unlike the base class: no ``lightning_module.cpu()`` and no optimizer moves.
        The engine stays attached, so the module keeps working (and stays partitioned)
        after ``fit``; the next run, or another Trainer, picks it up."""
        self._unguard_schedulers(self.lightning_module)
        if self.cluster_environment is not None:
            self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        assert self.accelerator is not None
        self.accelerator.teardown()
        self.checkpoint_io.teardown()


# Lightning logs its AMP line before the strategy sees the plugin (see _messages).
install_precision_note()
