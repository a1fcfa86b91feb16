"""Shared fixtures: small random models in Hugging Face format, made once per session."""
from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
# Subprocesses (CLI, Celery workers) import the package from this checkout.
os.environ["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tiny models gain nothing from intra-op threads, and on a 2-core machine shared with worker
# processes spinning thread pools slow them down by an order of magnitude.
os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402

torch.set_num_threads(1)

# Fixture modules owned by parts of the suite.
pytest_plugins = [m for m in ("tests.fixtures_redis",)
                  if os.path.exists(os.path.join(ROOT, *m.split(".")) + ".py")]


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    """make(arch="llama", **kwargs) -> path of a random HF model dir (cached per kwargs)."""
    from batchspec.tools.tiny import make_random_model
    cache: dict = {}

    def make(arch: str = "llama", **kwargs) -> str:
        key = (arch, tuple(sorted(kwargs.items())))
        if key not in cache:
            d = tmp_path_factory.mktemp(f"model_{arch}")
            cache[key] = make_random_model(str(d), arch, **kwargs)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama(model_factory) -> str:
    """The default tiny target: Llama, vocab 512, 2 layers, hidden 64, GQA 4/2."""
    return model_factory("llama", seed=0)


@pytest.fixture(scope="session")
def tiny_draft(model_factory) -> str:
    """A different random Llama with the same tokenizer/vocab (a poor draft)."""
    return model_factory("llama", seed=1, num_layers=1, hidden_size=32, num_heads=2,
                         num_kv_heads=1)
