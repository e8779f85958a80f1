"""Token selection: greedy, or temperature / min-p / top-k / top-p (vLLM's order) with a per-token
seeded generator, after each row's structured-output mask, its logit_bias, its stop tokens banned before its min_tokens, and
its presence, frequency and repetition penalties (vLLM V1's order). Every step is batched in torch:
a row's parameters are columns of the step's tensors, so no row's parameters reach another's tokens.

Log-probabilities: a sampled token's are of the logits the sampler drew from after logit_bias, the
min_tokens bans, the penalties and temperature (a greedy row's unscaled), before min-p, top-k and top-p; a prompt
token's are of the model's raw logits (no sampling parameter applies to a prompt). vLLM V0's choice,
and the one under which a temperature-0 request's logprobs are the model's log-softmax.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence

import torch

from pulseinfer.common.grammar import allows_any, fill_masks, masked
from pulseinfer.common.syncs import to_device, to_host
from pulseinfer.messages.plan import PENALTIES, Logprobs, SamplingSpec, TokenHistory

_SEED_STRIDE = 1_000_003  # distinct generator seeds per (request seed, token index)
# Below this a temperature is greedy: dividing by it only overflows, and the distribution it
# asks for is already one-hot to float32 precision (vLLM's _SAMPLING_EPS).
_SAMPLING_EPS = 1e-5
# A float64 temperature past float32's range becomes inf in the division, and -inf / inf is NaN;
# at float32's max every finite logit gap already scales to ~0 (uniform), so capping changes nothing.
_MAX_TEMPERATURE = torch.finfo(torch.float32).max
UNSAMPLEABLE = "the model's logits for this token have no finite maximum (NaN or inf), so no token can be chosen"


# prompt rows scored at once: their float32 logits (rows x vocab, 150 MB for Qwen3's) are the working memory
SCORE_ROWS = 256
LogprobColumns = list[torch.Tensor]  # [N] chosen log-probabilities, [N] ranks, [N, top] likeliest values, [N, top] their ids


def sample(logits: torch.Tensor, specs: list[SamplingSpec]) -> list[int | str]:
    """A token per row (sample_with_logprobs without the log-probabilities)."""
    return sample_with_logprobs(logits, specs)[0]


def sample_with_logprobs(
    logits: torch.Tensor, specs: list[SamplingSpec], masks: Callable[[], torch.Tensor] | None = None
) -> tuple[list[int | str], list[Logprobs | None]]:
    """A token per row, or, for a row that cannot be sampled (a broken model row, a grammar it
    cannot follow), an error that fails only that row's request; and the token's log-probabilities
    for the rows that asked. The device is read once: every row's greedy token and finite check, the
    distributions of the rows that sample, and the log-probabilities, in one transfer. `masks`: the
    structured rows' grammar masks, made while the forward ran (GrammarMasks.start); None: made here."""
    if logits.shape[0] != len(specs):
        raise ValueError(f"{logits.shape[0]} logit rows for {len(specs)} sampling specs")
    logits, refused = _constrained(logits, specs, masks)
    logits = _penalized(_biased(logits, specs), specs)
    sampled = [i for i, spec in enumerate(specs) if spec.temperature >= _SAMPLING_EPS]
    reported = [i for i, spec in enumerate(specs) if spec.logprobs]
    argmax = logits.argmax(dim=-1)
    # amax propagates NaN, so this one check catches NaN, all -inf and +inf rows (whose distributions go unused)
    reads = [argmax, torch.isfinite(logits.amax(dim=-1))] + ([_distributions(logits, specs, sampled)] if sampled else [])
    report = _report_reads(logits, argmax, specs, reported, set(sampled)) if reported else []
    greedy, finite, *rest = to_host(reads + report)
    probs, report = (rest[0], rest[1:]) if sampled else (None, rest)
    drawn = _tokens(specs, greedy, finite, {i: probs[j] for j, i in enumerate(sampled)})
    tokens = [refused.get(i, token) for i, token in enumerate(drawn)]
    return tokens, _reported(specs, tokens, reported, set(sampled), report)


def advance_grammars(specs: list[SamplingSpec], tokens: Sequence[int | str]) -> None:
    """Each structured row's matcher past its sampled token: once its step has succeeded (a step
    that fails is run again in parts, and a matcher must not take a token twice)."""
    for spec, token in zip(specs, tokens):
        if spec.grammar is not None and isinstance(token, int):
            spec.grammar.consume(token)


def _tokens(
    specs: list[SamplingSpec], greedy: torch.Tensor, finite: torch.Tensor, distributions: dict[int, torch.Tensor]
) -> list[int | str]:
    tokens: list[int | str] = []
    for i, (spec, token, ok) in enumerate(zip(specs, greedy.tolist(), finite.tolist())):
        if not ok:
            tokens.append(UNSAMPLEABLE)
        elif i in distributions:
            generator = torch.Generator(device="cpu").manual_seed((spec.seed * _SEED_STRIDE + spec.step) % (2**63))
            tokens.append(int(torch.multinomial(distributions[i], 1, generator=generator)))
        else:
            tokens.append(token)
    return tokens


def _report_reads(
    logits: torch.Tensor, argmax: torch.Tensor, specs: list[SamplingSpec], reported: list[int], sampled: set[int]
) -> list[torch.Tensor]:
    """What the host reads to report the rows' log-probabilities: the greedy token's columns (a
    sampled row's token is drawn on the host, after the read: its whole row is read instead)."""
    top = max(specs[i].top_logprobs for i in reported)
    temperatures = [min(specs[i].temperature, _MAX_TEMPERATURE) if i in sampled else 1.0 for i in reported]
    rows, scale = to_device([torch.tensor(reported), torch.tensor(temperatures, dtype=torch.float32)], logits.device)
    logprobs = torch.log_softmax(logits[rows].float() / scale[:, None], dim=-1)
    drawn = [j for j, i in enumerate(reported) if i in sampled]
    return _columns(logprobs, argmax[rows], top) + ([logprobs[drawn]] if drawn else [])


def _reported(
    specs: list[SamplingSpec], tokens: list[int | str], reported: list[int], sampled: set[int], reads: list[torch.Tensor]
) -> list[Logprobs | None]:
    """Each reported row's Logprobs of its token (None for the other rows, and an unsampleable one)."""
    out: list[Logprobs | None] = [None] * len(specs)
    if not reported:
        return out
    chosen, ranks, values, ids, *drawn_rows = reads
    drawn = iter(drawn_rows[0] if drawn_rows else ())
    for j, i in enumerate(reported):
        row = next(drawn) if i in sampled else None
        if isinstance(tokens[i], str):
            continue
        logprob, rank = (float(chosen[j]), int(ranks[j])) if row is None else (float(row[tokens[i]]), int((row > row[tokens[i]]).sum()) + 1)
        k = specs[i].top_logprobs
        out[i] = Logprobs([logprob], [rank], k, ids[j, :k].tolist(), values[j, :k].tolist())
    return out


def score(logits_of: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, targets: torch.Tensor, top: int) -> LogprobColumns:
    """Each hidden row's log-probability of its target token under the model's raw logits, its rank
    and its `top` likeliest tokens (on the device, SCORE_ROWS rows at a time)."""
    parts = [
        _columns(torch.log_softmax(logits_of(hidden[i : i + SCORE_ROWS]).float(), dim=-1), targets[i : i + SCORE_ROWS], top)
        for i in range(0, len(hidden), SCORE_ROWS)
    ]
    return [torch.cat(column) for column in zip(*parts)]


def _columns(logprobs: torch.Tensor, targets: torch.Tensor, top: int) -> LogprobColumns:
    chosen = logprobs.gather(1, targets[:, None]).squeeze(1)
    ranks = (logprobs > chosen[:, None]).sum(dim=-1) + 1
    values, ids = logprobs.topk(top, dim=-1)
    return [chosen, ranks, values, ids]


def logprobs_of(columns: LogprobColumns, top: int) -> Logprobs:
    """Columns read to the host as Logprobs."""
    chosen, ranks, values, ids = columns
    return Logprobs(chosen.tolist(), ranks.tolist(), top, ids.flatten().tolist(), values.flatten().tolist())


def _biased(logits: torch.Tensor, specs: list[SamplingSpec]) -> torch.Tensor:
    """The logits with every row's logit_bias added and its stop tokens at -inf while it is short
    of min_tokens: one scatter for the batch, on a copy (the logits as they are when no row asks)."""
    if not any(spec.bias_ids or spec.step < spec.min_tokens for spec in specs):
        return logits
    rows, ids, values = [], [], []
    for row, spec in enumerate(specs):
        banned = spec.stop_ids if spec.step < spec.min_tokens else ()
        for tokens, add in ((spec.bias_ids, spec.bias_values), (banned, (float("-inf"),) * len(banned))):
            rows += [row] * len(tokens)
            ids += tokens
            values += add
    index = to_device([torch.tensor(rows), torch.tensor(ids), torch.tensor(values, dtype=torch.float32)], logits.device)
    return logits.float().index_put((index[0], index[1]), index[2], accumulate=True)


class GrammarMasks:
    """Makes a step's grammar masks on a thread of its own while the forward runs: llguidance and
    torch's kernels release the GIL, so on a CPU as on a GPU the masks cost the step only what
    outlasts its forward. One thread: a matcher is never used by two at once (the sampler advances
    it only once its mask is made)."""

    def __init__(self):
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")  # started at the first mask

    def start(self, specs: list[SamplingSpec], before: Callable[[], None] = lambda: None) -> Callable[[], torch.Tensor] | None:
        """The masks of the structured rows among `specs` (the step's sampled rows, in order), coming;
        `before` runs first on the same thread (the tests' injected faults)."""
        matchers = [spec.grammar for spec in specs if spec.grammar is not None]
        if not matchers:
            return None

        def masks() -> torch.Tensor:
            before()
            return fill_masks(matchers, matchers[0].tokenizer.vocab_size)

        return self._thread.submit(masks).result

    def close(self) -> None:
        self._thread.shutdown()


def _constrained(
    logits: torch.Tensor, specs: list[SamplingSpec], masks: Callable[[], torch.Tensor] | None
) -> tuple[torch.Tensor, dict[int, str]]:
    """The logits with the tokens each structured row's grammar does not allow at -inf (vLLM masks
    them first, before any other processing); and the rows that cannot go on under their grammar,
    with why: such a row fails rather than end (on a stop token) outside its grammar."""
    rows = [i for i, spec in enumerate(specs) if spec.grammar is not None]
    if not rows:
        return logits, {}
    bitmask = masks() if masks is not None else fill_masks([specs[i].grammar for i in rows], specs[rows[0]].grammar.tokenizer.vocab_size)
    stuck = {i: why for j, i in enumerate(rows) if (why := _stuck(specs[i], bitmask[j])) is not None}
    return masked(logits, torch.tensor(rows), bitmask), stuck


def _stuck(spec: SamplingSpec, allowed: torch.Tensor) -> str | None:
    """Why a structured row cannot take a token its grammar allows (its mask `allowed`); None if it can."""
    if (error := spec.grammar.error) is not None:
        return f"its structured output's grammar cannot be followed: {error}"
    if not allows_any(allowed):
        return "its structured output's grammar allows no token here"
    if spec.step < spec.min_tokens and not allows_any(allowed, spec.stop_ids):
        return f"its structured output's grammar ends after {spec.step} tokens, but min_tokens asks for {spec.min_tokens}"
    return None


def _penalized(logits: torch.Tensor, specs: list[SamplingSpec]) -> torch.Tensor:
    """The logits with the penalized rows' penalties applied, as vLLM applies them: the repetition
    penalty to the tokens of the prompt or the output, then frequency x count and presence to those
    of the output. Each history's tokens are kept on the device (TokenHistory.cache) and grow by the
    tokens sampled since the last step, so a step sends only those."""
    rows = [i for i, spec in enumerate(specs) if spec.penalized]
    if not rows:
        return logits
    device, vocab = logits.device, logits.shape[-1]
    penalized = [specs[i] for i in rows]
    values = [torch.tensor([getattr(s, name) for s in penalized], dtype=torch.float32)[:, None] for name in PENALTIES]
    row, presence, frequency, repetition = to_device([torch.tensor(rows)] + values, device)
    prompts, outputs = zip(*(_history_on(spec.history, device) for spec in penalized))
    counts = _scattered(outputs, vocab, device)
    seen = counts > 0
    chosen = logits[row].float()
    if any(spec.repetition_penalty != 1 for spec in penalized):
        repeated = seen | (_scattered(prompts, vocab, device) > 0)
        chosen = torch.where(repeated, torch.where(chosen > 0, chosen / repetition, chosen * repetition), chosen)
    chosen = chosen - frequency * counts - presence * seen
    return logits.float().index_copy(0, row, chosen)


def _history_on(history: TokenHistory, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A history's prompt and output tokens on the device, the outputs brought up to date."""
    prompt, outputs = history.cache.get(device) or (to_device([torch.tensor(history.prompt, dtype=torch.long)], device)[0], None)
    synced = 0 if outputs is None else len(outputs)
    if outputs is None or synced < len(history.outputs):
        new = to_device([torch.tensor(history.outputs[synced:], dtype=torch.long)], device)[0]
        outputs = new if outputs is None else torch.cat([outputs, new])
        history.cache[device] = (prompt, outputs)
    return prompt, outputs


def _scattered(ids: tuple[torch.Tensor, ...], vocab: int, device: torch.device) -> torch.Tensor:
    """[rows, vocab] counts of each row's token ids, in one scatter."""
    lengths = [len(t) for t in ids]
    repeats = to_device([torch.tensor(lengths)], device)[0]
    row = torch.repeat_interleave(torch.arange(len(ids), device=device), repeats, output_size=sum(lengths))
    counts = torch.zeros(len(ids), vocab, device=device)
    return counts.index_put_((row, torch.cat(ids)), torch.ones(sum(lengths), device=device), accumulate=True)


def _distributions(logits: torch.Tensor, specs: list[SamplingSpec], sampled: list[int]) -> torch.Tensor:
    """The distributions the sampled rows draw from, [rows, vocab] on the logits' device. With a finite
    maximum a scaled row has a 0 at the top and <= 0 (or -inf) elsewhere: its softmax is a valid
    distribution for any temperature. A row whose top_k or top_p asks for nothing is left whole."""
    chosen = [specs[i] for i in sampled]
    vocab = logits.shape[-1]
    top_k = [s.top_k if 0 < s.top_k < vocab else vocab for s in chosen]  # vocab: keeps every token
    floats = [[min(s.temperature, _MAX_TEMPERATURE) for s in chosen], [s.min_p for s in chosen], [s.top_p for s in chosen]]
    columns = [torch.tensor(sampled), torch.tensor(top_k)[:, None]] + [torch.tensor(c, dtype=torch.float32)[:, None] for c in floats]
    row, top_k_at, temperature, min_p, top_p = to_device(columns, logits.device)
    rows = logits[row].float()
    scaled = (rows - rows.amax(dim=-1, keepdim=True)) / temperature
    # p / p_max = exp(scaled): keep p >= min_p * p_max (log 0 = -inf: a row without min_p keeps all)
    scaled = scaled.masked_fill(scaled < torch.log(min_p), float("-inf"))
    if min(top_k) < vocab:
        kth = scaled.topk(max(top_k), dim=-1).values.gather(1, top_k_at - 1)
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if any(s.top_p < 1.0 for s in chosen):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p; the top token always stays (top_p may
        # round to 0 in float32), and a row with top_p 1 keeps all (its sum may round past 1 early)
        drop = (sorted_probs.cumsum(-1) - sorted_probs >= top_p) & (top_p < 1.0)
        drop[:, 0] = False
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs.masked_fill(drop, 0.0))
    return probs
