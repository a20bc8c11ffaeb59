"""Loss curves: plain stage 3 over several seeds against hpZ + qwZ int8 + qgZ int4.

The run-to-run spread of plain stage 3 (``--seeds``: each seed its own initial weights
and its own order of batches) is the yardstick: the quantized run
(``--quantized-seeds``, same seeds' weights and batches) should stay inside it.
Everything runs in one set of spawned gloo processes, ``nodes x ranks_per_node`` (default
2 x 2, ``ranks_per_node=2``: the cross-node all-to-all of qgZ and the intra-node
secondary partition of hpZ are real), runs one after the other.

Data: real text, not random tokens (on which every run only learns the uniform
distribution): the bytes of the Python standard library's top-level ``*.py`` files
(sorted by name, the first ``--corpus-mb`` MB), one token per byte; the last 5% is held
out.  Each rank draws its own windows of ``--seq`` bytes (the generator seeded by seed and
rank).  The model is bench_core's GPT-2 preset (``25m``: 6 x 512, vocabulary 12288 of
which the 256 byte values are used), AdamW at a constant ``--lr``.  Every
``--eval-every`` steps a validation loss over the same fixed held-out windows (no-grad
forward: stage 3 gathers exact weights there, qwZ only quantizes training gathers).

    .venv/bin/python benchmarks/zero_plus_plus_loss.py --steps 5            # timing probe
    .venv/bin/python benchmarks/zero_plus_plus_loss.py --json docs/benchmarks/zero_plus_plus/loss_curves.json

``zero_plus_plus_page.py`` plots it and writes the table.
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import shlex
import statistics
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import systems as S  # noqa: E402

QUANTIZED = {"secondary_partition": "node", "weight_quantization": "int8", "gradient_quantization": "int4"}


def corpus(limit_bytes: int) -> torch.Tensor:
    """uint8 tensor: the stdlib's top-level .py files, sorted, concatenated up to the limit."""
    out, total = [], 0
    for path in sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py"))):
        with open(path, "rb") as f:
            data = f.read()
        out.append(data)
        total += len(data)
        if total >= limit_bytes:
            break
    blob = b"".join(out)[:limit_bytes]
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8).clone()


def windows(data: torch.Tensor, starts: torch.Tensor, seq: int) -> torch.Tensor:
    idx = starts[:, None] + torch.arange(seq)[None, :]
    return data[idx].long()


def model_ns(args, seed):
    """bench_core's preset (n_positions = the preset's, whatever --seq trains on)."""
    ns = argparse.Namespace(**vars(args))
    ns.seed, ns.seq = seed, args.seq_positions
    return ns


def train_run(args, rank, world_size, config_extra, seed, data, val_x, progress):
    import zero_strategy

    model = S.build_model(model_ns(args, seed))  # torch.manual_seed(seed) inside: each seed its own weights
    optimizer = S.make_optimizer(model.parameters(), args)
    config = {"stage": 3, "precision": args.precision, "ranks_per_node": args.ranks_per_node}
    config.update(config_extra)
    engine = zero_strategy.initialize(model, optimizer, config)
    train_end = int(len(data) * 0.95) - args.seq - 1
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    losses, val, times = [], [], []

    def evaluate():
        model.eval()
        with torch.no_grad():
            out = model(input_ids=val_x, labels=val_x).loss.item()
        model.train()
        return out

    for step in range(args.steps):
        if args.eval_every and step % args.eval_every == 0:
            val.append((step, evaluate()))
        x = windows(data, torch.randint(0, train_end, (args.micro_batch,), generator=g), args.seq)
        t0 = time.perf_counter()
        loss = model(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if progress is not None and (step + 1) % args.progress_every == 0:
            progress(f"step {step + 1}/{args.steps}: loss {statistics.mean(losses[-args.progress_every:]):.3f}, "
                     f"{statistics.median(times[-args.progress_every:]):.2f} s/step")
    if args.eval_every:
        val.append((args.steps, evaluate()))
    engine.close()
    return {"losses": losses, "val": val, "times": times}


def worker_main(rank, world_size, store_path, args, queue):
    from spawn import worker_session  # benchmarks/spawn.py

    env = dict(RANK=str(rank), LOCAL_RANK=str(rank % args.ranks_per_node), WORLD_SIZE=str(world_size))
    with worker_session(rank, world_size, store_path, queue, threads=args.threads, env=env) as send:
        data = corpus(int(args.corpus_mb * 1e6))
        # Validation: fixed windows of the held-out tail, split over the ranks.
        val_start = int(len(data) * 0.95)
        gv = torch.Generator().manual_seed(12345)
        starts = torch.randint(val_start, len(data) - args.seq - 1, (args.val_windows,), generator=gv)
        val_x = windows(data, starts.view(world_size, -1)[rank], args.seq)
        results = []
        runs = ([("plain", {}, s) for s in args.seeds]
                + [("quantized", args.quantized_config, s) for s in args.quantized_seeds])
        for name, extra, seed in runs:
            def progress(line, _n=name, _s=seed):
                queue.put((rank, "progress", f"{_n} seed {_s}: {line}"))

            run = train_run(args, rank, world_size, extra, seed, data, val_x, progress if rank == 0 else None)
            run.update(name=name, seed=seed, config=extra)
            results.append(run)
            dist.barrier()
        send({"runs": results, "threads": torch.get_num_threads(), "corpus_bytes": len(data)})


# ---------------------------------------------------------------------------------------
# summary: mean over ranks per step; spread of the plain seeds; where the quantized run is
# ---------------------------------------------------------------------------------------
def moving_average(values, window):
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def summarize(args, per_rank, threads, corpus_bytes, wall_s, load):
    runs = []
    for k, first in enumerate(per_rank[0]):
        ranks = [r[k] for r in per_rank]
        loss = [statistics.mean(r["losses"][i] for r in ranks) for i in range(args.steps)]
        val = [(first["val"][i][0], statistics.mean(r["val"][i][1] for r in ranks)) for i in range(len(first["val"]))]
        step_times = [max(r["times"][i] for r in ranks) for i in range(args.steps)]
        runs.append({"name": first["name"], "seed": first["seed"], "config": first["config"], "loss": loss,
                     "val": val, "median_step_s": statistics.median(step_times)})
    summary = {
        "command": "benchmarks/zero_plus_plus_loss.py " + shlex.join(args.argv),
        "model": args.model, "precision": args.precision, "psi": None, "steps": args.steps,
        "micro_batch": args.micro_batch, "seq": args.seq, "lr": args.lr, "nodes": args.nodes,
        "ranks_per_node": args.ranks_per_node, "world_size": args.world_size,
        "tokens_per_step": args.micro_batch * args.seq * args.world_size, "corpus_bytes": corpus_bytes,
        "val_windows": args.val_windows, "eval_every": args.eval_every, "smooth": args.smooth,
        "threads_per_rank": threads, "torch": torch.__version__, "cores": os.cpu_count(),
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), "wall_s": wall_s,
        "loadavg_before": load[0], "loadavg_after": load[1], "runs": runs,
    }
    summary["psi"] = S.trainable_numel(S.build_model(model_ns(args, 0)))
    summary["comparison"] = compare(summary)
    return summary


def compare(summary):
    """Whether each quantized run stays inside the plain seeds' band (min..max per step),
    raw and smoothed (moving average of ``smooth`` steps); final = mean of the last
    ``smooth`` steps; validation at every evaluation."""
    w = summary["smooth"]
    plain = [r for r in summary["runs"] if r["name"] == "plain"]
    quant = [r for r in summary["runs"] if r["name"] == "quantized"]
    if len(plain) < 2 or not quant:
        return None
    smooth = {id(r): moving_average(r["loss"], w) for r in summary["runs"]}
    steps = len(plain[0]["loss"])

    def band(values_of, i):
        vs = [values_of(r)[i] for r in plain]
        return min(vs), max(vs)

    def final(r):
        return statistics.mean(r["loss"][-w:])

    finals = [final(r) for r in plain]
    means = [statistics.mean(r["loss"]) for r in plain]
    vals = [r["val"][-1][1] for r in plain] if plain[0]["val"] else []
    out = {"plain_final": finals, "plain_final_spread": max(finals) - min(finals),
           "plain_mean": means, "plain_val_final": vals, "quantized": []}
    for q in quant:
        raw_in = sum(band(lambda r: r["loss"], i)[0] <= q["loss"][i] <= band(lambda r: r["loss"], i)[1]
                     for i in range(steps))
        sm_q = smooth[id(q)]
        sm_in, sm_out_after = 0, []
        for i in range(steps):
            lo, hi = band(lambda r: smooth[id(r)], i)
            if lo <= sm_q[i] <= hi:
                sm_in += 1
            else:
                sm_out_after.append((i, sm_q[i] - (hi if sm_q[i] > hi else lo)))
        # the same seed's plain run: the difference the quantization alone makes
        twin = next((r for r in plain if r["seed"] == q["seed"]), None)
        val_in = None
        if q["val"] and plain[0]["val"]:
            val_in = sum(min(r["val"][i][1] for r in plain) <= q["val"][i][1] <= max(r["val"][i][1] for r in plain)
                         for i in range(len(q["val"])))
        position = "below" if final(q) < min(finals) else "above" if final(q) > max(finals) else "inside"
        out["quantized"].append({
            "seed": q["seed"], "final": final(q), "mean": statistics.mean(q["loss"]), "position": position,
            "val_final": q["val"][-1][1] if q["val"] else None,
            "final_within_plain_range": min(finals) <= final(q) <= max(finals),
            "steps_raw_in_band": raw_in, "steps_smoothed_in_band": sm_in, "steps": steps,
            "smoothed_outside": sm_out_after[:20], "smoothed_outside_count": len(sm_out_after),
            "largest_smoothed_excursion": max((abs(d) for _, d in sm_out_after), default=0.0),
            "val_in_band": val_in, "val_points": len(q["val"]),
            "final_minus_same_seed_plain": final(q) - final(twin) if twin else None,
            "val_final_minus_same_seed_plain": (q["val"][-1][1] - twin["val"][-1][1]) if twin and q["val"] else None,
        })
    out["quantized_final"] = [final(q) for q in quant]
    out["quantized_val_final"] = [q["val"][-1][1] for q in quant] if quant[0]["val"] else []
    return out


SAME_SETTINGS = ("model", "precision", "steps", "micro_batch", "seq", "lr", "nodes", "ranks_per_node", "corpus_bytes",
                 "val_windows", "eval_every", "smooth", "torch")


def appended(path, new):
    """The summary in ``path`` with ``new``'s runs added (a run of the same name and seed
    is replaced); every setting that shapes a curve must be equal."""
    with open(path, encoding="utf-8") as f:
        old = json.load(f)
    differ = {k: (old.get(k), new.get(k)) for k in SAME_SETTINGS if old.get(k) != new.get(k)}
    if differ:
        raise SystemExit(f"--append: {path} was made with other settings: {differ}")
    keys = {(r["name"], r["seed"]) for r in new["runs"]}
    old["runs"] = [r for r in old["runs"] if (r["name"], r["seed"]) not in keys] + new["runs"]
    old["runs"].sort(key=lambda r: (r["name"] != "plain", r["seed"]))
    commands = old.get("commands") or [{"command": old["command"], "wall_s": old["wall_s"],
                                        "loadavg_before": old["loadavg_before"], "loadavg_after": old["loadavg_after"],
                                        "date": old["date"]}]
    commands.append({k: new[k] for k in ("command", "wall_s", "loadavg_before", "loadavg_after", "date")})
    old["commands"] = commands
    old["wall_s"] = sum(c["wall_s"] for c in commands)
    old["comparison"] = compare(old)
    return old


def parse_args(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="25m", choices=sorted(S.PRESETS))
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seeds", default="0,1,2", help="plain stage 3 runs")
    p.add_argument("--quantized-seeds", default="0", help="hpZ + qwZ int8 + qgZ int4 runs")
    p.add_argument("--quantized-config", type=json.loads, default=QUANTIZED,
                   help="the ZeRO++ options of the quantized runs (json; default hpZ + qwZ int8 + qgZ int4), "
                        "e.g. '{\"gradient_quantization\": \"int4\"}' to try one part alone")
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=64, help="bytes per sequence")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--corpus-mb", type=float, default=4.0)
    p.add_argument("--val-windows", type=int, default=32, help="held-out windows (split over the ranks)")
    p.add_argument("--eval-every", type=int, default=25, help="0: no validation")
    p.add_argument("--smooth", type=int, default=20, help="moving-average window (steps) for the band check")
    p.add_argument("--progress-every", type=int, default=25)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--timeout", type=float, default=7200.0)
    p.add_argument("--json", help="write the summary here")
    p.add_argument("--append", action="store_true",
                   help="add these runs to the runs already in --json (same settings required), e.g. more "
                        "quantized seeds: --seeds '' --quantized-seeds 1,2 --append")
    args = p.parse_args(argv)
    args.argv = argv
    args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    args.quantized_seeds = [int(s) for s in args.quantized_seeds.split(",") if s.strip()]
    args.world_size = args.nodes * args.ranks_per_node
    if args.append and not (args.json and os.path.exists(args.json)):
        p.error("--append needs an existing --json file")
    if args.val_windows % args.world_size:
        p.error("--val-windows must be a multiple of the world size")
    for key, value in S.PRESETS[args.model].items():
        if key not in ("micro_batch", "seq"):
            setattr(args, key, value)
    if args.seq > S.PRESETS[args.model]["seq"]:
        p.error(f"--seq must be <= the preset's {S.PRESETS[args.model]['seq']} positions")
    args.seq_positions = S.PRESETS[args.model]["seq"]
    if args.threads is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        args.threads = max(1, cores // args.world_size)
    return args


def main(argv=None):
    from spawn import run_workers

    args = parse_args(argv)
    t0 = time.perf_counter()
    load = os.getloadavg()

    def progress(line):
        sys.stderr.write(f"[{time.perf_counter() - t0:6.0f} s] {line}\n")
        sys.stderr.flush()

    results = run_workers(worker_main, args, "zpp_loss_", progress)
    summary = summarize(args, [r["runs"] for r in results], results[0]["threads"], results[0]["corpus_bytes"],
                        time.perf_counter() - t0, (load, os.getloadavg()))
    if args.append:
        summary = appended(args.json, summary)
    c = summary["comparison"]
    for r in summary["runs"]:
        print(f"{r['name']:9s} seed {r['seed']}: final (mean of last {args.smooth}) "
              f"{statistics.mean(r['loss'][-args.smooth:]):.4f}, mean {statistics.mean(r['loss']):.4f}, "
              f"val {r['val'][-1][1] if r['val'] else float('nan'):.4f}, {r['median_step_s']:.2f} s/step")
    if c:
        for q in c["quantized"]:
            print(f"quantized seed {q['seed']}: final within the plain seeds' range: {q['final_within_plain_range']}; "
                  f"smoothed loss inside the band at {q['steps_smoothed_in_band']}/{q['steps']} steps "
                  f"(largest excursion {q['largest_smoothed_excursion']:.4f}); raw {q['steps_raw_in_band']}/{q['steps']}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=1)
    return summary


if __name__ == "__main__":
    main()
