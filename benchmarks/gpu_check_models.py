"""The GPU check's models: transformers' GPT-2 and Llama built from configs, or, where
transformers is not installed (the GPU machine's Python is not known in advance), small
pure-torch stand-ins with the same parameter shapes, so every part still runs.

The stand-ins match the parameter count and the work per token of the transformers models
(pre-norm blocks, causal SDPA attention, GPT-2's tied embedding and learned positions,
Llama's RMSNorm, SwiGLU and untied head); they leave out what does not change memory or
the step's matrix work: dropout (off in the check anyway) and Llama's rotary embedding.
"""
from __future__ import annotations

import collections
import types

import torch
import torch.nn as nn
import torch.nn.functional as F

IMPLEMENTATIONS = ("auto", "transformers", "builtin")


def use_transformers(choice: str) -> bool:
    if choice == "builtin":
        return False
    try:
        import transformers  # noqa: F401
    except ImportError:
        if choice == "transformers":
            raise
        return False
    return True


def implementation_name(choice: str) -> str:
    if use_transformers(choice):
        import transformers

        return f"transformers {transformers.__version__}"
    return "built-in pure-torch stand-ins (gpu_check_models.py)"


def gpt2(gpt: dict, choice: str = "auto") -> nn.Module:
    """GPT-2 from ``gpt`` (n_layer, n_embd, n_head, vocab_size, n_positions), no dropout."""
    if use_transformers(choice):
        from transformers import GPT2Config, GPT2LMHeadModel

        # No special tokens: nothing is generated, and GPT-2's 50256 lies outside a tiny vocabulary.
        cfg = GPT2Config(**gpt, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                         attn_implementation="sdpa", bos_token_id=None, eos_token_id=None)
        return GPT2LMHeadModel(cfg)
    return GPT(**gpt)


def llama_config(llama: dict, choice: str = "auto"):
    if use_transformers(choice):
        from transformers import LlamaConfig

        return LlamaConfig(**llama, tie_word_embeddings=False, use_cache=False)
    return types.SimpleNamespace(rms_norm_eps=1e-6, **llama)


def llama(cfg, choice: str = "auto") -> nn.Module:
    if use_transformers(choice):
        from transformers import LlamaForCausalLM

        return LlamaForCausalLM(cfg)
    return Llama(cfg)


# A namedtuple, not a SimpleNamespace: stage 3 finds the output's tensors with torch's pytree
# to hook the re-gather for backward, and pytree does not look inside a SimpleNamespace.
CausalLMOutput = collections.namedtuple("CausalLMOutput", "loss logits")


def _causal_lm_loss(logits, labels):
    # Next-token loss in fp32, as transformers computes it.
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())


def _attend(q, k, v, heads):
    b, s, h = q.shape
    q, k, v = (t.view(b, s, heads, -1).transpose(1, 2) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)


class GPTBlock(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(n_embd)
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.attn_proj = nn.Linear(n_embd, n_embd)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.mlp_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        q, k, v = self.c_attn(self.ln_1(x)).chunk(3, dim=-1)
        x = x + self.attn_proj(_attend(q, k, v, self.n_head))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    _no_split_modules = ["GPTBlock"]

    def __init__(self, n_layer, n_embd, n_head, vocab_size, n_positions):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(n_positions, n_embd)
        self.h = nn.ModuleList(GPTBlock(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as GPT-2's
        self.apply(self._init_weights)

    def _init_weights(self, module):
        # GPT-2's N(0, 0.02) weights and zero biases (LayerNorms keep their ones / zeros).
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, 0.0, 0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    def forward(self, input_ids, labels=None):
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.wte(input_ids) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return CausalLMOutput(None if labels is None else _causal_lm_loss(logits, labels), logits)


class RMSNorm(nn.Module):
    def __init__(self, width, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width))

    def reset_parameters(self):
        nn.init.ones_(self.weight)

    def forward(self, x):
        y = x.float()
        return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.q_proj = nn.Linear(h, h, bias=False)
        self.k_proj = nn.Linear(h, kv, bias=False)
        self.v_proj = nn.Linear(h, kv, bias=False)
        self.o_proj = nn.Linear(h, h, bias=False)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x):
        y = self.input_layernorm(x)
        q, k, v = self.q_proj(y), self.k_proj(y), self.v_proj(y)
        if self.kv_heads != self.heads:  # grouped-query attention: repeat the KV heads
            rep = self.heads // self.kv_heads
            b, s, _ = k.shape
            k, v = (t.view(b, s, self.kv_heads, 1, -1).expand(-1, -1, -1, rep, -1).reshape(b, s, -1) for t in (k, v))
        x = x + self.o_proj(_attend(q, k, v, self.heads))
        y = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))


class Llama(nn.Module):
    _no_split_modules = ["LlamaDecoderLayer"]

    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def _init_weights(self, module):
        # transformers' convention (zero_strategy's deferred init calls it per module).
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, 0.0, 0.02)
        elif isinstance(module, RMSNorm):
            module.reset_parameters()

    def forward(self, input_ids, labels=None):
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.norm(x))
        return CausalLMOutput(None if labels is None else _causal_lm_loss(logits, labels), logits)
