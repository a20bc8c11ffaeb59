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
import enum
import math
import weakref
from typing import Dict, Iterator, List, Optional

import torch
import torch.nn as nn

from . import agreement
from .accounting import optimizer_state_bytes
from .execution.activation import apply_activation_checkpointing
from .communication.comm import Communicator
from .config import ZeroConfig
from .reliability.fingerprint import check_same_setup
from .sharding.flat_unit import FlatUnit
from .offload.disk_offload import make_disk_offload
from .sharding.gather import ModuleGroup, ParameterGatherer
from .execution.hooks import cast_floating_inputs, register_hooks
from .sharding.keep_gathered import KeepGathered, methods_to_wrap, wrap_methods
from .reliability.guard import guard_parameters, unguard_parameters
from .materialize.deferred import forget_meta_moves, initialize_deferred, meta_parameter_ids
from .materialize.pretrained import load_pretrained
from .materialize.recording import plan_replay, replaying
from .optim.optimizer import ZeroOptimizer, repoint_optimizer
from .optim.optimizer_kinds import is_elementwise
from .optim.optimizer_set import OptimizerSet, as_optimizer_list
from .sharding.whole_params import assign_owners
from .optim.loss_scale import LossScaler
from .reliability.misuse import SkipWatch, engine_steps, guard_misuse, route_module_zero_grad
from .sharding.param_shard import ShardState, whole_values
from .sharding.planner import plan_partitioned_params, plan_replicated_params
from .policy import Policies
from .sharding.reducer import GradientReducer
from .optim.stepper import step_units


# Which engine manages which module.  Weak both ways: the engine holds its module, so a
# strong value would keep every model (and its process group) alive until exit.
_ENGINES: "weakref.WeakKeyDictionary[nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()

# What the usage agreement settles to when the rider said no rank missed a gradient.
_EVERY_PARAMETER_USED = object()


def engine_of(module: nn.Module) -> Optional["ZeroEngine"]:
    """The open ZeroEngine managing ``module``, or None."""
    ref = _ENGINES.get(module)
    engine = ref() if ref is not None else None
    return engine if engine is not None and engine.phase is not Phase.CLOSED else None


class Phase(enum.Enum):
    """Where the engine is in a training step (see [Note: lifecycle])."""

    IDLE = "idle"  # no gradient since the last step() / zero_grad()
    BACKWARD = "backward"  # autograd is running backward through the model
    ACCUMULATED = "accumulated"  # backward(s) inside no_sync only: local, unreduced gradients
    REDUCED = "reduced"  # a backward reduced the gradients: step() may follow
    GRADS_READY = "grads_ready"  # step's fp32 gradients are prepared (clip / overflow checked)
    CLOSED = "closed"  # close() was called: nothing is managed any more


def _broadcast_from_rank0(model: nn.Module, comm, skip) -> None:
    """Start every rank from rank 0's values (as DDP does), tensor by tensor."""
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if id(t) not in skip and t.device.type != "meta":
                comm.broadcast(t.data, 0, label=f"the initial value of {name}")


def _weak_method(bound):
    """A callable that does not keep its object alive (stored on parameters, which
    autograd's C++ side holds)."""
    ref = weakref.WeakMethod(bound)

    def call(*args):
        method = ref()
        return method(*args) if method is not None else False

    return call


def _group_name(members, module_names) -> str:
    """A gather's name in messages: its module, or the first and last of merged siblings."""
    names = [module_names.get(id(m), "") or "<root>" for m in members]
    if len(names) == 1:
        return names[0]
    return f"{names[0]} .. {names[-1]} ({len(names)} merged)"


def _materialization_device(device, comm) -> torch.device:
    """Where deferred (meta) parameters are materialised: the given device; meta again on
    the fake process group (planning dry runs); else the current accelerator or CPU."""
    if device is not None:
        return torch.device(device)
    if comm.group is not None and torch.distributed.get_backend(comm.group) == "fake":
        return torch.device("meta")
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class ZeroEngine:
    """Owns the units, the reducer, the gatherer and the loss scaler for one model.

    [Note: lifecycle]
    ``phase`` is one :class:`Phase`; every misuse check is a transition that is not
    allowed from the current phase:

    * IDLE/ACCUMULATED --first gradient--> BACKWARD --end--> REDUCED (synchronised or
      sharded gradients) or ACCUMULATED (no_sync at stages 0-1: nothing reduced);
    * REDUCED --a synchronised backward--> error (its gradients would be reduced twice);
    * REDUCED --clip / overflow check--> GRADS_READY --step()--> IDLE;
    * step() from IDLE (no backward) or ACCUMULATED (unreduced gradients) is an error;
    * close() --> CLOSED, from which every call is an error.
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
        self.config = ZeroConfig.coerce(config)
        self.policies = pol = Policies.from_config(self.config)
        self.module = model
        self.comm = Communicator(process_group)
        self.comm.configure(pol.comm.timeout, pol.comm.check_call_order)
        self.scaler = LossScaler.from_config(self.config)
        self.global_step = 0
        self.last_step_skipped = False
        self.phase = Phase.IDLE
        self._skip_watch = SkipWatch()  # repeated fp16 skips with no way out warn
        self._synced = True  # False inside no_sync(): a mode, not a phase
        self._backward_synced = True  # the mode the running backward started in
        # Unscale / clip operations for this step's gradients: (op, value, optimizer index
        # or None for every optimizer's units).
        self._step_grad_ops: List[tuple] = []
        self._overflow = False
        self._used: Optional[Dict[int, List[bool]]] = None  # per unit: which parameters got a gradient
        self.last_load_report: Optional[Dict[str, list]] = None  # from pretrained=: missing / unexpected names
        existing = engine_of(model)
        if existing is not None:
            raise ValueError(
                f"this {type(model).__name__} is already managed by a ZeroEngine; call engine.close() on that one "
                "first (engine_of(model) returns it)"
            )
        # Before the model is touched: a keep_gathered_methods name that is not a method fails here.
        methods = methods_to_wrap(model, self.config.keep_gathered_methods) if pol.stage.shards_parameters else []
        # Parameters built inside init_context() live on the meta device until the
        # units below are filled (materialize/); decide where they will live.
        pending = meta_parameter_ids(model)
        self.device = _materialization_device(device, self.comm) if pending else None
        self.orig_dtype_by_id = {id(p): p.dtype for p in model.parameters()}

        # One optimizer or several ([Note: several optimizers] in optimizer_set.py).
        self.inner_optimizers: List[torch.optim.Optimizer] = as_optimizer_list(optimizer)
        optimizer = OptimizerSet(self.inner_optimizers) if self.inner_optimizers else None
        # Before any other collective: ranks set up differently fail here, naming the difference.
        check_same_setup(self.comm, model, optimizer, self.config, sync_module_states=sync_module_states, pretrained=pretrained)
        if sync_module_states and self.comm.world_size > 1:
            _broadcast_from_rank0(model, self.comm, skip=pending)
        # Parameters recorded by init_context get an eager build's values, replayed below
        # ([Note: recorded initialisation] in materialize/recording.py).
        replay = plan_replay(model, self.comm) if pending and self.device.type != "meta" else None

        shards_parameters = pol.stage.shards_parameters
        plan = (plan_partitioned_params if shards_parameters else plan_replicated_params)(model, optimizer, self.config)
        self.untouched = plan.untouched
        self.unit_module_classes = list(plan.unit_module_names)
        self.orig_dtype_untouched = {n: p.dtype for n, p in plan.untouched.items()}
        compute_dtype = pol.precision.compute_dtype
        for p in plan.untouched.values():
            if p.is_floating_point() and p.dtype != compute_dtype and id(p) not in pending:
                p.data = p.data.to(compute_dtype)

        module_names = {id(m): n for n, m in model.named_modules()}
        self.units: List[FlatUnit] = []
        # Disk offload's per-rank files (disk_offload.py); failures are agreed on below.
        self.disk_offload = make_disk_offload(pol.offload, self.comm)
        for i, spec in enumerate(plan.units):
            first, last = spec.names[0][0], spec.names[-1][0]
            whole = not shards_parameters or spec.persistent
            if not whole and spec.module is not None:
                label = f"module {_group_name(spec.members or (spec.module,), module_names)}"
            else:
                label = f"bucket {i} ({first}{' ... ' + last if last != first else ''})"
            self.units.append(
                FlatUnit(i, spec.params, spec.names, group_index=spec.group_index, policies=pol, rank=self.comm.rank,
                         world_size=self.comm.world_size, whole=whole, device=self.device, label=label,
                         disk=self.disk_offload)
            )
        self.trainable_units = [u for u in self.units if u.trainable]
        if self.disk_offload is not None:
            self.disk_offload.check("creating the disk-offload files")

        # The user's optimizers now update this rank's shards.
        self.optimizers: List[ZeroOptimizer] = []
        # Where each parameter the user gave an optimizer now lives, per param group of
        # every optimizer in order (see param_places_of): (unit index, position) or None
        # (not partitioned), for optimizer state dicts in torch's format.
        self.optimizer_param_places: List[List[Optional[tuple]]] = []
        self._stepped: Optional[set] = None  # the optimizers stepped in this round ([Note: step rounds])
        if optimizer is not None:
            place = {id(p): (u.index, i) for u in self.units for i, p in enumerate(u.params)}
            self.optimizer_param_places = [[place.get(id(p)) for p in g["params"]] for g in optimizer.param_groups]
            self._group_offsets = optimizer.group_offsets
            for u in self.trainable_units:
                u.optimizer_index, u.local_group_index = optimizer.locate(u.group_index)
            # Shape-aware optimizers get whole parameters ([Note: element-wise or whole-parameter]).
            whole = [u for u in self.trainable_units
                     if not is_elementwise(self.inner_optimizers[u.optimizer_index], self.config.elementwise_optimizers)]
            for u, owners in zip(whole, assign_owners([u.layout for u in whole])):
                u.use_whole_params(owners)
            for k, opt in enumerate(self.inner_optimizers):
                per_group: Dict[int, list] = {}
                for u in self.units_of(k):
                    per_group.setdefault(u.local_group_index, []).extend(u.optim_params)
                repoint_optimizer(opt, per_group)
            self.optimizers = [ZeroOptimizer(self, k) for k in range(len(self.inner_optimizers))]
        guard_misuse(self)  # the inner optimizer's own step(), torch's clip_grad_norm_ ([Note: silent misuse])

        # C_B: two buckets' worth in flight; a unit bigger than that is reduced alone.
        # (Not twice the largest unit: one big root unit would let every block's bucket
        # pile up beside the activations in backward.)
        self.reducer = GradientReducer(
            self._reduction_order(plan), self.comm, overlap=pol.comm.overlap,
            max_in_flight=2 * pol.comm.reduce_bucket_size, rider=_weak_method(self._usage_rider),
        )

        self.gatherer: Optional[ParameterGatherer] = None
        if shards_parameters:
            groups: Dict[int, ModuleGroup] = {}
            for u, spec in zip(self.units, plan.units):
                if spec.module is None:
                    continue
                g = groups.get(id(spec.module))
                if g is None:
                    g = groups[id(spec.module)] = ModuleGroup(spec.module, _group_name(spec.members or (spec.module,), module_names),
                                                              [], members=spec.members)
                g.units.append(u)
                g.numel += u.layout.padded_numel
            self.gatherer = ParameterGatherer(list(groups.values()), model, self.comm, prefetch_numel=pol.comm.prefetch_numel)

        self._keep = KeepGathered(self.gatherer, self.units, max_bytes=self.config.keep_gathered_max_bytes,
                                  bucket_numel=pol.comm.allgather_bucket_size, rank=self.comm.rank)
        self._handles = register_hooks(self)
        _ENGINES[model] = weakref.ref(self)
        cfg = self.config
        self._undo_checkpointing = (
            apply_activation_checkpointing(model, cfg.activation_checkpointing, cfg.offload_activations)
            if cfg.activation_checkpointing
            else []
        )

        if pending and self.device.type != "meta":
            forget_meta_moves(model)
            with replaying(replay):
                if pretrained is not None:
                    self.last_load_report = load_pretrained(self, pretrained, pending)
                else:
                    initialize_deferred(self, pending)
        elif pretrained is not None:
            self.last_load_report = load_pretrained(self, pretrained)
        if shards_parameters:
            # Last: materialisation and loading above write through the parameters.
            guard_parameters(self.units, on_access=_weak_method(self.gatherer.on_access))
        # generate() and the like run in keep_gathered() ([Note: keep gathered]).
        self._unwrap_methods = wrap_methods(self, methods) + [route_module_zero_grad(self)]
        if self.disk_offload is not None:
            self.disk_offload.evict_all()  # the values written above go to disk, out of memory

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

    def units_of(self, k: int) -> List[FlatUnit]:
        """The trainable units optimizer ``k`` updates."""
        return [u for u in self.trainable_units if u.optimizer_index == k]

    def param_places_of(self, k: int) -> List[List[Optional[tuple]]]:
        """:attr:`optimizer_param_places` of optimizer ``k``'s own param groups."""
        start = self._group_offsets[k]
        return self.optimizer_param_places[start : start + len(self.inner_optimizers[k].param_groups)]

    def parameters_of(self, k: int) -> List[torch.nn.Parameter]:
        """The model's parameters that optimizer ``k`` updates."""
        return [p for u in self.units_of(k) for p in u.params]

    def optimizer_of_parameters(self, parameters) -> Optional[int]:
        """None when the trainable ones among ``parameters`` are all of the model's
        trainable parameters; ``k`` when they are exactly optimizer ``k``'s; otherwise a
        ValueError (ZeRO clips every optimizer's gradients, or one optimizer's, together)."""
        given = {id(p) for p in parameters if p.requires_grad}
        every = {id(p) for u in self.trainable_units for p in u.params}
        if given == every:
            return None
        for k in range(len(self.optimizers)):
            if given == {id(p) for p in self.parameters_of(k)}:
                return k
        raise ValueError(
            f"{len(given)} of the {len(every)} trainable parameters of a ZeroEngine's model were given: ZeRO clips all "
            "of a model's gradients together, or all of one optimizer's. Pass model.parameters() (or exactly the "
            "parameters of one of its optimizers)"
        )

    def optimizer_index(self, optimizer) -> int:
        """The index of ``optimizer`` (a user optimizer or its ZeroOptimizer) in this engine."""
        for k, (inner, outer) in enumerate(zip(self.inner_optimizers, self.optimizers)):
            if optimizer is inner or optimizer is outer:
                return k
        raise ValueError(f"this {type(optimizer).__name__} is not one of this engine's optimizers")

    # ------------------------------------------------------------------------------------
    def _reduction_order(self, plan) -> List[FlatUnit]:
        units = [u for u in self.units if u.trainable]
        if not self.policies.stage.shards_parameters:
            return units  # already built in reverse registration order
        # Stage 3: unit modules in reverse registration order, the root last, then the
        # small persistent units (their gradients are ready at various points).
        order = {id(m): i for i, m in enumerate(self.module.modules())}

        def key(u_spec):
            u, spec = u_spec
            if spec.persistent:
                return (2, 0)
            if spec.module is self.module:
                return (1, 0)
            return (0, -order[id(spec.module)])

        pairs = [(u, s) for u, s in zip(self.units, plan.units) if u.trainable]
        return [u for u, _ in sorted(pairs, key=key)]

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
        self._usage_in_flight = None  # this backward may add gradients: agree again
        self._rider = None
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
        self._step_grad_ops = []
        self.reducer.flush(synced, self._start_usage_agreement if synced else None)
        if synced:
            self._read_usage_rider()
        if self.gatherer is not None:
            self.gatherer.end_of_backward()

    _unwrap_methods = ()  # until __init__ wrapped the keep_gathered_methods
    _phase_before_backward = Phase.IDLE

    def _on_root_pre_forward(self, args, kwargs):
        self._check_open()
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

    def _unshard(self) -> None:
        for unit in self.units:
            full = whole_values(unit.params_store, self.comm, label=f"unsharding {unit.label}")
            for i, p in enumerate(unit.params):
                p.data = unit.param_view(full.to(unit.device), i).to(unit.orig_dtypes[i], copy=True)
                p.grad = None
        for u in self.trainable_units:
            u.set_optimizer_grads(None)
        for name, p in self.untouched.items():  # frozen parameters were cast to the compute dtype
            if p.dtype != self.orig_dtype_untouched[name]:
                p.data = p.data.to(self.orig_dtype_untouched[name])

    # -- what adapters ask ----------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (the model is no longer managed)."""
        return self.phase is Phase.CLOSED

    @property
    def loss_scale(self) -> float:
        """The fp16 loss scale :meth:`backward` multiplies the loss by (1.0 otherwise)."""
        return float(self.scaler.scale)

    def original_dtype(self, param: torch.nn.Parameter) -> torch.dtype:
        """The dtype ``param`` had when the engine was built (its master's dtype under
        mixed precision, where the module holds a 16-bit compute copy)."""
        return self.orig_dtype_by_id.get(id(param), param.dtype)

    def _check_open(self) -> None:
        if self.phase is Phase.CLOSED:
            raise RuntimeError("this ZeroEngine was closed: the model's parameters are no longer managed; build a new engine with zero_strategy.initialize")

    # -- training API -------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """``loss.backward()``, with the fp16 loss scale applied."""
        self._check_open()
        if self.config.check_finite_loss:
            self._check_finite_loss(loss)
        if self.scaler.scale != 1.0:
            loss = loss * self.scaler.scale
        loss.backward(**kwargs)

    def _check_finite_loss(self, loss: torch.Tensor) -> None:
        # Agreed by every rank, so all stop together (a lone rank stopping would leave the
        # others waiting in backward's collectives).
        finite = bool(torch.isfinite(loss.detach()).all())
        mine = None if finite else FloatingPointError(f"loss {float(loss.detach().float().reshape(-1)[0])}")
        ranks = agreement.exchange(self.comm, "the finite-loss check", mine, error_type=FloatingPointError).failed
        if ranks:
            raise FloatingPointError(
                f"the loss is not finite (NaN or inf) at step {self.global_step} on rank(s) {ranks} "
                f"(this rank's loss: {float(loss.detach().float().reshape(-1)[0])}); stopped by "
                "ZeroConfig.check_finite_loss before it reached the weights"
            )

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient-accumulation micro-batches: stages 0/1 skip communication inside."""
        previous = self._synced
        self._synced = False
        try:
            yield
        finally:
            self._synced = previous

    @property
    def sync_gradients(self) -> bool:
        return self._synced

    def _check_grads_steppable(self, what: str) -> None:
        """The transitions into GRADS_READY that are misuse (see [Note: lifecycle])."""
        meta = self._device().type == "meta"  # planning dry runs step once to create optimizer state
        if self.phase is Phase.BACKWARD:
            raise RuntimeError(f"{what} was called while backward is still running through the model")
        if self.phase is Phase.IDLE and not meta:
            raise RuntimeError(
                f"{what} was called but no backward reached the model since the last step() or zero_grad(): "
                "there are no gradients to apply. Call engine.backward(loss) (or loss.backward()) first."
            )
        if self.phase is Phase.ACCUMULATED:
            raise RuntimeError(
                f"{what} was called after backward passes that all ran inside no_sync(): at stage "
                f"{self.policies.stage.stage} their gradients are local to each rank and were never reduced, so "
                "the update would differ per rank. Run the last micro-batch's backward outside no_sync()."
            )
        if not self._synced and not self.policies.stage.shards_gradients:
            raise RuntimeError(
                f"{what} was called inside no_sync(): at stage {self.policies.stage.stage} gradients are reduced "
                "only by a backward outside no_sync(); call step() after leaving the no_sync() block."
            )

    def _prepare_master_grads(self, what: str = "step()") -> bool:
        """Agree on fp16 overflow and move to GRADS_READY; return True on an overflow
        anywhere.  The fp32 gradients themselves are made unit by unit in the step."""
        if self.phase is Phase.GRADS_READY:
            return self._overflow
        self._check_grads_steppable(what)
        if self.reducer.busy:
            self.reducer.flush(self._synced)
        self._overflow = overflow = self._agree_overflow_and_usage()
        inv_scale = 1.0 / self.scaler.scale
        self._step_grad_ops = [("mul", inv_scale, None)] if inv_scale != 1.0 else []
        self.phase = Phase.GRADS_READY
        return overflow

    def _usage_flags(self, overflow: float = 0.0) -> torch.Tensor:
        flags = [overflow]
        for u in self.trainable_units:
            received = u.grads.received
            flags.extend(1.0 if i in received else 0.0 for i in range(len(u.params)))
        return torch.tensor(flags, device=self._device())

    # The agreement started at the end of the last synchronised backward: a control
    # reduction in flight, or _EVERY_PARAMETER_USED when the rider settled it.
    _usage_in_flight = None
    _rider: Optional[torch.Tensor] = None  # this backward's rider, once the last unit was launched

    def _agreement_wanted(self) -> bool:
        # Not with fp16 loss scaling (its overflow flag needs the reduced gradients) nor
        # on a planning dry run (meta tensors).
        return not (self.policies.precision.loss_scaling or not self.trainable_units or self._device().type == "meta")

    # [Note: usage rider]
    # Every synchronised step must learn which parameters got a gradient on any rank
    # (the step leaves the others alone).  Usually every one did, and a collective of
    # its own costs a fixed latency, which on a small model is a large part of the step.
    # So on gloo the last gradient collective carries one flag per rank ("some parameter
    # got no gradient here", [Note: riders] in collectives.py); only when its sum is not
    # zero do the ranks exchange the per-parameter flags, after the flush.  Elsewhere
    # (NCCL) the exchange is issued while the last buckets are in flight.
    def _usage_rider(self) -> Optional[torch.Tensor]:
        if not (self.comm.carries_riders and self._agreement_wanted()):
            return None
        missed = any(len(u.grads.received) < len(u.params) for u in self.trainable_units)
        self._rider = torch.tensor([1.0 if missed else 0.0], device=self._device())
        return self._rider

    def _read_usage_rider(self) -> None:
        rider, self._rider = self._rider, None
        if rider is None:
            return
        if float(rider.item()) == 0.0:
            self._usage_in_flight = _EVERY_PARAMETER_USED
        else:  # some rank missed a gradient: agree on which
            self._usage_in_flight = self.comm.control_all_reduce_async(
                self._usage_flags(), "max", label="which parameters got gradients")

    def _start_usage_agreement(self) -> None:
        """Issue the agreement on which parameters got gradients while the last gradient
        buckets are still in flight, so its latency hides behind theirs (unless the
        last bucket carries the rider: [Note: usage rider])."""
        self._usage_in_flight = None
        if self._rider is not None or not self._agreement_wanted():
            return
        self._usage_in_flight = self.comm.control_all_reduce_async(
            self._usage_flags(), "max", label="which parameters got gradients")

    def _agree_overflow_and_usage(self) -> bool:
        """One small all-reduce (max over ranks) of the fp16 overflow flag and of which
        parameters got a gradient this step on any rank (the step leaves the others
        alone, as DDP does: [Note: one optimizer tensor per parameter] in flat_unit.py).
        Without loss scaling it was issued at the end of the last backward
        (:meth:`_start_usage_agreement`) and is only waited for here.
        Returns whether any rank overflowed."""
        units = self.trainable_units
        in_flight, self._usage_in_flight = self._usage_in_flight, None
        if in_flight is _EVERY_PARAMETER_USED:
            self._used = None
            return False
        if in_flight is not None:
            agreed = in_flight.result()
        else:
            overflow = 0.0
            if self.policies.precision.loss_scaling:
                overflow = float(any(not bool(torch.isfinite(u.grads.reduced()).all()) for u in units))
            agreed = self._usage_flags(overflow)
            if agreed.numel() > 1 or self.policies.precision.loss_scaling:
                what = "which parameters got gradients" + (" and the fp16 overflow check" if self.policies.precision.loss_scaling else "")
                agreed = self.comm.control_all_reduce(agreed, "max", label=what)
        if agreed.device.type == "meta":  # a planning dry run: every parameter counts as used
            self._used = None
            return False
        values = agreed.tolist()
        self._used, at = {}, 1
        for u in units:
            self._used[u.index] = [v > 0 for v in values[at : at + len(u.params)]]
            at += len(u.params)
        return values[0] > 0

    def _used_of(self, unit: FlatUnit):
        return None if self._used is None else self._used.get(unit.index)

    def _device(self) -> torch.device:
        return self.units[0].device if self.units else torch.device("cpu")

    def _step_grad(self, unit: FlatUnit, *, for_norm: bool = False) -> torch.Tensor:
        """This unit's gradient as the optimizer will see it: this rank's reduced slice,
        on the optimizer's device in fp32, with this step's unscale / clip applied."""
        g = unit.grads.reduced()
        target = unit.params_store.optimizer_target
        ops = [(op, value) for op, value, k in self._step_grad_ops if k is None or k == unit.optimizer_index]
        if not ops and g.dtype == target.dtype and g.device == target.device:
            return g
        out = g.to(device=target.device, dtype=target.dtype, copy=True)
        for op, value in ops:
            if op == "mul":
                out.mul_(value)
            else:
                out.clamp_(-value, value)
        return out

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, optimizer=None) -> torch.Tensor:
        """Clip this step's gradients by their global norm over every shard; return the
        norm before clipping (inf/nan after an fp16 overflow, in which case nothing is clipped).

        ``optimizer`` (an index, or one of the engine's optimizers): the norm and the
        clipping of that optimizer's parameters only, as ``clip_grad_norm_`` over its
        parameters is without ZeRO (Lightning's ``clip_gradients(opt, ...)``).  Collective."""
        self._check_open()
        if not self.optimizers:
            raise RuntimeError("clip_grad_norm_ needs an optimizer: initialize was called with optimizer=None")
        k = self._optimizer_selector(optimizer)
        overflow = self._prepare_master_grads("clip_grad_norm_()")
        norm_type = float(norm_type)
        dev = self._device()
        local = torch.zeros((), device=dev, dtype=torch.float32)
        units = self.trainable_units if k is None else self.units_of(k)
        for u in units:  # one unit's fp32 temporary at a time
            g = self._step_grad(u).float()
            part = g.abs().max() if norm_type == math.inf else g.norm(norm_type) ** norm_type
            local = torch.maximum(local, part.to(dev)) if norm_type == math.inf else local + part.to(dev)
            del g
        if norm_type == math.inf:
            total = self._reduce_norm(local.reshape(1), "max")[0]
        else:
            total = self._reduce_norm(local.reshape(1), "sum")[0] ** (1.0 / norm_type)
        if overflow or not torch.isfinite(total):
            return total
        coef = float(max_norm) / (float(total) + 1e-6)
        if coef < 1.0:
            self._step_grad_ops.append(("mul", coef, k))
        return total

    def clip_grad_value_(self, clip_value: float, optimizer=None) -> None:
        """Clamp every gradient element (of ``optimizer``'s parameters only, when given) to
        ``[-clip_value, clip_value]`` (after fp16 unscaling).  Element-wise, so each rank
        clamps its own shard."""
        self._check_open()
        if not self.optimizers:
            raise RuntimeError("clip_grad_value_ needs an optimizer: initialize was called with optimizer=None")
        k = self._optimizer_selector(optimizer)
        if self._prepare_master_grads("clip_grad_value_()"):
            return
        self._step_grad_ops.append(("clamp", float(clip_value), k))

    def _optimizer_selector(self, optimizer) -> Optional[int]:
        """None (every optimizer) or the index ``optimizer`` names (index or optimizer); an
        engine with one optimizer treats it as None (the same parameters)."""
        if optimizer is None or len(self.optimizers) == 1:
            return None
        if isinstance(optimizer, int) and not isinstance(optimizer, bool):
            if not 0 <= optimizer < len(self.optimizers):
                raise ValueError(f"optimizer={optimizer}: this engine has {len(self.optimizers)} optimizer(s)")
            k = optimizer
        else:
            k = self.optimizer_index(getattr(optimizer, "_optimizer", optimizer))  # a LightningOptimizer wraps it
        return k

    def _reduce_norm(self, local: torch.Tensor, op: str) -> torch.Tensor:
        # Replicated gradients (stage 0) are whole on every rank: nothing to combine.
        if self.policies.stage.gradients_are_replicated:
            return local
        return self.comm.control_all_reduce(local, op, label="the gradient norm")

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
        every = range(len(self.optimizers))
        ks = list(every) if optimizer_index is None else [optimizer_index]
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
            for k in ks:
                units = self.units_of(k)
                with engine_steps(self.inner_optimizers[k]):
                    step_units(self.inner_optimizers[k], units, self._step_grad, self._used_of,
                               disk=self.disk_offload, comm=self.comm, host_fused=self._host_fused)
                self._all_gather_updated_params(units)
                self._keep.refresh(units)  # inside keep_gathered(): no stale copy
        skipped = self._round_skipped
        if len(self._stepped) == len(self.optimizers):
            self.zero_grad()  # ends the round
        return not skipped

    _round_skipped = False

    @property
    def _host_fused(self) -> bool:
        # The host step at memory speed ([Note: fused host step] in host_step.py).
        return self.policies.offload.offloads_optimizer and self.config.host_optimizer_step == "fused"

    def _start_round(self) -> None:
        overflow = self._prepare_master_grads("step()")
        self._stepped, self._round_skipped = set(), overflow
        if overflow:
            if self.scaler.dynamic and self.scaler.scale <= self.scaler.min_scale and self.config.on_min_loss_scale == "raise":
                self._stepped = None
                self._raise_at_min_loss_scale()
            return
        if self.config.gradient_clipping > 0:
            self.clip_grad_norm_(self.config.gradient_clipping)

    def _end_round(self) -> None:
        """The bookkeeping of a step, once per round (see [Note: step rounds])."""
        if self._stepped is None:
            return
        self._stepped = None
        if self._round_skipped:
            self.scaler.update(True)
            self._skip_watch.skipped(self.scaler, self.global_step)
            self.last_step_skipped = True
            return
        self._skip_watch.stepped()
        self.scaler.update(False)
        self.last_step_skipped = False
        self.global_step += 1

    def _raise_at_min_loss_scale(self) -> None:
        local = []
        for u in self.trainable_units:
            g = u.grads.reduced()
            if bool(torch.isfinite(g).all()):
                continue
            bad = (~torch.isfinite(g)).nonzero().reshape(-1)
            lo = u.params_store.lo  # the shard's first element within the unit
            for i, (off, n) in enumerate(zip(u.layout.offsets, u.layout.numels)):
                if bool(((bad + lo >= off) & (bad + lo < off + n)).any()):
                    local.append(u.names[i][0])
        names = sorted({n for part in self.comm.all_gather_object(local, "overflow report") for n in part})
        shown = ", ".join(names[:20]) + (f", ... ({len(names)} in all)" if len(names) > 20 else "")
        raise FloatingPointError(
            f"fp16 gradients overflowed at step {self.global_step} while the loss scale is already at "
            f"min_loss_scale={self.scaler.min_scale:g}: the scale cannot go lower, so training would only keep "
            f"skipping steps. Parameters with inf/NaN gradients: {shown or '(none found after unscaling)'}. "
            "Lower the learning rate, use bf16, or set on_min_loss_scale='skip' to keep skipping."
        )

    def _all_gather_updated_params(self, units: List[FlatUnit]) -> None:
        """Units kept whole (stages 1-2, stage 3's persistent ones) need every rank's update."""
        if not self.policies.stage.gathers_after_step:
            return
        # Buckets of about allgather_bucket_size elements in flight; each bucket is one
        # batch of gathers into the kept buffers (comm.all_gather_kept).
        buckets, bucket, in_flight = [], [], 0
        for u in units:
            if not u.keep_full:
                continue  # stage 3: gathered on demand by the next forward
            store = u.params_store
            bucket.append((store.full.data, store.shard, f"the updated {u.label}"))
            in_flight += u.layout.padded_numel
            if in_flight > self.policies.comm.allgather_bucket_size:
                buckets.append(bucket)
                bucket, in_flight = [], 0
        if bucket:
            buckets.append(bucket)
        for bucket in buckets:
            for w in self.comm.all_gather_kept(bucket):
                w.wait()

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
        self._used = None
        self._usage_in_flight = None
        self._rider = None
        self._step_grad_ops = []
        if self.gatherer is not None:
            self.gatherer.end_of_step()
        if self.phase is not Phase.CLOSED:
            self.phase = Phase.IDLE
        self.comm.start_step(self.global_step)

    # -- inference regions (see [Note: keep gathered] in keep_gathered.py) -----------------------
    @contextlib.contextmanager
    def keep_gathered(self) -> Iterator[bool]:
        """Collective.  Stage 3: inside, every parameter stays gathered, so a loop of
        forwards (generate()) communicates nothing after the gather at the start; at
        the end they are sharded again.  Yields whether they are held: False when the
        gathered model would exceed ``keep_gathered_max_bytes`` (then each forward gathers
        layer by layer as usual, after a one-time warning).  Below stage 3 the
        parameters are always whole (True).  Entered automatically around the methods
        named in ``keep_gathered_methods`` (default: ``generate``)."""
        self._check_open()
        with self._keep.region() as holding:
            yield holding

    # -- reading and changing parameters outside forward ----------------------------------------
    @contextlib.contextmanager
    def gathered_parameters(self, *modules: nn.Module, modifier_rank: Optional[int] = None) -> Iterator[None]:
        """Collective.  Inside, the parameters of ``modules`` (default: the whole model) are
        whole on every rank and may be read (stage 3; stages 0-2 always hold them whole).

        ``modifier_rank=r`` keeps the changes rank ``r`` makes inside: on exit its values
        are broadcast and written into every rank's shard and fp32 master weights (in the
        compute dtype's precision).  Without it, changes made inside are discarded
        (stage 3) or must not be made (stages 0-2: the next step would overwrite them
        from the master weights).  Do not run the model's forward inside.
        """
        self._check_open()
        if modifier_rank is not None and not 0 <= int(modifier_rank) < self.comm.world_size:
            raise ValueError(f"modifier_rank must be a rank of the engine's process group (0..{self.comm.world_size - 1}), got {modifier_rank}")
        wanted = {id(p) for m in (modules or (self.module,)) for p in m.parameters()}
        units = [u for u in self.units if any(id(p) in wanted for p in u.params)]
        untouched = [p for p in self.untouched.values() if id(p) in wanted]
        gathered_here = []
        for u in units:
            if not u.keep_full and u.state is not ShardState.GATHERED:
                u.params_store.start_gather(self.comm, u.label)
                gathered_here.append(u)
        for u in gathered_here:
            u.params_store.finish_gather()
        try:
            yield
            if modifier_rank is not None:
                with torch.no_grad():
                    for u in units:
                        self.comm.broadcast(u.params_store.full.data, int(modifier_rank), label=f"the modified {u.label}")
                        u.params_store.adopt_gathered()
                    for p in untouched:
                        self.comm.broadcast(p.data, int(modifier_rank), label="a modified parameter")
        finally:
            for u in gathered_here:
                u.params_store.release()

    # -- reports ----------------------------------------------------------------------------
    def memory_report(self) -> Dict[str, int]:
        """Bytes held on this rank now, by category (model states and comm buffers)."""
        report = {"parameters": 0, "gradients": 0, "master_weights": 0, "optimizer_state": 0, "communication_buffers": 0, "offloaded": 0}
        for u in self.units:
            parts = dict(u.params_store.bytes())
            if u.grads is not None:  # summed: both may hold offloaded bytes (disk offload's shard)
                for k, v in u.grads.bytes().items():
                    parts[k] = parts.get(k, 0) + v
            if self.policies.offload.offloads_optimizer:
                parts["offloaded"] = parts.get("offloaded", 0) + parts["master_weights"]
            for k, v in parts.items():
                report[k] += v
        for p in self.untouched.values():
            report["parameters"] += p.numel() * p.element_size()
            if p.grad is not None:
                report["gradients"] += p.grad.numel() * p.grad.element_size()
        if self.inner_optimizers:
            report["optimizer_state"] = sum(optimizer_state_bytes(opt) for opt in self.inner_optimizers)
            if self.policies.offload.offloads_optimizer:
                report["offloaded"] += report["optimizer_state"]

        offloaded = report.pop("offloaded")
        report["total"] = sum(report.values())
        # What stays on the training device (the saving ZeRO-Offload buys) and what
        # lives in host memory instead.
        on_disk = self.disk_offload is not None
        report["host"] = 0 if on_disk else offloaded
        report["disk"] = offloaded if on_disk else 0  # in disk-offload files, not memory
        report["device"] = report["total"] - offloaded
        # Not held now, so outside the total: what a whole-parameter optimizer's step adds
        # (the owned cut parameters' whole value and gradient, [Note: whole-parameter optimizers]).
        report["whole_param_step"] = sum(u.whole_params.step_bytes() for u in self.trainable_units
                                         if u.whole_params is not None)
        return report

    def unit_summary(self) -> dict:
        """What was partitioned how: the stage, the unit module classes chosen (stage 3),
        every flat unit and, at stage 3, every gather group (module, class, elements)."""
        names = {id(m): n for n, m in self.module.named_modules()}
        groups = []
        if self.gatherer is not None:
            for g in self.gatherer.groups:
                groups.append({"module": names.get(id(g.module), "") or "<root>", "class": type(g.module).__name__,
                               "modules": [names.get(id(m), "") or "<root>" for m in g.members],
                               "numel": g.numel, "units": [u.index for u in g.units]})
        return dict(
            stage=self.policies.stage.stage,
            world_size=self.comm.world_size,
            unit_modules=list(self.unit_module_classes),
            num_units=len(self.units),
            partitioned_elements=sum(u.layout.numel for u in self.units if not u.keep_full or self.policies.stage.partitions_optimizer_state),
            whole_elements=sum(u.layout.numel for u in self.units if u.keep_full),
            units=[dict(index=u.index, label=u.label, numel=u.layout.numel, whole=u.keep_full, trainable=u.trainable)
                   for u in self.units],
            groups=groups,
            on_demand_gathers=self.gatherer.on_demand_gathers if self.gatherer is not None else 0,
        )

    def describe(self) -> str:
        """One line for a start-up log: stage, world size, units, model-state bytes per rank."""
        s = self.unit_summary()
        mb = self.memory_report()["total"] / 2**20
        members = sum(len(g["modules"]) for g in s["groups"])
        merged = f", {members} modules merged into {len(s['groups'])} gathers" if members > len(s["groups"]) else ""
        what = (f", unit modules {', '.join(s['unit_modules']) or '(root only)'} ({len(s['groups'])} gather groups{merged})"
                if s["groups"] else "")
        cfg = self.config
        precision = (f"{cfg.precision} autocast over fp32 parameters" if cfg.autocast_dtype is not None
                     else f"{cfg.precision} with fp32 master weights" if cfg.is_mixed_precision else "fp32")
        return (f"ZeRO stage {s['stage']} on {s['world_size']} rank(s): {s['num_units']} flat units{what}; "
                f"{precision}; model states {mb:.1f} MiB on this rank now")

    def comm_report(self):
        """Elements and bytes moved per collective kind since the last reset."""
        return self.comm.report()

    def reset_comm_report(self) -> None:
        self.comm.reset()

    # -- state dicts (see state.py) ------------------------------------------------------------
    def full_state_dict(self, rank0_only: bool = True) -> Dict[str, torch.Tensor]:
        from .state_dicts.state import full_state_dict

        return full_state_dict(self, rank0_only=rank0_only)

    def load_full_state_dict(self, state_dict: Dict[str, torch.Tensor], strict: bool = True) -> None:
        from .state_dicts.state import load_full_state_dict

        load_full_state_dict(self, state_dict, strict=strict)
        self._keep.refresh(self.units)

    def full_optimizer_state_dict(self, rank0_only: bool = True, optimizer=None) -> dict:
        """Collective.  The optimizer state as the user's optimizer would hold it without
        ZeRO (torch's format, whole tensors, the user's parameter order), on rank 0 (or
        every rank): what DDP saves, see [Note: torch-format optimizer state] in state.py.
        With several optimizers, ``optimizer`` (an index, or the optimizer) says whose."""
        self._check_open()
        from .state_dicts.state import full_optimizer_state_dict

        return full_optimizer_state_dict(self, rank0_only=rank0_only, optimizer=optimizer)

    def load_full_optimizer_state_dict(self, state_dict: dict, optimizer=None) -> None:
        """Load a torch-format optimizer state dict (ours, or a plain / DDP optimizer's
        for the same parameters); every rank passes the same one.  With several
        optimizers, ``optimizer`` (an index, or the optimizer) says whose it is."""
        self._check_open()
        from .state_dicts.state import load_full_optimizer_state_dict

        load_full_optimizer_state_dict(self, state_dict, optimizer=optimizer)
        self._settle_disk()

    def state_dict(self) -> dict:
        from .state_dicts.state import rank_state_dict

        return rank_state_dict(self)

    def load_state_dict(self, state_dict: dict) -> None:
        from .state_dicts.state import load_rank_state_dict

        load_rank_state_dict(self, state_dict)
        self._keep.refresh(self.units)
        self._settle_disk()

    def load_pretrained(self, path) -> Dict[str, list]:
        """Load safetensors weights (a file, or a directory with an index) into the
        shards; each rank reads only what it keeps.  Returns missing/unexpected keys."""
        report = load_pretrained(self, path)
        self._keep.refresh(self.units)
        return report

    # -- checkpoints (see checkpoint/) ------------------------------------------------------------
    def save_checkpoint(self, directory, client_state: Optional[dict] = None):
        """Collective: write a sharded checkpoint directory atomically."""
        from .checkpoint.directory import save_checkpoint

        try:
            return save_checkpoint(self, directory, client_state=client_state)
        finally:
            self._settle_disk()

    def load_checkpoint(self, directory, *, allow_reshard: bool = True, weights_only: Optional[bool] = True) -> Optional[dict]:
        """Collective: restore from a checkpoint saved at any world size and stage;
        returns the saved ``client_state``, unpickled with ``weights_only`` (default
        True: no code from the file runs; pass False only for a checkpoint you trust)."""
        from .checkpoint.directory import load_checkpoint

        try:
            client_state = load_checkpoint(self, directory, allow_reshard=allow_reshard, weights_only=weights_only)
        finally:
            self._settle_disk()
        self._keep.refresh(self.units)
        return client_state

    # -- teardown ------------------------------------------------------------------------------
    def close(self, unshard: bool = False) -> None:
        """Remove every hook.  Parameters stay as they are (stage 3: sharded) unless
        ``unshard``: then every rank gets whole, independent parameters back, in their
        original dtypes (from the fp32 master values), and the model is an ordinary
        module again.  Collective when ``unshard``."""
        if unshard and self.phase is not Phase.CLOSED:
            self._unshard()
            unguard_parameters(self.units)
        for u in self.units:
            u.closed = True
        for h in self._handles:
            h.remove()
        self._handles = []
        for undo in self._undo_checkpointing:
            undo()
        self._undo_checkpointing = []
        for undo in self._unwrap_methods:
            undo()
        self._unwrap_methods = []
        self.phase = Phase.CLOSED
        if self.disk_offload is not None:
            self.disk_offload.close()  # removes the offload files (mapped tensors stay readable)

    def _settle_disk(self) -> None:
        """Disk offload: a load replaced optimizer state tensors, or a save paged files in:
        move new state into the files and drop everything from memory again."""
        if self.disk_offload is not None and self.phase is not Phase.CLOSED:
            if self.inner_optimizers:
                for k, opt in enumerate(self.inner_optimizers):
                    self.disk_offload.adopt_all(self.units_of(k), opt)
            else:
                self.disk_offload.evict_all()
