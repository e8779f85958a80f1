"""bench.selection_scorers computes `eval ppl`'s teacher-forced sparse decode without the engine:
for each of the worker's scorers it must give the engine's perplexity, or its comparisons mean nothing."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pulseinfer.bench.selection_scorers import ScorerStudyConfig, study
from pulseinfer.engine import EngineConfig
from pulseinfer.evals import PerplexityConfig, evaluate
from pulseinfer.gpu_worker.config import WorkerConfig
from pulseinfer.gpu_worker.offload.config import OffloadConfig


def test_study_gives_the_engines_perplexity(model):
    ppl = PerplexityConfig(context=1024, score_tokens=16, windows=1)
    offload = OffloadConfig(sink=64, recent=256, budget=128)  # 8 of the ~44 host blocks: sparse
    study_config = ScorerStudyConfig(windows=1, context=1024, score_tokens=16, budget=128, scorers="dense,quest,lowrank,oracle")
    result = study(study_config, model, log=lambda line: None)
    rows = {r["scorer"]: r for r in result["scorers"]}
    for mode, scorer in (("dense", "dense"), ("pulse", "quest"), ("pulse", "lowrank")):
        worker_offload = replace(offload, scorer=scorer) if mode == "pulse" else offload
        config = EngineConfig(worker=WorkerConfig(mode=mode, device_kv_tokens=8192, offload=worker_offload))
        engine_ppl = evaluate("ppl", config, ppl, model)["perplexity"]
        assert rows[scorer]["perplexity"] == pytest.approx(engine_ppl, rel=1e-4), scorer
    for scorer in ("quest", "lowrank"):  # the budget does cut
        assert rows[scorer]["perplexity"] != pytest.approx(rows["dense"]["perplexity"], rel=1e-4)
    assert rows["oracle"]["scored_tokens"] == 16


def test_study_rejects_unknown_scorers(model):
    with pytest.raises(ValueError, match="--scorers takes dense"):
        study(ScorerStudyConfig(scorers="dense,bogus"), model)
