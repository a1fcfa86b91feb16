"""The engine's forward against transformers: logits within 1e-4 (fp32) and greedy token ids
equal to `generate(do_sample=False)`, batched and alone, for every supported architecture."""
import json
import os

import pytest
import torch
import torch.nn.functional as F

from batchspec import LLM, SamplingParams
from batchspec.engine.block_manager import BlockManager
from batchspec.engine.runner import ModelRunner
from batchspec.engine.sequence import Sequence
from batchspec.tools.tiny import make_random_model

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
PROMPTS = ["def foo(x):\n    return", "import os", "The quick brown fox jumps over the lazy "
           "dog and then runs back into the forest", "a = [1, 2, 3]\nprint(a"]


def hf_model(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=ARCHS)
def arch_model(request, model_factory):
    # a larger init spread than the default so that greedy choices are well separated
    return model_factory(request.param, seed=3, init_std=0.1, tie_word_embeddings=
                         request.param == "qwen3")


def test_logits_match_transformers(arch_model):
    runner = ModelRunner(arch_model, "cpu", "float32")
    runner.allocate_kv_cache(num_blocks=16, block_size=4)
    ids = list(range(3, 40))
    seq = Sequence(0, "0", ids, SamplingParams(), seed=0)
    BlockManager(16, 4).allocate(seq, len(ids))
    with torch.no_grad():
        ref = hf_model(arch_model)(torch.tensor([ids])).logits[0]
    # prefill of all but the last token (a chunk), then the last one against the paged cache
    n = len(ids) - 1
    got = runner.forward([ids[:n]], [0], [seq.block_table], [n])
    last = runner.forward([ids[n:]], [n], [seq.block_table], [1])
    torch.testing.assert_close(got, ref[:n], atol=1e-4, rtol=0)
    torch.testing.assert_close(last[0], ref[n], atol=1e-4, rtol=0)


def test_greedy_matches_transformers_batched_and_alone(arch_model):
    llm = LLM(arch_model, device="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    batched = llm.generate(PROMPTS, params, use_tqdm=False)
    hf = hf_model(arch_model)
    for prompt, out in zip(PROMPTS, batched):
        ids = torch.tensor([out.prompt_token_ids])
        ref = hf.generate(ids, do_sample=False, max_new_tokens=24, min_new_tokens=24,
                          pad_token_id=0)[0, ids.shape[1]:].tolist()
        assert out.token_ids == ref, prompt
        alone = llm.generate([prompt], params, use_tqdm=False)[0]
        assert alone.token_ids == out.token_ids
        assert out.finish_reason == "length" and len(out.token_ids) == 24


def test_unsupported_architecture_is_refused(tmp_path, tiny_llama):
    d = tmp_path / "gpt2"
    d.mkdir()
    cfg = json.load(open(os.path.join(tiny_llama, "config.json")))
    cfg["architectures"] = ["GPT2LMHeadModel"]
    json.dump(cfg, open(d / "config.json", "w"))
    with pytest.raises(ValueError, match="LlamaForCausalLM, MistralForCausalLM"):
        LLM(str(d), device="cpu")


def test_pickle_checkpoint_refused(tmp_path, tiny_llama):
    d = tmp_path / "pickled"
    d.mkdir()
    (d / "config.json").write_text(open(os.path.join(tiny_llama, "config.json")).read())
    torch.save({}, d / "pytorch_model.bin")
    with pytest.raises(ValueError, match="safetensors"):
        LLM(str(d), device="cpu")


def test_missing_model_dir_fails_fast(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        LLM(str(tmp_path / "nope"), device="cpu")


def test_model_without_tokenizer_takes_token_ids(tmp_path):
    path = make_random_model(str(tmp_path / "m"), "llama", vocab_size=64, tokenizer=False)
    llm = LLM(path, device="cpu")
    assert llm.tokenizer is None
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=5),
                       use_tqdm=False)[0]
    assert len(out.token_ids) == 5 and out.text is None
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate(["text"], use_tqdm=False)


def test_the_cpu_kv_cache_takes_memory_as_rows_use_it():
    """zeroed: zeros that the OS fills in as pages are first written, so a KV cache of a GiB
    is not resident until rows write to it (torch.zeros wrote every byte at start-up)."""
    from batchspec.models.llama import zeroed

    def resident() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    before = resident()
    cache = zeroed((4, 2, 2 ** 16, 4, 64), torch.bfloat16, "cpu")      # 256 MiB
    assert cache.shape == (4, 2, 2 ** 16, 4, 64) and cache.is_contiguous()
    assert resident() - before < 16 * 2 ** 20
    cache[1, 0, :1024] = 1.5                                            # 512 KiB written
    assert resident() - before < 16 * 2 ** 20
    assert float(cache[1, 0, :2048].sum()) == 1.5 * 1024 * 4 * 64
    assert not cache[3, 1, -2048:].any() and not cache[0, 0, :2048].any()
    assert zeroed((0, 3), torch.float32, "cpu").shape == (0, 3)
    # private to the process, as torch.zeros's memory is: a forked child's writes stay its own
    pid = os.fork()
    if pid == 0:
        cache[2, 1, :16] = 7.0
        os._exit(0 if float(cache[2, 1, :16].sum()) == 7.0 * 16 * 4 * 64 else 1)
    assert os.waitpid(pid, 0)[1] == 0 and not cache[2, 1, :16].any()


def _resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("prefault", [False, True])
def test_an_engine_told_to_prefault_its_kv_cache_holds_it_from_the_start(prefault, tiny_llama):
    """prefault_kv_cache (batchspec bench sets it) writes every page of the KV cache when the
    engine is built, so that no step pays the page faults of pages rows write first; without
    it the cache is resident only as far as rows have written it."""
    from batchspec import LLM
    before = _resident()
    llm = LLM(tiny_llama, device="cpu", dtype="float32", num_kv_blocks=8192,
              prefault_kv_cache=prefault)
    grown = _resident() - before
    k, v = llm.engine.target.kv_caches[0]
    size = sum(k.numel() * k.element_size() + v.numel() * v.element_size()
               for k, v in llm.engine.target.kv_caches)
    assert size >= 64 * 2 ** 20 and not k.any() and not v.any()
    if prefault:
        assert grown >= 0.9 * size
    else:
        assert grown < 0.5 * size


def _tokenizer_facts(tok, text: str, messages: list[dict]) -> dict:
    ids = tok.encode(text, add_special_tokens=False)
    return {"class": type(tok), "vocab": tok.get_vocab(), "eos": tok.eos_token_id,
            "special": tok.all_special_ids, "init": tok.init_kwargs,
            "backend": tok.backend_tokenizer.to_str(), "ids": ids,
            "with_special": tok.encode(text), "text": tok.decode(ids, skip_special_tokens=True),
            "raw": tok.decode(ids), "chat": tok.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False)
            if tok.chat_template else None}


@pytest.mark.parametrize("which", ["demo", "tiny"])
def test_tokenizers_load_as_autotokenizer_builds_them(which, tiny_llama, tmp_path):
    # load_tokenizer loads the generic class without AutoTokenizer's detour through the
    # model's config: the same tokenizer, down to its settings and every output
    from transformers import AutoTokenizer

    from batchspec.demo import demo_models
    from batchspec.models.loader import load_tokenizer
    path = demo_models()["target"] if which == "demo" else tiny_llama
    text = "def f(x):\n    return x  # ü, 東京<|endoftext|> and  two  spaces\n\n"
    messages = [{"role": "user", "content": "Summarise: the cat sat."}]
    ours, auto = load_tokenizer(path), AutoTokenizer.from_pretrained(path)
    assert _tokenizer_facts(ours, text, messages) == _tokenizer_facts(auto, text, messages)
    # without AutoTokenizer's detour: no model family's module (nor the auto classes) loaded
    import subprocess
    import sys
    code = ("import sys; from batchspec.models.loader import load_tokenizer; "
            f"load_tokenizer({path!r}); "
            "print([m for m in sys.modules if m.startswith('transformers.models.')])")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "[]"
    # a model family's class (here Qwen2's, over the same files) goes through AutoTokenizer
    other = tmp_path / "other"
    other.mkdir()
    for name in os.listdir(path):
        if name.startswith(("tokenizer", "special_tokens", "chat_template")):
            with open(os.path.join(path, name), "rb") as f:
                (other / name).write_bytes(f.read())
    cfg = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps(cfg | {"tokenizer_class":
                                                                    "Qwen2Tokenizer"}))
    (other / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert type(load_tokenizer(str(other))).__name__ == "Qwen2Tokenizer"


@pytest.mark.parametrize("dtype,layout", [("float32", "onednn"), ("float32", "avx2"),
                                          ("bfloat16", "onednn"), ("bfloat16", "amx"),
                                          ("bfloat16", "avx512_bf16")])
def test_packed_weights_give_the_plain_products(arch_model, dtype, layout, monkeypatch):
    """On CPU the linear weights are packed at load (oneDNN's blocked layout, AMX tiles' for
    bf16 on CPUs with them, the same layout for AVX512-BF16's pair products on CPUs with those
    but no tiles, or the AVX2 op's for fp32); the logits equal those of F.linear on
    the same weights
    (BATCHSPEC_CPU_PREPACK=0), for prefill and decode rows."""
    ids = list(range(3, 40))
    logits = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("BATCHSPEC_CPU_PREPACK", flag)
        monkeypatch.setenv("BATCHSPEC_CPU_LINEAR", layout)
        runner = ModelRunner(arch_model, "cpu", dtype)
        if flag == "1" and runner.model.weight_layout != layout:
            pytest.skip(f"{layout} packing is not available here")
        assert runner.model.weight_layout == (layout if flag == "1" else "none")
        runner.allocate_kv_cache(num_blocks=16, block_size=4)
        seq = Sequence(0, "0", ids, SamplingParams(), seed=0)
        BlockManager(16, 4).allocate(seq, len(ids))
        n = len(ids) - 5
        logits[flag] = torch.cat([runner.forward([ids[:n]], [0], [seq.block_table], [n]),
                                  runner.forward([ids[n:]], [n], [seq.block_table], [5])])
    tol = 1e-4 if dtype == "float32" else 0.15  # bf16: a few roundings of logits ~ 10
    torch.testing.assert_close(logits["1"], logits["0"], atol=tol, rtol=0)
    assert (logits["1"].argmax(-1) == logits["0"].argmax(-1)).float().mean() > 0.9


def _bf16_linear(path):
    """The bf16 linear op of `path`: "amx" (linear_packed where the CPU has tiles),
    "avx512_bf16" (linear_packed_dp, the pair-product path whatever else the CPU has) or
    "fma" (linear_packed_fma, fp32 multiply-adds on the same packed weight)."""
    from batchspec.spec._build import load
    if _kernel_missing():
        pytest.skip("no C++ compiler for the CPU kernels")
    ops = load(False)
    if path == "amx":
        if not ops.linear_amx_available():
            pytest.skip("no AMX tiles on this CPU (or not permitted)")
        return ops, ops.linear_packed
    if not ops.linear_bf16_available():
        pytest.skip("no AVX512-BF16 on this CPU")
    return ops, ops.linear_packed_fma if path == "fma" else ops.linear_packed_dp


@pytest.mark.parametrize("path", ["amx", "avx512_bf16", "fma"])
def test_bf16_linear_is_the_product_and_the_same_for_a_row_in_any_batch(path):
    """kernels/linear_cpu.cpp's bf16 paths (AMX tiles; AVX512-BF16 pair products, on the same
    packed weight): x . W^T (+ b) to within bf16's rounding of the fp32 product, for widths
    that are and are not whole tiles (32 inputs, 16 outputs), odd ones among them, with and
    without a bias; and each row's result bit for bit the same whether it is computed alone,
    in a window of 5 rows or among 200 (what keeps a verification window's products those of
    decode steps), through every register block (1-6 rows by 1-4 blocks of 16 features); its
    fp32 output (for logits) the bf16 result's values."""
    ops, linear = _bf16_linear(path)
    g = torch.Generator().manual_seed(0)
    for n, k, bias in ((512, 256, False), (37, 50, True), (4096, 192, False), (16, 32, True),
                       (100, 63, False), (48, 17, True), (32, 33, False)):
        w = torch.randn(n, k, generator=g).to(torch.bfloat16)
        b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
        packed = ops.pack_linear_weight(w)
        x = torch.randn(200, k, generator=g).to(torch.bfloat16)
        y = linear(x, packed, k, n, b)
        ref = x.float() @ w.float().T + (b.float() if bias else 0)
        # one rounding to bf16 (2^-8 relative) plus the order of fp32 sums
        assert ((y.float() - ref).abs() <= ref.abs() * 2 ** -8 + 1e-3 * k ** 0.5).all(), (n, k)
        for rows in (slice(0, 1), slice(7, 12), slice(3, 20), slice(150, 200), slice(9, 11),
                     slice(20, 23), slice(30, 34), slice(40, 47)):
            assert torch.equal(linear(x[rows], packed, k, n, b), y[rows]), (n, k, rows)
        assert linear(x[:0], packed, k, n, b).shape == (0, n)
        # fp32 out (logits): the same bf16 values, without a pass to convert them
        assert torch.equal(linear(x, packed, k, n, b, True), y.float())
    with pytest.raises(RuntimeError, match="does not match"):
        linear(x[:, :-1], packed, k, n, None)


def test_bf16_linear_paths_agree_where_a_cpu_has_both():
    """On a CPU with AMX tiles and AVX512-BF16, the two bf16 paths give the same products up
    to the order of fp32 sums (tiles add 32 inputs a product, pair products 2)."""
    ops, _ = _bf16_linear("amx")
    _bf16_linear("avx512_bf16")
    g = torch.Generator().manual_seed(1)
    w = torch.randn(256, 192, generator=g).to(torch.bfloat16)
    x = torch.randn(40, 192, generator=g).to(torch.bfloat16)
    packed = ops.pack_linear_weight(w)
    tiles = ops.linear_packed(x, packed, 192, 256, None).float()
    pairs = ops.linear_packed_dp(x, packed, 192, 256, None).float()
    assert ((tiles - pairs).abs() <= tiles.abs() * 2 ** -7 + 1e-2).all()


def test_bf16_pair_products_and_multiply_adds_agree():
    """The two bf16 products without tiles on the same packed weight: fp32 multiply-adds of
    each pair's second input, then its first, are VDPBF16PS's two products in its order
    (Intel's definition), so on Intel CPUs they agree bit for bit on inputs without
    denormals; elsewhere to within the order of fp32 sums. linear_packed takes one of them
    for a whole process (linear_bf16_path), never one for some row counts and the other for
    the rest."""
    ops, _ = _bf16_linear("fma")
    g = torch.Generator().manual_seed(2)
    intel = "GenuineIntel" in open("/proc/cpuinfo").read()
    for n, k in ((256, 256), (4096, 192), (37, 50), (100, 63)):
        w = torch.randn(n, k, generator=g).to(torch.bfloat16)
        x = torch.randn(70, k, generator=g).to(torch.bfloat16)
        packed = ops.pack_linear_weight(w)
        fma = ops.linear_packed_fma(x, packed, k, n, None).float()
        pairs = ops.linear_packed_dp(x, packed, k, n, None).float()
        if intel:
            assert torch.equal(fma, pairs), (n, k)
        else:
            assert ((fma - pairs).abs() <= pairs.abs() * 2 ** -7 + 1e-2).all(), (n, k)
    # the choice follows the rates measured at the first call (where nothing forces one)
    rates = ops.linear_bf16_rates()
    assert len(rates) == 2 and min(rates) > 0
    if not ops.linear_amx_available() and "BATCHSPEC_CPU_BF16_PRODUCT" not in os.environ:
        assert ops.linear_bf16_path() == ("fma" if rates[0] >= 1.5 * rates[1] else "pairs")


@pytest.mark.parametrize("choice", ["pairs", "fma"])
def test_bf16_product_is_chosen_once_and_by_the_environment(choice):
    """BATCHSPEC_CPU_BF16_PRODUCT chooses the product of bf16 weights without tiles, and
    linear_packed gives what that product gives and not what the other gives. The input tells
    them apart: a denormal bf16 input times 2^100, which VDPBF16PS takes as zero on Intel CPUs
    and the multiply-adds do not (on other inputs Intel's two products agree bit for bit)."""
    import subprocess
    import sys
    _bf16_linear(choice)
    from batchspec.spec._build import load
    if load(False).linear_amx_available():
        pytest.skip("AMX tiles take bf16 weights on this CPU")
    code = ("import torch; from batchspec.spec._build import load; ops = load(False); "
            "w = torch.full((16, 32), 2.0 ** 100).bfloat16(); p = ops.pack_linear_weight(w); "
            "x = torch.zeros(2, 32); x[:, 0] = 1e-39; x[1, 1] = 1.0; x = x.bfloat16(); "
            "y = ops.linear_packed(x, p, 32, 16, None); "
            "f = ops.linear_packed_fma(x, p, 32, 16, None); "
            "d = ops.linear_packed_dp(x, p, 32, 16, None); "
            "print(ops.linear_bf16_path(), torch.equal(y, f), torch.equal(y, d), "
            "torch.equal(f, d))")
    env = dict(os.environ, BATCHSPEC_CPU_BF16_PRODUCT=choice)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    path, is_fma, is_pairs, same = out.stdout.split()[-4:]
    assert path == choice
    if same == "True":      # a CPU whose VDPBF16PS keeps denormal inputs: either product
        assert (is_fma, is_pairs) == ("True", "True")
    else:
        assert (is_fma, is_pairs) == (("True", "False") if choice == "fma" else ("False", "True"))
    # on Intel CPUs (VDPBF16PS takes denormal inputs as zero) the input tells them apart
    if "GenuineIntel" in open("/proc/cpuinfo").read():
        assert same == "False"


def test_a_bf16_product_the_environment_names_wrong_is_an_error_that_says_so():
    """BATCHSPEC_CPU_BF16_PRODUCT=fmaa is not taken for either product: the op says what the
    variable must be (and a model then warns with that line and runs without packed
    weights, batchspec.models.llama._prepack_works)."""
    import subprocess
    import sys
    _bf16_linear("fma")
    code = ("from batchspec.spec._build import load; ops = load(False)\n"
            "try:\n    print(ops.linear_bf16_path())\nexcept RuntimeError as e:\n"
            "    print(str(e).splitlines()[0])")
    env = dict(os.environ, BATCHSPEC_CPU_BF16_PRODUCT="fmaa")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    if "amx" in out.stdout.split():
        pytest.skip("AMX tiles take bf16 weights on this CPU")
    assert "BATCHSPEC_CPU_BF16_PRODUCT must be pairs or fma, got 'fmaa'" in out.stdout


def test_avx2_linear_is_the_product_and_the_same_for_a_row_in_any_batch():
    """kernels/linear_cpu.cpp's fp32 path: x . W^T (+ b) to within fp32's rounding of the
    exact product, for widths that are and are not whole blocks (16 outputs), with and
    without a bias, through each register block (1, 2 and 3 rows over several blocks, up to
    6 rows over one; 7, 8 and 14 rows end in passes of 4 and 3 or 4); each row's result bit
    for bit the same alone, in a window of 5 rows or among 200 (what keeps a verification
    window's logits those of decode steps); weights of bf16 values stored in bf16 give the
    fp32-stored results bit for bit, through their own register blocks."""
    from batchspec.spec._build import load
    if _kernel_missing():
        pytest.skip("no C++ compiler for the CPU kernels")
    ops = load(False)
    if not ops.linear_f32_available():
        pytest.skip("no AVX2 and FMA on this CPU")
    g = torch.Generator().manual_seed(0)
    for n, k, bias in ((512, 256, False), (37, 50, True), (4096, 192, False), (16, 1, True),
                       (200, 33, False)):
        w = torch.randn(n, k, generator=g)
        b = torch.randn(n, generator=g) if bias else None
        packed = ops.pack_linear_weight(w)
        x = torch.randn(200, k, generator=g)
        y = ops.linear_packed(x, packed, k, n, b)
        ref = x.double() @ w.double().T + (b.double() if bias else 0)
        # k fp32 roundings of sums of |x w| at most
        bound = (x.double().abs() @ w.double().abs().T) * k * 2 ** -24 + 1e-6
        assert ((y.double() - ref).abs() <= bound).all(), (n, k)
        for rows in (slice(0, 1), slice(7, 9), slice(3, 6), slice(10, 15), slice(3, 20),
                     slice(20, 27), slice(30, 38), slice(40, 54), slice(150, 200)):
            assert torch.equal(ops.linear_packed(x[rows], packed, k, n, b), y[rows]), (n, k, rows)
        assert ops.linear_packed(x[:0], packed, k, n, b).shape == (0, n)
        # weights that are all bf16 numbers (a bf16 checkpoint run in fp32) are stored in
        # bf16, read back exactly: the same results bit for bit as stored in fp32
        assert packed.dtype == torch.float32     # (randn: not bf16 numbers)
        wb = w.bfloat16().float()
        compact, full = ops.pack_linear_weight(wb), ops.pack_linear_weight(wb, False)
        assert compact.dtype == torch.bfloat16 and full.dtype == torch.float32
        yb = ops.linear_packed(x, compact, k, n, b)
        assert torch.equal(yb, ops.linear_packed(x, full, k, n, b)), (n, k)
        for rows in (slice(0, 1), slice(7, 9), slice(3, 6), slice(10, 15), slice(3, 20),
                     slice(20, 27), slice(30, 38), slice(40, 54)):
            assert torch.equal(ops.linear_packed(x[rows], compact, k, n, b), yb[rows]), (n, k)
    with pytest.raises(RuntimeError, match="does not match"):
        ops.linear_packed(x[:, :-1], packed, k, n, None)


def test_grouped_attention_equals_sdpa():
    """The bf16 CPU path for batched short rows (two matmuls, query heads stacked per KV
    head) computes what SDPA with GQA and a padding/causal mask computes."""
    from batchspec.layers.attention import _grouped_attention
    g = torch.Generator().manual_seed(0)
    B, Hq, Hkv, nq, ctx, D = 3, 6, 2, 4, 24, 16
    q, k, v = (torch.randn(B, h, n, D, generator=g) for h, n in ((Hq, nq), (Hkv, ctx),
                                                                   (Hkv, ctx)))
    lens = torch.tensor([24, 9, 17])
    qpos = lens[:, None] - nq + torch.arange(nq)[None, :]
    mask = (torch.arange(ctx)[None, None, :] <= qpos[:, :, None])[:, None]   # [B, 1, nq, ctx]
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3,
                                                           enable_gqa=True)
    torch.testing.assert_close(_grouped_attention(q, k, v, mask, 0.3), ref, atol=1e-5, rtol=0)
    got = _grouped_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, 0.3)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref, atol=0.05, rtol=0)


def prefilled(path, dtype, lengths, room=5):
    """A runner whose paged cache holds prompts of these lengths (room for `room` more
    tokens each): (runner, prompts, sequences)."""
    runner = ModelRunner(path, "cpu", dtype)
    runner.allocate_kv_cache(num_blocks=128, block_size=4)
    bm = BlockManager(128, 4)
    prompts = [list(range(3, 3 + n)) for n in lengths]
    seqs = []
    for i, ids in enumerate(prompts):
        seq = Sequence(i, str(i), ids, SamplingParams(), seed=0)
        bm.allocate(seq, len(ids) + room)
        seqs.append(seq)
        runner.forward([ids], [0], [seq.block_table], [1])
    return runner, prompts, seqs


@pytest.mark.parametrize("layout", ["onednn", "amx", "avx512_bf16", "none"])
def test_logits_in_the_output_layers_dtype_are_the_fp32_logits_numbers(tiny_llama, layout,
                                                                       monkeypatch):
    """forward(..., float_logits=False), what verification reads: a bf16 model's logits
    in bf16, without the fp32 copy, each the very number the fp32 logits hold, for
    oneDNN's packed layer, the C++ op's bf16 paths (which write fp32 themselves when asked)
    and F.linear."""
    monkeypatch.setenv("BATCHSPEC_CPU_LINEAR", layout)
    if layout == "none":
        monkeypatch.setenv("BATCHSPEC_CPU_PREPACK", "0")
    runner, prompts, seqs = prefilled(tiny_llama, "bfloat16", (9, 23, 14))
    if runner.model.weight_layout != layout:
        pytest.skip(f"{layout} layer is not available here")
    rows = [[5, 6, 7], [8], [9, 10]]
    args = (rows, [len(p) for p in prompts], [s.block_table for s in seqs],
            [len(r) for r in rows])
    as_made = runner.forward(*args, float_logits=False)
    fp32 = runner.forward(*args)
    assert as_made.dtype == torch.bfloat16 and fp32.dtype == torch.float32
    assert torch.equal(as_made.float(), fp32)


def test_bf16_batch_matches_rows_alone(tiny_llama):
    """bf16 on CPU: a batch of decoding rows (grouped-matmul attention) gives the logits each
    row gets alone (SDPA), up to bf16 rounding."""
    runner, prompts, seqs = prefilled(tiny_llama, "bfloat16", (9, 23, 14))
    rows = [[5, 6, 7], [8], [9, 10]]
    batch = runner.forward(rows, [len(p) for p in prompts], [s.block_table for s in seqs],
                           [len(r) for r in rows])
    alone = torch.cat([runner.forward([r], [len(p)], [s.block_table], [len(r)])
                       for r, p, s in zip(rows, prompts, seqs)])
    torch.testing.assert_close(batch, alone, atol=0.1, rtol=0.02)
    assert (batch.argmax(-1) == alone.argmax(-1)).float().mean() >= 0.8


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("lengths", [(9, 23, 14, 30), (60, 130, 64, 127)])
def test_cpu_paged_attention_kernel_equals_sdpa(arch_model, dtype, lengths, monkeypatch):
    """The C++ kernel over the paged cache (kernels/paged_attention_cpu.cpp) gives the logits
    of gather + SDPA for ragged short rows (decodes and verification windows, GQA), also where
    a row's keys span several of the kernel's 64-key chunks and its window straddles one's
    edge."""
    from batchspec.layers import attention
    if _kernel_missing():
        pytest.skip("no C++ compiler for the CPU kernels")
    runner, prompts, seqs = prefilled(arch_model, dtype, lengths)
    rows = [[5, 6, 7], [8], [9, 10, 11, 12, 13], [14, 15]]
    args = (rows, [len(p) for p in prompts], [s.block_table for s in seqs],
            [len(r) for r in rows])
    kernel = runner.forward(*args)
    assert attention._cpu_op, "the kernel was not used"
    monkeypatch.setattr(attention, "_cpu_op", False)
    sdpa = runner.forward(*args)
    tol = dict(atol=1e-4, rtol=0) if dtype == "float32" else dict(atol=0.1, rtol=0.02)
    torch.testing.assert_close(kernel, sdpa, **tol)


def test_cpu_ops_run_on_torchs_threads():
    """The C++ ops' at::parallel_for runs on torch's thread pool (the kernels are built with
    OpenMP): as many threads as torch.set_num_threads gives, up to the tasks; built without
    it, every op ran on the calling thread alone."""
    from batchspec.spec._build import load
    if _kernel_missing():
        pytest.skip("no C++ compiler for the CPU kernels")
    op = load(False).cpu_op_threads
    before = torch.get_num_threads()
    try:
        for threads in (1, 3, 4):
            torch.set_num_threads(threads)
            assert op(64) == threads and op(2) == min(2, threads)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logits_are_the_same_at_any_thread_count(arch_model, dtype):
    """The C++ ops (built with OpenMP, so at::parallel_for runs on torch's threads) split a
    forward's work by rows, output features and, in attention, by KV heads and pieces of a
    prompt's queries: logits must be the same bit for bit at 1, 3 and 8 threads, for a
    prompt's row alone, decodes and windows beside a prompt."""
    if _kernel_missing():
        pytest.skip("no C++ compiler for the CPU kernels")
    runner, prompts, seqs = prefilled(arch_model, dtype, (9, 40, 14))
    cases = [([list(range(3, 43))], [0], [seqs[1].block_table], [1]),
             ([[5, 6, 7], [8], [9, 10, 11, 12, 13]], [len(p) for p in prompts],
              [s.block_table for s in seqs], [3, 1, 5])]
    before = torch.get_num_threads()
    try:
        for args in cases:
            logits = []
            for threads in (1, 3, 8):
                torch.set_num_threads(threads)
                logits.append(runner.forward(*args))
            assert all(torch.equal(logits[0], x) for x in logits[1:]), (dtype, args[3])
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prompts_beside_windows_run_in_the_kernel(arch_model, dtype, monkeypatch):
    """On CPU, rows of up to CPU_KERNEL_MAX_Q new tokens (a new row's prompt, a prefill chunk
    after cached context) run in the C++ kernel beside the batch's windows, longer ones in
    SDPA: logits as SDPA gives them everywhere, and a prompt's logits the same bit for bit
    alone as beside other rows (the kernel's result for a query depends on its keys only)."""
    from batchspec.layers import attention
    if _kernel_missing():
        pytest.skip("no C++ compiler for the CPU kernels")
    runner = ModelRunner(arch_model, "cpu", dtype)
    runner.allocate_kv_cache(num_blocks=160, block_size=4)
    bm = BlockManager(160, 4)
    lengths, cached = (12, 40, 73, attention.CPU_KERNEL_MAX_Q + 2), (9, 0, 23, 0)
    seqs = []
    for i, (n, c) in enumerate(zip(lengths, cached)):
        seq = Sequence(i, str(i), list(range(3, 3 + c + n)), SamplingParams(), seed=0)
        bm.allocate(seq, c + n)
        seqs.append(seq)
        if c:
            runner.forward([seq.token_ids[:c]], [0], [seq.block_table], [1])
    rows = [seq.token_ids[c:] for seq, c in zip(seqs, cached)]
    rows[0] = rows[0][:3]                      # a verification window
    args = (rows, list(cached), [s.block_table for s in seqs], [3, 1, 1, 1])
    meta = attention.build_metadata([(c, len(r)) for c, r in zip(cached, rows)], args[2], 4,
                                    "cpu", runner.cfg.sliding_window)
    if runner.cfg.sliding_window is None:      # only the longest row in SDPA
        assert [q for _, q, _, _ in meta.prefill_rows] == [lengths[3]]
    mixed = runner.forward(*args)
    alone = runner.forward([rows[1]], [0], [seqs[1].block_table], [1])
    assert torch.equal(mixed[3], alone[0])
    monkeypatch.setattr(attention, "_cpu_op", False)
    sdpa = runner.forward(*args)
    tol = dict(atol=1e-4, rtol=0) if dtype == "float32" else dict(atol=0.1, rtol=0.02)
    torch.testing.assert_close(mixed, sdpa, **tol)


def _kernel_missing() -> bool:
    from batchspec.spec._build import load_error
    return load_error(False) is not None


def paged_rows(D, Hq, Hkv, block_size, dtype, qlens, kvlens, g, q_scale=1.0):
    """Ragged rows (qlens new tokens each, kvlens keys) over a paged cache whose blocks are
    shuffled: (q, k cache, v cache, block tables, the kernel's rows [first, q_len, kv_len])."""
    per_row = [-(-n // block_size) for n in kvlens]
    perm = torch.randperm(sum(per_row), generator=g)
    tables, at = [], 0
    for n in per_row:
        tables.append(perm[at:at + n].tolist() + [0] * (max(per_row) - n))
        at += n
    kc = torch.randn(sum(per_row) * block_size, Hkv, D, generator=g).to(dtype)
    vc = torch.randn(kc.shape, generator=g).to(dtype)
    q = (torch.randn(sum(qlens), Hq, D, generator=g) * q_scale).to(dtype)
    firsts = [sum(qlens[:i]) for i in range(len(qlens))]
    rows = torch.tensor([[f, ql, n] for f, ql, n in zip(firsts, qlens, kvlens)])
    return q, kc, vc, tables, rows


def paged_attention_error(D, Hq, Hkv, block_size, dtype, seed=0):
    """Largest difference between the CPU kernel and fp32 attention computed directly, over
    ragged rows whose keys end on, just before and just after the kernel's 16- and 64-key
    edges, in a cache whose blocks are shuffled."""
    from batchspec.spec._build import load
    g = torch.Generator().manual_seed(seed)
    qlens = [1, 5, 2, 1, 3, 6, 1, 4]
    kvlens = [1, 16, 17, 63, 64, 65, 130, 200]
    q, kc, vc, tables, rows = paged_rows(D, Hq, Hkv, block_size, dtype, qlens, kvlens, g)
    out = torch.zeros_like(q)
    scale = D ** -0.5
    load(False).paged_decode_attention(q, kc, vc, torch.tensor(tables), rows, scale,
                                       block_size, out)
    return direct_attention_error(out, q, kc, vc, tables, rows, block_size, scale)


def direct_attention_error(out, q, kc, vc, tables, rows, block_size, scale):
    """Largest difference between the kernel's `out` and fp32 attention computed directly
    over the rows' keys in the paged cache."""
    worst = 0.0
    Hq, Hkv = q.shape[1], kc.shape[1]
    for (f, ql, n), table in zip(rows.tolist(), tables):
        pos = torch.arange(n)
        slots = torch.tensor(table)[pos // block_size] * block_size + pos % block_size
        k = kc[slots].float().repeat_interleave(Hq // Hkv, dim=1)     # [n, Hq, D]
        v = vc[slots].float().repeat_interleave(Hq // Hkv, dim=1)
        s = torch.einsum("qhd,khd->hqk", q[f:f + ql].float(), k) * scale
        s = s.masked_fill(pos[None, None, :] > (n - ql + torch.arange(ql))[None, :, None],
                          float("-inf"))
        ref = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
        worst = max(worst, (out[f:f + ql].float() - ref).abs().max().item())
    return worst


def use_attention_path(path, monkeypatch):
    """The CPU kernel's path `path` (default, dpbf16, avx512, avx2 or portable) for this test;
    skips a path this CPU lacks. dpbf16 (pair products, AVX512-BF16) takes bf16 heads of 32,
    64 and 128 dimensions, and the AVX-512 path the rest."""
    from batchspec.config import cpu_matmul_isa
    if _kernel_missing():
        pytest.skip("no C++ compiler for the CPU kernels")
    isa = cpu_matmul_isa()
    if path == "dpbf16":
        if isa not in ("amx", "avx512_bf16"):
            pytest.skip("no AVX512-BF16 on this CPU")
        monkeypatch.setenv("BATCHSPEC_CPU_ATTENTION_AMX", "0")
    if path == "avx512":
        if isa not in ("amx", "avx512_bf16", "avx512"):
            pytest.skip("no AVX-512 on this CPU")
        monkeypatch.setenv("BATCHSPEC_CPU_ATTENTION_AMX", "0")
        monkeypatch.setenv("BATCHSPEC_CPU_ATTENTION_DPBF16", "0")
    if path == "avx2":
        if isa == "other":
            pytest.skip("no AVX2 on this CPU")
        monkeypatch.setenv("BATCHSPEC_CPU_ATTENTION_AVX2", "1")
    if path == "portable":
        monkeypatch.setenv("BATCHSPEC_CPU_ATTENTION_PORTABLE", "1")


@pytest.mark.parametrize("path", ["default", "dpbf16", "avx512", "avx2", "portable"])
def test_cpu_paged_attention_kernel_equals_direct_attention(path, monkeypatch):
    """Every path of the CPU kernel against attention computed directly, for head sizes
    16-128, GQA groups 1-4 over 1-3 KV heads, block sizes that do and do not divide the
    kernel's chunks, fp32 and bf16, rows of 1-6 tokens: by default AMX tiles for bf16 where
    the machine has AMX (head sizes 32-128), else pair products (AVX512-BF16) for them,
    AVX-512 for the rest where it has that, else AVX2; pair products; AVX-512 alone; AVX2
    alone; the portable C++ one."""
    use_attention_path(path, monkeypatch)
    for D in (16, 32, 64, 128):
        for Hq, Hkv in ((4, 2), (8, 2), (3, 3), (2, 1)):
            for bs in (16, 5):
                for dt, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
                    err = paged_attention_error(D, Hq, Hkv, bs, dt)
                    assert err <= tol, (D, Hq, Hkv, bs, dt, err)


def test_cpu_cache_writes_are_index_copy():
    """write_kv_ (kernels/kv_write.h), the forward's key and value writes on CPU: the cache
    index_copy_ makes, for bf16 and fp32, keys contiguous and values a strided view of the
    qkv product (as the forward passes them); a slot outside the cache is refused."""
    from batchspec.spec._build import load
    if _kernel_missing():
        pytest.skip("no C++ compiler for the CPU kernels")
    op = load(False).write_kv_
    g = torch.Generator().manual_seed(0)
    for dt in (torch.bfloat16, torch.float32):
        qkv = torch.randn(7, 4 * 16 + 2 * 2 * 16, generator=g).to(dt)
        k = torch.randn(7, 2, 16, generator=g).to(dt)
        v = qkv[:, 4 * 16 + 2 * 16:].view(7, 2, 16)
        slots = torch.tensor([5, 0, 31, 12, 13, 14, 2])
        caches = [torch.randn(32, 2, 16, generator=g).to(dt) for _ in range(2)]
        want = [c.clone().index_copy_(0, slots, x) for c, x in zip(caches, (k, v))]
        op(caches[0], caches[1], k, v, slots)
        assert torch.equal(caches[0], want[0]) and torch.equal(caches[1], want[1])
        with pytest.raises(RuntimeError, match="out of range"):
            op(caches[0], caches[1], k, v, torch.tensor([5, 0, 32, 12, 13, 14, 2]))


@pytest.mark.parametrize("path", ["default", "dpbf16", "avx512", "avx2", "portable"])
def test_a_query_attends_alike_in_a_window_and_decoded_alone(path, monkeypatch):
    """Each query of a verification window (5 and 13 tokens) gets, bit for bit, the
    attention it gets as a decode step of its own (same keys, same cache), in bf16 and fp32,
    beside other rows, whichever of its task's queries the kernel works on together: what
    lets a speculative run's greedy tokens be plain decoding's in bf16 too."""
    from batchspec.spec._build import load
    use_attention_path(path, monkeypatch)
    op = load(False).paged_decode_attention
    g = torch.Generator().manual_seed(0)
    for D, Hq, Hkv in ((64, 4, 2), (128, 8, 2), (32, 3, 3)):
        for dt, W in ((torch.bfloat16, 5), (torch.float32, 5), (torch.bfloat16, 13)):
            bs, n = 16, 150
            q, kc, vc, tables, rows = paged_rows(D, Hq, Hkv, bs, dt, [W, 3], [n, 70], g)
            window = torch.zeros_like(q)
            op(q, kc, vc, torch.tensor(tables), rows, D ** -0.5, bs, window)
            alone = torch.zeros_like(q[:W])
            decodes = torch.tensor([[j, 1, n - W + 1 + j] for j in range(W)])
            op(q[:W].contiguous(), kc, vc, torch.tensor([tables[0]] * W), decodes, D ** -0.5,
               bs, alone)
            assert torch.equal(window[:W], alone), (path, D, Hq, Hkv, dt)


@pytest.mark.parametrize("path", ["default", "dpbf16", "avx512", "avx2", "portable"])
def test_attention_is_the_same_at_any_thread_count(path, monkeypatch):
    """With fewer rows than threads the kernel cuts rows of many queries (a prompt's) into
    pieces, and the pair-product path gives each KV head a task: outputs must be the same
    bit for bit at 1, 4 and 8 threads, for a prompt's row alone, beside a decode and beside
    windows, and match attention computed directly."""
    from batchspec.spec._build import load
    use_attention_path(path, monkeypatch)
    op = load(False).paged_decode_attention
    g = torch.Generator().manual_seed(0)
    before = torch.get_num_threads()
    try:
        for D, Hq, Hkv in ((64, 4, 2), (32, 3, 3)):
            for dt in (torch.bfloat16, torch.float32):
                for qlens, kvlens in (([40], [40]), ([37, 1], [100, 90]), ([5, 64, 3],
                                                                           [70, 200, 9])):
                    bs = 16
                    q, kc, vc, tables, rows = paged_rows(D, Hq, Hkv, bs, dt, qlens, kvlens, g)
                    outs = []
                    for threads in (1, 4, 8):
                        torch.set_num_threads(threads)
                        out = torch.zeros_like(q)
                        op(q, kc, vc, torch.tensor(tables), rows, D ** -0.5, bs, out)
                        outs.append(out)
                    assert all(torch.equal(outs[0], o) for o in outs[1:]), (D, Hq, dt, qlens)
                    err = direct_attention_error(outs[0], q, kc, vc, tables, rows, bs,
                                                 D ** -0.5)
                    assert err <= (2e-2 if dt == torch.bfloat16 else 1e-5), (D, Hq, dt, err)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("path", ["amx", "dpbf16"])
def test_bf16_attention_paths_agree_with_the_avx512_path(path, monkeypatch):
    """bf16 attention takes the tile path on a CPU with AMX, and pair products on one with
    AVX512-BF16 only: each must agree with the AVX-512 path up to the order of sums (fewer
    than 1% of outputs differ, none by a bf16 step of its head's largest value), not merely
    sit within tolerance of fp32 attention. Weights rounded to bf16 once, as GPU flash
    kernels round them, differ in over a quarter of the outputs, and greedy tokens of windows
    then disagree with decodes' several times as often (docs/benchmarks.md)."""
    from batchspec.spec._build import load
    if _kernel_missing():
        pytest.skip("no C++ compiler for the CPU kernels")
    from batchspec.config import cpu_matmul_isa
    if path == "amx" and cpu_matmul_isa() != "amx":
        pytest.skip("no AMX on this CPU")
    if path == "dpbf16" and cpu_matmul_isa() not in ("amx", "avx512_bf16"):
        pytest.skip("no AVX512-BF16 on this CPU")
    op = load(False).paged_decode_attention
    g = torch.Generator().manual_seed(0)
    for D, Hq, Hkv in ((64, 4, 2), (128, 8, 2), (32, 3, 3)):
        bs = 16
        q, kc, vc, tables, rows = paged_rows(D, Hq, Hkv, bs, torch.bfloat16, [3, 5, 6, 4, 5],
                                             [40, 100, 200, 700, 65], g, q_scale=2.0)
        outs = []
        for on in ("1", "0"):
            monkeypatch.setenv("BATCHSPEC_CPU_ATTENTION_AMX", on if path == "amx" else "0")
            monkeypatch.setenv("BATCHSPEC_CPU_ATTENTION_DPBF16", on if path == "dpbf16" else "0")
            out = torch.zeros_like(q)
            op(q, kc, vc, torch.tensor(tables), rows, D ** -0.5, bs, out)
            outs.append(out.float())
        other, avx = outs
        assert (other != avx).float().mean().item() < 0.01, (D, Hq, Hkv)
        head_max = torch.maximum(other.abs().amax(-1), avx.abs().amax(-1))
        assert ((other - avx).abs().amax(-1) < head_max * 2 ** -8).all(), (D, Hq, Hkv)


@pytest.mark.parametrize("path", ["vector", "portable"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_swiglu_and_rope_give_the_torch_ops_result(dtype, path, monkeypatch):
    """The C++ silu(gate) * up and RoPE of q and k (kernels/fused_cpu.cpp) against the torch
    expressions they replace, on the explicit AVX2 / AVX-512 paths where the CPU has them
    and on the compiler-vectorised loops (BATCHSPEC_CPU_FUSED_PORTABLE), at widths the
    explicit paths take (multiples of 8 / 16 and of 16 / 32) and widths they leave to the
    loops: RoPE bit for bit in bf16, SwiGLU within one bf16 step (its exp may differ in the
    last fp32 bit); q and k come back contiguous."""
    from batchspec.models.llama import apply_rope, fused_ops
    if _kernel_missing():
        pytest.skip("no C++ compiler for the CPU kernels")
    if path == "portable":
        monkeypatch.setenv("BATCHSPEC_CPU_FUSED_PORTABLE", "1")
    else:
        monkeypatch.delenv("BATCHSPEC_CPU_FUSED_PORTABLE", raising=False)
    dt = getattr(torch, dtype)
    ops = fused_ops(dt, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    exact = dict(atol=1e-6, rtol=1e-6) if dtype == "float32" else dict(atol=0, rtol=0)
    for inter in (96, 40, 36):
        gu = (torch.randn(37, 2 * inter, generator=g) * 4).to(dt)
        gu[0, :4] = torch.tensor([0.0, -0.0, 90.0, -90.0])
        gate, up = gu.chunk(2, dim=-1)
        step = dict(atol=1e-5, rtol=1e-5) if dtype == "float32" else dict(atol=0, rtol=2 ** -8)
        torch.testing.assert_close(ops.silu_mul(gu), F.silu(gate) * up, **step)
    for D, Hq, Hkv in ((64, 4, 2), (16, 3, 3), (128, 2, 1), (12, 2, 1)):
        T = 29
        qkv = torch.randn(T, (Hq + 2 * Hkv) * D, generator=g).to(dt)
        freqs = torch.outer(torch.arange(300).float(),
                            1.0 / 10000 ** (torch.arange(0, D, 2).float() / D))
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(dt), emb.sin().to(dt)
        pos = torch.randint(0, 300, (T,), generator=g)
        q, k = ops.rope_qk(qkv, cos, sin, pos, Hq, Hkv)
        ref = apply_rope(qkv[:, :(Hq + Hkv) * D].view(T, Hq + Hkv, D), cos[pos].unsqueeze(1),
                         sin[pos].unsqueeze(1))
        assert q.is_contiguous() and k.is_contiguous()
        torch.testing.assert_close(q, ref[:, :Hq], **exact)
        torch.testing.assert_close(k, ref[:, Hq:], **exact)
    with pytest.raises(RuntimeError, match="outside the table"):
        ops.rope_qk(qkv, cos, sin, torch.full((T,), 300), Hq, Hkv)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_rms_norm_gives_the_torch_ops_result(arch_model, dtype):
    """The C++ RMSNorm (kernels/fused_cpu.cpp, the residual add folded in) keeps the torch
    expression's roundings, on the vector path (AVX512-BF16 here) and the scalar loop; a
    forward with every fused op (RMSNorm, SwiGLU, RoPE) gives the torch ops' logits (within
    rounding), on ragged rows of a prefilled cache."""
    from batchspec.models.llama import fused_ops, rms_norm
    if _kernel_missing():
        pytest.skip("no C++ compiler for the CPU kernels")
    ops = fused_ops(getattr(torch, dtype), torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    for width in (96, 40):   # a vector path's width (16s) and one the scalar loop takes
        # bit for bit in bf16 at 96; at 40 the scalar loop's order of sums may move 1/rsqrt's
        # last bit and with it a rounding: within one bf16 step there (1 of 1480 values here)
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == "float32" else \
            dict(atol=0, rtol=0) if width % 16 == 0 else dict(atol=0, rtol=2 ** -7)
        x = torch.randn(37, width, generator=g).to(getattr(torch, dtype))
        res = torch.randn(37, width, generator=g).to(x.dtype)
        w = (torch.randn(width, generator=g) * 0.3 + 1).to(x.dtype)
        torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6), **tol)
        h = x.clone()
        y = ops.add_rms_norm_(h, res, w, 1e-6)
        assert torch.equal(h, x + res)
        torch.testing.assert_close(y, rms_norm(x + res, w, 1e-6), **tol)
    runner, prompts, seqs = prefilled(arch_model, dtype, (9, 23, 14))
    rows = [[5, 6, 7], [8], [9, 10]]
    args = (rows, [len(p) for p in prompts], [s.block_table for s in seqs], [len(r) for r in rows])
    assert runner.model.fused is not None, "the fused op was not used"
    fused = runner.forward(*args)
    runner.model.fused = None
    plain = runner.forward(*args)
    tol = dict(atol=1e-4, rtol=0) if dtype == "float32" else dict(atol=0.1, rtol=0.02)
    torch.testing.assert_close(fused, plain, **tol)
    assert torch.equal(fused.argmax(-1), plain.argmax(-1))
