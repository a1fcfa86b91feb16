"""Small random models in Hugging Face format, made locally (nothing is downloaded).

Used by the tests, by benchmarks that need a model of a given size, and as a stand-in pair
when no trained models are at hand. A byte-level BPE tokenizer is trained on text from the
Python standard library so that string prompts work end to end."""
from __future__ import annotations

import inspect
import os

ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _stdlib_text() -> str:
    import json
    import string
    import textwrap
    return "\n".join(inspect.getsource(m) for m in (textwrap, string, json))


def build_tokenizer(out_dir: str, vocab_size: int = 512, text: str | None = None):
    """Train a byte-level BPE on `text` (default: a few stdlib modules) and save it in HF
    format to out_dir. Returns the PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([text or _stdlib_text()], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   bos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    os.makedirs(out_dir, exist_ok=True)
    fast.save_pretrained(out_dir)
    return fast


def make_random_model(out_dir: str, arch: str = "llama", *, vocab_size: int = 512,
                      hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                      num_kv_heads: int = 2, intermediate_size: int | None = None,
                      max_position_embeddings: int = 1024, tie_word_embeddings: bool = False,
                      rope_theta: float = 10000.0, seed: int = 0, tokenizer: bool = True,
                      init_std: float = 0.02, dtype: str = "float32", **extra) -> str:
    """Write a randomly initialised model of the given architecture to out_dir (config.json,
    model.safetensors and, if `tokenizer`, a trained tokenizer). Returns out_dir."""
    import torch
    import transformers

    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {sorted(ARCHS)}")
    os.makedirs(out_dir, exist_ok=True)
    eos_id = None
    if tokenizer:
        tok = build_tokenizer(out_dir, vocab_size=vocab_size)
        vocab_size = max(vocab_size, len(tok))
        eos_id = tok.eos_token_id
    cfg_cls, model_cls = (getattr(transformers, n) for n in ARCHS[arch])
    kwargs = dict(vocab_size=vocab_size, hidden_size=hidden_size,
                  num_hidden_layers=num_layers, num_attention_heads=num_heads,
                  num_key_value_heads=num_kv_heads,
                  intermediate_size=intermediate_size or 4 * hidden_size,
                  max_position_embeddings=max_position_embeddings,
                  tie_word_embeddings=tie_word_embeddings, rope_theta=rope_theta,
                  initializer_range=init_std, eos_token_id=eos_id, bos_token_id=eos_id,
                  pad_token_id=eos_id)
    if arch == "qwen3":
        kwargs["head_dim"] = hidden_size // num_heads
    kwargs.update(extra)
    config = cfg_cls(**kwargs)
    torch.manual_seed(seed)
    model = model_cls(config).to(getattr(torch, dtype))
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir
