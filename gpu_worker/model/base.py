"""What a model is to the layer loop (gpu_worker/forward.py): the math of its layers, in pieces
with attention between them. A model imports nothing of attention, caching or offloading."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from pulseinfer.common.model.config import ModelConfig


class DecoderModel(Protocol):
    config: ModelConfig
    device: torch.device

    @property
    def num_layers(self) -> int: ...

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The residual stream entering layer 0 [T, hidden]."""
        ...

    def rotary(self, positions: torch.Tensor) -> Any:
        """Whatever attention_inputs and predict_query need of the tokens' positions (computed once per cohort)."""
        ...

    def attention_inputs(self, index: int, hidden: torch.Tensor, rotary: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, heads, dim], k and v [T, kv_heads, dim] of layer `index`, as attention reads them."""
        ...

    def attention_output(self, index: int, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The residual stream after layer `index`'s attention, given its output [T, heads, dim]."""
        ...

    def feed_forward(self, index: int, hidden: torch.Tensor) -> torch.Tensor:
        """The residual stream leaving layer `index`."""
        ...

    def predict_query(self, index: int, hidden: torch.Tensor, rotary: Any) -> torch.Tensor:
        """Layer `index`'s queries predicted from the residual stream of the layer before it (layer-ahead recall)."""
        ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of final hidden states."""
        ...
