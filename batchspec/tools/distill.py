"""`batchspec distill`: train a small draft model on its target's own outputs.

Sequence-level distillation (as in DistillSpec, Zhou et al. 2023, arXiv 2310.08461): the
target continues training prompts (half greedily, half sampled at T=1, so the draft sees both
the greedy chain and the target's spread), then the draft is trained to match the target's
next-token distribution at every position of those sequences with a forward KL loss. The
acceptance rate of speculative decoding is 1 - TV(p, q) per token, which the KL bounds, so
this is the loss that raises α. Ends with a held-out α measurement before and after."""
from __future__ import annotations

import json
import os
import shutil
from typing import TYPE_CHECKING

import click

from batchspec.jobs.commands import clear_errors
from batchspec.tools.evaluate import Finite, evaluate_pair, load_prompts

if TYPE_CHECKING:
    import torch

# The bundled drafts: one layer, hidden 192; head_dim 64 like the target.
DRAFT_SIZE = dict(hidden_size=192, num_layers=1, num_heads=3, num_kv_heads=1,
                  intermediate_size=576)


def make_sequences(target_model, tok, prompts: list[dict], *, max_tokens: int, seed: int):
    """(prompt_ids, continuation_ids) per prompt: even prompts greedy, odd ones at T=1."""
    from batchspec.tools import hfref
    ids = [tok(p["prompt"], add_special_tokens=False)["input_ids"] for p in prompts]
    conts: list = [None] * len(ids)
    for parity, temperature in ((0, 0.0), (1, 1.0)):
        sub = list(range(parity, len(ids), 2))
        gen = hfref.generate(target_model, [ids[i] for i in sub], max_tokens=max_tokens,
                             temperature=temperature, eos_id=tok.eos_token_id, seed=seed,
                             desc=f"target continuations T={temperature}")
        for i, c in zip(sub, gen):
            conts[i] = c
    return ids, conts


def kl_loss(target_model, draft_model, prompts, conts, step: int, *, batch_size: int,
            pad_id: int, seed: int) -> torch.Tensor:
    """Mean forward KL(p_target || q_draft) over all predicted positions of a batch drawn
    from the step index (so a resumed run sees the same batches)."""
    import torch

    from batchspec.tools import hfref
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    idx = torch.randint(0, len(prompts), (batch_size,), generator=g).tolist()
    rows = [prompts[i] + conts[i] for i in idx]
    ids, mask = hfref.padded(rows, pad_id, left=False)
    with torch.no_grad():
        logp = torch.log_softmax(
            target_model(input_ids=ids, attention_mask=mask).logits.float(), -1)  # (B, T, V)
    logq = torch.log_softmax(draft_model(input_ids=ids, attention_mask=mask).logits.float(), -1)
    kl = (logp.exp() * (logp - logq)).sum(-1)  # (B, T)
    weight = mask.clone().float()
    weight[torch.arange(len(rows)), mask.sum(1) - 1] = 0  # the last token predicts nothing
    return (kl * weight).sum() / weight.sum()


def distill_draft(target: str, out_dir: str, *, data: str | None = None,
                  domain: str | None = None, init: str | None = None,
                  steps: int | None = None, seconds: float | None = 300.0,
                  num_prompts: int = 1024, gen_tokens: int = 96, batch_size: int = 16,
                  lr: float | None = None, size: dict | None = None, seed: int = 0,
                  eval_data: str | None = None, eval_prompts: int = 64, k: int = 4,
                  work_dir: str | None = None) -> dict:
    """Distil a draft for `target` into out_dir; returns the report also written to
    out_dir/distill.json. Work files (generated sequences, checkpoint) live in work_dir
    (default OUT.work) and are removed on success; re-running resumes from them."""
    import torch

    from batchspec.tools import hfref
    from batchspec.tools.training import load_llama, new_llama, save_hf, train
    if not (steps or seconds):
        raise ValueError("give a step or a time budget")
    # What can fail does so before the target generates: paths, vocabularies, prompts.
    hfref.check_vocabularies(target, [init] if init else [])
    prompts = load_prompts(data, domain, num_prompts, split="train", seed=seed)
    held_out = load_prompts(eval_data, domain, eval_prompts, split="heldout",
                            seed=seed + 1) if eval_prompts else []
    work_dir = work_dir or out_dir.rstrip("/") + ".work"
    try:
        os.makedirs(work_dir, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot write {out_dir}: {e.strerror} ({work_dir})") from None
    tok = hfref.load_tokenizer(target)
    target_model = hfref.load_causal_lm(target)
    draft_model = load_llama(init) if init else new_llama(tok, **(size or DRAFT_SIZE), seed=seed)
    if draft_model.config.vocab_size != target_model.config.vocab_size:
        raise ValueError(f"the draft's vocabulary ({draft_model.config.vocab_size} tokens) "
                         f"differs from the target's ({target_model.config.vocab_size})")

    seq_path = os.path.join(work_dir, "sequences.pt")
    if os.path.exists(seq_path):
        seqs = torch.load(seq_path, weights_only=True)
    else:
        ids, conts = make_sequences(target_model, tok, prompts, max_tokens=gen_tokens, seed=seed)
        seqs = {"prompts": ids, "continuations": conts}
        torch.save(seqs, seq_path)

    state = train(
        draft_model,
        lambda step: kl_loss(target_model, draft_model, seqs["prompts"], seqs["continuations"],
                             step, batch_size=batch_size, pad_id=tok.eos_token_id, seed=seed),
        steps=steps, seconds=seconds, lr=lr or (1e-3 if init else 3e-3),
        ckpt_path=os.path.join(work_dir, "checkpoint.pt"), desc="distill")
    save_hf(draft_model, tok, out_dir)
    for name in os.listdir(out_dir):
        if name.endswith(".safetensors"):
            hfref.umask_mode(os.path.join(out_dir, name))

    report = {"target": target, "init": init, "domain": domain, "data": data,
              "num_sequences": len(seqs["prompts"]), "steps": state["step"],
              "train_seconds": round(state["elapsed"], 1),
              "final_kl": round(sum(state["losses"][-20:]) / max(1, len(state["losses"][-20:])), 4)}
    if held_out:
        for name, path in (("before", init), ("after", out_dir)):
            if path:
                res = evaluate_pair(target, path, held_out, k=k, seed=seed)
                report[f"alpha_{name}"] = res["overall"]["acceptance_rate"]
                report[f"alpha_{name}_by_domain"] = {
                    d: s["acceptance_rate"] for d, s in res["by_domain"].items()}
    with open(os.path.join(out_dir, "distill.json"), "w") as f:
        json.dump(report, f, indent=1)
    shutil.rmtree(work_dir, ignore_errors=True)
    return report


@click.command()
@click.option("--target", required=True, envvar="BATCHSPEC_TARGET", help="Target model dir.")
@click.option("-o", "--output", "out_dir", required=True, help="Where to write the draft.")
@click.option("--data", type=click.Path(exists=True, dir_okay=False),
              help="Parquet of training prompts (prompt [, domain]); default: the standard "
                   "library corpus (training split).")
@click.option("--domain", help="Only prompts of this domain.")
@click.option("--init", type=click.Path(exists=True, file_okay=False),
              help="Start from this draft (e.g. the general draft for a domain draft).")
@click.option("--steps", type=click.IntRange(min=1), help="Stop after this many optimizer steps.")
@click.option("--time-budget", "seconds", type=Finite(min=0, min_open=True),
              help="Stop after this many seconds of training (default 300 when --steps is "
              "not given).")
@click.option("--num-prompts", type=click.IntRange(min=1), default=1024, show_default=True)
@click.option("--gen-tokens", type=click.IntRange(min=1), default=96, show_default=True,
              help="Target tokens generated per prompt.")
@click.option("--batch-size", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--lr", type=Finite(min=0, min_open=True),
              help="Peak learning rate (default 3e-3, 1e-3 with --init).")
@click.option("--eval-data", type=click.Path(exists=True, dir_okay=False),
              help="Parquet of held-out prompts for the final α; default: the standard "
                   "library corpus (held-out split).")
@click.option("--eval-prompts", type=click.IntRange(min=0), default=64, show_default=True,
              help="Held-out prompts for the final α (0: skip).")
@click.option("--seed", type=int, default=0, show_default=True)
@clear_errors
def distill(target, out_dir, data, domain, init, steps, seconds, num_prompts, gen_tokens,
            batch_size, lr, eval_data, eval_prompts, seed):
    """Distil a draft model for TARGET from the target's own outputs."""
    if steps is None and seconds is None:
        seconds = 300.0
    report = distill_draft(target, out_dir, data=data, domain=domain, init=init, steps=steps,
                           seconds=seconds, num_prompts=num_prompts, gen_tokens=gen_tokens,
                           batch_size=batch_size, lr=lr, seed=seed, eval_data=eval_data,
                           eval_prompts=eval_prompts)
    click.echo(json.dumps(report, indent=1))


COMMANDS = [distill]
