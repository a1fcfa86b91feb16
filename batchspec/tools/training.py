"""Small-model training on CPU, shared by the demo-family build and `batchspec distill`:
model construction, a step-or-time budget with a cosine schedule, a resumable training loop
and export to a Hugging Face directory in bf16 safetensors."""
from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Callable

import torch
from tqdm import tqdm


def new_llama(tokenizer, *, hidden_size: int, num_layers: int, num_heads: int,
              num_kv_heads: int, intermediate_size: int, max_position_embeddings: int = 2048,
              seed: int = 0):
    """A freshly initialised Llama whose vocabulary is the tokenizer's (tied embeddings: at
    this size the embedding table is a large share of the parameters)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    eos = tokenizer.eos_token_id
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size, max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True, rope_theta=10000.0, initializer_range=0.02,
        bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def load_llama(path: str):
    """An HF model directory as a trainable fp32 model."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def save_hf(model, tokenizer, out_dir: str, dtype=torch.bfloat16) -> str:
    """Write model (cast to `dtype`) and tokenizer to out_dir, replacing it atomically."""
    tmp = out_dir.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    # Cast a copy: the caller's fp32 weights may still be trained further.
    state_dict = {k: v.detach().to(dtype) for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:  # one copy of the shared matrix, as HF saves it
        state_dict.pop("lm_head.weight", None)
    model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
    # save_pretrained records the in-memory (fp32) dtype; record the one stored on disk
    cfg_path = os.path.join(tmp, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["dtype"] = str(dtype).removeprefix("torch.")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    return out_dir


def lr_at(progress: float, peak: float, warmup: float = 0.03, floor: float = 0.1) -> float:
    """Linear warm-up, then cosine decay to floor * peak, over progress in [0, 1]."""
    if progress < warmup:
        return peak * (progress + 1e-3) / warmup
    t = min(1.0, (progress - warmup) / (1.0 - warmup))
    return peak * (floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * t)))


def train(model, loss_fn: Callable[[int], torch.Tensor], *, steps: int | None,
          seconds: float | None, lr: float, ckpt_path: str | None = None,
          ckpt_every_s: float = 60.0, desc: str = "train",
          autocast: bool | None = None) -> dict:
    """Run AdamW on loss_fn(step) until `steps` or `seconds` is spent, whichever first.
    autocast: bf16 autocast of loss_fn, weights fp32 (None: where the CPU multiplies bf16
    in hardware, config.cpu_has_native_bf16; elsewhere bf16 is emulated: a distillation
    step of the demo's code draft took 10-11 s under it on an AVX2 CPU, 1.3-1.4 s in fp32).

    Progress (for the learning-rate schedule) is the larger of the two fractions, so a
    time-budgeted run still anneals. loss_fn must derive its batch from the step index alone,
    which makes a resumed run see the same data as an uninterrupted one."""
    assert steps or seconds, "give a step or a time budget"
    if autocast is None:
        from batchspec.config import cpu_has_native_bf16
        autocast = cpu_has_native_bf16()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    state = {"step": 0, "elapsed": 0.0, "losses": []}
    if ckpt_path and os.path.exists(ckpt_path):
        saved = torch.load(ckpt_path, weights_only=True)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        state = saved["state"]

    def progress():
        return max(state["step"] / steps if steps else 0.0,
                   state["elapsed"] / seconds if seconds else 0.0)

    def save():
        if ckpt_path:
            tmp = ckpt_path + ".tmp"
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "state": state}, tmp)
            os.replace(tmp, ckpt_path)

    model.train()
    bar = tqdm(total=100, initial=int(100 * progress()), desc=desc, unit="%",
               bar_format="{l_bar}{bar}| {n_fmt}% [{elapsed}<{remaining}{postfix}]")
    last_save = time.monotonic()
    while progress() < 1.0:
        t0 = time.monotonic()
        for group in opt.param_groups:
            group["lr"] = lr_at(progress(), lr)
        # bf16 autocast: about 1.5x faster on CPUs with AVX512-BF16; weights stay fp32.
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = loss_fn(state["step"])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        state["step"] += 1
        state["elapsed"] += time.monotonic() - t0
        state["losses"].append(round(loss.item(), 4))
        bar.update(int(100 * progress()) - bar.n)
        bar.set_postfix(step=state["step"], loss=f"{loss.item():.3f}", refresh=False)
        if time.monotonic() - last_save > ckpt_every_s:
            save()
            last_save = time.monotonic()
    bar.close()
    save()
    model.eval()
    return state
