"""Whole parameters outside forward, to read or (from one rank) to change.

``engine.gathered_parameters(*modules, modifier_rank=r)``: stage 3 gathers the units of
``modules`` (stages 0-2 hold them whole already); with ``modifier_rank`` the values rank
``r`` left are broadcast on exit and written into every rank's shard and fp32 master.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

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
