"""Atomic, reshardable checkpoint directories: the names and notes on the layout
(names), writing one (save), reading one at any world size (reader), restoring an
engine (load), whole tensors and safetensors files from one (consolidate); what on disk
is ours and the atomic swap (files), the manifest's validation and layout digest
(manifest), and a streaming safetensors writer (safetensors_io).  The names below are
the public API of ``zero_strategy.checkpoint``."""
from .consolidate import (consolidate, load_consolidated_optimizer_state, load_consolidated_optimizer_states,
                          load_consolidated_state_dict)
from .files import CheckpointError
from .files import existing as existing_checkpoint
from .load import load_checkpoint
from .manifest import FORMAT_VERSION
from .reader import CheckpointReader, load_client_state
from .save import save_checkpoint

__all__ = ["CheckpointError", "CheckpointReader", "FORMAT_VERSION", "consolidate", "existing_checkpoint", "load_checkpoint",
           "load_client_state", "load_consolidated_optimizer_state", "load_consolidated_optimizer_states",
           "load_consolidated_state_dict", "save_checkpoint"]
