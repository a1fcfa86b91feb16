"""EngineConfig: one validation path with errors that say what to fix."""
import json
import os

import pytest

from batchspec.config import EngineConfig
from batchspec.sampling import SamplingParams


def test_defaults_are_resolved(tiny_llama):
    c = EngineConfig(model=tiny_llama, device="cpu")
    assert (c.dtype, c.attention_backend, c.block_size) == ("float32", "torch", 16)
    assert EngineConfig(model=tiny_llama, device="cpu", attention_backend="flash").block_size == 256


@pytest.mark.parametrize("kwargs,match", [
    (dict(drafts={"code": "/nonexistent"}), "draft for domain 'code'"),
    (dict(dtype="int8"), "dtype must be"),
    (dict(block_size=12), "power of two"),
    (dict(attention_backend="flash", block_size=16), "multiple of 256"),
    (dict(confidence_threshold=1.5), "confidence_threshold"),
    (dict(num_speculative_tokens=-1), "num_speculative_tokens"),
    (dict(num_threads=0), "num_threads"),
    (dict(drafts={"code": "ngram", "code+vocab": "ngram"}), "domain 'code\\+vocab'"),
    (dict(drafts={"code": "ngram", "code+suffix": "suffix"}), "rename the domain"),
])
def test_bad_settings_fail_fast(tiny_llama, kwargs, match):
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        EngineConfig(model=tiny_llama, device="cpu", **kwargs)


def test_domain_names_with_a_plus_are_fine_unless_they_take_a_sources_name(tiny_llama):
    """A domain may be called "c++" or "a+b"; only D+vocab, D+ngram and D+suffix beside a
    domain D are refused (test_bad_settings_fail_fast)."""
    drafts = {"c++": "ngram", "a+b": "suffix", "a": "ngram", "vocab+x": "ngram"}
    assert EngineConfig(model=tiny_llama, device="cpu", drafts=drafts).drafts == drafts


def test_sampling_params_validation():
    assert SamplingParams(top_k=-1).top_k == 0
    for bad in (dict(temperature=-1), dict(top_p=0.0), dict(max_tokens=0), dict(top_k=-2)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_auto_dtype_follows_the_stored_weights(model_factory, tiny_llama):
    """auto: fp32 checkpoints run in fp32 on CPU; bf16 ones in bf16 where the CPU has bf16
    arithmetic (else fp32); on CUDA bf16, or fp16 for fp16 checkpoints."""
    from batchspec.config import cpu_has_native_bf16, default_dtype
    from batchspec.models.loader import stored_dtype
    bf16 = model_factory("llama", seed=0, dtype="bfloat16")
    fp16 = model_factory("llama", seed=0, dtype="float16")
    assert [stored_dtype(p) for p in (tiny_llama, bf16, fp16)] == \
        ["float32", "bfloat16", "float16"]
    assert EngineConfig(model=tiny_llama, device="cpu").dtype == "float32"
    assert EngineConfig(model=bf16, device="cpu").dtype == \
        ("bfloat16" if cpu_has_native_bf16() else "float32")
    assert EngineConfig(model=fp16, device="cpu").dtype == "float32"
    assert [default_dtype(p, "cuda") for p in (tiny_llama, bf16, fp16)] == \
        ["bfloat16", "bfloat16", "float16"]
    assert EngineConfig(model=bf16, device="cpu", dtype="float32").dtype == "float32"


def test_stored_dtype_reads_headers_without_torch(tmp_path, tiny_llama):
    """The dtype comes from the safetensors headers, read as bytes: `batchspec submit`
    checks a job (its EngineConfig, dtype auto) without loading torch. A file whose header
    cannot be read leaves config.json's dtype; loading the weights reports the file."""
    import shutil
    import subprocess
    import sys
    code = ("import sys; from batchspec.jobs.spec import JobSpec; "
            f"s = JobSpec.build(inputs=['in.parquet'], output='out', model={tiny_llama!r}); "
            "print(s.engine_config(device='cpu').dtype, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.split() == ["float32", "False"], out.stdout + out.stderr
    from batchspec.models.loader import stored_dtype
    bad = tmp_path / "bad"
    shutil.copytree(tiny_llama, bad)
    for name in os.listdir(bad):
        if name.endswith(".safetensors"):
            (bad / name).write_bytes(b"\xff" * 8 + b"{}")   # a header length of 2^64 - 1
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(config | {"torch_dtype": "bfloat16"}))
    assert stored_dtype(str(tiny_llama)) == "float32" and stored_dtype(str(bad)) == "bfloat16"


def test_the_cpu_is_named_by_its_widest_matrix_instructions():
    """Benchmarks record the CPU's matrix instructions: the ratios between methods depend on
    them. bf16 arithmetic in hardware is what amx and avx512_bf16 mean."""
    from batchspec.config import cpu_has_native_bf16, cpu_matmul_isa, cpu_model
    base = {"fpu", "sse2", "avx", "fma"}
    assert cpu_matmul_isa(base) == "other"
    assert cpu_matmul_isa(base | {"avx2"}) == "avx2"
    assert cpu_matmul_isa(base | {"avx2", "avx512f", "avx512_vnni"}) == "avx512"
    assert cpu_matmul_isa(base | {"avx2", "avx512f", "avx512_bf16"}) == "avx512_bf16"
    assert cpu_matmul_isa(base | {"avx2", "avx512f", "avx512_bf16", "amx_tile",
                                  "amx_bf16"}) == "amx"
    flags = set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    assert cpu_matmul_isa() == cpu_matmul_isa(flags)
    assert cpu_has_native_bf16() == bool({"amx_bf16", "avx512_bf16"} & flags)
    assert cpu_model() != ""
