"""Structured outputs' grammars checked off the gateway's event loop and out of its process.

A grammar is untrusted input that llguidance compiles natively: a chain of rules deep enough
overflows its stack (a segfault, which no exception handler survives), and a hostile one may spend
seconds or gigabytes compiling. So the gateway never compiles one itself: a request's constraint is
checked once, whatever its n and its prompts, by one of HELPERS helper processes (spawned: a
threaded process is never forked), each with a memory budget (RLIMIT_AS) and a time budget per
check. A helper that crashes or runs past its budget is killed and replaced, and the request gets a
400; the gateway serves on. docs/hardening.md "Grammars".
"""

from __future__ import annotations

import asyncio
import multiprocessing
import queue
import resource
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import Any, NoReturn

from llguidance import LLTokenizer

from pulseinfer.common.grammar import (
    FORCED_STEPS,
    GRAMMAR_STACK_BYTES,
    GrammarVocab,
    check_grammar,
    grammar_thread,
    structured_grammar,
)
from pulseinfer.messages.sampling import ParamError

HELPERS = 2  # checks at once; more wait for a free helper
CHECK_BUDGET_S = 30.0  # one check's time in its helper (a 500 KB schema: ~2 s on an idle 2-core VM)
MEMORY_BUDGET_BYTES = 1 << 30  # address space a helper may take beyond what it holds once started
START_BUDGET_S = 120.0  # a helper's start: its imports and its tokenizer (seconds for 262k tokens)
# a check's stack: half the worker's, so that a grammar the check compiled, the worker compiles with room to spare
CHECK_STACK_BYTES = GRAMMAR_STACK_BYTES // 2

_llg: LLTokenizer | None = None  # in a helper: the model's tokenizer as llguidance sees it


def check_in_helper(kind: str, text: str, min_tokens: int) -> int | None:
    """(In a helper.) The constraint's limits, grammar and forced start checked (ValueError with the
    reason); the output's length in tokens when that start is all of it, followed as far as min_tokens."""
    return check_grammar(_llg, structured_grammar(kind, text), max(FORCED_STEPS, min_tokens))


class HelperFailed(Exception):
    """A helper crashed or ran past its time budget (it has been replaced)."""


class GrammarChecks:
    def __init__(self, vocab: GrammarVocab, helpers: int = HELPERS, budget_s: float = CHECK_BUDGET_S):
        self.vocab = vocab
        self.budget_s = budget_s
        self._context = multiprocessing.get_context("spawn")
        self._idle: queue.SimpleQueue[_Helper] = queue.SimpleQueue()
        for _ in range(helpers):  # started now: they are ready by the first structured request
            self._idle.put(_Helper(self._context, vocab))
        # one thread per helper: a thread always finds one idle, and waits on it with the loop free
        self._threads = ThreadPoolExecutor(helpers, thread_name_prefix="grammar-checks")

    async def check(self, kind: str, text: str, min_tokens: int) -> None:
        """ParamError naming the field at fault ("structured", or "min_tokens" when the grammar's
        output is shorter than min_tokens) if the request's constraint cannot be followed."""
        try:
            length = await self.run(check_in_helper, kind, text, min_tokens)
        except (ValueError, HelperFailed) as e:
            raise ParamError(f"the structured output is refused: {e}", "structured") from None
        if length is not None and length < min_tokens:
            ends = f"its grammar ends after {length} token{'s' if length != 1 else ''}"
            raise ParamError(f"min_tokens ({min_tokens}) is more than the structured output allows: {ends}", "min_tokens")

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) in a helper (fn: a module-level function, pickled by name): what it returned, or
        ValueError with what it raised; HelperFailed if the helper crashed or ran past the budget."""
        return await asyncio.get_running_loop().run_in_executor(self._threads, self._call, fn, args)

    def _call(self, fn: Callable[..., Any], args: tuple) -> Any:
        helper = self._idle.get()
        try:
            return helper.call(fn, args, self.budget_s)
        except HelperFailed:
            helper.kill()
            helper = _Helper(self._context, self.vocab)
            raise
        finally:
            self._idle.put(helper)

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
        while not self._idle.empty():
            self._idle.get().kill()


class _Helper:
    """A helper process and the gateway's end of its pipe; used by one thread at a time."""

    def __init__(self, context: BaseContext, vocab: GrammarVocab):
        self.conn, theirs = context.Pipe()
        self.process = context.Process(target=_serve, args=(theirs, vocab), name="grammar-helper", daemon=True)
        self.process.start()
        theirs.close()
        self.started = False

    def call(self, fn: Callable[..., Any], args: tuple, budget_s: float) -> Any:
        if not self.started:
            self._receive(START_BUDGET_S, f"did not start in {START_BUDGET_S:g} s")
            self.started = True
        try:
            self.conn.send((fn, args))
        except OSError:  # it died while idle
            self._crashed()
        ok, value = self._receive(budget_s, f"took over {budget_s:g} s")
        if not ok:
            raise ValueError(value)
        return value

    def _receive(self, timeout_s: float, late: str) -> Any:
        try:
            if self.conn.poll(timeout_s):
                return self.conn.recv()
        except (EOFError, OSError):  # its end of the pipe closed
            self._crashed()
        raise HelperFailed(f"its check {late}")

    def _crashed(self) -> NoReturn:
        self.process.join(1.0)
        why = "a grammar too deep for the stack, or over the memory budget"
        raise HelperFailed(f"its check crashed (exit code {self.process.exitcode}): {why}")

    def kill(self) -> None:
        self.process.kill()
        self.process.join()
        self.conn.close()


def _serve(conn: Connection, vocab: GrammarVocab) -> None:
    """A helper's life: its tokenizer and its grammar thread, then its memory budget, then calls
    until the gateway goes."""
    global _llg
    _llg = vocab.llg()
    thread = grammar_thread("grammar-check", CHECK_STACK_BYTES)
    held = int(Path("/proc/self/statm").read_text().split()[0]) * resource.getpagesize()
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    budget = held + MEMORY_BUDGET_BYTES
    resource.setrlimit(resource.RLIMIT_AS, (budget if hard == resource.RLIM_INFINITY else min(budget, hard), hard))
    conn.send("ready")
    while True:
        try:
            fn, args = conn.recv()
            conn.send(_answer(thread, fn, args))
        except (EOFError, OSError):  # the gateway has gone
            return


def _answer(thread: ThreadPoolExecutor, fn: Callable[..., Any], args: tuple) -> tuple[bool, Any]:
    """(True, what fn returned) or (False, what it raised): anything a check raises is its request's
    answer, never the helper's end."""
    try:
        return True, thread.submit(fn, *args).result()
    except MemoryError:
        return False, "it needs more memory than a check may use"
    except Exception as e:
        return False, str(e) or type(e).__name__
