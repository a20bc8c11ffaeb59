"""State dicts: consolidated model weights, and one rank's shard of everything.

Consolidation gathers one unit at a time (memory bounded by the largest unit, not the
model) and takes trainable values from the fp32 master, so nothing is lost to the
16-bit compute copy; values are returned in each parameter's original dtype.

The consolidated model and optimizer functions need only how the model was cut (the
engine passes its ShardedModel); the rank state dict also holds the step counter and
the loss scale, so it takes the engine.
"""
from __future__ import annotations

from typing import Dict

import torch

from ..sharding.param_shard import whole_values

STATE_FORMAT = "zero_strategy.rank_state/3"  # 3: optimizer state per parameter piece


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
        # One optimizer: its state dict; several: a list of them, in the engine's order.
        "optimizer": (None if not engine.inner_optimizers else _snapshot(engine.inner_optimizers[0].state_dict())
                      if len(engine.inner_optimizers) == 1 else [_snapshot(o.state_dict()) for o in engine.inner_optimizers]),
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
    saved = sd["optimizer"]
    if engine.inner_optimizers and saved is not None:
        saved = saved if isinstance(saved, list) else [saved]
        if len(saved) != len(engine.inner_optimizers):
            raise ValueError(f"rank state holds {len(saved)} optimizer state(s), the engine has "
                             f"{len(engine.inner_optimizers)} optimizer(s)")
        for opt, osd in zip(engine.inner_optimizers, saved):
            _load_optimizer_keeping_group_dicts(opt, osd)
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


# -- optimizer state in torch's own format ------------------------------------------------------
# [Note: torch-format optimizer state]
# ``full_optimizer_state_dict`` returns what the user's optimizer's ``state_dict()`` would
# hold without ZeRO: ``{"state": {index: {key: value}}, "param_groups": [...]}``, indices
# counting the parameters in the order the user gave them to the optimizer, per-element
# state whole and shaped like its parameter.  That is what DDP (and any plain torch loop)
# saves and loads, so a run can move between ZeRO and DDP with its optimizer state
# intact, in both directions.  A parameter that never got a gradient has no entry, as in
# torch.  Memory: one unit's per-element state of one key at a time is gathered.


def _piece_states(engine, k: int) -> Dict[tuple, tuple]:
    """(unit, position) -> (that piece's optimizer tensor, its state) on this rank, for
    optimizer ``k``'s element-wise units."""
    opt = engine.inner_optimizers[k]
    out = {}
    for u in engine.units_of(k):
        if u.whole_params is not None:
            continue
        for t, (i, _, _) in zip(u.optim_params, u.optim_slices):
            st = opt.state.get(t)
            if st:
                out[(u.index, i)] = (t, st)
    return out


def _is_elementwise(v, like_shape) -> bool:
    return isinstance(v, torch.Tensor) and v.dim() > 0 and tuple(v.shape) == tuple(like_shape)


def _cpu_copy(v):
    return v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v


def _whole_states(engine, k: int) -> Dict[tuple, dict]:
    """(unit, position) -> whole state of every parameter of optimizer ``k``'s
    whole-parameter units, from its owner ([Note: whole-parameter optimizers]).
    Collective: one object gather per unit, so one unit's state is in flight at a time."""
    opt = engine.inner_optimizers[k]
    out: Dict[tuple, dict] = {}
    for u in engine.units_of(k):
        if u.whole_params is None:
            continue
        mine = {}
        for t, i in zip(u.optim_params, u.optim_positions):
            st = opt.state.get(t)
            if st:
                mine[i] = {key: _cpu_copy(v) for key, v in st.items()}
        for part in engine.comm.all_gather_object(mine, f"the optimizer state of {u.label}"):
            for i, st in part.items():
                out[(u.index, i)] = st
    return out


def full_optimizer_state_dict(engine, rank0_only: bool = True, optimizer=None) -> dict:
    """Collective.  The state of one optimizer (``optimizer``: its index or itself;
    may be left out when there is one) in torch's format (see the note above); with
    ``rank0_only`` the other ranks return {}."""
    k = engine.which_optimizer(optimizer, "full_optimizer_state_dict")
    opt = engine.inner_optimizers[k]
    comm = engine.comm
    keep = comm.rank == 0 or not rank0_only
    pieces = _piece_states(engine, k)
    # Which parameters have state, its per-element keys, and its scalar values: agreed
    # from every rank (a rank that holds no piece of a parameter does not know).
    mine = {}
    for place, (t, st) in pieces.items():
        mine[place] = {
            "elements": sorted((key, str(v.dtype)) for key, v in st.items() if _is_elementwise(v, t.shape)),
            "scalars": {key: _cpu_copy(v) for key, v in st.items() if not _is_elementwise(v, t.shape)},
        }
    known: Dict[tuple, dict] = {}
    for part in comm.all_gather_object(mine, "which parameters have optimizer state"):
        for place, info in part.items():
            known.setdefault(place, info)
    # Per-element state, one unit and key at a time.
    whole: Dict[tuple, dict] = {}
    for u in engine.units_of(k):
        if u.whole_params is not None:
            continue
        keys = sorted({e for (ui, _), info in known.items() if ui == u.index for e in info["elements"]})
        for key, dtype_name in keys:
            dtype = getattr(torch, dtype_name.replace("torch.", ""))
            # This rank's slice is built in its own chunk of the gathered buffer, which
            # then gathers in place: no slice-sized input beside it, and on gloo no staging.
            full = torch.empty(u.layout.padded_numel, dtype=dtype, device=u.params_store.optimizer_target.device)
            local = full[u.params_store.lo : u.params_store.hi]
            local.zero_()
            for t, (i, s_start, length) in zip(u.optim_params, u.optim_slices):
                v = pieces.get((u.index, i), (None, {}))[1].get(key)
                if v is not None:
                    local[s_start : s_start + length] = v.detach().reshape(-1)
            if u.layout.world_size > 1:
                comm.all_gather_for_state(full, local, label=f"the optimizer state {key!r} of {u.label}")
            if keep:
                for i in range(len(u.params)):
                    if (u.index, i) in known and (key, dtype_name) in known[(u.index, i)]["elements"]:
                        whole.setdefault((u.index, i), {})[key] = u.param_view(full, i).to("cpu", copy=True)
            del full, local
    owned_whole = _whole_states(engine, k)
    if not keep:
        return {}
    state, groups, index = {}, [], 0
    for gi, places in enumerate(engine.param_places_of(k)):
        ids = []
        for place in places:
            if place is not None and place in known:
                entry = dict(known[place]["scalars"])
                entry.update(whole.get(place, {}))
                state[index] = entry
            elif place is not None and place in owned_whole:
                state[index] = owned_whole[place]
            ids.append(index)
            index += 1
        group = {key: v for key, v in opt.param_groups[gi].items() if key != "params"}
        group["params"] = ids
        groups.append(group)
    return {"state": state, "param_groups": groups}


def load_full_optimizer_state_dict(engine, osd: dict, optimizer=None) -> None:
    """Every rank passes the same torch-format optimizer state dict (from
    :func:`full_optimizer_state_dict`, or a plain torch/DDP optimizer's ``state_dict()``
    for the same parameters in the same order) for one optimizer (``optimizer``: its
    index or itself; may be left out when there is one); each rank keeps its pieces
    (whole-parameter optimizers: the parameters it owns).  Hyperparameters in
    ``param_groups`` are loaded into the live group dicts."""
    k = engine.which_optimizer(optimizer, "load_full_optimizer_state_dict")
    opt = engine.inner_optimizers[k]
    if not isinstance(osd, dict) or "state" not in osd or "param_groups" not in osd:
        raise ValueError("load_full_optimizer_state_dict expects a torch optimizer state dict ({'state': ..., 'param_groups': ...})")
    places = engine.param_places_of(k)
    saved_groups = osd["param_groups"]
    if len(saved_groups) != len(places) or any(len(g["params"]) != len(p) for g, p in zip(saved_groups, places)):
        raise ValueError(
            "load_full_optimizer_state_dict: the state dict's param groups hold "
            f"{[len(g['params']) for g in saved_groups]} parameters, the optimizer's hold {[len(p) for p in places]}: "
            "a different model or optimizer set-up"
        )
    units = {u.index: u for u in engine.units}
    where = {}
    for g, group_places in zip(saved_groups, places):
        for idx, place in zip(g["params"], group_places):
            where[idx] = place
    for t_list in (u.optim_params for u in engine.units_of(k)):
        for t in t_list:
            opt.state.pop(t, None)
    for idx, entry in osd["state"].items():
        place = where.get(int(idx))
        if place is None:
            continue  # a parameter ZeRO does not partition or update (frozen)
        u = units[place[0]]
        i = place[1]
        shape = u.shapes[i]
        if u.whole_params is not None:  # the owner keeps the parameter's state whole
            for t, j in zip(u.optim_params, u.optim_positions):
                if j == i:
                    opt.state[t] = {key: (v.detach().to(t.device, copy=True) if isinstance(v, torch.Tensor) and v.dim() > 0
                                          else v.detach().clone() if isinstance(v, torch.Tensor) else v)
                                    for key, v in entry.items()}
            continue
        lo = u.layout.shard_range(u.shard_index)[0]
        for t, (j, s_start, length) in zip(u.optim_params, u.optim_slices):
            if j != i:
                continue
            t_start = lo + s_start - u.layout.offsets[i]
            piece = {}
            for key, v in entry.items():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    if tuple(v.shape) != tuple(shape):
                        raise ValueError(
                            f"load_full_optimizer_state_dict: state {key!r} of {u.names[i][0]} has shape "
                            f"{tuple(v.shape)}, the parameter {tuple(shape)}"
                        )
                    piece[key] = v.reshape(-1)[t_start : t_start + length].to(t.device, copy=True).view(t.shape)
                elif isinstance(v, torch.Tensor):
                    piece[key] = v.detach().clone()
                else:
                    piece[key] = v
            opt.state[t] = piece
    for group, saved in zip(opt.param_groups, saved_groups):
        group.update({k: v for k, v in saved.items() if k != "params"})
