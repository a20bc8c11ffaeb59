"""Writing a checkpoint directory: the layout of the shards, each rank's files, the
manifest, and the atomic swap into place (see [Note: checkpoint layout] and [Note:
integrity] in checkpoint/names.py)."""
from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from . import files
from .files import CheckpointError
from .manifest import FORMAT, FORMAT_VERSION, layout_digest, seal
from ..dtypes import dtype_name
from .safetensors_io import StreamingSafetensorsWriter

from .names import CLIENT_STATE, CONFIG, MANIFEST, SHARED, agree, as_path, rank_file


def _layout(engine) -> Tuple[list, list]:
    """The manifest's ``units`` and ``tensors``: where every parameter lives."""
    tensors, units = [], []
    for u in engine.units:
        units.append(
            dict(index=u.index, world=u.layout.world_size, shard_numel=u.layout.shard_numel, numel=u.layout.numel,
                 group_index=u.group_index, compute_dtype=dtype_name(u.compute_dtype))
        )
        for i, names in enumerate(u.names):
            tensors.append(
                dict(names=list(names), shape=[int(s) for s in u.shapes[i]], dtype=dtype_name(u.orig_dtypes[i]),
                     frozen=not u.trainable, unit=u.index, offset=u.layout.offsets[i], numel=u.layout.numels[i])
            )
    for name, p in engine.untouched.items():
        tied = [n for n, q in engine.module.named_parameters(remove_duplicate=False) if q is p]
        tensors.append(dict(names=tied or [name], shape=[int(s) for s in p.shape], dtype=dtype_name(engine.orig_dtype_untouched[name]),
                            frozen=True, unit=None, key=f"param.{name}"))
    return units, tensors


def _manifest(engine, units: list, tensors: list, checkpoint_id: str, table: dict) -> dict:
    from .._version import __version__

    cfg = engine.config
    saved = [_optimizer_entry(engine, k) for k in range(len(engine.inner_optimizers))]
    # One optimizer: "optimizer" (as every earlier version wrote it); several: "optimizers".
    optimizers = dict(optimizer=saved[0] if saved else None) if len(saved) <= 1 else dict(optimizer=None, optimizers=saved)
    return seal(dict(
        format=FORMAT, format_version=FORMAT_VERSION, library_version=__version__, checkpoint_id=checkpoint_id,
        world_size=engine.comm.world_size, stage=engine.policies.stage.stage, precision=cfg.precision, config=cfg.to_dict(),
        model_class=type(engine.module).__name__, tensors=tensors, units=units,
        buffers=_persistent_buffer_names(engine.module),
        **optimizers,
        loss_scaler=engine.scaler.state_dict(), step=engine.global_step, checksum="crc32", files=table,
    ))


def _optimizer_entry(engine, k: int) -> dict:
    opt = engine.inner_optimizers[k]
    return dict(
        cls=type(opt).__name__,
        param_groups=[{key: v for key, v in g.items() if key != "params" and _jsonable(v)} for g in opt.param_groups],
        # Each optimizer parameter's first name, in the order the user gave them (None:
        # not partitioned by ZeRO), so the state can be consolidated in torch's format.
        param_names=[[None if place is None else _unit_of(engine, place[0]).names[place[1]][0] for place in group]
                     for group in engine.param_places_of(k)],
    )


def _unit_of(engine, index: int):
    return next(u for u in engine.units if u.index == index)


def _persistent_buffer_names(module) -> List[str]:
    """Buffers that belong in a state dict (non-persistent ones are rebuilt at init)."""
    keys = set(module.state_dict(keep_vars=True).keys())  # no parameter data is read
    return [n for n, _ in module.named_buffers() if n in keys]


def _jsonable(v) -> bool:
    try:
        json.dumps(v)
        return True
    except (TypeError, ValueError):
        return False


def _rank_payload(engine) -> Tuple[Dict[str, torch.Tensor], dict]:
    """This rank's file: values, then the optimizer state of every parameter piece it
    holds ([Note: one optimizer tensor per parameter] in flat_unit.py).  Per-element state
    is laid out in the unit's flat shard space (resharding is slice arithmetic); scalar
    state (e.g. Adam's step) is one entry per parameter position in the unit, and
    ``optim_present`` says which parameters have state (one never stepped has none)."""
    tensors: Dict[str, torch.Tensor] = {}
    extra: dict = {"optimizer_scalars": {}}
    for u in engine.units:
        tensors[f"unit{u.index}.value"] = u.params_store.local_values().detach().float().cpu()
        if not u.trainable or not engine.inner_optimizers:
            continue
        opt = engine.inner_optimizers[u.optimizer_index]
        state = opt.state
        n = len(u.params)
        if u.whole_params is not None:
            _whole_payload(u, state, tensors, extra)
            continue
        present = torch.zeros(n, dtype=torch.uint8)
        elements: Dict[str, torch.Tensor] = {}
        scalars: Dict[str, torch.Tensor] = {}
        for t, (i, s_start, length) in zip(u.optim_params, u.optim_slices):
            st = state.get(t, {})
            if st:
                present[i] = 1
            for key, v in st.items():
                if isinstance(v, torch.Tensor) and v.dim() > 0 and tuple(v.shape) == tuple(t.shape):
                    if key not in elements:
                        elements[key] = torch.zeros(u.layout.shard_numel, dtype=v.dtype)
                    elements[key][s_start : s_start + length] = v.detach().reshape(-1).cpu()
                elif isinstance(v, torch.Tensor) and v.dim() == 0:
                    if key not in scalars:
                        scalars[key] = torch.zeros(n, dtype=v.dtype)
                    scalars[key][i] = v.detach().cpu()
                elif isinstance(v, torch.Tensor):
                    raise CheckpointError(
                        f"optimizer state {key!r} of {u.names[i][0]} has shape {tuple(v.shape)}: neither one value per "
                        f"element (shape {tuple(t.shape)}) nor a scalar, so it cannot be sharded and resharded; "
                        f"{type(opt).__name__} is not supported by sharded checkpoints"
                    )
                else:
                    extra["optimizer_scalars"][f"{u.index}.{i}.{key}"] = v
        tensors[f"unit{u.index}.optim_present"] = present
        for key, v in elements.items():
            tensors[f"unit{u.index}.optim.{key}"] = v
        for key, v in scalars.items():
            tensors[f"unit{u.index}.optim_scalar.{key}"] = v
    extra["rng_cpu"] = torch.get_rng_state().tolist()
    if torch.cuda.is_available():
        extra["rng_cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return tensors, extra


def _whole_payload(u, state, tensors: Dict[str, torch.Tensor], extra: dict) -> None:
    """A whole-parameter optimizer's state ([Note: whole-parameter optimizers] in
    whole_params.py): each owner writes its parameters' state whole, any shape, as
    ``unit<u>.whole<i>.<key>``; ``whole_present`` marks the positions it owns with state."""
    present = torch.zeros(len(u.params), dtype=torch.uint8)
    for t, i in zip(u.optim_params, u.optim_positions):
        st = state.get(t, {})
        if not st:
            continue
        present[i] = 1
        for key, v in st.items():
            if isinstance(v, torch.Tensor):
                tensors[f"unit{u.index}.whole{i}.{key}"] = v.detach().cpu().contiguous()
            else:
                extra["optimizer_scalars"][f"{u.index}.{i}.{key}"] = v
    tensors[f"unit{u.index}.whole_present"] = present


def _header_identity(kind: str, identity: dict) -> Dict[str, str]:
    meta = {"format": "pt", "zero_strategy.file": kind, "zero_strategy.checkpoint_id": identity["checkpoint_id"],
            "zero_strategy.world_size": str(identity["world_size"]), "zero_strategy.layout": identity["layout"]}
    if kind == "rank":
        meta["zero_strategy.rank"] = str(identity["rank"])
    return meta


def _write_safetensors(path: Path, tensors: Dict[str, torch.Tensor], metadata: Dict[str, str]) -> dict:
    writer = StreamingSafetensorsWriter(path, {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()},
                                        metadata=metadata, checksum=True)
    with writer:
        for k, v in tensors.items():
            writer.write(k, v)
    return {"size": writer.size, "crc32": writer.crc32}


def _write_rank_files(tmp: Path, rank: int, tensors: Dict[str, torch.Tensor], extra: dict) -> Dict[str, dict]:
    """This rank's two files; ``extra["identity"]`` says whose they are.  Returns their
    ``{name: {"size", "crc32", "rank"}}`` records for the manifest."""
    identity = extra["identity"]
    st = rank_file(tmp, rank, "safetensors")
    records = {st.name: _write_safetensors(st, tensors, _header_identity("rank", identity))}
    js = rank_file(tmp, rank, "json")
    records[js.name] = files.write_json(js, extra)
    for r in records.values():
        r["rank"] = rank
    return records


def _write_rank0_files(engine, tmp: Path, client_state: Optional[dict], identity: dict) -> Dict[str, dict]:
    shared = {f"param.{n}": p.detach().cpu() for n, p in engine.untouched.items()}
    persistent = set(_persistent_buffer_names(engine.module))
    shared.update({f"buffer.{n}": b.detach().cpu() for n, b in engine.module.named_buffers() if n in persistent})
    records = {SHARED: _write_safetensors(tmp / SHARED, shared, _header_identity("shared", identity))}
    if client_state is not None:
        with files.ChecksumFile(tmp / CLIENT_STATE) as f:
            torch.save(client_state, f)
        records[CLIENT_STATE] = f.record()
    config = getattr(engine.module, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        try:
            blob = json.dumps(config.to_dict()).encode()
        except (TypeError, ValueError):
            blob = None  # a config that is not JSON-serialisable is simply not copied
        if blob is not None:
            records[CONFIG] = files.write_bytes(tmp / CONFIG, blob)
    return records


def save_checkpoint(engine, directory, client_state: Optional[dict] = None) -> Path:
    """Write ``directory`` atomically. Collective: every rank calls it with the same path.

    Replaces ``directory`` only when it is a checkpoint this library wrote (or empty);
    any error, on any rank, is raised on every rank (CheckpointError)."""
    comm = engine.comm
    rank, ws = comm.rank, comm.world_size
    error, path, digest, units, tensors = None, None, "", [], []
    try:
        path = as_path(directory)
        units, tensors = _layout(engine)
        digest = layout_digest(ws, units, tensors)
    except Exception as e:  # noqa: BLE001 - agreed below, raised on every rank
        error = e
    agree(comm, "save_checkpoint", error, same={"path": str(path), "model layout": digest})
    what = f"save_checkpoint({path})"

    lock, done = None, False
    try:
        # 1. rank 0: the lock, the target checked, a fresh .tmp; it proposes the id.
        error, proposed = None, [0, 0]
        if rank == 0:
            try:
                lock = files.DirectoryLock.take(path, what)
                files.prepare_target(path, files.KIND_CHECKPOINT, what)
                files.new_tmp(path, files.KIND_CHECKPOINT)
                proposed = [secrets.randbits(62), secrets.randbits(62)]
            except Exception as e:  # noqa: BLE001
                error = e
        hi, lo = agree(comm, what, error, proposed=proposed)
        identity = dict(rank=rank, world_size=ws, checkpoint_id=f"{hi:016x}{lo:016x}", layout=digest)
        tmp = files.sibling(path, ".tmp")

        # 2. every rank: its files.
        error, records = None, {}
        try:
            payload, extra = _rank_payload(engine)
            extra["identity"] = identity
            records = dict(_write_rank_files(tmp, rank, payload, extra) or {})
            if rank == 0:
                records.update(_write_rank0_files(engine, tmp, client_state, identity))
        except Exception as e:  # noqa: BLE001
            error = e
        agree(comm, what, error)
        everyone = comm.all_gather_object(records, label=f"{what}: file checksums")

        # 3. rank 0: the manifest, then the swap; the lock is released before the
        # ranks agree, so it is gone wherever save_checkpoint has returned.
        error = None
        if rank == 0:
            try:
                table = {}
                for r in everyone:
                    table.update(r)
                files.write_json(tmp / MANIFEST, _manifest(engine, units, tensors, identity["checkpoint_id"], table))
                files.finish_and_swap(tmp, path, files.KIND_CHECKPOINT)
                done = True
            except Exception as e:  # noqa: BLE001
                error = e
            finally:
                if not done:
                    files.discard_tmp(path)
                lock.release()
                lock = None
        agree(comm, what, error)
    finally:
        if lock is not None:
            if not done:
                files.discard_tmp(path)
            lock.release()
    return Path(directory)
