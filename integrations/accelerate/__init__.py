"""ZeRO for Accelerate and the transformers Trainer, switched on from the accelerate config file.

    # zero3.yaml (an ordinary accelerate config plus one section)
    distributed_type: MULTI_GPU
    num_processes: 2
    mixed_precision: bf16
    zero_config:
      zero_stage: 3

    accelerate launch --config_file zero3.yaml train.py        # the script is unchanged

See docs/accelerate.md.  Modules: ``settings`` (the section), ``hooks`` (the start-up
hooks), ``accelerator`` (ZeroAccelerator), ``trainer`` (Trainer checkpointing),
``state`` (checkpoint folders), ``release`` (what moving or casting a prepared model does),
``loading`` (zero3_init_flag), ``run`` (the runner where start-up hooks are unavailable).
Importing this package imports neither accelerate nor torch.
"""
from __future__ import annotations

__all__ = ["ZeroAccelerator"]


def __getattr__(name):
    if name == "ZeroAccelerator":
        from .accelerator import ZeroAccelerator

        return ZeroAccelerator
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
