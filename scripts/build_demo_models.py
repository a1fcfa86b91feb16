"""Build the bundled demo model family from scratch: tokenizer, target, general draft and
per-domain drafts, all trained on CPU from text that ships with Python.

    nice -n 15 python scripts/build_demo_models.py            # every step not yet done
    python scripts/build_demo_models.py --only target --force  # redo one step

Each step writes its result and is skipped when that result exists; training steps keep a
checkpoint under build/demo/ and resume from it. Everything is seeded; wall-clock budgets
make the trained weights depend on the machine's speed (see docs/demo-models.md)."""
from __future__ import annotations

import json
import os
import random
import shutil
import sys
import time

import click
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from batchspec.demo.corpus import DOMAINS, build_corpus  # noqa: E402
from batchspec.tools.training import new_llama, save_hf, train  # noqa: E402

BUILD = os.path.join(ROOT, "build", "demo")
MODELS = os.path.join(ROOT, "batchspec", "demo", "models")
EXAMPLES = os.path.join(ROOT, "examples", "prompts.parquet")
VOCAB_SIZE = 4096
# head_dim 64 for both; the target is deep and narrow so that a 1-layer draft is cheap
# next to it, which is what makes speculation pay.
TARGET = dict(hidden_size=256, num_layers=6, num_heads=4, num_kv_heads=2, intermediate_size=768)
DRAFT = dict(hidden_size=192, num_layers=1, num_heads=3, num_kv_heads=1, intermediate_size=576)
SEQ_LEN, BATCH = 256, 16


def build_path(*parts):
    return os.path.join(BUILD, *parts)


def load_tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(build_path("tokenizer"))


def step_corpus():
    corpus = build_corpus()
    with open(build_path("corpus.json"), "w") as f:
        json.dump(corpus, f)


def load_corpus():
    with open(build_path("corpus.json")) as f:
        return json.load(f)


def step_tokenizer():
    from batchspec.tools.tiny import build_tokenizer
    corpus = load_corpus()
    rng = random.Random(0)
    code = [t for _, t in corpus["code"]["train"]]
    rng.shuffle(code)
    # About as much code as prose, so that neither domain's words dominate the merges.
    docs_text = "\n".join(t for _, t in corpus["docs"]["train"])
    code_text = "\n".join(code)[: len(docs_text)]
    tok = build_tokenizer(build_path("tokenizer"), vocab_size=VOCAB_SIZE,
                          text=code_text + "\n" + docs_text)
    tok.model_max_length = 2048
    tok.save_pretrained(build_path("tokenizer"))


def step_tokens():
    tok = load_tokenizer()
    corpus, tokens = load_corpus(), {}
    for domain in DOMAINS:
        for split, docs in corpus[domain].items():
            ids = tok([t for _, t in docs], add_special_tokens=False)["input_ids"]
            flat = [i for doc in ids for i in doc + [tok.eos_token_id]]
            tokens[f"{domain}/{split}"] = torch.tensor(flat, dtype=torch.int16)
            print(f"{domain}/{split}: {len(flat):,} tokens")
    torch.save(tokens, build_path("tokens.pt"))


def lm_batch(streams: list[torch.Tensor], step: int, batch: int, seed: int):
    """`batch` random windows of SEQ_LEN + 1 tokens, split evenly over the streams."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    rows = []
    for i in range(batch):
        s = streams[i % len(streams)]
        start = torch.randint(0, len(s) - SEQ_LEN - 1, (1,), generator=g).item()
        rows.append(s[start: start + SEQ_LEN + 1].long())
    return torch.stack(rows)


def lm_loss(model, x):
    logits = model(input_ids=x[:, :-1]).logits  # (B, T, V)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())


@torch.no_grad()
def heldout_loss(model, tokens, domain, num_batches=8):
    s = tokens[f"{domain}/heldout"]
    return sum(lm_loss(model, lm_batch([s], 10_000_000 + i, BATCH, 0)).item()
               for i in range(num_batches)) / num_batches


def pretrain(name: str, size: dict, minutes: float, lr: float, out_dir: str):
    """Next-token training on both domains' training splits, half a batch each."""
    tok, tokens = load_tokenizer(), torch.load(build_path("tokens.pt"))
    streams = [tokens[f"{d}/train"] for d in DOMAINS]
    model = new_llama(tok, **size, seed=0)
    print(f"{name}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params")
    t0 = time.time()
    state = train(model, lambda step: lm_loss(model, lm_batch(streams, step, BATCH, 0)),
                  steps=None, seconds=minutes * 60, lr=lr,
                  ckpt_path=build_path(f"{name}.ckpt"), desc=name)
    losses = {d: round(heldout_loss(model, tokens, d), 3) for d in DOMAINS}
    save_hf(model, tok, out_dir)
    log = {"name": name, "size": size, "steps": state["step"],
           "train_seconds": round(state["elapsed"], 1), "heldout_loss": losses,
           "final_train_loss": state["losses"][-1], "wall_s": round(time.time() - t0, 1)}
    print(json.dumps(log))
    with open(build_path(f"{name}.json"), "w") as f:
        json.dump(log, f, indent=1)


def step_prompts():
    """Held-out prompts: examples/prompts.parquet (the quick demo job) and a larger set under
    build/ for measuring α; training prompts for distillation come from the corpus itself."""
    import polars as pl

    from batchspec.demo.corpus import corpus_prompts
    os.makedirs(os.path.dirname(EXAMPLES), exist_ok=True)
    examples = corpus_prompts("heldout", DOMAINS, 24, seed=0)
    pl.DataFrame([dict(id=f"{p['domain']}-{i:02d}", **p, max_tokens=48)
                  for i, p in enumerate(examples)]).write_parquet(EXAMPLES)
    heldout = corpus_prompts("heldout", DOMAINS, 64, seed=1)
    pl.DataFrame([dict(id=f"{p['domain']}-{i:03d}", **p) for i, p in enumerate(heldout)]
                 ).write_parquet(build_path("heldout.parquet"))


def step_distill(name: str, init: str, domain: str | None, minutes: float, num_prompts: int):
    from batchspec.tools.distill import distill_draft
    report = distill_draft(os.path.join(MODELS, "target"), os.path.join(MODELS, name),
                           domain=domain, init=init, seconds=minutes * 60,
                           num_prompts=num_prompts, eval_data=build_path("heldout.parquet"),
                           work_dir=build_path(f"{name}.work"))
    # The bundled report names models relative to the checkout, not this machine's paths.
    for key in ("target", "init"):
        report[key] = os.path.relpath(report[key], ROOT)
    with open(os.path.join(MODELS, name, "distill.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report))


REFINE_PROMPTS, REFINE_SEED = 2048, 1


def step_refine(name: str, domain: str | None, minutes: float):
    """A draft distilled further, from itself, on REFINE_PROMPTS other training prompts of
    its domain (domain None: of both, for the general draft; seed REFINE_SEED), its α
    measured before and after on held-out prompts of the corpus: what `batchspec distill
    --init DRAFT [--domain D] --num-prompts 2048 --time-budget 600 --seed 1` does. The first
    stage (step_distill, 512 prompts) had left the code draft at KL 0.15; this stage took it
    to 0.11, and its α from 0.68 to 0.78 (docs/benchmarks.md, thirty-third round). The
    draft's weights are replaced where α did not fall; its report is its refine.json
    ("replaced" says which). The first stage's weights are not kept: with --force the step
    distills the draft once more, from its current weights (to redo both stages, force the
    draft's own step too). The general draft's stage runs after the domain drafts', which
    start from its first stage."""
    from batchspec.tools.distill import distill_draft
    path = os.path.join(MODELS, name)
    out = build_path(f"{name}-refined")
    report = distill_draft(os.path.join(MODELS, "target"), out, domain=domain, init=path,
                           seconds=minutes * 60, num_prompts=REFINE_PROMPTS, seed=REFINE_SEED,
                           work_dir=build_path(f"{name}-refine.work"))
    # a stage that leaves the draft worse (a budget too short for its warm-up: 8 steps in 15 s
    # took the code draft's α from 0.783 to 0.714) keeps the weights it started from
    report["replaced"] = report["alpha_after"] >= report["alpha_before"]
    if report["replaced"]:
        shutil.copy(os.path.join(out, "model.safetensors"),
                    os.path.join(path, "model.safetensors"))
    else:
        print(f"[{name}-refine] α fell from {report['alpha_before']} to "
              f"{report['alpha_after']}: the draft keeps its weights", flush=True)
    for key in ("target", "init"):
        report[key] = os.path.relpath(report[key], ROOT)
    with open(os.path.join(path, "refine.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report))


DRAFT_VOCAB_SIZE = 1024


def step_draft_vocab():
    """Each draft's vocabulary (batchspec.spec.draft_vocab): the 1,024 tokens most frequent
    in the training text of both domains, and end of sequence. Reads the corpus and the
    bundled tokenizer only, so it runs on its own: --only draft-vocab."""
    from batchspec.models.loader import load_tokenizer as model_tokenizer
    from batchspec.spec import draft_vocab
    tok = model_tokenizer(os.path.join(MODELS, "target"))
    corpus = build_corpus()
    counts = draft_vocab.count_tokens(
        tok, (t for d in DOMAINS for _, t in corpus[d]["train"]))
    ids, covered = draft_vocab.choose(counts, VOCAB_SIZE, size=DRAFT_VOCAB_SIZE,
                                      always=[tok.eos_token_id])
    for name in ("draft", "draft-code", "draft-docs"):
        draft_vocab.write(os.path.join(MODELS, name), ids, {
            "counted_tokens": sum(counts.values()), "covered": round(covered, 4),
            "data": ["the demo corpus's training text, both domains"]})
    print(f"{len(ids)} tokens, {covered:.1%} of the training text's {sum(counts.values()):,}")


def step_eval():
    """α at T=0, k=4 of every draft (and the undistilled base) on each domain's held-out
    prompts; the table in docs/benchmarks.md."""
    from batchspec.tools.evaluate import evaluate_pair, load_prompts
    prompts = load_prompts(build_path("heldout.parquet"), None, None, split="heldout")
    drafts = {"draft-base": build_path("draft-base")}
    drafts.update({n: os.path.join(MODELS, n) for n in ("draft", "draft-code", "draft-docs")})
    table = {}
    for name, path in drafts.items():
        res = evaluate_pair(os.path.join(MODELS, "target"), path, prompts, k=4,
                            dtype="float32")  # as the table was measured
        table[name] = {d: s["acceptance_rate"] for d, s in res["by_domain"].items()}
        table[name]["overall"] = res["overall"]["acceptance_rate"]
        print(name, table[name], flush=True)
    with open(build_path("alpha.json"), "w") as f:
        json.dump(table, f, indent=1)


STEPS = {
    "corpus": (lambda: build_path("corpus.json"), step_corpus),
    "tokenizer": (lambda: build_path("tokenizer"), step_tokenizer),
    "tokens": (lambda: build_path("tokens.pt"), step_tokens),
    "target": (lambda: os.path.join(MODELS, "target"),
               lambda: pretrain("target", TARGET, OPTS["target_minutes"], 2e-3,
                                os.path.join(MODELS, "target"))),
    "draft-base": (lambda: build_path("draft-base"),
                   lambda: pretrain("draft-base", DRAFT, OPTS["draft_minutes"], 3e-3,
                                    build_path("draft-base"))),
    "prompts": (lambda: build_path("heldout.parquet"), step_prompts),
    "draft": (lambda: os.path.join(MODELS, "draft"),
              lambda: step_distill("draft", build_path("draft-base"), None,
                                   OPTS["distill_minutes"], 1024)),
    "draft-code": (lambda: os.path.join(MODELS, "draft-code"),
                   lambda: step_distill("draft-code", os.path.join(MODELS, "draft"), "code",
                                        OPTS["domain_minutes"], 512)),
    "draft-docs": (lambda: os.path.join(MODELS, "draft-docs"),
                   lambda: step_distill("draft-docs", os.path.join(MODELS, "draft"), "docs",
                                        OPTS["domain_minutes"], 512)),
    "draft-code-refine": (lambda: os.path.join(MODELS, "draft-code", "refine.json"),
                          lambda: step_refine("draft-code", "code", OPTS["refine_minutes"])),
    "draft-docs-refine": (lambda: os.path.join(MODELS, "draft-docs", "refine.json"),
                          lambda: step_refine("draft-docs", "docs", OPTS["refine_minutes"])),
    "draft-refine": (lambda: os.path.join(MODELS, "draft", "refine.json"),
                     lambda: step_refine("draft", None, OPTS["refine_minutes"])),
    "draft-vocab": (lambda: os.path.join(MODELS, "draft-docs", "draft_vocab.json"),
                    step_draft_vocab),
    "eval": (lambda: build_path("alpha.json"), step_eval),
}
OPTS: dict = {}


@click.command()
@click.option("--only", multiple=True, type=click.Choice(list(STEPS)), help="Run these steps.")
@click.option("--force", is_flag=True, help="Redo the selected steps even when done.")
@click.option("--target-minutes", default=18.0, show_default=True)
@click.option("--draft-minutes", default=4.0, show_default=True, help="Undistilled draft.")
@click.option("--distill-minutes", default=5.0, show_default=True, help="General draft.")
@click.option("--domain-minutes", default=3.0, show_default=True, help="Each domain draft.")
@click.option("--refine-minutes", default=10.0, show_default=True,
              help="Each domain draft's second stage.")
@click.option("--threads", default=2, show_default=True)
def main(only, force, target_minutes, draft_minutes, distill_minutes, domain_minutes,
         refine_minutes, threads):
    """Build the demo model family (see the module docstring)."""
    OPTS.update(target_minutes=target_minutes, draft_minutes=draft_minutes,
                distill_minutes=distill_minutes, domain_minutes=domain_minutes,
                refine_minutes=refine_minutes)
    torch.set_num_threads(threads)
    os.makedirs(BUILD, exist_ok=True)
    for name, (output, run) in STEPS.items():
        if only and name not in only:
            continue
        if os.path.exists(output()) and not force:
            print(f"[{name}] done: {output()}")
            continue
        if force and os.path.isdir(output()):
            shutil.rmtree(output())
        print(f"[{name}] ...", flush=True)
        t0 = time.time()
        run()
        print(f"[{name}] {time.time() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
