"""A transformers Trainer script on a tiny GPT-2; it knows nothing about ZeRO.

    ACCELERATE_USE_CPU=true accelerate launch --config_file examples/accelerate/zero3.yaml \
        examples/accelerate/train_trainer.py --output-dir /tmp/tiny-trainer
    # continue from the checkpoint saved at step 4
    ACCELERATE_USE_CPU=true accelerate launch --config_file examples/accelerate/zero3.yaml \
        examples/accelerate/train_trainer.py --output-dir /tmp/tiny-trainer --resume checkpoint-4

(ACCELERATE_USE_CPU=true only on machines without GPUs.)  Trains with gradient
accumulation and gradient clipping, evaluates and saves a checkpoint every
``--save-steps`` steps, saves the final model with ``trainer.save_model`` and lets every
process generate greedily from its own prompt (different lengths per process, which
under ZeRO stage 3 needs the processes to keep stepping together).  With ``--out``
the main process writes the logged losses, the evaluation loss and the generations.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
from accelerate.utils import gather_object
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed

VOCAB = 64
SEQ_LEN = 16


class Progressions(torch.utils.data.Dataset):
    """Arithmetic progressions modulo VOCAB: learnable after two tokens."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        stride = torch.randint(1, 5, (n, 1), generator=g)
        self.tokens = (start + torch.arange(SEQ_LEN) * stride) % VOCAB

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i):
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output-dir", required=True)
    p.add_argument("--max-steps", type=int, default=8)
    p.add_argument("--save-steps", type=int, default=4)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--max-grad-norm", type=float, default=0.5)
    p.add_argument("--resume", default=None, help="a checkpoint folder name inside --output-dir")
    p.add_argument("--final-model", default=None, help="trainer.save_model() here at the end")
    p.add_argument("--reload-first-checkpoint", action="store_true",
                   help="load_best_model_at_end, ranking by the highest eval loss: as the loss falls, "
                        "this reloads the first checkpoint's weights at the end (a visible reload)")
    p.add_argument("--from-pretrained", default=None,
                   help="start from a saved model (AutoModelForCausalLM.from_pretrained) instead of a fresh one")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    set_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ_LEN + 16, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )
    if args.from_pretrained:
        model = AutoModelForCausalLM.from_pretrained(args.from_pretrained)
    else:
        model = GPT2LMHeadModel(config)
    # With zero3_init_flag, from_pretrained left the parameters unallocated (meta).
    built_on_meta = any(p.is_meta for p in model.parameters())
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        gradient_accumulation_steps=args.accum,
        max_grad_norm=args.max_grad_norm,
        learning_rate=1e-2,
        lr_scheduler_type="linear",
        warmup_steps=2,
        max_steps=args.max_steps,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=args.save_steps,
        save_strategy="steps",
        save_steps=args.save_steps,
        load_best_model_at_end=args.reload_first_checkpoint,
        metric_for_best_model="eval_loss",
        greater_is_better=True,
        report_to=[],
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
    )
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=Progressions(256, seed=1),
        eval_dataset=Progressions(32, seed=2),
    )
    resume = os.path.join(args.output_dir, args.resume) if args.resume else None
    trainer.train(resume_from_checkpoint=resume)
    history = list(trainer.state.log_history)  # before the final evaluate() adds to it
    metrics = trainer.evaluate()
    if args.final_model:
        trainer.save_model(args.final_model)

    # Every process generates from its own prompt, for a different number of tokens.
    rank = trainer.args.process_index
    prompt = torch.tensor([[rank + 1, rank + 3, rank + 5][: 2 + rank % 2]], device=trainer.args.device)
    model = trainer.accelerator.unwrap_model(trainer.model)
    model.eval()
    generated = model.generate(prompt, max_new_tokens=3 + 4 * rank, do_sample=False, pad_token_id=0)
    generations = gather_object([{"prompt": prompt[0].tolist(), "tokens": generated[0].tolist()}])
    built_on_meta = gather_object([built_on_meta])

    if trainer.is_world_process_zero() and args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "losses": {e["step"]: e["loss"] for e in history if "loss" in e},
                    "grad_norms": {e["step"]: e["grad_norm"] for e in history if "grad_norm" in e},
                    "eval_losses": {e["step"]: e["eval_loss"] for e in history if "eval_loss" in e},
                    "final_eval_loss": metrics["eval_loss"],
                    "generations": generations,
                    "accelerator_class": type(trainer.accelerator).__name__,
                    "built_on_meta": built_on_meta,
                    "num_processes": trainer.args.world_size,
                },
                f,
            )


if __name__ == "__main__":
    main()
