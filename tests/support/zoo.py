"""Tiny models of the architectures users bring, built from configs (nothing is
downloaded), each with a batch maker and a loss: GPT-2, Llama, Mistral, Qwen2, Mixtral,
T5, BERT, ViT, torch.nn.Transformer, a mixture of experts whose experts sit in an
nn.ModuleList, and a stack of 500 small Linear layers.  Also two usage patterns that
read a parameter outside its own module's forward: a fused-loss head that multiplies
by ``lm_head.weight`` directly (as TRL does), and a parent module that uses a child's
weight."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, SEQ, D = 64, 8, 32


def _hf(kind: str):
    import transformers as t

    common = dict(vocab_size=VOCAB, hidden_size=D, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=32)
    if kind == "gpt2":
        return t.GPT2LMHeadModel(t.GPT2Config(vocab_size=VOCAB, n_embd=D, n_layer=2, n_head=4, n_positions=32,
                                              resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    if kind == "llama":
        return t.LlamaForCausalLM(t.LlamaConfig(**common))
    if kind == "mistral":
        return t.MistralForCausalLM(t.MistralConfig(**common))
    if kind == "qwen2":
        return t.Qwen2ForCausalLM(t.Qwen2Config(**common))
    if kind == "mixtral":
        return t.MixtralForCausalLM(t.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2,
                                                    router_jitter_noise=0.0))
    if kind == "t5":
        return t.T5ForConditionalGeneration(t.T5Config(vocab_size=VOCAB, d_model=D, d_ff=64, d_kv=8, num_layers=2,
                                                       num_heads=4, dropout_rate=0.0, decoder_start_token_id=0))
    if kind == "bert":
        return t.BertForMaskedLM(t.BertConfig(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=2, num_attention_heads=4,
                                              intermediate_size=64, hidden_dropout_prob=0.0,
                                              attention_probs_dropout_prob=0.0, max_position_embeddings=32))
    if kind == "vit":
        return t.ViTForImageClassification(t.ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=D,
                                                       num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                                       num_labels=5))
    raise KeyError(kind)


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))


class MoEBlock(nn.Module):
    """Soft-gated: every expert gets every token (unused experts are tested elsewhere)."""

    def __init__(self, n_experts: int = 4) -> None:
        super().__init__()
        self.gate = nn.Linear(D, n_experts)
        self.experts = nn.ModuleList(Expert() for _ in range(n_experts))
        self.norm = nn.LayerNorm(D)

    def forward(self, x):
        w = torch.softmax(self.gate(x), dim=-1)
        out = sum(w[..., i : i + 1] * e(x) for i, e in enumerate(self.experts))
        return self.norm(x + out)


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(MoEBlock() for _ in range(2))
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids):
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class TorchTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.core = nn.Transformer(d_model=D, nhead=4, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=64,
                                   dropout=0.0, batch_first=True)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids):
        x = self.embed(ids)
        return self.head(self.core(x, x))


class ManyLinear(nn.Module):
    def __init__(self, n: int = 500, width: int = 8) -> None:
        super().__init__()
        self.inp = nn.Linear(D, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(n))
        self.out = nn.Linear(width, 5)

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = x + 0.1 * torch.tanh(layer(x))
        return self.out(x)


class FusedHeadLM(nn.Module):
    """A causal LM whose forward returns hidden states; the loss (``loss_of``) then reads
    ``lm.lm_head.weight`` directly, after the model's forward, as TRL's fused loss does."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = _hf("llama")

    def forward(self, ids):
        return self.lm.model(input_ids=ids).last_hidden_state


class Child(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(D, D)

    def forward(self, x):
        return torch.tanh(self.proj(x))


class ParentUsesChildWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.children_ = nn.ModuleList(Child() for _ in range(2))
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids):
        x = self.embed(ids)
        for c in self.children_:
            x = c(x) + x @ c.proj.weight  # the parent uses the child's weight after the child ran
        return self.head(x)


NAMES = ("gpt2", "llama", "mistral", "qwen2", "mixtral", "t5", "bert", "vit", "torch_transformer", "moe", "many_linear",
         "fused_head", "parent_child")


def build_model(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if name in ("gpt2", "llama", "mistral", "qwen2", "mixtral", "t5", "bert", "vit"):
        return _hf(name)
    return {"torch_transformer": TorchTransformer, "moe": MoE, "many_linear": ManyLinear, "fused_head": FusedHeadLM,
            "parent_child": ParentUsesChildWeight}[name]()


def make_batches(name: str, steps: int, global_batch: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        if name == "vit":
            out.append({"pixel_values": torch.randn(global_batch, 3, 8, 8, generator=g),
                        "labels": torch.randint(0, 5, (global_batch,), generator=g)})
        elif name == "many_linear":
            out.append({"x": torch.randn(global_batch, D, generator=g), "y": torch.randint(0, 5, (global_batch,), generator=g)})
        else:
            out.append({"ids": torch.randint(1, VOCAB, (global_batch, SEQ), generator=g)})
    return out


def shard(batch: dict, rank: int, world: int) -> dict:
    return {k: v.chunk(world)[rank] for k, v in batch.items()}


def loss_of(name: str, model: nn.Module, batch: dict) -> torch.Tensor:
    if name == "vit":
        return model(pixel_values=batch["pixel_values"], labels=batch["labels"]).loss
    if name == "many_linear":
        return F.cross_entropy(model(batch["x"]).float(), batch["y"])
    ids = batch["ids"]
    if name == "t5":
        return model(input_ids=ids, labels=ids.flip(-1)).loss
    if name == "bert":
        return model(input_ids=ids, labels=ids).loss
    if name in ("gpt2", "llama", "mistral", "qwen2", "mixtral"):
        return model(input_ids=ids, labels=ids).loss
    if name == "fused_head":
        logits = (model(ids) @ model.lm.lm_head.weight.t()).float()  # outside every forward
    else:
        logits = model(ids).float()
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def train_on_engine(name: str, run, engine, rank: int, world: int, steps: int, global_batch: int) -> list:
    """``steps`` ZeRO steps of ``name`` on this rank's share of each global batch
    (``run``: the model, or its compiled wrapper); returns the global mean loss per step
    (a collective: every rank calls it)."""
    import torch.distributed as dist

    losses = []
    for batch in make_batches(name, steps, global_batch):
        loss = loss_of(name, run, shard(batch, rank, world))
        engine.backward(loss)
        engine.step()
        t = loss.detach().float().reshape(1) / world
        dist.all_reduce(t)
        losses.append(float(t))
    return losses


def enable_hf_gradient_checkpointing(model) -> None:
    """transformers' own gradient checkpointing (non-reentrant), under either of its names."""
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x's name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
