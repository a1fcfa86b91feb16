"""batchspec: offline / batch LLM generation with continuously batched speculative decoding."""
from batchspec.sampling import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "EngineConfig", "demo_models"]


def __getattr__(name):  # keep `import batchspec` light: torch loads on first use of LLM
    if name in ("LLM", "RequestOutput"):
        from batchspec import llm
        return getattr(llm, name)
    if name == "EngineConfig":
        from batchspec.config import EngineConfig
        return EngineConfig
    if name == "demo_models":
        from batchspec.demo import demo_models
        return demo_models
    raise AttributeError(name)
