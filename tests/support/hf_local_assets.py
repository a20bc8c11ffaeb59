"""Local stand-ins for what Hugging Face client scripts fetch from the hub: a text file,
a tokenizer trained on it with the `tokenizers` library, and a tiny GPT-2 built from a
config and written with ``save_pretrained`` (tokenizer files in the same folder, as a
hub repository has them).  Used by tests/transformers/test_run_clm.py and tests/transformers/test_trl_sft.py.

Dropout is off in the saved config: a per-step comparison with DDP should not depend on
how each run consumes the random number stream.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = ("the cat dog bird sat ran flew on under over a red blue green small big mat tree sky house "
         "quickly slowly and then saw heard near far old new").split()


def write_text(path: Path, lines: int = 240, seed: int = 0, words_per_line: int | None = None) -> Path:
    """Short sentences of a small vocabulary, one per line (a corpus a tiny model can learn).
    With ``words_per_line`` every line has that many words, so the file holds exactly
    ``lines * words_per_line`` tokens of the word-level tokenizer below."""
    rng = random.Random(seed)
    text = "\n".join(" ".join(rng.choice(WORDS) for _ in range(words_per_line or rng.randint(4, 12)))
                     for _ in range(lines))
    path.write_text(text + "\n")
    return path


def write_sft_jsonl(path: Path, rows: int = 48, seed: int = 1) -> Path:
    """A `text` column dataset in JSON lines, the form TRL's SFTTrainer takes for language modelling."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(rows):
            f.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 14)))}) + "\n")
    return path


def save_tokenizer(folder: Path, corpus: Path, model_max_length: int = 64):
    """A word-level tokenizer trained on ``corpus``; saved as a fast tokenizer that
    AutoTokenizer loads from ``folder``. Returns the loaded tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train([str(corpus)], trainers.WordLevelTrainer(special_tokens=["<eos>", "<unk>", "<pad>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>", pad_token="<pad>",
                                   bos_token="<eos>", model_max_length=model_max_length)
    fast.save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


def save_tiny_gpt2(folder: Path, corpus: Path, seed: int = 5, n_positions: int = 64) -> Path:
    """Tokenizer and a 2-block GPT-2 of width 32 (tied lm_head) in ``folder``."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    if (folder / "config.json").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = save_tokenizer(folder, corpus, model_max_length=n_positions)
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=n_positions, n_embd=32, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=tokenizer.eos_token_id,
                        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    GPT2LMHeadModel(config).save_pretrained(folder)
    return folder


def save_tiny_llama(folder: Path, corpus: Path, seed: int = 6) -> Path:
    """Tokenizer and a 2-layer Llama of width 32 whose lm_head is its own weight (not tied
    to the embedding), in ``folder``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (folder / "config.json").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = save_tokenizer(folder, corpus)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, bos_token_id=tokenizer.eos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder
