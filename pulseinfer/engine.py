"""In-process engine: the scheduler's batcher driving a local model runner.

The same receive -> schedule -> forward -> finish loop the services run across processes,
without the sockets; used by `pulseinfer generate`, the evals and the tests.
"""

from __future__ import annotations

import functools
import time
import uuid
from dataclasses import dataclass, field

import torch

from pulseinfer.common.grammar import GrammarTokenizer, structured_grammar
from pulseinfer.common.model.tokenizer import TextStream
from pulseinfer.gpu_worker.config import WorkerConfig
from pulseinfer.gpu_worker.faults import FaultPlan
from pulseinfer.gpu_worker.model.loader import LoadedModel, load_model
from pulseinfer.gpu_worker.offload.config import HostTier
from pulseinfer.gpu_worker.runner import ModelRunner, Pick
from pulseinfer.gpu_worker.sparse import check_mode
from pulseinfer.kv_store.allocator import BlockAllocator
from pulseinfer.kv_store.prefix_cache import HostBlocks
from pulseinfer.kv_store.view import PoolView
from pulseinfer.messages.plan import Chunk, Logprobs, StepPlan
from pulseinfer.messages.sampling import FinishReason, SamplingParams
from pulseinfer.scheduler.batcher import Batcher, BatcherConfig, ModelLimits
from pulseinfer.scheduler.request import Sequence


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # GGUF file, HF directory or a model name; default: SmolLM2-135M-Instruct
    load_format: str = "auto"  # auto | dummy: seeded random weights of the model's geometry
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    batcher: BatcherConfig = field(default_factory=BatcherConfig)
    host_kv_tokens: int = 131072  # the in-process host pool (private memory, faulted in as used)
    # a dense engine makes that pool only when asked, for the KV hierarchy (batcher.host_prefix_cache):
    # a cluster's dense workers always have the kv_store's, but a dense baseline in process must not
    # pay for (or pin) a host pool it would not otherwise touch
    dense_host_tier: bool = False


@dataclass
class Completion:
    seq_id: str
    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str
    offloaded: bool = False  # its KV lived mostly in the host pool when it finished
    error: str = ""
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    prompt_logprobs: list[float] | None = None  # with SamplingParams.prompt_logprobs: of prompt tokens 1..

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    def to_json(self) -> dict:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "finish_reason": self.finish_reason,
            "offloaded": self.offloaded,
            "cached_tokens": self.cached_tokens,
            **({"error": self.error} if self.error else {}),
        }


class Engine:
    def __init__(
        self, config: EngineConfig, loaded: LoadedModel | None = None, host: HostTier | None = None, faults: FaultPlan | None = None
    ):
        """`host`: where offloaded requests' KV goes; default: a pool in this process, recalled by
        the worker's own I/O thread (bench.layer_ahead passes a kv_store process's pool and engine);
        `faults`: the tests' injected faults."""
        started = time.perf_counter()
        self.config = config
        self.loaded = loaded or load_model(config.model, config.load_format)
        self.tokenizer = self.loaded.tokenizer
        check_mode(config.worker.mode, config.batcher.offload)
        offloading = config.batcher.offload != "never" and config.worker.mode != "dense"
        b = config.batcher
        hierarchy = b.prefix_cache == b.host_prefix_cache == "on" and not self.loaded.config.sliding_layers
        hierarchy = hierarchy and (offloading or config.dense_host_tier)
        self._own_pool: PoolView | None = None  # the host pool this engine made: close() lets go of it
        self.host = (host or self._host_tier()) if offloading or hierarchy else None
        try:
            self.runner = ModelRunner(self.loaded, config.worker.with_prefix_cache(b.prefix_cache), self.host, offloading, faults)
        except BaseException:
            if self._own_pool is not None:
                self._own_pool.close()
            raise
        spec = self.runner.cache_spec
        self.allocator = BlockAllocator(spec.num_blocks)
        r = self.runner
        limits = ModelLimits(
            self.loaded.config.max_position,
            self.tokenizer.eos_id,
            spec.block_size,
            r.offload_blocks,
            r.max_running,
            r.host_tier,
            r.window_history,
        )
        self.batcher = Batcher(config.batcher, limits, self.allocator, self.host.allocator if self.host is not None else None)
        self._streams: dict[str, TextStream] = {}
        self._seqs: dict[str, Sequence] = {}
        self._errors: dict[str, str] = {}
        self._prompt_logprobs: dict[str, list[Logprobs]] = {}  # of requests that score their prompt, as scored
        self.last_plan: StepPlan | None = None  # what the last step ran (the benchmarks time steps by it)
        self.load_seconds = time.perf_counter() - started

    def _host_tier(self) -> HostTier:
        c, block = self.loaded.config, self.config.worker.block_size
        blocks = self.config.host_kv_tokens // block
        view = self._own_pool = PoolView.private(blocks, c.kv_layers, c.num_kv_heads, block, c.head_dim, self.config.worker.torch_dtype())
        if self.config.worker.device == "cuda":
            view.pin()
        return HostTier(view, HostBlocks(blocks))

    def close(self) -> None:
        """Stops the worker's I/O thread and lets go of the host pool this engine made: unpinned, then
        unmapped. An Engine on CUDA must be closed (or used as a context manager): the next one in
        this process may map its pool at the same address, where a registration left behind would be stale.
        A host tier passed in stays its owner's."""
        self.runner.close()
        pool, self._own_pool = self._own_pool, None
        if pool is not None:
            if self.runner.device.type == "cuda":  # no kernel may still read or write the pool
                torch.cuda.synchronize(self.runner.device)
            pool.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @functools.cached_property
    def grammars(self) -> GrammarTokenizer:
        """What structured outputs are followed with: built at the first one (a second for a 50k vocabulary)."""
        eos = self.tokenizer.eos_id
        return GrammarTokenizer(self.tokenizer, self.loaded.config.vocab_size, [eos] if eos is not None else [])

    def submit(self, prompt_ids: list[int], params: SamplingParams, seq_id: str | None = None) -> str:
        seq_id = seq_id or uuid.uuid4().hex
        seq = Sequence.admit(seq_id, prompt_ids, params, self.loaded.config.vocab_size)
        if params.structured is not None:
            seq.grammar = self.grammars.matcher(structured_grammar(*params.structured))
        self.batcher.add(seq)
        self._seqs[seq_id] = seq
        self._streams[seq_id] = TextStream(
            self.tokenizer, params.stop, prompt_ids, params.min_tokens, params.skip_special_tokens, params.include_stop_str_in_output
        )
        if params.prompt_logprobs is not None:
            self._prompt_logprobs[seq_id] = []
        return seq_id

    def step(self, pick: Pick | None = None) -> list[Completion]:
        """One batched forward; returns the requests that finished in it."""
        plan = self.last_plan = self.batcher.schedule()
        if plan is None:
            return []
        outcome = self.runner.execute(plan, pick)
        self.batcher.observe(plan, outcome.recall, outcome.compute_s)
        finished = self.batcher.commit(plan, outcome.tokens)
        self._take_prompt_logprobs(plan, outcome.prompt_logprobs)
        for seq_id, error in outcome.failed.items():
            if (seq := self.batcher.abort(seq_id, FinishReason.ERROR)) is not None:
                self._errors[seq_id] = error
                finished.append(seq)
        for chunk in plan.chunks:
            seq = self._seqs.get(chunk.seq_id)
            if chunk.sampling is not None and seq is not None and seq not in finished:
                stream = self._streams[seq.seq_id]
                stream.update(seq.output_ids)
                if stream.stopped:
                    finished.append(self.batcher.abort(seq.seq_id, FinishReason.STOP))
        return [self._complete(seq) for seq in finished]

    def _take_prompt_logprobs(self, plan: StepPlan, scored: dict[str, Logprobs]) -> None:
        for chunk in plan.chunks:
            if chunk.seq_id in scored and (seq := self._seqs.get(chunk.seq_id)) is not None:
                self._prompt_logprobs[chunk.seq_id].append(seq.take_prompt_logprobs(chunk.start_pos, scored[chunk.seq_id]))

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Completion]:
        all_params = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.submit(p, sp) for p, sp in zip(prompts, all_params)]
        done: dict[str, Completion] = {}
        while len(done) < len(ids) or self.batcher.released:  # the last step frees what finished offloaded
            for completion in self.step():
                done[completion.seq_id] = completion
        return [done[i] for i in ids]

    def score(self, texts: list[list[int]], tail: int) -> list[list[float]]:
        """Log-probability of each of the last `tail` tokens of each text, every one predicted by a
        decode step (teacher forcing: the text's own next token is fed back, not a sampled one)."""
        targets: dict[str, list[int]] = {}
        logprobs: dict[str, list[float]] = {}
        params = SamplingParams(max_tokens=tail + 1, ignore_eos=True)
        for ids in texts:
            if len(ids) <= tail + 1:
                raise ValueError(f"a text of {len(ids)} tokens has no context before its last {tail} tokens")
            seq_id = self.submit(ids[: -tail - 1], params)
            targets[seq_id], logprobs[seq_id] = ids[-tail - 1 :], []

        def force(logits: torch.Tensor, chunks: list[Chunk]) -> list[int]:
            tokens = []
            for row, chunk in zip(logits, chunks):
                done = len(self._seqs[chunk.seq_id].output_ids)
                token = targets[chunk.seq_id][done]
                if done:  # the first target is predicted by the prefill, not by a decode step
                    logprobs[chunk.seq_id].append(torch.log_softmax(row, dim=-1)[token].item())
                tokens.append(token)
            return tokens

        pending = set(targets)
        while pending or self.batcher.released:
            for completion in self.step(force):
                if completion.error:
                    raise RuntimeError(f"scoring failed: {completion.error}")
                pending.discard(completion.seq_id)
        return [logprobs[seq_id] for seq_id in targets]

    def selection_stats(self) -> dict:
        """What the offloaded requests' selections kept and moved (dense: everything, nothing)."""
        if self.runner.offload is None:
            return {"attention_mass": 1.0, "recall_transfers_per_step": 0.0, "recall_bytes_per_step": 0.0}
        return self.runner.offload.stats()

    def _complete(self, seq: Sequence) -> Completion:
        stream = self._streams.pop(seq.seq_id)
        del self._seqs[seq.seq_id]
        if not stream.stopped:
            stream.update(seq.output_ids)
            stream.flush()
        error = self._errors.pop(seq.seq_id, "")
        scored = self._prompt_logprobs.pop(seq.seq_id, None)
        return Completion(
            seq.seq_id,
            stream.emitted,
            list(seq.output_ids),
            len(seq.prompt_ids),
            seq.finish_reason.value,
            seq.offloaded,
            error,
            seq.cached_tokens or 0,
            None if scored is None else [logprob for part in scored for logprob in part.logprobs],
        )
