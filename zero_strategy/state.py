"""State dicts: consolidated model weights, and one rank's shard of everything.

Consolidation gathers one unit at a time (memory bounded by the largest unit, not the
model) and takes trainable values from the fp32 master, so nothing is lost to the
16-bit compute copy; values are returned in each parameter's original dtype.
"""
from __future__ import annotations

from typing import Dict

import torch

from .param_shard import whole_values

STATE_FORMAT = "zero_strategy.rank_state/2"


def full_state_dict(engine, rank0_only: bool = True) -> Dict[str, torch.Tensor]:
    comm = engine.comm
    keep = (comm.rank == 0) or not rank0_only
    by_id = {}
    for unit in engine.units:
        # The most precise copy of every rank's slice: the fp32 master if there is one.
        full = whole_values(unit.params_store, comm, label=f"the state dict of {unit.label}")
        if keep:
            for i, p in enumerate(unit.params):
                by_id[id(p)] = unit.param_view(full, i).to(device="cpu", dtype=unit.orig_dtypes[i], copy=True)
        del full
    if not keep:
        return {}
    out: Dict[str, torch.Tensor] = {}
    orig = engine.orig_dtype_untouched
    for name, t in engine.module.state_dict(keep_vars=True).items():
        if id(t) in by_id:
            out[name] = by_id[id(t)]
        elif name in engine.untouched:
            out[name] = t.detach().to(device="cpu", dtype=orig[name], copy=True)
        else:
            # Tied names of untouched parameters, and buffers.
            tied = next((n for n, p in engine.untouched.items() if p is t), None)
            dtype = orig[tied] if tied is not None else t.dtype
            out[name] = t.detach().to(device="cpu", dtype=dtype, copy=True)
    return out


def load_full_state_dict(engine, state_dict: Dict[str, torch.Tensor], strict: bool = True) -> None:
    """Every rank passes the same consolidated state dict; each keeps its own slices."""
    model_sd = engine.module.state_dict(keep_vars=True)
    if strict:
        missing = [k for k in model_sd if k not in state_dict]
        unexpected = [k for k in state_dict if k not in model_sd]
        if missing or unexpected:
            raise KeyError(f"load_full_state_dict: missing keys {missing[:10]}, unexpected keys {unexpected[:10]}")
    done = set()
    for unit in engine.units:
        for i, names in enumerate(unit.names):
            name = next((n for n in names if n in state_dict), None)
            if name is None:
                continue
            value = state_dict[name]
            if tuple(value.shape) != unit.shapes[i]:
                raise ValueError(f"load_full_state_dict: {name!r} has shape {tuple(value.shape)}, the model expects {unit.shapes[i]}")
            owned = unit.params_store.owned_range(i)
            if owned is not None:
                a, b = owned
                unit.params_store.write(i, value.reshape(-1)[a:b].to(unit.device), start=a)
            for n in names:
                done.add(n)
    with torch.no_grad():
        for name, t in model_sd.items():
            if name in done or name not in state_dict:
                continue
            t.copy_(state_dict[name])


def rank_state_dict(engine) -> dict:
    """This rank's shard of everything needed to resume at the same world size and stage."""
    cfg = engine.config
    return {
        "format": STATE_FORMAT,
        "stage": engine.policies.stage.stage,
        "precision": cfg.precision,
        "world_size": engine.comm.world_size,
        "rank": engine.comm.rank,
        "units": [
            {
                "names": [n[0] for n in u.names],
                "numels": list(u.layout.numels),
                "values": u.params_store.local_values().detach().cpu().clone(),
            }
            for u in engine.units
        ],
        "untouched": {n: p.detach().cpu().clone() for n, p in engine.untouched.items()},
        "buffers": {n: b.detach().cpu().clone() for n, b in engine.module.named_buffers()},
        "optimizer": None if engine.inner_optimizer is None else _snapshot(engine.inner_optimizer.state_dict()),
        "loss_scaler": engine.scaler.state_dict(),
        "step": engine.global_step,
    }


def _snapshot(obj):
    """Deep copy with tensors cloned to CPU: torch's optimizer.state_dict() returns the
    live state tensors, which the next step would overwrite in place."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _snapshot(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_snapshot(v) for v in obj]
    return obj


def load_rank_state_dict(engine, sd: dict) -> None:
    if sd.get("format") != STATE_FORMAT:
        raise ValueError(f"not a zero_strategy rank state (format {sd.get('format')!r}, expected {STATE_FORMAT!r})")
    ws, stage = engine.comm.world_size, engine.policies.stage.stage
    if sd["world_size"] != ws or sd["stage"] != stage:
        raise ValueError(
            f"this rank state was saved at world size {sd['world_size']} / stage {sd['stage']}, "
            f"but the engine runs at world size {ws} / stage {stage}; load a resharding checkpoint instead"
        )
    if len(sd["units"]) != len(engine.units):
        raise ValueError(f"rank state has {len(sd['units'])} units, the engine has {len(engine.units)}: a different model or config")
    for u, s in zip(engine.units, sd["units"]):
        if s["names"] != [n[0] for n in u.names] or s["numels"] != list(u.layout.numels):
            raise ValueError(f"rank state unit {u.index} holds {s['names'][:3]}..., the engine's holds {[n[0] for n in u.names][:3]}...")
        u.params_store.write_local(s["values"])
    with torch.no_grad():
        for n, p in engine.untouched.items():
            p.copy_(sd["untouched"][n])
        buffers = dict(engine.module.named_buffers())
        for n, b in sd["buffers"].items():
            if n in buffers:
                buffers[n].copy_(b)
    if engine.inner_optimizer is not None and sd["optimizer"] is not None:
        _load_optimizer_keeping_group_dicts(engine.inner_optimizer, sd["optimizer"])
    engine.scaler.load_state_dict(sd["loss_scaler"])
    engine.global_step = sd["step"]
    for u in engine.units:
        if u.keep_full and u.layout.world_size > 1:  # every other rank's part of a whole unit
            store = u.params_store
            engine.comm.all_gather(store.full.data, store.shard, async_op=False, label=f"the resumed {u.label}")


def _load_optimizer_keeping_group_dicts(optimizer, sd: dict) -> None:
    """``Optimizer.load_state_dict`` replaces the param-group dicts with new ones, which
    would cut LR schedulers (and ZeroOptimizer) off from the live hyperparameters.
    Load, then copy the loaded values back into the original dicts."""
    groups = optimizer.param_groups
    originals = [dict(g) for g in groups]
    optimizer.load_state_dict(sd)
    loaded = optimizer.param_groups
    for old, new, orig in zip(groups, loaded, originals):
        old.update({k: v for k, v in new.items() if k != "params"})
        old["params"] = orig["params"]
    optimizer.param_groups = groups
