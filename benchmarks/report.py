"""Markdown tables, plots and a progress bar for the benchmark summaries (bench_core.summarize)."""
from __future__ import annotations

import os
import statistics
import sys

MB = 1e6  # decimal, like the paper's GB = 1e9 B


# ---------------------------------------------------------------------------------------
# progress
# ---------------------------------------------------------------------------------------
class Progress:
    """tqdm when installed, else one rewritten stderr line."""

    def __init__(self, total, desc=""):
        self.total, self.n, self.desc = total, 0, desc
        try:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit="step", file=sys.stderr, dynamic_ncols=True)
        except ImportError:
            self._bar = None

    def update(self, n=1):
        self.n += n
        if self._bar is not None:
            self._bar.update(n)
        else:
            sys.stderr.write(f"\r{self.desc} {self.n}/{self.total} steps")
            sys.stderr.flush()

    def write(self, line):
        if self._bar is not None:
            self._bar.write(line, file=sys.stderr)
        else:
            sys.stderr.write("\n" + line + "\n")

    def set_description(self, desc):
        self.desc = desc
        if self._bar is not None:
            self._bar.set_description(desc)

    def close(self):
        if self._bar is not None:
            self._bar.close()
        else:
            sys.stderr.write("\n")


# ---------------------------------------------------------------------------------------
# tables
# ---------------------------------------------------------------------------------------
def _mb(v):
    return "n/a" if v is None else f"{v / MB:.1f}"


def _ratio(a, b, fmt="{:.3f}"):
    return "n/a" if a is None or not b else fmt.format(a / b)


def _int(v):
    return "n/a" if v is None else f"{v:,}"


def title(summary):
    c = summary["config"]
    return (f"{c['model']} ({c['psi'] / 1e6:.1f}M parameters), {c['precision']}, world size {c['world_size']}")


def _spread(row):
    """min / median / max over the passes of each pass's median step time."""
    medians = row.get("medians_per_repeat") or [row["median_s"]]
    return f"{min(medians):.3f} / {statistics.median(medians):.3f} / {max(medians):.3f}"


def markdown_table(summary):
    lines = [
        "| system | ≈ stage | median step (s) | vs DDP | pass medians min / median / max (s) "
        "| model states / rank (MB) | paper (MB) | states / paper "
        "| resident tensors (MB) | peak tensors (MB) | peak RSS growth (MB) | comm / step (elements) | paper "
        "| comm / paper | max abs Δloss vs DDP |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summary["rows"]:
        ratio = "n/a" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        dloss = "n/a" if r["max_dloss"] is None else f"{r['max_dloss']:.1e}"
        lines.append(
            f"| {r['label']} | {r['stage']} | {r['median_s']:.3f} | {ratio} | {_spread(r)} | {_mb(r['model_state_bytes'])} "
            f"| {_mb(r['paper_bytes'])} | {_ratio(r['model_state_bytes'], r['paper_bytes'])} "
            f"| {_mb(r['resident_bytes'])} | {_mb(r['peak_live_bytes'])} | {_mb(r['peak_rss_growth'])} "
            f"| {_int(r['comm_elements'])} | {_int(r['paper_comm'])} | {_ratio(r['comm_elements'], r['paper_comm'])} "
            f"| {dloss} |"
        )
    return "\n".join(lines) + "\n"


def footer(summary):
    c = summary["config"]
    lb, la = summary["loadavg_before"], summary["loadavg_after"]
    text = (f"_{summary['date']}; GPT-2 {c['n_layer']}L/{c['n_embd']}d/{c['n_head']}h, vocab {c['vocab']}, "
            f"seq {c['seq']}, micro-batch {c['micro_batch']}/rank, {c['steps']} steps "
            f"({c['warmup']} warm-up + 1 memory-probe step untimed) x {c.get('repeats', 1)} pass(es), "
            f"{c['threads_per_rank']} thread(s)/rank; "
            f"wall {summary['wall_s']:.0f} s; load average (1/5/15 min) {lb[0]:.2f}/{lb[1]:.2f}/{lb[2]:.2f} before, "
            f"{la[0]:.2f}/{la[1]:.2f}/{la[2]:.2f} after, {summary['cores']} cores_")
    for name, reason in summary.get("skipped", {}).items():
        text += f"\n\n_{name} skipped: {reason}_"
    return text + "\n"


def markdown_run(summary):
    return f"### {title(summary)}\n\n" + markdown_table(summary) + "\n" + footer(summary)


COLUMN_NOTES = """\
Columns (per system, worst rank):

- **≈ stage**: the ZeRO stage whose paper formula the system is compared with (DDP = 0;
  FSDP2 without resharding after forward ≈ 2, with resharding ≈ 3).
- **median step**: median over the timed steps of the slowest rank's forward + backward +
  optimizer step (with `--repeats R`, the system list runs R times, odd passes in reverse
  order, and the fastest pass's median is kept); **vs DDP**: ratio to DDP's in the same
  invocation; **pass medians**: the least, middle and largest of the passes' medians, so
  the spread the machine's drift caused is visible next to the figure kept.
- **model states / rank**: parameters + gradients + master weights + optimizer state after
  the last `step()` (before FSDP2's `zero_grad(set_to_none=True)` frees its gradients):
  zero_strategy's `engine.memory_report()`, DDP's fp32 parameters + `.grad` + Adam state,
  FSDP2's local shards of the DTensor parameters, gradients and Adam state. DeepSpeed has
  no public per-rank accounting: n/a, see *resident tensors*. **paper** =
  `zero_strategy.estimate(Ψ, N, stage, precision, optimizer="adam").total`.
- **resident tensors**: `zero_strategy.accounting.live_tensor_bytes()` (every distinct tensor
  storage the garbage collector can reach) after the last step, minus the same count
  before the system was built. Includes buckets and flat buffers; misses tensors only C++
  holds (DDP's reducer buckets).
- **peak tensors**: the highest number of tensor bytes alive at any moment of the last
  step (live tensor bytes before it + the maximum running sum of the profiler's CPU
  allocation/free events during it), minus the count before the system was built. This
  is the peak-memory figure to compare: model states + activations + gathered parameters
  + communication buffers.
- **peak RSS growth**: VmHWM during the last step (reset just before it by writing 5 to
  `/proc/self/clear_refs`, after `malloc_trim`) minus the RSS before the system was built.
  Includes allocator caching, so it is coarser than *peak tensors*.
- **comm / step**: elements per rank in the last step, counted the paper's way (reduce-
  scatter and all-gather: the full tensor; all-reduce: 2x). zero_strategy: its
  `comm_report().paper_volume`; DDP: a counting comm hook on its buckets; FSDP2 and
  DeepSpeed: wrappers around `torch.distributed`'s collectives while the system runs
  (calls under 1024 elements - flags and norms - and broadcasts are left out). **paper** = 2Ψ
  (stages 0-2) or 3Ψ (stage 3).
- **max abs Δloss**: max over ranks and steps of |loss − DDP's loss| (same data, same
  initial weights, no dropout). In bf16 DDP runs autocast over fp32 weights while the
  others keep bf16 weights, so a difference of ~1e-2 is rounding, not a bug.
"""


# ---------------------------------------------------------------------------------------
# plots
# ---------------------------------------------------------------------------------------
def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


SYSTEM_STYLE = {
    "ddp": ("tab:gray", "o"),
    "zero0": ("tab:blue", "o"), "zero1": ("tab:blue", "o"), "zero2": ("tab:blue", "o"), "zero3": ("tab:blue", "o"),
    "fsdp2_zero2": ("tab:orange", "s"), "fsdp2_zero3": ("tab:orange", "s"),
    "deepspeed1": ("tab:green", "^"), "deepspeed2": ("tab:green", "^"), "deepspeed3": ("tab:green", "^"),
}


def plot_memory_vs_world_size(summaries, path, model, precision):
    """One panel per stage: the paper formula against N, the measured model states (filled)
    and peak tensor bytes (hollow) of every system of that stage."""
    from zero_strategy import estimate

    runs = [s for s in summaries if s["config"]["model"] == model and s["config"]["precision"] == precision]
    if not runs:
        return None
    plt = _pyplot()
    psi = runs[0]["config"]["psi"]
    sizes = sorted({s["config"]["world_size"] for s in runs})
    xs = list(range(1, max(8, max(sizes)) + 1))
    fig, axes = plt.subplots(1, 4, figsize=(17, 4.2), sharey=True)
    for stage, ax in enumerate(axes):
        ax.plot(xs, [estimate(psi, n, stage, precision=precision).total / MB for n in xs], "k--", lw=1.2,
                label="paper formula")
        seen = set()
        for s in runs:
            n = s["config"]["world_size"]
            for r in s["rows"]:
                if r["stage"] != stage:
                    continue
                color, marker = SYSTEM_STYLE.get(r["system"], ("tab:red", "x"))
                offset = {"ddp": -0.12, "fsdp2": 0.0, "deepspeed": 0.12}.get(r["system"].rstrip("0123").split("_")[0], -0.06)
                states = r["model_state_bytes"] if r["model_state_bytes"] is not None else r["resident_bytes"]
                lab = r["label"] if r["system"] not in seen else None
                seen.add(r["system"])
                ax.plot(n + offset, states / MB, marker=marker, color=color, ls="none", ms=8, label=lab)
                ax.plot(n + offset, r["peak_live_bytes"] / MB, marker=marker, color=color, ls="none", ms=8,
                        mfc="none")
        ax.set_title(f"stage {stage}" + (" (DDP, zero0)" if stage == 0 else ""))
        ax.set_xlabel("world size N")
        ax.set_xticks(xs)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("MB per rank (filled: model states, hollow: peak tensors)")
    fig.suptitle(f"Per-rank memory vs world size, GPT-2 {model} ({psi / 1e6:.1f}M), {precision}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_step_ratio(summaries, path):
    """Grouped bars: median step time / DDP per system, one bar per configuration."""
    plt = _pyplot()
    systems = []
    for s in summaries:
        for r in s["rows"]:
            if r["system"] not in systems:
                systems.append(r["system"])
    order = {name: i for i, name in enumerate(
        ["ddp", "zero0", "zero1", "fsdp2_zero2", "deepspeed1", "zero2", "deepspeed2", "zero3", "fsdp2_zero3",
         "deepspeed3"])}
    systems.sort(key=lambda n: order.get(n, 99))
    width = 0.8 / max(1, len(summaries))
    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(systems)), 4.5))
    for i, s in enumerate(summaries):
        c = s["config"]
        by = {r["system"]: r["ratio"] for r in s["rows"]}
        xs = [j + (i - (len(summaries) - 1) / 2) * width for j in range(len(systems))]
        ax.bar(xs, [by.get(n) or 0 for n in systems], width,
               label=f"{c['model']} {c['precision']} N={c['world_size']}")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(1.05, color="tab:green", lw=0.8, ls="--", label="1.05x (stage 1-2 target)")
    ax.axhline(1.25, color="tab:red", lw=0.8, ls="--", label="1.25x (stage 3 target)")
    ax.set_xticks(range(len(systems)))
    ax.set_xticklabels([n.replace("_", "\n") for n in systems], fontsize=8)
    ax.set_ylabel("median step time / DDP")
    ax.set_title("Step time relative to DDP (same invocation; lower is better)")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------
# targets
# ---------------------------------------------------------------------------------------
EQUIVALENTS = {  # zero_strategy system -> the other systems at the same sharding
    "zero1": ("deepspeed1",),
    "zero2": ("fsdp2_zero2", "deepspeed2"),
    "zero3": ("fsdp2_zero3", "deepspeed3"),
}


def check_targets(summary):
    """Lines 'OK/MISSED: ...' for the issue's targets, for one run."""
    rows = {r["system"]: r for r in summary["rows"]}
    out = []
    for name, limit in (("zero1", 1.05), ("zero2", 1.05), ("zero3", 1.25)):
        r = rows.get(name)
        if r is None or r["ratio"] is None:
            continue
        out.append(f"{'OK' if r['ratio'] <= limit else 'MISSED'}: {name} {r['ratio']:.2f}x DDP (target <= {limit}x)")
    for name, others in EQUIVALENTS.items():
        z = rows.get(name)
        if z is None:
            continue
        for o in others:
            r = rows.get(o)
            if r is None:
                continue
            t = z["median_s"] / r["median_s"]
            out.append(f"{'OK' if t <= 1.0 else 'MISSED'}: {name} step {z['median_s']:.3f}s vs {o} "
                       f"{r['median_s']:.3f}s ({t:.2f}x)")
            # Equal within 0.1% (Adam's scalar step counters and the like) counts as "no higher".
            out.append(f"{'OK' if z['peak_live_bytes'] <= 1.001 * r['peak_live_bytes'] else 'MISSED'}: {name} peak tensors "
                       f"{z['peak_live_bytes'] / MB:.1f} MB vs {o} {r['peak_live_bytes'] / MB:.1f} MB")
    return out


def write_outputs(table: str, data, output=None, json_path=None) -> None:
    """Print ``table``; also write it to ``output`` and ``data`` as JSON to ``json_path``."""
    import json
    import sys

    sys.stdout.write(table)
    if output:
        with open(output, "w", encoding="utf-8") as f:
            f.write(table)
    if json_path:
        os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
