"""Automatic prefix caching of the device pool, on the batcher alone (no model): names chained over
blocks, reuse of the longest cached prefix, the last token always computed, reference counts,
least-recently-used eviction only under need, preemption, offloaded requests, and the switch."""

from __future__ import annotations

import pytest
from helpers import assert_device_idle, assert_host_idle

from pulseinfer.engine import Engine, EngineConfig
from pulseinfer.gpu_worker.config import WorkerConfig
from pulseinfer.gpu_worker.offload.config import OffloadConfig
from pulseinfer.kv_store.allocator import BlockAllocator, PoolExhausted
from pulseinfer.kv_store.prefix_cache import NAME_BYTES, ROOT, HostBlocks, chain_hashes
from pulseinfer.messages.plan import SampledToken, StepPlan
from pulseinfer.messages.sampling import SamplingParams
from pulseinfer.scheduler.batcher import Batcher, BatcherConfig, ModelLimits
from pulseinfer.scheduler.request import Sequence

B = 16
PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


def _batcher(blocks: int = 64, **config) -> Batcher:
    limits = ModelLimits(max_position=4096, eos_id=None, block_size=B, **config.pop("limits", {}))
    host = config.pop("host", None)
    return Batcher(BatcherConfig(prefill_chunk=4096, **config), limits, BlockAllocator(blocks), host)


def _seq(seq_id: str, ids: list[int], params: SamplingParams = PARAMS) -> Sequence:
    return Sequence.admit(seq_id, ids, params, vocab_size=100_000)


def _step(batcher: Batcher) -> StepPlan | None:
    """One step: every chunk that ends its context samples token 7."""
    plan = batcher.schedule()
    if plan is not None:
        batcher.commit(plan, [SampledToken(c.seq_id, 7) for c in plan.chunks if c.sampling is not None])
    return plan


def _run(batcher: Batcher) -> list[StepPlan]:
    plans = []
    while batcher.waiting or batcher.running:
        plans.append(_step(batcher))
    return plans


def _used(batcher: Batcher) -> int:
    return batcher.allocator.num_blocks - batcher.allocator.num_free


def test_names_chain_over_the_prefix():
    a = list(range(64))
    b = [*a[:16], 999, *a[17:]]  # differs in block 1 only
    names_a, names_b = chain_hashes(a, B, 0, 4, ROOT), chain_hashes(b, B, 0, 4, ROOT)
    assert names_a[0] == names_b[0] and all(x != y for x, y in zip(names_a[1:], names_b[1:]))  # later blocks differ too
    assert chain_hashes(a, B, 2, 2, names_a[1]) == names_a[2:]  # extending a chain gives the same names
    assert chain_hashes(a[16:], B, 0, 1, ROOT) != names_a[1:2]  # equal tokens at another position: another name


def test_a_shared_prefix_is_reused_and_only_the_rest_prefilled():
    batcher = _batcher()
    shared = list(range(100, 100 + 5 * B))
    batcher.add(_seq("a", [*shared, 1, 2, 3]))
    _run(batcher)
    assert len(batcher.prefix) == 5  # 83 tokens + 3 of 4 outputs computed: 5 full blocks
    a_blocks = batcher.prefix.match(chain_hashes(shared, B, 0, 5, ROOT))
    batcher.add(_seq("b", [*shared, 9, 9]))
    (chunk,) = batcher.schedule().chunks
    assert chunk.start_pos == 5 * B and chunk.token_ids == (9, 9)  # only the new tokens
    assert list(chunk.block_table[:5]) == a_blocks  # a's blocks, shared
    b = batcher.running[0]
    assert b.cached_tokens == 5 * B and all(batcher.allocator.refcount(x) == 2 for x in a_blocks)
    stats = batcher.prefix.stats
    assert (stats.queried_tokens, stats.hit_tokens) == (len(shared) + 3 + len(shared) + 2, 5 * B)


def test_a_fully_cached_prompt_still_computes_its_last_token():
    batcher = _batcher()
    ids = list(range(200, 200 + 3 * B))  # exactly 3 blocks
    batcher.add(_seq("a", ids))
    _run(batcher)
    batcher.add(_seq("b", ids))
    (chunk,) = batcher.schedule().chunks
    assert chunk.start_pos == 2 * B and len(chunk.token_ids) == B and chunk.sampling is not None
    assert batcher.running[0].cached_tokens == 2 * B


def test_cached_blocks_stay_until_room_is_needed_then_go_least_recently_used_first():
    batcher = _batcher(blocks=12)
    prompts = {name: [n * 1000 + i for i in range(3 * B + 1)] for n, name in enumerate("abc", 1)}
    for name in "ab":  # 3 full blocks each stay cached, 4 allocated while running
        batcher.add(_seq(name, prompts[name]))
        _run(batcher)
    assert len(batcher.prefix) == 6 and _used(batcher) == 6 and batcher.prefix.stats.evicted_blocks == 0
    batcher.add(_seq("a2", prompts["a"]))  # touches a's blocks: b's are now the least recently used
    _run(batcher)
    batcher.add(_seq("big", list(range(5000, 5000 + 7 * B))))  # needs 8 blocks: 6 free, 2 evicted
    _run(batcher)
    assert batcher.prefix.stats.evicted_blocks >= 2
    assert len(batcher.prefix.match(chain_hashes(prompts["a"], B, 0, 3, ROOT))) == 3  # the recently used prefix survived
    assert len(batcher.prefix.match(chain_hashes(prompts["b"], B, 0, 3, ROOT))) < 3
    batcher.allocator.check()
    cached = len(batcher.prefix)
    assert _used(batcher) == cached  # idle: every used block is a cached one
    assert batcher.drop_prefix_cache() == cached
    assert batcher.allocator.num_free == batcher.allocator.num_blocks and len(batcher.prefix) == 0


def test_blocks_a_running_request_holds_are_never_evicted():
    batcher = _batcher(blocks=9)
    shared = list(range(300, 300 + 4 * B))
    batcher.add(_seq("a", [*shared, 1]))
    _run(batcher)
    batcher.add(_seq("long", [*shared, 2], SamplingParams(max_tokens=40, ignore_eos=True)))
    _step(batcher)
    held = batcher.allocator.blocks_of("long")[:4]
    assert sorted(held) == sorted(batcher.prefix.blocks.values())  # it runs on the 4 cached blocks
    assert batcher.prefix.evictable() == 0
    batcher.add(_seq("other", list(range(7000, 7000 + 2 * B))))  # takes every free block
    for _ in range(12):
        _step(batcher)
    assert [s.seq_id for s in batcher.running] == ["long"] and not batcher.waiting  # "other" finished beside it
    assert set(held) <= set(batcher.prefix.blocks.values()) and batcher.num_preemptions == 0
    batcher.allocator.check()


def test_a_preempted_request_reuses_its_own_blocks_when_readmitted():
    batcher = _batcher(blocks=10)
    batcher.add(_seq("a", list(range(400, 400 + 4 * B)), SamplingParams(max_tokens=3 * B, ignore_eos=True)))
    batcher.add(_seq("b", list(range(900, 900 + 4 * B)), SamplingParams(max_tokens=3 * B, ignore_eos=True)))
    plans = _run(batcher)
    assert batcher.num_preemptions > 0
    readmitted = [c for p in plans for c in p.chunks if c.start_pos > 0 and c.sampling is not None and len(c.token_ids) > 1]
    assert readmitted  # a prefill after preemption began past the blocks the cache kept
    batcher.allocator.check()
    assert _used(batcher) == len(batcher.prefix)


def test_offloaded_requests_add_no_device_blocks_and_without_a_host_tier_reuse_nothing():
    batcher = _batcher(blocks=64, offload="always", limits={"offload_blocks": 6})
    ids = list(range(500, 500 + 6 * B))
    for name in "ab":
        batcher.add(_seq(name, ids))
        _run(batcher)
    assert len(batcher.prefix) == 0 and batcher.prefix.stats.hit_tokens == 0


def _host_with(ids: list[int], count: int, pool: int = 32) -> tuple[HostBlocks, list[int]]:
    """A host tier caching the first `count` blocks of `ids`, as a finished offloaded request leaves it."""
    host = HostBlocks(pool)
    blocks = host.allocate("earlier", count)
    host.insert(chain_hashes(ids, B, 0, count, ROOT), blocks)
    host.release("earlier")
    return host, blocks


def test_an_offloaded_request_starts_from_the_host_blocks_of_its_cached_prefix():
    ids = list(range(700, 700 + 8 * B + 3))
    host, cached = _host_with(ids, 5)
    batcher = _batcher(blocks=64, offload="always", limits={"offload_blocks": 6}, host=host)
    batcher.add(_seq("b", ids))
    plan = batcher.schedule()
    (chunk,) = plan.chunks
    assert chunk.offloaded and chunk.start_pos == 5 * B and chunk.host_prefix == tuple(cached)
    assert all(host.allocator.refcount(x) == 2 for x in cached)  # the cache's and the request's
    (named,) = plan.names  # the blocks it completes, for its worker to name
    assert named.first == 5 and named.names == tuple(chain_hashes(ids, B, 0, 8, ROOT)[5:])
    stats = batcher.prefix.stats
    assert batcher.running[0].cached_tokens == 5 * B and stats.hit_tokens == stats.host_hit_tokens == 5 * B
    batcher.abort("b")
    assert batcher.released == ["b"]  # its worker frees what it holds, the cached blocks' references included


def test_under_pressure_a_request_whose_prefix_the_host_caches_is_offloaded_before_a_longer_one():
    cached = list(range(1000, 1000 + 165))  # 169 tokens with its outputs: 11 blocks, 8 of them cached on the host
    host, _ = _host_with(cached, 8)
    batcher = _batcher(blocks=20, offload="auto", limits={"offload_blocks": 4}, host=host)
    batcher.add(_seq("cached", cached))
    batcher.add(_seq("longer", list(range(3000, 3000 + 180))))  # 12 blocks: longest-first alone would offload it
    chunks = {c.seq_id: c for c in batcher.schedule().chunks}
    assert chunks["cached"].offloaded and chunks["cached"].start_pos == 8 * B
    assert not chunks["longer"].offloaded


def test_a_request_preempted_and_placed_again_in_one_plan_takes_no_host_blocks():
    """Its worker frees everything of it before the plan's chunks: taking blocks first would lose them."""
    ids = list(range(900, 900 + 4 * B + 1))
    host, _ = _host_with(ids, 4)
    batcher = _batcher(blocks=64, offload="always", limits={"offload_blocks": 6}, host=host)
    seq = _seq("c", ids)
    batcher.add(seq)
    batcher.schedule()
    batcher._preempt(seq)
    plan = batcher.schedule()
    assert plan.released == ("c",) and plan.chunks[0].start_pos == 0 and plan.chunks[0].host_prefix == ()


def test_host_allocations_evict_unheld_cached_blocks_least_recently_used_first():
    host = HostBlocks(8)
    old, new = host.allocate("old", 3), host.allocate("new", 3)
    host.insert([bytes([i]) * NAME_BYTES for i in range(3)], old)
    host.insert([bytes([10 + i]) * NAME_BYTES for i in range(3)], new)
    host.release("old")
    host.release("new")
    held = host.acquire("reader", [bytes([10]) * NAME_BYTES])  # the newer prefix's head, now held
    assert held == new[:1]
    got = host.allocate("x", 5)  # 2 free + 3 evicted: the old prefix's, least recently used
    assert set(old) <= set(got) and len(host.prefix) == 3 and host.prefix.stats.evicted_blocks == 3
    with pytest.raises(PoolExhausted):
        host.allocate("y", 3)  # two cached blocks can go, the held one cannot
    host.allocator.check()


# ---------------------------------------------------------------- the two tiers as one hierarchy


def _demote_as_a_worker_would(host: HostBlocks, plan: StepPlan) -> list[int]:
    """What a worker does with a plan's demotions: reserve host blocks for the names its host tier
    lacks, (write them,) name them. Returns what was reserved per name (-1: not written)."""
    reserved = host.reserve("\x01demote-w0", [name for _, name in plan.demote])
    written = [(name, block) for (_, name), block in zip(plan.demote, reserved) if block >= 0]
    host.insert([n for n, _ in written], [b for _, b in written], "\x01demote-w0")
    return reserved


def test_the_host_tier_reserves_only_the_names_it_lacks_and_names_them_once_written():
    host = HostBlocks(4)
    a, b, c = (bytes([i]) * NAME_BYTES for i in range(3))
    (kept,) = host.allocate("r", 1)
    host.insert([a], [kept])
    host.release("r")
    reserved = host.reserve("\x01demote-w0", [a, b, c])
    assert reserved[0] == -1 and min(reserved[1:]) >= 0  # `a` is there already: it is not written again
    assert b not in host.prefix and host.allocator.refcount(reserved[1]) == 1  # unnamed until written
    host.insert([b, c], reserved[1:], "\x01demote-w0")
    assert host.match([b]) == host.match([c]) == 1 and host.allocator.blocks_of("\x01demote-w0") == []
    assert host.prefix.stats.demoted_blocks == 2
    with pytest.raises(ValueError, match="did not reserve"):
        host.insert([bytes([9]) * NAME_BYTES], [kept], "\x01demote-w0")
    assert host.reserve("\x01demote-w0", [bytes([5 + i]) * NAME_BYTES for i in range(6)]).count(-1) == 2  # room for 4: LRU evicted
    host.allocator.check()


def _evicting_batcher(host_prefix_cache: str = "on") -> tuple[Batcher, HostBlocks, list[int]]:
    """A request's 5 full blocks cached on an 8-block device pool, then an unrelated one that needs 7:
    4 of them are evicted, tail first. Returns the batcher, its host tier and the first prompt."""
    host = HostBlocks(64)
    batcher = _batcher(blocks=8, limits={"host_tier": True}, host=host, host_prefix_cache=host_prefix_cache)
    first = list(range(100, 100 + 5 * B + 1))
    batcher.add(_seq("a", first))
    _run(batcher)
    batcher.add(_seq("b", list(range(5000, 5000 + 6 * B + 4))))
    return batcher, host, first


def test_evicted_device_blocks_are_demoted_by_the_next_plan_then_promoted_for_a_resident_sharer():
    batcher, host, first = _evicting_batcher()
    names = chain_hashes(first, B, 0, 5, ROOT)
    plan = batcher.schedule()
    assert [name for _, name in plan.demote] == names[4:0:-1]  # the tail first: the head serves every longer prefix
    assert len(set(block for block, _ in plan.demote) & set(plan.chunks[0].block_table)) == 4  # granted in the same plan
    assert min(_demote_as_a_worker_would(host, plan)) >= 0
    batcher.commit(plan, [SampledToken("b", 7)])
    _run(batcher)
    assert batcher.prefix.stats.demoted_blocks == 4 and len(host.prefix) == 4

    batcher.add(_seq("c", first[:-1] + [42, 43]))  # the first 5 blocks shared: 1 on the device, 4 in the host tier
    plan = batcher.schedule()
    (chunk,) = plan.chunks
    promoted = host.prefix.match(names[1:])
    assert chunk.start_pos == 5 * B and chunk.host_prefix == tuple(promoted) and plan.admitted[0].host_prefix == chunk.host_prefix
    assert host.allocator.blocks_of("c\x01promote") == promoted  # held until its worker has copied them
    assert len(chunk.block_table) == 6 and chunk.block_table[0] == batcher.prefix.match(names[:1])[0]
    seq = batcher.running[0]
    assert seq.cached_tokens == 5 * B and batcher.prefix.stats.host_hit_tokens == 4 * B and batcher.prefix.stats.promoted_blocks == 4
    batcher.commit(plan, [SampledToken("c", 7)])
    assert batcher.prefix.match(names) == list(chunk.block_table[:5])  # once copied, cached on the device again


def test_a_request_whose_prefix_is_being_demoted_waits_a_step_for_the_host_tier_to_have_it():
    batcher, host, first = _evicting_batcher()
    demoting = batcher.schedule()  # places the unrelated request, evicting 4 of the first's blocks
    batcher.abort("b")  # its blocks are free again: the sharer below would fit at once
    batcher.add(_seq("c", first[:-1] + [42, 43]))
    waiting = batcher.schedule()
    assert waiting.chunks == () and [s.seq_id for s in batcher.waiting] == ["c"]  # not computing what is being demoted
    _demote_as_a_worker_would(host, demoting)
    batcher.commit(demoting, [])
    batcher.commit(waiting, [])
    (placed,) = batcher.schedule().chunks
    assert placed.start_pos == 5 * B and len(placed.host_prefix) == 4


def test_a_promotion_in_flight_keeps_the_request_from_taking_host_blocks_again():
    batcher, host, first = _evicting_batcher()
    _demote_as_a_worker_would(host, _step(batcher))
    _run(batcher)
    seq = _seq("c", first[:-1] + [42, 43])
    batcher.add(seq)
    assert batcher.schedule().chunks[0].host_prefix  # promoted: its step has not answered
    batcher._preempt(seq)
    again = batcher.schedule().chunks[0]
    assert again.host_prefix == () and again.start_pos == B  # the device block only, until that step is done


def test_with_the_host_prefix_cache_off_evictions_are_dropped_and_nothing_is_promoted():
    batcher, host, first = _evicting_batcher("off")
    assert _step(batcher).demote == () and batcher.prefix.stats.evicted_blocks == 4
    _run(batcher)
    batcher.add(_seq("c", first[:-1] + [42, 43]))
    chunk = batcher.schedule().chunks[0]
    assert chunk.start_pos == B and chunk.host_prefix == () and host.allocator.num_free == 64


@pytest.mark.parametrize("limits", [{}, {"max_running": 8}])
def test_off_or_on_a_sliding_window_model_without_its_history_nothing_is_cached(limits):
    config = {"prefix_cache": "off"} if not limits else {}
    batcher = _batcher(limits=limits, **config)
    assert batcher.prefix is None
    for name in "ab":
        batcher.add(_seq(name, list(range(600, 600 + 3 * B))))
        _run(batcher)
    assert _used(batcher) == 0


def test_a_sliding_window_model_with_its_history_reuses_device_blocks_and_never_the_host_tier():
    """Its worker keeps the sliding layers' KV of device blocks, not of host blocks: resident
    requests share a prefix; nothing is demoted, promoted or reused offloaded."""
    host = HostBlocks(64)
    limits = {"max_running": 8, "window_history": True, "host_tier": True, "offload_blocks": 4}
    batcher = _batcher(blocks=8, limits=limits, host=host, offload="auto")
    assert batcher.prefix is not None and batcher.host is None and not batcher.hierarchy
    shared = list(range(700, 700 + 4 * B))
    batcher.add(_seq("a", [*shared, 1]))
    _run(batcher)
    batcher.add(_seq("b", [*shared, 2, 3]))
    (chunk,) = _step(batcher).chunks
    assert chunk.start_pos == 4 * B and chunk.host_prefix == () and not chunk.offloaded
    _run(batcher)
    batcher.add(_seq("c", list(range(2000, 2000 + 7 * B))))  # evicts the prefix: dropped, not demoted
    plans = _run(batcher)
    assert not any(c.offloaded for plan in plans for c in plan.chunks)
    assert batcher.prefix.stats.demoted_blocks == 0 and not any(plan.demote for plan in plans)
    assert host.allocator.num_free == 64


def test_the_switches_are_checked():
    with pytest.raises(ValueError, match="--prefix-cache must be one of on, off"):
        BatcherConfig(prefix_cache="maybe")
    with pytest.raises(ValueError, match="--host-prefix-cache must be one of on, off"):
        BatcherConfig(host_prefix_cache="1")
    with pytest.raises(ValueError, match="--window-history must be on or off"):
        WorkerConfig(window_history="yes")


# ---------------------------------------------------------------- with the model


@pytest.mark.parametrize(
    ("mode", "budget", "policy", "pool"),
    [
        ("dense", 0, "never", 4096),
        ("pulse", 512, "always", 640),  # a covering budget, every request offloaded: they reuse host blocks
        ("pulse", 64, "always", 640),  # sparse, every request offloaded
        ("pulse", 64, "auto", 256),  # sparse: the long request cannot be resident, the sharers are
    ],
)
def test_greedy_tokens_are_the_same_with_the_cache_on_and_off(model, mode, budget, policy, pool):
    """A first request warms the cache; then two requests sharing its 160-token prefix reuse its
    blocks (device blocks resident, host blocks offloaded: sink and recent window read back into
    their footprint), beside a long one sharing nothing."""
    text = model.tokenizer.encode(" ".join(str(i) for i in range(1000)))
    shared = text[:160]
    second_wave = [shared + text[700:720], shared + text[800:830], text[1000:1300]]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    runs = {}
    for cache in ("off", "on"):
        offload = OffloadConfig(sink=32, recent=64, budget=budget, calibration_tokens=256) if budget else OffloadConfig()
        worker = WorkerConfig(mode=mode, device_kv_tokens=pool, offload=offload)
        engine = Engine(EngineConfig(worker=worker, batcher=BatcherConfig(prefix_cache=cache, offload=policy)), loaded=model)
        first = engine.generate([shared + text[600:610]], params)
        rest = engine.generate(second_wave, params)
        runs[cache] = [c.token_ids for c in first + rest], [c.cached_tokens for c in rest], [c.offloaded for c in rest]
        assert_device_idle(engine)
        assert_host_idle(engine)
    assert runs["on"][0] == runs["off"][0]
    offloaded = {"never": [False] * 3, "always": [True] * 3, "auto": [False, False, True]}[policy]
    assert runs["on"][2] == offloaded and runs["off"][2][2] == offloaded[2]  # without reuse a sharer may be offloaded too
    assert runs["off"][1] == [0, 0, 0] and runs["on"][1] == [160, 160, 0]


@pytest.mark.parametrize(("mode", "policy"), [("dense", "never"), ("pulse", "auto"), ("headwise", "auto")])
def test_greedy_tokens_are_the_same_with_a_prefix_demoted_and_promoted_back(model, mode, policy):
    """A 160-token prefix cached on a 320-token device pool is evicted by an unrelated request (6 of its
    10 blocks); with the host prefix cache on they were demoted, and a request sharing the prefix
    promotes them back: it finds all 160 tokens cached (64 on the device, 96 in the host tier) where
    without the host tier it finds 64, and its greedy tokens are the same."""
    text = model.tokenizer.encode(" ".join(str(i) for i in range(1000)))
    shared = text[:160]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    runs = {}
    for host_cache in ("off", "on"):
        offload = OffloadConfig(sink=32, recent=64, budget=64, calibration_tokens=256)
        worker = WorkerConfig(mode=mode, device_kv_tokens=320, offload=offload)
        batcher = BatcherConfig(host_prefix_cache=host_cache, offload=policy)
        engine = Engine(EngineConfig(worker=worker, batcher=batcher, dense_host_tier=True), loaded=model)
        done = [engine.generate([prompt], params)[0] for prompt in (shared + text[600:610], text[1000:1250], shared + text[700:720])]
        stats = engine.batcher.prefix.stats
        runs[host_cache] = [c.token_ids for c in done], [c.cached_tokens for c in done], stats.demoted_blocks, stats.promoted_blocks
        assert not any(c.offloaded for c in done)
        assert_device_idle(engine)
        assert_host_idle(engine)
        engine.close()
    assert runs["on"][0] == runs["off"][0]
    assert runs["off"][1:] == ([0, 0, 64], 0, 0)
    assert runs["on"][1] == [0, 0, 160] and runs["on"][2] >= 6 and runs["on"][3] == 6


@pytest.mark.parametrize(("mode", "policy", "pool"), [("dense", "never", 4096), ("pulse", "auto", 4096), ("dense", "never", 1072)])
def test_gemma3_greedy_tokens_are_the_same_reusing_a_prefix_longer_than_its_window(gemma_model, mode, policy, pool):
    """Gemma 3 270M (windows of 512): a 700-token prefix warms the cache; then two requests reuse
    688 and 592 of its tokens (their rings rebuilt from the sliding layers' history of the prefix's
    last 512 positions) beside one sharing nothing. On the 1,072-token pool the three cannot all
    grow together: one is preempted and starts again from its own cached blocks (its rings rebuilt)."""
    import pydoc_data.topics

    tokenizer = gemma_model.tokenizer
    text = tokenizer.encode(" ".join(pydoc_data.topics.topics.values()), add_special=False)
    shared = [tokenizer.special.bos_id, *text[5000:5699]]
    prompts = [shared + text[9100:9130], shared[:600] + text[9200:9205], text[12000:12300]]
    tight = pool < 2048
    params = SamplingParams(max_tokens=40 if tight else 8, ignore_eos=True)
    runs = {}
    for cache in ("off", "on"):
        worker = WorkerConfig(mode=mode, device_kv_tokens=pool, max_running=4, offload=OffloadConfig(calibration_tokens=256))
        engine = Engine(EngineConfig(worker=worker, batcher=BatcherConfig(prefix_cache=cache, offload=policy)), loaded=gemma_model)
        assert engine.runner.window_history == (cache == "on")
        first = engine.generate([shared + text[9000:9010]], params)
        rest = engine.generate(prompts, params)
        runs[cache] = [c.token_ids for c in first + rest], [c.cached_tokens for c in rest], engine.batcher.num_preemptions
        assert not any(c.offloaded or c.error for c in first + rest)
        # rings rebuilt: the two sharers' and, preempted, the third one's from its own cached blocks
        assert engine.runner.window.rebuilt == (0 if cache == "off" else 3 if tight else 2)
        assert_device_idle(engine)
        engine.close()
    assert runs["on"][0] == runs["off"][0]
    assert runs["off"][1] == [0, 0, 0] and runs["on"][1] == [688, 592, 0]
    assert (runs["on"][2] > 0) == tight
