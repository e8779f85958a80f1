"""What the scheduler asks a worker to compute in one step."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pulseinfer.common.grammar import GrammarMatcher

# SamplingSpec, Chunk and SampledToken, built per request per step, are slotted and not frozen: a
# frozen dataclass's __init__ costs 1.2 us against 0.2, at batch 256 a quarter millisecond of every
# step on each side of the wire (docs/architecture.md). Nothing mutates them once made.


@dataclass(slots=True)
class SamplingSpec:
    """The per-step slice of SamplingParams a worker needs to pick one token."""

    temperature: float
    top_p: float
    top_k: int
    seed: int
    step: int  # index of the token being sampled; with seed, makes sampling stateless and reproducible
    min_p: float = 0.0  # tokens less likely than min_p times the likeliest are dropped (after temperature)
    min_tokens: int = 0  # while step < min_tokens, stop_ids cannot be sampled
    stop_ids: tuple[int, ...] = ()  # the tokens that end the request (eos unless ignored, stop_token_ids); only with min_tokens
    bias_ids: tuple[int, ...] = ()  # logit_bias: added to these tokens' logits before anything else
    bias_values: tuple[float, ...] = ()
    logprobs: bool = False  # report the sampled token's log-probability
    top_logprobs: int = 0  # with this many of the likeliest tokens'
    # vLLM's penalties: the generated tokens' logits less presence + frequency x count; a token of
    # the prompt or the output has its logit divided by repetition_penalty (multiplied, when negative)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    history: TokenHistory | None = None  # only with a penalty or a structured output
    structured: tuple[str, str] | None = None  # SamplingParams.structured: (kind, value)
    grammar: GrammarMatcher | None = None  # the worker's matcher of it, which the sampler advances

    def next(self) -> SamplingSpec:
        """The spec of the token after this one."""
        return SamplingSpec(
            self.temperature, self.top_p, self.top_k, self.seed, self.step + 1,
            self.min_p, self.min_tokens, self.stop_ids, self.bias_ids, self.bias_values, self.logprobs, self.top_logprobs,
            self.presence_penalty, self.frequency_penalty, self.repetition_penalty, self.history, self.structured, self.grammar,
        )  # fmt: skip

    @property
    def penalized(self) -> bool:
        return penalizes(self)


# SamplingParams' and SamplingSpec's penalties, with the values that turn them off
PENALTIES = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}


def penalizes(sampling: object) -> bool:
    """Whether SamplingParams or a SamplingSpec has a penalty on."""
    return any(getattr(sampling, name) != off for name, off in PENALTIES.items())


@dataclass(eq=False, slots=True)
class TokenHistory:
    """The tokens a request's penalties look at and its grammar is advanced past when it is re-admitted,
    shared by its specs: the prompt's (for the repetition penalty; empty without it) and the generated
    ones, which its owner appends as they are sampled. `cache`: the sampler's device copies of them,
    kept here so they die with the request."""

    prompt: tuple[int, ...]
    outputs: array[int]
    cache: dict = field(default_factory=dict)


@dataclass(slots=True)
class Logprobs:
    """Log-probabilities of consecutive tokens, column-wise (generate.proto Logprobs): token i's `top`
    likeliest alternatives are top_ids[i*top : (i+1)*top], likeliest first."""

    logprobs: list[float]
    ranks: list[int]  # 1 + the tokens strictly likelier
    top: int
    top_ids: list[int]
    top_logprobs: list[float]

    def __len__(self) -> int:
        return len(self.logprobs)

    @staticmethod
    def concat(parts: list[Logprobs]) -> Logprobs | None:
        """The parts' tokens one after another (None for no parts); they share a top."""
        if not parts:
            return None
        return Logprobs(
            [x for p in parts for x in p.logprobs], [x for p in parts for x in p.ranks], parts[0].top,
            [x for p in parts for x in p.top_ids], [x for p in parts for x in p.top_logprobs],
        )  # fmt: skip

    def rows(self) -> list[tuple[float, int, list[tuple[int, float]]]]:
        """Per token: its logprob, its rank and its top alternatives as (id, logprob)."""
        k = self.top
        ids, values = self.top_ids, self.top_logprobs
        return [
            (lp, rank, list(zip(ids[i * k : i * k + k], values[i * k : i * k + k])))
            for i, (lp, rank) in enumerate(zip(self.logprobs, self.ranks))
        ]

    def slice(self, start: int, end: int) -> Logprobs:
        """Tokens start..end-1."""
        k = self.top
        return Logprobs(
            self.logprobs[start:end], self.ranks[start:end], k, self.top_ids[start * k : end * k], self.top_logprobs[start * k : end * k]
        )


PENDING_TOKEN = -1  # a decode chunk's input planned a step ahead: the token its worker samples in the step before


@dataclass(slots=True)
class Chunk:
    """Tokens of one sequence to run through the model at positions start_pos.."""

    seq_id: str
    token_ids: tuple[int, ...]
    start_pos: int
    block_table: tuple[int, ...]
    sampling: SamplingSpec | None  # None: a prefill chunk that does not reach the end of the prompt
    offloaded: bool = False  # block_table is the fixed device footprint; the worker keeps the rest on host
    host_prefix: tuple[int, ...] = ()  # offloaded, its first chunk: the cached host blocks it starts from
    # how the scheduler sends it (pulseinfer/messages/wire.py): the admission's handle; a decode chunk's input is
    # the token its worker sampled last (PENDING_TOKEN while unknown); its worker has block_table[:known_blocks]
    handle: int = -1
    fed_back: bool = False
    known_blocks: int = 0
    # its request scores its prompt: each row's logits against the token after it (the chunk's next,
    # then score_next: -1 for the chunk that samples), with prompt_top alternatives; -1: not scored
    prompt_top: int = -1
    score_next: int = -1

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True)
class Admission:
    """What a worker keeps of a request it starts running (worker.proto Admission)."""

    handle: int
    seq_id: str
    start_pos: int  # tokens whose KV it starts with (a cached prefix)
    length: int  # tokens it has at admission: its prefill ends here and samples
    sampling: SamplingSpec  # step: the index of the first token it samples
    offloaded: bool
    host_prefix: tuple[int, ...]
    stop_token_ids: tuple[int, ...]  # with the model's eos unless ignore_eos: a token that ends it
    ignore_eos: bool
    prompt_top: int = -1  # it scores its prompt with this many alternatives per token; -1: it does not


@dataclass(frozen=True)
class BlockNames:
    """Prefix-cache names of an offloaded request's full blocks first, first + 1, ..., for its worker
    to give the host tier once the blocks are written."""

    seq_id: str
    handle: int
    first: int
    names: tuple[bytes, ...]


@dataclass(frozen=True)
class StepPlan:
    step_id: int
    chunks: tuple[Chunk, ...]
    released: tuple[str, ...] = ()  # requests that ended (offloaded, or on a sliding-window model): the worker frees their state first
    names: tuple[BlockNames, ...] = ()
    # how the scheduler sends it: the admissions that ended since the last plan, and the ones that start
    released_handles: tuple[int, ...] = ()
    admitted: tuple[Admission, ...] = ()
    # cached device blocks evicted for this step, with their names: the worker writes them to the
    # host tier (the KV hierarchy) before the step writes anything
    demote: tuple[tuple[int, bytes], ...] = ()

    @property
    def decode_chunks(self) -> list[Chunk]:
        """The chunks that decode one token (the rest prefill)."""
        return [c for c in self.chunks if c.sampling is not None and len(c.token_ids) == 1]

    @property
    def steady(self) -> bool:
        """Only decode rows of running requests: no admission, no prefill chunk."""
        return not self.admitted and all(c.fed_back for c in self.chunks)


@dataclass(slots=True)
class SampledToken:
    seq_id: str
    token_id: int
    logprobs: Logprobs | None = None  # of this one token, when its request asked


@dataclass(frozen=True)
class RecallStats:
    """What offloaded requests recalled from the host pool: one step's, or summed (worker.proto
    RecallStats, field for field)."""

    units: int = 0  # (block, layer) units; (block, layer, head) in headwise mode
    transfers: int = 0  # contiguous host ranges read
    bytes: int = 0
    wait_s: float = 0.0  # compute blocked on recalls
    prefetched_units: int = 0  # recalled ahead of their layer from a predicted query
    corrected_units: int = 0  # recalled at their layer: the prediction missed them
    io_busy_s: float = 0.0  # time the copies took, wherever they ran: the link's bandwidth is bytes / io_busy_s
    truncated_units: int = 0  # selected but left out of attention: their recall missed the layer's deadline
    suspended_rows: int = 0  # (decode row, layer) pairs suspended for their recalls while the other rows attended
    resumed_layers: int = 0  # layers run apart by rows resuming after a suspension (layer cursors): weights read again

    def __add__(self, other: RecallStats) -> RecallStats:
        return RecallStats(*(getattr(self, name) + getattr(other, name) for name in RECALL_FIELDS))

    def __sub__(self, other: RecallStats) -> RecallStats:
        return RecallStats(*(getattr(self, name) - getattr(other, name) for name in RECALL_FIELDS))


RECALL_FIELDS = tuple(f.name for f in fields(RecallStats))


@dataclass(frozen=True)
class StepOutcome:
    tokens: list[SampledToken]
    failed: dict[str, str]  # seq_id -> why the worker dropped it from the step (the others ran)
    recall: RecallStats = RecallStats()  # what the step's offloaded requests recalled
    compute_s: float = 0.0  # the forward's time, less what it waited on recalls
    tier_copy_s: float = 0.0  # before the forward: demotions and promotions of the KV hierarchy
    prompt_logprobs: dict[str, Logprobs] = field(default_factory=dict)  # seq_id -> its prompt tokens the step's chunk scored
    isolated_failures: int = 0  # requests that failed alone when the step was run again in parts
