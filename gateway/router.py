"""Which node a request goes to (docs/deployment.md, several nodes): batching stays inside each node's scheduler, the
gateway only picks the node.

cache_aware is SGLang router's policy: a request goes to the node that holds the longest prefix
of it, unless load is imbalanced (then to the least loaded) or no node holds enough of it (then to
the node whose index is smallest: the most room, so distinct prompts spread). What a node holds
is known from the blocks the gateway sent it, named as kv_store/prefix_cache.py names them, and
corrected by the node's own stored/evicted events when it publishes them (gateway/nodes.py).
least_load and round_robin ignore prefixes."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from pulseinfer.kv_store.prefix_cache import ROOT, chain_hashes

POLICIES = ("cache_aware", "least_load", "round_robin")


@dataclass(frozen=True)
class RouterConfig:
    route: str = "cache_aware"  # cache_aware | least_load | round_robin
    cache_threshold: float = 0.5  # cache_aware: below this share of its blocks held anywhere, a prompt is placed for room
    balance_abs_threshold: int = 32  # load is imbalanced when the busiest node runs this many more requests
    balance_rel_threshold: float = 1.5  # ... and this many times the least busy node's
    index_blocks: int = 1 << 20  # block names remembered per node before its least recently used are forgotten

    def __post_init__(self) -> None:
        if self.route not in POLICIES:
            raise ValueError(f"--route must be one of {', '.join(POLICIES)}, got {self.route!r}")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"--cache-threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise ValueError("--balance-abs-threshold must be >= 0 and --balance-rel-threshold >= 1")
        if self.index_blocks < 1:
            raise ValueError(f"--index-blocks must be >= 1, got {self.index_blocks}")


class BlockIndex:
    """The block names a node is believed to hold, least recently used first, bounded."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._names: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: bytes) -> bool:
        return name in self._names

    def prefix(self, names: Sequence[bytes]) -> int:
        """How many of `names`, from the first, the node holds (a chain: a missing block ends it)."""
        for held, name in enumerate(names):
            if name not in self._names:
                return held
        return len(names)

    def add(self, names: Iterable[bytes]) -> None:
        for name in names:
            self._names[name] = None
            self._names.move_to_end(name)
        while len(self._names) > self.capacity:
            self._names.popitem(last=False)

    def remove(self, names: Iterable[bytes]) -> None:
        for name in names:
            self._names.pop(name, None)

    def clear(self) -> None:
        self._names.clear()


class Routable(Protocol):
    """A node as the policies see it."""

    address: str
    in_flight: int
    index: BlockIndex


@dataclass(frozen=True)
class Choice:
    node: Routable
    reason: str  # cache_hit | balance | room | least_load | round_robin
    names: tuple[bytes, ...]  # the prompt's full-block names (cache_aware), added to the node's index


class Router:
    def __init__(self, config: RouterConfig):
        self.config = config
        self._turn = itertools.count()

    def choose(self, nodes: Sequence[Routable], prompt_ids: Sequence[int], block_size: int) -> Choice:
        """`nodes`: those that can take a request now (at least one)."""
        turn = next(self._turn)
        if self.config.route == "round_robin":
            return Choice(nodes[turn % len(nodes)], "round_robin", ())
        # ties go round: a quiet cluster still spreads
        rotated = [*nodes[turn % len(nodes) :], *nodes[: turn % len(nodes)]]
        least = min(rotated, key=lambda n: n.in_flight)
        if self.config.route == "least_load" or block_size == 0:
            return Choice(least, "least_load", ())
        full = len(prompt_ids) // block_size
        names = tuple(chain_hashes(list(prompt_ids[: full * block_size]), block_size, 0, full, ROOT))
        if self._imbalanced(nodes):
            return Choice(least, "balance", names)
        best = max(rotated, key=lambda n: (n.index.prefix(names), -n.in_flight))
        if names and best.index.prefix(names) / len(names) > self.config.cache_threshold:
            return Choice(best, "cache_hit", names)
        return Choice(min(rotated, key=lambda n: (len(n.index), n.in_flight)), "room", names)

    def _imbalanced(self, nodes: Sequence[Routable]) -> bool:
        loads = [n.in_flight for n in nodes]
        high, low = max(loads), min(loads)
        return high - low > self.config.balance_abs_threshold and high > low * self.config.balance_rel_threshold
