"""Llama-family decoder math: RMSNorm, RoPE, GQA projections, SwiGLU MLP. Attention itself is the
backend's (gpu_worker/attention), the order of the layers the loop's (gpu_worker/forward.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pulseinfer.common.model.config import ModelConfig

Rotary = tuple[torch.Tensor, torch.Tensor]  # cos, sin [T, head_dim] of the tokens' positions


@dataclass(frozen=True)
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # q, k and v projections stacked: one matmul
    qkv_bias: torch.Tensor | None
    o_proj: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # gate and up projections stacked
    down: torch.Tensor


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rope_tables(config: ModelConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    freqs = torch.outer(torch.arange(config.max_position, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(device), emb.sin().to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, dim]; cos/sin: [T, dim]; rotate-half convention (HF layout)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos[:, None, :] + rotated.float() * sin[:, None, :]).to(x.dtype)


class LlamaModel:
    """A decoder layer is `hidden + attention_output(attention of attention_inputs)`, then
    `feed_forward`: the pieces gpu_worker/forward.py runs, with attention in between."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype):
        self.config = config
        self.device = device
        self.dtype = dtype

        def w(name: str) -> torch.Tensor:
            return weights[name].to(device=device, dtype=dtype)

        self.embed_tokens = w("model.embed_tokens.weight")
        self.lm_head = self.embed_tokens if config.tie_embeddings else w("lm_head.weight")
        self.norm = w("model.norm.weight")
        self.layers = [self._layer(w, f"model.layers.{i}.", config.qkv_bias) for i in range(config.num_layers)]
        self.cos, self.sin = rope_tables(config, device)

    @staticmethod
    def _layer(w, prefix: str, bias: bool) -> LayerWeights:
        attn = prefix + "self_attn."
        return LayerWeights(
            input_norm=w(prefix + "input_layernorm.weight"),
            qkv=torch.cat([w(attn + "q_proj.weight"), w(attn + "k_proj.weight"), w(attn + "v_proj.weight")]),
            qkv_bias=torch.cat([w(attn + "q_proj.bias"), w(attn + "k_proj.bias"), w(attn + "v_proj.bias")]) if bias else None,
            o_proj=w(attn + "o_proj.weight"),
            post_norm=w(prefix + "post_attention_layernorm.weight"),
            gate_up=torch.cat([w(prefix + "mlp.gate_proj.weight"), w(prefix + "mlp.up_proj.weight")]),
            down=w(prefix + "mlp.down_proj.weight"),
        )

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens[ids]

    def rotary(self, positions: torch.Tensor) -> Rotary:
        return self.cos[positions], self.sin[positions]

    def attention_inputs(self, index: int, hidden: torch.Tensor, rotary: Rotary) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer `index`'s q [T, heads, dim], k and v [T, kv_heads, dim] of the residual stream, q and k rotated."""
        layer = self.layers[index]
        return self.qkv(layer, rms_norm(hidden, layer.input_norm, self.config.rms_eps), *rotary)

    def attention_output(self, index: int, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The residual stream after layer `index`'s attention, whose output [T, heads, dim] is `attended`."""
        return hidden + F.linear(attended.reshape(len(attended), self.config.q_size), self.layers[index].o_proj)

    def feed_forward(self, index: int, hidden: torch.Tensor) -> torch.Tensor:
        layer = self.layers[index]
        return hidden + self.mlp(layer, rms_norm(hidden, layer.post_norm, self.config.rms_eps))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of final hidden states [S, hidden]."""
        return F.linear(rms_norm(hidden, self.norm, self.config.rms_eps), self.lm_head).float()

    def qkv(self, layer: LayerWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The layer's q [T, heads, dim], k and v [T, kv_heads, dim] of normed hidden states x, q and k rotated."""
        c = self.config
        q, k, v = F.linear(x, layer.qkv, layer.qkv_bias).split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = apply_rope(q.view(-1, c.num_heads, c.head_dim), cos, sin)
        k = apply_rope(k.view(-1, c.num_kv_heads, c.head_dim), cos, sin)
        return q, k, v.reshape(-1, c.num_kv_heads, c.head_dim)

    def predict_query(self, index: int, hidden: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        """Layer `index`'s queries from the residual stream after the previous layer's attention (it
        changes little through one MLP): what layer-ahead recall selects with, while that MLP runs.
        Predicting from before the attention leaves a whole layer to overlap but missed 1.7x the
        blocks (docs/benchmarks.md)."""
        c, layer = self.config, self.layers[index]
        bias = layer.qkv_bias[: c.q_size] if layer.qkv_bias is not None else None
        q = F.linear(rms_norm(hidden, layer.input_norm, c.rms_eps), layer.qkv[: c.q_size], bias)
        return apply_rope(q.view(-1, c.num_heads, c.head_dim), *rotary)

    def mlp(self, layer: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, layer.gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, layer.down)
