"""ZeRO++'s qgZ: a gradient reduce-scatter in two levels, quantized between nodes.

[Note: two-level reduction]
With M nodes of L ranks (rank = node * L + local rank) and a gradient of N = M * L
equal chunks, rank r must end with the sum over every rank of chunk r.

1. Inside each node, a full-precision reduce-scatter over the node communicator, of
   the chunks reordered so that local rank l receives the node's sum of chunks
   {n * L + l : every node n}: one per node, all of them destined to ranks with its
   own local rank.
2. Between nodes, an all-to-all over the cross communicator (the M ranks with this
   local rank): the piece for node n, block-quantized to int8 or int4
   ([Note: block quantization] in quantize.py), goes to rank n * L + l.  Each rank
   dequantizes the M - 1 pieces it received in fp32, adds its own node's piece
   (never quantized), and casts the sum to the gradient dtype.

Step 1 is issued when the reducer launches the unit (asynchronous, overlapping
backward as a plain reduce-scatter does); step 2 runs when the reducer waits for it.
Cross-node bytes per rank: (M - 1) / M of 1/L of the gradient at bits + 32/block
bits per element, against (M - 1) / M of all of it at 16 or 32 bits for a flat
reduce-scatter.  No error feedback: the rounding of one step is not carried into the
next (ZeRO++ reports convergence unchanged without it for int4 with blocks of this
size; docs/benchmarks/zero_plus_plus.md shows the loss curves measured here).
"""
from __future__ import annotations

import torch

from . import quantize as Q


class TwoLevelReduceScatter:
    """One unit's reduction in flight (step 1 issued); ``wait`` runs step 2."""

    def __init__(self, comm, out: torch.Tensor, full: torch.Tensor, bits: int, block: int, label: str) -> None:
        node, cross = comm.node_comm, comm.cross_comm
        m, l = cross.world_size, node.world_size
        self.comm, self.out, self.bits, self.block, self.label = comm, out, bits, block, label
        c = full.numel() // (m * l)
        # Chunk n * L + l of the gradient moves to row l, column n: local rank l's slice
        # of the node reduce-scatter then holds every node's chunk for its own local rank.
        reordered = full[: m * l * c].view(m, l, c).transpose(0, 1).contiguous().view(-1)
        self.pieces = torch.empty(m * c, dtype=full.dtype, device=full.device)
        self.work = node.reduce_scatter(self.pieces, reordered, async_op=True, label=f"{label} (within the node)",
                                        scratch=True)
        self._reordered = reordered  # kept until the collective is done with it

    def wait(self) -> bool:
        if self.work is None:
            return True
        self.work.wait()
        self.work = self._reordered = None
        cross = self.comm.cross_comm
        m, me = cross.world_size, cross.rank
        c = self.pieces.numel() // m
        q_row, s_row = Q.payload_bytes(c, self.block, self.bits), Q.blocks_for(c, self.block)
        q_send = torch.empty(m * q_row, dtype=torch.uint8, device=self.pieces.device)
        s_send = torch.empty(m * s_row, dtype=torch.float32, device=self.pieces.device)
        rows = self.pieces.view(m, c)
        for n in range(m):
            Q.quantize_into(rows[n], q_send[n * q_row : (n + 1) * q_row], s_send[n * s_row : (n + 1) * s_row],
                            self.block, self.bits)
        q_recv, s_recv = torch.empty_like(q_send), torch.empty_like(s_send)
        cross.all_to_all_quantized(q_recv, q_send, s_recv, s_send, rows=m, numel_per_row=c, bits=self.bits,
                                   label=f"{self.label} (between nodes, int{self.bits})")
        total = rows[me].to(torch.float32)  # this node's own piece, exact
        for n in range(m):
            if n != me:
                total += Q.dequantize(q_recv[n * q_row : (n + 1) * q_row], s_recv[n * s_row : (n + 1) * s_row], c,
                                      self.block, self.bits)
        self.out.copy_(total)
        self.pieces = None
        return True

    def is_completed(self) -> bool:
        return self.work is None


__all__ = ["TwoLevelReduceScatter"]
