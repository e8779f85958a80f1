"""The Mooncake trace format that `pulseinfer bench serve --trace` replays: JSONL of timestamp (ms),
input_length, output_length and hash_ids, one id per 512-token block of the prompt (equal ids: the
same prefix block). Its rows, a window of them (or the conversations that begin there), the tokens
of a block as a function of its id, and a row's lengths scaled and cut to fit a context."""

from __future__ import annotations

import gzip
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

TRACE_BLOCK = 512  # tokens per hash id in a Mooncake trace
# the conversation trace of Mooncake's FAST'25 release, shipped with the benchmarks (traces/README.md)
CONVERSATION_TRACE = str(Path(__file__).parent / "traces" / "mooncake_conversation_trace.jsonl.gz")


@dataclass(frozen=True)
class TraceRow:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def _trace_row(line: str, where: str) -> TraceRow:
    try:
        row = json.loads(line)
        hash_ids = tuple(row["hash_ids"])
        parsed = TraceRow(float(row["timestamp"]), row["input_length"], row["output_length"], hash_ids)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{where}: not a trace record ({type(e).__name__}: {e})") from e
    ints = (parsed.input_length, parsed.output_length, *hash_ids)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in ints) or parsed.input_length < 1 or parsed.output_length < 1:
        raise ValueError(f"{where}: input_length and output_length must be integers >= 1, hash_ids integers")
    if parsed.timestamp_ms < 0 or len(hash_ids) != math.ceil(parsed.input_length / TRACE_BLOCK):
        raise ValueError(f"{where}: needs a timestamp >= 0 and one hash id per {TRACE_BLOCK} tokens of input_length")
    return parsed


def load_trace(
    path: str,
    *,
    start_s: float = 0.0,
    duration_s: float | None = None,
    conversation_count: int | None = None,
    max_requests: int | None = None,
) -> list[TraceRow]:
    """The requests of a window of the trace, in arrival order: those arriving in [start_s,
    start_s + duration_s) s of trace time (to its end without a duration), or every request of the
    first `conversation_count` conversations beginning there; then the first `max_requests`."""
    try:
        raw = Path(path).read_bytes()
        lines = (gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw).decode().splitlines()
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read --trace {path}: {getattr(e, 'strerror', None) or e}") from e
    rows = [_trace_row(line, f"{path}:{n}") for n, line in enumerate(lines, 1) if line.strip()]
    rows.sort(key=lambda r: r.timestamp_ms)
    end_s = math.inf if duration_s is None else start_s + duration_s
    window = [r for r in rows if start_s <= r.timestamp_ms / 1e3 < end_s]
    if conversation_count is not None:
        window = conversations(rows, window, conversation_count)
    if not window:
        raise ValueError(f"no request of {path} arrives in the window [{start_s}, {end_s}) s")
    return window[:max_requests]


def conversations(rows: list[TraceRow], window: list[TraceRow], count: int) -> list[TraceRow]:
    """Every request (of `rows`, in arrival order) of the first `count` conversations with more than
    one request whose first request is in `window`; a conversation: the requests whose prompts begin
    with the same two trace blocks."""
    turns: dict[tuple[int, ...], list[TraceRow]] = {}
    for row in rows:
        turns.setdefault(row.hash_ids[:2], []).append(row)
    starts = {id(row) for row in window}
    chosen = [root for root, its in turns.items() if len(its) > 1 and len(root) == 2 and id(its[0]) in starts]
    chosen.sort(key=lambda root: turns[root][0].timestamp_ms)
    return sorted((row for root in chosen[:count] for row in turns[root]), key=lambda r: r.timestamp_ms)


@dataclass(frozen=True)
class BlockSource:
    """The tokens of a trace block as a function of its hash id: prose cut from the corpus at an
    offset seeded by the id, its first two tokens replaced by the id written in base len(alphabet),
    since prose offsets alone collide (the trace has more ids than the corpus has offsets)."""

    corpus: list[int]
    alphabet: list[int]  # the corpus's own tokens, so that no special token appears
    size: int
    seed: int

    @classmethod
    def of(cls, corpus: list[int], size: int, seed: int) -> BlockSource:
        if size > len(corpus):
            raise ValueError(f"a block of {size} tokens is longer than the prompt corpus ({len(corpus)} tokens): lower --length-scale")
        return cls(corpus, sorted(set(corpus)), size, seed)

    def block(self, hash_id: int) -> list[int]:
        start = random.Random(f"{self.seed}:{hash_id}").randrange(len(self.corpus) - self.size + 1)
        n = len(self.alphabet)
        tag = [self.alphabet[hash_id % n], self.alphabet[hash_id // n % n]]
        return (tag + self.corpus[start + 2 : start + self.size])[: self.size]


def scaled_lengths(row: TraceRow, scale: float, block: int, max_context: int) -> tuple[int, int, bool]:
    """(prompt, output) tokens after scaling, cut to fit the context, and whether they were cut.
    Full blocks scale to `block` tokens, the partial last one by `scale`; output >= 2 for TPOT."""
    last = row.input_length - TRACE_BLOCK * (len(row.hash_ids) - 1)
    prompt = block * (len(row.hash_ids) - 1) + max(1, round(last * scale))
    output = max(2, round(row.output_length * scale))
    fitted_output = min(output, max_context - 1)
    fitted_prompt = min(prompt, max_context - fitted_output)
    return fitted_prompt, fitted_output, (fitted_prompt, fitted_output) != (prompt, output)


def trace_block_size(length_scale: float) -> int:
    return max(1, round(TRACE_BLOCK * length_scale))
