"""ZeroEngine: one training step of ZeRO-DP over a model sharded in place.

The phases of a step, as the code follows them:

1. forward  - stage 3 gathers each unit module's parameters just before it runs
              (prefetching the next ones) and releases them after.
2. backward - each parameter's gradient is copied into its unit's flat buffer the
              moment autograd finishes it; complete units are reduced (reduce-scatter,
              or all-reduce at stage 0) asynchronously, in a fixed order, while
              backward continues; everything is waited for when backward ends.
3. step     - this rank's reduced gradient slice becomes the fp32 master's gradient
              (unscaled for fp16; an overflow anywhere skips the step everywhere),
              optional global-norm clipping, the user's optimizer updates the shards,
              the compute-dtype shards are refreshed and (stages 1-2) all-gathered.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Dict, Iterator, List, Optional

import torch
import torch.nn as nn

from .communication import multinode
from .communication.comm import Communicator
from .config import ZeroConfig
from .execution.activation import apply_activation_checkpointing
from .execution.hooks import cast_floating_inputs, register_hooks
from .materialize.deferred import forget_meta_moves, initialize_deferred, meta_parameter_ids
from .materialize.pretrained import load_pretrained
from .materialize.recording import plan_replay, replaying
from .optim.loss_scale import LossScaler, raise_at_min_loss_scale
from .optim.optimizer import ZeroOptimizer
from .optim.optimizer_set import OptimizerSet, as_optimizer_list
from .optim.step_grads import StepGradients
from .optim.stepper import step_units
from .optim.usage import UsageAgreement
from .lifecycle import Phase, check_grads_steppable, check_open, engine_of, register_engine, weak_method
from .persistence import SavesAndLoads
from .policy import Policies
from .reliability.finite_loss import check_finite_loss
from .reliability.fingerprint import check_same_setup
from .reliability.guard import guard_parameters, unguard_parameters
from .reliability.misuse import SkipWatch, engine_steps, guard_misuse, route_module_zero_grad
from .sharding.builder import build_sharded_model, materialization_device
from .sharding.flat_unit import FlatUnit
from .sharding.gathered_parameters import WholeParameters
from .sharding.grad_reads import install_grad_reads, set_grad_reads, uninstall_grad_reads
from .sharding.keep_gathered import KeepGathered, methods_to_wrap, wrap_methods
from .sharding.reducer import GradientReducer
from .reports import Reports
from .sharding.sharded_model import ShardedModel


def _broadcast_from_rank0(model: nn.Module, comm, skip) -> None:
    """Start every rank from rank 0's values (as DDP does), tensor by tensor."""
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if id(t) not in skip and t.device.type != "meta":
                comm.broadcast(t.data, 0, label=f"the initial value of {name}")


class ZeroEngine(SavesAndLoads, WholeParameters, Reports):
    """The lifecycle and the step of ZeRO-DP over one ShardedModel (sharding/sharded_model.py).

    ``phase`` follows [Note: lifecycle] in lifecycle.py: every misuse check is a
    transition that the current phase does not allow.

    Everything the engine installs on the model (hooks, wrapped methods, activation
    checkpointing, disk files) registers its undo in ``_undo``; close() runs them in
    reverse.  The parameter guards stay on a closed stage-3 model (its parameters are
    still shards) until ``close(unshard=True)`` hands whole ones back.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: Optional[torch.optim.Optimizer],
        config,
        process_group=None,
        device=None,
        pretrained=None,
        sync_module_states: bool = True,
    ) -> None:
        config = ZeroConfig.coerce(config)
        pol = Policies.from_config(config)
        comm = Communicator(process_group)
        comm.configure(pol.comm.timeout, pol.comm.check_call_order)
        self.scaler = LossScaler.from_config(config, pol.precision)
        self.global_step = 0
        self.last_step_skipped = False
        self.phase = Phase.IDLE
        self._undo: List = []  # what close() runs, last first
        self._skip_watch = SkipWatch()  # repeated fp16 skips with no way out warn
        self._synced = True  # False inside no_sync(): a mode, not a phase
        self._backward_synced = True  # the mode the running backward started in
        self._overflow = False
        self._stepped: Optional[set] = None  # the optimizers stepped in this round ([Note: step rounds])
        self.last_load_report: Optional[Dict[str, list]] = None  # from pretrained=: missing / unexpected names
        if engine_of(model) is not None:
            raise ValueError(
                f"this {type(model).__name__} is already managed by a ZeroEngine; call engine.close() on that one "
                "first (engine_of(model) returns it)"
            )
        # Before the model is touched: a keep_gathered_methods name that is not a method fails here.
        methods = methods_to_wrap(model, config.keep_gathered_methods) if pol.stage.shards_parameters else []
        # Parameters built inside init_context() live on the meta device until the
        # units are filled (materialize/); decide where they will live.
        pending = meta_parameter_ids(model)
        device = materialization_device(device, comm) if pending else None

        # One optimizer or several ([Note: several optimizers] in optimizer_set.py).
        inner = as_optimizer_list(optimizer)
        optimizer_set = OptimizerSet(inner) if inner else None
        # Before any other collective: ranks set up differently fail here, naming the difference.
        topology = multinode.resolve_topology(config)  # this rank's launcher variables: compared by the check
        check_same_setup(comm, model, optimizer_set, config, sync_module_states=sync_module_states, pretrained=pretrained,
                         ranks_per_node=topology.ranks_per_node)
        if sync_module_states and comm.world_size > 1:
            _broadcast_from_rank0(model, comm, skip=pending)
        # Nodes, and ZeRO++'s node and cross-node communicators when asked for (every rank
        # has the same config now, so every rank builds the same groups).
        self.topology = multinode.set_up(comm, config, topology)
        # Parameters recorded by init_context get an eager build's values, replayed below
        # ([Note: recorded initialisation] in materialize/recording.py).
        replay = plan_replay(model, comm) if pending and device.type != "meta" else None

        self.sharded: ShardedModel = build_sharded_model(model, inner, optimizer_set, config, pol, comm, device, pending)
        sm = self.sharded
        # The questions most callers ask, answered by the sharded model (never rebound).
        self.module, self.config, self.policies, self.comm, self.device = model, config, pol, comm, device
        self.units, self.trainable_units, self.untouched = sm.units, sm.trainable_units, sm.untouched
        self.inner_optimizers, self.gatherer, self.disk_offload = sm.inner_optimizers, sm.gatherer, sm.disk_offload
        self.orig_dtype_by_id, self.orig_dtype_untouched = sm.orig_dtype_by_id, sm.orig_dtype_untouched
        self.unit_module_classes, self.optimizer_param_places = sm.unit_module_classes, sm.optimizer_param_places
        self.units_of, self.param_places_of, self.parameters_of = sm.units_of, sm.param_places_of, sm.parameters_of
        self.optimizer_of_parameters, self.original_dtype = sm.optimizer_of_parameters, sm.original_dtype
        self.optimizer_index = sm.optimizer_index
        if sm.disk_offload is not None:
            self._undo.append(sm.disk_offload.close)  # removes the offload files (mapped tensors stay readable)

        self.optimizers: List[ZeroOptimizer] = [ZeroOptimizer(self, k) for k in range(len(inner))]
        guard_misuse(self)  # the inner optimizer's own step(), torch's clip_grad_norm_ ([Note: silent misuse])
        self._usage = UsageAgreement(sm)
        self._grads = StepGradients(sm)
        # C_B: two buckets' worth in flight; a unit bigger than that is reduced alone.
        # (Not twice the largest unit: one big root unit would let every block's bucket
        # pile up beside the activations in backward.)
        self.reducer = GradientReducer(
            sm.reduction_order, comm, overlap=pol.comm.overlap,
            max_in_flight=2 * pol.comm.reduce_bucket_size, rider=weak_method(self._usage.rider),
        )
        self._keep = KeepGathered(sm.gatherer, sm.units, max_bytes=config.keep_gathered_max_bytes,
                                  bucket_numel=pol.comm.allgather_bucket_size, rank=comm.rank)
        self._undo.extend(h.remove for h in register_hooks(self))
        # .grad as DDP would show it ([Note: .grad under ZeRO] in sharding/grad_reads.py).
        self._grad_reads = bool(sm.trainable_units)
        if self._grad_reads:
            install_grad_reads(sm.trainable_units, comm, self._grads)
            set_grad_reads(sm.trainable_units, True)
            self._undo.append(lambda units=sm.trainable_units: uninstall_grad_reads(units))
        register_engine(model, self)
        if config.activation_checkpointing:
            self._undo.extend(apply_activation_checkpointing(model, config.activation_checkpointing, config.offload_activations))

        if pending and device.type != "meta":
            forget_meta_moves(model)
            with replaying(replay):
                if pretrained is not None:
                    self.last_load_report = load_pretrained(sm, pretrained, pending)
                else:
                    initialize_deferred(sm, pending)
        elif pretrained is not None:
            self.last_load_report = load_pretrained(sm, pretrained)
        if pol.stage.shards_parameters:
            # Last: materialisation and loading above write through the parameters.
            guard_parameters(sm.units, on_access=weak_method(sm.gatherer.on_access))
        # generate() and the like run in keep_gathered() ([Note: keep gathered]).
        self._undo.extend(wrap_methods(self, methods) + [route_module_zero_grad(self)])
        if sm.disk_offload is not None:
            sm.disk_offload.evict_all()  # the values written above go to disk, out of memory

    # -- optimizers ---------------------------------------------------------------------------
    @property
    def optimizer(self) -> Optional[ZeroOptimizer]:
        """The ZeroOptimizer of an engine with one optimizer (None without one); with
        several, use :attr:`optimizers`."""
        return self._only("optimizer", self.optimizers)

    @property
    def inner_optimizer(self) -> Optional[torch.optim.Optimizer]:
        """The user's optimizer of an engine with one optimizer (None without one); with
        several, use :attr:`inner_optimizers`."""
        return self._only("inner_optimizer", self.inner_optimizers)

    def _only(self, what: str, items: list):
        if len(items) > 1:
            names = ", ".join(type(o).__name__ for o in self.inner_optimizers)
            raise RuntimeError(
                f"engine.{what} is ambiguous: this engine has {len(items)} optimizers ({names}); use "
                f"engine.{what}s[k] for optimizer k"
            )
        return items[0] if items else None

    # -- hooks' entry points ---------------------------------------------------------------
    def _on_param_grad(self, unit: FlatUnit, pos: int) -> None:
        if self.phase is not Phase.BACKWARD:
            self._begin_backward()
        unit.grads.accept(pos)
        self.reducer.on_grad_ready(unit, self._backward_synced)

    def _begin_backward(self) -> None:
        if self._stepped:
            waiting = [f"{k} ({type(self.inner_optimizers[k]).__name__})" for k in range(len(self.optimizers))
                       if k not in self._stepped]
            raise RuntimeError(
                f"a backward reached the model while a step was half done: optimizer(s) {', '.join(waiting)} have not "
                "stepped on the gradients the others stepped on. Step every optimizer, or call zero_grad() on one that "
                "should skip this step (or engine.zero_grad()), before the next backward; optimizers stepped at "
                "different rates over accumulated gradients are not supported"
            )
        self._phase_before_backward = self.phase
        self._backward_synced = self._synced
        self._usage.reset()  # this backward may add gradients: agree again
        self.phase = Phase.BACKWARD
        # Weak: the callback must not keep a dropped engine alive through autograd.
        ref = weakref.ref(self)
        torch.autograd.Variable._execution_engine.queue_callback(lambda: ref() and ref()._on_backward_end())

    def _on_backward_end(self) -> None:
        synced = self._backward_synced
        # The phase moves on first: what the flush launches is no longer overlapped
        # with autograd (tests observe this).
        reduces = bool(self.trainable_units) and any(GradientReducer.reduces_now(u, synced) for u in self.trainable_units)
        before = self._phase_before_backward
        if reduces or before in (Phase.REDUCED, Phase.GRADS_READY):
            self.phase = Phase.REDUCED
        else:
            self.phase = Phase.ACCUMULATED
        self._grads.begin()
        self.reducer.flush(synced, self._usage.start if synced else None)
        if synced:
            self._usage.read_rider()
        if self.gatherer is not None:
            self.gatherer.end_of_backward()
        self._serve_grad_reads(True)

    _phase_before_backward = Phase.IDLE
    _grad_reads_on = True

    def _serve_grad_reads(self, on: bool) -> None:
        """Between backward and forward ``.grad`` is served; plain during both."""
        if self._grad_reads and on != self._grad_reads_on:
            set_grad_reads(self.trainable_units, on)
            self._grad_reads_on = on

    def _on_root_pre_forward(self, args, kwargs):
        self._check_open()
        self._serve_grad_reads(False)
        if torch.is_grad_enabled() and self.module.training:
            self.comm.training_forwards += 1  # [Note: a skipped batch] in communication/diagnosis.py
        if self.gatherer is not None:
            self.gatherer.begin_forward()
        if torch.is_grad_enabled() and self._synced:
            for u in self.trainable_units:
                u.grads.before_synced_forward()
        if self.policies.precision.mixed:
            return cast_floating_inputs(args, kwargs, self.policies.precision.compute_dtype)
        return None

    def _on_root_post_forward(self) -> None:
        if self.gatherer is not None:
            self.gatherer.end_of_forward()
        if not torch.is_grad_enabled():
            self._serve_grad_reads(True)  # no backward follows this forward

    # -- what adapters ask ----------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (the model is no longer managed)."""
        return self.phase is Phase.CLOSED

    @property
    def loss_scale(self) -> float:
        """The fp16 loss scale :meth:`backward` multiplies the loss by (1.0 otherwise)."""
        return float(self.scaler.scale)

    def _check_open(self) -> None:
        check_open(self.phase)

    # -- training API -------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """``loss.backward()``, with the fp16 loss scale applied."""
        self._check_open()
        if self.config.check_finite_loss:
            check_finite_loss(self.comm, loss, self.global_step)
        if self.scaler.scale != 1.0:
            loss = loss * self.scaler.scale
        loss.backward(**kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient-accumulation micro-batches: stages 0/1 skip communication inside
        (stages 2/3 too with ``no_sync_reduces=False``; by default they reduce as they go)."""
        previous = self._synced
        self._synced = False
        try:
            yield
        finally:
            self._synced = previous

    @property
    def sync_gradients(self) -> bool:
        return self._synced

    def _prepare_master_grads(self, what: str = "step()") -> bool:
        """Agree on fp16 overflow and on which parameters got gradients ([Note: usage
        rider] in optim/usage.py) and move to GRADS_READY; return True on an overflow
        anywhere.  The fp32 gradients themselves are made unit by unit in the step."""
        if self.phase is Phase.GRADS_READY:
            return self._overflow
        check_grads_steppable(self.phase, what, synced=self._synced, stage=self.policies.stage,
                              reduces_in_no_sync=self.policies.gradients.reduces_in_no_sync,
                              dry_run=self.sharded.compute_device().type == "meta")
        if self.reducer.busy:
            self.reducer.flush(self._synced)
        self._overflow = overflow = self._usage.settle()
        self._grads.begin(1.0 / self.scaler.scale)
        self.phase = Phase.GRADS_READY
        return overflow

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, optimizer=None) -> torch.Tensor:
        """Clip this step's gradients by their global norm over every shard; return the
        norm before clipping (inf/nan after an fp16 overflow, in which case nothing is clipped).

        ``optimizer`` (an index, or one of the engine's optimizers): the norm and the
        clipping of that optimizer's parameters only, as ``clip_grad_norm_`` over its
        parameters is without ZeRO (Lightning's ``clip_gradients(opt, ...)``).  Collective."""
        k = self._clip_target("clip_grad_norm_", optimizer)
        overflow = self._prepare_master_grads("clip_grad_norm_()")
        total = self._grads.norm(self.trainable_units if k is None else self.units_of(k), float(norm_type))
        if overflow or not torch.isfinite(total):
            return total
        coef = float(max_norm) / (float(total) + 1e-6)
        if coef < 1.0:
            self._grads.scale(coef, k)
        return total

    def clip_grad_value_(self, clip_value: float, optimizer=None) -> None:
        """Clamp every gradient element (of ``optimizer``'s parameters only, when given) to
        ``[-clip_value, clip_value]`` (after fp16 unscaling).  Element-wise, so each rank
        clamps its own shard."""
        k = self._clip_target("clip_grad_value_", optimizer)
        if not self._prepare_master_grads("clip_grad_value_()"):
            self._grads.clamp(float(clip_value), k)

    def _clip_target(self, what: str, optimizer) -> Optional[int]:
        """None (every optimizer's parameters) or the index ``optimizer`` names; an
        engine with one optimizer clips the same parameters either way (None)."""
        self._check_open()
        if optimizer is None and self.optimizers:
            return None
        k = self.sharded.which_optimizer(optimizer, what)
        return None if len(self.optimizers) == 1 else k

    # [Note: step rounds]
    # A step is a round over the optimizers: the first step() call of a round agrees on
    # fp16 overflow and usage and clips (every optimizer's gradients together); each
    # optimizer then updates its own units and gathers them; when every optimizer has
    # stepped, or at zero_grad(), the round ends (loss scale, global_step, gradients
    # cleared).  engine.step() is a whole round; engine.optimizers[k].step() is one
    # optimizer's part of it ([Note: several optimizers] in optimizer_set.py).
    def step(self, optimizer_index: Optional[int] = None) -> bool:
        """Apply the optimizers (or only optimizer ``optimizer_index``: see [Note: step
        rounds]) to this rank's shards and refresh the parameters.

        Returns False when an fp16 overflow (on any rank) skipped the step."""
        self._check_open()
        if not self.optimizers:
            raise RuntimeError("step() needs an optimizer: initialize was called with optimizer=None")
        ks = list(range(len(self.optimizers))) if optimizer_index is None else [optimizer_index]
        if self._stepped is None:
            self._start_round()
        again = [k for k in ks if k in self._stepped]
        if again:
            raise RuntimeError(
                f"optimizer {again[0]} ({type(self.inner_optimizers[again[0]]).__name__}) was already stepped since the "
                "last zero_grad(): its gradients were applied once; call zero_grad() and run a backward before stepping "
                "it again"
            )
        self._stepped.update(ks)
        if not self._round_skipped:
            # The host step at memory speed ([Note: fused host step] in host_step.py).
            host_fused = self.policies.offload.offloads_optimizer and self.config.host_optimizer_step == "fused"
            for k in ks:
                units = self.units_of(k)
                with engine_steps(self.inner_optimizers[k]):
                    step_units(self.inner_optimizers[k], units, self._grads.of, self._usage.used_of,
                               disk=self.disk_offload, comm=self.comm, host_fused=host_fused)
                self.sharded.all_gather_updated(units)
                self._keep.refresh(units)  # inside keep_gathered(): no stale copy
        skipped = self._round_skipped
        if len(self._stepped) == len(self.optimizers):
            if self.policies.gradients.step_clears:
                self.zero_grad()  # ends the round
            else:
                self._end_round()  # the gradients stay, readable, until zero_grad()
                self._after_round()
        return not skipped

    _round_skipped = False

    def _start_round(self) -> None:
        overflow = self._prepare_master_grads("step()")
        self._stepped, self._round_skipped = set(), overflow
        if overflow:
            if self.scaler.dynamic and self.scaler.scale <= self.scaler.min_scale and self.config.on_min_loss_scale == "raise":
                self._stepped = None
                raise_at_min_loss_scale(self.sharded, self.scaler, self.global_step)
            return
        if self.config.gradient_clipping > 0:
            self.clip_grad_norm_(self.config.gradient_clipping)

    def _end_round(self) -> None:
        """The bookkeeping of a step, once per round (see [Note: step rounds])."""
        if self._stepped is None:
            return
        self._stepped = None
        self.last_step_skipped = self._round_skipped
        self.scaler.update(self._round_skipped)
        if self._round_skipped:
            self._skip_watch.skipped(self.scaler, self.global_step)
            return
        self._skip_watch.stepped()
        self.global_step += 1

    def zero_grad_of(self, k: int) -> None:
        """``engine.optimizers[k].zero_grad()``.  With several optimizers, once optimizer
        ``k`` has stepped in a round its gradients are spent and the round's end clears
        them (with everyone else's): nothing to do now, so ``a.step(); a.zero_grad();
        b.step()`` steps ``b`` on its gradients as under DDP.  Otherwise every gradient is
        cleared and the round ends, as :meth:`zero_grad`."""
        if len(self.optimizers) > 1 and self._stepped and k in self._stepped:
            return
        self.zero_grad()

    def zero_grad(self) -> None:
        """Clear every gradient; ends a step round in progress ([Note: step rounds])."""
        self._end_round()
        for u in self.trainable_units:
            u.grads.zero()
            u.set_optimizer_grads(None)
        self._usage.clear()
        self._grads.begin()
        self._after_round()

    def _after_round(self) -> None:
        if self.gatherer is not None:
            self.gatherer.end_of_step()
        if self.phase is not Phase.CLOSED:
            self.phase = Phase.IDLE
        self.comm.start_step(self.global_step)

    # -- teardown ------------------------------------------------------------------------------
    def close(self, unshard: bool = False) -> None:
        """Remove every hook.  Parameters stay as they are (stage 3: sharded) unless
        ``unshard``: then every rank gets whole, independent parameters back, in their
        original dtypes (from the fp32 master values), and the model is an ordinary
        module again.  Collective when ``unshard``."""
        if unshard and self.phase is not Phase.CLOSED:
            self.sharded.unshard()
            unguard_parameters(self.units)
        for u in self.units:
            u.closed = True
        undo, self._undo = self._undo, []
        for step in reversed(undo):
            step()
        self.phase = Phase.CLOSED
