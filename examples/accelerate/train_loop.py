"""A plain Accelerate training loop on a tiny GPT-2; it knows nothing about ZeRO.

    # ZeRO stage 3 (the config file's zero_config: section switches it on)
    ACCELERATE_USE_CPU=true accelerate launch --config_file examples/accelerate/zero3.yaml \
        examples/accelerate/train_loop.py --steps 20 --accum 2 --clip 1.0
    # the same script with plain DDP
    ACCELERATE_USE_CPU=true accelerate launch --config_file examples/accelerate/ddp.yaml \
        examples/accelerate/train_loop.py --steps 20 --accum 2 --clip 1.0

(ACCELERATE_USE_CPU=true only on machines without GPUs.)  The model is built from a
``GPT2Config`` (nothing is downloaded); every sequence is an arithmetic progression
modulo the vocabulary, so the loss falls quickly.  It uses what an Accelerate loop
usually does: prepare, accumulate, backward, clip_grad_norm_, optimizer/scheduler
step, save_state / load_state, get_state_dict, save_model and unwrap_model.  With
``--out`` the main process writes what happened (per-step losses, gradient norms,
skipped steps) as JSON, which the tests compare between launches; it prints each step's
loss, gradient norm and learning rate as it goes.
"""
from __future__ import annotations

import argparse
import json
import math

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object, set_seed
from torch.utils.data import DataLoader, TensorDataset
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

VOCAB = 64
SEQ_LEN = 16


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8, help="optimizer steps to reach")
    p.add_argument("--accum", type=int, default=1, help="gradient accumulation steps")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per micro-batch per process")
    p.add_argument("--clip", type=float, default=0.0, help="max gradient norm (0: only measure it)")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--save-state-at", type=int, default=None, help="accelerator.save_state after this step")
    p.add_argument("--state-dir", default=None)
    p.add_argument("--resume-from", default=None, help="accelerator.load_state from here, then continue")
    p.add_argument("--start-step", type=int, default=0, help="the step the resumed state was saved at")
    p.add_argument("--save-model", default=None, help="save_model + save_pretrained the final weights here")
    p.add_argument("--inf-at", type=int, default=None, help="make this step's loss infinite (overflow test)")
    p.add_argument("--track-weights", action="store_true", help="record a checksum of get_state_dict per step")
    p.add_argument("--prepare-separately", action="store_true", help="prepare the model, then the rest")
    p.add_argument("--from-pretrained", default=None,
                   help="start from a saved model (AutoModelForCausalLM.from_pretrained) instead of a fresh one")
    p.add_argument("--out", default=None, help="write the results as JSON here (main process)")
    return p.parse_args()


def make_dataset(num_sequences: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    start = torch.randint(0, VOCAB, (num_sequences, 1), generator=g)
    stride = torch.randint(1, 5, (num_sequences, 1), generator=g)
    return TensorDataset((start + torch.arange(SEQ_LEN) * stride) % VOCAB)


def build_model() -> GPT2LMHeadModel:
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ_LEN, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def main():
    args = parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=args.accum)
    set_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.from_pretrained) if args.from_pretrained else build_model()
    # With zero3_init_flag, from_pretrained left the parameters unallocated (meta).
    built_on_meta = gather_object([any(p.is_meta for p in model.parameters())])
    original = model
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}], lr=args.lr
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.95**s)
    per_step = args.batch_size * args.accum * accelerator.num_processes
    loader = DataLoader(make_dataset(per_step * args.steps), batch_size=args.batch_size, shuffle=False)
    if args.prepare_separately:
        model = accelerator.prepare(model)
        optimizer, loader, scheduler = accelerator.prepare(optimizer, loader, scheduler)
    else:
        model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    if args.resume_from:
        accelerator.load_state(args.resume_from)
        loader = accelerator.skip_first_batches(loader, args.start_step * args.accum)

    results = {"losses": [], "grad_norms": [], "skipped": [], "checksums": [], "lrs": []}
    step, running = args.start_step, 0.0
    for (tokens,) in loader:
        with accelerator.accumulate(model):
            loss = model(input_ids=tokens, labels=tokens).loss
            if args.inf_at == step:
                loss = loss * math.inf
            accelerator.backward(loss)
            norm = None
            if accelerator.sync_gradients:
                norm = accelerator.clip_grad_norm_(model.parameters(), args.clip if args.clip > 0 else math.inf)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        running += accelerator.reduce(loss.detach().float(), "mean").item() / args.accum
        if not accelerator.sync_gradients:
            continue
        results["losses"].append(running)
        results["grad_norms"].append(float(norm))
        results["skipped"].append(bool(accelerator.optimizer_step_was_skipped))
        results["lrs"].append(scheduler.get_last_lr()[0])
        if args.track_weights:
            state = accelerator.get_state_dict(model)
            if accelerator.is_main_process:
                results["checksums"].append(sum(float(t.double().abs().sum()) for t in state.values()))
        # For whoever watches the run (the main process only); --out records the same numbers.
        accelerator.print(f"step {step + 1}/{args.steps}  loss {running:.4f}  grad norm {float(norm):.4f}  "
                          f"lr {results['lrs'][-1]:.2e}"
                          + ("  skipped (fp16 overflow)" if results["skipped"][-1] else ""), flush=True)
        running = 0.0
        step += 1
        if step == args.save_state_at:
            accelerator.save_state(args.state_dir)
        if step == args.steps:
            break

    results["built_on_meta"] = built_on_meta
    results["unwrap_is_model"] = gather_object([accelerator.unwrap_model(model) is original])
    if args.save_model:
        accelerator.save_model(model, f"{args.save_model}/save_model")
        unwrapped = accelerator.unwrap_model(model)
        unwrapped.save_pretrained(
            f"{args.save_model}/save_pretrained",
            is_main_process=accelerator.is_main_process,
            save_function=accelerator.save,
            state_dict=accelerator.get_state_dict(model),
        )
        if accelerator.is_main_process:
            unwrapped.config.save_pretrained(f"{args.save_model}/save_model")
    results["distributed_type"] = str(accelerator.distributed_type)
    results["num_processes"] = accelerator.num_processes
    results["mixed_precision"] = accelerator.mixed_precision
    results["accelerator_class"] = type(accelerator).__name__
    if accelerator.is_main_process and args.out:
        with open(args.out, "w") as f:
            json.dump(results, f)
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
