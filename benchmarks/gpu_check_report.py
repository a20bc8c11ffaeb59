"""The markdown page of benchmarks/gpu_check.py's results (from its JSON report)."""
from __future__ import annotations

# Memory figures are printed in GiB; a --tiny rehearsal's in MiB (markdown() switches).
_UNIT = {"name": "GiB", "bytes": 2**30}


def _gib(v):
    return "-" if v is None else f"{v / _UNIT['bytes']:.2f}"


def _num(v, fmt="{:.3f}"):
    return "-" if v is None else fmt.format(v)


def _psi(v):
    return "-" if not v else (f"{v / 1e9:.3f}B" if v >= 1e8 else f"{v / 1e6:.3f}M")


def _errors(part):
    out = []
    if part.get("status", "ok") != "ok":
        out.append(f"**Status:** {part['status']}")
    if part.get("error"):
        out.append("**Error:**\n\n```\n" + part["error"].strip() + "\n```")
    if part.get("note"):
        out.append(f"Note: {part['note']}")
    if part.get("log_tail") and (part.get("status", "ok") != "ok" or part.get("error")):
        out.append("Log tail:\n\n```\n" + part["log_tail"].strip()[-1500:] + "\n```")
    return out


def _rows(part, skip=("status", "error", "note", "log_tail", "part_s", "world_size")):
    return [(k, v) for k, v in part.items() if k not in skip and isinstance(v, dict)]


def stages_table(part, with_time=True):
    head = ["system", "Ψ", "N"]
    if with_time:
        head += ["step s (min of pass medians; min-max of one pass)", "vs torch_amp", "tokens/s", "MFU (6Ψ)",
                 "MFU (6Ψ + attention)"]
    head += ["peak device GiB", "model states GiB", "paper's formula GiB", "estimate, this implementation GiB",
             "peak − estimate GiB (activations, temporaries)"]
    if with_time:
        head += ["max abs Δloss vs torch_amp"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    notes = []
    for name, r in _rows(part):
        if r.get("error") and "psi" not in r:
            notes.append(f"- {name}: " + r["error"].strip().splitlines()[0])
            continue
        cells = [name, _psi(r.get("psi")), str(r.get("world_size", "-"))]
        if with_time:
            step = r.get("step_s")
            cells += [f"{_num(step)} ({_num(r.get('step_min_s'))}-{_num(r.get('step_max_s'))})" if step else "-",
                      _num(r.get("vs_torch_amp")), _num(r.get("tokens_per_s"), "{:,.0f}"),
                      _num(r.get("mfu"), "{:.1%}"), _num(r.get("mfu_with_attention"), "{:.1%}")]
        cells += [_gib(r.get("peak_bytes")), _gib(r.get("model_state_bytes")), _gib(r.get("estimate_formula")),
                  _gib(r.get("estimate_held_during_step")), _gib(r.get("activations_and_temporaries_bytes"))]
        if with_time:
            cells += [_num(r.get("max_abs_loss_diff_vs_torch_amp"), "{:.4f}")]
        lines.append("| " + " | ".join(cells) + " |")
        if r.get("error"):
            notes.append(f"- {name}: " + r["error"].strip().splitlines()[0])
    return "\n".join(lines) + ("\n\n" + "\n".join(notes) if notes else "")


def activations_table(part):
    head = ["stage", "activations", "held after forward GiB", "saving vs none", "peak of a step GiB", "step s",
            "losses (first, last)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    rows = dict(_rows(part))
    notes = []
    for key, r in rows.items():
        if r.get("error"):
            notes.append(f"- {key}: " + r["error"].strip().splitlines()[0])
            continue
        none = rows.get(f"stage{r['stage']}_none", {}).get("held_after_forward_bytes")
        saving = "-" if not none else f"{1 - r['held_after_forward_bytes'] / none:.1%}"
        losses = r.get("losses") or []
        shown = f"{losses[0]:.4f}, {losses[-1]:.4f}" if losses else "-"
        lines.append(f"| {r['stage']} | {r['config']} | {_gib(r['held_after_forward_bytes'])} | {saving} "
                     f"| {_gib(r['peak_step_bytes'])} | {_num(r['step_s'])} | {shown} |")
    return "\n".join(lines) + ("\n\n" + "\n".join(notes) if notes else "")


def offload_section(part):
    lines = []
    m = part.get("model")
    if m:
        lines.append(f"Llama-shaped, Ψ = {_psi(m.get('psi'))} ({m.get('layers')} layers, hidden {m.get('hidden')}, "
                     f"intermediate {m.get('intermediate')}), config `{part.get('config')}`, built in "
                     f"`zero_strategy.init_context()`; `initialize` took {_num(part.get('initialize_s'), '{:.1f}')} s.")
    exp = part.get("expected")
    if exp:
        lines.append(f"Expected: device {_gib(exp['device_bytes'])} GiB (2Ψ/N bf16 shard), host "
                     f"{_gib(exp['host_bytes'])} GiB (16Ψ/N: fp32 master, fp32 gradient shard, Adam's moments); "
                     f"the paper's stage-3 total {_gib(exp['formula_total'])} GiB.")
    lines.append(f"Host MemAvailable at start {_gib(part.get('host_mem_available_bytes'))} GiB, needed (with the "
                 f"pinned allocator's rounding) {_gib(part.get('host_bytes_needed'))} GiB; pinned rounding above "
                 f"64 MiB switched off: {part.get('pinned_rounding_limited')}.")
    after = part.get("after_initialize")
    if after:
        rep = after["memory_report"]
        lines.append(f"After initialize: RSS +{_gib(after['rss_bytes'])} GiB, device allocated "
                     f"{_gib(after['device_allocated_bytes'])} GiB; memory_report device {_gib(rep.get('device'))} / "
                     f"host {_gib(rep.get('host'))} GiB.")
    steps = part.get("steps") or []
    if steps:
        lines += ["", "| step | host_optimizer_step | step s | forward+backward s | optimizer step s | loss | device peak GiB "
                      "| host peak RSS growth GiB | host RSS growth GiB | memory_report device / host GiB |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for s in steps:
            rep = s["memory_report"]
            lines.append(f"| {s['step']} | {s.get('host_optimizer_step', 'optimizer')} | {_num(s['step_s'], '{:.2f}')} "
                         f"| {_num(s['forward_backward_s'], '{:.2f}')} "
                         f"| {_num(s['optimizer_step_s'], '{:.2f}')} | {s['loss']:.4f} | {_gib(s['device_peak_bytes'])} "
                         f"| {_gib(s['host_peak_rss_bytes'])} | {_gib(s['host_rss_bytes'])} "
                         f"| {_gib(rep.get('device'))} / {_gib(rep.get('host'))} |")
    return "\n\n".join(lines[:4]) + ("\n" + "\n".join(lines[4:]) if len(lines) > 4 else "")


def _safe(render, part):
    """A rendering bug must not lose the figures: fall back to the part's raw JSON."""
    try:
        return render(part)
    except Exception as exc:  # noqa: BLE001
        import json

        return (f"(rendering failed: {type(exc).__name__}: {exc}; the raw results follow)\n\n```\n"
                + json.dumps(part, indent=1, default=str)[:6000] + "\n```")


def markdown(report):
    _UNIT.update(name="MiB", bytes=2**20) if report["tiny"] else _UNIT.update(name="GiB", bytes=2**30)
    text = _markdown(report)
    return text.replace("GiB", "MiB") if report["tiny"] else text


def _markdown(report):
    env = report["environment"]
    shapes = report["shapes"]
    g = shapes["gpt"]
    out = [
        "# GPU check",
        "",
        f"{report['started']}; device `{report['device']}`"
        + (f" ({env.get('gpu')}, {_gib(env.get('gpu_memory_bytes'))} GiB, capability {env.get('capability')}, "
           f"{env.get('gpu_count')} visible)" if env.get("gpu") else "")
        + f"; torch {env['torch']} (CUDA {env['torch_cuda']}, NCCL {env.get('nccl', '-')}), transformers "
        f"{env['transformers']}, Python {env['python']}, {env['cpu_count']} CPUs, host MemAvailable "
        f"{_gib(env.get('host_mem_available_bytes'))} GiB."
        + (" **Tiny shapes (a rehearsal of the code path, not a measurement).**" if report["tiny"] else "")
        + (" On CPU the memory figures are resident-set stand-ins (VmRSS / VmHWM), not allocator counts."
           if report["device"] == "cpu" else ""),
        "",
        f"Models: {report.get('models', '-')}. GPT-2 model: {g['n_layer']} layers × {g['n_embd']} wide, vocab {g['vocab_size']}, batch "
        f"{shapes['batch']} × sequence {shapes['seq']} = {shapes['batch'] * shapes['seq']} tokens per step, "
        f"{shapes['warmup']} warm-up + {shapes['steps']} timed steps per pass. MFU = 6 · Ψ · tokens / step time / "
        f"{report['peak_flops'] / 1e12:.0f} TFLOPS (dense bf16 peak used; H200/H100 SXM = 989); the second MFU "
        "adds PaLM's attention term 12 · layers · width · sequence per token. Recomputation is not counted.",
        "",
    ]
    tests = report.get("tests")
    if tests:
        out += ["## tests/core/test_gpu.py (-m gpu)", "", f"exit status {tests['rc']}", "", "```", tests["tail"], "```", ""]
    parts = report["parts"]
    if "stages" in parts:
        p = parts["stages"]
        backend = "gloo" if report["device"] == "cpu" else "NCCL"
        out += [f"## Step time, MFU and peak memory per stage (world size 1, {backend})", "",
                "`torch_amp`: plain PyTorch, fp32 parameters + `torch.autocast(bfloat16)` + `torch.optim.AdamW` "
                "(the same arithmetic as ZeRO bf16: bf16 compute, fp32 master and Adam state) - the fair baseline "
                "for the hook overhead. `torch_bf16`: bf16 parameters and AdamW on them (no master copy), a lower "
                "bound. `zeroS`: `zero_strategy.initialize(model, AdamW, {stage: S, precision: bf16})`; "
                "`zero3_thr0` adds `param_persistence_threshold: 0`. At N = 1 the paper's formula is 16Ψ for every "
                "stage; the estimate is `zero_strategy.estimate(...).held_during_step` with this plan's "
                "units, buckets and gathered blocks. Peak = `torch.cuda.max_memory_allocated` over one step, "
                "minus what was allocated before the model was built.", ""]
        out += _errors(p) + [_safe(stages_table, p), ""]
    if "memory_at_n" in parts:
        p = parts["memory_at_n"]
        out += [f"## Peak memory of one rank of N = {p.get('world_size', '?')} (fake process group)", "",
                "The same configurations as rank 0 of torch's fake process group: collectives do nothing, so "
                "values are meaningless and no time is reported, but every buffer one rank of N would allocate "
                "is allocated. Here the formula differs by stage.", ""]
        out += _errors(p) + [_safe(lambda q: stages_table(q, with_time=False), p), ""]
    if "activations" in parts:
        p = parts["activations"]
        out += ["## Activation checkpointing and its host offload", "",
                "Same GPT-2 and batch. *Held after forward*: device memory allocated after forward minus before "
                "it (what waits for backward). `checkpointing` = `activation_checkpointing: [auto]` (GPT2Block); "
                "`+offload` adds `offload_activations: true` (block inputs in pinned host memory).", ""]
        out += _errors(p) + [_safe(activations_table, p), ""]
    if "offload" in parts:
        p = parts["offload"]
        out += ["## Optimizer offload of a ~7B model (`offload_optimizer: cpu`)", ""]
        out += _errors(p) + [_safe(offload_section, p), ""]
    out += ["## Parts", "", "| part | status | seconds |", "|---|---|---|"]
    out += [f"| {k} | {v.get('status', 'ok')}{' (error)' if v.get('error') else ''} | {_num(v.get('part_s'), '{:.0f}')} |"
            for k, v in parts.items()]
    out += ["", f"Total {report.get('total_s', 0):.0f} s of a {report['budget_s']:.0f} s budget.", ""]
    return "\n".join(out)
