"""Write docs/benchmarks/zero_plus_plus.md ("ZeRO++ across nodes") from saved results.

Inputs (written by the commands quoted on the page):

* ``docs/benchmarks/zero_plus_plus/cross_node.json``   bench_cross_node.py (measured)
* ``docs/benchmarks/zero_plus_plus/loss_curves.json``  zero_plus_plus_loss.py (measured)

The simulation (simulate_zero_plus_plus.py, arithmetic: a second) is rerun here from
cross_node.json with its default assumptions.  Outputs: the page, ``loss_curves.png``,
``simulated_step_time.png``, ``simulate.json`` and ``summary.md``, the fragment
``run_all.py`` puts into docs/benchmarks.md (so the section survives re-rendering it).

    .venv/bin/python benchmarks/zero_plus_plus_page.py
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
REPO = os.path.dirname(HERE)

import bench_cross_node as X  # noqa: E402
import simulate_zero_plus_plus as Z  # noqa: E402

DATA = os.path.join(REPO, "docs", "benchmarks", "zero_plus_plus")
PAGE = os.path.join(REPO, "docs", "benchmarks", "zero_plus_plus.md")


def _load(path):
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


# ---------------------------------------------------------------------------------------
# loss curves
# ---------------------------------------------------------------------------------------
def plot_losses(summary, path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    import zero_plus_plus_loss as L

    w = summary["smooth"]
    plain = [r for r in summary["runs"] if r["name"] == "plain"]
    quant = [r for r in summary["runs"] if r["name"] == "quantized"]
    steps = list(range(1, summary["steps"] + 1))
    fig, (ax, axv) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [2, 1]})
    sm = {id(r): L.moving_average(r["loss"], w) for r in summary["runs"]}
    lo = [min(sm[id(r)][i] for r in plain) for i in range(len(steps))]
    hi = [max(sm[id(r)][i] for r in plain) for i in range(len(steps))]
    ax.fill_between(steps, lo, hi, color="tab:blue", alpha=0.25, label=f"plain stage 3, {len(plain)} seeds: range")
    blues = ["#1f4e9c", "#3a7dd8", "#7fb2f0", "#0b2a5c"]
    for k, r in enumerate(plain):
        ax.plot(steps, r["loss"], color=blues[k % 4], lw=0.4, alpha=0.3)
        ax.plot(steps, sm[id(r)], color=blues[k % 4], lw=1.0, label=f"plain seed {r['seed']}")
    greens = ["#1b7a2e", "#3fb950", "#8fd99b", "#0c4a1a"]
    if len(quant) >= 2:
        qlo = [min(sm[id(r)][i] for r in quant) for i in range(len(steps))]
        qhi = [max(sm[id(r)][i] for r in quant) for i in range(len(steps))]
        ax.fill_between(steps, qlo, qhi, color="tab:green", alpha=0.15,
                        label=f"hpZ + qwZ int8 + qgZ int4, {len(quant)} seeds: range")
    for k, r in enumerate(quant):
        ax.plot(steps, r["loss"], color=greens[k % 4], lw=0.4, alpha=0.3)
        ax.plot(steps, sm[id(r)], color=greens[k % 4], lw=1.4, label=f"hpZ + qwZ int8 + qgZ int4, seed {r['seed']}")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    floor = min(min(r["loss"]) for r in summary["runs"])
    ax.set_ylim(floor - 0.1, min(4.0, max(max(r["loss"]) for r in summary["runs"])))
    ax.text(0.99, 0.02, f"thin: per step; thick: {w}-step moving average", transform=ax.transAxes, ha="right",
            fontsize=7, color="gray")
    handles, labels = ax.get_legend_handles_labels()
    seen = {}
    for h, lab in zip(handles, labels):
        seen.setdefault(lab, h)
    ax.legend(seen.values(), seen.keys(), fontsize=7)
    ax.set_title(f"GPT-2 {summary['model']} ({summary['psi'] / 1e6:.1f}M), {summary['precision']}, "
                 f"{summary['nodes']} nodes x {summary['ranks_per_node']} ranks, "
                 f"{summary['tokens_per_step']} tokens/step", fontsize=9)
    for k, r in enumerate(plain):
        axv.plot([s for s, _ in r["val"]], [v for _, v in r["val"]], "-o", ms=2, color=blues[k % 4], lw=0.8,
                 label=f"plain seed {r['seed']}")
    for k, r in enumerate(quant):
        axv.plot([s for s, _ in r["val"]], [v for _, v in r["val"]], "-s", ms=3, color=greens[k % 4], lw=1.2,
                 label=f"quantized seed {r['seed']}")
    axv.legend(fontsize=7)
    axv.set_xlabel("step")
    axv.set_ylabel("held-out loss")
    tail = [v for r in summary["runs"] for s, v in r["val"] if s >= summary["steps"] // 3]
    if tail:
        axv.set_ylim(min(tail) - 0.1, max(tail) + 0.1)
    axv.set_title("validation (same held-out windows for every run)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def loss_table(summary) -> str:
    w = summary["smooth"]
    lines = [
        f"| run | seed | final loss (mean of last {w} steps) | mean loss, all steps | held-out loss at step "
        f"{summary['steps']} | median step (s) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in summary["runs"]:
        label = "plain stage 3" if r["name"] == "plain" else "hpZ + qwZ int8 + qgZ int4"
        val = f"{r['val'][-1][1]:.4f}" if r["val"] else "-"
        lines.append(f"| {label} | {r['seed']} | {statistics.mean(r['loss'][-w:]):.4f} | "
                     f"{statistics.mean(r['loss']):.4f} | {val} | {r['median_step_s']:.2f} |")
    return "\n".join(lines) + "\n"


def loss_verdict(summary) -> list:
    c = summary.get("comparison")
    if not c:
        return []
    out = []
    lo, hi = min(c["plain_final"]), max(c["plain_final"])
    vals = c["plain_val_final"]
    for q in c["quantized"]:
        where = {"inside": "inside", "below": "below (better than)", "above": "above (worse than)"}[
            q.get("position", "inside" if q["final_within_plain_range"] else "outside")]
        line = (f"- Quantized, seed {q['seed']}: final loss {q['final']:.4f}, **{where}** the plain seeds' "
                f"{lo:.4f} .. {hi:.4f} (spread {c['plain_final_spread']:.4f})")
        if q["final_minus_same_seed_plain"] is not None:
            line += f"; {q['final_minus_same_seed_plain']:+.4f} from plain stage 3 with the same seed"
        line += (f". Its {summary['smooth']}-step moving average is inside the plain band at "
                 f"{q['steps_smoothed_in_band']} of {q['steps']} steps (largest distance outside "
                 f"{q['largest_smoothed_excursion']:.4f}).")
        if vals and q["val_final"] is not None:
            line += (f" Held-out loss at the end {q['val_final']:.4f} against {min(vals):.4f} .. {max(vals):.4f}"
                     + (f" ({q['val_final_minus_same_seed_plain']:+.4f} from the same seed's plain run)"
                        if q["val_final_minus_same_seed_plain"] is not None else "")
                     + f"; inside the plain range at {q['val_in_band']} of {q['val_points']} evaluations.")
        out.append(line)
    qf = c.get("quantized_final") or []
    if len(qf) >= 2:
        mp, mq = statistics.mean(c["plain_final"]), statistics.mean(qf)
        out.append(f"- Over seeds: final loss {mq:.4f} on average for the quantized runs ({min(qf):.4f} .. "
                   f"{max(qf):.4f}) against {mp:.4f} for plain stage 3 ({lo:.4f} .. {hi:.4f}): {mq - mp:+.4f}.")
        diffs = [q["final_minus_same_seed_plain"] for q in c["quantized"] if q["final_minus_same_seed_plain"] is not None]
        if diffs:
            out.append(f"- Reading: against the same seed's plain run the quantized runs end "
                       + ", ".join(f"{d:+.4f}" for d in diffs)
                       + f", the largest {max(abs(d) for d in diffs) / c['plain_final_spread']:.0%} of the plain "
                       f"seeds' spread ({c['plain_final_spread']:.4f}), "
                       + ("on either side" if min(diffs) < 0 < max(diffs) else "all on one side")
                       + f", and {mq - mp:+.4f} on average"
                       + (": the quantization's effect is of the size of run-to-run noise, with no direction seen."
                          if min(diffs) < 0 < max(diffs) else ".")
                       + " A range from three seeds is a narrow yardstick: each quantized run's final "
                       "value lies " + ", ".join(q.get("position", "?") for q in c["quantized"])
                       + " it.")
        qv = c.get("quantized_val_final") or []
        if len(qv) >= 2 and vals:
            out.append(f"- Held-out at the end: {statistics.mean(qv):.4f} ({min(qv):.4f} .. {max(qv):.4f}) against "
                       f"{statistics.mean(vals):.4f} ({min(vals):.4f} .. {max(vals):.4f}).")
    return out


def ablation_lines(data_dir, loss) -> list:
    """The parts alone (150-step runs of seed 0), next to the full runs at the same step."""
    import glob

    rows = []
    for path in sorted(glob.glob(os.path.join(data_dir, "loss_ablation_*.json"))):
        a = _load(path)
        if a and a["runs"]:
            rows.append((os.path.basename(path), a))
    if not rows or not loss:
        return []
    steps = rows[0][1]["steps"]
    w = loss["smooth"]

    def at(run, n):
        val = dict((s, v) for s, v in run["val"]).get(n)
        return statistics.mean(run["loss"][n - w:n]), val

    lines = [
        f"Which part: each part alone, seed 0, {steps} steps, the same settings otherwise (files "
        "`loss_ablation_*.json`; hpZ alone trains bit for bit like plain stage 3, tests/core/test_zero_plus_plus.py, "
        "so the hpZ + qwZ run shows qwZ's effect), beside the runs above at step " + str(steps) + f" (training loss: mean of steps "
        f"{steps - w + 1}-{steps}; held-out loss at step {steps}):",
        "",
        "| run | ZeRO++ options | training loss | held-out loss |",
        "|---|---|---:|---:|",
    ]
    for r in loss["runs"]:
        if len(r["loss"]) >= steps:
            t, v = at(r, steps)
            label = "plain stage 3" if r["name"] == "plain" else "hpZ + qwZ int8 + qgZ int4"
            lines.append(f"| {label}, seed {r['seed']} | {json.dumps(r['config']) if r['config'] else '-'} | {t:.4f} | "
                         f"{'-' if v is None else f'{v:.4f}'} |")
    for name, a in rows:
        r = a["runs"][0]
        t, v = at(r, steps)
        lines.append(f"| {name}, seed {r['seed']} | {json.dumps(r['config'])} | {t:.4f} | "
                     f"{'-' if v is None else f'{v:.4f}'} |")
    lines += ["", "Commands (each wrote to /tmp; the files were copied here under the names above):", "", "```"] + [f".venv/bin/python {a['command']}" for _, a in rows] + ["```", ""]
    return lines


# ---------------------------------------------------------------------------------------
# page
# ---------------------------------------------------------------------------------------
def measured_section(cross) -> list:
    lines = [
        "## Measured: cross-node bytes per training step",
        "",
        f"{cross['world_size']} gloo processes on this 2-core host as {cross['nodes']} simulated nodes x "
        f"{cross['ranks_per_node']} ranks (`ranks_per_node={cross['ranks_per_node']}`: ranks 0-1 are node 0, "
        "ranks 2-3 node 1). In the same processes, one after the other, each system trains the same GPT-2 "
        "(bench_core's presets) from the same weights on the same batches: (a) plain stage 3, (b) + hpZ, "
        "(c) hpZ + qwZ int8 + qgZ int4, all with the default config otherwise (persistence threshold 1e5: "
        "biases and LayerNorms stay whole, every block's matrices are partitioned), and (d) FSDP2 HSDP, "
        "`fully_shard` on every block and the root over `init_device_mesh(\"cpu\", (2, 2), mesh_dim_names="
        "(\"replicate\", \"shard\"))`, whose rows are the nodes (sharded inside a node, replicated across).",
        "",
        "Counting: ours is `engine.comm_report()`; FSDP2's is torch.distributed's collectives wrapped "
        "during the steps (in this torch FSDP2 calls `all_gather_single`, `reduce_scatter_single` and, for "
        "HSDP's replicas, `all_reduce`), each call's full-tensor bytes and process group passed to the same "
        "function the engine uses, `topology.sent_bytes` ([Note: direct-exchange bytes] in "
        "zero_strategy/communication/topology.py): what this rank must hand to every other member of the "
        "group, split by whether that member is on its node. Bytes per rank per step (the worst rank; every "
        "measured step moved exactly the same bytes), MB = 1e6 B. *bits per element x elements*: per "
        "collective kind, the bits on the wire per element and the elements per step as a multiple of Ψ "
        "(AG all-gather, RS reduce-scatter, RS x-node a2a qgZ's quantized all-to-all between nodes, AR "
        "all-reduce, ctl small control values). Steps/s: a shared 2-core CPU host running four processes, "
        "for the record only.",
        "",
        "Command:",
        "",
        "```",
        f".venv/bin/python {cross['command']}",
        "```",
        "",
    ]
    for c in cross["configs"]:
        lines.append(X.markdown_config(cross, c))
    plans = []
    for c in cross["configs"]:
        plain = next((r for r in c["rows"] if r["system"] == "zero3"), None)
        plan = plain and plain["config"].get("plan")
        if plan and c["precision"] == cross["configs"][0]["precision"]:
            plans.append(f"{c['model']}: {plan['partitioned_units']} partitioned units holding "
                         f"{plan['partitioned_numel'] / c['psi']:.2%} of Ψ, {plan['whole_numel']:,} elements kept "
                         "whole on every rank")
    gathers = []
    for c in cross["configs"]:
        plain = next((r for r in c["rows"] if r["system"] == "zero3"), None)
        if plain and "all_gather" in plain["kinds_rank0"]:
            gathers.append(f"{plain['kinds_rank0']['all_gather']['elements_per_psi']:.2f}Ψ ({c['model']} "
                           f"{c['precision']}; embedding {c['vocab'] * c['n_embd'] / c['psi']:.0%} of Ψ)")
    lines += [
        f"_{cross['date']}, torch {cross['torch']}, {cross['threads_per_rank']} thread per rank, "
        f"{cross['warmup']} warm-up + {cross['steps']} measured steps per system, load average "
        f"{cross['loadavg_before'][0]:.1f} before / {cross['loadavg_after'][0]:.1f} after, {cross['wall_s']:.0f} s._",
        "",
        "Reading it:",
        "",
        "- The default plan (persistence threshold 1e5) partitions the blocks: "
        + ("; ".join(plans) if plans else "(plan not recorded)") + ".",
        "- Plain stage 3's all-gather volume is " + ", ".join(gathers) + " rather than 2Ψ (the other "
        "stage-3 systems gather the same elements): the tied embedding sits in the root unit, gathered once "
        "and kept from forward into backward; every block is gathered twice.",
        "- (b) hpZ moves the backward all-gathers inside the node: cross-node bytes fall by the blocks' "
        "backward share, intra-node bytes rise by as much as they are gathered within a node.",
        "- (c) adds int8 forward gathers (8.125 bits per element with one fp32 scale per 256: the AG "
        "figure mixes them with hpZ's backward gathers inside the node, which stay at the compute precision: 16 bits "
        "in bf16, 32 in fp32) and qgZ: a full-precision "
        "reduce-scatter inside the node, then 4.125-bit pieces between nodes (0.25Ψ elements per rank here: "
        "(M-1)/M of 1/L of the gradient).",
        "- (d) HSDP never gathers across nodes: its cross-node traffic is the all-reduce of each rank's "
        "1/L shard of the gradient with its replica on the other node, in the reduce dtype.",
        "- This accounting is the direct exchange: a flat collective over ranks on both nodes is charged "
        "what each rank sends to each remote member, so the same shard sent to both ranks of the other node "
        "counts twice. A topology-aware library sends it once per node; the simulation below uses that "
        "cheaper model for flat collectives, which lowers every system's flat collectives: plain stage 3 has the "
        "most of them (all three passes), hpZ two, ZeRO++ one (the int8 forward gather), HSDP none.",
        "",
    ]
    return lines


def loss_section(loss, png_rel, data_dir) -> list:
    commands = loss.get("commands") or [loss]
    lines = [
        "## Measured: loss curves, plain stage 3's spread against hpZ + qwZ int8 + qgZ int4",
        "",
        f"GPT-2 {loss['model']} ({loss['psi'] / 1e6:.1f}M parameters), {loss['precision']}, "
        f"{loss['nodes']} simulated nodes x {loss['ranks_per_node']} ranks, {loss['steps']} steps of "
        f"{loss['micro_batch']} sequences x {loss['seq']} tokens per rank ({loss['tokens_per_step']} tokens per "
        f"step), AdamW lr {loss['lr']:g} (constant, weight decay 0.01). Data: real text, the bytes of the "
        f"Python standard library's top-level modules ({loss['corpus_bytes'] / 1e6:.1f} MB, one token per "
        "byte, the last 5% held out); random tokens would only teach every run the uniform distribution. "
        "Each seed has its own initial weights and its own batch order; a quantized run with seed s uses "
        f"plain seed s's weights and batches. The held-out loss is over the same {loss['val_windows']} windows every "
        f"{loss['eval_every']} steps (a no-grad forward, which gathers exact weights). Batch and sequence "
        "were chosen after timing a few steps (0.9 s a step for plain stage 3, 1.1 s quantized, on the quiet "
        "machine) so that three plain runs and one quantized run fit about 20 minutes; other work shared the "
        "2 cores, so they took longer: " + "; ".join(
            f"{c['wall_s'] / 60:.0f} min at load average {c['loadavg_before'][0]:.1f} / {c['loadavg_after'][0]:.1f}"
            for c in commands) + " (before / after). Commands, in order (`--append` adds runs to the file; every "
        "setting that shapes a curve must be equal):",
        "",
        "```",
    ] + [f".venv/bin/python {c['command']}" for c in commands] + [
        "```",
        "",
        f"![loss curves]({png_rel})",
        "",
        "Left: training loss per step (thin, mean over the 4 ranks' micro-batches) and its "
        f"{loss['smooth']}-step moving average (thick); the shaded band is, at each step, the range of the "
        "plain seeds' moving averages (blue; green: the quantized seeds'), the run-to-run spread the quantized "
        "runs are judged against. "
        "Right: the held-out loss at each evaluation, plain seeds in blue, the quantized runs in green.",
        "",
        loss_table(loss),
    ]
    lines += loss_verdict(loss) + [""] + ablation_lines(data_dir, loss)
    return lines


def simulation_section(sim, args, png_rel, cross) -> list:
    src = sim["source"]
    ag = None
    for c in (cross or {}).get("configs", []):
        if c["model"] == src["model"] and c["precision"] == src["precision"]:
            plain = next((r for r in c["rows"] if r["system"] == "zero3"), None)
            if plain and "all_gather" in plain["kinds_rank0"]:
                ag = plain["kinds_rank0"]["all_gather"]["elements_per_psi"]
    unfit = []
    for model in args.models:
        for system in args.systems:
            bad = [r["nodes"] for r in sim["rows"] if r["model"] == model and r["system"] == system
                   and not r["fits"] and r["nic_gbps"] == args.nic_gbps[0]]
            if bad:
                unfit.append(f"{Z.SYSTEM_LABELS[system]} at {model} on {', '.join(map(str, bad))} node(s)")
    lines = [
        "## Simulated: step time of 7B and 70B Llama shapes on 2-64 nodes of 8 GPUs",
        "",
        "Nothing in this section ran on a GPU or a network: it is arithmetic (benchmarks/"
        "simulate_zero_plus_plus.py; its docstring states each step) on these inputs:",
        "",
        f"- **Bytes per parameter per step, per collective and level**: from the measured {src['model']} "
        f"{src['precision']} run above ({src['psi'] / 1e6:.1f}M parameters, {src['nodes']} x "
        f"{src['ranks_per_node']}). Each kind's measured intra/cross bytes are split back into the "
        "full-tensor bytes of the collectives behind them, by level (flat over all ranks, inside a node, "
        "one rank per node) by inverting `sent_bytes`; re-applying `sent_bytes` gives the measured bytes "
        "back (checked below). Scaling: flat and node collectives carry whole units, so their bytes are "
        "(bytes per parameter) x Ψ; cross collectives carry what a node already reduced or sharded to 1/L, "
        f"so theirs are (bytes per parameter) x Ψ x {src['ranks_per_node']} / L."
        + (f" The measured GPT-2's embedding is gathered once per step, so its all-gathers are {ag:.2f}Ψ, "
           f"not the ~2Ψ a Llama would gather: every stage-3 system's gather volume is understated alike "
           f"(by up to {(2 - ag) / 2:.0%})." if ag else ""),
        "- **Time per collective**: the ring formula t = S(n-1)/(nB) per level: inside a node n = 8 on "
        f"NVLink at {args.nvlink_gbs:g} GB/s per GPU; across nodes n = M on each GPU's NIC at "
        + "/".join(f"{g:g}" for g in args.nic_gbps) + " Gb/s; a flat collective over all 8M GPUs as two levels, "
        "S over NVLink and S/8 per GPU across (each node's traffic spread over its 8 NICs, as NCCL's rings "
        "do). All-reduce counts twice. No latency terms.",
        f"- **Compute**: 6 Ψ T FLOPs per GPU per step, T = {args.tokens_per_gpu} tokens per GPU per step, at "
        f"{args.mfu:.0%} MFU of {args.peak_tflops:g} TFLOP/s (H100 SXM, dense bf16).",
        "- **Step time** = compute + exposed communication: *no overlap* (all of it exposed, an upper bound) "
        "and *full overlap* (max(compute, communication), a lower bound); prefetching lands in between.",
        "- **Model states per GPU** (16 bytes per parameter): 16Ψ/N; hpZ adds its secondary partition, 2Ψ/8, "
        "held from each layer's forward to its backward; HSDP holds 16Ψ/8. (x) marks more than 80 GB "
        "(activations not counted)" + (": " + "; ".join(unfit) if unfit else "") + ".",
        "",
        "```",
        f".venv/bin/python {sim['command']}",
        "```",
        "",
        "Per-parameter bytes the simulation uses (from the measurement):",
        "",
        Z.ops_markdown(sim["ops"], src, args.systems),
    ]
    for c in sim["checks"]:
        lines.append(f"- check, {Z.SYSTEM_LABELS[c['system']]}: `sent_bytes` on these gives {c['intra']:,.0f} / "
                     f"{c['cross']:,.0f} bytes intra / cross per rank; measured {c['measured_intra']:,.0f} / "
                     f"{c['measured_cross']:,.0f}")
    lines += ["", f"![simulated step time]({png_rel})", "",
              "One panel per model (rows) and NIC bandwidth per GPU (columns); x: nodes of 8 GPUs (weak "
              "scaling: the same tokens per GPU at every size); lines with markers: step time with no overlap, "
              "dotted: with full overlap (mostly on the compute line); grey: compute alone; x: model states above "
              "the GPU's memory. hpZ (orange, dashed) and HSDP (blue) coincide: in this model they put the same "
              "bytes on each link (hpZ: a forward gather and the reduce-scatter across nodes, each S/8 per GPU; "
              "HSDP: the all-reduce of a 1/8 shard, 2 x S/8), and about the same on NVLink. The "
              "tables below give the same numbers, then each system's bytes per GPU per step on the NIC and "
              "on NVLink at the smallest and largest node count.", "",
              Z.markdown(sim["rows"], args, src), ""]
    return lines


def headline(cross, loss, sim, args) -> list:
    out = []
    if cross:
        for c in cross["configs"]:
            by = {r["system"]: r for r in c["rows"]}
            if "zero3_zpp" in by and "zero3" in by:
                z = by["zero3_zpp"]
                h = by.get("fsdp2_hsdp")
                out.append(
                    f"- measured, {c['model']} {c['precision']}: hpZ + qwZ + qgZ sends "
                    f"{z['cross_node_bytes'] / 1e6:.1f} MB across nodes per rank and step, "
                    f"{z['cross_vs_plain']:.3f}x plain stage 3's {by['zero3']['cross_node_bytes'] / 1e6:.1f} MB"
                    + (f" and {z['cross_node_bytes'] / h['cross_node_bytes']:.2f}x FSDP2 HSDP's "
                       f"{h['cross_node_bytes'] / 1e6:.1f} MB" if h else "") + ".")
    if loss and loss.get("comparison") and len(loss["comparison"].get("quantized_final") or []) >= 2:
        c = loss["comparison"]
        qf, pf = c["quantized_final"], c["plain_final"]
        out.append(f"- measured, loss: after {loss['steps']} steps hpZ + qwZ int8 + qgZ int4 ends at "
                   f"{statistics.mean(qf):.4f} on average over {len(qf)} seeds ({min(qf):.4f} .. {max(qf):.4f}), "
                   f"plain stage 3 at {statistics.mean(pf):.4f} ({min(pf):.4f} .. {max(pf):.4f}); same-seed "
                   "differences " + ", ".join(f"{q['final_minus_same_seed_plain']:+.3f}" for q in c["quantized"])
                   + ".")
    elif loss and loss.get("comparison"):
        c = loss["comparison"]
        for q in c["quantized"]:
            where = {"inside": "inside", "below": "below (better than)", "above": "above (worse than)"}[
                q.get("position", "inside")]
            out.append(f"- measured, loss: after {loss['steps']} steps the quantized run of seed {q['seed']} ends at "
                       f"{q['final']:.4f}, {where} plain stage 3's {len(c['plain_final'])}-seed range "
                       f"{min(c['plain_final']):.4f} .. {max(c['plain_final']):.4f}.")
    if sim:
        for model in args.models:
            rs = {(r["system"], r["nodes"], r["nic_gbps"]): r for r in sim["rows"] if r["model"] == model}
            n, g = args.nodes[-1], args.nic_gbps[0]
            a, b = rs.get(("zero3", n, g)), rs.get(("zero3_zpp", n, g))
            if a and b:
                out.append(f"- simulated, {model} on {n} x 8 GPUs at {g:g} Gb/s: step {a['step_no_overlap_s']:.2f} s "
                           f"(plain stage 3) vs {b['step_no_overlap_s']:.2f} s (ZeRO++) with no overlap, "
                           f"{a['step_full_overlap_s']:.2f} vs {b['step_full_overlap_s']:.2f} s with full overlap.")
    return out


def render(data_dir=DATA, page=PAGE):
    cross = _load(os.path.join(data_dir, "cross_node.json"))
    loss = _load(os.path.join(data_dir, "loss_curves.json"))
    if loss:
        import zero_plus_plus_loss as L

        loss["comparison"] = L.compare(loss)  # with this version's fields, whatever wrote the file
    page_dir = os.path.dirname(os.path.abspath(page))
    rel = os.path.relpath(os.path.abspath(data_dir), page_dir)
    sim, sim_args = None, None
    measured = os.path.join(data_dir, "cross_node.json")
    if cross:
        sim_args = Z.parse_args(["--measured", measured])
        sim = Z.run(sim_args)
        # the command as a reader would type it (default paths)
        sim["command"] = "benchmarks/simulate_zero_plus_plus.py --check"
        with open(os.path.join(data_dir, "simulate.json"), "w", encoding="utf-8") as f:
            json.dump(sim, f, indent=1)
        Z.plot(sim["rows"], sim_args, os.path.join(data_dir, "simulated_step_time.png"))
    if loss:
        plot_losses(loss, os.path.join(data_dir, "loss_curves.png"))
    lines = [
        "# ZeRO++ across nodes",
        "",
        "What hpZ (`secondary_partition: \"node\"`), qwZ (`weight_quantization: \"int8\"`) and qgZ "
        "(`gradient_quantization: \"int4\"`) save between nodes, next to plain stage 3 and FSDP2's HSDP. "
        "The first two sections are **measured** on this CPU host with nodes simulated by "
        "`ranks_per_node` (4 gloo processes as 2 nodes x 2 ranks: byte counts are exact, times are not "
        "those of a network); the third is a **simulation**: arithmetic from those measured bytes with "
        "stated bandwidths and compute rate. Page written by `benchmarks/zero_plus_plus_page.py` from the "
        "saved results in `docs/benchmarks/zero_plus_plus/`; "
        "[back to the benchmarks](../benchmarks.md).",
        "",
        "Headlines:",
        "",
    ]
    args = sim_args or Z.parse_args(["--measured", "nominal"])
    lines += headline(cross, loss, sim, args) + [""]
    if cross:
        lines += measured_section(cross)
    if loss:
        lines += loss_section(loss, f"{rel}/loss_curves.png", data_dir)
    if sim:
        lines += simulation_section(sim, sim_args, f"{rel}/simulated_step_time.png", cross)
    with open(page, "w", encoding="utf-8") as f:
        f.write("\n".join(lines).rstrip() + "\n")
    # The fragment run_all.py puts into docs/benchmarks.md ({rel} = this folder from that page).
    summary = ["## ZeRO++ across nodes", "",
               "Cross-node bytes of plain stage 3, hpZ, hpZ + qwZ + qgZ and FSDP2 HSDP on simulated nodes, "
               "loss curves of the quantized run against plain stage 3's seed spread, and a simulation of 7B / "
               "70B step times on 2-64 nodes: **[zero_plus_plus.md]({rel}/zero_plus_plus.md)**.", ""]
    summary += headline(cross, loss, sim, args) + [""]
    with open(os.path.join(data_dir, "summary.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(summary))
    return page


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", default=DATA)
    p.add_argument("--page", default=PAGE)
    args = p.parse_args(argv)
    os.makedirs(args.data_dir, exist_ok=True)
    print(render(args.data_dir, args.page))


if __name__ == "__main__":
    main()
