"""The host optimizer step over one unit's flat fp32 buffers with torch's fused CPU kernel.

[Note: fused host step]
With ``offload_optimizer`` "cpu" or "nvme" the optimizer runs on the host, over one
tensor per parameter piece of each unit ([Note: one optimizer tensor per parameter] in
flat_unit.py).  Torch's default CPU Adam (foreach, or a for loop) makes several passes
over memory per piece, each through a temporary; its ``fused=True`` CPU kernel reads
and writes each element once, vectorised and over all cores, and runs about ten times
faster, the more so the fewer and longer the tensors it is handed.  So when nothing
would differ, :func:`fused_host_step` hands the fused kernel *one flat tensor per run of
pieces* instead of the optimizer's many views:

* eligible: the optimizer's class is exactly torch's Adam, AdamW, SGD or Adagrad; its
  group does not set ``fused=False``, ``differentiable`` or ``capturable``; the
  hyperparameters are numbers (a tensor ``lr`` is fine: the kernel takes it); the
  target and gradient are fp32 on the CPU; no AMP ``grad_scale`` / ``found_inf`` is set
  on the optimizer; existing state has torch's format.  Otherwise it returns False and
  the caller runs ``optimizer.step()`` over the views, as before.
* a *run* is a maximal sequence of adjacent pieces (consecutive in the shard) that got a
  gradient and whose state is in one condition: none yet, or the same ``step`` (Adam,
  Adagrad), or all with / all without a momentum buffer (SGD).  Each run is one kernel
  call over ``target[a:b]`` and ``grad[a:b]``, with one step tensor.  A piece without
  gradient ends a run and is skipped entirely (no weight decay, no step count), exactly
  as torch skips a parameter whose ``.grad`` is None.  The kernel's arithmetic is
  torch's own fused implementation; it differs from the for-loop one by rounding only
  (FMA), as ``fused=True`` on the same optimizer would.
* the state stays torch's, per piece, in ``optimizer.state[piece]`` (``step`` tensors,
  ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``, ``momentum_buffer``, ``sum``), so state
  dicts, sharded checkpoints and disk offload read it as before.  Each per-element state
  tensor is a view, shaped like its piece, into one flat fp32 buffer per key covering
  the unit's shard (the piece's slot is its place in the target), so a run's state is
  one slice.  The buffer is not kept anywhere else: it is the storage those views share
  (:func:`_flat_for`).  So when disk offload adopts the state into its files (views of
  its own per-unit flat file of the shard's length), those files *are* the buffers from
  the next step on, and the first step's in-memory buffers are freed as soon as they
  were adopted, instead of staying behind next to the files.  A state tensor that is
  not (or no longer: after ``load_state_dict``, a checkpoint load) a view at its slot
  is copied into the buffer and its entry replaced by the view.  After a run, every
  piece's ``step`` gets the run's new value.  State made on a first step is what torch
  makes (zeros, Adagrad's ``initial_accumulator_value``, SGD's momentum buffer = the
  first gradient, which the kernel writes with ``is_first_step``).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch
from torch.optim.optimizer import _get_scalar_dtype

_ADAM = (torch.optim.Adam, torch.optim.AdamW)
_CLASSES = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)
_NEW = "new"  # the condition of a piece without state yet


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _lr_ok(lr) -> bool:
    if _number(lr):
        return True
    return isinstance(lr, torch.Tensor) and lr.numel() == 1 and lr.device.type == "cpu" and not lr.requires_grad


def _group_ok(optimizer, group) -> bool:
    if group.get("fused") is False or group.get("differentiable", False) or group.get("capturable", False):
        return False
    if not _lr_ok(group["lr"]):
        return False
    cls = type(optimizer)
    if cls in _ADAM:
        b1, b2 = group["betas"]
        return all(_number(v) for v in (b1, b2, group["eps"], group["weight_decay"]))
    if cls is torch.optim.SGD:
        return all(_number(group[k]) for k in ("momentum", "dampening", "weight_decay"))
    return (all(_number(group[k]) for k in ("lr_decay", "eps", "weight_decay"))
            and _number(optimizer.defaults.get("initial_accumulator_value", 0.0)))


def _state_keys(optimizer, group) -> List[str]:
    """The per-element state tensors torch keeps for each parameter of ``group``."""
    cls = type(optimizer)
    if cls in _ADAM:
        return ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group["amsgrad"] else [])
    if cls is torch.optim.SGD:
        return ["momentum_buffer"] if group["momentum"] != 0 else []
    return ["sum"]


def _tensor_ok(v, piece) -> bool:
    return (isinstance(v, torch.Tensor) and v.dtype == torch.float32 and v.device == piece.device
            and v.shape == piece.shape and v.is_contiguous())


def _condition(optimizer, group, state, keys, piece):
    """``_NEW`` (no state yet), a step value, True/False (SGD: has a momentum buffer),
    or None where the state is not in torch's format (then the caller falls back)."""
    def tensor_ok(v):
        return _tensor_ok(v, piece)

    if type(optimizer) is torch.optim.SGD:
        if not keys:
            return True  # no state at all: every piece is alike
        buf = state.get("momentum_buffer") if state else None
        if buf is None:
            return False
        return True if tensor_ok(buf) else None
    if not state:
        return _NEW
    step = state.get("step")
    if not (isinstance(step, torch.Tensor) and step.dim() == 0 and step.is_floating_point() and step.device.type == "cpu"):
        return None
    if not all(tensor_ok(state.get(k)) for k in keys):
        return None
    return float(step)


def _flat_for(key: str, pieces, slices, states, n: int, taken: set) -> Optional[torch.Tensor]:
    """The flat buffer the pieces' ``key`` tensors already are views of, each at its slot,
    or None.  Accepted: one storage, one base offset, room for the whole shard, and either
    the storage is exactly the shard's length (ours, disk offload's files) or every piece
    of the unit is in it (so the free slots filled later belong to this unit)."""
    storage = base = None
    present = 0
    for t, (_, s_start, _), st in zip(pieces, slices, states):
        v = st.get(key) if st else None
        if v is None:
            continue
        s = v.untyped_storage()
        b = v.storage_offset() - s_start
        if storage is None:
            storage, base = s, b
        elif s.data_ptr() != storage.data_ptr() or b != base:
            return None
        present += 1
    if storage is None or base < 0 or storage.data_ptr() in taken:
        return None
    elsize = 4
    if storage.nbytes() < (base + n) * elsize:
        return None
    if not ((base == 0 and storage.nbytes() == n * elsize) or present == len(pieces)):
        return None
    return torch.empty(0, dtype=torch.float32, device=pieces[0].device).set_(storage, base, (n,), (1,))


def _place_state(optimizer, unit, keys, states, n: int, taken: set) -> Dict[str, torch.Tensor]:
    """One flat buffer per key over the shard, with every piece's existing ``key`` tensor
    a view of it at the piece's slot (copied there where it was not).  ``taken``: data
    pointers of storages that must not serve as a buffer (the target, the gradient, the
    buffers of other keys)."""
    pieces, slices = unit.optim_params, unit.optim_slices
    flats: Dict[str, torch.Tensor] = {}
    for key in keys:
        flat = _flat_for(key, pieces, slices, states, n, taken)
        if flat is None:
            flat = torch.zeros(n, dtype=torch.float32, device=pieces[0].device)
            # Values that live in some other buffer: first take them all out (a slot here
            # may be another piece's source), then put them in place.
            moved = []
            for t, (_, s_start, length), st in zip(pieces, slices, states):
                v = st.get(key) if st else None
                if v is not None:
                    moved.append((st, s_start, length, t.shape, v))
            for st, s_start, length, shape, v in moved:
                flat[s_start : s_start + length].copy_(v.reshape(-1))
                st[key] = flat[s_start : s_start + length].view(shape)
        flats[key] = flat
        taken.add(flat.untyped_storage().data_ptr())
    return flats


def fused_host_step(optimizer: torch.optim.Optimizer, unit, flat_grad: torch.Tensor,
                    used: Optional[Sequence[bool]]) -> bool:
    """Step ``unit`` (its group alone holds params: ``unit.optim_params``) with torch's
    fused CPU kernel over flat runs of its shard, ``flat_grad`` being its flat fp32
    gradient slice and ``used`` (None: all) which parameter positions got a gradient.
    Returns False, having changed nothing, where that would not be the optimizer's own
    update; see [Note: fused host step]."""
    # The unit's group in its own optimizer (an engine with several optimizers numbers
    # the groups of each from 0: ``local_group_index``).
    gi = getattr(unit, "local_group_index", unit.group_index)
    if type(optimizer) not in _CLASSES or gi is None or getattr(unit, "whole_params", None) is not None:
        return False  # whole-parameter mode hands the optimizer other tensors
    if getattr(optimizer, "grad_scale", None) is not None or getattr(optimizer, "found_inf", None) is not None:
        return False
    group = optimizer.param_groups[gi]
    if not _group_ok(optimizer, group):
        return False
    target = unit.params_store.optimizer_target
    n = target.numel()
    if (target.device.type != "cpu" or target.dtype != torch.float32 or target.dim() != 1 or not target.is_contiguous()
            or not isinstance(flat_grad, torch.Tensor) or flat_grad.layout != torch.strided
            or flat_grad.device != target.device or flat_grad.dtype != torch.float32 or flat_grad.dim() != 1
            or flat_grad.numel() != n or flat_grad.stride(0) != 1):
        return False
    pieces, slices = unit.optim_params, unit.optim_slices
    if slices is None or len(pieces) != len(slices):
        return False
    if not pieces:
        return True
    if any(t is not p for t, p in zip(pieces, group["params"])) or len(group["params"]) != len(pieces):
        return False
    tptr = target.data_ptr()
    for t, (_, s_start, length) in zip(pieces, slices):
        if (t.data_ptr() != tptr + 4 * s_start or t.numel() != length or not t.is_contiguous()
                or s_start < 0 or s_start + length > n or length == 0):
            return False
    keys = _state_keys(optimizer, group)
    states = [optimizer.state.get(t) for t in pieces]
    conditions = []
    for t, (pos, _, _), st in zip(pieces, slices, states):
        if used is not None and not used[pos]:
            # Skipped; its state is only moved into the buffers (so it must be torch's format).
            if st and not all(st.get(k) is None or _tensor_ok(st.get(k), t) for k in keys):
                return False
            conditions.append(None)
            continue
        c = _condition(optimizer, group, st, keys, t)
        if c is None:
            return False
        conditions.append(("run", c))

    with torch.no_grad():
        flats = _place_state(optimizer, unit, keys, states, n, {target.untyped_storage().data_ptr(),
                                                                 flat_grad.untyped_storage().data_ptr()})
        # Runs: maximal adjacent used pieces in one condition, contiguous in the shard.
        runs: List[List[int]] = []
        for j, c in enumerate(conditions):
            if c is None:
                continue
            if (runs and conditions[runs[-1][-1]] == c
                    and slices[runs[-1][-1]][1] + slices[runs[-1][-1]][2] == slices[j][1]):
                runs[-1].append(j)
            else:
                runs.append([j])
        for run in runs:
            _step_run(optimizer, group, unit, flats, keys, run, conditions[run[0]][1], target, flat_grad)
    return True


def _step_run(optimizer, group, unit, flats, keys, run, cond, target, flat_grad) -> None:
    pieces, slices = unit.optim_params, unit.optim_slices
    a = slices[run[0]][1]
    b = slices[run[-1]][1] + slices[run[-1]][2]
    param, grad = target[a:b], flat_grad[a:b]
    state = optimizer.state
    cls = type(optimizer)
    new = cond == _NEW or (cls is torch.optim.SGD and cond is False)
    if new:  # torch's lazy initialisation, into the buffers' slots
        if cls in _ADAM:
            for key in keys:
                flats[key][a:b].zero_()
        elif cls is torch.optim.Adagrad:
            flats["sum"][a:b].fill_(optimizer.defaults["initial_accumulator_value"])
        # SGD: the kernel writes the first momentum buffer (is_first_step)
    if cls is torch.optim.SGD:
        torch._fused_sgd_([param], [grad], [flats["momentum_buffer"][a:b]] if keys else [],
                          weight_decay=group["weight_decay"], momentum=group["momentum"], lr=group["lr"],
                          dampening=group["dampening"], nesterov=group["nesterov"], maximize=group["maximize"],
                          is_first_step=new and bool(keys))
        if new and keys:
            for j in run:
                t, (_, s_start, length) = pieces[j], slices[j]
                state[t]["momentum_buffer"] = flats["momentum_buffer"][s_start : s_start + length].view(t.shape)
        return
    step_value = (0.0 if cond == _NEW else cond) + 1.0
    step = torch.tensor(step_value, dtype=torch.float32)
    if cls in _ADAM:
        beta1, beta2 = group["betas"]
        fn = torch._fused_adamw_ if group.get("decoupled_weight_decay", cls is torch.optim.AdamW) else torch._fused_adam_
        fn([param], [grad], [flats["exp_avg"][a:b]], [flats["exp_avg_sq"][a:b]],
           [flats["max_exp_avg_sq"][a:b]] if group["amsgrad"] else [], [step],
           amsgrad=group["amsgrad"], lr=group["lr"], beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"],
           eps=group["eps"], maximize=group["maximize"])
    else:
        torch._fused_adagrad_([param], [grad], [flats["sum"][a:b]], [step], lr=group["lr"],
                              lr_decay=group["lr_decay"], weight_decay=group["weight_decay"], eps=group["eps"],
                              maximize=group["maximize"])
    for j in run:
        t, (_, s_start, length) = pieces[j], slices[j]
        st = state[t]
        if cond == _NEW:
            # As torch makes it (then increments it): on the piece's device with fused, else the CPU default.
            st["step"] = (torch.tensor(step_value, dtype=_get_scalar_dtype(is_fused=True), device=t.device)
                          if group.get("fused") else torch.tensor(step_value, dtype=_get_scalar_dtype()))
            for key in keys:
                st[key] = flats[key][s_start : s_start + length].view(t.shape)
        else:
            st["step"].fill_(step_value)


__all__ = ["fused_host_step"]
