"""The one dtype table: precision names, torch dtypes, and their names in files.

Everything that turns a word into a dtype or back (the config's "bf16", a checkpoint
manifest's "bfloat16", a safetensors header's "BF16") looks it up here, so the
spellings cannot drift apart between modules.
"""
from __future__ import annotations

from typing import Dict, NamedTuple, Optional

import torch


class DtypeNames(NamedTuple):
    name: str  # in manifests and transformers configs ("bfloat16")
    safetensors: str  # in safetensors headers ("BF16")
    precision: Optional[str]  # the config's word for a training precision ("bf16"), if it is one


TABLE: Dict[torch.dtype, DtypeNames] = {
    torch.float64: DtypeNames("float64", "F64", None),
    torch.float32: DtypeNames("float32", "F32", "fp32"),
    torch.float16: DtypeNames("float16", "F16", "fp16"),
    torch.bfloat16: DtypeNames("bfloat16", "BF16", "bf16"),
    torch.int64: DtypeNames("int64", "I64", None),
    torch.int32: DtypeNames("int32", "I32", None),
    torch.int16: DtypeNames("int16", "I16", None),
    torch.int8: DtypeNames("int8", "I8", None),
    torch.uint8: DtypeNames("uint8", "U8", None),
    torch.bool: DtypeNames("bool", "BOOL", None),
}
_BY_NAME = {v.name: k for k, v in TABLE.items()}
_BY_PRECISION = {v.precision: k for k, v in TABLE.items() if v.precision is not None}


def dtype_name(dtype: torch.dtype) -> str:
    return TABLE[dtype].name


def dtype_from_name(name: str) -> torch.dtype:
    if name not in _BY_NAME:
        raise ValueError(f"unknown dtype name {name!r}; known: {', '.join(sorted(_BY_NAME))}")
    return _BY_NAME[name]


def safetensors_code(dtype: torch.dtype) -> str:
    return TABLE[dtype].safetensors


def precision_dtype(precision: str) -> torch.dtype:
    """``"fp32"`` / ``"bf16"`` / ``"fp16"`` -> the torch dtype."""
    if precision not in _BY_PRECISION:
        raise ValueError(f"unknown precision {precision!r}; expected one of {', '.join(_BY_PRECISION)}")
    return _BY_PRECISION[precision]
