"""A folder of safetensors weights as files to read: which file holds which tensor (a
single file, or an index whose file names may not lead outside the folder), and how a
model's names map to a file's keys (prefixes added or dropped, as transformers does)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Dict, Optional

from ..checkpoint.files import CheckpointError, read_json, require_regular


def weight_files(path) -> Dict[str, Path]:
    """name -> safetensors file, for a file, or a directory with one file or an index
    (``model.safetensors.index.json``; its file names may not lead outside the folder)."""
    path = Path(path)
    if os.path.lexists(path) and not path.is_dir():  # a file (or something posing as one: refused below)
        files = [path]
    else:
        index = path / "model.safetensors.index.json"
        if os.path.lexists(index):
            weight_map = read_json(index, follow_links=True)
            if not isinstance(weight_map, dict) or not isinstance(weight_map.get("weight_map"), dict):
                raise CheckpointError(f"{index} must hold an object with a 'weight_map' object")
            found = {k: file_inside(path, v, index) for k, v in weight_map["weight_map"].items()}
            for f in set(found.values()):
                require_regular(f, follow_links=True)
            return found
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no .safetensors weights in {path} (looked for model.safetensors or an index)")
    from safetensors import safe_open

    out = {}
    for f in files:
        # Links are followed (the Hugging Face cache's snapshots are links to blobs), but a
        # FIFO or a device would block or read without end inside safetensors' native open.
        require_regular(f, follow_links=True)
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                out[k] = f
    return out




def file_inside(folder: Path, name, named_in: Path) -> Path:
    """``folder / name`` for a file name read from ``named_in`` (an index), refusing
    anything that would lead outside ``folder``: absolute paths, ``..``, links out."""
    if not isinstance(name, str) or not name or os.path.isabs(name):
        raise ValueError(f"{named_in} names the weight file {name!r}: only a file inside {folder} is accepted")
    root = Path(folder).resolve()
    target = (root / name).resolve()
    if target != root and root not in target.parents:
        raise ValueError(f"{named_in} names the weight file {name!r}, which lies outside {folder}; refusing to read it")
    return target




def _key_resolver(model_names, file_keys) -> Callable[[str], Optional[str]]:
    """name in the model -> key in the files.  Keys normally match; a checkpoint saved from
    the model's inner module (keys without the model's first name component, e.g. a
    causal-LM head model loading a base-model checkpoint) or from a wrapper (keys with one
    extra leading component) is matched by that one prefix."""
    def exact(n):
        return n if n in file_keys else None

    if any(n in file_keys for n in model_names):
        return exact
    for n in model_names:
        head, _, rest = n.partition(".")
        if rest and rest in file_keys:
            strip = head + "."
            return lambda n: exact(n[len(strip):]) if n.startswith(strip) else None
    for head in sorted({k.partition(".")[0] for k in file_keys if "." in k}):
        if any(f"{head}.{n}" in file_keys for n in model_names):
            return lambda n: exact(f"{head}.{n}")
    return exact
