"""Per-rank prefix caches for prefix-aware routing: least recently used, sized in tokens.

A prompt is a chain of segments ``((key, tokens), ...)`` (:class:`placement.routing.requests.Request`).
A segment is a cache entry identified by the whole chain up to it, as a radix cache's node is by its
path, so a segment counts as a hit only on a rank that also holds every segment before it. When a rank
takes a request the chain is touched child first, so parents are always more recent than their
children and eviction removes leaves before the prefixes they hang from.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

__all__ = ["PrefixCaches"]

Chain = Sequence[tuple[Hashable, int]]


class PrefixCaches:
    """One LRU cache of ``capacity`` tokens per rank.

    Args:
        num_ranks: ranks ``0 .. num_ranks - 1``.
        capacity: tokens each rank's cache holds (0: no caching, every lookup misses).
    """

    def __init__(self, num_ranks: int, capacity: int):
        self.capacity = int(capacity)
        self._lru: list[OrderedDict[int, int]] = [OrderedDict() for _ in range(int(num_ranks))]
        self._held = [0] * int(num_ranks)
        self._node: dict[tuple[int, Hashable], int] = {}  # (parent node, segment key) -> node id

    def _path(self, chain: Chain, create: bool) -> list[tuple[int, int]]:
        """``(node id, tokens)`` of the chain's segments, as far as they are known (all when ``create``)."""
        out, parent = [], -1
        for key, tokens in chain:
            k = (parent, key)
            node = self._node.get(k)
            if node is None:
                if not create:
                    break
                node = self._node[k] = len(self._node)
            out.append((node, int(tokens)))
            parent = node
        return out

    def hit(self, rank: int, chain: Chain) -> int:
        """Tokens of the longest prefix of ``chain`` held by ``rank``'s cache."""
        lru, total = self._lru[rank], 0
        for node, tokens in self._path(chain, create=False):
            if node not in lru:
                break
            total += tokens
        return total

    def hits(self, chain: Chain) -> list[int]:
        """:meth:`hit` on every rank."""
        path = self._path(chain, create=False)
        out = []
        for lru in self._lru:
            total = 0
            for node, tokens in path:
                if node not in lru:
                    break
                total += tokens
            out.append(total)
        return out

    def insert(self, rank: int, chain: Chain) -> None:
        """``rank`` now holds ``chain`` (every segment, most recent first from the leaf up); the least
        recently used entries go until the cache is within its capacity."""
        if self.capacity <= 0:
            return
        lru = self._lru[rank]
        for node, tokens in reversed(self._path(chain, create=True)):
            if node in lru:
                lru.move_to_end(node)
            else:
                lru[node] = tokens
                self._held[rank] += tokens
        while self._held[rank] > self.capacity and lru:
            _, tokens = lru.popitem(last=False)
            self._held[rank] -= tokens

    def clear(self, rank: int) -> None:
        """Forget ``rank``'s cache (a rank that left, or restarted)."""
        self._lru[rank].clear()
        self._held[rank] = 0

    def held(self, rank: int) -> int:
        """Tokens ``rank``'s cache holds now."""
        return self._held[rank]
