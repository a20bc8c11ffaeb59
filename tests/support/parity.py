"""Reference (single process, plain torch) and ZeRO runs of the same training job.

The reference is independent of the engine: plain autograd + torch.optim on one
process over the whole global batch.  For 16-bit precisions it applies the same casts
as ZeRO does (compute copy in 16 bits, fp32 master weights, loss scale for fp16; with
``autocast`` in the job's config: fp32 parameters and the forward under torch.autocast),
but none of the engine's code.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from models import TrustRatioSGD, lm_batches, muon_adamw, muon_orthogonalise_in_fp32, tiny_gpt2, two_group_optimizer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def make_optimizer(model, job):
    """One optimizer, or a list of them (``"muon+adamw"``)."""
    # AdamW is what fine-tuning uses, but it is blind to a wrong gradient scale;
    # SGD with momentum is not, so the matrix runs both.
    kind = job.get("optim", "adamw")
    if kind == "sgd":
        return two_group_optimizer(model, lr=job.get("lr", 0.5), cls=torch.optim.SGD, momentum=0.9)
    if kind == "adafactor":  # transformers' (the Trainer's --optim adafactor), factored on 2-D weights
        from transformers.optimization import Adafactor

        # eps[0] above its 1e-30 default: GPT-2's key bias has an exactly-zero true gradient
        # (softmax ignores it), and Adafactor would otherwise normalise its rounding noise
        # into full-size steps that differ between any two summation orders.
        return two_group_optimizer(model, lr=job.get("lr", 1e-2), cls=Adafactor, relative_step=False,
                                   scale_parameter=False, warmup_init=False, eps=(1e-10, 1e-3))
    if kind == "trust_ratio":
        return two_group_optimizer(model, lr=job.get("lr", 0.05), cls=TrustRatioSGD)
    if kind == "muon+adamw":
        if job.get("muon_fp32", True):
            muon_orthogonalise_in_fp32()
        return muon_adamw(model, lr=job.get("lr", 1e-2))
    return two_group_optimizer(model, lr=job.get("lr", 1e-2))


def _as_list(opt):
    return list(opt) if isinstance(opt, (list, tuple)) else [opt]


def build(job):
    model = tiny_gpt2(seed=job.get("seed", 0), n_layer=job.get("n_layer", 2))
    model.transformer.wpe.weight.requires_grad_(False)  # a frozen parameter
    opt = make_optimizer(model, job)
    return model, opt


def reference_run(job):
    model, _ = build(job)
    dtype = DTYPES[job["precision"]]
    ws, accum, steps = job["world_size"], job["accum"], job["steps"]
    micro = job.get("micro_batch", 2)
    batches = lm_batches(steps, ws * accum * micro)
    # fp32 masters keyed like the model; compute copy in the compute dtype.
    # autocast: fp32 parameters, forward under torch.autocast (stock autocast training).
    autocast = job.get("config", {}).get("autocast", False)
    master = {n: p.detach().clone().float() for n, p in model.named_parameters()}
    compute = copy.deepcopy(model).to(torch.float32 if autocast else dtype)
    masters = [torch.nn.Parameter(master[n]) for n, p in model.named_parameters()]
    by_name = dict(zip([n for n, _ in model.named_parameters()], masters))
    name_of = {id(p): n for n, p in model.named_parameters()}
    opts = []
    for template in _as_list(make_optimizer(model, job)):
        opt_groups = []
        for g in template.param_groups:
            ng = {k: v for k, v in g.items() if k != "params"}
            ng["params"] = [by_name[name_of[id(p)]] for p in g["params"]]
            opt_groups.append(ng)
        opts.append(type(template)(opt_groups))  # every hyperparameter is in the group dicts
    scale = float(2 ** job.get("initial_scale_power", 8)) if job["precision"] == "fp16" else 1.0
    losses = []
    cparams = dict(compute.named_parameters())
    for batch in batches:
        # Split like ZeRO does: micro-batch j of rank r.
        total = 0.0
        for p in compute.parameters():
            p.grad = None
        chunks = batch.view(ws, accum, micro, -1)
        for j in range(accum):
            for r in range(ws):
                ids = chunks[r, j]
                with torch.autocast("cpu", dtype=dtype, enabled=autocast):
                    loss = compute(input_ids=ids, labels=ids).loss
                total += float(loss) / (accum * ws)
                # Under autocast the fp16 gradients inside backward are rounded at the
                # loss's scale, so it is the engine's: 1/ws is applied to the fp32 sum
                # (exact for a power of two), as ZeRO's reduction does.
                ((loss / accum / (1 if autocast else ws)) * scale).backward()
        for n, m in by_name.items():
            g = cparams[n].grad
            m.grad = None if g is None else g.float() / scale / (ws if autocast else 1)
            if not cparams[n].requires_grad:
                m.grad = None
        if job.get("clip"):
            torch.nn.utils.clip_grad_norm_([m for m in masters if m.grad is not None], job["clip"])
        for opt in opts:
            opt.step()
        with torch.no_grad():
            for n, m in by_name.items():
                cparams[n].copy_(m)
        losses.append(total)
    return losses, {n: m.detach().clone() for n, m in by_name.items()}


def zero_run(rank, ws, job):
    import zero_strategy

    model, opt = build(job)
    accum, steps = job["accum"], job["steps"]
    micro = job.get("micro_batch", 2)
    batches = lm_batches(steps, ws * accum * micro)
    cfg = dict(stage=job["stage"], precision=job["precision"], reduce_bucket_size=job.get("bucket", 3000),
               param_persistence_threshold=job.get("persist", 64), initial_scale_power=job.get("initial_scale_power", 8),
               gradient_clipping=job.get("clip", 0.0), offload_optimizer=job.get("offload", "none"),
               activation_checkpointing=job.get("checkpointing", ()), offload_activations=job.get("offload_activations", False))
    cfg.update(job.get("config", {}))  # any other ZeroConfig field (they win over the above)
    engine = zero_strategy.initialize(model, opt, cfg)
    losses = []
    for batch in batches:
        engine.reset_comm_report()
        chunks = batch.view(ws, accum, micro, -1)
        local = 0.0
        for j in range(accum):
            ids = chunks[rank, j]
            ctx = engine.no_sync() if j < accum - 1 else _null()
            with ctx:
                loss = model(input_ids=ids, labels=ids).loss
                engine.backward(loss / accum)
            local += float(loss) / accum
        engine.step()
        t = torch.tensor([local / ws])
        dist.all_reduce(t)
        losses.append(float(t))
    sd = engine.full_state_dict()
    if job.get("with_report"):
        return losses, sd, engine.memory_report()
    if job.get("with_comm"):  # the last step's communication, by kind
        return losses, sd, engine.comm_report().as_dict(), engine.memory_report()
    return losses, sd


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False
