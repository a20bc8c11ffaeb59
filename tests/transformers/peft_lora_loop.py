"""A PEFT LoRA fine-tuning loop as users write it (plain Accelerate + PEFT; it does not
import zero_strategy), launched by tests/transformers/test_pretrained_peft.py under a DDP config and
under a zero_config with zero3_init_flag.

Writes, from the main process: ``initial.safetensors`` (the consolidated weights right
after prepare), ``final.safetensors`` (after training) and ``out.json`` (per-step losses
of every rank, whether from_pretrained left the base model unallocated), and ``adapter/``
(PEFT's save_pretrained)."""
import argparse
import json
import os

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object
from peft import LoraConfig, get_peft_model
from safetensors.torch import save_file
from torch.utils.data import DataLoader, TensorDataset
from transformers import AutoModelForCausalLM


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--replace-module-on-rank", type=int, default=None,
                   help="(a failure test) swap one Linear for a fresh one on that rank only, after loading")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)

    accelerator = Accelerator()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model)
    built_on_meta = gather_object([any(p.is_meta for p in model.parameters())])
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    if args.replace_module_on_rank == accelerator.process_index:
        model.base_model.model.model.layers[1].mlp.down_proj = torch.nn.Linear(64, 32, bias=False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    data = torch.randint(0, 64, (4 * args.steps, 12), generator=torch.Generator().manual_seed(7))
    loader = DataLoader(TensorDataset(data), batch_size=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    def save(name):
        state = accelerator.get_state_dict(model)
        if accelerator.is_main_process:
            save_file({k: v.detach().cpu().contiguous().clone() for k, v in state.items()}, os.path.join(args.out, name))

    save("initial.safetensors")
    model.train()
    losses = []
    for (batch,) in loader:
        loss = model(input_ids=batch, labels=batch).loss
        losses.append(gather_object([loss.item()]))
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    save("final.safetensors")
    # PEFT's own adapter folder, written as users write it: every process calls
    # save_pretrained (a collective state_dict under ZeRO stage 3), the main one writes.
    accelerator.unwrap_model(model).save_pretrained(os.path.join(args.out, "adapter"),
                                                    is_main_process=accelerator.is_main_process,
                                                    save_function=accelerator.save)
    if accelerator.is_main_process:
        with open(os.path.join(args.out, "out.json"), "w") as f:
            json.dump({"losses": losses, "built_on_meta": built_on_meta, "accelerator_class": type(accelerator).__name__,
                       "num_processes": accelerator.num_processes}, f)
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
