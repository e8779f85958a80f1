"""Offloaded requests in-process: the host tier, full-budget decode equal to dense, resident and
offloaded requests in one batch, host pool exhaustion, and the selection and hot-buffer pieces."""

from __future__ import annotations

import os
import pydoc_data.topics
import time
from pathlib import Path

import pytest
import torch
from helpers import assert_device_idle, assert_host_idle

from pulseinfer.common.model.meta import ModelLoadError
from pulseinfer.engine import Engine, EngineConfig
from pulseinfer.gpu_check.fixtures import TOKENIZER_ENV, geometry_dir, materialized, random_prompts
from pulseinfer.gpu_worker import forward
from pulseinfer.gpu_worker.batch import pad_tables
from pulseinfer.gpu_worker.config import WorkerConfig
from pulseinfer.gpu_worker.forward import Cohort
from pulseinfer.gpu_worker.model.loader import LoadedModel, load_model
from pulseinfer.gpu_worker.offload.config import OffloadConfig
from pulseinfer.gpu_worker.offload.hot import HotBuffers
from pulseinfer.gpu_worker.offload.recall import HostCopier
from pulseinfer.gpu_worker.offload.selection import by_rank
from pulseinfer.gpu_worker.sparse import LowRankScorer, QuestScorer, SummaryPool, select_blocks
from pulseinfer.kernels.scoring import lowrank_scores
from pulseinfer.messages.sampling import SamplingParams
from pulseinfer.scheduler.batcher import BatcherConfig

GREEDY_32 = SamplingParams(max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def corpus(model) -> list[int]:
    return model.tokenizer.encode(" ".join(pydoc_data.topics.topics.values())[:200_000])


def _engine(model, policy: str, device_tokens: int, host_tokens: int = 131072, mode: str = "pulse", **offload) -> Engine:
    worker = WorkerConfig(mode=mode, device_kv_tokens=device_tokens, offload=OffloadConfig(**offload))
    return Engine(EngineConfig(worker=worker, batcher=BatcherConfig(offload=policy), host_kv_tokens=host_tokens), loaded=model)


def _assert_all_freed(engine: Engine) -> None:
    assert_device_idle(engine)
    assert_host_idle(engine)
    assert engine.runner.offload.seqs == {}


@pytest.mark.slow
def test_full_budget_offload_equals_dense_at_2k_and_4k(model, corpus):
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    prompts = [corpus[: 2048 - 16], corpus[20000 : 20000 + 4096 - 16]]  # contexts end at 2k and 4k tokens
    dense = _engine(model, "never", 16384).generate(prompts, params)
    # layer-ahead recall and suspension on: they change when blocks land, never what is attended
    offloaded_engine = _engine(model, "always", 16384, sink=64, recent=256, budget=4096, layer_ahead="on", suspend="layer")
    offloaded = offloaded_engine.generate(prompts, params)
    assert [c.token_ids for c in offloaded] == [c.token_ids for c in dense]
    assert all(c.offloaded for c in offloaded)
    stats = offloaded_engine.runner.offload.stats()
    assert stats["recall"]["prefetched_units"] > 0 and stats["recall"]["suspended_rows"] > 0
    stored = [len(p) + params.max_tokens - 1 for p in prompts]  # the last sampled token's KV is never computed
    assert stats["written_blocks"] == sum(n // 16 - 64 // 16 for n in stored)  # every full block past the sink, once
    assert stats["recall"]["units"] > 0
    _assert_all_freed(offloaded_engine)
    # head-wise selection over every block attends the same keys, one table per kv head
    headwise = _engine(model, "always", 16384, mode="headwise", sink=64, recent=256, budget=4096).generate(prompts, params)
    assert [c.token_ids for c in headwise] == [c.token_ids for c in dense]


def test_offloaded_requests_within_their_sink_decode_as_dense(model, corpus):
    """Contexts shorter than the sink: no window block and no host block in any row of the batch."""
    prompts, params = [corpus[:5], corpus[100:120]], SamplingParams(max_tokens=8, ignore_eos=True)
    dense = _engine(model, "never", 4096).generate(prompts, params)
    engine = _engine(model, "always", 4096, sink=64, recent=256, budget=1024)
    offloaded = engine.generate(prompts, params)
    assert [c.token_ids for c in offloaded] == [c.token_ids for c in dense] and all(c.offloaded for c in offloaded)
    _assert_all_freed(engine)


@pytest.fixture(scope="module")
def dummy_qwen3(tmp_path_factory) -> LoadedModel:
    """Seeded random weights of the Qwen3-0.6B geometry, with the GPU check's tokenizer (its
    wheelhouse's) or else the default model's: no model file needed, as on a GPU check's machine."""
    tokenizer = os.environ.get(TOKENIZER_ENV)
    try:
        path = geometry_dir("qwen3-0.6b", tmp_path_factory.mktemp("models"), Path(tokenizer) if tokenizer else None)
    except ModelLoadError as e:
        pytest.skip(f"no tokenizer for the dummy geometry: {e}")
    return materialized(load_model(path, "dummy"))  # made once for both engines


@pytest.mark.gpu
def test_full_budget_offload_equals_dense_on_cuda(dummy_qwen3):
    prompts = random_prompts((1000, 300))

    def run(policy: str, **offload) -> list[list[int]]:
        # float32: on random weights the top logits lie closer than bfloat16 rounding, and only
        # the order of the attention's sums differs between the two paths
        worker = WorkerConfig(device="cuda", dtype="float32", device_kv_tokens=16384, offload=OffloadConfig(**offload))
        with Engine(EngineConfig(worker=worker, batcher=BatcherConfig(offload=policy), host_kv_tokens=16384), loaded=dummy_qwen3) as engine:
            completions = engine.generate(prompts, GREEDY_32)
        assert all(c.offloaded == (policy == "always") for c in completions)
        return [c.token_ids for c in completions]

    assert run("always", sink=64, recent=128, budget=1024) == run("never")


def _record_cohorts(monkeypatch) -> list[Cohort]:
    """Every cohort the model runs from now on: a step's own, then any of rows suspended in it."""
    cohorts = []
    run = forward.run_cohort
    monkeypatch.setattr(forward, "run_cohort", lambda model, cohort, *args: cohorts.append(cohort) or run(model, cohort, *args))
    return cohorts


def _suspended_cohorts(cohorts: list[Cohort]) -> list[Cohort]:
    return [c for c in cohorts if c.resume is not None]


@pytest.mark.parametrize(("mode", "suspend"), [("pulse", "layer"), ("pulse", "cursor"), ("headwise", "layer")])
def test_layer_ahead_recall_and_suspension_change_timing_never_tokens(model, corpus, mode, suspend, monkeypatch):
    """At a sparse budget the predicted selection misses blocks; the true query's selection
    recalls them, so the attended blocks (and tokens) are those of synchronous recall. Rows
    whose recalls are in flight attend after the others (pulse mode), or with layer cursors go
    on from their layer after the others have run every layer: the same tokens again."""
    prompts = [corpus[:1000], corpus[7000:8300], corpus[12000:12600]]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    runs = {}
    cohorts = _record_cohorts(monkeypatch)
    for ahead in (False, True):
        engine = _engine(
            model,
            "always",
            16384,
            mode=mode,
            sink=32,
            recent=64,
            budget=128,
            layer_ahead="on" if ahead else "off",
            suspend=suspend if ahead else "off",
        )
        runs[ahead] = ([c.token_ids for c in engine.generate(prompts, params)], engine.runner.offload.stats()["recall"])
        _assert_all_freed(engine)
    assert runs[True][0] == runs[False][0]
    synchronous, ahead = runs[False][1], runs[True][1]
    assert synchronous["prefetched_units"] == 0 and ahead["prefetched_units"] > 0
    assert 0 < ahead["corrected_units"] < ahead["units"]  # predictions miss some blocks and hit others
    assert synchronous["suspended_rows"] == 0
    if mode == "pulse":  # head-wise recalls stay synchronous, the baseline's
        assert ahead["suspended_rows"] > 0
    # layer cursors: rows suspended past the first layer resumed there after the others ran every layer
    assert any(c.layer > 0 for c in _suspended_cohorts(cohorts)) == (suspend == "cursor")
    assert (ahead["resumed_layers"] > 0) == (suspend == "cursor") and synchronous["resumed_layers"] == 0


def test_layer_cursors_resume_suspended_rows_at_their_layer_with_the_dense_tokens(model, corpus, monkeypatch):
    """With layer cursors a row whose recall is in flight stays at its layer while the other rows
    run the later layers; it resumes there as a cohort of its own. With a
    budget covering every block the tokens are dense's."""
    cohorts = _record_cohorts(monkeypatch)
    prompts = [corpus[:1000], corpus[7000:8300], corpus[12000:12600]]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    dense = _engine(model, "never", 16384).generate(prompts, params)
    engine = _engine(model, "always", 16384, sink=32, recent=64, budget=2048, layer_ahead="on", suspend="cursor")
    assert [c.token_ids for c in engine.generate(prompts, params)] == [c.token_ids for c in dense]
    suspended = _suspended_cohorts(cohorts)
    stats = engine.runner.offload.stats()
    assert suspended and stats["recall"]["suspended_rows"] > 0
    assert stats["recall"]["resumed_layers"] == sum(
        model.config.num_layers - c.layer for c in suspended
    )  # every layer a resumed cohort ran apart
    _assert_all_freed(engine)


@pytest.mark.parametrize("mode", ["pulse", "headwise"])
def test_a_hot_buffer_beyond_the_budget_recalls_less_and_attends_the_same(model, corpus, mode):
    """Blocks selected at earlier steps stay in the extra hot-buffer room: fewer are recalled
    again, and the selection (so the tokens) is unchanged."""
    prompts = [corpus[:1000], corpus[7000:8300]]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    runs = {}
    for extra in (0, 128):
        engine = _engine(model, "always", 16384, mode=mode, sink=32, recent=64, budget=128, hot_extra=extra)
        runs[extra] = ([c.token_ids for c in engine.generate(prompts, params)], engine.runner.offload.stats()["recall"])
        _assert_all_freed(engine)
    assert runs[128][0] == runs[0][0]
    assert 0 < runs[128][1]["units"] < runs[0][1]["units"]


def test_layer_ahead_fills_the_room_beyond_the_budget_and_attends_the_same(model, corpus):
    """The predicted query selects the hot buffer's whole capacity: the true query finds more of
    its blocks recalled ahead (fewer recalled in line), and attends what synchronous recall does."""
    prompts = [corpus[:1000], corpus[7000:8300]]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    runs = {}
    for extra, ahead in ((0, "off"), (0, "on"), (128, "on")):
        engine = _engine(model, "always", 16384, sink=32, recent=64, budget=128, hot_extra=extra, layer_ahead=ahead, suspend="layer")
        runs[extra, ahead] = ([c.token_ids for c in engine.generate(prompts, params)], engine.runner.offload.stats()["recall"])
        _assert_all_freed(engine)
    assert runs[128, "on"][0] == runs[0, "on"][0] == runs[0, "off"][0]
    assert 0 < runs[128, "on"][1]["corrected_units"] < runs[0, "on"][1]["corrected_units"]


def test_recall_deadline_that_never_expires_changes_nothing(model, corpus):
    """With a deadline each layer's gather lands in parts on the I/O thread; when they all land in
    time, a budget covering every block still gives the dense tokens, layer-ahead recall on."""
    prompts = [corpus[:1000], corpus[7000:8300]]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    dense = _engine(model, "never", 16384).generate(prompts, params)
    engine = _engine(model, "always", 16384, sink=32, recent=64, budget=2048, layer_ahead="on", recall_deadline_ms=60_000.0)
    assert [c.token_ids for c in engine.generate(prompts, params)] == [c.token_ids for c in dense]
    stats = engine.runner.offload.stats()
    assert stats["recall"]["units"] > 0 and stats["recall"]["truncated_units"] == 0
    _assert_all_freed(engine)


def test_recall_deadline_attends_over_what_landed_and_counts_the_rest(model, corpus, monkeypatch):
    """A link slower than the deadline: attention leaves out the blocks still in flight (counted),
    the step waits for them before it ends, and the next steps find them in the hot buffer."""
    copy = HostCopier.__call__

    def slow_copy(copier, layer, recalls):
        time.sleep(0.002)
        copy(copier, layer, recalls)

    monkeypatch.setattr(HostCopier, "__call__", slow_copy)
    prompts = [corpus[:1000], corpus[7000:8300]]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    engine = _engine(model, "always", 16384, sink=32, recent=64, budget=256, layer_ahead="off", recall_deadline_ms=0.0)
    done = engine.generate(prompts, params)
    assert all(len(c.token_ids) == 6 and c.error == "" for c in done)
    stats = engine.runner.offload.stats()
    assert 0 < stats["recall"]["truncated_units"] <= stats["recall"]["units"]
    steps = len(prompts) * (params.max_tokens - 1)  # decode rows; the prefill samples the first token
    assert stats["recall"]["units"] < steps * 30 * (256 // 16) // 2  # landed late, kept: later steps recall only new misses
    _assert_all_freed(engine)


def test_recall_deadline_is_checked(model):
    with pytest.raises(ValueError, match="--recall-deadline-ms must be >= 0"):
        OffloadConfig(recall_deadline_ms=-1.0)
    with pytest.raises(ValueError, match="needs --mode pulse"):
        _engine(model, "always", 4096, mode="headwise", recall_deadline_ms=5.0)


def test_hosted_blocks_are_summarized_from_the_keys_the_host_pool_holds(model, corpus):
    """Prefill chunks of two requests in one step, ending mid-block, then decode steps that fill
    blocks one at a time: every hosted block's summary is its scorer's summary of its stored keys."""
    worker = WorkerConfig(device_kv_tokens=4096, offload=OffloadConfig(sink=64, recent=256, budget=256))
    batcher = BatcherConfig(offload="always", prefill_chunk=200)
    engine = Engine(EngineConfig(worker=worker, batcher=batcher, host_kv_tokens=16384), loaded=model)
    for prompt in (corpus[:1000], corpus[3000:3700]):
        engine.submit(prompt, SamplingParams(max_tokens=64, ignore_eos=True))
    for _ in range(30):  # 9 prefill steps, then decode steps past block boundaries (1008, 1024; 704, 720)
        engine.step()
    manager = engine.runner.offload
    seqs = sorted(manager.seqs.values(), key=lambda s: s.length)
    assert all(seq.length // 16 > prompt // 16 for seq, prompt in zip(seqs, (700, 1000)))  # decode filled blocks
    for seq in seqs:
        assert len(seq.host_blocks) == seq.length // 16 - 64 // 16  # every full block past the sink
        for layer in (0, 17, 29):
            keys = manager.view.read(torch.tensor(seq.host_blocks), layer)[:, 0].transpose(1, 2)  # [n, block, kv_heads, dim]
            expected = manager.scorer.summarize(layer, keys)
            for got, want in zip(manager.summaries.of(layer, torch.tensor(seq.summary_slots)), expected):
                torch.testing.assert_close(got, want)


def test_long_requests_offload_and_short_ones_stay_resident_in_one_batch(model, corpus):
    short = [corpus[100:150], corpus[300:420]]
    long = corpus[5000:8000]  # 3000 tokens: more than the whole device pool
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    dense = _engine(model, "never", 8192).generate(short + [long], params)
    engine = _engine(model, "auto", 2048, sink=64, recent=256, budget=512)
    got = engine.generate(short + [long], params)
    assert [c.offloaded for c in got] == [False, False, True]
    assert [c.token_ids for c in got[:2]] == [c.token_ids for c in dense[:2]]
    agree = sum(a == b for a, b in zip(got[2].token_ids, dense[2].token_ids)) / len(dense[2].token_ids)
    assert agree >= 0.75, agree  # 512 of 2.7k host-tier tokens selected: sparse, not exact
    _assert_all_freed(engine)


def test_host_pool_exhaustion_fails_that_request_clearly_and_harms_no_other(model, corpus):
    small = corpus[:400]
    huge = corpus[10000:12000]  # needs ~120 host blocks; the pool has 64
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    (expected,) = _engine(model, "never", 8192).generate([small], params)
    engine = _engine(model, "always", 8192, host_tokens=64 * 16, sink=16, recent=64, budget=512)
    ok, failed = engine.generate([small, huge], params)
    assert ok.token_ids == expected.token_ids and ok.error == ""
    assert failed.finish_reason == "error" and "host KV pool exhausted" in failed.error
    _assert_all_freed(engine)
    (again,) = engine.generate([small], params)  # the engine keeps serving
    assert again.token_ids == expected.token_ids


def test_offload_config_is_checked():
    with pytest.raises(ValueError, match="--recent must be a multiple"):
        OffloadConfig(recent=100).geometry(16)
    with pytest.raises(ValueError, match="--budget"):
        OffloadConfig(budget=0).geometry(16)
    with pytest.raises(ValueError, match="--hot-extra"):
        OffloadConfig(hot_extra=8).geometry(16)
    g = OffloadConfig(sink=32, recent=64, budget=128).geometry(16)
    assert (g.sink_blocks, g.ring_blocks, g.budget_blocks, g.hot_blocks, g.device_blocks) == (2, 4, 8, 8, 14)
    g = OffloadConfig(sink=32, recent=64, budget=128, hot_extra=64).geometry(16)
    assert (g.budget_blocks, g.hot_blocks, g.device_blocks) == (8, 12, 18)
    assert g.window_start(32) == 2 and g.window_start(16 * 10 + 1) == 7


def test_solohead_picks_the_highest_quest_bound_over_all_query_heads():
    torch.manual_seed(0)
    kv_heads, group, dim, blocks, block = 3, 3, 8, 12, 16
    keys = torch.randn(blocks, block, kv_heads, dim)
    scorer = QuestScorer(kv_heads, dim)
    pool, table = _pool_of(scorer, keys)
    q = torch.randn(kv_heads * group, dim)

    def select(count: int, per_head: bool) -> list:
        return select_blocks(scorer, 0, q[None], pool, table, torch.tensor([count]), 4, per_head).tolist()

    ((picked,),) = select(blocks, per_head=False)
    grouped = q.view(kv_heads, group, dim)
    bound = [
        sum(torch.maximum(grouped[h] * keys[b, :, h].amax(0), grouped[h] * keys[b, :, h].amin(0)).sum().item() for h in range(kv_heads))
        for b in range(blocks)
    ]
    assert picked == sorted(range(blocks), key=lambda b: -bound[b])[:4]  # highest first: the recall order
    for b in range(blocks):  # an upper bound of every token's q.k summed over the heads
        exact = torch.einsum("hgd,thd->t", grouped, keys[b]).max().item()
        assert bound[b] >= exact - 1e-4
    assert select(3, per_head=False) == [[[0, 1, 2, -1]]]  # all, padded
    (per_head,) = select(blocks, per_head=True)
    for h, chosen in enumerate(per_head):  # head-wise: each kv head's own top 4 by its group's bound
        head_bound = [
            torch.maximum(grouped[h] * keys[b, :, h].amax(0), grouped[h] * keys[b, :, h].amin(0)).sum().item() for b in range(blocks)
        ]
        assert chosen == sorted(range(blocks), key=lambda b: -head_bound[b])[:4]
    assert len({tuple(c) for c in per_head}) > 1  # the heads disagree: head-wise recalls fragment


def test_lowrank_scores_are_each_blocks_attention_share_when_the_rank_is_full():
    """With a full-rank orthonormal basis the projection loses nothing: a block's score is the
    share of each query head's softmax over the host blocks it draws, summed over the heads."""
    torch.manual_seed(2)
    kv_heads, group, dim, blocks, block = 3, 3, 8, 10, 16
    keys = torch.randn(blocks, block, kv_heads, dim)
    q = torch.randn(kv_heads * group, dim)
    bases = torch.linalg.qr(torch.randn(1, kv_heads, dim, dim)).Q
    scorer = LowRankScorer(bases)
    (projected,) = scorer.summarize(0, keys)
    logits = torch.einsum("hgd,nbhd->hgnb", q.view(kv_heads, group, dim), keys) / dim**0.5
    shares = torch.softmax(logits.flatten(2), dim=-1).view(kv_heads, group, blocks, block).sum(dim=-1)  # [kv_heads, group, n]
    every = torch.arange(blocks)[None]
    valid = torch.ones_like(every, dtype=torch.bool)
    (solo,) = scorer.scores(0, q[None], (projected,), every, valid, per_head=False)
    torch.testing.assert_close(solo, shares.sum(dim=(0, 1))[None])
    (per_head,) = scorer.scores(0, q[None], (projected,), every, valid, per_head=True)
    torch.testing.assert_close(per_head, shares.sum(dim=1))
    with pytest.raises(ValueError, match="low-rank scores"):
        lowrank_scores(q[None, :, :4], bases[0], projected, every, valid, per_head=False)


def _pool_of(scorer, keys: torch.Tensor) -> tuple[SummaryPool, torch.Tensor]:
    """A summary pool holding the blocks `keys` [n, block, kv_heads, dim], in shuffled slots, and the table [1, n] naming them in order."""
    pool = SummaryPool(1, scorer, keys.shape[1], torch.float32, torch.device("cpu"))
    pool.allocate(3)  # another request's slots
    slots = torch.tensor(pool.allocate(keys.shape[0]))[torch.randperm(keys.shape[0])]
    pool.write(0, slots, keys)
    return pool, slots[None]


def test_a_batch_selects_what_each_row_selects_alone():
    """Rows of different lengths, their summaries anywhere in the pool, share one scoring pass and
    one padded top-k: short rows keep all their blocks, the padding never gets picked, and each row
    gets what it would get on its own."""
    torch.manual_seed(1)
    kv_heads, dim, budget = 3, 8, 4
    q = torch.randn(4, 3 * kv_heads, dim)
    counts = [12, 3, 5, 12]
    bases = torch.linalg.qr(torch.randn(1, kv_heads, dim, dim)).Q[..., :4]  # orthonormal rank-4 bases
    for scorer in (QuestScorer(kv_heads, dim), LowRankScorer(bases)):
        pool = SummaryPool(1, scorer, 16, torch.float32, torch.device("cpu"))
        rows = [torch.tensor(pool.allocate(n)) for n in counts]  # a pool grown past its first size
        for slots in rows:
            pool.write(0, slots, torch.randn(len(slots), 16, kv_heads, dim))
        width = max(counts)
        table = torch.stack([torch.cat((slots, slots.new_zeros(width - len(slots)))) for slots in rows])
        for per_head in (False, True):
            batch = select_blocks(scorer, 0, q, pool, table, torch.tensor(counts), budget, per_head)
            alone = [
                select_blocks(scorer, 0, q[r : r + 1], pool, slots[None], torch.tensor([n]), budget, per_head)
                if n >= budget
                else select_blocks(scorer, 0, q[r : r + 1], pool, table[r : r + 1], torch.tensor([n]), budget, per_head)
                for r, (n, slots) in enumerate(zip(counts, rows))
            ]
            assert torch.equal(batch, torch.cat(alone))
            assert batch[1].tolist() == [[0, 1, 2, -1]] * batch.shape[1] and 0 <= batch[2].min() and batch[2].max() < 5
        assert select_blocks(scorer, 0, q[:0], pool, table[:0], torch.tensor(counts[:0]), budget, False).shape == (0, 1, budget)


def test_a_summary_pool_reuses_released_slots_and_keeps_its_summaries_when_it_grows():
    scorer = QuestScorer(2, 4)
    pool = SummaryPool(2, scorer, 16, torch.bfloat16, torch.device("cpu"))
    keys = torch.randn(5, 16, 2, 4)
    first = pool.allocate(5)
    pool.write(1, torch.tensor(first), keys)
    pool.release(first[1:3])
    assert sorted(pool.allocate(2)) == sorted(first[1:3])
    more = pool.allocate(40)  # past the first size: the pool grows
    assert pool.capacity >= 45 and not set(more) & set(first) and pool.parts[0].dtype == torch.bfloat16
    for got, want in zip(pool.of(1, torch.tensor(first)), scorer.summarize(1, keys)):
        torch.testing.assert_close(got, want.to(torch.bfloat16))


def test_hot_buffer_recalls_only_misses_and_evicts_least_recently_used():
    g = OffloadConfig(sink=16, recent=16, budget=48).geometry(16)  # 3 hot blocks
    hot = HotBuffers(1, 1, g, torch.device("cpu"))
    hot.add((90, 91, 92, 93, 94))  # another request's row: untouched below
    rows = torch.tensor([hot.add((100, 101, 200, 201, 202))])

    def update(*chosen: int) -> tuple[list[int], list[int]]:
        """The device blocks of the chosen blocks (padding left out) and the misses."""
        devices, missed = hot.update(rows, 0, torch.tensor([[chosen]]))
        real = [i for i, j in enumerate(chosen) if j >= 0]
        return [devices[0, 0, i].item() for i in real], [chosen[i] for i in real if missed[0, 0, i]]

    assert update(5, 6, 7) == ([200, 201, 202], [5, 6, 7])  # unused blocks first, in footprint order
    assert update(5, 6, 7) == ([200, 201, 202], [])  # all present: nothing moves
    assert update(6, 7, 9) == ([201, 202, 200], [9])  # 5 was least recently used and not selected: its block is reused
    assert update(9, 7, -1) == ([200, 202], [])  # -1 pads a short selection
    assert update(8, 5, -1) == ([201, 200], [8, 5])  # 6 (unselected since two updates), then 9 (older than 7)
    assert hot.held[0].eq(-1).all()


def test_headwise_hot_buffer_keeps_one_lru_per_kv_head():
    g = OffloadConfig(sink=16, recent=16, budget=32).geometry(16)  # 2 hot blocks, shared by 2 heads
    hot = HotBuffers(1, 2, g, torch.device("cpu"))
    rows = torch.tensor([hot.add((100, 101, 200, 201))])
    devices, missed = hot.update(rows, 0, torch.tensor([[[5, 6], [6, 8]]]))
    assert devices.tolist() == [[[200, 201], [200, 201]]] and missed.all()
    devices, missed = hot.update(rows, 0, torch.tensor([[[5, 6], [6, 9]]]))
    assert devices.tolist() == [[[200, 201], [200, 201]]]
    assert missed.tolist() == [[[False, False], [False, True]]]  # only head 1's new block moves


def test_recalls_go_best_first_across_the_batch_and_its_heads():
    missed = torch.tensor([[[True, True, False], [True, False, True]], [[False, True, False], [False, False, False]]])  # [rows, heads, k]
    row, head, k = by_rank(missed)
    assert list(zip(row.tolist(), head.tolist(), k.tolist())) == [(0, 0, 0), (1, 0, 1), (0, 1, 0), (0, 0, 1), (0, 1, 2)]
    assert [t.numel() for t in by_rank(missed[:0])] == [0, 0, 0]


def test_pad_tables_makes_shared_rows_per_head_when_any_row_is():
    shared, per_head = [7, 8], [[1, 2, 3], [4, 5, 6]]
    assert pad_tables([shared, [9]]).tolist() == [[7, 8], [9, 9]]
    assert pad_tables([shared, per_head]).tolist() == [[[7, 8, 7], [7, 8, 7]], [[1, 2, 3], [4, 5, 6]]]
