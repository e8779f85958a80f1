"""Executes step plans: builds the batch, runs the model, samples."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from pulseinfer.common.syncs import to_device, to_host
from pulseinfer.gpu_worker.attention import attention_backend
from pulseinfer.gpu_worker.attention.window import WindowCache
from pulseinfer.gpu_worker.batch import ForwardBatch, build_batch
from pulseinfer.gpu_worker.config import WorkerConfig
from pulseinfer.gpu_worker.faults import FaultPlan
from pulseinfer.gpu_worker.forward import forward_hidden
from pulseinfer.gpu_worker.hierarchy import KVHierarchy
from pulseinfer.gpu_worker.key_basis import calibration_ids, key_bases
from pulseinfer.gpu_worker.kv_cache import KVCacheSpec, PagedKVCache
from pulseinfer.gpu_worker.memory_plan import device_memory, worker_plan
from pulseinfer.gpu_worker.model.decoder import Decoder
from pulseinfer.gpu_worker.model.loader import LoadedModel
from pulseinfer.gpu_worker.offload.config import HostTier
from pulseinfer.gpu_worker.offload.manager import OffloadManager
from pulseinfer.gpu_worker.sampler import GrammarMasks, advance_grammars, logprobs_of, sample_with_logprobs, score
from pulseinfer.gpu_worker.sparse import LowRankScorer, QuestScorer, Scorer
from pulseinfer.kv_store.client import KVStoreUnavailable
from pulseinfer.messages.plan import Chunk, Logprobs, RecallStats, SampledToken, StepOutcome, StepPlan

log = logging.getLogger("gpu_worker")

# (logits [S, vocab], the sampled chunks) -> a token each, or an error string that fails that chunk's request
Pick = Callable[[torch.Tensor, list[Chunk]], Sequence[int | str]]


def _without(plan: StepPlan, failed: dict[str, str]) -> StepPlan:
    """The plan less the chunks and the block names of the requests that failed: a block of theirs
    may not have been written."""
    chunks = tuple(c for c in plan.chunks if c.seq_id not in failed)
    return replace(plan, chunks=chunks, names=tuple(n for n in plan.names if n.seq_id not in failed))


@dataclass(frozen=True)
class PendingOutcome:
    """The outcome of a step whose forward has started (what a runner's launch() returns): `wait`
    returns it; `ends_at` (perf_counter) is when the forward is expected to end, 0 when it has
    ended (or is not known)."""

    wait: Callable[[], StepOutcome]
    ends_at: float = 0.0


def poisons_device(error: Exception) -> bool:
    """A device error after which the context cannot run anything: the worker restarts instead."""
    return isinstance(error, torch.AcceleratorError) or "CUDA error" in str(error)


def _halves(plan: StepPlan) -> list[StepPlan]:
    """The plan's chunks in two plans, each with its own chunks' block names."""
    mid, halves = len(plan.chunks) // 2, []
    for part in (plan.chunks[:mid], plan.chunks[mid:]):
        ids = {c.seq_id for c in part}
        halves.append(replace(plan, chunks=part, names=tuple(n for n in plan.names if n.seq_id in ids)))
    return halves


def _merged(outcomes: list[StepOutcome]) -> StepOutcome:
    """The outcomes of a step's parts as the step's."""
    return StepOutcome(
        tokens=[t for o in outcomes for t in o.tokens],
        failed={seq_id: e for o in outcomes for seq_id, e in o.failed.items()},
        recall=sum((o.recall for o in outcomes), RecallStats()),
        compute_s=sum(o.compute_s for o in outcomes),
        prompt_logprobs={seq_id: lp for o in outcomes for seq_id, lp in o.prompt_logprobs.items()},
        isolated_failures=sum(o.isolated_failures for o in outcomes),
    )


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        config: WorkerConfig,
        host: HostTier | None = None,
        offloading: bool = True,
        faults: FaultPlan | None = None,
    ):
        """`host`: the kv_store's pool (None: none mapped); `offloading`: whether offloaded requests may
        come (a cluster's worker always lets its scheduler decide); `faults`: the tests' injected faults."""
        self.config = config
        self.faults = faults or FaultPlan()
        self.device = config.torch_device()
        self.dtype = config.torch_dtype()
        self.model_config = loaded.config
        offloading = offloading and host is not None and config.mode != "dense"
        memory = device_memory(config, self.device)
        if memory is not None:  # before any allocation: a configuration the device cannot hold is refused whole
            worker_plan(loaded.config, config, memory, offloading and bool(loaded.config.kv_layers)).check()
        self.model = Decoder(loaded.config, loaded.weights, self.device, self.dtype)
        shared = offloading and host.recall_engine is not None  # the kv_store's I/O engine recalls into it
        self.cache = PagedKVCache(loaded.config, config.cache_spec(), self.dtype, self.device, shared)
        self.window = self._window_cache(loaded) if loaded.config.sliding_layers else None
        self.offload = self._offload_manager(host, loaded) if offloading and loaded.config.kv_layers else None
        # with the host pool mapped, in every mode: evicted prefix blocks demoted there and promoted back (not
        # on a model with sliding-window layers: the host tier holds none of their KV to rebuild rings from)
        tiered = host is not None and loaded.config.kv_layers and self.window is None
        self.hierarchy = KVHierarchy(self.cache, host, self.offload) if tiered else None
        self.attention = attention_backend(self.cache, self.offload, self.window, loaded.config)
        self.masks = GrammarMasks()

    def _window_cache(self, loaded: LoadedModel) -> WindowCache:
        history = self.cache.spec.num_tokens if self.config.window_history == "on" else 0
        return WindowCache(loaded.config, self.config.max_running, self.cache.spec.block_size, self.dtype, self.device, history)

    def _offload_manager(self, host: HostTier, loaded: LoadedModel) -> OffloadManager:
        geometry = self.config.offload.geometry(self.config.block_size)
        if geometry.device_blocks > self.cache.spec.num_blocks:
            log.warning(
                "an offloaded request holds %d device blocks (--sink + --recent + --budget), more than the device KV pool's %d: "
                "nothing will be offloaded",
                geometry.device_blocks,
                self.cache.spec.num_blocks,
            )
        return OffloadManager(self.config.offload, self.cache, host, self._scorer(loaded), self.config.mode == "headwise", self.faults)

    def _scorer(self, loaded: LoadedModel) -> Scorer:
        """The block scorer; lowrank fits its key bases on the calibration text first (a dense pass)."""
        c, o = self.model_config, self.config.offload
        if o.scorer == "quest":
            return QuestScorer(c.num_kv_heads, c.head_dim)
        rank = o.rank(c.head_dim)
        fitted = ("key_bases", o.calibration_tokens, rank, self.dtype, self.device)
        if fitted not in loaded.fitted:
            started = time.perf_counter()
            loaded.fitted[fitted] = key_bases(self.model, calibration_ids(loaded.tokenizer, o.calibration_tokens), rank)
            seconds = time.perf_counter() - started
            log.info("lowrank scorer: rank-%d key bases fitted on %d tokens in %.1f s", rank, o.calibration_tokens, seconds)
        return LowRankScorer(loaded.fitted[fitted][list(c.full_layers)])

    def release_all(self, host_owners: Sequence[str] = ()) -> None:
        """Frees every request's device state and host blocks: the scheduler that planned them is gone.
        `host_owners`: who holds host blocks for admissions sent here that may not have run (an
        offloaded one's cached prefix, a resident one's promotion)."""
        if self.window is not None:
            self.window.release_all()
        if self.offload is not None:
            self.offload.release_all()
        if self.hierarchy is not None:
            self.hierarchy.release(host_owners)

    def detach_host(self) -> None:
        """The kv_store died, with its pool: what this worker mapped of it is let go of (mapped anew when next needed)."""
        if self.offload is not None:
            self.offload.detach()
        if self.hierarchy is not None:
            self.hierarchy.detach()

    def idle(self) -> None:
        """No step to run: demotions still landing are named now."""
        if self.hierarchy is not None:
            self.hierarchy.settle(wait=True)

    @property
    def host_tier(self) -> bool:
        """Whether it maps the host pool: its scheduler may demote evicted prefix blocks there and promote them back."""
        return self.hierarchy is not None

    def close(self) -> None:
        if self.offload is not None:
            self.offload.close()
        self.cache.close()
        self.masks.close()

    @property
    def window_history(self) -> bool:
        """Whether it keeps its sliding-window layers' KV of every device block: requests may start from a cached prefix."""
        return self.window is not None and self.window.keeps_history

    @property
    def cache_spec(self) -> KVCacheSpec:
        return self.cache.spec

    @property
    def max_running(self) -> int:
        """Requests this worker runs at once; 0: as many as the device KV pool holds."""
        return self.window.capacity if self.window is not None else 0

    @property
    def offload_blocks(self) -> int:
        """Device blocks one offloaded request holds; 0 without a host pool (nothing can be offloaded)."""
        return self.offload.geometry.device_blocks if self.offload is not None else 0

    launches_async = False  # launch() runs the step: its Python drives every kernel and waits for the sampled tokens

    def launch(self, plan: StepPlan) -> PendingOutcome:
        """The worker's step (gpu_worker/server.py StepRunner): run now, its outcome handed back."""
        outcome = self.execute(plan)
        return PendingOutcome(lambda: outcome)

    def execute(self, plan: StepPlan, pick: Pick | None = None) -> StepOutcome:
        """Runs one step. `pick` chooses each sampled chunk's token from its logits (default: the
        chunk's sampling parameters; the perplexity eval forces the text's next token)."""
        started = time.perf_counter()
        not_loaded = self.hierarchy.step(plan.demote, plan.chunks) if self.hierarchy is not None else {}
        tier_copy_s = time.perf_counter() - started
        self.faults.forget(plan.released)
        plan, failed = self._admit(_without(plan, not_loaded))
        failed |= not_loaded
        try:
            return replace(self._isolating(plan, failed, pick), tier_copy_s=tier_copy_s)
        except KVStoreUnavailable as e:
            # The kv_store died mid-step and the offloaded requests' KV with its pool. The resident
            # requests need nothing of it: they run the step again alone (their KV rewritten, the same).
            if self.device.type == "cuda":  # the step's kernels may still read and write the pool, which detach unmaps
                torch.cuda.synchronize(self.device)
            self.offload.detach()
            failed |= {c.seq_id: str(e) for c in plan.chunks if c.offloaded}
            outcome = self._run(replace(plan, chunks=tuple(c for c in plan.chunks if not c.offloaded)), failed, pick)
            return replace(outcome, tier_copy_s=tier_copy_s)

    def _isolating(self, plan: StepPlan, failed: dict[str, str], pick: Pick | None, again: bool = False) -> StepOutcome:
        """Runs the step (`again`: a part of a step that failed, restored first); if it raises, its
        chunks run again in halves down to the ones that raise: those fail with the cause, every
        other gets what the step would have given it."""
        if again:
            self._restore(plan)
        try:
            return self._run(plan, failed, pick)
        except KVStoreUnavailable:
            raise
        except Exception as e:
            if poisons_device(e):
                raise
            log.warning("step %d failed (%s: %s): its %d chunks run again in parts", plan.step_id, type(e).__name__, e, len(plan.chunks))
            lost = self._unrepeatable(plan) if len(plan.chunks) > 1 else set()
            cause = f"the step failed ({type(e).__name__}: {e}) and this request's KV could not be restored to run it again"
            rest = replace(plan, chunks=tuple(c for c in plan.chunks if c.seq_id not in lost))
            parts = [StepOutcome([], failed | dict.fromkeys(lost, cause))]
            if len(rest.chunks) == 1:  # the culprit: nothing to run again
                parts.append(self._failed_alone(rest, e))
            elif rest.chunks:
                parts += [self._isolating(half, {}, pick, again=True) for half in _halves(rest)]
            return _merged(parts)

    @staticmethod
    def _failed_alone(plan: StepPlan, error: Exception) -> StepOutcome:
        (chunk,) = plan.chunks
        log.warning("step %d: request %s fails alone: %s: %s", plan.step_id, chunk.seq_id, type(error).__name__, error)
        return StepOutcome([], {chunk.seq_id: f"{type(error).__name__}: {error}"}, isolated_failures=1)

    def _unrepeatable(self, plan: StepPlan) -> set[str]:
        """The chunks whose KV a run that failed may have left unfit for running them again: prefill
        chunks that read context from a sliding-window ring their own writes overwrite, with no
        history to rebuild it from (kept for resident requests only, when --window-history is on)."""
        if self.window is None:
            return set()
        lost = (c for c in plan.chunks if len(c.token_ids) > 1 and c.start_pos > 0)
        return {c.seq_id for c in lost if c.offloaded or not self.window.keeps_history}

    def _restore(self, plan: StepPlan) -> None:
        """Before a part of a failed step runs again: sliding-window rings rebuilt as they were before
        its prefill chunks, and the offloaded requests' recalls forgotten (they may not have landed)."""
        if self.window is not None:
            for c in plan.chunks:
                if len(c.token_ids) > 1 and c.start_pos > 0:
                    self.window.rebuild(c.seq_id, c.start_pos, c.block_table)
        if self.offload is not None:
            self.offload.forget_recalls([c.seq_id for c in plan.chunks if c.offloaded])

    def _run(self, plan: StepPlan, failed: dict[str, str], pick: Pick | None) -> StepOutcome:
        if not plan.chunks:
            if self.offload is not None:
                self.offload.name_blocks(plan.names)
            return StepOutcome([], failed)
        started, recalled = time.perf_counter(), self._recalled()
        faults = self.faults
        faults.arm(plan.chunks)
        sampled = [c for c in plan.chunks if c.sampling is not None]
        specs = [c.sampling for c in sampled]
        structured = (c.seq_id for c in sampled if c.sampling.grammar is not None)  # read only when a fault is armed
        # made while the forward runs
        masks = self.masks.start(specs, lambda: faults.check("mask", structured)) if pick is None else None
        batch = build_batch(plan, self.cache.spec.block_size, self.device)
        attention = self.attention.begin(plan, batch)
        try:
            hidden = forward_hidden(self.model, batch, attention, self._midway if faults.armed else None)
        finally:
            attention.finish()
        logits = self.model.logits(hidden[batch.sample_index])
        if pick is not None:
            picked, logprobs = pick(logits, sampled), [None] * len(sampled)
        else:
            faults.check("sampling", (c.seq_id for c in sampled))
            picked, logprobs = sample_with_logprobs(logits, specs, masks)
        faults.check("logprobs", (c.seq_id for c in plan.chunks if c.prompt_top >= 0 or (c.sampling and c.sampling.logprobs)))
        prompt_logprobs = self._score_prompts(plan.chunks, batch.chunk_starts, hidden)
        if self.offload is not None:  # after sampling, whose read has drained the stream that naming waits for
            self.offload.name_blocks(plan.names)
        if pick is None:
            advance_grammars(specs, picked)
        tokens = []
        for chunk, token, token_logprobs in zip(sampled, picked, logprobs):
            if isinstance(token, str):  # a row that could not be sampled fails its own request, not the step
                failed[chunk.seq_id] = token
            else:
                tokens.append(SampledToken(chunk.seq_id, token, token_logprobs))
        recall = self._recalled() - recalled
        compute_s = time.perf_counter() - started - recall.wait_s
        return StepOutcome(tokens, failed, recall, compute_s, prompt_logprobs=prompt_logprobs)

    def _score_prompts(self, chunks: Sequence[Chunk], starts: dict[str, int], hidden: torch.Tensor) -> dict[str, Logprobs]:
        """The prompt tokens each scoring chunk's rows predict (the chunk's tokens after its first, then
        the token after it unless it samples), their logprobs read in one transfer."""
        targets = {c.seq_id: list(c.token_ids[1:]) + ([c.score_next] if c.sampling is None else []) for c in chunks if c.prompt_top >= 0}
        # a one-token chunk that samples (a prompt's last token, scored by decode steps) predicts no prompt token
        empty = {c.seq_id: Logprobs([], [], c.prompt_top, [], []) for c in chunks if c.seq_id in targets and not targets[c.seq_id]}
        scored = [c for c in chunks if targets.get(c.seq_id)]
        if not scored:
            return empty
        columns = []
        for chunk in scored:
            start, ids = starts[chunk.seq_id], targets[chunk.seq_id]
            rows, ids = to_device([torch.arange(start, start + len(ids)), torch.tensor(ids, dtype=torch.long)], self.device)
            columns += score(self.model.logits, hidden[rows], ids, chunk.prompt_top)
        read = to_host(columns)
        return empty | {c.seq_id: logprobs_of(read[4 * i : 4 * i + 4], c.prompt_top) for i, c in enumerate(scored)}

    def _midway(self, batch: ForwardBatch) -> None:
        self.faults.check("forward", batch.chunk_starts)

    def _recalled(self) -> RecallStats:
        return self.offload.recall if self.offload is not None else RecallStats()

    def _admit(self, plan: StepPlan) -> tuple[StepPlan, dict[str, str]]:
        """The plan less the chunks that cannot run here, and why: those without a sliding-window
        ring, and offloaded ones without host blocks (or without a host pool)."""
        refused = self.window.admit(plan) if self.window is not None else {}
        if self.offload is not None:
            plan, failed = self.offload.admit(_without(plan, refused))
            refused |= failed
        else:
            refused |= {c.seq_id: "this worker has no host KV pool to offload to" for c in plan.chunks if c.offloaded}
        return _without(plan, refused), refused
