"""Llama-family decoder: RMSNorm, RoPE, GQA attention over a paged KV cache, SwiGLU MLP."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pulseinfer.gpu_worker.batch import ForwardBatch
from pulseinfer.gpu_worker.kv_cache import PagedKVCache
from pulseinfer.gpu_worker.model.config import ModelConfig
from pulseinfer.gpu_worker.offload import DecodePhase, OffloadStep
from pulseinfer.kernels.attention import GatherWorkspace, paged_decode_attention, paged_prefill_attention, prefill_attention
from pulseinfer.kernels.decode_triton import paged_decode_attention_triton

# (layer, q [T, heads, dim], keys [length, kv_heads, dim]) -> allowed [T, length], or None: causal
Mask = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor | None]
KV = tuple[torch.Tensor, torch.Tensor]


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


@dataclass(frozen=True)
class Suspension:
    """Decode rows suspended at a layer after their query, K/V writes and selection: what their
    attention needs when they resume, so it attends exactly what it would have without suspending."""

    rows: list[int]
    q: torch.Tensor
    tables: torch.Tensor
    lens: torch.Tensor


@dataclass(frozen=True)
class Cohort:
    """Rows of a step that run the layers together from `layer` on: their flat token indices in the
    step's batch, their hidden states entering that layer, their own batch and offload step; rows
    suspended at `layer` resume at its attention."""

    tokens: torch.Tensor
    layer: int
    hidden: torch.Tensor
    batch: ForwardBatch
    offload: OffloadStep | None
    resume: Suspension | None = None


def cohort_of(
    tokens: torch.Tensor,
    hidden: torch.Tensor,
    layer: int,
    batch: ForwardBatch,
    offload: OffloadStep | None,
    rows: list[int],
    prefills: bool,
    resume: Suspension | None = None,
) -> Cohort:
    """The decode rows `rows` of a cohort (and its prefill chunks if `prefills`) as a cohort at `layer`."""
    sub, kept = batch.subset(rows, prefills)
    return Cohort(tokens[kept], layer, hidden[kept], sub, offload.cohort(sub) if offload is not None else None, resume)


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype):
        self.config = config
        self.device = device
        self.dtype = dtype

        def w(name: str) -> torch.Tensor:
            return weights[name].to(device=device, dtype=dtype)

        self.embed = w("model.embed_tokens.weight")
        self.lm_head = self.embed if config.tie_embeddings else w("lm_head.weight")
        self.norm = w("model.norm.weight")
        self.layers = [self._layer(w, f"model.layers.{i}.", config.qkv_bias) for i in range(config.num_layers)]
        self.cos, self.sin = rope_tables(config, device)
        self.workspace = GatherWorkspace()

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

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: PagedKVCache, offload: OffloadStep | None = None) -> torch.Tensor:
        """Runs every token of the batch; returns fp32 logits of the sampled positions [S, vocab].
        `offload` places, recalls and attends the offloaded requests' KV. With layer cursors, rows
        suspended at a layer leave as a cohort that resumes there once the rest has run every layer."""
        hidden = self.embed[batch.input_ids]
        cohorts = [Cohort(torch.arange(len(hidden), device=hidden.device), 0, hidden, batch, offload)]
        while cohorts:
            tokens, final = self._run(cohorts.pop(0), cache, cohorts.append)
            hidden[tokens] = final
        last = rms_norm(hidden[batch.sample_index], self.norm, self.config.rms_eps)
        return F.linear(last, self.lm_head).float()

    def _run(self, cohort: Cohort, cache: PagedKVCache, suspend: Callable[[Cohort], None]) -> tuple[torch.Tensor, torch.Tensor]:
        """The cohort's hidden states through its layers to the last; rows suspended on the way go to
        `suspend`. Returns the flat indices of the tokens that ran to the end and their hidden states."""
        tokens, hidden, batch, offload = cohort.tokens, cohort.hidden, cohort.batch, cohort.offload
        cos, sin = self.cos[batch.positions], self.sin[batch.positions]
        for index in range(cohort.layer, len(self.layers)):
            layer = self.layers[index]
            if index == cohort.layer and cohort.resume is not None:
                attended, suspended = self._resume(index, layer, cohort.resume, batch, cache, offload), None
            else:
                x = rms_norm(hidden, layer.input_norm, self.config.rms_eps)
                attended, suspended = self._attention(index, layer, x, cos, sin, batch, cache, offload)
            if suspended is not None:
                suspend(cohort_of(tokens, hidden, index, batch, offload, suspended.rows, prefills=False, resume=suspended))
                rest = [row for row in range(len(batch.decode_seq_ids)) if row not in suspended.rows]
                going_on = cohort_of(tokens, hidden + attended, index, batch, offload, rest, prefills=True)
                tokens, hidden, batch, offload = going_on.tokens, going_on.hidden, going_on.batch, going_on.offload
                cos, sin = self.cos[batch.positions], self.sin[batch.positions]
            else:
                hidden = hidden + attended
            if offload is not None and offload.prefetching and index + 1 < len(self.layers):
                offload.prefetch(
                    index + 1,
                    cache,
                    self._predict_q(index + 1, hidden[batch.decode_index], cos[batch.decode_index], sin[batch.decode_index]),
                )
            hidden = hidden + self.mlp(layer, rms_norm(hidden, layer.post_norm, self.config.rms_eps))
        return tokens, hidden

    def _attention(
        self, index: int, layer: LayerWeights, x: torch.Tensor, cos, sin, batch: ForwardBatch, cache: PagedKVCache, offload
    ) -> tuple[torch.Tensor, Suspension | None]:
        """The layer's attention output (o_proj applied) and the decode rows suspended at it, whose
        rows of the output are not computed."""
        c = self.config
        q, k, v = self.qkv(layer, x, cos, sin)
        cache.write(index, batch.write_slots, k[batch.resident_index], v[batch.resident_index])
        if offload is not None:
            offload.store(index, cache, k, v)
        k_cache, v_cache = cache.layer(index)
        block = cache.spec.block_size
        out = torch.empty_like(q)
        suspended = None
        if batch.decode_index.numel():
            phases = [DecodePhase(None, batch.decode_block_tables, batch.decode_ctx_lens)]
            if offload is not None:
                phases = offload.decode_phases(index, cache, q[batch.decode_index], batch)
            for rows, tables, lens, later in phases:  # rows whose recalls are in flight come last
                target = batch.decode_index if rows is None else batch.decode_index[rows]
                if later:
                    suspended = Suspension(rows.tolist(), q[target], tables, lens)
                    continue
                out[target] = self._decode_attention(q[target], k_cache, v_cache, tables, lens, block)
        for span in batch.prefills:
            q_span = q[span.start : span.end]
            if span.ctx_blocks is None:
                k_ctx, v_ctx = offload.prefill_context(index, cache, span, self.workspace)
                out[span.start : span.end] = prefill_attention(q_span, k_ctx, v_ctx, span.ctx_len)
            else:
                out[span.start : span.end] = paged_prefill_attention(
                    q_span, k_cache, v_cache, span.ctx_blocks, span.ctx_len, block, self.workspace
                )
        return F.linear(out.view(-1, c.q_size), layer.o_proj), suspended

    def _resume(
        self, index: int, layer: LayerWeights, resume: Suspension, batch: ForwardBatch, cache: PagedKVCache, offload: OffloadStep
    ) -> torch.Tensor:
        """The attention output of rows resuming at the layer where they were suspended: once their
        recalls have landed, over the tables selected then (their K/V are written already)."""
        offload.resume(index)
        k_cache, v_cache = cache.layer(index)
        out = torch.empty((len(batch.input_ids), *resume.q.shape[1:]), dtype=resume.q.dtype, device=resume.q.device)
        out[batch.decode_index] = self._decode_attention(resume.q, k_cache, v_cache, resume.tables, resume.lens, cache.spec.block_size)
        return F.linear(out.view(-1, self.config.q_size), layer.o_proj)

    @torch.inference_mode()
    def run_dense(
        self, ids: list[int], start: int = 0, prefix: Sequence[KV] = (), mask: Mask | None = None
    ) -> tuple[torch.Tensor, list[KV]]:
        """Tokens `ids` at positions start.. through every layer without a KV cache, attending the
        prefix's K/V and their own (causal, or under `mask`): the final hidden states and each
        layer's K/V, prefix included. For calibration and the scorer study, not serving."""
        if prefix and mask is None:
            raise ValueError("run_dense: a prefix needs a mask (the causal default assumes queries start at position 0)")
        positions = torch.arange(start, start + len(ids), device=self.device)
        hidden = self.embed[torch.tensor(ids, device=self.device)]
        cos, sin = self.cos[positions], self.sin[positions]
        eps, kv = self.config.rms_eps, []
        for index, layer in enumerate(self.layers):
            q, k, v = self.qkv(layer, rms_norm(hidden, layer.input_norm, eps), cos, sin)
            if prefix:
                k, v = torch.cat([prefix[index][0], k]), torch.cat([prefix[index][1], v])
            kv.append((k, v))
            allowed = mask(index, q, k) if mask is not None else None
            heads_first = [t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
            out = F.scaled_dot_product_attention(*heads_first, attn_mask=allowed, is_causal=allowed is None, enable_gqa=True)
            hidden = hidden + F.linear(out.squeeze(0).transpose(0, 1).reshape(len(ids), -1), layer.o_proj)
            hidden = hidden + self.mlp(layer, rms_norm(hidden, layer.post_norm, eps))
        return hidden, kv

    def qkv(self, layer: LayerWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The layer's q [T, heads, dim], k and v [T, kv_heads, dim] of normed hidden states x, q and k rotated."""
        c = self.config
        q, k, v = F.linear(x, layer.qkv, layer.qkv_bias).split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = apply_rope(q.view(-1, c.num_heads, c.head_dim), cos, sin)
        k = apply_rope(k.view(-1, c.num_kv_heads, c.head_dim), cos, sin)
        return q, k, v.reshape(-1, c.num_kv_heads, c.head_dim)

    def _predict_q(self, index: int, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Layer `index`'s queries from the residual stream after the previous layer's attention (it
        changes little through one MLP): what layer-ahead recall selects with, while that MLP runs.
        Predicting from before the attention leaves a whole layer to overlap but missed 1.7x the
        blocks (docs/benchmarks.md)."""
        c, layer = self.config, self.layers[index]
        bias = layer.qkv_bias[: c.q_size] if layer.qkv_bias is not None else None
        q = F.linear(rms_norm(hidden, layer.input_norm, c.rms_eps), layer.qkv[: c.q_size], bias)
        return apply_rope(q.view(-1, c.num_heads, c.head_dim), cos, sin)

    def _decode_attention(self, q, k_cache, v_cache, tables: torch.Tensor, lens: torch.Tensor, block: int) -> torch.Tensor:
        """The Triton kernel on CUDA (per-head tables; shared rows broadcast), the torch reference elsewhere."""
        if q.is_cuda:
            if tables.dim() == 2:
                tables = tables[:, None, :].expand(-1, k_cache.shape[1], -1)
            return paged_decode_attention_triton(q, k_cache, v_cache, tables, lens, block)
        return paged_decode_attention(q, k_cache, v_cache, tables, lens, block, self.workspace)

    def mlp(self, layer: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, layer.gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, layer.down)
