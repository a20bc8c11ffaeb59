"""Turn a ZeroStrategy checkpoint directory into an ordinary single-file Lightning checkpoint.

    python -m zero_strategy.integrations.lightning.consolidate CKPT_DIR OUT.ckpt

The output holds the consolidated weights under ``state_dict`` (original names, dtypes
and the module's key order), the optimizer state under ``optimizer_states`` (one entry
per optimizer, in ``configure_optimizers``' order) in torch's format (whole tensors, indexed in the user's parameter order: what ddp's optimizer
saves), plus everything else Lightning saved (hyper-parameters, loops, callbacks, LR
schedulers).  So ``MyModule.load_from_checkpoint("OUT.ckpt")``, ``trainer.test(model,
ckpt_path="OUT.ckpt")`` and resuming ``trainer.fit(model, ckpt_path="OUT.ckpt")`` work with
any strategy (ddp included).  A directory written by ``fabric.save`` gives the file ddp's
``fabric.save`` writes: the weights and the optimizer state under the keys they were saved
with ("model", "optimizer"), beside the other state.  Every
tensor is saved compact (a view into a shard would drag the shard's whole storage in).
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

    from ._common import OPTIMIZER_NAMES, STATE_DICT_KEYS
    from ._fabric_files import OBJECTS_KEY

    directory = Path(checkpoint_dir)
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory} is not a ZeroStrategy checkpoint directory")
    checkpoint = {}
    client = directory / CLIENT_STATE
    if client.exists():
        checkpoint.update(load_client_state(client, weights_only=weights_only))
    order = checkpoint.pop(STATE_DICT_KEYS, None)
    names = checkpoint.pop(OPTIMIZER_NAMES, None)
    checkpoint["state_dict"] = _compact(_in_order(load_consolidated_state_dict(directory), order))
    checkpoint.pop("optimizer_states", None)
    optimizer_states = _optimizer_states(directory, names)
    objects = checkpoint.pop(OBJECTS_KEY, None)
    if isinstance(objects, dict) and objects.get("module"):
        # fabric.save: the layout ddp's fabric.save writes, each object under its own key
        # (the keys are recorded in the engine's optimizer order)
        checkpoint[objects["module"]] = checkpoint.pop("state_dict")
        for key, state in zip(objects.get("optimizers") or [], optimizer_states or []):
            if key is not None and state is not None:
                checkpoint[key] = state
    elif optimizer_states:
        checkpoint["optimizer_states"] = optimizer_states
    if output_file is not None:
        out = Path(output_file)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        torch.save(checkpoint, tmp)
        tmp.replace(out)
    return checkpoint


def _in_order(state_dict: dict, order) -> dict:
    """The module's state-dict order when the checkpoint recorded it (names it does not
    list keep the manifest's order, after the listed ones)."""
    if not order:
        return state_dict
    out = {k: state_dict[k] for k in order if k in state_dict}
    out.update((k, v) for k, v in state_dict.items() if k not in out)
    return out


def _compact(state_dict: dict) -> dict:
    """Each tensor in its own storage of its own size; tied names stay one tensor."""
    seen, out = {}, {}
    for k, v in state_dict.items():
        if isinstance(v, torch.Tensor):
            if id(v) not in seen:
                seen[id(v)] = v.detach().clone(memory_format=torch.contiguous_format)
            v = seen[id(v)]
        out[k] = v
    return out


def _optimizer_states(directory: Path, names) -> Optional[list]:
    """Each optimizer's state in torch's format (the core's
    :func:`zero_strategy.checkpoint.load_consolidated_optimizer_states`), in the order
    Lightning holds the optimizers, with the param-group hyperparameters as the strategy
    recorded them at save time (Python types, e.g. Adam's betas as a tuple, which the
    manifest's JSON cannot keep).  None without optimizer state."""
    from zero_strategy.checkpoint import load_consolidated_optimizer_states

    from ._common import recorded_orders

    states = load_consolidated_optimizer_states(directory)
    if not states or any(state is None for state in states):
        return None
    orders = recorded_orders(names)
    for state, order in zip(states, orders):
        recorded = order.get("param_groups")
        if recorded:
            state["param_groups"] = [{**group, **hyper, "params": group["params"]}
                                     for group, hyper in zip(state["param_groups"], recorded)]
    return states


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
    weights = ckpt.get("state_dict")
    if weights is None:  # a fabric.save directory: the model under its own key
        weights = next((v for v in ckpt.values() if isinstance(v, dict) and v and
                        all(isinstance(t, torch.Tensor) for t in v.values())), {})
    n = sum(t.numel() for t in weights.values())
    optimizer = " and the optimizer state" if ckpt.get("optimizer_states") or any(
        isinstance(v, dict) and "param_groups" in v for v in ckpt.values()) else ""
    print(f"wrote {args.output_file}: {len(weights)} tensors, {n:,} elements{optimizer}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
