"""The fp16 dynamic loss scaler.

The loss scaler only holds numbers; the engine decides when to consult it, and the
overflow flag it sees has already been agreed on by every rank (so all ranks skip the
same steps and keep identical scales).  ``raise_at_min_loss_scale`` is the one
collective here: the error when the scale cannot go lower.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LossScaler:
    """Dynamic (or static) loss scale for fp16 training.

    On overflow the step is skipped; after ``hysteresis`` consecutive overflows the scale
    is halved (never below ``min_scale``).  After ``window`` clean steps it doubles.
    A scale of 1 with ``dynamic=False`` is the no-op scaler used for fp32/bf16.
    """

    scale: float = 1.0
    dynamic: bool = False
    window: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    clean_steps: int = 0
    hysteresis_left: int = 2
    overflows: int = 0

    @classmethod
    def from_config(cls, config, precision) -> "LossScaler":
        """``precision``: the PrecisionPolicy (whether this precision scales the loss)."""
        if not precision.loss_scaling:
            return cls()
        if config.loss_scale > 0:
            return cls(scale=float(config.loss_scale), dynamic=False)
        return cls(
            scale=float(2 ** config.initial_scale_power),
            dynamic=True,
            window=config.loss_scale_window,
            hysteresis=config.hysteresis,
            min_scale=float(config.min_loss_scale),
            hysteresis_left=config.hysteresis,
        )

    def update(self, overflow: bool) -> None:
        if overflow:
            self.overflows += 1
        if not self.dynamic:
            return
        if overflow:
            self.clean_steps = 0
            self.hysteresis_left -= 1
            if self.hysteresis_left <= 0:
                self.scale = max(self.scale / 2.0, self.min_scale)
                self.hysteresis_left = self.hysteresis
        else:
            self.clean_steps += 1
            if self.clean_steps % self.window == 0:
                self.scale *= 2.0
                self.hysteresis_left = self.hysteresis

    # The saved fields and the type each must have: a checkpoint's values are checked
    # against this before anything is assigned (a manifest is data, not attribute names).
    _FIELDS = {"scale": float, "dynamic": bool, "window": int, "hysteresis": int, "min_scale": float,
               "clean_steps": int, "hysteresis_left": int, "overflows": int}

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in self._FIELDS}

    def load_state_dict(self, sd: dict) -> None:
        """Restore from :meth:`state_dict`; unknown keys or values of the wrong type are
        refused (ValueError naming them) and nothing is changed."""
        if not isinstance(sd, dict):
            raise ValueError(f"loss scaler state must be a dict, got {type(sd).__name__}")
        unknown = sorted(set(sd) - set(self._FIELDS))
        if unknown:
            raise ValueError(f"loss scaler state has unknown keys {unknown}; expected some of {sorted(self._FIELDS)}")
        values = {}
        for k, v in sd.items():
            kind = self._FIELDS[k]
            ok = isinstance(v, bool) if kind is bool else (isinstance(v, (int, float)) and not isinstance(v, bool))
            if kind is int and ok and float(v) != int(v):
                ok = False
            if not ok:
                raise ValueError(f"loss scaler state {k!r} must be {kind.__name__}, got {v!r}")
            values[k] = kind(v)
        if values.get("scale", self.scale) <= 0 or values.get("scale", self.scale) != values.get("scale", self.scale):
            raise ValueError(f"loss scaler state 'scale' must be a positive number, got {values.get('scale')!r}")
        for k, v in values.items():
            setattr(self, k, v)


def raise_at_min_loss_scale(sharded, scaler: LossScaler, step: int) -> None:
    """Collective.  fp16 overflowed with the scale already at its floor: raise, naming
    the parameters whose gradients hold inf/NaN on any rank."""
    local = []
    for u in sharded.trainable_units:
        g = u.grads.reduced()
        if bool(torch.isfinite(g).all()):
            continue
        bad = (~torch.isfinite(g)).nonzero().reshape(-1)
        lo = u.params_store.lo  # the shard's first element within the unit
        for i, (off, n) in enumerate(zip(u.layout.offsets, u.layout.numels)):
            if bool(((bad + lo >= off) & (bad + lo < off + n)).any()):
                local.append(u.names[i][0])
    names = sorted({n for part in sharded.comm.all_gather_object(local, "overflow report") for n in part})
    shown = ", ".join(names[:20]) + (f", ... ({len(names)} in all)" if len(names) > 20 else "")
    raise FloatingPointError(
        f"fp16 gradients overflowed at step {step} while the loss scale is already at "
        f"min_loss_scale={scaler.min_scale:g}: the scale cannot go lower, so training would only keep "
        f"skipping steps. Parameters with inf/NaN gradients: {shown or '(none found after unscaling)'}. "
        "Lower the learning rate, use bf16, or set on_min_loss_scale='skip' to keep skipping."
    )
