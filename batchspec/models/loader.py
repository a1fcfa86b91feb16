"""Load a Hugging Face model directory: config.json, *.safetensors, tokenizer files.

No repository code is executed (no trust_remote_code) and pickle checkpoints are refused."""
from __future__ import annotations

import glob
import json
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # (torch loads with the weights: `batchspec submit` checks a job without it)
    import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                           "Qwen3ForCausalLM")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


@dataclass
class ModelConfig:
    """The subset of a HF config the Llama-family forward needs."""
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool         # q/k/v biases (Qwen2 always, Llama optional)
    qk_norm: bool                # per-head RMSNorm on q and k (Qwen3)
    sliding_window: int | None
    eos_token_ids: list[int]
    hidden_act: str


def _read_json(file: str) -> dict:
    """A JSON object from a model directory, or a ValueError naming the file."""
    with open(file) as f:
        try:
            raw = json.load(f)
        except ValueError as e:
            raise ValueError(f"{file} is not valid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise ValueError(f"{file} is not a JSON object")
    return raw


def _config_path(path: str) -> str:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{path!r} has no config.json: give a Hugging Face model directory")
    return cfg_path


def config_json(path: str) -> dict:
    """The model directory's config.json as a dict, or an error naming what is wrong."""
    return _read_json(_config_path(path))


def read_config(path: str) -> ModelConfig:
    cfg_path = _config_path(path)
    raw = _read_json(cfg_path)
    missing = [key for key in ("vocab_size", "hidden_size", "num_hidden_layers",
                               "num_attention_heads", "intermediate_size") if key not in raw]
    if missing:
        raise ValueError(f"{cfg_path} lacks {', '.join(missing)}: give the model's own config.json")
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ValueError(f"{path!r}: architecture {archs or raw.get('model_type')} is not "
                         f"supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{path!r}: hidden_act {act!r} is not supported (silu only)")
    num_heads = raw["num_attention_heads"]
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    rope_theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "linear", "llama3"):
        raise ValueError(f"{path!r}: RoPE type {rope_type!r} is not supported "
                         f"(default, linear, llama3)")
    eos = raw.get("eos_token_id")
    eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    gen_cfg = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_cfg):
        g = _read_json(gen_cfg).get("eos_token_id")
        if g is not None:
            eos_ids = sorted(set(eos_ids) | set([g] if isinstance(g, int) else g))
    sliding = raw.get("sliding_window")
    if arch == "Qwen2ForCausalLM" and not raw.get("use_sliding_window", False):
        sliding = None
    if arch in ("LlamaForCausalLM", "Qwen3ForCausalLM"):
        sliding = None if not raw.get("use_sliding_window", False) else sliding
    return ModelConfig(
        architecture=arch, vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
        num_layers=raw["num_hidden_layers"], num_heads=num_heads,
        num_kv_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
        intermediate_size=raw["intermediate_size"], rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta, rope_scaling=None if rope_type == "default" else rope,
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        attention_bias=arch == "Qwen2ForCausalLM" or raw.get("attention_bias", False),
        qk_norm=arch == "Qwen3ForCausalLM", sliding_window=sliding, eos_token_ids=eos_ids,
        hidden_act=act)


def weight_shapes(cfg: ModelConfig, names) -> dict[str, tuple[int, ...]]:
    """Every tensor the forward (models/llama.py) reads, with its shape in the whole
    checkpoint by the config; `names`: the checkpoint's tensor names (an lm_head is read where
    the embeddings are not tied and there is one)."""
    E, D, Q, KV, M = (cfg.hidden_size, cfg.head_dim, cfg.num_heads * cfg.head_dim,
                      cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size)
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, E), "model.norm.weight": (E,)}
    if not cfg.tie_word_embeddings and "lm_head.weight" in names:
        shapes["lm_head.weight"] = (cfg.vocab_size, E)
    for i in range(cfg.num_layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        shapes |= {p + "input_layernorm.weight": (E,), p + "post_attention_layernorm.weight": (E,),
                   a + "q_proj.weight": (Q, E), a + "k_proj.weight": (KV, E),
                   a + "v_proj.weight": (KV, E), a + "o_proj.weight": (E, Q),
                   p + "mlp.gate_proj.weight": (M, E), p + "mlp.up_proj.weight": (M, E),
                   p + "mlp.down_proj.weight": (E, M)}
        if cfg.attention_bias:
            shapes |= {a + "q_proj.bias": (Q,), a + "k_proj.bias": (KV,), a + "v_proj.bias": (KV,)}
        if cfg.qk_norm:
            shapes |= {a + "q_norm.weight": (D,), a + "k_norm.weight": (D,)}
    return shapes


def check_shapes(path: str, have: dict[str, list[int]], want: dict[str, tuple[int, ...]]) -> None:
    """Raise a ValueError, saying what to fix, unless every tensor in `want` is in `have` (a
    checkpoint's names and shapes) with that shape: config.json and the weights must describe
    the same model."""
    for name, shape in want.items():
        if name not in have:
            raise ValueError(f"{path!r} has no tensor {name} that its config.json calls for: "
                             f"the config and the weights differ")
        if tuple(have[name]) != tuple(shape):
            raise ValueError(f"{path!r}: tensor {name} has shape {list(have[name])} where its "
                             f"config.json makes it {list(shape)}: the config and the weights "
                             f"differ")


def weight_files(path: str) -> list[str]:
    """The model's *.safetensors files; an error saying what to do where there are none."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        if glob.glob(os.path.join(path, "*.bin")) or glob.glob(os.path.join(path, "*.pt")):
            raise ValueError(f"{path!r} holds only pickle checkpoints (*.bin/*.pt), which "
                             f"are not loaded for safety; convert them to *.safetensors")
        raise FileNotFoundError(f"{path!r} has no *.safetensors weights")
    return files


def _unreadable(file: str, why) -> ValueError:
    return ValueError(f"{file} is not a readable safetensors file ({why}): download or convert "
                      f"the weights again")


def check_model_files(path: str) -> None:
    """Raise what loading the model at `path` would: from its config.json and the headers of
    its safetensors files alone (no torch, no weights read), so that a job is refused when it
    is submitted, not on a worker. Checks the config, every tensor's shape against it, that
    each file holds the bytes its header promises, and that tokenizer_config.json (if any)
    parses; the tokenizer itself loads on the worker (transformers: 1.3 s to import)."""
    cfg = read_config(path)
    _tokenizer_class(path)
    have: dict[str, list[int]] = {}
    for f in weight_files(path):
        try:
            header_size, header = safetensors_header(f)
            tensors = {k: v for k, v in header.items() if k != "__metadata__"}
            end = max((v["data_offsets"][1] for v in tensors.values()), default=0)
        except Exception as e:   # noqa: BLE001 - malformed JSON or entries
            raise _unreadable(f, e) from e
        size, needed = os.path.getsize(f), 8 + header_size + end
        if size < needed:
            raise _unreadable(f, f"{size} bytes where its header needs {needed}: truncated")
        have |= {k: v["shape"] for k, v in tensors.items()}
    check_shapes(path, have, weight_shapes(cfg, have))


class Checkpoint:
    """The tensors of a model directory's *.safetensors files, read on demand: whole, or a
    range along one dimension, so that a tensor-parallel rank reads only its shard."""

    def __init__(self, path: str):
        from safetensors import safe_open
        self.path = path
        self._files = []
        for f in weight_files(path):
            try:
                self._files.append(safe_open(f, "pt"))
            except OSError:
                raise
            except Exception as e:   # a truncated or corrupt file: SafetensorError
                raise _unreadable(f, e) from e
        self._where = {name: st for st in self._files for name in st.keys()}

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def check(self, shapes: dict[str, tuple[int, ...]]) -> None:
        """check_shapes over this checkpoint's tensors."""
        check_shapes(self.path, {n: self.shape(n) for n in shapes if n in self._where}, shapes)

    def shape(self, name: str) -> list[int]:
        return list(self._where[name].get_slice(name).get_shape())

    def get(self, name: str, dim: int | None = None, start: int = 0,
            stop: int | None = None) -> torch.Tensor:
        """The tensor `name`, or rows (dim 0) / columns (dim 1) start:stop of it."""
        if dim is None:
            return self._where[name].get_tensor(name)
        part = self._where[name].get_slice(name)
        return part[start:stop] if dim == 0 else part[:, start:stop]

    def num_params(self, skip: tuple[str, ...] = ()) -> int:
        return sum(math.prod(self.shape(n)) for n in self._where if n not in skip)


# tokenizer_config.json classes that AutoTokenizer resolves to transformers' generic class over
# tokenizer.json (TokenizersBackend, alias PreTrainedTokenizerFast): batchspec's own models
# (the demo family, tiny test models) and any saved from such a tokenizer
GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(path: str):
    """The model's HF tokenizer, or None when the directory has no tokenizer files. A
    tokenizer of the generic class is loaded as that class: AutoTokenizer would build the
    same object after reading the model's config through AutoConfig, which imports the
    model family's modules (2-3 s of a job's start-up on a 2-core CPU)."""
    if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        return None
    try:
        if _tokenizer_class(path) in GENERIC_TOKENIZER_CLASSES and \
                os.path.isfile(os.path.join(path, "tokenizer.json")):
            from transformers import PreTrainedTokenizerFast
            return PreTrainedTokenizerFast.from_pretrained(path)
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except OSError:
        raise
    except Exception as e:   # malformed tokenizer files: JSON or the tokenizers library's errors
        raise ValueError(f"cannot load the tokenizer of {path!r} ({e}): check its tokenizer "
                         f"files ({', '.join(TOKENIZER_FILES)})") from e


def _tokenizer_class(path: str) -> str | None:
    """tokenizer_config.json's class, None without the file (a malformed one raises)."""
    file = os.path.join(path, "tokenizer_config.json")
    return _read_json(file).get("tokenizer_class") if os.path.isfile(file) else None


SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


def safetensors_header(file: str) -> tuple[int, dict]:
    """A .safetensors file's header, read without torch: its length in bytes (a little-endian
    u64 first in the file) and its JSON, each tensor's dtype, shape and data offsets."""
    with open(file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if not 2 <= size <= 100 * 2 ** 20:
            raise ValueError(f"{file}: not a safetensors file (header of {size} bytes)")
        return size, json.loads(f.read(size))


def stored_dtype(path: str) -> str | None:
    """The floating-point dtype a checkpoint's weights are stored in: the first floating
    tensor's in the safetensors headers, else config.json's `torch_dtype` (or `dtype`)."""
    for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        try:
            _, header = safetensors_header(f)
            for k in sorted(header):
                if k != "__metadata__" and (dt := SAFETENSORS_DTYPES.get(header[k]["dtype"])):
                    return dt
        except Exception:  # unreadable here: loading the weights reports it properly
            break
    raw = _read_json(_config_path(path))
    named = raw.get("torch_dtype") or raw.get("dtype")
    return named if named in SAFETENSORS_DTYPES.values() else None


def num_parameters(path: str) -> int:
    return Checkpoint(path).num_params()
