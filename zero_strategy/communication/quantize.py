"""Block quantization for ZeRO++'s compressed collectives (qwZ, qgZ).

[Note: block quantization]
A 1-D tensor is cut into blocks of ``block`` elements (the last one padded with
zeros); each block is stored as signed integers of ``bits`` bits (8, or 4 packed two
to a byte) and one fp32 scale, its largest magnitude over the largest integer
(127 or 7), with round-to-nearest-even.  Dequantizing multiplies back in fp32.  Every
rank that dequantizes the same bytes gets the same values bit for bit (the same
kernels on the same inputs), which is what lets qwZ hand every rank identical
weights.  Bits per element on the wire: ``bits + 32 / block`` (8.125 for int8 at the
default block of 256, 4.125 for int4).

The error of one element is at most half a quantization step, ``scale / 2``: for a
block whose largest magnitude is m, ``m / 254`` at int8 and ``m / 14`` at int4.
"""
from __future__ import annotations

from typing import Tuple

import torch

_LARGEST = {8: 127, 4: 7}


def blocks_for(numel: int, block: int) -> int:
    return -(-numel // block)


def payload_bytes(numel: int, block: int, bits: int) -> int:
    """Bytes of the integer payload of ``numel`` elements (padded to whole blocks)."""
    return blocks_for(numel, block) * block * bits // 8


def wire_bytes(numel: int, block: int, bits: int) -> int:
    """Payload plus fp32 scales."""
    return payload_bytes(numel, block, bits) + 4 * blocks_for(numel, block)


def quantize_into(x: torch.Tensor, q_out: torch.Tensor, scales_out: torch.Tensor, block: int, bits: int) -> None:
    """Quantize the 1-D ``x`` into ``q_out`` (uint8, :func:`payload_bytes` long) and
    ``scales_out`` (fp32, one per block)."""
    n = x.numel()
    nb = blocks_for(n, block)
    padded = torch.zeros(nb * block, dtype=torch.float32, device=x.device)
    padded[:n].copy_(x.reshape(-1))
    rows = padded.view(nb, block)
    largest = _LARGEST[bits]
    scale = rows.abs().amax(dim=1) / largest
    scales_out.copy_(scale)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    ints = torch.round(rows / safe[:, None]).clamp_(-largest, largest).to(torch.int8)
    if bits == 8:
        q_out.copy_(ints.view(-1).view(torch.uint8))
    else:  # two nibbles a byte, offset to 0..14
        nib = (ints.view(-1, 2) + 8).to(torch.uint8)
        q_out.copy_(nib[:, 0] | (nib[:, 1] << 4))


def dequantize(q: torch.Tensor, scales: torch.Tensor, numel: int, block: int, bits: int) -> torch.Tensor:
    """fp32 values of the first ``numel`` elements that :func:`quantize_into` stored."""
    nb = scales.numel()
    if bits == 8:
        ints = q.view(torch.int8).to(torch.float32)
    else:
        low = (q & 0x0F).to(torch.int16) - 8
        high = (q >> 4).to(torch.int16) - 8
        ints = torch.stack([low, high], dim=1).view(-1).to(torch.float32)
    return (ints.view(nb, block) * scales.view(nb, 1)).view(-1)[:numel]


def buffers(numel: int, block: int, bits: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """Empty (payload, scales) for ``numel`` elements."""
    return (torch.empty(payload_bytes(numel, block, bits), dtype=torch.uint8, device=device),
            torch.empty(blocks_for(numel, block), dtype=torch.float32, device=device))


__all__ = ["blocks_for", "buffers", "dequantize", "payload_bytes", "quantize_into", "wire_bytes"]
