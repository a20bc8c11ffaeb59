"""One-shot GPU check (issue #17): the CUDA/NCCL paths measured at world size 1.

Run by benchmarks/gpu_check.sh after tests/core/test_gpu.py. Each part (see
gpu_check_parts.py) runs in its own subprocess with its own time limit, so a crash, a
CUDA out-of-memory or a host OOM kill in one part still leaves the others' figures; each
part saves its results as it goes, so a part stopped by its limit keeps what it measured.
The report is written to ``$OUT`` (default ./gpu_check_out) as gpu_check.md and
gpu_check.json, and printed.

    bash benchmarks/gpu_check.sh                                   # the GPU machine, < 8 min
    .venv/bin/python benchmarks/gpu_check.py --device cpu --tiny   # the same code path on CPU
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, REPO)

# Seconds per part with full shapes: (most it may take, least kept free for it while the
# parts before it run). Measured on one H200 (2026-12-04): stages 51 s, activations 20 s,
# memory_at_n 14 s, offload 98 s.
PART_LIMITS = {"stages": (170, 60), "activations": (80, 30), "memory_at_n": (60, 20), "offload": (240, 90)}
TINY_LIMITS = {name: (120, 10) for name in PART_LIMITS}
GIB = 2**30


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="default: cuda when available, else cpu")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (a rehearsal of the code path, e.g. on CPU)")
    p.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_out", help="output directory (default $OUT)")
    p.add_argument("--parts", default="stages,activations,memory_at_n,offload")
    p.add_argument("--budget", type=float, default=400.0, help="seconds for all parts together")
    p.add_argument("--no-isolate", dest="isolate", action="store_false",
                   help="run the parts in this process (faster start; one crash ends the check)")
    p.add_argument("--repeats", type=int, default=2, help="passes over the stage systems (A B ... then reversed)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="dense bf16 peak for MFU (default 989: H200/H100 SXM; H200 NVL: 835)")
    p.add_argument("--models", choices=("auto", "transformers", "builtin"), default="auto",
                   help="transformers' GPT-2 / Llama (auto: when installed) or the pure-torch stand-ins")
    p.add_argument("--tests-log", help="pytest output of tests/core/test_gpu.py (from gpu_check.sh)")
    p.add_argument("--tests-rc", help="its exit status")
    # Internal: one part in this process (what the isolating parent runs).
    p.add_argument("--part", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.parts = [s.strip() for s in args.parts.split(",") if s.strip()]
    bad = [s for s in args.parts if s not in PART_LIMITS]
    if bad:
        p.error(f"unknown part(s) {bad}; choose from {','.join(PART_LIMITS)}")
    return args


def resolve_device(args):
    import torch

    name = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch.cuda.is_available() is False (torch "
                         f"{torch.__version__}, built for CUDA {torch.version.cuda}); use --device cpu --tiny to rehearse")
    return torch.device("cuda", 0) if name == "cuda" else torch.device("cpu")


def make_context(args, deadline):
    import gpu_check_parts as parts

    ctx = parts.Context(resolve_device(args), parts.shapes_for(args.tiny, args.models), deadline, repeats=args.repeats)
    if args.peak_tflops:
        ctx.peak_flops = args.peak_tflops * 1e12
    return ctx


def _write_json(path, data):
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(tmp, path)  # a part killed mid-write leaves the previous complete file


def run_part_here(args, name, deadline, result_path=None):
    """Run one part in this process; its results (also on error) as a dict."""
    import gpu_check_parts as parts

    data = {}

    def record(key, value):
        data[key] = value
        if result_path:
            _write_json(result_path, data)
        # One line per result in the part's log: where the time went, what failed.
        brief = {k: v for k, v in value.items() if k in ("step_s", "peak_bytes", "error", "step")} \
            if isinstance(value, dict) else value
        sys.stderr.write(f"[{time.strftime('%H:%M:%S')}] {name}.{key}: {str(brief)[:300]}\n")

    t0 = time.time()
    import torch

    threads = torch.get_num_threads()
    try:
        ctx = make_context(args, deadline)
        if ctx.device.type == "cpu" and args.tiny:
            # Tiny shapes gain nothing from intra-op threads, which spin-wait badly on a
            # loaded machine (a 2-layer model's backward took ~1 s with 2 threads under load).
            torch.set_num_threads(1)
        parts.PARTS[name](ctx, record)
    except Exception as exc:  # noqa: BLE001 - reported, the other parts still run
        record("error", parts.error_text(exc))
    finally:
        torch.set_num_threads(threads)
    record("part_s", time.time() - t0)
    return data


def run_part_isolated(args, name, limit_s, out_dir):
    result = os.path.join(out_dir, f"part_{name}.json")
    log = os.path.join(out_dir, f"part_{name}.log")
    if os.path.exists(result):
        os.remove(result)
    # Stop starting new configurations 15 s before the hard limit (model builds take that).
    deadline = time.time() + max(5.0, limit_s - 15)
    cmd = [sys.executable, os.path.abspath(__file__), "--part", name, "--result", result, "--deadline", str(deadline),
           "--repeats", str(args.repeats), "--models", args.models]
    cmd += ["--tiny"] if args.tiny else []
    cmd += ["--device", args.device] if args.device else []
    cmd += ["--peak-tflops", str(args.peak_tflops)] if args.peak_tflops else []
    t0 = time.time()
    status = "ok"
    with open(log, "w", encoding="utf-8") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=limit_s, cwd=REPO).returncode
            if rc != 0:
                status = f"exited with status {rc}" + (" (killed: out of host memory?)" if rc in (-9, 137) else "")
        except subprocess.TimeoutExpired:
            status = f"stopped at its {limit_s:.0f} s limit"
    data = {}
    if os.path.exists(result):
        with open(result, encoding="utf-8") as f:
            data = json.load(f)
    data["status"] = status
    data.setdefault("part_s", time.time() - t0)
    if status != "ok" or "error" in data:
        with open(log, encoding="utf-8", errors="replace") as f:
            data["log_tail"] = f.read()[-2500:]
    return data


def environment(args):
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "cuda_available": torch.cuda.is_available(), "cpu_count": os.cpu_count(), "device": args.device or "auto"}
    for mod in ("transformers", "pytest", "yaml", "safetensors"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception as exc:  # noqa: BLE001
            env[mod] = f"missing ({type(exc).__name__})"
    if torch.cuda.is_available():
        # Properties only: no allocation, so no CUDA context is held while the parts run.
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, gpu_memory_bytes=props.total_memory, gpu_count=torch.cuda.device_count(),
                   capability=f"{props.major}.{props.minor}")
        try:
            v = torch.cuda.nccl.version()  # a tuple, or one integer (2.18.3 = 21803) in older torch
            env["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception as exc:  # noqa: BLE001
            env["nccl"] = f"unknown ({exc})"
    import gpu_check_parts as parts

    env["host_mem_available_bytes"] = parts.mem_available_bytes()
    return env


def main(argv=None):
    args = parse_args(argv)
    if args.part:  # child mode
        run_part_here(args, args.part, args.deadline or time.time() + 600, args.result)
        return 0
    t_start = time.time()
    out_dir = os.path.abspath(args.out)
    os.makedirs(out_dir, exist_ok=True)
    import gpu_check_parts as parts

    report = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "environment": environment(args),
              "tiny": args.tiny, "isolated": args.isolate, "budget_s": args.budget, "parts": {}}
    ctx_preview = make_context(args, 0)
    report["device"] = str(ctx_preview.device)
    report["peak_flops"] = ctx_preview.peak_flops
    report["shapes"] = vars(ctx_preview.shapes)
    import gpu_check_models

    report["models"] = gpu_check_models.implementation_name(args.models)
    report["tests"] = tests_summary(args)
    limits = TINY_LIMITS if args.tiny else PART_LIMITS
    order = [p for p in parts.PART_ORDER if p in args.parts]
    deadline = t_start + args.budget
    for i, name in enumerate(order):
        left = deadline - time.time()
        keep_free = sum(limits[p][1] for p in order[i + 1:])
        limit = min(limits[name][0], left - keep_free)
        if limit < min(limits[name][1], 20):
            report["parts"][name] = {"status": f"not run: {left:.0f} s of the budget left"}
            continue
        sys.stderr.write(f"gpu_check: part {name} (up to {limit:.0f} s)\n")
        if args.isolate:
            data = run_part_isolated(args, name, limit, out_dir)
        else:
            data = run_part_here(args, name, time.time() + limit)
            data["status"] = "ok"
        report["parts"][name] = data
        report["total_s"] = time.time() - t_start
        write_report(report, out_dir)  # after every part: a check stopped from outside keeps the rest
    report["total_s"] = time.time() - t_start
    text = write_report(report, out_dir)
    sys.stdout.write(text)
    sys.stdout.write(f"\n(written to {out_dir}/gpu_check.md and gpu_check.json)\n")
    return 0


def write_report(report, out_dir) -> str:
    _write_json(os.path.join(out_dir, "gpu_check.json"), report)  # first: the figures themselves
    try:
        import gpu_check_report

        text = gpu_check_report.markdown(report)
    except Exception as exc:  # noqa: BLE001 - the JSON above still holds everything
        text = f"# GPU check\n\nThe page could not be rendered ({type(exc).__name__}: {exc}); see gpu_check.json.\n"
    with open(os.path.join(out_dir, "gpu_check.md"), "w", encoding="utf-8") as f:
        f.write(text)
    return text


def tests_summary(args):
    if not args.tests_log:
        return None
    tail = ""
    if os.path.exists(args.tests_log):
        with open(args.tests_log, encoding="utf-8", errors="replace") as f:
            lines = [line.rstrip() for line in f if line.strip()]
        tail = "\n".join(lines[-15:])
    return {"rc": args.tests_rc, "log": args.tests_log, "tail": tail}


if __name__ == "__main__":
    sys.exit(main())
