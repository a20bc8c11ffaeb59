"""The setup check at initialize: every rank must build the same engine.

[Note: the setup check]
Ranks set up differently train wrongly without a word (a different learning rate on
one rank), fail much later (stage 3 on one rank and 2 on another), or have gloo abort
a process (different models issue collectives of different sizes).  So
:func:`check_same_setup` runs first in ``ZeroEngine.__init__``, before any other
collective.  Each rank hashes

* ``config``: every ZeroConfig field but ``nvme_path`` (each rank may keep its
  disk-offload files on a local disk of its own);
* ``parameters`` / ``buffers``: names, shapes, dtypes (and ``requires_grad``);
* ``optimizer``: its class, and per param group the hyperparameters (every key but
  ``params``) and which parameters it holds, by name (in any order);
* ``options``: ``sync_module_states`` and whether ``pretrained`` weights are loaded;

and one agreement ([Note: every rank fails together] in agreement.py) of a fixed
number of hashes tells every rank whether all agree.  The tensor has the same
size on every rank whatever was passed, and the check runs without
``check_call_order``'s extra exchange even when some rank asked for it, so this first
collective always pairs up.  Only when the hashes differ are the descriptions gathered
(a second, small exchange), and every rank raises :class:`SetupMismatchError` naming
each difference, e.g. ``param group 0 'lr': rank 0 has 0.1, rank 1 has 0.01``.

With ``sync_module_states=False`` (every rank keeps its own values) and no
``pretrained`` weights, a checksum of the parameter and buffer values (a sample of
each tensor) is compared too, and a warning says so when they differ (different seeds): a checkpoint loaded
before training would make them agree, so it is not an error.  Parameters still on
the meta device (deferred initialisation) are skipped.
"""
from __future__ import annotations

import hashlib
import json
import re
import warnings
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import agreement

_BITS = (1 << 62) - 1
_SHOWN = 12  # differences listed at most
SECTIONS = ("config", "parameters", "buffers", "optimizer", "options")
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")  # object reprs differ per process by their address


class SetupMismatchError(ValueError):
    """The ranks called zero_strategy.initialize with different models, optimizers or configs."""


def _scalar(value):
    if isinstance(value, torch.Tensor):  # e.g. lr as a tensor: its values, not its device
        return value.tolist() if value.numel() <= 16 else f"tensor{tuple(value.shape)} {value.dtype}"
    if isinstance(value, (list, tuple)):
        return [_scalar(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _scalar(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (bool, int, str)) or value is None:
        return value
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    return _ADDRESS.sub("", repr(value))  # floats exactly (0.1 and 0.1000000001 differ)


# Config fields that may differ between ranks: where a rank keeps its own files.
_PER_RANK_FIELDS = ("nvme_path",)


def describe_setup(model: nn.Module, optimizer, config, *, sync_module_states: bool, pretrained,
                   ranks_per_node: Optional[int] = None) -> Dict[str, object]:
    """What must be equal on every rank, as JSON-able values (see [Note: the setup check])."""
    names = {id(p): n for n, p in model.named_parameters()}
    groups = []
    if optimizer is not None:
        for g in optimizer.param_groups:
            hyper = {str(k): _scalar(v) for k, v in sorted(g.items()) if k != "params"}
            # Sorted: the order within a group does not matter (groups built from a set differ in order per process).
            held = sorted(names.get(id(p), "<not in the model>") for p in g["params"])
            groups.append({"hyperparameters": hyper, "params": held})
    return {
        "config": {k: _scalar(v) for k, v in sorted(config.to_dict().items()) if k not in _PER_RANK_FIELDS},
        "parameters": [[n, list(p.shape), str(p.dtype), bool(p.requires_grad)] for n, p in model.named_parameters()],
        "buffers": [[n, list(b.shape), str(b.dtype)] for n, b in model.named_buffers()],
        "optimizer": None if optimizer is None else {"class": getattr(optimizer, "class_name", type(optimizer).__qualname__),
                                                     "groups": groups},
        "options": {"sync_module_states": bool(sync_module_states), "pretrained": pretrained is not None,
                    # Each rank reads its node layout from its own launcher variables: nodes of
                    # different sizes show up here ([Note: node structure] in topology.py).
                    "ranks per node (ranks_per_node, else the launcher's LOCAL_WORLD_SIZE)": ranks_per_node},
    }


def _digest(section) -> int:
    text = json.dumps(section, sort_keys=True, default=str)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") & _BITS


_SAMPLE = 1024  # elements per tensor in the values checksum


def _values_checksum(model: nn.Module) -> int:
    """A hash of up to _SAMPLE evenly spaced elements of every parameter and buffer:
    equal on ranks that hold equal values, different for different seeds, and cheap
    (summing all of GPT-2 small in float64 took 4 s on CPU; this takes about 30 ms)."""
    samples = []
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            if t.device.type == "meta" or t.numel() == 0:
                continue
            flat = t.detach().reshape(-1)
            stride = max(1, flat.numel() // _SAMPLE)
            samples.append(flat[::stride][:_SAMPLE].to(torch.float64))
    if not samples:
        return 0
    values = torch.cat([s.to(samples[0].device) for s in samples]).cpu().numpy().tobytes()  # one copy to the host
    return int.from_bytes(hashlib.blake2b(values, digest_size=8).digest(), "little") & _BITS


# -- naming the differences --------------------------------------------------------------------------
def _by_rank(values: List, fmt=repr) -> str:
    groups: Dict[str, List[int]] = {}
    for r, v in enumerate(values):
        groups.setdefault(fmt(v), []).append(r)
    return ", ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} {'have' if len(rs) > 1 else 'has'} {v}"
                     for v, rs in groups.items())


def _diff_dicts(prefix: str, dicts: List[Optional[dict]], out: List[str]) -> None:
    keys = sorted({k for d in dicts if d for k in d})
    for k in keys:
        values = [(d or {}).get(k, "<missing>") for d in dicts]
        if any(v != values[0] for v in values):
            key = f"{prefix}{k}" if prefix.endswith(".") or not prefix else f"{prefix}{k!r}"
            out.append(f"{key}: {_by_rank(values, lambda v: v if isinstance(v, str) else repr(v))}")


def _diff_tensors(kind: str, lists: List[list], out: List[str]) -> None:
    tables = [{row[0]: row[1:] for row in rows} for rows in lists]
    names = list(dict.fromkeys(n for t in tables for n in t))
    for n in names:
        values = [t.get(n) for t in tables]
        if any(v != values[0] for v in values):
            def fmt(v, n=n):
                if v is None:
                    return f"no {kind} {n}"
                text = f"{tuple(v[0])} {v[1].replace('torch.', '')}"
                return text + (" frozen" if len(v) > 2 and not v[2] else "")
            out.append(f"{kind} {n}: {_by_rank(values, fmt)}")
    orders = [list(t) for t in tables]
    if not out and any(o != orders[0] for o in orders):
        out.append(f"{kind}s registered in a different order: {_by_rank(orders, lambda o: ', '.join(o[:4]) + ' ...')}")


def _some_names(names: List[str]) -> str:
    return f"{len(names)} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"


def explain(descriptions: List[dict], sections: List[str]) -> List[str]:
    """One line per difference, each naming every rank's value."""
    out: List[str] = []
    for s in sections:
        parts = [d[s] for d in descriptions]
        if s == "config":
            _diff_dicts("ZeroConfig.", parts, out)
        elif s in ("parameters", "buffers"):
            lines: List[str] = []
            _diff_tensors(s[:-1], parts, lines)
            out.extend(lines)
        elif s == "optimizer":
            if any((p is None) != (parts[0] is None) for p in parts):
                out.append(f"optimizer: {_by_rank([None if p is None else p['class'] for p in parts], str)}")
                continue
            classes = [p["class"] for p in parts]
            if any(c != classes[0] for c in classes):
                out.append(f"optimizer class: {_by_rank(classes, str)}")
            counts = [len(p["groups"]) for p in parts]
            if any(c != counts[0] for c in counts):
                out.append(f"optimizer param groups: {_by_rank(counts)}")
                continue
            for i in range(counts[0]):
                _diff_dicts(f"param group {i} ", [p["groups"][i]["hyperparameters"] for p in parts], out)
                held = [p["groups"][i]["params"] for p in parts]
                if any(h != held[0] for h in held):
                    out.append(f"param group {i} holds different parameters: {_by_rank(held, _some_names)}")
        else:
            _diff_dicts("", parts, out)
    return out


def check_same_setup(comm, model: nn.Module, optimizer, config, *, sync_module_states: bool, pretrained,
                     ranks_per_node: Optional[int] = None) -> None:
    """Collective (see [Note: the setup check]); nothing happens on a single process."""
    if comm.world_size == 1 or comm.group is None or dist.get_backend(comm.group) == "fake":
        return
    desc = describe_setup(model, optimizer, config, sync_module_states=sync_module_states, pretrained=pretrained,
                          ranks_per_node=ranks_per_node)
    digests = [_digest(desc[s]) for s in SECTIONS]
    # Always the same length: a value slot of 0 where values are not compared.
    digests.append(_values_checksum(model) if not sync_module_states and pretrained is None else 0)
    check_order, comm.check_order = comm.check_order, False  # the same collectives on every rank
    try:
        differing = agreement.exchange(comm, "the setup check (config, model, optimizer)", None,
                                       same={s: str(d) for s, d in zip(SECTIONS + ("values",), digests)}).differing
        structural = [s for s in differing if s != "values"]
        if structural:
            everyone = comm.all_gather_object({s: desc[s] for s in structural}, label="the setup check's differences")
    finally:
        comm.check_order = check_order
    if structural:
        lines = explain(everyone, structural)
        shown = lines[:_SHOWN] + ([f"... ({len(lines)} differences in all)"] if len(lines) > _SHOWN else [])
        raise SetupMismatchError(
            "zero_strategy.initialize: the ranks were set up differently, which would train wrongly or fail later "
            f"(differing: {', '.join(structural)}):\n  " + "\n  ".join(shown or ["(the descriptions differ)"]) +
            "\nEvery rank must build the same model and optimizer (same hyperparameters) and pass the same config "
            "and initialize options; make the differing values above equal on every rank."
        )
    if differing:
        warnings.warn(
            "zero_strategy.initialize: the model's parameter or buffer values differ between ranks (different "
            "seeds?) and sync_module_states=False, so every rank starts from its own values. Unless the same "
            "weights are loaded on every rank before training (a checkpoint), the replicas train apart; pass "
            "sync_module_states=True (the default) to start every rank from rank 0's values.",
            RuntimeWarning,
            stacklevel=4,
        )
