"""A runner whose forward is a fixed simulated time: a benchmark tool, not a product path.

`pulseinfer bench control-plane` runs the real cluster (gateway, scheduler, kv_store, workers)
with workers started with `--simulate-step-ms S`, which run this in place of the model, so that
what is measured is the control plane alone. It holds no KV and needs no weights: only the
model's config and tokenizer. Its accounting is honest: each chunk's block table must hold the
chunk as a real worker's cache would (an offloaded one exactly the offloaded footprint), else the
chunk fails as it would on a real worker. The forward is a sleep until S after the step began,
and each sampled token is a pure function of the request's seed and the token's index: an
ordinary word, never an end-of-sequence or special token, so that every request runs to its
max_tokens and every token streams as text.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from pulseinfer.common.model.tokenizer import Tokenizer
from pulseinfer.gpu_worker.config import WorkerConfig
from pulseinfer.gpu_worker.kv_cache import KVCacheSpec
from pulseinfer.gpu_worker.runner import PendingOutcome
from pulseinfer.messages.plan import Chunk, RecallStats, SampledToken, SamplingSpec, StepOutcome, StepPlan

# each a single token of the usual BPE vocabularies (with its leading space); the tokenizer decides
WORDS = " the of and to in is was for on that with as by at from it an be this which or are his her they had not have one all"
MASK64 = (1 << 64) - 1


def word_tokens(tokenizer: Tokenizer) -> tuple[int, ...]:
    """Ids of ordinary words of the tokenizer's vocabulary: none special, none the eos, each decoding to text."""
    special = set(tokenizer.backend.get_added_tokens_decoder()) | {tokenizer.eos_id, tokenizer.special.bos_id}
    ids = tuple(dict.fromkeys(i for i in tokenizer.encode(WORDS, add_special=False) if i not in special and tokenizer.decode([i])))
    if not ids:
        raise ValueError("the tokenizer has no ordinary word tokens to simulate sampling with")
    return ids


def simulated_token(words: tuple[int, ...], sampling: SamplingSpec) -> int:
    """A word chosen by (seed, step) alone, as sampling with a seed is (splitmix64 of the pair)."""
    x = (sampling.seed * 0x9E3779B97F4A7C15 + sampling.step + 1) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return words[(x ^ (x >> 31)) % len(words)]


class SimulatedRunner:
    """What the Worker uses of a ModelRunner (gpu_worker/runner.py), with a forward of `step_ms`."""

    offload = None  # no host tier is mapped: offloaded requests are checked for their device footprint only
    host_tier = False
    max_running = 0  # no sliding-window rings: as many requests as the device pool holds
    window_history = False
    launches_async = True  # its forward runs on a timer, as a device's kernels run, while the worker's thread goes on

    def __init__(self, config: WorkerConfig, tokenizer: Tokenizer, step_ms: float):
        if not step_ms > 0:
            raise ValueError(f"--simulate-step-ms must be > 0, got {step_ms}")
        self.cache_spec: KVCacheSpec = config.cache_spec()
        # the footprint a real worker with a host pool reports, so that the scheduler offloads to this one alike
        self.offload_blocks = 0 if config.mode == "dense" else config.offload.geometry(config.block_size).device_blocks
        self.step_s = step_ms / 1e3
        self.words = word_tokens(tokenizer)

    def release_all(self, host_owners: Sequence[str] = ()) -> None:
        """Nothing to free: no request state is kept here."""

    def detach_host(self) -> None:
        """No host pool is mapped."""

    def idle(self) -> None:
        """No demotions to name."""

    def close(self) -> None:
        """Nothing to unmap: no cache, no host pool."""

    def launch(self, plan: StepPlan) -> PendingOutcome:
        """The step's accounting, then a forward that ends step_ms after it began, on its own clock
        as a device's does: the worker's thread is free meanwhile and the returned call waits for
        the end. A step whose chunks all failed, or that only releases, runs no forward, as on a
        real worker."""
        started = time.perf_counter()
        failed = {c.seq_id: why for c in plan.chunks if (why := self.refusal(c)) is not None}
        runs = [c for c in plan.chunks if c.seq_id not in failed]
        if not runs:
            return PendingOutcome(lambda: StepOutcome([], failed))
        tokens = [SampledToken(c.seq_id, simulated_token(self.words, c.sampling)) for c in runs if c.sampling is not None]

        ends_at = started + self.step_s

        def wait() -> StepOutcome:
            time.sleep(max(0.0, ends_at - time.perf_counter()))
            return StepOutcome(tokens, failed, RecallStats(), self.step_s)

        return PendingOutcome(wait, ends_at)

    def refusal(self, chunk: Chunk) -> str | None:
        """Why a real worker could not run the chunk with its block table, or None."""
        table, pool = chunk.block_table, self.cache_spec.num_blocks
        if table and not (min(table) >= 0 and max(table) < pool):  # C-speed scans: no Python loop over 2k blocks per row
            return f"block table names a block outside the device KV pool of {pool} blocks"
        if chunk.offloaded:
            if not self.offload_blocks:
                return "this worker has no host KV pool to offload to"
            if len(table) != self.offload_blocks:
                return f"an offloaded request holds {self.offload_blocks} device blocks, its block table has {len(table)}"
            return None
        held = len(table) * self.cache_spec.block_size
        if held < chunk.end_pos:
            return f"block table of {len(table)} blocks holds {held} tokens, the chunk ends at position {chunk.end_pos}"
        return None
