"""The lowrank scorer's key bases: orthonormal, fitted to the model's keys, and refused when asked
for what cannot be."""

from __future__ import annotations

import pytest
import torch

from pulseinfer.gpu_worker.forward import dense_forward
from pulseinfer.gpu_worker.key_basis import calibration_ids, key_bases
from pulseinfer.gpu_worker.model.decoder import Decoder


def test_bases_are_orthonormal_and_capture_the_keys_better_than_a_random_subspace(model):
    llama = Decoder(model.config, model.weights, torch.device("cpu"), torch.float32)
    ids = calibration_ids(model.tokenizer, 256)
    assert len(ids) == 256
    rank, c = 8, model.config
    bases = key_bases(llama, ids, rank)
    assert bases.shape == (c.num_layers, c.num_kv_heads, c.head_dim, rank)
    torch.testing.assert_close(
        bases.transpose(-1, -2) @ bases, torch.eye(rank).expand(c.num_layers, c.num_kv_heads, -1, -1), atol=1e-5, rtol=0
    )
    _, kv = dense_forward(llama, ids)
    keys = kv[5][0].transpose(0, 1)  # layer 5: [kv_heads, tokens, dim]
    random = torch.linalg.qr(torch.randn(c.num_kv_heads, c.head_dim, rank, generator=torch.Generator().manual_seed(0))).Q
    kept, kept_random = ((keys @ b).square().sum() / keys.square().sum() for b in (bases[5], random))
    assert kept > 0.6 and kept > 3 * kept_random  # keys are low-rank; the fitted directions find it
    full = key_bases(llama, ids[:64], c.head_dim)  # full rank: the projection loses nothing
    torch.testing.assert_close(keys @ full[5] @ full[5].transpose(-1, -2), keys, atol=1e-3, rtol=1e-3)


def test_bad_ranks_and_calibration_lengths_are_refused(model):
    llama = Decoder(model.config, model.weights, torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="--key-rank"):
        key_bases(llama, [1, 2, 3], model.config.head_dim + 1)
    with pytest.raises(ValueError, match="calibration text has"):
        calibration_ids(model.tokenizer, 10**7)
