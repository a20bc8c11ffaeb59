"""A plain Accelerate loop training one model with two optimizers: Muon on the 2-D
hidden matrices of a tiny GPT-2 and AdamW on the rest, prepared together with
``accelerator.prepare(model, muon, adamw, loader, muon_sched, adamw_sched)``.

Launched by tests/accelerate/test_accelerate_optimizers.py with a plain DDP config and with
``zero_config`` sections; it does not import zero_strategy.  Gradient accumulation 2
through ``accelerator.accumulate``, global-norm clipping, an LR scheduler per optimizer,
and a ``save_state`` / ``load_state`` round trip (the resumed steps must repeat the
uninterrupted ones).  Writes losses, final weights and each optimizer's state in
torch's format.

    python accelerate_two_optimizers_script.py OUT_DIR
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from accelerate import Accelerator

from models import muon_adamw, muon_orthogonalise_in_fp32, tiny_gpt2

STEPS, ACCUM, MICRO_BATCH = 4, 2, 2


def optimizer_states(accelerator, optimizers):
    """Each optimizer's state in torch's format on the main process."""
    engine = getattr(accelerator, "zero_engine", None)
    if engine is not None:  # a sharded optimizer: consolidated by its engine (collective)
        return [engine.full_optimizer_state_dict(optimizer=k) for k in range(len(optimizers))]
    return [o.optimizer.state_dict() for o in optimizers]


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    # Stock Muon orthogonalises in bf16; fp32 here keeps one process vs two ranks within fp32 tolerances.
    muon_orthogonalise_in_fp32()
    accelerator = Accelerator(gradient_accumulation_steps=ACCUM)
    model = tiny_gpt2()
    muon, adamw = muon_adamw(model)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 96, (STEPS * ACCUM * MICRO_BATCH * accelerator.num_processes, 16), generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=MICRO_BATCH)
    muon_sched = torch.optim.lr_scheduler.StepLR(muon, 1, gamma=0.8)
    adamw_sched = torch.optim.lr_scheduler.LambdaLR(adamw, lambda step: 1.0 / (1.0 + step))
    model, muon, adamw, loader, muon_sched, adamw_sched = accelerator.prepare(
        model, muon, adamw, loader, muon_sched, adamw_sched)
    optimizers = (muon, adamw)

    def run(batches):
        losses = []
        for (ids,) in batches:
            with accelerator.accumulate(model):
                loss = model(input_ids=ids, labels=ids).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                for opt in optimizers:
                    opt.step()
                muon_sched.step()
                adamw_sched.step()
                for opt in optimizers:
                    opt.zero_grad()
            losses.append(float(accelerator.gather(loss.detach()[None]).mean()))
        return losses

    batches = list(loader)
    half = len(batches) // 2
    losses = run(batches[:half])
    accelerator.save_state(str(out / "state"))
    losses += run(batches[half:])
    weights = accelerator.get_state_dict(model)
    states = optimizer_states(accelerator, optimizers)
    lrs = [muon.param_groups[0]["lr"], adamw.param_groups[0]["lr"]]
    accelerator.load_state(str(out / "state"))
    resumed = run(batches[half:])
    if accelerator.is_main_process:
        torch.save({k: v.detach().cpu().clone() for k, v in weights.items()}, out / "weights.pt")
        torch.save(states, out / "optimizers.pt")
        (out / "out.json").write_text(json.dumps({
            "accelerator_class": type(accelerator).__name__, "losses": losses, "resumed": resumed, "lrs": lrs,
            # (a wrapper-aware name: a wrapped optimizer shows what it wraps under .optimizer)
            "optimizer_classes": [type(getattr(o.optimizer, "optimizer", o.optimizer)).__name__ for o in optimizers],
        }))
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
