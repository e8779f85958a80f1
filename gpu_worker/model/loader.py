"""Weight loading from GGUF files and Hugging Face safetensors directories.

Both paths produce weights under Hugging Face parameter names, so the model code has one
naming scheme and a GGUF model can be written out as an equivalent safetensors directory.
The metadata (config, tokenizer, which path is which model) is read by pulseinfer/common/model,
which needs no torch.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pulseinfer.common.model.config import ModelConfig
from pulseinfer.common.model.gguf_file import GGUFTensor
from pulseinfer.common.model.meta import ModelLoadError, hf_dir_config, open_model, read_gguf_model
from pulseinfer.common.model.tokenizer import Tokenizer


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    source: Path


def load_model(path: str | Path | None = None) -> LoadedModel:
    return open_model(path, hf_dir=_load_hf_dir, gguf=_load_gguf)


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


def _load_gguf(path: Path) -> LoadedModel:
    fields, all_tensors, config = read_gguf_model(path)
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


def _load_hf_dir(path: Path) -> LoadedModel:
    from safetensors.torch import load_file

    config = hf_dir_config(path)
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
