"""Fine-tune a tiny GPT-2 with ZeRO on a synthetic dataset it can learn in seconds.

    torchrun --nproc-per-node 2 examples/finetune_tiny_gpt2.py
    torchrun --nproc-per-node 2 examples/finetune_tiny_gpt2.py --stage 2 --precision bf16 --accum 2 --clip 1.0
    torchrun --nproc-per-node 2 examples/finetune_tiny_gpt2.py --save /tmp/tiny-gpt2
    torchrun --nproc-per-node 2 examples/finetune_tiny_gpt2.py --min-gather-numel 0   # one gather per block
    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint node0:29500 \
        examples/finetune_tiny_gpt2.py   # the same on each of 2 nodes: docs/multinode.md
    torchrun --nproc-per-node 4 examples/finetune_tiny_gpt2.py --ranks-per-node 2 --secondary-partition node \
        --weight-quantization int8 --gradient-quantization int4   # ZeRO++ on 2 simulated nodes
    python examples/finetune_tiny_gpt2.py            # one process, no process group

The model is built from a ``GPT2Config`` (nothing is downloaded).  Every sequence is
an arithmetic progression modulo the vocabulary (start a, stride d): after two tokens
the rest is determined, so the loss falls quickly from ln(vocab) ~ 6.2.

The training loop is the ordinary PyTorch one; ZeRO adds three lines:
``zero_strategy.initialize``, ``engine.backward(loss)`` and ``engine.step()``.  At the end
it prints this rank's memory next to the paper's formula (GiB) and the last step's
communication next to the paper's 2Ψ / 3Ψ, with why they differ here.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import os
import textwrap
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging as hf_logging

import zero_strategy
from zero_strategy.units import gib_number

VOCAB = 512
SEQ_LEN = 32


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3], help="ZeRO stage (default 3)")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps")
    parser.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch per rank")
    parser.add_argument("--clip", type=float, default=0.0, help="max global gradient norm (0 = off)")
    parser.add_argument("--lr", type=float, default=5e-3, help="peak learning rate")
    parser.add_argument("--warmup", type=int, default=None, help="warmup steps (default: steps // 10)")
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--min-gather-numel", type=int, default=None, metavar="N",
                        help="stage 3: gather sibling blocks together until one gather holds N elements "
                             "(default: ZeroConfig's 1,000,000, which gathers this small model as one "
                             "piece; 0 = one gather per GPT2Block)")
    parser.add_argument("--ranks-per-node", type=int, default=None, metavar="L",
                        help="ranks per node (default: what the launcher says, e.g. torchrun's LOCAL_WORLD_SIZE); "
                             "on one host, simulate nodes of L ranks (docs/multinode.md)")
    parser.add_argument("--secondary-partition", choices=["node"], default=None,
                        help="ZeRO++ hpZ (stage 3): backward gathers inside the node")
    parser.add_argument("--weight-quantization", choices=["int8"], default=None,
                        help="ZeRO++ qwZ (stage 3): int8 weights in training all-gathers")
    parser.add_argument("--gradient-quantization", choices=["int8", "int4"], default=None,
                        help="ZeRO++ qgZ (stages 2-3): quantized gradient exchange between nodes")
    parser.add_argument("--save", metavar="DIR", default=None,
                        help="save the consolidated model with save_pretrained and reload it")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def setup_distributed():
    """torchrun sets RANK/WORLD_SIZE/LOCAL_RANK; plain `python` runs one process without a group."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        if torch.cuda.is_available():
            device = torch.device("cuda", local_rank)
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", device_id=device)
        else:
            device = torch.device("cpu")
            dist.init_process_group("gloo")
        return dist.get_rank(), dist.get_world_size(), device
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return 0, 1, device


def make_dataset(num_sequences: int, seed: int) -> TensorDataset:
    """Arithmetic progressions mod VOCAB: t_i = (a + i * d) % VOCAB, d in 1..4."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (num_sequences, 1), generator=g)
    stride = torch.randint(1, 5, (num_sequences, 1), generator=g)
    positions = torch.arange(SEQ_LEN).unsqueeze(0)
    tokens = (start + positions * stride) % VOCAB
    return TensorDataset(tokens)


def mean_over_ranks(value: torch.Tensor, world_size: int) -> float:
    value = value.detach().float().clone()
    if world_size > 1:
        dist.all_reduce(value)
        value /= world_size
    return value.item()


def main() -> None:
    args = parse_args()
    hf_logging.disable_progress_bar()
    rank, world_size, device = setup_distributed()
    is_main = rank == 0
    torch.manual_seed(args.seed)  # same initial weights on every rank
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # The model is tiny: more intra-op threads cost more in synchronisation than
        # they save (torchrun already sets OMP_NUM_THREADS=1 per process).
        torch.set_num_threads(1)

    # -- model and optimizer, built exactly as without ZeRO -----------------------------
    config = GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=128, n_layer=4, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)
    model = GPT2LMHeadModel(config).to(device)
    model.loss_type = "ForCausalLM"  # GPT2LMHeadModel's name does not tell transformers its loss
    num_params = sum(p.numel() for p in model.parameters())  # tied wte/lm_head counted once
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)

    # Linear warmup, then linear decay to 10% of the peak; built on the user's optimizer
    # before initialize and it keeps working: ZeRO keeps the same param-group dicts.
    warmup = args.warmup if args.warmup is not None else max(1, args.steps // 10)

    def lr_factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, args.steps - warmup)
        return max(0.1, 1.0 - 0.9 * progress)

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)

    zero_config = {
        "stage": args.stage,
        "precision": args.precision,
        # The tiny model's matrices are all below the default 100_000 elements, so lower
        # the threshold to shard them at stage 3 (biases and LayerNorms stay whole).
        "param_persistence_threshold": 1024,
    }
    if args.min_gather_numel is not None:
        zero_config["min_gather_numel"] = args.min_gather_numel
    for key in ("ranks_per_node", "secondary_partition", "weight_quantization", "gradient_quantization"):
        if getattr(args, key) is not None:
            zero_config[key] = getattr(args, key)
    engine = zero_strategy.initialize(model, optimizer, zero_config)
    setup_line = engine.describe()  # on several nodes it says how many, and where it learnt that
    if is_main:
        print(f"GPT-2: {num_params:,} parameters, world size {world_size}, device {device}, "
              f"stage {args.stage}, precision {args.precision}, accum {args.accum}, "
              f"clip {args.clip or 'off'}, {len(engine.units)} flat units")
        print(setup_line)

    # -- data: each rank reads its own share -----------------------------------------
    dataset = make_dataset(num_sequences=2048, seed=1234)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True,
                                 seed=args.seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    def batches():
        epoch = 0
        while True:
            sampler.set_epoch(epoch)
            for (tokens,) in loader:
                yield tokens.to(device)
            epoch += 1

    data = batches()
    probe = make_dataset(num_sequences=16, seed=99)[:][0].to(device)  # the same on every rank

    # -- training loop --------------------------------------------------------------------
    model.train()
    first_loss = last_loss = None
    skipped = 0
    start = time.perf_counter()
    for step in range(args.steps):
        if step == args.steps - 1:
            engine.reset_comm_report()  # measure the traffic of exactly one optimizer step
        step_loss = torch.zeros((), device=device)
        for micro in range(args.accum):
            tokens = next(data)
            last_micro = micro == args.accum - 1
            # no_sync on all but the last micro-batch: stages 0/1 then skip communication.
            with (engine.no_sync() if not last_micro else contextlib.nullcontext()):
                loss = model(input_ids=tokens, labels=tokens).loss
                engine.backward(loss / args.accum)
            step_loss += loss.detach().float() / args.accum
        if args.clip > 0:
            engine.clip_grad_norm_(args.clip)
        if step == args.steps - 1:
            # Between backward and step every model state exists (stages 2-3 free their
            # gradient shards in step()): the moment the paper's formula describes.
            memory = engine.memory_report()
        if engine.step():
            scheduler.step()
        else:
            skipped += 1  # fp16 overflow: skipped on every rank, the scale was lowered
        mean_loss = mean_over_ranks(step_loss, world_size)
        first_loss = mean_loss if first_loss is None else first_loss
        last_loss = mean_loss
        if is_main and (step % args.log_every == 0 or step == args.steps - 1):
            lr = optimizer.param_groups[0]["lr"]
            print(f"step {step:4d}  loss {mean_loss:.4f}  lr {lr:.2e}", flush=True)
    elapsed = time.perf_counter() - start
    comm = engine.comm_report()

    if is_main:
        print(f"\nloss {first_loss:.4f} -> {last_loss:.4f} in {args.steps} steps, "
              f"{elapsed:.1f} s ({elapsed / args.steps * 1000:.0f} ms/step)"
              + (f", {skipped} step(s) skipped on fp16 overflow" if skipped else ""))
        report_memory(memory, engine, num_params, world_size, args)
        report_comm(comm, num_params, engine.unit_summary(), engine.config.min_gather_numel, args)

    # -- consolidated weights -> plain transformers ------------------------------------
    if args.save:
        sd = engine.full_state_dict()  # collective: every rank calls it, rank 0 gets the dict
        model.eval()
        with torch.no_grad():  # stage 3 forward gathers, so every rank runs it
            engine_loss = model(input_ids=probe, labels=probe).loss.float().item()
        if is_main:
            model.save_pretrained(args.save, state_dict=sd)
            reloaded = GPT2LMHeadModel.from_pretrained(args.save).to(device).eval()
            reloaded.loss_type = "ForCausalLM"
            with torch.no_grad():
                reloaded_loss = reloaded(input_ids=probe, labels=probe).loss.item()
            print(f"\nsaved to {args.save}: {sorted(os.listdir(args.save))}")
            print(f"loss on a probe batch: ZeRO model {engine_loss:.4f}, "
                  f"reloaded GPT2LMHeadModel.from_pretrained {reloaded_loss:.4f}")

    # Tear down while Python is fully alive: drop the engine (it and its optimizer facade
    # form a reference cycle, hence gc.collect) so that destroy_process_group really
    # destroys the group and joins its worker threads.  Otherwise a gloo worker thread
    # may release a finished collective during interpreter shutdown and abort the process.
    engine.close()
    del engine, optimizer, scheduler
    gc.collect()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def report_memory(got, engine, num_params: int, world_size: int, args) -> None:
    """What this rank held before the last step, next to the paper's formula for the same Ψ."""
    est = zero_strategy.estimate(num_params, world_size, args.stage, args.precision, "adamw")
    # The paper's K (optimizer bytes per parameter) includes the fp32 master copy in
    # mixed precision; memory_report lists the master separately.
    optimizer_total = got["master_weights"] + got["optimizer_state"]
    rows = [
        ("parameters", gib_number(got["parameters"]), gib_number(est.parameters)),
        ("gradients", gib_number(got["gradients"]), gib_number(est.gradients)),
        ("optimizer states", gib_number(optimizer_total), gib_number(est.optimizer_states)),
        ("  of which master_weights", gib_number(got["master_weights"]), ""),
        ("  of which optimizer_state", gib_number(got["optimizer_state"]), ""),
        ("communication_buffers", gib_number(got["communication_buffers"]), ""),
        ("total", gib_number(got["total"]), gib_number(est.total)),
    ]
    print(f"\nmemory on rank 0 between the last backward and its step, GiB (Ψ = {num_params:,}, "
          f"N = {world_size}, stage {args.stage}, {args.precision}, AdamW)")
    print(f"  {'category':28s} {'memory_report':>13s}  {'paper formula':>13s}")
    for name, measured, formula in rows:
        print(f"  {name:28s} {measured:>13s}  {formula:>13s}".rstrip())
    whole = sum(u["numel"] for u in engine.unit_summary()["units"] if u["whole"])
    if args.stage == 3 and whole and world_size > 1:
        say(f"memory_report's parameters are above the formula: the {whole:,} elements below "
            "param_persistence_threshold stay whole on every rank, where the formula divides them by N.")


def report_comm(comm, num_params: int, summary: dict, min_gather_numel: int, args) -> None:
    """The last optimizer step's traffic, counted as the paper does (all-reduce = 2x)."""
    print("\ncommunication in one optimizer step (elements per rank, counted as the paper does):")
    width = max([16] + [len(kind) for kind in comm.kinds])
    for kind, tally in sorted(comm.kinds.items()):
        print(f"  {kind:{width}s} {tally.calls:4d} calls  {tally.elements:>12,} elements")
    volume = comm.paper_volume
    print(f"  {'paper_volume':{width}s} {volume:,} = {volume / num_params:.2f} Ψ, where Ψ = {num_params:,} "
          "(the parameter count)")
    if comm.cross_node_bytes:
        print(f"  bytes sent by rank 0: {comm.intra_node_bytes:,} inside its node, {comm.cross_node_bytes:,} to "
              "other nodes")
    if args.stage < 3:
        say(f"The paper's stages 0-2 move 2Ψ = {2 * num_params:,}: gradients reduced (an all-reduce counts "
            "2x), parameters all-gathered.")
    if args.accum > 1 and args.stage == 2:
        say(f"Stage 2 reduce-scatters every micro-batch: with --accum {args.accum} expect "
            f"{args.accum + 1}Ψ ({args.accum} reduce-scatters + 1 all-gather).")
    elif args.accum > 1 and args.stage == 3:
        say(f"Stage 3 gathers and reduce-scatters every micro-batch: with --accum {args.accum} "
            f"expect about {3 * args.accum}Ψ.")
    elif args.accum > 1:
        say(f"Stages 0/1 communicate only on the last of the {args.accum} micro-batches (no_sync).")
    elif args.stage == 3:
        explain_stage3_volume(summary, num_params, min_gather_numel)
    if args.stage >= 1 and comm["all_gather"].elements > 0:
        say("Flat units are padded to a multiple of N, so the counts can be slightly above these.")


def explain_stage3_volume(summary: dict, num_params: int, min_gather_numel: int) -> None:
    """Why stage 3 moved what it moved: the paper's 3Ψ, less what this run never gathers twice."""
    partitioned = sum(u["numel"] for u in summary["units"] if not u["whole"])
    whole = num_params - partitioned
    root = sum(g["numel"] for g in summary["groups"] if g["module"] == "<root>")
    say(f"The paper's stage 3 moves 3Ψ = {3 * num_params:,}: every parameter is all-gathered for forward, "
        "again for backward, and its gradient is reduce-scattered.")
    if len(summary["groups"]) == 1:
        say(f"Here less: this model's {partitioned:,} partitioned elements are fewer than min_gather_numel "
            f"({min_gather_numel:,}), so they are gathered as one piece, and the piece forward releases last "
            "stays gathered into backward: nothing is gathered twice. --min-gather-numel 0 gathers each "
            "GPT2Block on its own and brings the volume near 3Ψ.")
    else:
        say(f"Here less: the root module's {root:,} elements (embeddings, head) are released last in forward, "
            "so they stay gathered into backward and move 2x, not 3x.")
    if whole:
        say(f"The {whole:,} elements below param_persistence_threshold stay whole on every rank and move 2x "
            "(reduce-scatter and all-gather, as in stage 2).")
    expected = 3 * partitioned - root + 2 * whole
    say(f"Expected: 3 x {partitioned:,} - {root:,} + 2 x {whole:,} = {expected:,} = {expected / num_params:.2f} Ψ")


def say(text: str) -> None:
    print(textwrap.fill(text, width=100, initial_indent="  ", subsequent_indent="  ", break_on_hyphens=False))


if __name__ == "__main__":
    main()
