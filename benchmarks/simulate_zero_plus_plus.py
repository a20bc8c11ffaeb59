"""Step time of 7B / 70B Llama-shaped models on 2-64 nodes of 8 GPUs: plain stage 3, hpZ,
hpZ + qwZ + qgZ, FSDP2 HSDP -- a model fed by the bytes measured on simulated nodes.

Nothing here runs on a GPU; every figure is arithmetic on stated inputs:

1. **Bytes per parameter, by collective and level**, from ``bench_cross_node.py``'s
   measurement (default: its largest bf16 model, ``docs/benchmarks/zero_plus_plus/
   cross_node.json``) on M0 x L0 simulated nodes.  Each collective kind's measured
   (intra-node, cross-node) bytes per rank are split back into the full-tensor bytes of
   the collectives that produced them, by level -- *flat* (a group spanning every rank),
   *node* (the ranks of one node) and *cross* (one rank per node) -- by inverting the
   accounting the measurement used (``topology.sent_bytes``, [Note: direct-exchange
   bytes]): a flat collective of S bytes sends ``m S (N0-L0)/N0`` across and
   ``m S (L0-1)/N0`` inside the node (m = 2 for all-reduce), a node one ``m S (L0-1)/L0``
   inside only, a cross one ``m S (M0-1)/M0`` across only.  ``--check`` re-applies
   ``sent_bytes`` and must give the measured bytes back.
2. **Scaling to Ψ**: a flat or node collective carries whole units (all-gathers of a
   layer's parameters, reduce-scatters of its gradients): S = (bytes per parameter) x Ψ.
   A cross collective carries what a node has already sharded or reduced to 1/L of the
   model (HSDP's replica all-reduce of a shard, qgZ's all-to-all of node-reduced
   gradient pieces): S = (bytes per parameter at L0) x Ψ x L0 / L.
3. **Time per collective**, the ring formula ``t = S (n-1) / (n B)`` per level: a node
   collective over n = L GPUs on NVLink (``--nvlink-gbs``, 450 GB/s per GPU); a cross
   collective over n = M nodes on each GPU's own NIC (``--nic-gbps``, 100 / 200 / 400
   Gb/s per GPU); a flat collective over all N = M x L GPUs as the two levels a
   topology-aware library (NCCL's rings and trees with one NIC per GPU) runs it: S over
   NVLink inside the node, and S / L per GPU across nodes (each node's traffic spread over
   its L NICs).  All-reduce = 2x.  Latency terms are ignored (units are 100M+ elements).
4. **Compute**: 6 Ψ T FLOPs per GPU per step at ``--mfu`` (0.40) of ``--peak-tflops``
   (989: H100 SXM dense bf16), T = ``--tokens-per-gpu`` (4096) tokens per GPU per step.
5. **Step time** = compute + exposed communication, under two stated assumptions: *no
   overlap* (exposed = all of it: an upper bound) and *full overlap* (step =
   max(compute, communication): a lower bound).  Real prefetching lies in between.

Model states per GPU beside it (bf16 parameters and gradients, fp32 master and Adam:
16 B per parameter): 16Ψ/N for stage 3; hpZ adds its secondary partition, 2Ψ/L, held
from a layer's forward to its backward (all layers at the end of forward); HSDP holds
16Ψ/L.  Activations are not counted.  Columns beyond 80 GB do not fit an H100.

    .venv/bin/python benchmarks/simulate_zero_plus_plus.py
    .venv/bin/python benchmarks/simulate_zero_plus_plus.py --models 7b --nodes 2,8 --nic-gbps 100 --check
    .venv/bin/python benchmarks/simulate_zero_plus_plus.py --measured nominal     # no measurement: design values
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

REPO = os.path.dirname(HERE)
DEFAULT_MEASURED = os.path.join(REPO, "docs", "benchmarks", "zero_plus_plus", "cross_node.json")
SYSTEM_LABELS = {
    "zero3": "plain stage 3",
    "zero3_hpz": "stage 3 + hpZ",
    "zero3_zpp": "hpZ + qwZ int8 + qgZ int4",
    "fsdp2_hsdp": "FSDP2 HSDP",
}
KIND_MULTIPLIER = {"all_reduce": 2, "control": 2}
LEVELS = ("flat", "node", "cross")
GB = 1e9


# ---------------------------------------------------------------------------------------
# models
# ---------------------------------------------------------------------------------------
def llama_params(shape: dict) -> int:
    """Trainable parameters of transformers' LlamaForCausalLM (untied embedding, no biases)."""
    h, i, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    heads, kv, vocab = shape["num_attention_heads"], shape["num_key_value_heads"], shape["vocab_size"]
    d = shape.get("head_dim", h // heads)
    attn = h * heads * d + 2 * h * kv * d + heads * d * h
    mlp = 3 * h * i
    return 2 * vocab * h + layers * (attn + mlp + 2 * h) + h


def model_shapes():
    import simulate_scale

    return simulate_scale.MODELS


# ---------------------------------------------------------------------------------------
# 1. measured bytes -> full-tensor bytes per parameter, by level
# ---------------------------------------------------------------------------------------
def decompose_kind(kind: str, intra: float, cross: float, nodes: int, per_node: int) -> dict:
    """Full-tensor bytes of the collectives behind one kind's (intra, cross) bytes per rank,
    by level: cross-only when nothing stayed inside the node, else flat + node."""
    m = KIND_MULTIPLIER.get(kind, 1)
    n = nodes * per_node
    if intra == 0 and cross == 0:
        return {}
    if intra == 0 or per_node == 1:
        return {"cross": cross * nodes / ((nodes - 1) * m)}
    flat = cross * n / ((n - per_node) * m)
    node = (intra - m * flat * (per_node - 1) / n) * per_node / ((per_node - 1) * m)
    # The engine rounds each call's split to whole bytes: residues of a few bytes per call are noise.
    tol = 1e-4 * (intra + cross) + 16
    out = {}
    if flat > 0:
        out["flat"] = flat
    if node > tol:
        out["node"] = node
    elif node < -tol:
        raise ValueError(f"{kind}: intra {intra} and cross {cross} bytes fit no flat + node split")
    return out


def ops_from_measurement(row: dict, nodes: int, per_node: int, skip=("control",)) -> list:
    """[(kind, level, multiplier, bytes per parameter)] for one measured system row;
    cross-level ops' bytes per parameter refer to a model of Ψ parameters at L = per_node
    (scaled by per_node / L later)."""
    psi = row["psi"]
    ops = []
    for kind, v in row["kinds_rank0"].items():
        if kind in skip or kind == "total":
            continue
        for level, s in decompose_kind(kind, v["intra_node_bytes"], v["cross_node_bytes"], nodes, per_node).items():
            ops.append({"kind": kind, "level": level, "m": KIND_MULTIPLIER.get(kind, 1), "bytes_per_param": s / psi,
                        "bits_per_element": v.get("bits_per_element")})
    return ops


def nominal_ops(precision_bytes: float = 2.0, block: int = 256, gathers_per_step: float = 2.0) -> dict:
    """The design's per-parameter bytes (no measurement): every parameter gathered
    ``gathers_per_step`` times, bf16 wire, int8 / int4 blocks with one fp32 scale each;
    cross-level ops per parameter at L0 = 1 (scaled by 1 / L)."""
    q8, q4 = 1 + 4 / block, 0.5 + 4 / block
    b, g = precision_bytes, gathers_per_step
    fwd, bwd = 1.0, g - 1.0
    return {
        "zero3": [op("all_gather", "flat", g * b), op("reduce_scatter", "flat", b)],
        "zero3_hpz": [op("all_gather", "flat", fwd * b), op("all_gather", "node", bwd * b),
                      op("reduce_scatter", "flat", b)],
        "zero3_zpp": [op("all_gather", "flat", fwd * q8), op("all_gather", "node", bwd * b),
                      op("reduce_scatter", "node", b), op("reduce_scatter_cross_node", "cross", q4)],
        "fsdp2_hsdp": [op("all_gather", "node", g * b), op("reduce_scatter", "node", b),
                       op("all_reduce", "cross", b)],
    }


def op(kind, level, bytes_per_param):
    return {"kind": kind, "level": level, "m": KIND_MULTIPLIER.get(kind, 1), "bytes_per_param": bytes_per_param}


def load_measured(path: str, model: str = None, precision: str = "bf16"):
    """(ops per system, source dict) from bench_cross_node's JSON: the given model or the
    largest measured one in ``precision``."""
    with open(path, encoding="utf-8") as f:
        summary = json.load(f)
    configs = [c for c in summary["configs"] if c["precision"] == precision and (model is None or c["model"] == model)]
    if not configs:
        raise SystemExit(f"{path}: no {precision} measurement{' of ' + model if model else ''}")
    config = max(configs, key=lambda c: c["psi"])
    nodes, per_node = summary["nodes"], summary["ranks_per_node"]
    ops = {r["system"]: ops_from_measurement(r, nodes, per_node) for r in config["rows"]}
    source = {"path": os.path.relpath(path, REPO) if path.startswith(REPO) else path, "model": config["model"],
              "psi": config["psi"], "precision": precision, "nodes": nodes, "ranks_per_node": per_node,
              "command": summary.get("command"), "date": summary.get("date")}
    return ops, source, config


def reapply(ops: list, psi: int, nodes: int, per_node: int) -> tuple:
    """(intra, cross) bytes per rank that ``topology.sent_bytes`` gives for these ops at
    nodes x per_node: the inverse of :func:`decompose_kind` (``--check``)."""
    from zero_strategy.communication.topology import GroupPlacement, Topology, sent_bytes

    topo = Topology(nodes * per_node, per_node)
    groups = {"flat": list(range(nodes * per_node)), "node": topo.node_ranks(0), "cross": topo.peers_across(0)}
    intra = cross = 0
    for o in ops:
        place = GroupPlacement.of(topo, groups[o["level"]], 0)
        shape = "all_reduce" if o["m"] == 2 else "all_gather"
        a, c = sent_bytes(shape, o["bytes_per_param"] * psi, place)
        intra, cross = intra + a, cross + c
    return intra, cross


# ---------------------------------------------------------------------------------------
# 2-5. time at scale
# ---------------------------------------------------------------------------------------
def op_bytes_and_time(o: dict, psi: float, nodes: int, per_node: int, ref_per_node: int, nvlink_Bps: float,
                      nic_Bps: float) -> dict:
    """Full tensor bytes, per-GPU NVLink / NIC bytes and seconds of one op at M x L."""
    m, level, L, M = o["m"], o["level"], per_node, nodes
    if level == "cross":
        s = o["bytes_per_param"] * psi * ref_per_node / L
    else:
        s = o["bytes_per_param"] * psi
    nvl = nic = 0.0
    if level in ("node", "flat") and L > 1:
        nvl = m * s * (L - 1) / L
    if level == "cross" and M > 1:
        nic = m * s * (M - 1) / M
    if level == "flat" and M > 1:
        nic = m * (s / L) * (M - 1) / M
    return {"full_bytes": s, "nvlink_bytes": nvl, "nic_bytes": nic,
            "nvlink_s": nvl / nvlink_Bps, "nic_s": nic / nic_Bps}


def model_state_bytes(system: str, psi: float, nodes: int, per_node: int) -> float:
    n = nodes * per_node
    if system == "fsdp2_hsdp":
        return 16 * psi / per_node
    extra = 2 * psi / per_node if system in ("zero3_hpz", "zero3_zpp") else 0.0
    return 16 * psi / n + extra


def simulate(ops: dict, args, ref_per_node: int) -> list:
    shapes = model_shapes()
    rows = []
    for model in args.models:
        psi = llama_params(shapes[model])
        compute = 6 * psi * args.tokens_per_gpu / (args.mfu * args.peak_tflops * 1e12)
        for nodes in args.nodes:
            for gbps in args.nic_gbps:
                nic_Bps, nvlink_Bps = gbps * 1e9 / 8, args.nvlink_gbs * 1e9
                for system in args.systems:
                    parts = [op_bytes_and_time(o, psi, nodes, args.gpus_per_node, ref_per_node, nvlink_Bps, nic_Bps)
                             for o in ops[system]]
                    comm = sum(p["nvlink_s"] + p["nic_s"] for p in parts)
                    states = model_state_bytes(system, psi, nodes, args.gpus_per_node)
                    rows.append({
                        "model": model, "psi": psi, "nodes": nodes, "gpus": nodes * args.gpus_per_node,
                        "nic_gbps": gbps, "system": system, "compute_s": compute,
                        "nvlink_bytes": sum(p["nvlink_bytes"] for p in parts),
                        "nic_bytes": sum(p["nic_bytes"] for p in parts),
                        "nvlink_s": sum(p["nvlink_s"] for p in parts), "nic_s": sum(p["nic_s"] for p in parts),
                        "comm_s": comm, "step_no_overlap_s": compute + comm, "step_full_overlap_s": max(compute, comm),
                        "model_state_bytes": states, "fits": states <= args.gpu_memory_gb * GB,
                        "tokens_per_s_no_overlap": args.tokens_per_gpu * nodes * args.gpus_per_node / (compute + comm),
                    })
    return rows


# ---------------------------------------------------------------------------------------
# output
# ---------------------------------------------------------------------------------------
def _row(rows, **key):
    return next(r for r in rows if all(r[k] == v for k, v in key.items()))


def markdown(rows, args, source) -> str:
    systems = args.systems
    lines = []
    for model in args.models:
        mrows = [r for r in rows if r["model"] == model]
        r0 = mrows[0]
        lines += [
            f"**{model}** (Llama shape, Ψ = {r0['psi'] / 1e9:.2f}B): compute {r0['compute_s']:.3f} s per step "
            f"({args.tokens_per_gpu} tokens per GPU, {args.mfu:.0%} MFU of {args.peak_tflops:g} TFLOP/s). "
            "Step time in seconds, *no overlap* / *full overlap*; (x) = model states per GPU above "
            f"{args.gpu_memory_gb:g} GB.",
            "",
            "| nodes x 8 | NIC Gb/s per GPU | " + " | ".join(SYSTEM_LABELS[s] for s in systems)
            + " | ZeRO++ vs plain (no overlap) |",
            "|---:|---:|" + "---:|" * len(systems) + "---:|",
        ]
        for nodes in args.nodes:
            for gbps in args.nic_gbps:
                cells = []
                for s in systems:
                    r = _row(mrows, nodes=nodes, nic_gbps=gbps, system=s)
                    cells.append(f"{r['step_no_overlap_s']:.3f} / {r['step_full_overlap_s']:.3f}"
                                 + ("" if r["fits"] else " (x)"))
                speed = ""
                if "zero3" in systems and "zero3_zpp" in systems:
                    a = _row(mrows, nodes=nodes, nic_gbps=gbps, system="zero3")["step_no_overlap_s"]
                    b = _row(mrows, nodes=nodes, nic_gbps=gbps, system="zero3_zpp")["step_no_overlap_s"]
                    speed = f"{a / b:.2f}x"
                lines.append(f"| {nodes} | {gbps:g} | " + " | ".join(cells) + f" | {speed} |")
        lines.append("")
        # bytes and memory per GPU: independent of the NIC's speed
        lines += [
            f"Per GPU per step at {args.nodes[0]} and {args.nodes[-1]} nodes ({model}): NIC bytes, NVLink bytes, "
            "communication time at the slowest and fastest NIC, model states.",
            "",
            "| system | nodes | NIC GB | NVLink GB | comm s at " + " / ".join(f"{g:g}" for g in args.nic_gbps)
            + " Gb/s | model states GB |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for s in systems:
            for nodes in sorted({args.nodes[0], args.nodes[-1]}):
                rs = [_row(mrows, nodes=nodes, nic_gbps=g, system=s) for g in args.nic_gbps]
                lines.append(f"| {SYSTEM_LABELS[s]} | {nodes} | {rs[0]['nic_bytes'] / GB:.2f} | "
                             f"{rs[0]['nvlink_bytes'] / GB:.2f} | " + " / ".join(f"{r['comm_s']:.3f}" for r in rs)
                             + f" | {rs[0]['model_state_bytes'] / GB:.1f}{'' if rs[0]['fits'] else ' (x)'} |")
        lines.append("")
    return "\n".join(lines)


def ops_markdown(ops: dict, source: dict, systems) -> str:
    ref = source["ranks_per_node"]
    lines = [
        "| system | collective | level | bytes per parameter per step |",
        "|---|---|---|---:|",
    ]
    for s in systems:
        for o in ops[s]:
            per = "Ψ" if o["level"] != "cross" else f"Ψ x {ref}/L"
            lines.append(f"| {SYSTEM_LABELS[s]} | {o['kind']} | {o['level']} | {o['bytes_per_param']:.4f} x {per} |")
    return "\n".join(lines) + "\n"


def plot(rows, args, path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    colors = {"zero3": "tab:red", "zero3_hpz": "tab:orange", "zero3_zpp": "tab:green", "fsdp2_hsdp": "tab:blue"}
    # hpZ and HSDP can coincide (the same bytes on each link): different markers and dashes keep both visible
    styles = {"zero3": ("o", "-", 1.5), "zero3_hpz": ("s", (0, (4, 2)), 2.6), "zero3_zpp": ("o", "-", 1.5),
              "fsdp2_hsdp": ("^", "-", 1.2)}
    fig, axes = plt.subplots(len(args.models), len(args.nic_gbps), figsize=(4.2 * len(args.nic_gbps),
                                                                             3.4 * len(args.models)),
                             squeeze=False, sharex=True)
    for i, model in enumerate(args.models):
        for j, gbps in enumerate(args.nic_gbps):
            ax = axes[i][j]
            compute = None
            for s in args.systems:
                rs = [_row(rows, model=model, nodes=n, nic_gbps=gbps, system=s) for n in args.nodes]
                compute = rs[0]["compute_s"]
                marker, dash, width = styles.get(s, ("o", "-", 1.5))
                ax.plot(args.nodes, [r["step_no_overlap_s"] for r in rs], marker=marker, ls=dash, lw=width, ms=4,
                        color=colors.get(s), label=f"{SYSTEM_LABELS[s]} (no overlap)")
                ax.plot(args.nodes, [r["step_full_overlap_s"] for r in rs], ls=":", lw=1.2, color=colors.get(s),
                        alpha=0.7, label=f"{SYSTEM_LABELS[s]} (full overlap)")
                for n, r in zip(args.nodes, rs):
                    if not r["fits"]:
                        ax.plot([n], [r["step_no_overlap_s"]], "x", color="black", ms=8, mew=1.5)
            ax.axhline(compute, color="gray", lw=0.8, ls="-", alpha=0.5)
            ax.set_xscale("log", base=2)
            ax.set_xticks(args.nodes)
            ax.set_xticklabels([str(n) for n in args.nodes])
            ax.set_ylim(bottom=0)
            ax.set_title(f"{model}, NIC {gbps:g} Gb/s per GPU", fontsize=9)
            if i == len(args.models) - 1:
                ax.set_xlabel(f"nodes (x {args.gpus_per_node} GPUs)")
            if j == 0:
                ax.set_ylabel("step time (s)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=7, frameon=False)
    fig.suptitle(f"Simulated step time: compute (grey, {args.mfu:.0%} MFU, {args.tokens_per_gpu} tokens/GPU) + "
                 f"communication; x = model states > {args.gpu_memory_gb:g} GB/GPU", fontsize=9)
    fig.tight_layout(rect=(0, 0.08, 1, 0.96))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def parse_args(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="7b,70b")
    p.add_argument("--nodes", default="2,4,8,16,32,64")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--nic-gbps", default="100,200,400", help="cross-node bandwidth per GPU, Gb/s")
    p.add_argument("--nvlink-gbs", type=float, default=450.0, help="intra-node bandwidth per GPU, GB/s")
    p.add_argument("--mfu", type=float, default=0.40)
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--tokens-per-gpu", type=int, default=4096)
    p.add_argument("--gpu-memory-gb", type=float, default=80.0)
    p.add_argument("--systems", default=",".join(SYSTEM_LABELS))
    p.add_argument("--measured", default=DEFAULT_MEASURED,
                   help="bench_cross_node.py's JSON, or 'nominal' for the design's bytes (no measurement)")
    p.add_argument("--measured-model", default=None, help="which measured model (default: the largest)")
    p.add_argument("--measured-precision", default="bf16")
    p.add_argument("--check", action="store_true", help="re-apply sent_bytes to the decomposition: must give "
                                                        "the measured bytes back")
    p.add_argument("--json", help="write rows, inputs and assumptions here")
    p.add_argument("--output", help="write the markdown tables here")
    p.add_argument("--plot", help="write the PNG here")
    args = p.parse_args(argv)
    args.argv = argv
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.nodes = [int(n) for n in args.nodes.split(",")]
    args.nic_gbps = [float(g) for g in args.nic_gbps.split(",")]
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = [s for s in args.systems if s not in SYSTEM_LABELS]
    if bad:
        p.error(f"--systems: unknown {bad}")
    bad = [m for m in args.models if m not in model_shapes()]
    if bad:
        p.error(f"--models: unknown {bad}")
    return args


def inputs(args):
    """(ops per system, source, measured config or None, reference ranks per node)."""
    if args.measured == "nominal":
        return nominal_ops(), {"nominal": True, "ranks_per_node": 1}, None, 1
    ops, source, config = load_measured(args.measured, args.measured_model, args.measured_precision)
    return ops, source, config, source["ranks_per_node"]


def run(args):
    ops, source, config, ref = inputs(args)
    missing = [s for s in args.systems if s not in ops]
    if missing:
        raise SystemExit(f"no measurement of {missing} in {args.measured}")
    checks = []
    if config is not None:
        for r in config["rows"]:
            if r["system"] not in args.systems:
                continue
            intra, cross = reapply(ops[r["system"]], r["psi"], source["nodes"], source["ranks_per_node"])
            kinds = {k: v for k, v in r["kinds_rank0"].items() if k not in ("control", "total")}
            want_i = sum(v["intra_node_bytes"] for v in kinds.values())
            want_c = sum(v["cross_node_bytes"] for v in kinds.values())
            checks.append({"system": r["system"], "intra": intra, "cross": cross, "measured_intra": want_i,
                           "measured_cross": want_c})
    rows = simulate(ops, args, ref)
    return {"rows": rows, "ops": ops, "source": source, "checks": checks,
            "assumptions": {k: getattr(args, k) for k in ("gpus_per_node", "nic_gbps", "nvlink_gbs", "mfu",
                                                          "peak_tflops", "tokens_per_gpu", "gpu_memory_gb", "nodes",
                                                          "models")},
            "command": "benchmarks/simulate_zero_plus_plus.py " + shlex.join(args.argv)}


def main(argv=None):
    args = parse_args(argv)
    out = run(args)
    text = ops_markdown(out["ops"], out["source"], args.systems) + "\n" + markdown(out["rows"], args, out["source"])
    if args.check or out["checks"]:
        for c in out["checks"]:
            text += (f"\ncheck {c['system']}: sent_bytes on the decomposition gives intra {c['intra']:,.0f} / cross "
                     f"{c['cross']:,.0f} B, measured {c['measured_intra']:,.0f} / {c['measured_cross']:,.0f} B")
        text += "\n"
    from report import write_outputs  # benchmarks/report.py

    write_outputs(text + "\n", out, args.output, args.json)
    if args.plot:
        plot(out["rows"], args, args.plot)
    if args.check:
        bad = [c for c in out["checks"] if abs(c["intra"] - c["measured_intra"]) > 1e-6 * max(1, c["measured_intra"]) + 8
               or abs(c["cross"] - c["measured_cross"]) > 1e-6 * max(1, c["measured_cross"]) + 8]
        if bad:
            raise SystemExit(f"decomposition does not reproduce the measurement: {bad}")
    return out


if __name__ == "__main__":
    main()
