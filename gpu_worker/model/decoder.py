"""Decoder math of the supported families, one code path with the family's switches (ModelConfig):

- Llama, Mistral: RMSNorm, RoPE (default, linear or llama3 scaling), GQA projections, SwiGLU MLP;
- Qwen2: q/k/v biases, yarn scaling; Qwen3: per-head RMSNorm of q and k;
- Gemma 3: embeddings scaled by sqrt(hidden), (1 + w) norms before and after attention and MLP,
  q/k norms, scores scaled by query_pre_attn_scalar, GELU-tanh MLP, sliding-window layers with a
  rotary base of their own.

Attention itself is the backend's (gpu_worker/attention), the order of the layers the loop's
(gpu_worker/forward.py), and which layers slide is the config's (the backend reads it there)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pulseinfer.common.model.config import ModelConfig, RopeConfig

Rotary = tuple[torch.Tensor, torch.Tensor]  # cos, sin [T, head_dim] of the tokens' positions
Rotaries = tuple[Rotary, Rotary]  # full layers', sliding layers'


@dataclass(frozen=True)
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # q, k and v projections stacked: one matmul
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # per-head RMSNorm weights of q and k (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None
    o_proj: torch.Tensor
    attention_out_norm: torch.Tensor | None  # Gemma 3 norms attention's output before the residual add
    mlp_norm: torch.Tensor
    mlp_out_norm: torch.Tensor | None  # and the MLP's
    gate_up: torch.Tensor  # gate and up projections stacked
    down: torch.Tensor


def inverse_frequencies(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """Rotary inverse frequencies [dim / 2] and the cos/sin scale, as transformers' rope types compute them."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope.kind == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.kind == "llama3":
        return _llama3_frequencies(rope, inv_freq), 1.0
    if rope.kind == "yarn":
        return _yarn_frequencies(rope, dim)
    return inv_freq, 1.0


def _llama3_frequencies(rope: RopeConfig, inv_freq: torch.Tensor) -> torch.Tensor:
    """Long wavelengths divided by the factor, short ones kept, the band between interpolated."""
    old = rope.original_max_position
    low_wavelen, high_wavelen = old / rope.low_freq_factor, old / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_frequencies(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """YaRN: interpolated and extrapolated frequencies blended by a ramp over the dimensions whose
    rotations fall between beta_slow and beta_fast in the pretraining context; cos/sin scaled."""
    factor, base, context = rope.factor, rope.theta, rope.original_max_position
    attention_factor = rope.attention_factor if rope.attention_factor is not None else 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(context / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, dim]; cos/sin: [T, dim]; rotate-half convention (HF layout)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos[:, None, :] + rotated.float() * sin[:, None, :]).to(x.dtype)


class Decoder:
    """A decoder layer is `hidden + attention_output(attention of attention_inputs)`, then
    `feed_forward`: the pieces gpu_worker/forward.py runs, with attention in between."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype):
        self.config = config
        self.device = device
        self.dtype = dtype
        # Gemma stores w of a (1 + w) norm: the multiplier is kept, computed once
        norm_shift = 1.0 if config.gemma else 0.0

        def w(name: str) -> torch.Tensor:
            return weights[name].to(device=device, dtype=dtype)

        def norm(name: str) -> torch.Tensor:
            return (weights[name].float() + norm_shift).to(device=device, dtype=torch.float32 if config.gemma else dtype)

        self.embed_tokens = w("model.embed_tokens.weight")
        self.embed_scale = torch.tensor(config.hidden_size**0.5 if config.gemma else 1.0, dtype=dtype).item()
        self.lm_head = self.embed_tokens if config.tie_embeddings else w("lm_head.weight")
        self.norm = norm("model.norm.weight")
        self.layers = [self._layer(f"model.layers.{i}.", w, norm) for i in range(config.num_layers)]
        # the kernels scale scores by head_dim ** -0.5; a family scaling otherwise scales q by the rest
        self.query_scale = config.attention_scale * math.sqrt(config.head_dim)
        # on the device once: a copy from pageable memory at every rotary() would be a host sync
        ropes = (config.rope, config.local_rope or config.rope)
        self.frequencies = [(inv_freq.to(device), scale) for inv_freq, scale in (inverse_frequencies(r, config.head_dim) for r in ropes)]

    def _layer(self, prefix: str, w: Callable[[str], torch.Tensor], norm: Callable[[str], torch.Tensor]) -> LayerWeights:
        c = self.config
        attn = prefix + "self_attn."
        return LayerWeights(
            input_norm=norm(prefix + "input_layernorm.weight"),
            qkv=torch.cat([w(attn + "q_proj.weight"), w(attn + "k_proj.weight"), w(attn + "v_proj.weight")]),
            qkv_bias=torch.cat([w(attn + "q_proj.bias"), w(attn + "k_proj.bias"), w(attn + "v_proj.bias")]) if c.qkv_bias else None,
            q_norm=norm(attn + "q_norm.weight") if c.qk_norm else None,
            k_norm=norm(attn + "k_norm.weight") if c.qk_norm else None,
            o_proj=w(attn + "o_proj.weight"),
            attention_out_norm=norm(prefix + "post_attention_layernorm.weight") if c.gemma else None,
            mlp_norm=norm(prefix + ("pre_feedforward_layernorm.weight" if c.gemma else "post_attention_layernorm.weight")),
            mlp_out_norm=norm(prefix + "post_feedforward_layernorm.weight") if c.gemma else None,
            gate_up=torch.cat([w(prefix + "mlp.gate_proj.weight"), w(prefix + "mlp.up_proj.weight")]),
            down=w(prefix + "mlp.down_proj.weight"),
        )

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Llama's norm scales in the activations' dtype, Gemma's in fp32 (its weights are kept so)."""
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.config.rms_eps)
        return (x32 * weight).to(x.dtype) if self.config.gemma else weight * x32.to(x.dtype)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens[ids]
        return hidden * self.embed_scale if self.config.gemma else hidden

    def rotary(self, positions: torch.Tensor) -> Rotaries:
        """cos/sin of the positions for full and for sliding layers, computed as transformers does (fp32)."""
        tables = []
        for inv_freq, scale in self.frequencies:
            freqs = torch.outer(positions.float(), inv_freq)
            emb = torch.cat([freqs, freqs], dim=-1)
            tables.append((emb.cos() * scale, emb.sin() * scale))
        return tables[0], tables[1]

    def attention_inputs(self, index: int, hidden: torch.Tensor, rotary: Rotaries) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer `index`'s q [T, heads, dim], k and v [T, kv_heads, dim] of the residual stream, q and k rotated."""
        c, layer = self.config, self.layers[index]
        x = self.rms_norm(hidden, layer.input_norm)
        q, k, v = F.linear(x, layer.qkv, layer.qkv_bias).split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        cos, sin = rotary[c.sliding(index)]
        k = k.view(-1, c.num_kv_heads, c.head_dim)
        if layer.k_norm is not None:
            k = self.rms_norm(k, layer.k_norm)
        return self._query(layer, q, cos, sin), apply_rope(k, cos, sin), v.reshape(-1, c.num_kv_heads, c.head_dim)

    def _query(self, layer: LayerWeights, q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q = q.view(-1, self.config.num_heads, self.config.head_dim)
        if layer.q_norm is not None:
            q = self.rms_norm(q, layer.q_norm)
        q = apply_rope(q, cos, sin)
        return q * self.query_scale if self.query_scale != 1.0 else q

    def attention_output(self, index: int, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The residual stream after layer `index`'s attention, whose output [T, heads, dim] is `attended`."""
        layer = self.layers[index]
        out = F.linear(attended.reshape(len(attended), self.config.q_size), layer.o_proj)
        return hidden + (self.rms_norm(out, layer.attention_out_norm) if layer.attention_out_norm is not None else out)

    def feed_forward(self, index: int, hidden: torch.Tensor) -> torch.Tensor:
        layer = self.layers[index]
        gate, up = F.linear(self.rms_norm(hidden, layer.mlp_norm), layer.gate_up).chunk(2, dim=-1)
        gate = F.gelu(gate, approximate="tanh") if self.config.gemma else F.silu(gate)
        out = F.linear(gate * up, layer.down)
        return hidden + (self.rms_norm(out, layer.mlp_out_norm) if layer.mlp_out_norm is not None else out)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of final hidden states [S, hidden]."""
        return F.linear(self.rms_norm(hidden, self.norm), self.lm_head).float()

    def predict_query(self, index: int, hidden: torch.Tensor, rotary: Rotaries) -> torch.Tensor:
        """Layer `index`'s queries from the residual stream after the previous layer's attention (it
        changes little through one MLP): what layer-ahead recall selects with, while that MLP runs.
        Predicting from before the attention leaves a whole layer to overlap but missed 1.7x the
        blocks (docs/benchmarks.md)."""
        c, layer = self.config, self.layers[index]
        bias = layer.qkv_bias[: c.q_size] if layer.qkv_bias is not None else None
        q = F.linear(self.rms_norm(hidden, layer.input_norm), layer.qkv[: c.q_size], bias)
        return self._query(layer, q, *rotary[c.sliding(index)])
