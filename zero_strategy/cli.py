"""Command line: `zero-strategy <subcommand> ...` (also `python -m zero_strategy.cli`).

To add a subcommand, write `_add_<name>_args(parser)` and `_run_<name>(args) -> int`
and register both in SUBCOMMANDS at the bottom of this file.
"""

from __future__ import annotations

import argparse
import os
import sys
from decimal import Decimal, InvalidOperation
from typing import Callable, Optional, Sequence


_SUFFIXES = {"k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def parse_count(text: str) -> int:
    """'7.5e9', '7.5B', '350M', '1T', '25_000_000' -> an exact int (Decimal avoids 7.5e9
    turning into 7499999999 through float rounding)."""
    raw = text.strip().replace("_", "").replace(",", "")
    scale = 1
    if raw and raw[-1].lower() in _SUFFIXES:
        scale = _SUFFIXES[raw[-1].lower()]
        raw = raw[:-1]
    try:
        value = Decimal(raw) * scale
    except InvalidOperation:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a count; use e.g. 7.5e9, 7.5B, 350M, 1T") from None
    if not value.is_finite() or value != value.to_integral_value() or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole, non-negative count")
    return int(value)


_BINARY_SUFFIXES = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """A byte count: what parse_count takes (12e9, 12G = 12 * 10**9), or binary units
    (24GiB, 11.5GiB, 512MiB)."""
    raw = text.strip().replace("_", "").replace(",", "")
    for suffix, scale in _BINARY_SUFFIXES.items():
        if raw.lower().endswith(suffix):
            try:
                value = Decimal(raw[: -len(suffix)]) * scale
            except InvalidOperation:
                break
            if value.is_finite() and value >= 0:
                return int(value)  # a fraction of a byte rounds down
            break
    else:
        return parse_count(text)
    raise argparse.ArgumentTypeError(f"{text!r} is not a byte count; use e.g. 12GiB, 512MiB, 12e9")


def _world_sizes(values: Optional[list]) -> list:
    """--world-size may repeat and take comma lists: 64, or 1,4,16."""
    if not values:
        return [1, 4, 16, 64, 256, 1024]  # the world sizes of the paper's Table 1
    sizes = []
    for value in values:
        for part in value.split(","):
            if part.strip():
                size = parse_count(part)
                if size < 1:
                    raise argparse.ArgumentTypeError(f"world size must be >= 1, got {part!r}")
                sizes.append(size)
    return sizes


# -- estimate ------------------------------------------------------------------------


def _add_estimate_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--params", type=parse_count, required=True,
                        help="number of parameters: 7.5e9, 7.5B, 350M, 1T")
    parser.add_argument("--world-size", action="append", metavar="N[,N...]",
                        help="data-parallel ranks; repeat or comma-separate "
                             "(default: 1,4,16,64,256,1024 as in the paper)")
    parser.add_argument("--precision", default="fp16", help="fp16 (default), bf16 or fp32")
    parser.add_argument("--optimizer", default="adam",
                        help="adam (default), adamw, sgd, sgd_nomomentum")
    for flag, what in [
        ("--reduce-bucket-size", "elements per gradient bucket (stages 0-2)"),
        ("--prefetch-bucket-size", "elements of prefetched parameters (stage 3)"),
        ("--num-units", "number of flat units, each padded to a multiple of N"),
        ("--persistent-params", "elements of small params kept whole (stage 3)"),
        ("--largest-unit", "elements of the largest gathered unit (stage 3)"),
    ]:
        parser.add_argument(flag, type=parse_count, default=None,
                            help=what + "; adds an overhead term")
    parser.add_argument("--memory-per-rank", type=parse_bytes, default=None, metavar="BYTES",
                        help="memory one rank may use for model states (e.g. 11GiB: a host's RAM, less what the "
                             "runtime and activations need, divided by the ranks on it); says which configurations "
                             "fit and the largest model that does")
    parser.add_argument("--disk-per-rank", type=parse_bytes, default=None, metavar="BYTES",
                        help="disk one rank may fill under nvme_path; with --memory-per-rank, also limits the "
                             "disk-offload rows")
    parser.add_argument("--ranks-per-node", type=parse_count, default=8, metavar="L",
                        help="ranks (GPUs) per node, for the cross-node traffic table (default 8)")


def _run_estimate(args: argparse.Namespace) -> int:
    # Unless told otherwise, show the overheads of the default configuration: bucket
    # sizes from ZeroConfig, and units of one reduce bucket each.
    from .config import ZeroConfig
    from .estimate_report import EstimateRequest, print_report

    defaults = ZeroConfig()
    bucket = args.reduce_bucket_size or defaults.reduce_bucket_size
    overhead_args = dict(
        reduce_bucket_size=bucket,
        prefetch_bucket_size=args.prefetch_bucket_size if args.prefetch_bucket_size is not None else defaults.prefetch_bucket_size,
        num_units=args.num_units or max(1, -(-args.params // bucket)),
        persistent_params=args.persistent_params or 0,
        largest_unit=args.largest_unit or 0,
    )
    print_report(EstimateRequest(
        params=args.params, world_sizes=_world_sizes(args.world_size), precision=args.precision,
        optimizer=args.optimizer, overhead_args=overhead_args, grow_units_with_model=not args.num_units,
        inflight_bytes=defaults.nvme_inflight_bytes, memory_per_rank=args.memory_per_rank,
        disk_per_rank=args.disk_per_rank, ranks_per_node=max(1, args.ranks_per_node)))
    return 0


# -- consolidate ---------------------------------------------------------------------


def _add_consolidate_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint_dir", help="a directory written by engine.save_checkpoint")
    parser.add_argument("output_dir", help="where model.safetensors (or shards + index) and config.json go")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None,
                        help="cast every floating tensor (default: each tensor's original dtype)")
    parser.add_argument("--max-shard-size", type=parse_count, default=2 * 1024**3,
                        help="bytes per output file before splitting (default 2 GiB)")


def _run_consolidate(args: argparse.Namespace) -> int:
    from .checkpoint import CheckpointError, consolidate

    try:
        files = consolidate(args.checkpoint_dir, args.output_dir, dtype=args.dtype, max_shard_bytes=args.max_shard_size)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for f in files:
        print(f)
    return 0


# -- help ----------------------------------------------------------------------------

_CHECKPOINT_COMMANDS = """\
consolidating checkpoints:
  zero-strategy consolidate CKPT_DIR OUT_DIR
      a directory written by engine.save_checkpoint -> safetensors weights
  python -m zero_strategy.integrations.lightning.consolidate CKPT_DIR OUT.ckpt
      Lightning: a ZeroStrategy checkpoint directory -> one ordinary .ckpt file
      (loads with any strategy; see docs/lightning.md)
"""

_ESTIMATE_EXAMPLES = """\
examples:
  zero-strategy estimate --params 7.5e9 --world-size 1,4,16,64,256,1024
      the paper's Table 1: Psi = 7.5B, fp16, Adam (K = 12)
  zero-strategy estimate --params 7B --world-size 8 --precision bf16 --optimizer adamw
      one 8-GPU machine, with the cpu and nvme offload rows
  zero-strategy estimate --params 2B --world-size 2 --precision bf16 \\
      --memory-per-rank 11GiB --disk-per-rank 40GiB
      which configurations fit, and the largest model each one fits

Sizes are GiB (2^30 bytes); the paper's GB are 10^9 bytes (1 GiB = 1.0737 GB).
"""

_CONSOLIDATE_EXAMPLES = """\
examples:
  zero-strategy consolidate ckpt/step-1000 out/
  zero-strategy consolidate ckpt/step-1000 out/ --dtype bf16 --max-shard-size 5e9
"""

# -- dispatch ------------------------------------------------------------------------

# name -> (help text, add-arguments function, run function returning an exit code, epilog)
SUBCOMMANDS: dict[str, tuple[str, Callable, Callable, str]] = {
    "estimate": ("model-state memory per rank for ZeRO stages 0-3, with and without offload",
                 _add_estimate_args, _run_estimate, _ESTIMATE_EXAMPLES + "\n" + _CHECKPOINT_COMMANDS),
    "consolidate": ("write ordinary safetensors weights from a sharded checkpoint directory",
                    lambda p: _add_consolidate_args(p), lambda a: _run_consolidate(a),
                    _CONSOLIDATE_EXAMPLES + "\n" + _CHECKPOINT_COMMANDS),
}


def build_parser() -> argparse.ArgumentParser:
    # RawDescriptionHelpFormatter keeps the examples' line breaks.
    parser = argparse.ArgumentParser(prog="zero-strategy", description=__doc__.splitlines()[0],
                                     epilog=_ESTIMATE_EXAMPLES + "\n" + _CHECKPOINT_COMMANDS,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, add_args, run, epilog) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text, epilog=epilog,
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
        add_args(sub_parser)
        sub_parser.set_defaults(_run=run)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = args._run(args)
        sys.stdout.flush()  # so that a closed pipe shows here, not in the interpreter's last flush
        return code
    except (ValueError, argparse.ArgumentTypeError) as exc:
        # Bad values (e.g. an unknown optimizer) are usage errors, not crashes.
        parser.error(str(exc))
    except BrokenPipeError:
        # `zero-strategy estimate ... | head`: the reader has what it wanted. Point stdout
        # at /dev/null so that the interpreter's last flush does not fail once more, and
        # exit as a process ended by SIGPIPE does in a shell (128 + 13).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
