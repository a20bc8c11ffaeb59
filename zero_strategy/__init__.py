"""zero_strategy: ZeRO data parallelism (Rajbhandari et al., SC 2020) for existing training loops.

    engine = zero_strategy.initialize(model, optimizer, {"stage": 3, "precision": "bf16"})
    loss = model(**batch).loss
    engine.backward(loss)
    engine.step()
"""
from __future__ import annotations

from typing import Optional

from .config import ZeroConfig
from .estimate import MemoryEstimate, estimate
from .engine import ZeroEngine, engine_of
from .materialize.deferred import init_context, keep_meta_on_moves
from .reliability.guard import PartitionedParameterError, is_partitioned
from .reliability.misuse import engine_for_parameters
from .communication.comm import CollectiveError
from . import agreement as _agreement
from .reliability.fingerprint import SetupMismatchError
from .checkpoint import (CheckpointError, consolidate, load_consolidated_optimizer_state, load_consolidated_optimizer_states,
                         load_consolidated_state_dict)

from ._version import __version__


def initialize(model, optimizer=None, config=None, process_group=None, *, device=None, pretrained=None,
               sync_module_states=True) -> ZeroEngine:
    """Shard ``model`` in place and re-point ``optimizer`` at this rank's shards.

    ``optimizer`` is one torch optimizer, a list of them (``[muon, adamw]``: each keeps
    its param groups, schedulers and state; ``engine.step()`` steps all, and
    ``engine.optimizers[k]`` is each one's ZeroOptimizer), or None.  An optimizer that
    is not element-wise (Adafactor, Muon, LAMB, ...) is given whole parameters.

    ``model`` stays the same object of the same class; run it as before.  ``config`` is
    a :class:`ZeroConfig`, a dict of its fields, or a path to a json/yaml file.
    ``process_group`` defaults to the initialised default group (or a single process
    when torch.distributed is not initialised).

    A model built inside :func:`init_context` has no parameter memory yet: it is
    materialised here directly into shards on ``device`` (default: the current CUDA
    device, else CPU), initialised module by module, or read slice by slice from
    ``pretrained`` (safetensors file or directory) when given.  With
    ``sync_module_states`` (the default, as DDP) every rank first takes rank 0's
    parameter and buffer values, so ranks seeded differently start equal (parameters
    still on the meta device are skipped; ``pretrained`` weights are loaded afterwards).

    Every rank must pass the same model structure, optimizer hyperparameters, config and
    options: they are compared first (one small collective), and a difference raises
    :class:`SetupMismatchError` on every rank, naming it."""
    return ZeroEngine(model, optimizer, config, process_group=process_group, device=device, pretrained=pretrained,
                      sync_module_states=sync_module_states)


def run_on_every_rank(what: str, work, *, process_group=None, timeout: Optional[float] = None,
                      error_type=RuntimeError, own: str = "always"):
    """Collective: ``work()`` on every rank of ``process_group`` (default: the default
    group; a single process when torch.distributed is not initialised), then the ranks
    agree on its success within ``timeout`` seconds (default: ``collective_timeout``'s
    default).  If it raised on any rank, every rank raises: the ranks that failed their
    own error (``own="always"``; see ``zero_strategy.agreement.agree`` for the other
    choices), the others ``error_type`` naming each failing rank and its message, so no
    rank is left waiting in a later collective for a peer that gave up.  Returns what
    ``work()`` returned on this rank."""
    comm = _agreement.communicator(process_group, timeout)
    return comm.run_and_agree(what, work, error_type=error_type, own=own)


def gathered_parameters(model, *modules, modifier_rank=None):
    """``engine_of(model).gathered_parameters(*modules, modifier_rank=...)``: a context in
    which the (stage-3 partitioned) parameters of ``modules`` of ``model`` are whole on
    every rank.  Collective.  See :meth:`ZeroEngine.gathered_parameters`."""
    engine = engine_of(model)
    if engine is None:
        raise ValueError(
            f"this {type(model).__name__} is not managed by an open ZeroEngine: pass the model given to "
            "zero_strategy.initialize (the root module, not a submodule)"
        )
    return engine.gathered_parameters(*modules, modifier_rank=modifier_rank)


__all__ = [
    "gathered_parameters",
    "run_on_every_rank",
    "PartitionedParameterError",
    "is_partitioned",
    "CollectiveError",
    "SetupMismatchError",
    "ZeroConfig",
    "ZeroEngine",
    "initialize",
    "engine_of",
    "engine_for_parameters",
    "estimate",
    "MemoryEstimate",
    "init_context",
    "keep_meta_on_moves",
    "CheckpointError",
    "consolidate",
    "load_consolidated_optimizer_state",
    "load_consolidated_optimizer_states",
    "load_consolidated_state_dict",
    "__version__",
]
