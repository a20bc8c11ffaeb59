"""Memory accounting that does not trust the engine's own bookkeeping.

``optimizer_state_bytes`` sums the tensors an optimizer holds.  ``live_tensor_bytes``
walks every tensor the garbage collector can see and adds up each distinct storage
once: an independent check of ``memory_report`` used by the tests and benchmarks.
"""
from __future__ import annotations

import gc
import warnings
from typing import Optional

import torch


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    seen, total = set(), 0
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                key = (v.device, v.untyped_storage().data_ptr()) if v.device.type != "meta" else id(v)
                if key not in seen:
                    seen.add(key)
                    total += v.untyped_storage().nbytes()
    return total


def live_tensor_bytes(device: Optional[str] = None) -> int:
    """Bytes of every distinct tensor storage reachable by the garbage collector."""
    gc.collect()
    seen, total = set(), 0
    with warnings.catch_warnings():
        # isinstance() on every live object touches deprecated torch attributes.
        warnings.simplefilter("ignore")
        objects = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for obj in objects:
        try:
            if not isinstance(obj, torch.Tensor):
                continue
            if device is not None and obj.device.type != device:
                continue
            storage = obj.untyped_storage()
            key = (obj.device, storage.data_ptr())
            if storage.data_ptr() == 0 or key in seen:
                continue
            seen.add(key)
            total += storage.nbytes()
        except Exception:  # tensors without storage (sparse, functional wrappers)
            continue
    return total


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (Linux reports KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
