"""A worker's device memory, term by term, from the model's geometry and the worker's flags alone (no
weights, no device): the weights, the device KV pool and the offloaded rows' hot buffers in it, the
block summaries of their host blocks, the sliding-window rings, the lowrank scorer's bases and an
estimate of one step's activations. `pulseinfer plan` prints it; a worker refuses to start on a
device it does not fit (ModelRunner)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pulseinfer.common.model.config import ModelConfig
from pulseinfer.gpu_worker.config import WorkerConfig, parse_bytes
from pulseinfer.gpu_worker.offload.config import OffloadConfig, OffloadGeometry
from pulseinfer.gpu_worker.sparse import BLOCKS, LowRankScorer, QuestScorer, Scorer
from pulseinfer.messages.limits import PREFILL_CHUNK


@dataclass(frozen=True)
class PlanConfig:
    """`pulseinfer plan`: the rows a worker holds at once, and the pool that holds them."""

    model: str | None = None
    load_format: str = "auto"
    batch: int = 64  # rows decoded together
    context: int = 32768  # tokens of each row
    prefill_chunk: int = PREFILL_CHUNK  # prefill tokens in the same step (activations)
    device_kv_tokens: int = 0  # the worker's device KV pool; 0: the pool the batch needs

    def __post_init__(self) -> None:
        if self.batch < 1 or self.context < 1 or self.prefill_chunk < 0 or self.device_kv_tokens < 0:
            raise ValueError("--batch and --context must be >= 1, --prefill-chunk and --device-kv-tokens >= 0")


@dataclass(frozen=True)
class Workload:
    batch: int  # rows held at once
    context: int  # tokens of each row
    prefill_chunk: int  # prefill tokens beside the decode rows in one step


@dataclass(frozen=True)
class Term:
    name: str
    nbytes: int
    what: str  # what is counted


@dataclass(frozen=True)
class MemoryPlan:
    terms: tuple[Term, ...]
    device_memory: int
    pool_tokens: int  # the device KV pool (--device-kv-tokens)
    rows_held: int  # rows of the batch the pool holds
    workload: Workload

    @property
    def total(self) -> int:
        return sum(t.nbytes for t in self.terms)

    @property
    def fits(self) -> bool:
        return self.total <= self.device_memory and self.rows_held >= self.workload.batch

    def overflow(self) -> str | None:
        """Why the plan does not fit, naming its term; None when it fits. The terms are placed in
        order, so the one named is the first that finds too little left."""
        if self.rows_held < self.workload.batch:
            return (
                f"device KV pool: {self.pool_tokens} tokens (--device-kv-tokens) hold {self.rows_held} of the "
                f"{self.workload.batch} rows of {self.workload.context} tokens"
            )
        placed = 0
        for term in self.terms:
            if placed + term.nbytes > self.device_memory:
                left = max(0, self.device_memory - placed)
                return (
                    f"{term.name}: {_gb(term.nbytes)} with {_gb(left)} left of {_gb(self.device_memory)}; "
                    f"the plan needs {_gb(self.total)}, over by {_gb(self.total - self.device_memory)} "
                    f"(largest term: {max(self.terms, key=lambda t: t.nbytes).name})"
                )
            placed += term.nbytes
        return None

    def check(self) -> None:
        if (why := self.overflow()) is not None:
            raise ValueError(f"the worker's device memory plan does not fit: {why}")

    def table(self) -> str:
        w = self.workload
        rows = [(t.name, f"{t.nbytes:,}", _gb(t.nbytes), t.what) for t in self.terms]
        rows += [("total", f"{self.total:,}", _gb(self.total), f"batch {w.batch} x {w.context} tokens, pool {self.pool_tokens} tokens")]
        rows += [("device memory", f"{self.device_memory:,}", _gb(self.device_memory), "")]
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = [f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]}".rstrip() for r in rows]
        spare = self.device_memory - self.total
        verdict = f"fits, {_gb(spare)} spare" if self.fits else f"does not fit: {self.overflow()}"
        return "\n".join([*lines, verdict])


def _gb(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB"


def weight_params(c: ModelConfig) -> int:
    """Parameters of the embeddings, the lm_head when untied, every layer and the final norm."""
    attention = c.hidden_size * (c.q_size + 2 * c.kv_size) + c.q_size * c.hidden_size
    attention += (c.q_size + 2 * c.kv_size if c.qkv_bias else 0) + (2 * c.head_dim if c.qk_norm else 0)
    norms = (4 if c.gemma else 2) * c.hidden_size
    layer = attention + 3 * c.hidden_size * c.intermediate_size + norms
    embeddings = c.vocab_size * c.hidden_size * (1 if c.tie_embeddings else 2)
    return embeddings + c.num_layers * layer + c.hidden_size


def block_bytes(c: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of one block in the paged cache (its full-attention layers)."""
    return 2 * c.kv_layers * block_size * c.kv_size * dtype.itemsize


def plan_scorer(c: ModelConfig, offload: OffloadConfig) -> Scorer:
    """The scorer the worker would build, its lowrank bases on the meta device (shapes only)."""
    if offload.scorer == "quest":
        return QuestScorer(c.num_kv_heads, c.head_dim)
    return LowRankScorer(torch.empty((c.kv_layers, c.num_kv_heads, c.head_dim, offload.rank(c.head_dim)), device="meta"))


def summary_bytes(c: ModelConfig, offload: OffloadConfig, block_size: int, dtype: torch.dtype) -> int:
    """One host block's summaries in every full-attention layer, stored in the KV cache's dtype."""
    shapes = plan_scorer(c, offload).shapes(block_size)
    return sum(math.prod(d for d in shape if d != BLOCKS) for shape in shapes) * c.kv_layers * dtype.itemsize


def row_blocks(geometry: OffloadGeometry, context: int, offloading: bool) -> tuple[int, bool]:
    """A row's device blocks and whether it is offloaded: one no longer than its footprint stays resident."""
    blocks = -(-context // geometry.block_size)
    offloaded = offloading and blocks > geometry.device_blocks
    return (geometry.device_blocks if offloaded else blocks), offloaded


def activation_bytes(c: ModelConfig, workload: Workload, dtype: torch.dtype) -> int:
    """An estimate of one mixed step's peak: its tokens (the decode rows and a prefill chunk) through
    one layer at a time, each holding the residual and its norm, q/k/v, the attention output and
    the MLP's gate, up and their product; then the sampled rows' logits, in the dtype and in fp32.
    Attention keeps no scores (the kernels stream the context); allocator slack is not counted."""
    tokens = workload.batch + workload.prefill_chunk
    per_token = 2 * c.hidden_size + 2 * c.q_size + 2 * c.kv_size + 3 * c.intermediate_size
    return tokens * per_token * dtype.itemsize + workload.batch * c.vocab_size * (dtype.itemsize + 4)


def plan_memory(c: ModelConfig, worker: WorkerConfig, workload: Workload, device_memory: int, offloading: bool) -> MemoryPlan:
    """The device memory of a worker running `workload`; `offloading`: its long rows offload (pulse or
    headwise with a host tier), else every row keeps its whole context on the device."""
    dtype, bs = worker.torch_dtype(), worker.block_size
    geometry = worker.offload.geometry(bs)
    per_row, offloaded = row_blocks(geometry, workload.context, offloading)
    pool_blocks = worker.device_kv_tokens // bs or workload.batch * per_row
    block = block_bytes(c, bs, dtype)
    rows = min(workload.batch, pool_blocks // per_row)
    hot = rows * geometry.hot_blocks * block if offloaded else 0
    what = f"{pool_blocks} blocks of {bs} tokens ({c.kv_layers} layers' K and V, {_name(dtype)}); a row holds {per_row}"
    if offloaded:
        what += f": sink {geometry.sink_blocks} + ring {geometry.ring_blocks} here, hot {geometry.hot_blocks} below"
    terms = [
        Term("weights", weight_params(c) * dtype.itemsize, _weights_what(c, dtype)),
        Term("device KV pool", pool_blocks * block - hot, what),
    ]
    if offloaded:
        terms.append(Term("hot buffers", hot, f"{rows} rows x {geometry.hot_blocks} blocks (--budget + --hot-extra), in the pool"))
        terms += _scorer_terms(c, worker.offload, geometry, rows, workload.context, dtype)
    if c.sliding_layers:
        terms.append(Term("sliding-window rings", _window_bytes(c, worker, pool_blocks, dtype), _window_what(c, worker)))
    step = f"a step of {workload.batch} decode rows + a {workload.prefill_chunk}-token prefill chunk"
    terms.append(Term("activations (estimate)", activation_bytes(c, workload, dtype), f"{step}; logits {workload.batch} x {c.vocab_size}"))
    return MemoryPlan(tuple(terms), device_memory, pool_blocks * bs, rows, workload)


def _scorer_terms(
    c: ModelConfig, offload: OffloadConfig, geometry: OffloadGeometry, rows: int, context: int, dtype: torch.dtype
) -> list[Term]:
    """The summaries of every offloaded row's host blocks (each whole block past the sink, the
    window's included: gpu_worker/offload/manager.py), and the lowrank scorer's bases."""
    host_blocks = max(0, context // geometry.block_size - geometry.sink_blocks)
    per_block = summary_bytes(c, offload, geometry.block_size, dtype)
    where = f"{offload.scorer} over {c.kv_layers} layers, {_name(dtype)}"
    what = f"{rows} rows x {host_blocks} host blocks x {per_block:,} B ({where})"
    terms = [Term("block summaries", rows * host_blocks * per_block, what)]
    if offload.scorer == "lowrank":
        rank = offload.rank(c.head_dim)
        terms.append(Term("lowrank bases", c.kv_layers * c.kv_size * rank * 4, f"rank {rank} per layer and kv head, fp32"))
    return terms


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _weights_what(c: ModelConfig, dtype: torch.dtype) -> str:
    head = "tied lm_head" if c.tie_embeddings else "lm_head"
    return f"{weight_params(c) / 1e9:.2f}B parameters in {_name(dtype)}: embeddings, {head}, {c.num_layers} layers, norms"


def _window_bytes(c: ModelConfig, worker: WorkerConfig, pool_blocks: int, dtype: torch.dtype) -> int:
    """gpu_worker/attention/window.py: a ring per running request, and the history of every pool slot when kept."""
    ring_slots = -(-c.sliding_window // worker.block_size) * worker.block_size
    history = pool_blocks * worker.block_size if worker.window_history == "on" else 0
    return 2 * len(c.sliding_layers) * (worker.max_running * ring_slots + history) * c.kv_size * dtype.itemsize


def _window_what(c: ModelConfig, worker: WorkerConfig) -> str:
    history = ", and the pool's history (--window-history on)" if worker.window_history == "on" else ""
    return f"{len(c.sliding_layers)} sliding layers: {worker.max_running} rings (--max-running) of {c.sliding_window} tokens{history}"


def worker_plan(c: ModelConfig, worker: WorkerConfig, device_memory: int, offloading: bool) -> MemoryPlan:
    """The plan of a worker as configured: as many rows of the model's longest context as its
    device pool holds (no more than --max-running on a model with sliding layers, whose rings
    bound the rows), beside a prefill chunk of the scheduler's default size."""
    geometry = worker.offload.geometry(worker.block_size)
    per_row, _ = row_blocks(geometry, c.max_position, offloading)
    rows = worker.device_kv_tokens // worker.block_size // per_row
    if c.sliding_layers:
        rows = min(rows, worker.max_running)
    return plan_memory(c, worker, Workload(rows, c.max_position, PREFILL_CHUNK), device_memory, offloading)


def device_memory(worker: WorkerConfig, device: torch.device) -> int | None:
    """What the plan must fit: --device-memory, else a CUDA device's total memory; None (no check) on the CPU."""
    if worker.device_memory:
        return parse_bytes(worker.device_memory)
    return torch.cuda.mem_get_info(device)[1] if device.type == "cuda" else None
