"""What the transformers Trainer needs on top of ZeroAccelerator.

The Trainer (5.x) drives Accelerate for the training step (prepare, backward,
no_sync, clip_grad_norm_, optimizer_step_was_skipped), so :class:`ZeroAccelerator`
covers those.  Its checkpointing, though, reads and writes the model and optimizer
directly, and for a third-party engine it takes the generic DDP branches:

* ``save_model`` would save ``model.state_dict()`` from rank 0 alone (under stage 3 the
  parameters are partitioned) -> consolidate on every rank, write on the main one;
* ``_save_optimizer_and_scheduler`` would save rank 0's optimizer shard as if it were
  the whole optimizer -> every rank writes its shard (``zero_checkpoint/``), and rank 0
  also writes ``optimizer.pt`` in torch's own format (the whole optimizer state as a
  plain optimizer holds it), so a run under a plain DDP config resumes from the same
  checkpoint with its optimizer state (the stock Trainer would otherwise skip it
  without a word);
* ``_load_optimizer_and_scheduler`` -> every rank restores its shard from
  ``zero_checkpoint/``, or, for a checkpoint a DDP run wrote, its part of
  ``optimizer.pt``;
* ``_load_from_checkpoint`` / ``_load_best_model`` on an already partitioned model ->
  load the consolidated weights through the engine.

:func:`patch_trainer` wraps these five methods on the Trainer class; each wrapper
calls the original unless the Trainer's model runs on a ZeroEngine.
"""
from __future__ import annotations

import functools
import os
import warnings

import torch

from . import state as _state

_SCHEDULER_NAME = "scheduler.pt"
_OPTIMIZER_NAME = "optimizer.pt"  # the stock Trainer's name for it


def _engine(trainer):
    accelerator = getattr(trainer, "accelerator", None)
    lookup = getattr(accelerator, "zero_engine_for", None)
    return None if lookup is None else lookup(getattr(trainer, "model", None))


def _save_model(original, self, output_dir=None, _internal_call=False):
    engine = _engine(self)
    if engine is None:
        return original(self, output_dir, _internal_call=_internal_call)
    if output_dir is None:
        output_dir = self.args.output_dir
    state_dict = self.accelerator.get_state_dict(self.model)  # collective
    if self.args.should_save:
        self._save(output_dir, state_dict=state_dict)
    if self.args.push_to_hub and not _internal_call:
        self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)


def _save_optimizer_and_scheduler(original, self, output_dir):
    engine = _engine(self)
    if engine is None:
        return original(self, output_dir)
    _state.save_engine(engine, output_dir)
    full = engine.full_optimizer_state_dict()  # collective; rank 0 gets it
    if self.args.should_save:
        torch.save(full, os.path.join(output_dir, _OPTIMIZER_NAME))
    del full
    if self.args.should_save and self.lr_scheduler is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch's "save the optimizer too" reminder
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, _SCHEDULER_NAME))


def _load_optimizer_and_scheduler(original, self, checkpoint):
    engine = _engine(self)
    if engine is None or checkpoint is None:
        return original(self, checkpoint)
    from zero_strategy.checkpoint import existing_checkpoint as existing

    plain = os.path.join(checkpoint, _OPTIMIZER_NAME)
    if existing(os.path.join(checkpoint, _state.CHECKPOINT_SUBDIR)) is None and os.path.isfile(plain):
        # Written by a run without zero_config (DDP): the whole state in torch's format.
        engine.load_full_optimizer_state_dict(torch.load(plain, map_location="cpu", weights_only=True))
    else:
        _state.load_engine(engine, checkpoint)
    scheduler_file = os.path.join(checkpoint, _SCHEDULER_NAME)
    if self.lr_scheduler is not None and os.path.isfile(scheduler_file):
        self.lr_scheduler.load_state_dict(torch.load(scheduler_file, weights_only=True))


def _load_from_checkpoint(original, self, resume_from_checkpoint, model=None):
    engine = _engine(self)
    if engine is None or (model is not None and self.accelerator.zero_engine_for(model) is None):
        return original(self, resume_from_checkpoint, model)
    engine.load_full_state_dict(_state.read_consolidated_weights(resume_from_checkpoint), strict=False)


def _load_best_model(original, self):
    engine = _engine(self)
    if engine is None:
        return original(self)
    engine.load_full_state_dict(_state.read_consolidated_weights(self.state.best_model_checkpoint), strict=False)


_WRAPPERS = {
    "save_model": _save_model,
    "_save_optimizer_and_scheduler": _save_optimizer_and_scheduler,
    "_load_optimizer_and_scheduler": _load_optimizer_and_scheduler,
    "_load_from_checkpoint": _load_from_checkpoint,
    "_load_best_model": _load_best_model,
}


def patch_trainer(trainer_cls) -> None:
    """Wrap the Trainer's checkpoint methods (idempotent)."""
    for name, wrapper in _WRAPPERS.items():
        original = getattr(trainer_cls, name)
        if getattr(original, "_zero_strategy", False):
            continue
        method = _bind(wrapper, original)
        method._zero_strategy = True
        setattr(trainer_cls, name, method)


def _bind(wrapper, original):
    @functools.wraps(original)
    def method(self, *args, **kwargs):
        return wrapper(original, self, *args, **kwargs)

    return method
