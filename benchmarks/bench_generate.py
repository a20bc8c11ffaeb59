"""generate() throughput: DDP, zero_strategy stage 2, stage 3, and stage 3 kept gathered.

Every system greedily generates the same number of new tokens from the same prompts with
the same tiny Llama or GPT-2 (transformers ``LlamaConfig`` / ``GPT2Config``, ``--model``,
built locally from a seed), one after
the other inside the SAME spawned gloo worker processes; the systems run in a different
order on each repeat (odd repeats reversed), so load from other processes is spread over
all of them.  Per system: tokens/s (new tokens of the whole batch divided by the slowest
rank's time; the fastest of ``--calls`` calls in a repeat) as min / median / max over
the repeats, the median's ratio to stage 2 and the median of the ratios within each
repeat (the systems of one repeat run back to back, under about the same load),
all-gather calls and bytes per generate() (zero_strategy's own count: the output
buffers, so the whole gathered tensor per call), and whether the tokens are
exactly the single-process model's.

    .venv/bin/python benchmarks/bench_generate.py                 # 2 ranks, 64 new tokens, 5 repeats
    .venv/bin/python benchmarks/bench_generate.py --repeats 9 --layers 8 --json out.json
    .venv/bin/python benchmarks/bench_generate.py --model gpt2 --layers 4 --hidden 256 --vocab 5000 \
        --new-tokens 20 --systems ddp,zero3_default,zero3_default_lockstep

Systems: ``ddp`` (``DistributedDataParallel``; generate() runs on ``.module``),
``zero2`` (stage 2), ``zero3`` (stage 3, ``param_persistence_threshold=0`` so every
parameter is partitioned, ``keep_gathered_methods=[]``: every forward gathers layer by
layer), ``zero3_keep`` (the same with the default ``keep_gathered_methods=["generate"]``:
the model is gathered once per generate() call), ``zero3_default`` (stage 3 with every
default, ``param_persistence_threshold`` included) and ``zero3_default_lockstep`` (the
same with ``synced_gpus=True`` passed by the caller: one all-reduce per new token, what
every stage-3 generate() under Accelerate paid before the engine chose ``synced_gpus``
itself).  Each engine is built with an AdamW optimizer, as in training.  Stage-3 models
carry the mark the Accelerate integration sets (``_is_fsdp_managed_module``), and
``synced_gpus`` is left to generate() and the engine's wrapper, except for ``zero3``
(no wrapper: the caller must keep the ranks in lockstep, so it passes True) and
``zero3_default_lockstep``.  Ratios are given against stage 2 and against DDP.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import time
import traceback
import warnings

import torch
import torch.distributed as dist

SYSTEMS = ("ddp", "zero2", "zero3", "zero3_keep", "zero3_default", "zero3_default_lockstep")
ZERO_CONFIGS = {
    "zero2": {"stage": 2},
    "zero3": {"stage": 3, "param_persistence_threshold": 0, "keep_gathered_methods": []},
    "zero3_keep": {"stage": 3, "param_persistence_threshold": 0},
    "zero3_default": {"stage": 3},
    "zero3_default_lockstep": {"stage": 3},
}
# What each system passes as synced_gpus (None: generate() and the engine's wrapper decide).
CALLER_SYNCED_GPUS = {"ddp": False, "zero3": True, "zero3_default_lockstep": True}


def build_model(args):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    if args.model == "gpt2":
        config = GPT2Config(vocab_size=args.vocab, n_positions=args.prompt_len + args.new_tokens + 8, n_embd=args.hidden,
                            n_layer=args.layers, n_head=args.heads, bos_token_id=0, eos_token_id=0)
        return GPT2LMHeadModel(config).eval()
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.prompt_len + args.new_tokens + 8, tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).eval()


def prompts(args):
    g = torch.Generator().manual_seed(args.seed + 1)
    return torch.randint(3, args.vocab, (args.batch, args.prompt_len), generator=g)


def generate(model, ids, args, new_tokens, synced_gpus):
    # min_new_tokens: an end-of-sequence token must not end one system's run early.
    kwargs = {} if synced_gpus is None else {"synced_gpus": synced_gpus}
    return model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                          pad_token_id=0, **kwargs)


def run_system(name, args, reference_state, ids, expected):
    import zero_strategy

    model = build_model(args)
    model.load_state_dict(reference_state)
    engine, wrapper = None, None
    if name == "ddp":
        wrapper = torch.nn.parallel.DistributedDataParallel(model)
        target = wrapper.module
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        engine = zero_strategy.initialize(model, optimizer, {**args.zero_config, **ZERO_CONFIGS[name]})
        target = model
        if engine.policies.stage.shards_parameters:
            model._is_fsdp_managed_module = True  # as the Accelerate integration marks a stage-3 model
    synced = CALLER_SYNCED_GPUS.get(name)
    seconds, same = [], True
    with torch.no_grad():
        generate(target, ids, args, 2, synced)  # warm-up, not timed
        if engine is not None:
            engine.reset_comm_report()
        for _ in range(args.calls):
            dist.barrier()
            t0 = time.perf_counter()
            out = generate(target, ids, args, args.new_tokens, synced)
            seconds.append(time.perf_counter() - t0)
            same = same and bool(torch.equal(out, expected))
    tally = engine.comm_report()["all_gather"] if engine is not None else None
    gathers = tally.calls // args.calls if tally is not None else 0
    gathered_bytes = tally.bytes // args.calls if tally is not None else 0
    if engine is not None:
        engine.close()
    del wrapper, model
    return {"seconds": seconds, "all_gathers": gathers, "all_gather_bytes": gathered_bytes, "same_tokens": same}


def worker_main(rank, world_size, store_path, args, queue):
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, cores // world_size))
    warnings.filterwarnings("ignore")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        reference = build_model(args)
        ids = prompts(args)
        with torch.no_grad():  # the single-process model's greedy tokens
            expected = generate(reference, ids, args, args.new_tokens, False)
        state = reference.state_dict()
        results = {name: [] for name in args.systems}
        for rep in range(args.repeats):
            order = list(args.systems) if rep % 2 == 0 else list(reversed(args.systems))
            for name in order:
                results[name].append(run_system(name, args, state, ids, expected))
                dist.barrier()
        buf = io.BytesIO()
        torch.save({"results": results, "threads": torch.get_num_threads()}, buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - the parent prints it
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(args):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from spawn import run_workers  # benchmarks/spawn.py

    return run_workers(worker_main, args, "bench_generate_")


def summarize(args, per_rank):
    tokens = args.batch * args.new_tokens
    rows = []
    for name in args.systems:
        runs = [[r["results"][name][k] for r in per_rank] for k in range(args.repeats)]
        # A generate() is as slow as its slowest rank; of the --calls in one repeat the
        # fastest counts (the others shared the cores with something else).
        rates = [tokens / min(max(x["seconds"][c] for x in ranks) for c in range(args.calls)) for ranks in runs]
        rows.append({
            "system": name,
            "tokens_per_s": rates,
            "min": min(rates), "median": statistics.median(rates), "max": max(rates),
            "all_gathers_per_generate": max(x["all_gathers"] for ranks in runs for x in ranks),
            "all_gather_bytes_per_generate": max(x["all_gather_bytes"] for ranks in runs for x in ranks),
            "same_tokens": all(x["same_tokens"] for ranks in runs for x in ranks),
        })
    for base in ("zero2", "ddp"):
        ref = next((r for r in rows if r["system"] == base), None)
        for r in rows:
            r[f"median_vs_{base}"] = r["median"] / ref["median"] if ref else None
            # Repeat k of every system ran back to back: the ratio within a repeat cancels
            # most of the load that changes between repeats.
            r[f"paired_vs_{base}"] = (statistics.median(a / b for a, b in zip(r["tokens_per_s"], ref["tokens_per_s"]))
                                      if ref else None)
    return {
        "config": {k: v for k, v in vars(args).items() if k not in ("json",)},
        "threads_per_rank": per_rank[0]["threads"],
        "loadavg": os.getloadavg(),
        "rows": rows,
    }


def render(summary) -> str:
    c = summary["config"]
    lines = [
        f"generate(): {'GPT-2' if c['model'] == 'gpt2' else 'Llama'} {c['layers']} layers x {c['hidden']} "
        f"(vocab {c['vocab']}), batch {c['batch']}, "
        f"prompt {c['prompt_len']}, {c['new_tokens']} new tokens greedy, {c['world_size']} gloo ranks x "
        f"{summary['threads_per_rank']} thread(s), {c['repeats']} repeats of the best of {c['calls']} calls, fp32"
        + (f", zero config {json.dumps(c['zero_config'])}" if c["zero_config"] else ""),
        "",
        "| system | tokens/s min | median | max | median / zero2 | paired / zero2 | paired / ddp | all-gathers per generate | MiB gathered per generate | tokens = single process |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]

    def ratio(r, key):
        return f"{r[key]:.2f}" if r.get(key) is not None else "n/a"

    for r in summary["rows"]:
        lines.append(f"| {r['system']} | {r['min']:.1f} | {r['median']:.1f} | {r['max']:.1f} | {ratio(r, 'median_vs_zero2')} | "
                     f"{ratio(r, 'paired_vs_zero2')} | {ratio(r, 'paired_vs_ddp')} | "
                     f"{r['all_gathers_per_generate']} | {r['all_gather_bytes_per_generate'] / 2**20:.1f} | "
                     f"{'yes' if r['same_tokens'] else 'NO'} |")
    lines.append("")
    lines.append(f"load average at the end: {' '.join(f'{x:.2f}' for x in summary['loadavg'])}")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--model", choices=("llama", "gpt2"), default="llama")
    p.add_argument("--systems", default=",".join(SYSTEMS[:4]), help=f"comma-separated, of {', '.join(SYSTEMS)}")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--calls", type=int, default=3, help="timed generate() calls per repeat; the fastest counts")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--zero-config", default="{}",
                   help='extra ZeroConfig fields (JSON) for every zero system, e.g. \'{"min_gather_numel": 0}\'')
    p.add_argument("--json", default=None, help="also write the summary here")
    args = p.parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    try:
        args.zero_config = json.loads(args.zero_config)
    except ValueError as exc:
        p.error(f"--zero-config is not JSON: {exc}")
    if not isinstance(args.zero_config, dict):
        p.error("--zero-config must be a JSON object of ZeroConfig fields")
    unknown = [s for s in args.systems if s not in SYSTEMS]
    if unknown:
        p.error(f"unknown system(s) {unknown}; choose from {', '.join(SYSTEMS)}")
    if min(args.repeats, args.calls, args.new_tokens, args.world_size) < 1:
        p.error("--repeats, --calls, --new-tokens and --world-size must be at least 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    summary = summarize(args, spawn(args))
    print(render(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return summary


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
