"""Mixed-precision helpers: dtype names and the fp16 dynamic loss scaler.

The loss scaler only holds numbers; the engine decides when to consult it, and the
overflow flag it sees has already been agreed on by every rank (so all ranks skip the
same steps and keep identical scales).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


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
    def from_config(cls, config) -> "LossScaler":
        if not config.uses_loss_scaling:
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

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("scale", "dynamic", "window", "hysteresis", "min_scale", "clean_steps", "hysteresis_left", "overflows")}

    def load_state_dict(self, sd: dict) -> None:
        for k, v in sd.items():
            setattr(self, k, v)
