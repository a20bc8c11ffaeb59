"""PEFT LoRA built inside ``LightningModule.configure_model`` under the ZeRO strategies.

Under stage 3 ``configure_model`` runs inside the strategy's deferred-init context (its
parameters stay on the meta device until ``setup``).  Whatever the strategy defers,
the values after set-up must be the ones ``strategy="ddp"`` builds with the same
LightningModule, seed and data: the base model's (built from a config, or loaded with
``from_pretrained``) and PEFT's LoRA initialisation (``lora_B`` = 0, ``lora_A`` drawn
from the same point of the random stream).  Launched as tests/lightning/test_lightning.py does:
this file runs as a script, Lightning's own launcher starts the second (gloo, CPU)
process; the reference is always the ddp run, never the strategy's own output.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1] / "support"))

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "zero3-p0")  # zero3-p0: param_persistence_threshold=0 (all partitioned)
MODELS = ("llama-config", "gpt2-pretrained", "gpt2-config")  # gpt2-config: tied embeddings, matrices over 100k elements
# Each rank seeded differently in configure_model: ddp broadcasts rank 0's values, zero3 must give the same model.
RANK_SEEDED = ("llama-rank-seeded", ("ddp", "zero3", "zero3-p0"))
STEPS = 3


# ======================================================================================
# the pytest side
# ======================================================================================
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    pytest.importorskip("peft")
    pytest.importorskip("transformers")
    from test_lightning import _run

    out = tmp_path_factory.mktemp("lightning_peft")
    _run(HERE, out, timeout=300)
    return out


def _state(out, tag):
    import torch

    return torch.load(Path(out) / f"{tag}.pt", weights_only=True)


def _record(out, tag, rank):
    return json.loads((Path(out) / f"{tag}.rank{rank}.json").read_text())


CASES = [(m, s) for m in MODELS for s in STRATEGIES[1:]] + [(RANK_SEEDED[0], s) for s in RANK_SEEDED[1][1:]]


@pytest.mark.slow
@pytest.mark.parametrize("model,strategy", CASES)
def test_lora_in_configure_model_matches_ddp(runs, model, strategy):
    import torch

    ref, got = _state(runs, f"{model}-ddp"), _state(runs, f"{model}-{strategy}")
    assert sorted(got) == sorted(ref)
    lora_b = [k for k in ref if ".lora_B." in k]
    lora_a = [k for k in ref if ".lora_A." in k]
    assert lora_b and len(lora_a) == len(lora_b)
    assert all(torch.count_nonzero(ref[k]) == 0 for k in lora_b)  # the reference is PEFT's own init
    differ = [k for k in ref if got[k].dtype != ref[k].dtype or not torch.equal(got[k], ref[k])]
    assert not differ, f"{strategy}: {len(differ)} of {len(ref)} tensors differ from ddp after set-up: {differ[:8]}"
    assert all(torch.count_nonzero(got[k]) == 0 for k in lora_b)
    for r in (0, 1):
        g, d = _record(runs, f"{model}-{strategy}", r), _record(runs, f"{model}-ddp", r)
        assert len(g["losses"]) == len(d["losses"]) == STEPS
        for i, (x, y) in enumerate(zip(g["losses"], d["losses"])):
            assert abs(x - y) <= 1e-6 * abs(y), f"{strategy} rank {r} step {i}: {x} vs ddp {y}"
        assert g["losses"][-1] != g["losses"][0]  # the adapters train
        if strategy.startswith("zero3"):
            assert g["meta_in_configure"] is True  # still deferred: no parameter memory while building
        assert d["meta_in_configure"] is False


# ======================================================================================
# one process: the recording itself (no engine)
# ======================================================================================
def _built(build, seed=0):
    """``build()`` eagerly and inside the stage-3 context, from the same seed; the random
    number drawn right after each."""
    import torch

    from zero_strategy import ZeroConfig
    from zero_strategy.integrations.lightning import _common

    torch.manual_seed(seed)
    eager = build()
    eager_next = torch.rand(4)
    torch.manual_seed(seed)
    with _common.partitioned_init(ZeroConfig(stage=3)):
        deferred = build()
    return eager, eager_next, deferred, torch.rand(4)


def _replayed(p):
    import torch

    from zero_strategy.materialize.recording import RECIPE_ATTR, _replay_into

    out = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype))
    _replay_into(out, getattr(p, RECIPE_ATTR))
    return out


def test_recorded_recipes_replay_an_eager_build_exactly():
    import torch
    from torch import nn

    pytest.importorskip("peft")
    pytest.importorskip("transformers")
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    class Odd(nn.Module):  # inits written in place after construction, and a parameter with computed values
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(6, 5)
            nn.init.trunc_normal_(self.a.weight, std=0.3)
            nn.init.xavier_normal_(self.a.weight)  # twice: the last one counts, both draw
            nn.init.orthogonal_(self.a.weight)
            self.a.weight.data[0].mul_(3.0)
            with torch.no_grad():
                self.a.bias[1:3] = 0.5
            self.scale = nn.Parameter(torch.randn(5) * 0.1)  # not a constant: kept, not deferred

    def build():
        lm = get_peft_model(LlamaForCausalLM(_llama_config()), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
        return nn.ModuleList([lm, Odd()])

    eager, eager_next, deferred, deferred_next = _built(build)
    assert torch.equal(eager_next, deferred_next)  # the random stream advanced as in the eager build
    ref = dict(eager.named_parameters())
    for name, p in deferred.named_parameters():
        if name.endswith("scale"):
            assert not p.is_meta and torch.equal(p, ref[name])
            continue
        assert p.is_meta, name
        assert torch.equal(_replayed(p), ref[name]), name
    assert all(torch.count_nonzero(p) == 0 for n, p in eager.named_parameters() if "lora_B" in n)


def test_a_value_that_cannot_be_replayed_is_an_error_naming_it():
    import torch
    from torch import nn

    from zero_strategy.materialize.recording import check_replayable

    def build():
        m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        with torch.no_grad():
            m[1].weight.copy_(m[0].weight)  # from another deferred parameter: no values exist yet
        return m

    eager, eager_next, deferred, deferred_next = _built(build)
    assert torch.equal(eager_next, deferred_next)
    with pytest.raises(ValueError) as info:
        check_replayable(deferred)
    message = str(info.value)
    assert "1 parameter(s)" in message and "1.weight (Tensor.copy_ reads a tensor on the meta device" in message


# ======================================================================================
# the workload (run as a script)
# ======================================================================================
def _llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=64, tie_word_embeddings=False)


def _main(out: Path) -> None:
    import lightning.pytorch as pl
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaForCausalLM

    transformers.logging.set_verbosity_error()
    out.mkdir(parents=True, exist_ok=True)
    gpt2 = out / "gpt2"
    if not (gpt2 / "model.safetensors").exists():  # rank 0 first: the launcher starts rank 1 at the first Trainer
        torch.manual_seed(5)
        GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                                   embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)).save_pretrained(gpt2)

    class LoRA(pl.LightningModule):
        def __init__(self, source):
            super().__init__()
            self.source, self.lm, self.losses, self.meta_in_configure = source, None, [], None

        def configure_model(self):
            if self.lm is not None:
                return
            if self.source == RANK_SEEDED[0]:
                torch.manual_seed(100 + self.global_rank)
            if self.source == "gpt2-config":
                base, targets = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=192, n_layer=2, n_head=4,
                                                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                                           bos_token_id=0, eos_token_id=0)), ["c_attn"]
            elif self.source != "gpt2-pretrained":
                base, targets = LlamaForCausalLM(_llama_config()), ["q_proj", "v_proj"]
            else:
                base, targets = AutoModelForCausalLM.from_pretrained(gpt2), ["c_attn"]
            self.lm = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0,
                                                      fan_in_fan_out=self.source.startswith("gpt2")))
            self.meta_in_configure = any(p.is_meta for p in self.lm.parameters())

        def training_step(self, batch, batch_idx):
            (ids,) = batch
            loss = self.lm(input_ids=ids, labels=ids).loss
            self.losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)

    class AfterSetup(pl.Callback):
        """The whole state right after set-up, before the first step (rank 0 writes it)."""

        def __init__(self, tag):
            self.tag = tag

        def on_train_start(self, trainer, module):
            engine = getattr(trainer.strategy, "engine", None)
            if engine is not None:
                sd = engine.full_state_dict(rank0_only=True)
            else:
                sd = module.state_dict()
            if trainer.global_rank == 0:
                torch.save({k: v.detach().cpu().clone() for k, v in sd.items()}, out / f"{self.tag}.pt")

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randint(0, 64, (8 * STEPS, 12), generator=g)),
                                       batch_size=4)
    for source, strategies in [*((m, STRATEGIES) for m in MODELS), RANK_SEEDED]:
        for s in strategies:
            strategy = s
            if s == "zero3-p0":
                from zero_strategy.integrations.lightning import ZeroStrategy

                strategy = ZeroStrategy(stage=3, param_persistence_threshold=0)
            tag = f"{source}-{s}"
            pl.seed_everything(0, verbose=False)
            model = LoRA(source)
            trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS, logger=False,
                                 enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                 num_sanity_val_steps=0, callbacks=[AfterSetup(tag)])
            trainer.fit(model, data)
            (out / f"{tag}.rank{trainer.global_rank}.json").write_text(
                json.dumps({"losses": model.losses, "meta_in_configure": model.meta_in_configure}))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    _main(Path(sys.argv[1]))
