"""Run the benchmark matrix and write the docs page with its tables and plots.

    .venv/bin/python benchmarks/run_all.py                       # 25m fp32+bf16 at N=2, 100m fp32 at N=2
    .venv/bin/python benchmarks/run_all.py --world-sizes 2,4 --models 25m
    .venv/bin/python benchmarks/run_all.py --quick --output-dir /tmp/bench --page /tmp/bench/README.md
    .venv/bin/python benchmarks/run_all.py --render-only          # rebuild the page from saved results

Each configuration (model, precision, world size) is one bench_core invocation: all
systems run one after the other in the same worker processes, so "vs DDP" compares like
with like.  Its summary is saved as <output-dir>/results/<model>_<precision>_ws<N>.json;
the page is rendered from every saved result, so configurations can be (re)run one at a
time.  The simulation (simulate_scale.py) runs in this process on torch's fake process group.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
REPO = os.path.dirname(HERE)

import bench_core  # noqa: E402
import report  # noqa: E402
import simulate_scale  # noqa: E402
import systems as S  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=None, help="comma-separated presets (default: 25m,100m; --quick: quick)")
    p.add_argument("--precisions", default="fp32,bf16")
    p.add_argument("--world-sizes", default="2")
    p.add_argument("--big-model-runs", default="100m:fp32:2",
                   help="for models other than 25m/quick run only these model:precision:world-size "
                        "triples (a 100m matrix takes long on a 2-core machine); 'all' = full matrix")
    p.add_argument("--systems", default=",".join(S.ALL_SYSTEMS))
    p.add_argument("--output-dir", default=None,
                   help="results/*.json and the PNG plots go here (default docs/benchmarks; with --quick a "
                        "temporary directory, so a smoke run never overwrites the docs)")
    p.add_argument("--page", default=None, help="markdown page to write (default: <output-dir>/../benchmarks.md)")
    p.add_argument("--simulate-models", default="7b,70b,1t")
    p.add_argument("--simulate-world-sizes", default="8,64,256,1024,4096")
    p.add_argument("--no-simulate", action="store_true")
    p.add_argument("--render-only", action="store_true", help="no runs: rebuild page and plots from saved results")
    p.add_argument("--skip-existing", action="store_true", help="do not rerun configurations with a saved result")
    bench_core.add_model_args(p)
    args = p.parse_args(argv)
    args.systems = bench_core.parse_systems(p, args.systems)
    if args.models is None:
        args.models = "quick" if args.quick else "25m,100m"
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in args.models if m not in S.PRESETS]
    if bad:
        p.error(f"--models: unknown {bad}; choose from {','.join(S.PRESETS)}")
    args.precisions = [x.strip() for x in args.precisions.split(",") if x.strip()]
    args.world_sizes = [int(x) for x in args.world_sizes.split(",")]
    if args.output_dir is None:
        if args.quick:
            import tempfile

            args.output_dir = tempfile.mkdtemp(prefix="zero_bench_quick_")
        else:
            args.output_dir = os.path.join(REPO, "docs", "benchmarks")
    if args.page is None:
        args.page = os.path.join(os.path.dirname(os.path.abspath(args.output_dir)), "benchmarks.md")
    return p, args


def configurations(args):
    big = None if args.big_model_runs == "all" else {
        tuple(t.split(":")) for t in args.big_model_runs.split(",") if t}
    out = []
    for model in args.models:
        for precision in args.precisions:
            for n in args.world_sizes:
                if model not in ("25m", "quick") and big is not None and (model, precision, str(n)) not in big:
                    continue
                out.append((model, precision, n))
    return out


def bench_args(p, args, model, precision, n):
    """A bench_core argument namespace for one configuration."""
    ns = argparse.Namespace(**vars(args))
    ns.model, ns.precision, ns.world_size = model, precision, n
    ns.quick = model == "quick"
    bench_core.finish_model_args(p, ns)
    return ns


def result_path(args, model, precision, n):
    return os.path.join(args.output_dir, "results", f"{model}_{precision}_ws{n}.json")


def load_results(args):
    out = []
    for path in sorted(glob.glob(os.path.join(args.output_dir, "results", "*.json"))):
        with open(path, encoding="utf-8") as f:
            out.append(json.load(f))
    key_model = {name: i for i, name in enumerate(S.PRESETS)}
    out.sort(key=lambda s: (key_model.get(s["config"]["model"], 9), s["config"]["precision"] != "fp32",
                            s["config"]["world_size"]))
    return out


def render(args, summaries, sim_rows):
    os.makedirs(args.output_dir, exist_ok=True)
    page_dir = os.path.dirname(os.path.abspath(args.page))
    rel = os.path.relpath(os.path.abspath(args.output_dir), page_dir)
    plots = []
    for model in S.PRESETS:
        for precision in ("fp32", "bf16"):
            path = os.path.join(args.output_dir, f"memory_{model}_{precision}.png")
            if report.plot_memory_vs_world_size(summaries, path, model, precision):
                plots.append((f"Per-rank memory, {model} {precision}", os.path.basename(path)))
    if summaries:
        report.plot_step_ratio(summaries, os.path.join(args.output_dir, "step_time_vs_ddp.png"))
        plots.insert(0, ("Step time relative to DDP", "step_time_vs_ddp.png"))

    lines = [
        "# Benchmarks: zero_strategy against DDP, FSDP2 and DeepSpeed",
        "",
        "Generated by `benchmarks/run_all.py` (see [benchmarks/README.md](../benchmarks/README.md) for the "
        "harness). Every table is one invocation: all systems trained the same GPT-2-style model from the "
        "same initial weights on the same synthetic batches, one after the other in the same gloo worker "
        "processes on CPU. The machine is a shared 2-core VM, so step times are only as good as the "
        "load average printed under each table; memory and communication figures are exact.",
        "",
        "Reproduce:",
        "",
        "```",
        ".venv/bin/python benchmarks/run_all.py --models 25m,100m --precisions fp32,bf16 --world-sizes 2",
        ".venv/bin/python benchmarks/run_all.py --models 25m --world-sizes 4 --no-simulate",
        "```",
        "",
    ]
    skipped = {k: v for s in summaries for k, v in s.get("skipped", {}).items()}
    if skipped:
        lines += ["**Skipped:** " + "; ".join(f"{k}: {v}" for k, v in sorted(skipped.items())), ""]
    notes = os.path.join(args.output_dir, "NOTES.md")
    if os.path.exists(notes):
        # Hand-written findings (targets, causes, caveats): kept across re-renders.
        with open(notes, encoding="utf-8") as f:
            lines += ["## Findings", "", f.read().strip(), ""]
    lines += ["## Plots", ""]
    for caption, name in plots:
        lines += [f"![{caption}]({rel}/{name})", ""]
    lines += ["## Measured", "", report.COLUMN_NOTES, ""]
    for s in summaries:
        lines += [report.markdown_run(s).rstrip(), ""]
        checks = report.check_targets(s)
        if checks:
            lines += ["Targets (zero_strategy vs DDP and vs the same sharding in the other systems):", ""]
            lines += [f"- {c}" for c in checks] + [""]
    if sim_rows:
        lines += [
            "## Beyond this machine: per-rank model states from the real partition plan",
            "",
            simulate_scale.DESCRIPTION,
            "",
            "Regenerate (prints the table; `run_all.py` renders it here):",
            "",
            "```",
            simulate_scale.REGENERATE,
            "```",
            "",
            simulate_scale.markdown(sim_rows).rstrip(),
            "",
        ]
    zpp = os.path.join(args.output_dir, "zero_plus_plus", "summary.md")
    if os.path.exists(zpp):
        # Written by benchmarks/zero_plus_plus_page.py with its own page: kept across re-renders.
        with open(zpp, encoding="utf-8") as f:
            lines += [f.read().replace("{rel}", rel).strip(), ""]
    with open(args.page, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
    return args.page


def main(argv=None):
    p, args = parse_args(argv)
    os.makedirs(os.path.join(args.output_dir, "results"), exist_ok=True)
    sim_path = os.path.join(args.output_dir, "results", "simulate_scale.rows")
    if not args.render_only:
        todo = configurations(args)
        if args.skip_existing:
            todo = [c for c in todo if not os.path.exists(result_path(args, *c))]
        namespaces = [bench_args(p, args, *c) for c in todo]
        total = sum(len(ns.systems) * ns.steps * ns.repeats for ns in namespaces)
        bar = report.Progress(total, "benchmarks")
        try:
            for (model, precision, n), ns in zip(todo, namespaces):
                bar.set_description(f"{model} {precision} N={n}")
                summary = bench_core.run(ns, progress=bar.update)
                with open(result_path(args, model, precision, n), "w", encoding="utf-8") as f:
                    json.dump(summary, f, indent=1)
                for line in report.check_targets(summary):
                    bar.write(f"{model} {precision} N={n}: {line}")
        finally:
            bar.close()
        if not args.no_simulate:
            sim_args = simulate_scale.parse_args(["--models", args.simulate_models,
                                                  "--world-sizes", args.simulate_world_sizes])
            t0 = time.perf_counter()
            rows = simulate_scale.run(sim_args)
            sys.stderr.write(f"simulation: {len(rows)} engines in {time.perf_counter() - t0:.0f} s\n")
            with open(sim_path, "w", encoding="utf-8") as f:
                json.dump(rows, f, indent=1)
    sim_rows = None
    if os.path.exists(sim_path):
        with open(sim_path, encoding="utf-8") as f:
            sim_rows = json.load(f)
    page = render(args, load_results(args), sim_rows)
    sys.stderr.write(f"wrote {page}\n")
    return page


if __name__ == "__main__":
    main()
