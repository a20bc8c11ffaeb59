"""Atomic, reshardable checkpoint directories (directory: save, the reader, load,
consolidation), what on disk is ours and the atomic swap (files), the manifest's
validation and layout digest (manifest), and a streaming safetensors writer
(safetensors_io).  The names below are the public API of ``zero_strategy.checkpoint``."""
from .directory import (CheckpointError, CheckpointReader, FORMAT_VERSION, consolidate, existing_checkpoint,
                        load_checkpoint, load_client_state, load_consolidated_optimizer_state,
                        load_consolidated_optimizer_states, load_consolidated_state_dict, save_checkpoint)

__all__ = ["CheckpointError", "CheckpointReader", "FORMAT_VERSION", "consolidate", "existing_checkpoint", "load_checkpoint",
           "load_client_state", "load_consolidated_optimizer_state", "load_consolidated_optimizer_states",
           "load_consolidated_state_dict", "save_checkpoint"]
