"""Build glue for the verification kernels: JIT-compile kernels/ with torch cpp_extension.

Two flavours of one bindings file (kernels/verify_ops.cpp):
  cpu   registers torch.ops.batchspec.*       (the C++ twin of the kernel; any C++ compiler),
        plus the CPU paged attention of short rows (kernels/paged_attention_cpu.cpp),
        the fused RMSNorm of a layer (kernels/fused_cpu.cpp), bf16 linear layers on AMX tiles
        or AVX512-BF16 (kernels/linear_cpu.cpp), a draft's output layer in int8
        (kernels/head_int8_cpu.cpp) and the suffix trie of suffix drafts
        (kernels/suffix_trie.cpp; a pybind11 class, so this flavour is also a Python module:
        cpu_module()) and the adaptive policy's per-row arithmetic (kernels/policy_core.cpp)
  cuda  registers torch.ops.batchspec_cuda.*  (adds kernels/verify_kernel.cu; CUDA torch + nvcc)
Builds are cached under $BATCHSPEC_CACHE/kernels (default ~/.cache/batchspec/kernels), one
directory per torch version, hash of the kernel sources, compiler flags and place of the
sources (build_dir), so checkouts never rebuild each other's builds. A first build says so on
stderr (it takes a minute or two on 2 cores: 85-89 s on a 2-core Xeon VM).
`python -m batchspec.spec._build [--cuda]` builds ahead of time (e.g. in a Docker image).
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import re
import sys
from pathlib import Path

import torch

NAMESPACE = {False: "batchspec", True: "batchspec_cuda"}
_errors: dict[bool, str] = {}
_module = None   # the CPU flavour as a Python module (its pybind11 classes: SuffixTrie)


def kernel_dir() -> Path:
    """kernels/ of an installed package (batchspec/kernels) or of a source checkout."""
    pkg = Path(__file__).resolve().parents[1]
    for d in (pkg / "kernels", pkg.parent / "kernels"):
        if (d / "verify_core.h").is_file():
            return d
    raise FileNotFoundError(f"verification kernel sources not found next to {pkg}")


def cache_dir() -> Path:
    root = os.environ.get("BATCHSPEC_CACHE") or os.path.join(Path.home(), ".cache", "batchspec")
    return Path(root) / "kernels"


def sources_hash() -> str:
    """Hash of every file in kernels/ (sources and headers)."""
    h = hashlib.sha256()
    for path in sorted(kernel_dir().iterdir()):
        if path.is_file():
            h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:12]


def build_dir(flavour: str, cflags: list[str]) -> Path:
    """Where a flavour's build is cached: keyed by torch's version, the sources, the flags
    (a build made with other flags is another build) and the sources' directory. The build
    files name the sources by path, so two installs of one revision at different places (two
    virtualenvs, two checkouts) that shared a directory rebuilt it in turn, about a minute at
    each process's start."""
    flags = hashlib.sha256(" ".join(cflags).encode()).hexdigest()[:6]
    place = hashlib.sha256(str(kernel_dir()).encode()).hexdigest()[:6]
    return cache_dir() / re.sub(r"[^\w.]+", "_", f"torch{torch.__version__}-{flavour}-"
                                               f"{sources_hash()}-{flags}-{place}")


def load(cuda: bool = False):
    """Compile (or reuse) and load one flavour; returns its torch.ops namespace. Raises on
    failure (missing compiler/nvcc, compile error); a failure is remembered, not retried."""
    if cuda in _errors:
        raise RuntimeError(_errors[cuda])
    ns = getattr(torch.ops, NAMESPACE[cuda])
    if hasattr(ns, "rejection_sample"):
        return ns
    try:
        _compile(cuda)
    except Exception as e:
        msg = str(e).strip().splitlines()
        _errors[cuda] = f"{type(e).__name__}: {msg[-1] if msg else ''}"
        raise
    return ns


def cpu_module():
    """The CPU flavour's Python module (kernels/suffix_trie.cpp's SuffixTrie); raises as
    load() does."""
    load(False)
    return _module


def _compile(cuda: bool) -> None:
    global _module
    from torch.utils import cpp_extension

    if cuda and not (torch.version.cuda and cpp_extension.CUDA_HOME):
        # No GPU is needed to build (e.g. in a Docker build: set TORCH_CUDA_ARCH_LIST).
        raise RuntimeError("CUDA build needs a CUDA build of torch and nvcc (CUDA_HOME)")
    src = kernel_dir()
    flavour = "cuda" if cuda else "cpu"
    sources = [str(src / "verify_ops.cpp")] + ([str(src / "verify_kernel.cu")] if cuda else
                                               [str(src / "paged_attention_cpu.cpp"),
                                                str(src / "fused_cpu.cpp"),
                                                str(src / "linear_cpu.cpp"),
                                                str(src / "head_int8_cpu.cpp"),
                                                str(src / "draft_steps_cpu.cpp"),
                                                str(src / "suffix_trie.cpp"),
                                                str(src / "policy_core.cpp")])
    # -fno-trapping-math: no FP exception is ever observed, so loops with a clamp or a
    # select (the portable attention path's exp, the host draw's filter) vectorise; it
    # changes no result
    # -fopenmp: at::parallel_for is inline and runs its threads through OpenMP only where
    # the caller is built with it; without it every op here ran on the calling thread alone,
    # whatever torch.set_num_threads said. The OpenMP runtime is the one torch loaded
    # (libgomp.so.1).
    cflags = ["-O3", "-fno-trapping-math", f"-DBS_NS={NAMESPACE[cuda]}"] + \
        (["-DBS_WITH_CUDA"] if cuda else ["-fopenmp"])
    build = build_dir(flavour, cflags)
    build.mkdir(parents=True, exist_ok=True)
    if not any(build.glob("*.so")):
        print(f"batchspec: building the {flavour.upper()} verification kernel (first run, "
              f"a minute or two on 2 cores; cached in {build})...", file=sys.stderr, flush=True)
    # torch's own build lock is a file that a builder killed mid-build (kill -9, OOM) leaves
    # behind, and every later build would wait on it forever. Builders take an flock first
    # (the kernel drops it when its holder dies), so a torch lock found under it is stale.
    with open(build / ".build.flock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        (build / "lock").unlink(missing_ok=True)
        module = cpp_extension.load(
            name=f"batchspec_verify_{flavour}", sources=sources, build_directory=str(build),
            extra_cflags=cflags, extra_include_paths=[str(src)],
            extra_ldflags=None if cuda else ["-fopenmp"],
            # no fused multiply-add: the GPU rounds like the host and the torch reference
            extra_cuda_cflags=["-O3", "--fmad=false", "-lineinfo"] if cuda else None,
            is_python_module=not cuda, verbose=bool(os.environ.get("BATCHSPEC_BUILD_VERBOSE")))
    if not cuda:
        _module = module


def load_error(cuda: bool = False) -> str | None:
    """None when the flavour loads, else a one-line reason."""
    try:
        load(cuda)
        return None
    except Exception:  # noqa: BLE001 - any build failure means "fall back"
        return _errors.get(cuda, "load failed")


if __name__ == "__main__":
    want_cuda = "--cuda" in sys.argv[1:]
    load(False)
    print("cpu kernel:", cache_dir())
    if want_cuda:
        load(True)
        print("cuda kernel:", cache_dir())
