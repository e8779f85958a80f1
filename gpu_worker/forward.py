"""The layer loop every model runs under: a step's tokens through the layers, attention handed to
the step's backend. Interruptible layer-wise scheduling lives here: decode rows whose recalls are
in flight at a layer leave as a cohort that resumes there once the rest has run every layer
(layer cursors), and the next layer's recall starts from a predicted query while this layer's MLP runs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pulseinfer.gpu_worker.attention.base import StepAttention, Suspension
from pulseinfer.gpu_worker.batch import ForwardBatch
from pulseinfer.gpu_worker.model.base import DecoderModel
from pulseinfer.kernels.prefill_triton import prefill_attention_triton

# (layer, q [T, heads, dim], keys [length, kv_heads, dim]) -> allowed [T, length], or None: causal
Mask = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor | None]
KV = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Cohort:
    """Rows of a step that run the layers together from `layer` on: their flat token indices in the
    step's batch, their hidden states entering that layer, their own batch and attention; rows
    suspended at `layer` resume at its attention."""

    tokens: torch.Tensor
    layer: int
    hidden: torch.Tensor
    batch: ForwardBatch
    attention: StepAttention
    resume: Suspension | None = None


def cohort_of(
    tokens: torch.Tensor,
    hidden: torch.Tensor,
    layer: int,
    batch: ForwardBatch,
    attention: StepAttention,
    rows: list[int],
    prefills: bool,
    resume: Suspension | None = None,
) -> Cohort:
    """The decode rows `rows` of a cohort (and its prefill chunks if `prefills`) as a cohort at `layer`."""
    sub, kept = batch.subset(rows, prefills)
    return Cohort(tokens[kept], layer, hidden[kept], sub, attention.cohort(sub), resume)


@torch.inference_mode()
def forward(model: DecoderModel, batch: ForwardBatch, attention: StepAttention) -> torch.Tensor:
    """Runs every token of the batch; returns fp32 logits of the sampled positions [S, vocab]."""
    return model.logits(forward_hidden(model, batch, attention)[batch.sample_index])


@torch.inference_mode()
def forward_hidden(
    model: DecoderModel, batch: ForwardBatch, attention: StepAttention, midway: Callable[[ForwardBatch], None] | None = None
) -> torch.Tensor:
    """Runs every token of the batch; returns their hidden states after the last layer [T, hidden].
    `midway`: called with each cohort's batch after the middle layer (the tests' injected faults)."""
    hidden = model.embed(batch.input_ids)
    cohorts = [Cohort(torch.arange(len(hidden), device=hidden.device), 0, hidden, batch, attention)]
    while cohorts:
        tokens, final = run_cohort(model, cohorts.pop(0), cohorts.append, midway)
        hidden[tokens] = final
    return hidden


def run_cohort(
    model: DecoderModel, cohort: Cohort, suspend: Callable[[Cohort], None], midway: Callable[[ForwardBatch], None] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The cohort's hidden states through its layers to the last; rows suspended on the way go to
    `suspend`. Returns the flat indices of the tokens that ran to the end and their hidden states."""
    tokens, hidden, batch, attention = cohort.tokens, cohort.hidden, cohort.batch, cohort.attention
    rotary = model.rotary(batch.positions)
    for index in range(cohort.layer, model.num_layers):
        if index == cohort.layer and cohort.resume is not None:
            attended, suspended = attention.resume(index, cohort.resume), None
        else:
            attended, suspended = attention.attend(index, *model.attention_inputs(index, hidden, rotary))
        if suspended is not None:
            suspend(cohort_of(tokens, hidden, index, batch, attention, suspended.rows, prefills=False, resume=suspended))
            rest = [row for row in range(len(batch.decode_seq_ids)) if row not in suspended.rows]
            going_on = cohort_of(tokens, model.attention_output(index, hidden, attended), index, batch, attention, rest, prefills=True)
            tokens, hidden, batch, attention = going_on.tokens, going_on.hidden, going_on.batch, going_on.attention
            rotary = model.rotary(batch.positions)
        else:
            hidden = model.attention_output(index, hidden, attended)
        if attention.prefetching and index + 1 < model.num_layers:
            rows = batch.decode_index
            attention.prefetch(index + 1, model.predict_query(index + 1, hidden[rows], model.rotary(batch.positions[rows])))
        hidden = model.feed_forward(index, hidden)
        if midway is not None and index == model.num_layers // 2:
            midway(batch)
    return tokens, hidden


@torch.inference_mode()
def dense_forward(
    model: DecoderModel, ids: list[int], start: int = 0, prefix: Sequence[KV] = (), mask: Mask | None = None
) -> tuple[torch.Tensor, list[KV]]:
    """Tokens `ids` at positions start.. through every layer without a KV cache, attending the
    prefix's K/V and their own (causal, or under `mask`): the final hidden states and each
    layer's K/V, prefix included. For calibration and the scorer study, not serving."""
    if prefix and mask is None:
        raise ValueError("dense_forward: a prefix needs a mask (the causal default assumes queries start at position 0)")
    positions = torch.arange(start, start + len(ids), device=model.device)
    hidden = model.embed(torch.tensor(ids, device=model.device))
    rotary, kv = model.rotary(positions), []
    for index in range(model.num_layers):
        q, k, v = model.attention_inputs(index, hidden, rotary)
        if prefix:
            k, v = torch.cat([prefix[index][0], k]), torch.cat([prefix[index][1], v])
        kv.append((k, v))
        window = model.config.sliding_window if model.config.sliding(index) else 0
        if q.is_cuda and mask is None:  # no prefix: the kernel, never a score matrix
            out = prefill_attention_triton(q, k, v, len(ids), window)
        else:
            allowed = mask(index, q, k) if mask is not None else _window_mask(window, len(ids), q.device) if window else None
            heads_first = [t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
            attended = F.scaled_dot_product_attention(*heads_first, attn_mask=allowed, is_causal=allowed is None, enable_gqa=True)
            out = attended.squeeze(0).transpose(0, 1)
        hidden = model.attention_output(index, hidden, out)
        hidden = model.feed_forward(index, hidden)
    return hidden, kv


def _window_mask(window: int, n: int, device: torch.device) -> torch.Tensor:
    """Causal attention of n tokens to each other, each seeing the last `window` (itself included)."""
    offset = torch.arange(n, device=device)[:, None] - torch.arange(n, device=device)[None, :]
    return (offset >= 0) & (offset < window)
