"""transformers reference paths used around the engine: batched (left-padded) generation and
teacher-forced acceptance of a draft on a target's own continuations.

The acceptance measure replays speculative decoding on a fixed target continuation y: a draft
token at a position where the target emitted y_i is accepted with probability
min(1, q(y_i) / p(y_i)) (Leviathan et al. 2023: P(accept, y) = min(p, q)(y) and P(y) = p(y)),
which at temperature 0 is 1 exactly when the draft's argmax is y_i. Windows of k drafts run
left to right until the first rejection, then the target's token is taken, as in the engine;
so at T=0 the result equals what the engine measures, from one forward pass of each model."""
from __future__ import annotations

import os

import torch


def model_config(path: str) -> dict:
    """config.json of the model directory `path`, read before transformers sees the path:
    given a directory that does not exist, transformers looks the name up on the Hugging
    Face Hub (nothing is downloaded here)."""
    from batchspec.models.loader import config_json
    return config_json(path)


def check_vocabularies(target: str, drafts) -> None:
    """Fail before any model is loaded where a draft's vocabulary size is not the target's."""
    want = model_config(target).get("vocab_size")
    for draft in drafts:
        got = model_config(draft).get("vocab_size")
        if got != want:
            raise ValueError(f"draft {draft!r} has vocabulary size {got}, target {target!r} "
                             f"has {want}: a draft must share the target's tokenizer and "
                             f"vocabulary")


def load_causal_lm(path: str, dtype=torch.float32):
    from transformers import AutoModelForCausalLM
    model_config(path)
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True).eval()


def load_tokenizer(path: str):
    from transformers import AutoTokenizer
    model_config(path)
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def umask_mode(path: str) -> None:
    """Give a file the mode open() gives (0666 less the umask): safetensors writes its file
    0600, which workers running as another user cannot read."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def padded(rows: list[list[int]], pad_id: int, left: bool):
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        sl = slice(width - len(r), width) if left else slice(0, len(r))
        ids[i, sl] = torch.tensor(r)
        mask[i, sl] = 1
    return ids, mask


@torch.no_grad()
def generate(model, prompt_ids: list[list[int]], *, max_tokens: int, temperature: float,
             eos_id: int, seed: int = 0, batch_size: int = 32,
             desc: str | None = None) -> list[list[int]]:
    """New token ids for each prompt (ending at and including EOS, if produced), with
    transformers `generate` on left-padded batches; prompts are batched by length."""
    order = sorted(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))
    out: list[list[int]] = [[] for _ in prompt_ids]
    from tqdm import tqdm
    for start in tqdm(range(0, len(order), batch_size), desc=desc, disable=desc is None):
        idx = order[start: start + batch_size]
        ids, mask = padded([prompt_ids[i] for i in idx], eos_id, left=True)
        torch.manual_seed(seed + start)
        sample = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) \
            if temperature > 0 else dict(do_sample=False)
        gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                             min_new_tokens=1, pad_token_id=eos_id, eos_token_id=eos_id,
                             **sample)
        for row, i in zip(gen[:, ids.shape[1]:].tolist(), idx):
            out[i] = row[: row.index(eos_id) + 1] if eos_id in row else row
    return out


def replay_windows(accept: list[bool], k: int) -> dict:
    """Speculative rounds over a continuation whose per-position acceptance is given. The
    first token comes from the prefill, as in the engine; then each round drafts up to k
    tokens (never past the end), keeps them up to the first rejection and adds the target's
    token. `tokens` counts the tokens made by rounds."""
    accept = accept[1:]
    pos, rounds, drafted, accepted = 0, 0, 0, 0
    while pos < len(accept):
        n = min(k, len(accept) - pos - 1)
        a = 0
        while a < n and accept[pos + a]:
            a += 1
        rounds, drafted, accepted, pos = rounds + 1, drafted + n, accepted + a, pos + a + 1
    return {"rounds": rounds, "drafted": drafted, "accepted": accepted, "tokens": len(accept)}


@torch.no_grad()
def teacher_forced_acceptance(target, draft, prompt_ids: list[list[int]],
                              continuations: list[list[int]], *, k: int, temperature: float,
                              pad_id: int, seed: int = 0, batch_size: int = 16) -> list[dict]:
    """One replay record (rounds, drafted, accepted, tokens) per continuation."""
    g = torch.Generator().manual_seed(seed)
    records = []
    for start in range(0, len(prompt_ids), batch_size):
        prompts = prompt_ids[start: start + batch_size]
        conts = continuations[start: start + batch_size]
        ids, mask = padded([p + c for p, c in zip(prompts, conts)], pad_id, left=False)
        t_logits = target(input_ids=ids, attention_mask=mask).logits.float()  # (B, T, V)
        d_logits = draft(input_ids=ids, attention_mask=mask).logits.float()
        for r, (p, c) in enumerate(zip(prompts, conts)):
            pos = torch.arange(len(p) - 1, len(p) + len(c) - 1)  # logits that predict c
            y = torch.tensor(c)
            if temperature == 0:
                accept = d_logits[r, pos].argmax(-1) == y
            else:
                lp = torch.log_softmax(t_logits[r, pos] / temperature, -1).gather(1, y[:, None])
                lq = torch.log_softmax(d_logits[r, pos] / temperature, -1).gather(1, y[:, None])
                ratio = (lq - lp).exp().clamp(max=1.0).squeeze(1)
                accept = torch.rand(len(c), generator=g) < ratio
            records.append(replay_windows(accept.tolist(), k))
    return records
