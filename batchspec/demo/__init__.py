"""The bundled demo model family: a small Llama target trained on the Python standard
library (code and docs) and drafts distilled from it, the default models of `batchspec run`.
Built by scripts/build_demo_models.py; see docs/demo-models.md."""
from __future__ import annotations

import os

MODELS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "models")
NAMES = ("target", "draft", "draft-code", "draft-docs")


def demo_models() -> dict[str, str]:
    """{"target", "draft", "draft-code", "draft-docs"} -> absolute model directory."""
    paths = {name: os.path.join(MODELS_DIR, name) for name in NAMES}
    missing = [p for p in paths.values()
               if not os.path.exists(os.path.join(p, "model.safetensors"))]
    if missing:
        raise FileNotFoundError(
            f"demo models missing: {', '.join(missing)}; rebuild them with "
            f"`python scripts/build_demo_models.py` (see docs/demo-models.md)")
    return paths
