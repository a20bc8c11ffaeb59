"""Whole parameters outside forward, to read or (from one rank) to change.

``engine.gathered_parameters(*modules, modifier_rank=r)``: stage 3 gathers the units of
``modules`` (stages 0-2 hold them whole already); with ``modifier_rank`` the values rank
``r`` left are broadcast on exit and written into every rank's shard and fp32 master.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.nn as nn

from .param_shard import ShardState


@contextlib.contextmanager
def gathered_parameters(sharded, modules, modifier_rank: Optional[int] = None) -> Iterator[None]:
    comm = sharded.comm
    if modifier_rank is not None and not 0 <= int(modifier_rank) < comm.world_size:
        raise ValueError(f"modifier_rank must be a rank of the engine's process group (0..{comm.world_size - 1}), got {modifier_rank}")
    wanted = {id(p) for m in (modules or (sharded.module,)) for p in m.parameters()}
    units = [u for u in sharded.units if any(id(p) in wanted for p in u.params)]
    untouched = [p for p in sharded.untouched.values() if id(p) in wanted]
    gathered_here = []
    for u in units:
        if not u.keep_full and u.state is not ShardState.GATHERED:
            u.params_store.start_gather(comm, u.label)
            gathered_here.append(u)
    for u in gathered_here:
        u.params_store.finish_gather()
    try:
        yield
        if modifier_rank is not None:
            with torch.no_grad():
                for u in units:
                    comm.broadcast(u.params_store.full.data, int(modifier_rank), label=f"the modified {u.label}")
                    u.params_store.adopt_gathered()
                for p in untouched:
                    comm.broadcast(p.data, int(modifier_rank), label="a modified parameter")
    finally:
        for u in gathered_here:
            u.params_store.release()


class WholeParameters:
    """ZeroEngine's whole-parameter contexts (mixed in; needs ``sharded``, ``_keep``
    (keep_gathered.py) and ``_check_open``)."""

    @contextlib.contextmanager
    def keep_gathered(self) -> Iterator[bool]:
        """Collective.  Stage 3: inside, every parameter stays gathered, so a loop of
        forwards (generate()) communicates nothing after the gather at the start; at
        the end they are sharded again.  Yields whether they are held: False when the
        gathered model would exceed ``keep_gathered_max_bytes`` (then each forward gathers
        layer by layer as usual, after a one-time warning).  Below stage 3 the
        parameters are always whole (True).  Entered automatically around the methods
        named in ``keep_gathered_methods`` (default: ``generate``)."""
        self._check_open()
        with self._keep.region() as holding:
            yield holding

    @contextlib.contextmanager
    def gathered_parameters(self, *modules: nn.Module, modifier_rank: Optional[int] = None) -> Iterator[None]:
        """Collective.  Inside, the parameters of ``modules`` (default: the whole model) are
        whole on every rank and may be read (stage 3; stages 0-2 always hold them whole).

        ``modifier_rank=r`` keeps the changes rank ``r`` makes inside: on exit its values
        are broadcast and written into every rank's shard and fp32 master weights (in the
        compute dtype's precision).  Without it, changes made inside are discarded
        (stage 3) or must not be made (stages 0-2: the next step would overwrite them
        from the master weights).  Do not run the model's forward inside.
        """
        self._check_open()
        with gathered_parameters(self.sharded, modules, modifier_rank):
            yield
