"""ZeroEngine's saving and loading methods: state dicts, pretrained weights, checkpoints.

Each delegates to the module that does the work (state_dicts/state.py,
materialize/pretrained.py, checkpoint/save.py and load.py) and then settles what the engine
holds beside the shards: the whole copies kept inside ``keep_gathered()`` are refreshed
from the new values, and under disk offload new optimizer state moves into its files
and everything leaves memory again.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

from .checkpoint.load import load_checkpoint
from .checkpoint.save import save_checkpoint
from .lifecycle import Phase
from .materialize.pretrained import load_pretrained
from .state_dicts import state as state_dicts


class SavesAndLoads:
    """Mixed into ZeroEngine (engine.py): needs ``sharded``, ``_keep``, ``_check_open``
    and ``phase``."""

    def full_state_dict(self, rank0_only: bool = True) -> Dict[str, torch.Tensor]:
        """Collective.  Whole parameters (original dtypes) and buffers under the model's
        own names, on rank 0 (or every rank)."""
        return state_dicts.full_state_dict(self.sharded, rank0_only=rank0_only)

    def load_full_state_dict(self, state_dict: Dict[str, torch.Tensor], strict: bool = True) -> None:
        """Write whole tensors (every rank passes the same) into the shards and masters."""
        state_dicts.load_full_state_dict(self.sharded, state_dict, strict=strict)
        self._keep.refresh(self.sharded.units)

    def full_optimizer_state_dict(self, rank0_only: bool = True, optimizer=None) -> dict:
        """Collective.  The optimizer state as the user's optimizer would hold it without
        ZeRO (torch's format, whole tensors, the user's parameter order), on rank 0 (or
        every rank): what DDP saves, see [Note: torch-format optimizer state] in state.py.
        With several optimizers, ``optimizer`` (an index, or the optimizer) says whose."""
        self._check_open()
        return state_dicts.full_optimizer_state_dict(self.sharded, rank0_only=rank0_only, optimizer=optimizer)

    def load_full_optimizer_state_dict(self, state_dict: dict, optimizer=None) -> None:
        """Load a torch-format optimizer state dict (ours, or a plain / DDP optimizer's
        for the same parameters); every rank passes the same one.  With several
        optimizers, ``optimizer`` (an index, or the optimizer) says whose it is."""
        self._check_open()
        state_dicts.load_full_optimizer_state_dict(self.sharded, state_dict, optimizer=optimizer)
        self._settle_disk()

    def state_dict(self) -> dict:
        """This rank's shards, optimizer state and step record (torch.save-able)."""
        return state_dicts.rank_state_dict(self)

    def load_state_dict(self, state_dict: dict) -> None:
        """The inverse of :meth:`state_dict`, on the same world size and setup."""
        state_dicts.load_rank_state_dict(self, state_dict)
        self._keep.refresh(self.sharded.units)
        self._settle_disk()

    def load_pretrained(self, path) -> Dict[str, list]:
        """Load safetensors weights (a file, or a directory with an index) into the
        shards; each rank reads only what it keeps.  Returns missing/unexpected keys."""
        report = load_pretrained(self.sharded, path)
        self._keep.refresh(self.sharded.units)
        return report

    def save_checkpoint(self, directory, client_state: Optional[dict] = None):
        """Collective: write a sharded checkpoint directory atomically."""
        try:
            return save_checkpoint(self, directory, client_state=client_state)
        finally:
            self._settle_disk()

    def load_checkpoint(self, directory, *, allow_reshard: bool = True, weights_only: Optional[bool] = True) -> Optional[dict]:
        """Collective: restore from a checkpoint saved at any world size and stage;
        returns the saved ``client_state``, unpickled with ``weights_only`` (default
        True: no code from the file runs; pass False only for a checkpoint you trust)."""
        try:
            client_state = load_checkpoint(self, directory, allow_reshard=allow_reshard, weights_only=weights_only)
        finally:
            self._settle_disk()
        self._keep.refresh(self.sharded.units)
        return client_state

    def _settle_disk(self) -> None:
        """Disk offload: a load replaced optimizer state tensors, or a save paged files in:
        move new state into the files and drop everything from memory again."""
        sm = self.sharded
        if sm.disk_offload is not None and self.phase is not Phase.CLOSED:
            if sm.inner_optimizers:
                for k, opt in enumerate(sm.inner_optimizers):
                    sm.disk_offload.adopt_all(sm.units_of(k), opt)
            else:
                sm.disk_offload.evict_all()
