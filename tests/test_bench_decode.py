"""The decode benchmark's teacher-forced agreement: the other modes decode dense's tokens and count
where their own greedy token is the same."""

from __future__ import annotations

import pytest
import torch

from pulseinfer.bench.decode import DecodeBenchConfig, TeacherForcing, run, table
from pulseinfer.messages.plan import Chunk


def test_teacher_forcing_feeds_the_reference_and_counts_greedy_agreement():
    forcing = TeacherForcing({"a": [5, 6, 7], "b": [1, 2]}, {"a": 10, "b": 3})
    logits = torch.zeros(2, 8)
    logits[0, 6] = logits[1, 4] = 1.0  # a's greedy token agrees at its second output, b's does not
    chunks = [Chunk("a", (9,), 10, (), None), Chunk("b", (0,), 3, (), None)]
    assert forcing(logits, chunks) == [6, 2]
    assert (forcing.agreed, forcing.total) == (1, 2)


def test_teacher_forced_modes_decode_dense_tokens(model):
    # a budget far below the host blocks, so the sparse mode's own greedy tokens may differ from dense's
    config = DecodeBenchConfig(
        requests=2, context="600-700", output_tokens=6, device_kv_tokens=1024, sink=16, recent=32, budget=32,
        modes="dense,pulse-no-admission", teacher_forced=True,
    )  # fmt: skip
    result = run(config, model, log=lambda _: None)
    dense, pulse = result["modes"]
    assert "agree: teacher-forced" in table(result)
    assert pulse["tokens"] == dense["tokens"] and pulse["offloaded_requests"] == 2
    assert 0 < pulse["agreement_teacher_forced"] <= 1 and pulse["agreement_with_dense"] == pulse["agreement_teacher_forced"]
    assert "agreement_teacher_forced" not in dense


def test_teacher_forcing_needs_dense_first():
    with pytest.raises(ValueError, match="must start with dense"):
        DecodeBenchConfig(modes="pulse,dense", teacher_forced=True).mode_list()
