"""Command line: `zero-strategy <subcommand> ...` (also `python -m zero_strategy.cli`).

To add a subcommand, write `_add_<name>_args(parser)` and `_run_<name>(args) -> int`
and register both in SUBCOMMANDS at the bottom of this file.
"""

from __future__ import annotations

import argparse
import sys
from decimal import Decimal, InvalidOperation
from typing import Callable, Optional, Sequence

from .estimate import (OVERHEAD_DESCRIPTIONS, SAVING_DESCRIPTIONS, STAGE_NAMES, disk_offload_estimate, estimate,
                       largest_fitting, optimizer_bytes_per_param)

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


def _gb(num_bytes: int) -> str:
    return f"{num_bytes / 1e9:,.2f} GB ({num_bytes:,} B)"


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


def _run_estimate(args: argparse.Namespace) -> int:
    sizes = _world_sizes(args.world_size)
    # Unless told otherwise, show the overheads of the default configuration: bucket
    # sizes from ZeroConfig, and units of one reduce bucket each.
    from .config import ZeroConfig

    defaults = ZeroConfig()
    bucket = args.reduce_bucket_size or defaults.reduce_bucket_size
    overhead_args = dict(
        reduce_bucket_size=bucket,
        prefetch_bucket_size=args.prefetch_bucket_size if args.prefetch_bucket_size is not None else defaults.prefetch_bucket_size,
        num_units=args.num_units or max(1, -(-args.params // bucket)),
        persistent_params=args.persistent_params or 0,
        largest_unit=args.largest_unit or 0,
    )
    k = optimizer_bytes_per_param(args.optimizer, args.precision)
    budget = args.memory_per_rank
    header = ("stage", "name", "params", "grads", "optimizer states",
              "total (formula)", "total with overheads", "ours: backward-step", "ours: between steps")
    for n in sizes:
        results = [estimate(args.params, n, s, args.precision, args.optimizer, **overhead_args)
                   for s in range(4)]
        print(f"Model states per rank: {args.params:,} parameters, N = {n}, "
              f"precision {args.precision}, optimizer {args.optimizer} (K = {k} bytes/param)")
        rows = [header + ((f"fits in {_gb(budget)}",) if budget is not None else ())] + [
            (str(s), STAGE_NAMES[s], _gb(r.parameters), _gb(r.gradients),
             _gb(r.optimizer_states), _gb(r.total), _gb(r.total_with_overheads),
             _gb(r.held_during_step), _gb(r.held_between_steps))
            + ((_fits(r.held_during_step, budget),) if budget is not None else ())
            for s, r in enumerate(results)
        ]
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        for row in rows:
            print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        _print_overheads(results)
        _print_savings(results)
        _print_disk_offload(args, n)
        if budget is not None:
            _print_largest(args, n, overhead_args, bucket)
        print()
    return 0


def _fits(needed: int, budget: int) -> str:
    return "yes" if needed <= budget else f"NO: {(needed - budget) / 1e9:,.2f} GB over"


def _disk_rows(args: argparse.Namespace):
    """(stage, what is offloaded, offload_param) of the disk-offload table."""
    return ((1, "optimizer", False), (2, "optimizer", False), (3, "optimizer", False), (3, "optimizer + params", True))


def _print_largest(args: argparse.Namespace, n: int, overhead_args: dict, bucket: int) -> None:
    """The largest parameter count each configuration fits in --memory-per-rank (and
    --disk-per-rank for disk offload), by the same estimates as the tables above."""
    from .config import ZeroConfig

    budget, disk = args.memory_per_rank, args.disk_per_rank
    inflight = ZeroConfig().nvme_inflight_bytes
    print(f"Largest model whose model states fit in {_gb(budget)} per rank (N = {n}; 'ours: backward-step'"
          + (f"; disk offload also within {_gb(disk)} of disk per rank" if disk is not None else "") + "):")

    def held(stage):
        def needed(psi):
            kw = dict(overhead_args)
            if not args.num_units:  # the default: one unit per reduce bucket, so it grows with the model
                kw["num_units"] = max(1, -(-psi // bucket))
            kw["persistent_params"] = min(kw["persistent_params"], psi)
            return estimate(psi, n, stage, args.precision, args.optimizer, **kw).held_during_step
        return needed

    rows = [("configuration", "largest model (parameters)")]
    for stage in range(4):
        rows.append((f"stage {stage}", f"{largest_fitting(held(stage), budget):,}"))
    for stage, what, offload_param in _disk_rows(args):
        def ram(psi, stage=stage, offload_param=offload_param):
            return disk_offload_estimate(psi, n, stage, args.precision, args.optimizer, offload_param=offload_param,
                                         inflight_bytes=inflight).ram
        psi = largest_fitting(ram, budget)
        limit = "memory"
        if disk is not None:
            def on_disk(p, stage=stage, offload_param=offload_param):
                return disk_offload_estimate(p, n, stage, args.precision, args.optimizer,
                                             offload_param=offload_param, inflight_bytes=inflight).disk
            by_disk = largest_fitting(on_disk, disk)
            if by_disk < psi:
                psi, limit = by_disk, "disk"
        rows.append((f"stage {stage} + disk offload ({what})", f"{psi:,} (limited by {limit})"))
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    for row in rows:
        print("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())


def _print_disk_offload(args: argparse.Namespace, n: int) -> None:
    from .config import ZeroConfig

    inflight = ZeroConfig().nvme_inflight_bytes
    print(f"With disk offload (offload_optimizer: nvme; nvme_inflight_bytes {inflight:,}), per rank:")
    budget, disk = args.memory_per_rank, args.disk_per_rank
    rows = [("stage", "offload", "RAM (backward-step)", "disk")
            + ((f"fits in {_gb(budget)}",) if budget is not None else ())
            + ((f"fits in {_gb(disk)} of disk",) if disk is not None else ())]
    for stage, on_disk, offload_param in _disk_rows(args):
        r = disk_offload_estimate(args.params, n, stage, args.precision, args.optimizer,
                                  offload_param=offload_param, inflight_bytes=inflight)
        rows.append((str(stage), on_disk, _gb(r.ram), _gb(r.disk))
                    + ((_fits(r.ram, budget),) if budget is not None else ())
                    + ((_fits(r.disk, disk),) if disk is not None else ()))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())


def _print_savings(results: list) -> None:
    terms = [t for t in SAVING_DESCRIPTIONS if any(t in r.savings for r in results)]
    if terms:
        print("Below the formula:")
    for term in terms:
        print(f"  {term}: {SAVING_DESCRIPTIONS[term]}")
    print("  stages 2-3 free their gradient shards in step(): 'between steps' leaves them out")


def _print_overheads(results: list) -> None:
    terms = [t for t in OVERHEAD_DESCRIPTIONS if any(t in r.overheads for r in results)]
    if not terms:
        print("Overheads: none requested (pass --reduce-bucket-size, --num-units, "
              "--largest-unit, --prefetch-bucket-size or --persistent-params).")
        return
    print("Overheads this implementation adds beyond the paper's formula:")
    for term in terms:
        print(f"  {term}: {OVERHEAD_DESCRIPTIONS[term]}")
        for stage, r in enumerate(results):
            if term in r.overheads:
                print(f"    stage {stage}: {_gb(r.overheads[term])}")


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


# -- dispatch ------------------------------------------------------------------------

# name -> (help text, add-arguments function, run function returning an exit code)
SUBCOMMANDS: dict[str, tuple[str, Callable, Callable]] = {
    "estimate": ("model-state memory per rank for ZeRO stages 0-3",
                 _add_estimate_args, _run_estimate),
    "consolidate": ("write ordinary safetensors weights from a sharded checkpoint directory",
                    lambda p: _add_consolidate_args(p), lambda a: _run_consolidate(a)),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zero-strategy", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, add_args, run) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        add_args(sub_parser)
        sub_parser.set_defaults(_run=run)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args._run(args)
    except (ValueError, argparse.ArgumentTypeError) as exc:
        # Bad values (e.g. an unknown optimizer) are usage errors, not crashes.
        parser.error(str(exc))


if __name__ == "__main__":
    sys.exit(main())
