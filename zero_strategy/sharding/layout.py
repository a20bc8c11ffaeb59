"""Pure shard arithmetic: integers in, integers out.

[Note: flat unit]
A *flat unit* is an ordered list of tensors that ZeRO treats as one contiguous 1-D
space: tensor ``i`` occupies ``[offsets[i], offsets[i] + numels[i])``.  The space is
padded at the end to a multiple of the world size so that it splits into ``N`` equal
*shards*; rank ``r`` owns ``[r * shard_numel, (r + 1) * shard_numel)``.  Equal shards
let every collective be a plain equal-size reduce-scatter / all-gather, and padding
costs at most ``N - 1`` elements per unit (flat splitting, not per-tensor dim-0
chunking, which would pad every tensor).

Nothing here touches torch, so these functions are tested at thousands of ranks in
milliseconds.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Iterable, List, Sequence, Tuple


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class FlatLayout:
    """Where each tensor of a flat unit lives, and which slice each rank owns."""

    numels: Tuple[int, ...]
    world_size: int

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if any(n < 0 for n in self.numels):
            raise ValueError(f"tensor sizes must be >= 0, got {self.numels}")

    @cached_property  # read for every gradient and gather: computed once
    def offsets(self) -> Tuple[int, ...]:
        out, acc = [], 0
        for n in self.numels:
            out.append(acc)
            acc += n
        return tuple(out)

    @cached_property
    def numel(self) -> int:
        """Elements of real data (without padding)."""
        return sum(self.numels)

    @cached_property
    def shard_numel(self) -> int:
        """Elements each rank holds (at least 1 so empty units still have a valid shard)."""
        return max(1, ceil_div(self.numel, self.world_size))

    @cached_property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world_size

    @cached_property
    def padding(self) -> int:
        return self.padded_numel - self.numel

    def shard_range(self, rank: int) -> Tuple[int, int]:
        """``[start, end)`` of the flat space owned by ``rank`` (may cover padding)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of size {self.world_size}")
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def tensor_slices_in_shard(self, rank: int) -> List[Tuple[int, int, int, int]]:
        """For each tensor overlapping ``rank``'s shard: ``(index, start_in_tensor,
        start_in_shard, length)``.  Used to read a checkpoint slice or to load a
        full tensor into a shard without materialising the flat unit."""
        lo, hi = self.shard_range(rank)
        out = []
        for i, (off, n) in enumerate(zip(self.offsets, self.numels)):
            a, b = max(lo, off), min(hi, off + n)
            if a < b:
                out.append((i, a - off, a - lo, b - a))
        return out


def split_into_buckets(numels: Sequence[int], bucket_size: int) -> List[List[int]]:
    """Group consecutive indices so each group holds at most ``bucket_size`` elements,
    except that a single tensor larger than the bucket gets a group of its own."""
    if bucket_size < 1:
        raise ValueError(f"bucket_size must be >= 1, got {bucket_size}")
    groups: List[List[int]] = []
    current: List[int] = []
    filled = 0
    for i, n in enumerate(numels):
        if current and filled + n > bucket_size:
            groups.append(current)
            current, filled = [], 0
        current.append(i)
        filled += n
    if current:
        groups.append(current)
    return groups


def total_padding(layouts: Iterable[FlatLayout]) -> int:
    return sum(l.padding for l in layouts)
