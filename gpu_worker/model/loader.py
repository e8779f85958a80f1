"""Weight loading from GGUF files and Hugging Face safetensors directories.

Both paths produce weights under Hugging Face parameter names, so the model code has one
naming scheme and a GGUF model can be written out as an equivalent safetensors directory.
The metadata (config, tokenizer, which path is which model) is read by pulseinfer/common/model,
which needs no torch.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from pulseinfer.common.model.config import ModelConfig
from pulseinfer.common.model.gguf_file import GGUFTensor
from pulseinfer.common.model.meta import ModelLoadError, check_load_format, dir_tokenizer, hf_dir_config, open_model, read_gguf_model
from pulseinfer.common.model.tokenizer import Tokenizer


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: Mapping[str, torch.Tensor]
    tokenizer: Tokenizer
    source: Path
    # what runners fit on these weights, by what it is (the lowrank scorer's key bases): the engines a
    # bench, an eval or a test makes on one loaded model fit it once
    fitted: dict[tuple, torch.Tensor] = field(default_factory=dict, repr=False)


def load_model(path: str | Path | None = None, load_format: str = "auto") -> LoadedModel:
    """A model's config, tokenizer and weights: its files', or with load_format `dummy` seeded random
    ones of its config's geometry (a GGUF file, a directory, or a name of meta.GEOMETRIES)."""
    check_load_format(load_format)
    if load_format == "dummy":
        return open_model(path, hf_dir=_dummy_hf_dir, gguf=_dummy_gguf)
    return open_model(path, hf_dir=_load_hf_dir, gguf=_load_gguf)


class DummyWeights(Mapping[str, torch.Tensor]):
    """Every weight the config's math reads, made when read (never all held at once) from a seed and
    its name: the same on every device and in every process. Linear weights and biases are N(0, 0.02),
    norms the identity (1, or 0 for Gemma's 1 + w)."""

    def __init__(self, config: ModelConfig, seed: int = 0):
        self.config, self.seed = config, seed
        self.shapes = weight_shapes(config)

    def __getitem__(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        if name.endswith("norm.weight"):
            return torch.full(shape, 0.0 if self.config.gemma else 1.0)
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
        return torch.randn(shape, generator=generator).mul_(0.02)

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def _dummy_hf_dir(path: Path) -> LoadedModel:
    config = hf_dir_config(path)
    return LoadedModel(config, DummyWeights(config), dir_tokenizer(path, "dummy"), path)


def _dummy_gguf(path: Path) -> LoadedModel:
    fields, _, config = read_gguf_model(path)
    return LoadedModel(config, DummyWeights(config), Tokenizer.from_gguf_fields(fields), path)


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
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Gemma's norms around attention and MLP: llama.cpp's post_attention_norm is HF's post_attention_layernorm
_GGUF_GEMMA_NAMES = _GGUF_LAYER_NAMES | {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _hf_name(gguf_name: str, gemma: bool) -> str | None:
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    match = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
    names = _GGUF_GEMMA_NAMES if gemma else _GGUF_LAYER_NAMES
    if match and match.group(2) in names:
        return f"model.layers.{match.group(1)}.{names[match.group(2)]}"
    return None


def _unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp interleaves Q/K rows for its RoPE; HF uses rotate-half. Undo the permutation."""
    head_dim = w.shape[0] // n_head
    return w.reshape(n_head, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dequantize(tensor: GGUFTensor) -> np.ndarray:
    from gguf import quants

    return np.asarray(quants.dequantize(tensor.data, tensor.qtype), dtype=np.float32).reshape(tensor.shape)


def _to_hf(name: str, array: np.ndarray, config: ModelConfig) -> np.ndarray:
    """A GGUF tensor as transformers holds it: llama.cpp permutes the q/k rows of the Llama
    architecture only (the others use the rotate-half layout already), and stores Gemma's norm
    weights as the multiplier 1 + w."""
    if config.architecture == "llama" and re.search(r"[qk]_proj\.(weight|bias)$", name):
        return _unpermute_rope(array, config.num_heads if "q_proj" in name else config.num_kv_heads)
    if config.gemma and name.endswith("norm.weight"):
        return array - 1.0
    return array


def _load_gguf(path: Path) -> LoadedModel:
    fields, all_tensors, config = read_gguf_model(path)
    tensors = [(name, t) for t in all_tensors if (name := _hf_name(t.name, config.gemma))]
    with ThreadPoolExecutor(max_workers=2) as pool:  # numpy dequantization releases the GIL
        arrays = list(pool.map(lambda item: _dequantize(item[1]), tensors))
    weights = {}
    for (name, _), array in zip(tensors, arrays):
        # F32 tensors are read-only mmap views
        weights[name] = torch.from_numpy(np.require(_to_hf(name, array, config), requirements=["C", "W"]))
    _check_weights(config, weights, path)
    return LoadedModel(config, weights, Tokenizer.from_gguf_fields(fields), path)


# ---------------------------------------------------------------- Hugging Face directory


def _load_hf_dir(path: Path) -> LoadedModel:
    from safetensors.torch import load_file

    config = hf_dir_config(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors files (seeded random weights of its geometry: --load-format dummy)")
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


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight the model reads, by Hugging Face name, with its shape."""
    c = config
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size), "model.norm.weight": (c.hidden_size,)}
    if not c.tie_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    norms = ["input_layernorm", "post_attention_layernorm"] + (
        ["pre_feedforward_layernorm", "post_feedforward_layernorm"] if c.gemma else []
    )
    layer = {f"{name}.weight": (c.hidden_size,) for name in norms}
    layer |= {
        "self_attn.q_proj.weight": (c.q_size, c.hidden_size),
        "self_attn.k_proj.weight": (c.kv_size, c.hidden_size),
        "self_attn.v_proj.weight": (c.kv_size, c.hidden_size),
        "self_attn.o_proj.weight": (c.hidden_size, c.q_size),
        "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
        "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
        "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
    }
    if c.qkv_bias:
        layer |= {"self_attn.q_proj.bias": (c.q_size,), "self_attn.k_proj.bias": (c.kv_size,), "self_attn.v_proj.bias": (c.kv_size,)}
    if c.qk_norm:
        layer |= {"self_attn.q_norm.weight": (c.head_dim,), "self_attn.k_norm.weight": (c.head_dim,)}
    for i in range(c.num_layers):
        shapes |= {f"model.layers.{i}.{name}": shape for name, shape in layer.items()}
    return shapes


def _check_weights(config: ModelConfig, weights: dict[str, torch.Tensor], source: Path) -> None:
    """Every weight the config's math reads is there, in its shape: a config that leaves out a
    family's part (Qwen3 without q/k norms) fails here rather than computing something else."""
    shapes = weight_shapes(config)
    missing = [name for name in shapes if name not in weights]
    if missing:
        raise ModelLoadError(f"{source}: missing {len(missing)} weights the {config.architecture} config needs, e.g. {missing[:3]}")
    unused = [name for name in weights if name not in shapes and not name.endswith("rotary_emb.inv_freq")]
    if unused:
        raise ModelLoadError(f"{source}: {len(unused)} weights the {config.architecture} config does not use, e.g. {unused[:3]}")
    wrong = [(name, tuple(weights[name].shape), shape) for name, shape in shapes.items() if tuple(weights[name].shape) != shape]
    if wrong:
        name, got, want = wrong[0]
        raise ModelLoadError(f"{source}: {name} has shape {got}, the config implies {want} ({len(wrong)} weights differ)")
