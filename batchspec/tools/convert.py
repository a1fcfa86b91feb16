"""`batchspec convert`: turn a GGUF checkpoint (llama.cpp's format, often quantized) into the
Hugging Face directory batchspec loads: config.json, model.safetensors, tokenizer files and
the chat template.

transformers' GGUF loader does the work: it reads the GGUF metadata into a config and a
tokenizer and dequantizes the tensors (Q4_0, Q4_1, Q8_0, K-quants, ...) to floating point;
the result is saved with `save_pretrained`. It needs the `gguf` package (and `accelerate`)."""
from __future__ import annotations

import importlib.util
import os
import struct

import click

from batchspec.jobs.commands import clear_errors

DTYPES = ("float32", "bfloat16", "float16")


def convert_gguf(gguf_file: str, out_dir: str, dtype: str = "float32") -> str:
    """Dequantize `gguf_file` into an HF model directory at `out_dir` (created); returns it.
    Raises FileNotFoundError / ImportError / ValueError with a one-line reason."""
    if not os.path.isfile(gguf_file):
        raise FileNotFoundError(f"{gguf_file!r} is not a file")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    for pkg in ("gguf", "accelerate"):
        if importlib.util.find_spec(pkg) is None:
            raise ImportError(f"reading GGUF files needs the {pkg!r} package: "
                              f"pip install gguf accelerate")
    if os.path.exists(os.path.join(out_dir, "config.json")):
        raise FileExistsError(f"{out_dir!r} already holds a model (config.json); give an "
                              f"empty or new directory")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src_dir, name = os.path.split(os.path.abspath(gguf_file))
    try:
        tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name,
                                                     dtype=getattr(torch, dtype))
    except struct.error:   # a file cut short inside its header (metadata, tensor index)
        raise ValueError(f"{gguf_file!r} could not be read as a GGUF model: it ends inside "
                         f"its header (a truncated download?)") from None
    except (ValueError, KeyError, OSError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{gguf_file!r} could not be read as a GGUF model: {first}") from None
    save_dequantized(model, tokenizer, out_dir)
    return out_dir


def save_dequantized(model, tokenizer, out_dir: str) -> None:
    """Write weights, config and tokenizer. The model loaded from GGUF is flagged as
    quantized (which `save_pretrained` refuses) although its tensors are plain floats, so the
    state dict and the config are written directly, without the quantization entry; a tied
    output head is not stored twice."""
    from safetensors.torch import save_file

    from batchspec.tools.hfref import umask_mode
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    os.makedirs(out_dir, exist_ok=True)
    weights = os.path.join(out_dir, "model.safetensors")
    save_file(state, weights, metadata={"format": "pt"})
    umask_mode(weights)
    config.save_pretrained(out_dir)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


@click.command()
@click.argument("gguf_file", type=click.Path(dir_okay=False))
@click.option("-o", "--output", "out_dir", required=True, type=click.Path(file_okay=False),
              help="New directory for the Hugging Face model.")
@click.option("--dtype", type=click.Choice(DTYPES), default="float32", show_default=True,
              help="Floating-point type of the saved weights.")
@clear_errors
def convert(gguf_file, out_dir, dtype):
    """Convert a GGUF checkpoint into a Hugging Face directory (config, safetensors,
    tokenizer, chat template) that --model / --draft accept."""
    try:
        convert_gguf(gguf_file, out_dir, dtype)
    except (FileNotFoundError, FileExistsError, ImportError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"wrote {out_dir}")


COMMANDS = [convert]
