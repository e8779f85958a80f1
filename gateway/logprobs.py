"""Token log-probabilities as the OpenAI API shows them: the legacy completions object, chat's
content list and vLLM's prompt_logprobs, for a whole choice or chunk by chunk as it streams."""

from __future__ import annotations

from collections.abc import Callable

from pulseinfer.gateway.core import Delta
from pulseinfer.gateway.openai_api import ParsedRequest
from pulseinfer.gateway.openai_responses import ChoiceOutput
from pulseinfer.messages.plan import Logprobs

LOGPROB_FLOOR = -9999.0  # JSON has no -inf: a token the sampler could not pick (banned by min_tokens) reports this, as vLLM's does
TokenRow = tuple[float, int, list[tuple[int, float]]] | None  # Logprobs.rows() of a token; None: it has none (a prompt's first)


class LogprobFormat:
    """Token log-probabilities in the three shapes clients read: the legacy completions object
    (tokens, token_logprobs, top_logprobs, text_offset), chat's content list, and vLLM's prompt_logprobs.
    A top list holds the token's own entry as well as its alternatives (as vLLM's and OpenAI's do)."""

    def __init__(self, token_text: Callable[[int], str]):
        self.text = token_text  # one token's text (special tokens shown)

    def completion(self, ids: list[int], rows: list[TokenRow], offset: int) -> dict:
        """`offset`: where the first token's text starts in the choice's text."""
        texts = [self.text(t) for t in ids]
        offsets = []
        for text in texts:
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": texts,
            "token_logprobs": [None if row is None else _floor(row[0]) for row in rows],
            "top_logprobs": [
                None if row is None else {self.text(t): _floor(lp) for t, lp in [(i, row[0]), *row[2]]} for i, row in zip(ids, rows)
            ],
            "text_offset": offsets,
        }

    def chat(self, ids: list[int], rows: list[TokenRow]) -> dict:
        return {
            "content": [{**self._entry(i, row[0]), "top_logprobs": [self._entry(t, lp) for t, lp in row[2]]} for i, row in zip(ids, rows)]
        }

    def prompt(self, ids: tuple[int, ...], logprobs: Logprobs) -> list:
        """vLLM's prompt_logprobs: None for the first token, then {token id: {logprob, rank, decoded_token}}."""
        out: list = [None]
        for token, (lp, rank, top) in zip(ids[1:], logprobs.rows()):
            entries = {str(t): {"logprob": _floor(v), "rank": r, "decoded_token": self.text(t)} for r, (t, v) in enumerate(top, 1)}
            entries[str(token)] = {"logprob": _floor(lp), "rank": rank, "decoded_token": self.text(token)}
            out.append(entries)
        return out

    def _entry(self, token: int, logprob: float) -> dict:
        text = self.text(token)
        return {"token": text, "logprob": _floor(logprob), "bytes": list(text.encode("utf-8", "replace"))}


def _floor(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def token_rows(logprobs: Logprobs | None, count: int) -> list[TokenRow]:
    return logprobs.rows() if logprobs is not None else [None] * count


NO_LOGPROBS = Logprobs([], [], 0, [], [])  # of no token: a prompt of one token scores none


class ChoiceView:
    """What of a choice's tokens' log-probabilities a request shows, and in which shape."""

    def __init__(self, format: LogprobFormat, chat: bool, parsed: ParsedRequest):
        self.format = format
        self.chat = chat
        self.echo = parsed.echo
        self.token_logprobs = parsed.params.logprobs is not None
        self.prompt_logprobs = parsed.params.prompt_logprobs is not None
        self.reports = self.token_logprobs  # streamed chunks carry logprobs

    def logprobs(self, prompt_ids: tuple[int, ...], out: ChoiceOutput) -> dict | None:
        """A whole choice's logprobs object (None when not asked): an echoing completion's begin with its prompt's."""
        if not self.token_logprobs:
            return None
        rows = token_rows(out.logprobs, len(out.token_ids))
        if self.chat:
            return self.format.chat(out.token_ids, rows)
        if not self.echo:
            return self.format.completion(out.token_ids, rows, 0)
        prompt = [None] + token_rows(out.prompt_logprobs or NO_LOGPROBS, 0)
        return self.format.completion([*prompt_ids, *out.token_ids], prompt + rows, 0)

    def stream(self, prompt_ids: tuple[int, ...]) -> StreamedLogprobs:
        return StreamedLogprobs(self, prompt_ids)


class StreamedLogprobs:
    """One streamed choice's logprobs, chunk by chunk: a completion's text offsets run on across
    chunks, and an echoing one's prompt tokens come first (its first token's logprob null)."""

    def __init__(self, view: ChoiceView, prompt_ids: tuple[int, ...]):
        self.view = view
        self.prompt_ids = prompt_ids
        self.offset = 0
        self.prompt_done = 0  # prompt tokens whose logprobs were streamed

    def echo(self) -> dict | None:
        """The echoed prompt's first token, whose logprob is null (the others follow as they are scored)."""
        if not self.view.token_logprobs:
            return None
        return self._completion(list(self.prompt_ids[:1]), [None])

    def delta(self, event: Delta) -> dict | None:
        if not self.view.token_logprobs:
            return None
        if event.prompt_logprobs is not None:
            if not self.view.echo or self.view.chat:
                return None
            start = 1 + self.prompt_done
            self.prompt_done += len(event.prompt_logprobs)
            return self._completion(list(self.prompt_ids[start : 1 + self.prompt_done]), event.prompt_logprobs.rows())
        if not event.token_ids:
            return None
        rows = token_rows(event.logprobs, len(event.token_ids))
        return self.view.format.chat(event.token_ids, rows) if self.view.chat else self._completion(event.token_ids, rows)

    def _completion(self, ids: list[int], rows: list) -> dict:
        body = self.view.format.completion(ids, rows, self.offset)
        self.offset += sum(len(t) for t in body["tokens"])
        return body
