"""Turn a ZeroStrategy checkpoint directory into an ordinary single-file Lightning checkpoint.

    python -m zero_strategy.integrations.lightning.consolidate CKPT_DIR OUT.ckpt

The output holds the consolidated weights under ``state_dict`` (original names and
dtypes) plus everything else Lightning saved (hyper-parameters, loops, callbacks, LR
schedulers), so ``MyModule.load_from_checkpoint("OUT.ckpt")`` and
``trainer.test(model, ckpt_path="OUT.ckpt")`` work with any strategy.  It has no
``optimizer_states``: to resume training, resume from the directory with ZeroStrategy.
Runs in a single process without a process group; needs memory for the whole model.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

import torch

CLIENT_STATE = "client_state.pt"


def consolidate_checkpoint(checkpoint_dir, output_file: Optional[str] = None, *, weights_only: bool = True) -> dict:
    """Return the single-file checkpoint dict; also write it to ``output_file`` if given.

    Lightning's state in the directory is read with ``weights_only`` (default True:
    nothing in the file can run code); pass False only for a checkpoint you trust."""
    from zero_strategy.checkpoint import load_client_state, load_consolidated_state_dict

    directory = Path(checkpoint_dir)
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory} is not a ZeroStrategy checkpoint directory")
    checkpoint = {}
    client = directory / CLIENT_STATE
    if client.exists():
        checkpoint.update(load_client_state(client, weights_only=weights_only))
    checkpoint["state_dict"] = load_consolidated_state_dict(directory)
    checkpoint.pop("optimizer_states", None)
    if output_file is not None:
        out = Path(output_file)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        torch.save(checkpoint, tmp)
        tmp.replace(out)
    return checkpoint


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m zero_strategy.integrations.lightning.consolidate",
        description="Write an ordinary Lightning checkpoint file from a ZeroStrategy checkpoint directory.",
    )
    parser.add_argument("checkpoint_dir", help="directory written by ZeroStrategy (e.g. epoch=0-step=10.ckpt/)")
    parser.add_argument("output_file", help="single-file checkpoint to write (e.g. model.ckpt)")
    parser.add_argument(
        "--trust-pickle", action="store_true",
        help="unpickle Lightning's saved state without restrictions (runs code the file names: only for checkpoints you trust)",
    )
    args = parser.parse_args(argv)
    ckpt = consolidate_checkpoint(args.checkpoint_dir, args.output_file, weights_only=not args.trust_pickle)
    n = sum(t.numel() for t in ckpt["state_dict"].values() if isinstance(t, torch.Tensor))
    print(f"wrote {args.output_file}: {len(ckpt['state_dict'])} tensors, {n:,} elements")
    return 0


if __name__ == "__main__":
    sys.exit(main())
