"""Training text for the demo model family, taken from what ships with Python itself.

Two domains: `code` (the standard library's Python source) and `docs` (English prose: the
docstrings of the same files, extracted with `ast`, the pydoc topics text, and the text
files bundled with the library). The held-out split is chosen per file (or per pydoc topic)
by a hash of its name, so it does not depend on a seed, and a held-out file contributes
neither its source nor its docstrings to training."""
from __future__ import annotations

import ast
import functools
import inspect
import os
import random
import sysconfig
import zlib

DOMAINS = ("code", "docs")
HELDOUT_PERCENT = 4
# encodings/ is mostly generated codec tables, not code anyone writes.
_SKIP_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__", "encodings"}


def is_heldout(name: str) -> bool:
    return zlib.crc32(name.encode()) % 100 < HELDOUT_PERCENT


def _stdlib_files(ext: str) -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        paths += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(ext)]
    return [(os.path.relpath(p, root), p) for p in paths]


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (UnicodeDecodeError, OSError):
        return None


def _docstrings(source: str) -> str:
    """Module, class and function docstrings of one file, in source order."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return ""
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, kinds) and (doc := ast.get_docstring(node, clean=True)):
            if len(doc) >= 40:  # one-liners like "Return x." teach little prose
                found.append((getattr(node, "lineno", 0), doc))
    return "\n\n".join(doc for _, doc in sorted(found, key=lambda t: t[0]))


def build_corpus() -> dict[str, dict[str, list[tuple[str, str]]]]:
    """{domain: {"train"|"heldout": [(name, text), ...]}} from the running Python."""
    from pydoc_data.topics import topics

    corpus = {d: {"train": [], "heldout": []} for d in DOMAINS}

    def add(domain, name, text):
        if text and text.strip():
            corpus[domain]["heldout" if is_heldout(name) else "train"].append((name, text))

    for name, path in _stdlib_files(".py"):
        source = _read(path)
        if source is None:
            continue
        add("code", name, source)
        add("docs", name, _docstrings(source))
    for key in sorted(topics):
        add("docs", f"pydoc:{key}", inspect.cleandoc(topics[key]))
    for name, path in _stdlib_files(".txt"):
        add("docs", name, _read(path))
    return corpus


@functools.lru_cache(maxsize=1)
def _cached_corpus():
    return build_corpus()


def corpus_prompts(split: str, domains=DOMAINS, num_per_domain: int = 32, *, seed: int = 0,
                   min_chars: int = 120, max_chars: int = 400) -> list[dict]:
    """Prompts cut from the corpus split: a few whole lines starting at a random non-blank
    line of a random document (longer documents more likely), so that a prompt ends where a
    writer would pause. Returns [{prompt, domain}], num_per_domain for each domain."""
    rng = random.Random(seed)
    prompts = []
    for domain in domains:
        docs = [text for _, text in _cached_corpus()[domain][split]]
        weights = [len(t) for t in docs]
        seen: set[str] = set()
        for _ in range(num_per_domain * 20):
            if len(seen) == num_per_domain:
                break
            lines = rng.choices(docs, weights)[0].splitlines(keepends=True)
            starts = [i for i, line in enumerate(lines) if line.strip()]
            if not starts:
                continue
            i = rng.choice(starts)
            text = ""
            while i < len(lines) and len(text) < min_chars:
                text, i = text + lines[i], i + 1
            if len(text) >= min_chars // 2 and text not in seen:
                seen.add(text := text[:max_chars])
                prompts.append({"prompt": text, "domain": domain})
    return prompts
