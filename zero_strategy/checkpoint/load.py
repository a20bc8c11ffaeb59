"""Loading a checkpoint into an engine at any world size and stage: plan (read and
check everything, agreed), then apply."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional

import torch

from . import files
from .files import CheckpointError
from .reader import CheckpointReader, saved_optimizers, saved_state
from .names import MANIFEST, agree, as_path


@dataclass
class _Plan:
    reader: CheckpointReader
    client: Optional[dict]
    by_name: Dict[str, dict]
    restore_optimizer: bool
    rank_json: object  # rank -> that rank's JSON sidecar, read once


def load_checkpoint(engine, directory, *, allow_reshard: bool = True, weights_only: Optional[bool] = True) -> Optional[dict]:
    """Restore ``engine`` from ``directory``; returns the saved ``client_state``.

    Works across world sizes and stages (resharding on the fly) unless
    ``allow_reshard`` is False, in which case a different world size is an error.
    ``client_state.pt`` is read with ``torch.load(weights_only=True)`` (tensors and
    plain containers only, no code runs) unless the caller passes
    ``weights_only=False`` for a file it trusts; ``None`` means True.

    Everything is validated and verified before the engine is changed; an error on any
    rank is raised on every rank."""
    comm = engine.comm
    error, path, plan = None, None, None
    try:
        path = as_path(directory)
        if comm.rank == 0:
            files.clean_leftover_tmp(path)
        plan = _plan_load(engine, path, allow_reshard, weights_only)
    except Exception as e:  # noqa: BLE001 - agreed below, raised on every rank
        error = e
    agree(comm, "load_checkpoint", error, same={"path": str(path)})
    error = None
    try:
        _apply(engine, plan)
    except Exception as e:  # noqa: BLE001
        error = e
    finally:
        plan.reader.close()
    agree(comm, f"load_checkpoint({path})", error)
    return plan.client


def _plan_load(engine, path: Path, allow_reshard: bool, weights_only) -> _Plan:
    """Everything that can refuse the checkpoint, before the engine is touched."""
    comm = engine.comm
    reader = CheckpointReader(path)
    try:
        reader.verify(comm.rank, comm.world_size)
        # Read (and refuse) the caller's state before touching the engine, so a refused
        # file leaves the model as it was.
        client = reader.client_state(weights_only=weights_only)
        m = reader.manifest
        ws = comm.world_size
        if not allow_reshard and (m["world_size"] != ws or m["stage"] != engine.policies.stage.stage):
            raise CheckpointError(
                f"{reader.directory} was saved at world size {m['world_size']} / stage {m['stage']} but this run has "
                f"world size {ws} / stage {engine.policies.stage.stage}; pass allow_reshard=True to reshard it on load"
            )
        by_name: Dict[str, dict] = {}
        for entry in m["tensors"]:
            for n in entry["names"]:
                by_name[n] = entry
        _check_model_matches(engine, reader, by_name)
        opts = engine.inner_optimizers
        old = saved_optimizers(m)
        restore_optimizer = bool(opts) and old is not None
        if opts and old is None and _holds_optimizer_state(reader):
            raise CheckpointError(
                f"{reader.manifest_path} has no optimizer section, but its rank files hold optimizer state: the manifest "
                "was damaged or edited, and loading it would silently reset the optimizer (moments and step)"
            )
        if restore_optimizer:
            saved_classes, classes = [o["cls"] for o in old], [type(o).__name__ for o in opts]
            if saved_classes != classes:
                raise CheckpointError(f"{reader.directory} holds the state of {' + '.join(saved_classes)} but the engine's "
                                      f"optimizers are {' + '.join(classes)}")
            for k, (opt, entry) in enumerate(zip(opts, old)):
                _check_param_groups(reader.manifest_path, k, opt, entry["param_groups"])
        rank_json = functools.lru_cache(maxsize=None)(reader.rank_json)
        if restore_optimizer:
            rank_json(0)  # validated now, before the engine is touched
        if m["world_size"] == ws:
            reader.rank_json(comm.rank)  # validated now, applied later
    except BaseException:
        reader.close()
        raise
    return _Plan(reader, client, by_name, restore_optimizer, rank_json)


def _holds_optimizer_state(reader) -> bool:
    """Whether rank 0's file holds per-parameter optimizer state (every save with a
    stepped optimizer writes ``unit<i>.optim_present`` or ``unit<i>.whole_present``)."""
    return any(reader.keys_with_prefix(0, f"unit{u}.optim_present") or reader.keys_with_prefix(0, f"unit{u}.whole_present")
               or reader.keys_with_prefix(0, f"unit{u}.optim.") for u in reader.units)


def _check_param_groups(where, k: int, opt, saved_groups) -> None:
    """The saved hyperparameters of optimizer ``k`` fit the live optimizer: as many
    groups, no key the live groups lack, each value of the live value's type (numbers
    finite where the live one is; None, torch's "pick the default", fits any type)."""
    def fail(what: str):
        raise CheckpointError(f"{where}: optimizers[{k}] ({type(opt).__name__}) {what}; the checkpoint's hyperparameters "
                              "do not fit this optimizer (a damaged or edited manifest, or another optimizer's checkpoint)")

    if len(saved_groups) != len(opt.param_groups):
        fail(f"has {len(saved_groups)} saved param group(s) but the live optimizer has {len(opt.param_groups)}")
    for i, (live, saved) in enumerate(zip(opt.param_groups, saved_groups)):
        for key, value in saved.items():
            if key not in live:
                fail(f"param_groups[{i}] names {key!r:.80}, which the live optimizer does not have")
            problem = _type_problem(live[key], value)
            if problem:
                fail(f"param_groups[{i}][{key!r}] is {value!r:.80}: {problem}")


def _type_problem(live, saved) -> str:
    if live is None or saved is None:
        return ""
    if isinstance(live, bool) or isinstance(saved, bool):
        return "" if isinstance(live, bool) and isinstance(saved, bool) else f"expected {type(live).__name__}"
    if isinstance(live, (int, float)) and not isinstance(live, bool):
        if not isinstance(saved, (int, float)):
            return f"expected a number like {live!r:.40}"
        if math.isfinite(live) and not math.isfinite(saved):
            return "not finite"
        return ""
    if isinstance(live, (tuple, list)):
        if not isinstance(saved, list) or len(saved) != len(live):
            return f"expected {len(live)} values like {list(live)!r:.60}"
        return next((p for p in (_type_problem(a, b) for a, b in zip(live, saved)) if p), "")
    if isinstance(live, str):
        return "" if isinstance(saved, str) else "expected a string"
    return ""  # tensors and other objects are not saved (not JSON); nothing to compare


def _apply(engine, plan: _Plan) -> None:
    reader, by_name, m = plan.reader, plan.by_name, plan.reader.manifest
    restore_optimizer = plan.restore_optimizer
    for u in engine.units:
        store = u.params_store
        for i, names in enumerate(u.names):  # values: whatever part of each tensor this rank keeps
            owned = store.owned_range(i)
            if owned is not None:
                store.write(i, _read_tensor_range(reader, by_name[names[0]], *owned).to(u.device), start=owned[0])
        if restore_optimizer and u.trainable:
            opt = engine.inner_optimizers[u.optimizer_index]
            lo = u.layout.shard_range(u.shard_index)[0]
            if u.whole_params is not None:
                wanted = [(t, i, 0, u.layout.numels[i]) for t, i in zip(u.optim_params, u.optim_positions)]
            else:
                wanted = [(t, i, lo + s_start - u.layout.offsets[i], length)
                          for t, (i, s_start, length) in zip(u.optim_params, u.optim_slices)]
            for t, i, t_start, length in wanted:
                st = saved_state(reader, by_name[u.names[i][0]], t_start, length, t, plan.rank_json)
                if st:
                    opt.state[t] = st
                else:  # never stepped when saved: no state, as torch would have
                    opt.state.pop(t, None)
    with torch.no_grad():
        for name, p in engine.untouched.items():
            p.copy_(reader.tensor(by_name[name]).view(p.shape))
        buffers = dict(engine.module.named_buffers())
        for n in m.get("buffers", []):
            if n in buffers:
                buffers[n].copy_(reader.shared(f"buffer.{n}"))
    if restore_optimizer:
        for opt, entry in zip(engine.inner_optimizers, saved_optimizers(m)):
            for group, saved in zip(opt.param_groups, entry["param_groups"]):
                # JSON has no tuples: give a tuple-valued hyperparameter (Adam's betas) its type back.
                group.update({k: tuple(v) if isinstance(group.get(k), tuple) and isinstance(v, list) else v
                              for k, v in saved.items()})
    engine.scaler.load_state_dict(m["loss_scaler"])  # validated with the manifest
    engine.global_step = m["step"]
    engine.zero_grad()
    if m["world_size"] == engine.comm.world_size:
        rj = reader.rank_json(engine.comm.rank)
        torch.set_rng_state(torch.tensor(rj["rng_cpu"], dtype=torch.uint8))
        if "rng_cuda" in rj and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in rj["rng_cuda"]])


def _read_tensor_range(reader, entry: dict, start: int, end: int) -> torch.Tensor:
    """Elements ``[start, end)`` of one saved tensor (flattened), as float32."""
    if entry["unit"] is None:
        return reader.shared(entry["key"]).reshape(-1)[start:end].float()
    return reader.read_unit_range(entry["unit"], "value", entry["offset"] + start, end - start)


def _check_model_matches(engine, reader, by_name: Dict[str, dict]) -> None:
    problems = []
    for u in engine.units:
        for i, names in enumerate(u.names):
            entry = by_name.get(names[0])
            if entry is None:
                problems.append(f"{names[0]!r} is not in the checkpoint")
            elif list(entry["shape"]) != list(u.shapes[i]):
                problems.append(f"{names[0]!r} has shape {tuple(entry['shape'])} in the checkpoint, {u.shapes[i]} in the model")
    for name, p in engine.untouched.items():
        entry = by_name.get(name)
        if entry is None:
            problems.append(f"{name!r} is not in the checkpoint")
        elif list(entry["shape"]) != list(p.shape):
            problems.append(f"{name!r} has shape {tuple(entry['shape'])} in the checkpoint, {tuple(p.shape)} in the model")
    if problems:
        raise CheckpointError(
            f"{reader.directory / MANIFEST} describes a different model ({reader.manifest.get('model_class')}): "
            + "; ".join(problems[:5]) + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else "")
        )


