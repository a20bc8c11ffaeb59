"""A streaming writer for the safetensors format, so files are written one tensor at a
time (memory bounded by the largest tensor, not the file).

Reading goes through the ``safetensors`` library (``safe_open`` reads slices without
loading whole files).  Writing is hand-rolled only because the library's writers take
every tensor of a file at once; the format is small and fixed: an 8-byte little-endian
header length, a JSON header (name -> dtype, shape, byte offsets; padded with spaces
to a multiple of 8), then the raw little-endian bytes in header order.  Tests read
every file written here back with the safetensors library.
"""
from __future__ import annotations

import json
import os
import struct
import zlib
from pathlib import Path
from typing import Dict, Optional, Tuple

import torch

from ..dtypes import safetensors_code


class StreamingSafetensorsWriter:
    def __init__(self, path, layout: Dict[str, Tuple[torch.dtype, tuple]], metadata: Optional[Dict[str, str]] = None,
                 checksum: bool = False) -> None:
        self.path = Path(path)
        # With checksum=True, the CRC-32 and size of every byte written (header included)
        # are kept in ``crc32`` / ``size`` as the file streams out (checkpoints record them).
        self._checksum = checksum
        self.crc32 = 0
        self.size = 0
        self._order = list(layout)
        header: dict = {}
        offset = 0
        self._sizes = {}
        for name, (dtype, shape) in layout.items():
            n = 1
            for s in shape:
                n *= s
            nbytes = n * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": safetensors_code(dtype), "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self._sizes[name] = (dtype, tuple(shape), nbytes)
            offset += nbytes
        if metadata:
            header["__metadata__"] = dict(metadata)
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self._header = struct.pack("<Q", len(blob)) + blob
        self._next = 0
        self._f = None

    def __enter__(self) -> "StreamingSafetensorsWriter":
        self._f = open(self.path, "wb")
        self._emit(self._header)
        return self

    def _emit(self, data: bytes) -> None:
        if self._checksum:
            self.crc32 = zlib.crc32(data, self.crc32)
            self.size += len(data)
        self._f.write(data)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected = self._order[self._next] if self._next < len(self._order) else None
        if name != expected:
            raise ValueError(f"tensors must be written in header order: expected {expected!r}, got {name!r}")
        dtype, shape, nbytes = self._sizes[name]
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(f"{name}: declared {dtype}{list(shape)}, got {tensor.dtype}{list(tensor.shape)}")
        data = tensor.detach().contiguous().cpu().reshape(-1)
        raw = data.view(torch.uint8) if data.numel() else torch.empty(0, dtype=torch.uint8)
        self._emit(raw.numpy().tobytes())
        self._next += 1

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None and self._next != len(self._order):
                raise ValueError(f"{self.path}: {len(self._order) - self._next} declared tensors were never written")
            self._f.flush()
            os.fsync(self._f.fileno())
        finally:
            self._f.close()
