"""Cross-node bytes per training step: plain stage 3, hpZ, hpZ + qwZ + qgZ, FSDP2 HSDP.

One invocation spawns ``nodes x ranks_per_node`` gloo processes (default 2 x 2) on this
host; consecutive global ranks form a simulated node (``ranks_per_node`` in the ZeRO
config, the same layout for FSDP2's mesh).  In those same processes, for every model
(GPT-2 shapes of bench_core: ``25m``, ``100m``) and precision, each system trains the
same model from the same weights on the same batches:

* ``zero3``       plain stage 3 (``{"stage": 3, "ranks_per_node": L}``, defaults otherwise);
* ``zero3_hpz``   + ``secondary_partition: "node"`` (hpZ);
* ``zero3_zpp``   + ``weight_quantization: "int8"`` and ``gradient_quantization: "int4"``
                  (hpZ + qwZ + qgZ);
* ``fsdp2_hsdp``  FSDP2 ``fully_shard`` on every GPT2Block and the root over the 2-D mesh
                  ``init_device_mesh("cpu", (M, L), mesh_dim_names=("replicate", "shard"))``:
                  row n of the mesh = the L ranks of node n, so parameters are sharded
                  inside a node and replicated across nodes (HSDP).

What is counted, per rank and step, over the steps after ``--warmup`` (each step alike):
ours from ``engine.comm_report()``; FSDP2's by wrapping torch.distributed's collectives
(``all_gather_single`` / ``reduce_scatter_single`` / ``all_reduce`` are what FSDP2 calls in
this torch, the older names and list variants are wrapped too) and passing each call's
group and full-tensor bytes to the SAME function the engine uses,
``zero_strategy.communication.topology.sent_bytes`` ([Note: direct-exchange bytes]).
Steps/s beside it are measured on a shared 2-core CPU host: report only.

    .venv/bin/python benchmarks/bench_cross_node.py                         # 25m + 100m, bf16 + fp32
    .venv/bin/python benchmarks/bench_cross_node.py --models 25m --precisions bf16 --systems zero3,zero3_zpp
    .venv/bin/python benchmarks/bench_cross_node.py --json docs/benchmarks/zero_plus_plus/cross_node.json

The docs page (docs/benchmarks/zero_plus_plus.md) is written by ``zero_plus_plus_page.py``
from the saved JSON.
"""
from __future__ import annotations

import argparse
import datetime
import inspect
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

import systems as S  # noqa: E402  (benchmarks/ is not a package)

ZPP = {"secondary_partition": "node", "weight_quantization": "int8", "gradient_quantization": "int4"}
SYSTEMS = {
    "zero3": ("(a) plain stage 3", {}),
    "zero3_hpz": ("(b) stage 3 + hpZ", {"secondary_partition": "node"}),
    "zero3_zpp": ("(c) hpZ + qwZ int8 + qgZ int4", ZPP),
    "fsdp2_hsdp": ("(d) FSDP2 HSDP (replicate x shard)", None),
}
DEFAULT_SYSTEMS = tuple(SYSTEMS)


# ---------------------------------------------------------------------------------------
# FSDP2's collectives, counted with the engine's accounting function
# ---------------------------------------------------------------------------------------
# torch.distributed name -> (kind for sent_bytes, the argument holding the full tensor).
_WRAPPED = {
    "all_gather_single": ("all_gather", "output_tensor"),
    "all_gather_into_tensor": ("all_gather", "output_tensor"),
    "_all_gather_base": ("all_gather", "output_tensor"),
    "all_gather": ("all_gather", "tensor_list"),
    "reduce_scatter_single": ("reduce_scatter", "input"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "_reduce_scatter_base": ("reduce_scatter", "input"),
    "reduce_scatter": ("reduce_scatter", "input_list"),
    "all_reduce": ("all_reduce", "tensor"),
    "broadcast": ("broadcast", "tensor"),
    "all_to_all_single": ("all_to_all", "input"),
}


def _nbytes(x) -> int:
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return x.numel() * x.element_size()


def _numel(x) -> int:
    if isinstance(x, (list, tuple)):
        return sum(t.numel() for t in x)
    return x.numel()


class DirectExchangeCounter:
    """Wraps torch.distributed's collectives while installed; every outermost call adds
    (calls, elements, bytes, intra_node_bytes, cross_node_bytes) to its kind, the split
    from ``topology.sent_bytes`` with the call's own group (``engine.comm_report()``'s
    fields).  Also keeps each call's (kind, group size, members on other nodes, bytes) in
    ``calls`` for the simulation's per-level decomposition."""

    def __init__(self, topology, rank):
        self.topology, self.rank = topology, rank
        self.kinds, self.calls = {}, []
        self._depth, self._saved, self._placements = 0, [], {}

    def install(self):
        import torch.distributed.distributed_c10d as c10d

        for module in (dist, c10d):
            for name, (kind, arg) in _WRAPPED.items():
                fn = getattr(module, name, None)
                if fn is None or getattr(fn, "_xnode_counted", False):
                    continue
                self._saved.append((module, name, fn))
                setattr(module, name, self._wrap(fn, kind, arg))
        return self

    def uninstall(self):
        for module, name, fn in reversed(self._saved):
            setattr(module, name, fn)
        self._saved = []

    def reset(self):
        self.kinds, self.calls = {}, []

    def _placement(self, group):
        from zero_strategy.communication.topology import GroupPlacement

        key = id(group)
        if key not in self._placements:
            ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
            self._placements[key] = (group, GroupPlacement.of(self.topology, ranks, self.rank))
        return self._placements[key][1]

    def _wrap(self, fn, kind, arg):
        from zero_strategy.communication.topology import sent_bytes

        signature = inspect.signature(fn)

        def wrapper(*args, **kwargs):
            outer = self._depth == 0
            self._depth += 1
            try:
                if outer:
                    bound = signature.bind(*args, **kwargs).arguments
                    full = bound[arg]
                    place = self._placement(bound.get("group"))
                    nbytes = _nbytes(full)
                    if kind == "all_to_all":
                        # equal splits assumed (FSDP2 does not call it); this rank's own chunk stays
                        share = nbytes / place.size
                        sent = (round(share * (place.size - 1 - place.members_elsewhere)),
                                round(share * place.members_elsewhere))
                    else:
                        is_source = True
                        if kind == "broadcast":
                            src = bound.get("src")
                            is_source = src is None or src == self.rank
                        sent = sent_bytes(kind, nbytes, place, is_source)
                    t = self.kinds.setdefault(kind, dict(calls=0, elements=0, bytes=0, intra_node_bytes=0,
                                                         cross_node_bytes=0))
                    t["calls"] += 1
                    t["elements"] += _numel(full)
                    t["bytes"] += nbytes
                    t["intra_node_bytes"] += sent[0]
                    t["cross_node_bytes"] += sent[1]
                    self.calls.append((kind, place.size, place.members_elsewhere, nbytes))
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1

        wrapper._xnode_counted = True
        return wrapper

    def as_dict(self):
        out = {k: dict(v) for k, v in self.kinds.items()}
        out["total"] = {"intra_node_bytes": sum(v["intra_node_bytes"] for v in self.kinds.values()),
                        "cross_node_bytes": sum(v["cross_node_bytes"] for v in self.kinds.values())}
        return out


# ---------------------------------------------------------------------------------------
# systems
# ---------------------------------------------------------------------------------------
class ZeroPP:
    """zero_strategy stage 3 with ``ranks_per_node`` and the system's ZeRO++ options."""

    def __init__(self, args, name):
        import zero_strategy

        self.model = S.build_model(args)
        self.psi = S.trainable_numel(self.model)
        self.optimizer = S.make_optimizer(self.model.parameters(), args)
        config = {"stage": 3, "precision": args.precision, "ranks_per_node": args.ranks_per_node}
        config.update(SYSTEMS[name][1])
        config.update(args.zero_config or {})
        self.config = config
        self.engine = zero_strategy.initialize(self.model, self.optimizer, config)
        # The plan with the default persistence threshold: which elements are partitioned
        # (gathered per unit) and which stay whole on every rank.
        try:
            units = list(self.engine.units)
            self.config["plan"] = {
                "partitioned_units": sum(1 for u in units if not u.keep_full),
                "partitioned_numel": sum(u.layout.numel for u in units if not u.keep_full),
                "whole_units": sum(1 for u in units if u.keep_full),
                "whole_numel": sum(u.layout.numel for u in units if u.keep_full),
            }
        except AttributeError:  # the engine's internals changed: the plan is only informative
            pass

    def train_step(self, x):
        loss = self.model(input_ids=x, labels=x).loss
        self.engine.backward(loss)
        self.engine.step()
        return loss.detach()

    def reset_comm(self):
        self.engine.reset_comm_report()

    def comm(self):
        report = self.engine.comm_report().as_dict()
        report.pop("paper_volume", None)
        return report

    def close(self):
        self.engine.close()
        del self.engine, self.model, self.optimizer


def hsdp_mesh(nodes, ranks_per_node):
    """The HSDP mesh: dim 0 replicates across nodes, dim 1 shards inside one.  Its
    layout is ``arange(world).view(nodes, ranks_per_node)``, so row n holds ranks
    n*L .. n*L+L-1: node n's ranks (checked by the caller)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (nodes, ranks_per_node), mesh_dim_names=("replicate", "shard"))


class FSDP2HSDP:
    def __init__(self, args, name, counter):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        self.model = S.build_model(args)
        self.psi = S.trainable_numel(self.model)
        mesh = hsdp_mesh(args.nodes, args.ranks_per_node)
        rows = mesh.mesh.tolist()
        want = [list(range(n * args.ranks_per_node, (n + 1) * args.ranks_per_node)) for n in range(args.nodes)]
        if rows != want:
            raise RuntimeError(f"HSDP mesh rows {rows} are not the nodes {want}")
        self.config = {"mesh": rows, "mesh_dim_names": ["replicate", "shard"]}
        if args.precision == "bf16":  # as bench_core's fsdp2 systems: bf16 params and reductions
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        else:
            policy = MixedPrecisionPolicy()
        for block in self.model.transformer.h:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(self.model, mesh=mesh, mp_policy=policy)
        self.optimizer = S.make_optimizer(self.model.parameters(), args)
        self.counter = counter

    def train_step(self, x):
        loss = self.model(input_ids=x, labels=x).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return loss.detach()

    def reset_comm(self):
        self.counter.reset()

    def comm(self):
        return self.counter.as_dict()

    def close(self):
        del self.model, self.optimizer


# ---------------------------------------------------------------------------------------
# worker
# ---------------------------------------------------------------------------------------
def model_args(args, model, precision):
    ns = argparse.Namespace(**vars(args))
    ns.model, ns.precision = model, precision
    for key, value in S.PRESETS[model].items():
        override = getattr(args, key.replace("-", "_"), None)
        setattr(ns, key, override if override is not None else value)
    return ns


def run_one(name, ns, rank, batches, counter):
    dist.barrier()
    t0 = time.perf_counter()
    system = FSDP2HSDP(ns, name, counter) if name == "fsdp2_hsdp" else ZeroPP(ns, name)
    build_s = time.perf_counter() - t0
    times, losses, per_step = [], [], []
    for step in range(ns.warmup + ns.steps):
        system.reset_comm()
        if name == "fsdp2_hsdp":
            counter.calls = []
        dist.barrier()
        t0 = time.perf_counter()
        loss = system.train_step(batches[step])
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if step >= ns.warmup:
            per_step.append(system.comm())
    calls = list(counter.calls) if name == "fsdp2_hsdp" else None
    config = system.config
    system.close()
    del system
    return {"psi": None, "times": times, "losses": losses,
            "comm_per_step": per_step, "build_s": build_s, "config": config, "fsdp2_last_step_calls": calls}


def worker_main(rank, world_size, store_path, args, queue):
    from spawn import worker_session  # benchmarks/spawn.py
    from zero_strategy.communication.topology import Topology

    env = dict(RANK=str(rank), LOCAL_RANK=str(rank % args.ranks_per_node), WORLD_SIZE=str(world_size))
    with worker_session(rank, world_size, store_path, queue, threads=args.threads, env=env) as send:
        counter = DirectExchangeCounter(Topology(world_size, args.ranks_per_node), rank)
        results = {}
        for model in args.models:
            for precision in args.precisions:
                ns = model_args(args, model, precision)
                g = torch.Generator().manual_seed(ns.seed * 1000 + rank)
                batches = torch.randint(0, ns.vocab, (ns.warmup + ns.steps, ns.micro_batch, ns.seq), generator=g)
                psi = S.trainable_numel(S.build_model(ns))
                for name in args.systems:
                    if name == "fsdp2_hsdp":
                        counter.reset()
                        counter.install()
                    try:
                        run = run_one(name, ns, rank, batches, counter)
                    finally:
                        if name == "fsdp2_hsdp":
                            counter.uninstall()
                    run["psi"] = psi
                    results[(model, precision, name)] = run
                    if rank == 0:
                        queue.put((rank, "progress", f"{model} {precision} {name}: "
                                   f"{statistics.median(run['times'][ns.warmup:]):.2f} s/step"))
                    dist.barrier()
        send({"results": results, "threads": torch.get_num_threads()})


# ---------------------------------------------------------------------------------------
# summary
# ---------------------------------------------------------------------------------------
def _kinds_of(step):
    return {k: v for k, v in step.items() if k != "total"}


def summarize(args, per_rank, threads, wall_s, load_before, load_after):
    """json-serialisable: per (model, precision) the systems' rows."""
    configs = []
    for model in args.models:
        for precision in args.precisions:
            ns = model_args(args, model, precision)
            rows = []
            for name in args.systems:
                runs = [r[(model, precision, name)] for r in per_rank]
                psi = runs[0]["psi"]
                steps = len(runs[0]["comm_per_step"])
                # Bytes per step of each rank, averaged over the measured steps; every
                # measured step must move the same bytes (checked: "steps_equal").
                def per_rank_totals(run, key):
                    return [s["total"][key] for s in run["comm_per_step"]]

                cross = [statistics.mean(per_rank_totals(r, "cross_node_bytes")) for r in runs]
                intra = [statistics.mean(per_rank_totals(r, "intra_node_bytes")) for r in runs]
                steps_equal = all(len(set(per_rank_totals(r, k))) == 1 for r in runs
                                  for k in ("cross_node_bytes", "intra_node_bytes"))
                kinds = {}
                for k, v in _kinds_of(runs[0]["comm_per_step"][-1]).items():
                    kinds[k] = {f: v[f] for f in ("calls", "elements", "bytes", "intra_node_bytes",
                                                  "cross_node_bytes")}
                    kinds[k]["bits_per_element"] = 8 * v["bytes"] / v["elements"] if v["elements"] else 0.0
                    kinds[k]["elements_per_psi"] = v["elements"] / psi
                timed = [max(r["times"][i] for r in runs) for i in range(args.warmup, args.warmup + steps)]
                median = statistics.median(timed)
                rows.append({
                    "system": name,
                    "label": SYSTEMS[name][0],
                    "config": runs[0]["config"],
                    "psi": psi,
                    "cross_node_bytes": max(cross),
                    "intra_node_bytes": max(intra),
                    "cross_node_bytes_per_rank": cross,
                    "intra_node_bytes_per_rank": intra,
                    "steps_equal": steps_equal,
                    "kinds_rank0": kinds,
                    "median_step_s": median,
                    "steps_per_s": 1.0 / median,
                    "step_times": timed,
                    "losses_rank0": runs[0]["losses"],
                    "build_s": max(r["build_s"] for r in runs),
                    "fsdp2_calls_rank0": runs[0]["fsdp2_last_step_calls"],
                })
            plain = next((r for r in rows if r["system"] == "zero3"), None)
            for r in rows:
                r["cross_vs_plain"] = r["cross_node_bytes"] / plain["cross_node_bytes"] if plain else None
                r["intra_vs_plain"] = r["intra_node_bytes"] / plain["intra_node_bytes"] if plain else None
            configs.append({
                "model": model, "precision": precision, "psi": rows[0]["psi"] if rows else None,
                "n_layer": ns.n_layer, "n_embd": ns.n_embd, "n_head": ns.n_head, "vocab": ns.vocab,
                "seq": ns.seq, "micro_batch": ns.micro_batch, "rows": rows,
                "targets": check_targets(rows),
            })
    return {
        "command": "benchmarks/bench_cross_node.py " + shlex.join(args.argv),
        "nodes": args.nodes, "ranks_per_node": args.ranks_per_node, "world_size": args.world_size,
        "steps": args.steps, "warmup": args.warmup, "threads_per_rank": threads, "lr": args.lr,
        "torch": torch.__version__,
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "cores": os.cpu_count(), "loadavg_before": load_before, "loadavg_after": load_after,
        "wall_s": wall_s, "configs": configs,
    }


def check_targets(rows):
    """(c) <= 0.25x plain stage 3's cross-node bytes, and below HSDP's."""
    by = {r["system"]: r for r in rows}
    out = []
    zpp, plain, hsdp = by.get("zero3_zpp"), by.get("zero3"), by.get("fsdp2_hsdp")
    if zpp and plain:
        ratio = zpp["cross_node_bytes"] / plain["cross_node_bytes"]
        out.append({"target": "(c) cross-node bytes <= 0.25 x plain stage 3", "value": ratio, "ok": ratio <= 0.25})
    if zpp and hsdp:
        ratio = zpp["cross_node_bytes"] / hsdp["cross_node_bytes"]
        out.append({"target": "(c) cross-node bytes below FSDP2 HSDP", "value": ratio, "ok": ratio < 1.0})
    return out


# ---------------------------------------------------------------------------------------
# tables
# ---------------------------------------------------------------------------------------
KIND_NAMES = {"all_gather": "AG", "reduce_scatter": "RS", "reduce_scatter_cross_node": "RS x-node a2a",
              "all_reduce": "AR", "broadcast": "bcast", "control": "ctl", "all_to_all": "a2a"}


def _mb(v):
    return f"{v / 1e6:,.2f}"


def kinds_text(kinds):
    parts = []
    for k, v in kinds.items():
        if not v["elements"]:
            continue
        parts.append(f"{KIND_NAMES.get(k, k)} {v['bits_per_element']:.3g} b/el x {v['elements_per_psi']:.2f}Ψ")
    return "; ".join(parts)


def markdown_config(summary, c):
    lines = [
        f"**{c['model']}** ({c['psi'] / 1e6:.1f}M parameters, {c['n_layer']} layers x {c['n_embd']}), "
        f"{c['precision']}, {summary['nodes']} nodes x {summary['ranks_per_node']} ranks, "
        f"{c['micro_batch']} x {c['seq']} tokens per rank per step",
        "",
        "| system | cross-node MB / step / rank | intra-node MB / step / rank | cross vs plain | "
        "intra vs plain | steps/s | bits per element x elements per step, by kind |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in c["rows"]:
        flag = "" if r["steps_equal"] else " (steps differ)"
        lines.append(
            f"| {r['label']} | {_mb(r['cross_node_bytes'])}{flag} | {_mb(r['intra_node_bytes'])} | "
            f"{r['cross_vs_plain']:.3f} | {r['intra_vs_plain']:.3f} | {r['steps_per_s']:.2f} | "
            f"{kinds_text(r['kinds_rank0'])} |")
    lines.append("")
    for t in c["targets"]:
        lines.append(f"- {t['target']}: {t['value']:.3f} {'OK' if t['ok'] else 'MISSED'}")
    return "\n".join(lines) + "\n"


def markdown(summary):
    out = []
    for c in summary["configs"]:
        out.append(markdown_config(summary, c))
    out.append(f"{summary['date']}, torch {summary['torch']}, {summary['world_size']} gloo processes on "
               f"{summary['cores']} cores ({summary['threads_per_rank']} thread(s) each), "
               f"{summary['warmup']} warm-up + {summary['steps']} measured steps per system; load average "
               f"{summary['loadavg_before'][0]:.1f} before, {summary['loadavg_after'][0]:.1f} after; "
               f"{summary['wall_s']:.0f} s.\n")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------
def parse_args(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="25m,100m", help="bench_core presets, comma-separated")
    p.add_argument("--precisions", default="bf16,fp32")
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS), help="subset of " + ",".join(SYSTEMS))
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--steps", type=int, default=2, help="measured steps per system (bytes: mean over them)")
    p.add_argument("--warmup", type=int, default=1)
    for name in ("n-layer", "n-embd", "n-head", "vocab", "seq", "micro-batch"):
        p.add_argument(f"--{name}", type=int, default=None, help="override the preset's value")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads per rank (default cores // ranks)")
    p.add_argument("--zero-config", type=json.loads, default=None, help="extra ZeroConfig fields for ours (json)")
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--json", help="write the summary here")
    p.add_argument("--output", help="write the markdown tables here")
    args = p.parse_args(argv)
    args.argv = argv
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.precisions = [x.strip() for x in args.precisions.split(",") if x.strip()]
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    for bad, known, what in ((set(args.models) - set(S.PRESETS), S.PRESETS, "--models"),
                             (set(args.systems) - set(SYSTEMS), SYSTEMS, "--systems"),
                             (set(args.precisions) - {"fp32", "bf16"}, ("fp32", "bf16"), "--precisions")):
        if bad:
            p.error(f"{what}: unknown {sorted(bad)}; choose from {','.join(known)}")
    if args.nodes < 2 or args.ranks_per_node < 1:
        p.error("need --nodes >= 2 and --ranks-per-node >= 1")
    args.world_size = args.nodes * args.ranks_per_node
    if args.threads is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        args.threads = max(1, cores // args.world_size)
    return args


def run(args, progress=None):
    from spawn import run_workers

    t0 = time.perf_counter()
    load_before = os.getloadavg()
    results = run_workers(worker_main, args, "bench_cross_node_", progress)
    per_rank = [r["results"] for r in results]
    return summarize(args, per_rank, results[0]["threads"], time.perf_counter() - t0, load_before, os.getloadavg())


def main(argv=None):
    args = parse_args(argv)

    def progress(line):
        sys.stderr.write(line + "\n")
        sys.stderr.flush()

    summary = run(args, progress)
    from report import write_outputs  # benchmarks/report.py

    write_outputs(markdown(summary) + "\n", summary, args.output, args.json)
    return summary


if __name__ == "__main__":
    main()
