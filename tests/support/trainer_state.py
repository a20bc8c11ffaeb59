"""What a transformers Trainer logged per optimizer step, read from its checkpoint."""
from __future__ import annotations

import json
from pathlib import Path


def logged_per_step(out: Path, step: int, keys) -> dict:
    """``keys`` of every training log entry in ``checkpoint-<step>/trainer_state.json``."""
    history = json.loads((Path(out) / f"checkpoint-{step}" / "trainer_state.json").read_text())["log_history"]
    steps = [h for h in history if "loss" in h]
    return {key: [h[key] for h in steps] for key in keys}
