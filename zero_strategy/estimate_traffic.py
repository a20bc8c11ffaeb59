"""Bytes a rank sends per training step, and how many of them cross nodes.

The model is the communicator's ([Note: direct-exchange bytes] in
communication/topology.py): in a collective over g ranks a rank hands S/g of a tensor
of S bytes to each other member (twice for an all-reduce), and the part for members on
other nodes is cross-node.  With N ranks in nodes of L (M = N / L nodes), Ψ parameters
of b bytes (2 for bf16/fp16, 4 for fp32):

* stages 0-2 move 2Ψb per step (an all-reduce, or a reduce-scatter and an all-gather),
  stage 3 3Ψb (forward and backward all-gathers and a reduce-scatter); of each, the
  fraction (N - L) / N crosses nodes.
* hpZ (``secondary_partition``): backward's all-gather stays in the node; it costs Ψb/L
  of memory per rank from forward to backward (every unit's node slice at its peak).
* qwZ (``weight_quantization``): every all-gather that still crosses nodes carries
  1 + 4/B bytes per element (int8 and an fp32 scale per block of B).
* qgZ (``gradient_quantization``): a reduce-scatter of Ψb inside the node, then each
  rank sends (M - 1) / M of its Ψ/L elements to the other nodes at bits/8 + 4/B bytes.

These are first-order counts (no padding, no small control traffic, no saving from the
group kept gathered between forward and backward); ``comm_report()`` measures the
real ones.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .estimate import bytes_per_element


@dataclass(frozen=True)
class Traffic:
    sent: float  # bytes per rank per step
    cross_node: float
    extra_memory: float = 0.0  # hpZ's secondary partition, bytes per rank


def step_traffic(params: int, world_size: int, ranks_per_node: int, stage: int, precision: str, *,
                 secondary_partition: bool = False, weight_bits: Optional[int] = None,
                 gradient_bits: Optional[int] = None, block: int = 256) -> Traffic:
    """Bytes one rank sends per step (see the module's note)."""
    n, l = world_size, ranks_per_node
    if n % l:
        raise ValueError(f"ranks_per_node={l} does not divide the world size {n}")
    if n == 1:
        return Traffic(0.0, 0.0)
    b = bytes_per_element(precision)
    out, cross = (n - 1) / n, (n - l) / n  # a world collective: sent, of which across nodes
    psi = float(params)
    if stage < 3:
        return Traffic(2 * psi * b * out, 2 * psi * b * cross)
    gather = psi * (1 + 4 / block) if weight_bits else psi * b  # one all-gather's full tensor, as it moves
    sent = gather * out  # forward
    crossing = gather * cross
    if secondary_partition:
        sent += psi * b * (l - 1) / l  # backward, from the node's secondary partition
    else:
        sent += gather * out
        crossing += gather * cross
    if gradient_bits:
        m = n // l
        piece = (psi / l) * (m - 1) / m * (gradient_bits / 8 + 4 / block)
        sent += psi * b * (l - 1) / l + piece
        crossing += piece
    else:
        sent += psi * b * out
        crossing += psi * b * cross
    return Traffic(sent, crossing, psi * b / l if secondary_partition else 0.0)


__all__ = ["Traffic", "step_traffic"]
