"""A trained policy next to frozen reference models in one Accelerator, as TRL's
DPOTrainer prepares them: ``prepare(policy, optimizer, loader)``, then ``prepare(ref)``
(a frozen reference, at stage 3 through ``set_zero_config`` whatever the section says;
under stock DDP, which refuses ``prepare`` of a frozen model, with evaluation_mode=True)
and ``prepare_model(ref_eval, evaluation_mode=True)`` (a second reference whose
parameters still require grad).  Launched by tests/accelerate/test_accelerate_multi_model.py under
zero_config sections and under a plain DDP config; does not import zero_strategy.

The policy is first prepared for evaluation (its outputs on a probe recorded), as the
Trainer's ``evaluate()`` before ``train()`` does, then with its optimizer.  Each step's
loss uses both references' outputs (a DPO-like penalty pulling the policy's
log-probabilities towards theirs), with gradient accumulation, clipping, a
save_state / load_state round trip (the last steps are run twice: once straight on,
once after restoring the checkpoint), get_state_dict and unwrap_model of every model.
The models come from ``from_pretrained`` (argv[2]: the policy's folder, argv[3]: the
reference's), so under ``zero3_init_flag`` every one of them is built unallocated and
filled from its files at prepare, the references without an optimizer.  The plain copy
is built from the config and loaded from the reference's file with torch.

Writes to argv[1] (main process): the per-step losses, the final policy weights file,
how far each reference's outputs and weights are from the plain copy, and what
unwrap_model returned.
"""
import json
import os
import sys

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

STEPS, ACCUM, SAVE_AFTER = 6, 2, 3  # optimizer steps; micro-batches per step; checkpoint after this step


def save_models(policy_dir, ref_dir):
    """The two checkpoints the script loads (called by the test, once)."""
    config = GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True)
    for seed, folder in ((0, policy_dir), (1, ref_dir)):
        set_seed(seed)
        GPT2LMHeadModel(config).save_pretrained(folder)


def token_logp(model, ids):
    logits = model(input_ids=ids).logits[:, :-1].float()
    return torch.gather(F.log_softmax(logits, -1), 2, ids[:, 1:, None]).squeeze(-1).sum(-1)


def main():
    out_path, policy_dir, ref_dir = sys.argv[1:4]
    accelerator = Accelerator(gradient_accumulation_steps=ACCUM)
    policy = AutoModelForCausalLM.from_pretrained(policy_dir)
    ref = AutoModelForCausalLM.from_pretrained(ref_dir).requires_grad_(False)  # frozen: prepared alone
    ref_eval = AutoModelForCausalLM.from_pretrained(ref_dir)  # trainable flags, but prepared for evaluation
    plain = GPT2LMHeadModel(AutoConfig.from_pretrained(ref_dir))  # never prepared: what both references must compute
    missing, unexpected = plain.load_state_dict(load_file(os.path.join(ref_dir, "model.safetensors")), strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected, (missing, unexpected)  # lm_head is tied to wte
    plain.tie_weights()
    plain.eval()
    unallocated = [all(p.is_meta for p in m.parameters()) for m in (policy, ref, ref_eval)]

    generator = torch.Generator().manual_seed(2)
    data = torch.randint(0, 96, (STEPS * ACCUM * 4 * accelerator.num_processes, 16), generator=generator)
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=False)
    probe = torch.randint(0, 96, (3, 16), generator=torch.Generator().manual_seed(3)).to(accelerator.device)
    # Prepared for evaluation before training, as the Trainer's evaluate() before train() does.
    # Not in the DDP reference run: there that first prepare changes the training that
    # follows (the third loss moves by 6e-5 against a run without it; not investigated).
    if type(accelerator).__name__ == "ZeroAccelerator":
        policy = accelerator.prepare_model(policy, evaluation_mode=True)
    with torch.no_grad():
        before_training = policy(input_ids=probe).logits.float().cpu()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=3e-3, weight_decay=0.01)
    policy, optimizer, loader = accelerator.prepare(policy, optimizer, loader)
    if type(accelerator).__name__ == "ZeroAccelerator":
        # Its own stage: 3 with every parameter partitioned, whatever the policy's is.
        accelerator.set_zero_config(ref, zero_stage=3, param_persistence_threshold=0)
        ref = accelerator.prepare(ref)
    else:  # stock DDP refuses a module without trainable parameters ("DistributedDataParallel is not needed ...")
        ref = accelerator.prepare_model(ref, evaluation_mode=True)
    ref_eval = accelerator.prepare_model(ref_eval, evaluation_mode=True)
    ref.eval()
    ref_eval.eval()

    ref_gap = {"ref": 0.0, "ref_eval": 0.0}

    def check_references():
        with torch.no_grad():
            want = plain.to(accelerator.device)(input_ids=probe).logits
            for name, model in (("ref", ref), ("ref_eval", ref_eval)):
                got = model(input_ids=probe).logits
                ref_gap[name] = max(ref_gap[name], float((got.float() - want.float()).abs().max()))

    def run(batches):
        losses = []
        for batch in batches:
            with accelerator.accumulate(policy):
                with torch.no_grad():
                    anchor = 0.5 * (token_logp(ref, batch) + token_logp(ref_eval, batch))
                logp = token_logp(policy, batch)
                loss = -logp.mean() / batch.shape[1] + 0.01 * ((logp - anchor) ** 2).mean() / batch.shape[1]
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(policy.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
            losses.append(float(accelerator.gather(loss.detach()[None]).mean()))
        return losses

    batches = list(loader)
    per_step = ACCUM
    losses = run(batches[: SAVE_AFTER * per_step])
    check_references()
    folder = os.path.join(os.path.dirname(out_path), "state")
    accelerator.save_state(folder)
    tail = run(batches[SAVE_AFTER * per_step:])
    check_references()
    accelerator.load_state(folder)
    resumed = run(batches[SAVE_AFTER * per_step:])
    check_references()

    policy_weights = accelerator.get_state_dict(policy)  # collective
    ref_weights = accelerator.get_state_dict(ref)
    ref_eval_weights = accelerator.get_state_dict(ref_eval)
    unwrapped = {"ref": accelerator.unwrap_model(ref) is ref, "ref_eval": accelerator.unwrap_model(ref_eval) is ref_eval}
    lookup = getattr(accelerator, "zero_engine_for", None)
    stages = None if lookup is None else [lookup(m).config.stage for m in (policy, ref, ref_eval)]
    if accelerator.is_main_process:
        expected = plain.state_dict()
        weight_gap = {name: max(float((sd[k].float().cpu() - expected[k].float().cpu()).abs().max()) for k in expected)
                      for name, sd in (("ref", ref_weights), ("ref_eval", ref_eval_weights))}
        weights_file = os.path.join(os.path.dirname(out_path), "policy.safetensors")
        save_file({k: v.detach().float().cpu().contiguous() for k, v in policy_weights.items()
                   if k != "lm_head.weight"}, weights_file)
        with open(out_path, "w") as f:
            json.dump({"losses": losses + tail, "resumed": resumed, "ref_output_gap": ref_gap, "ref_weight_gap": weight_gap,
                       "unwrap_is_model": unwrapped, "policy_weights": weights_file,
                       "policy_probe_sum_before_training": float(before_training.double().sum()),
                       "accelerator_class": type(accelerator).__name__, "stages": stages, "unallocated_before_prepare": unallocated,
                       "ref_keys_equal": sorted(ref_weights) == sorted(expected)}, f)
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
