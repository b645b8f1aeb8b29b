"""The request router: a stateful object that sends each request to an attention-DP rank.

``Router(rule, num_ranks, options, placement)``: :meth:`Router.route` takes a
:class:`~placement.routing.requests.Request` and returns a rank; :meth:`Router.finish` tells it the
request is done. Between the two the router counts the request against its rank (one request in
flight, its prompt's KV tokens) and, for the prefix rules, records the prompt in the rank's prefix
cache. :meth:`Router.report` (one rank) and :meth:`Router.report_queue` / :meth:`Router.report_kv` (every
rank) take the engine's own figures (requests in flight, KV tokens) when a caller has them; :meth:`Router.remove_rank` and :meth:`Router.add_rank` follow ranks that leave or
come back (an elastic scale-down). The rules are :data:`placement.routing.rules.ROUTING_RULES`.

Determinism: ties are broken by draws from ``numpy.random.default_rng(options.seed)``, one draw per
rank per routed request, so one seed and one sequence of calls give one sequence of ranks.

The drift cap (``max_imbalance``, :func:`eligible`): a capped rule never sends a request to a rank
whose requests in flight would then exceed ``ceil((1 + max_imbalance) x`` the serving ranks' mean
after the request ``)``; the least-loaded ranks always qualify.

Bad calls raise ValueError naming what was wrong; documented fallbacks instead of errors: a request
without a signature (None or all zeros) goes by load under ``affinity`` (no affinity term under
``combined``); no cached prefix goes by load under ``prefix``; a request still in flight on a rank that
left is finished normally. The last decision, with its fallback, is :attr:`Router.last`.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

from moe_placement.base.limits import MAX_RANKS, check_whole
from moe_placement.base.options import refuse_unknown_keywords
from placement.model import Placement
from placement.routing.prefix import PrefixCaches
from placement.routing.requests import Request, local_share, node_holdings
from placement.routing.rules import CombinedWeights, RoutingRule, View, get_rule

__all__ = ["Decision", "Router", "RouterOptions", "eligible"]

DEFAULT_CACHE_TOKENS = (
    1 << 20
)  # prefix cache per rank, tokens (about what one H200 rank keeps for a small MoE)


@refuse_unknown_keywords
@dataclass(frozen=True)
class RouterOptions:
    """How the router decides (every knob; each documented once here).

    Attributes:
        max_imbalance: the drift cap: no capped rule sends a request to a rank whose requests in flight
            would exceed ``ceil((1 + max_imbalance) x mean)`` (None: no cap).
        kv_capacity: KV tokens one rank holds, for the free-KV terms (None: unknown, not used).
        cache_tokens: tokens of each rank's prefix cache (least recently used; 0: no prefix cache).
        weights: the ``combined`` rule's weights.
        seed: seeds the tie-breaking draws.
    """

    max_imbalance: float | None = 0.1
    kv_capacity: int | None = None
    cache_tokens: int = DEFAULT_CACHE_TOKENS
    weights: CombinedWeights = CombinedWeights()
    seed: int = 0

    def __post_init__(self) -> None:
        x = self.max_imbalance
        if x is not None and (
            isinstance(x, bool) or not isinstance(x, (int, float, np.number)) or not (0 <= x <= 100)
        ):
            raise ValueError(
                f"max_imbalance must be a number in [0, 100] (0.1 = 10% over the mean) or None, got {x!r}"
            )
        if self.kv_capacity is not None:
            check_whole("kv_capacity", self.kv_capacity, 1, fix="tokens of KV one rank holds, or None")
        check_whole("cache_tokens", self.cache_tokens, 0, 1 << 40)
        check_whole("seed", self.seed, 0, 2**32 - 1)
        if not isinstance(self.weights, CombinedWeights):
            raise ValueError(f"weights must be a CombinedWeights, got {type(self.weights).__name__}")


@dataclass(frozen=True)
class Decision:
    """One routed request: its rank, the prompt tokens found in that rank's prefix cache, and the
    reason the rule fell back to load ("" when it did not)."""

    rank: int
    hit_tokens: int
    fallback: str = ""


def eligible(queue: np.ndarray, serving: np.ndarray, max_imbalance: float | None) -> np.ndarray:
    """bool ``[G]``: serving ranks that may take one more request under the drift cap.

    A rank qualifies when ``queue + 1 <= ceil((1 + max_imbalance) x (sum of serving queues + 1) /
    serving ranks)``, and the least-loaded serving ranks always do (so the set is never empty).
    """
    if max_imbalance is None:
        return serving.copy()
    q = queue[serving]
    cap = math.ceil((1.0 + max_imbalance) * (float(q.sum()) + 1.0) / q.size - 1e-9)
    ok = serving & (queue + 1 <= cap)
    return ok | (serving & (queue == q.min()))


class Router:
    """Sends requests to ranks with one rule (module docstring).

    Args:
        rule: a name in :data:`~placement.routing.rules.ROUTING_RULES` or the rule.
        num_ranks: attention-DP ranks ``G`` (with a placement and no ``rank_nodes``: its EP size, rank
            ``g`` on node ``g // (G / N)``).
        options: :class:`RouterOptions`.
        placement: the expert placement in service (the affinity terms read which experts each node
            holds); required by ``affinity``.
        rank_nodes: int ``[G]``: the node of the placement's topology each rank's tokens are dispatched
            from, where attention-DP ranks are not EP ranks (attention TP, or independent instances of one
            placement: a rank's node within its instance); None: rank ``g`` is EP rank ``g``.
    """

    def __init__(
        self,
        rule: str | RoutingRule,
        num_ranks: int,
        options: RouterOptions | None = None,
        placement: Placement | None = None,
        rank_nodes: np.ndarray | None = None,
    ):
        self.rule = get_rule(rule)
        G = check_whole("num_ranks", num_ranks, 1, MAX_RANKS)
        self.options = options if options is not None else RouterOptions()
        if not isinstance(self.options, RouterOptions):
            raise ValueError(f"options must be a RouterOptions, got {type(self.options).__name__}")
        self._holdings, self._node_of_rank = self._check_placement(placement, G, rank_nodes)
        self.num_ranks = G
        self.queue = np.zeros(G, dtype=np.int64)
        self.kv = np.zeros(G, dtype=np.int64)
        self.serving = np.ones(G, dtype=bool)
        self.caches = PrefixCaches(G, self.options.cache_tokens)
        self._rng = np.random.default_rng(self.options.seed)
        self._turn = 0
        self._in_flight: dict[Hashable, tuple[int, int]] = {}  # request id -> (rank, KV tokens)
        self.last: Decision | None = None

    def _check_placement(self, placement: Placement | None, G: int, rank_nodes):
        if placement is None:
            if self.rule.needs_placement:
                raise ValueError(
                    f"the {self.rule.name} rule needs the expert placement (which experts each node holds)"
                )
            if rank_nodes is not None:
                raise ValueError("rank_nodes names nodes of a placement's topology: pass the placement too")
            return None, None
        if not isinstance(placement, Placement):
            raise ValueError(f"placement must be a placement.model.Placement, got {type(placement).__name__}")
        if rank_nodes is not None:
            nodes = np.asarray(rank_nodes)
            N = placement.topology.num_nodes
            if (
                nodes.shape != (G,)
                or nodes.dtype.kind not in "iu"
                or (nodes.size and not (0 <= nodes.min() <= nodes.max() < N))
            ):
                raise ValueError(
                    f"rank_nodes must be {G} node indices in 0..{N - 1} (one per rank), got {nodes.dtype} {nodes.shape}"
                )
            return node_holdings(placement), nodes.astype(np.int64)
        if placement.topology.ep_size != G:
            raise ValueError(
                f"the placement has {placement.topology.ep_size} EP ranks but the router {G} ranks; attention-DP "
                f"ranks are EP ranks here: pass num_ranks={placement.topology.ep_size}"
            )
        return node_holdings(placement), np.arange(G) // placement.topology.gpus_per_node

    # ---- routing --------------------------------------------------------------------------------
    def route(self, request: Request) -> int:
        """The rank ``request`` goes to; the router then counts it in flight there until :meth:`finish`."""
        self._check_request(request)
        if not self.serving.any():
            raise ValueError("no rank is serving: every rank was removed; add_rank one back first")
        view = self._view(request)
        rank, fallback = self.rule.choose(view)
        hit = int(view.hits[rank]) if view.hits is not None else self.caches.hit(rank, request.prefix)
        self._turn = (rank + 1) % self.num_ranks  # round-robin's pointer
        self._admit(request, rank)
        self.last = Decision(rank, min(hit, int(request.prompt_tokens)), fallback)
        return rank

    def _check_request(self, request: Request) -> None:
        if not isinstance(request, Request):
            raise ValueError(f"route takes a placement.routing.Request, got {type(request).__name__}")
        if request.request_id in self._in_flight:
            raise ValueError(
                f"request {request.request_id!r} is already in flight; ids must be unique until finish()"
            )
        check_whole("prompt_tokens", request.prompt_tokens, 0, 1 << 40)

    def _view(self, request: Request) -> View:
        rule = self.rule
        hits = np.asarray(self.caches.hits(request.prefix), dtype=np.int64) if rule.uses_prefix else None
        return View(
            queue=self.queue,
            kv=self.kv,
            kv_capacity=self.options.kv_capacity,
            eligible=eligible(self.queue, self.serving, self.options.max_imbalance if rule.capped else None),
            serving=self.serving,
            tie=self._rng.random(self.num_ranks),
            turn=self._turn,
            hits=hits,
            prompt_tokens=int(request.prompt_tokens),
            affinity=self._affinity(request) if rule.uses_affinity else None,
            weights=self.options.weights,
        )

    def _affinity(self, request: Request) -> np.ndarray | None:
        """float ``[G]``: each rank's node's share of the request's picks; None without a signature."""
        if self._holdings is None or request.signature is None:
            return None
        sig = np.asarray(request.signature, dtype=np.float64)
        if sig.shape != self._holdings.shape[1:] or not np.all(np.isfinite(sig)) or (sig < 0).any():
            raise ValueError(
                f"request {request.request_id!r}: the signature must be finite shares >= 0 of shape "
                f"{self._holdings.shape[1:]} (layers, experts), got {sig.dtype} {sig.shape}"
            )
        if not sig.any():
            return None
        return local_share(sig, self._holdings)[self._node_of_rank]

    def _admit(self, request: Request, rank: int) -> None:
        self.queue[rank] += 1
        self.kv[rank] += int(request.prompt_tokens)
        self._in_flight[request.request_id] = (rank, int(request.prompt_tokens))
        self.caches.insert(rank, request.prefix)

    def finish(self, request_id: Hashable) -> int:
        """Request ``request_id`` is done: its rank's load drops. Returns the rank it was on."""
        if request_id not in self._in_flight:
            raise ValueError(f"request {request_id!r} is not in flight (never routed, or already finished)")
        rank, kv = self._in_flight.pop(request_id)
        self.queue[rank] -= 1
        self.kv[rank] = max(0, int(self.kv[rank]) - kv)
        return rank

    def cache(self, rank: int, chain: tuple[tuple[Hashable, int], ...]) -> None:
        """Record that ``rank`` holds the KV of ``chain`` (a finished turn's prompt and answer)."""
        self._check_rank(rank)
        if self.serving[rank]:
            self.caches.insert(rank, chain)

    # ---- ranks ----------------------------------------------------------------------------------
    def _check_rank(self, rank) -> int:
        return check_whole(
            "rank", rank, 0, self.num_ranks - 1, fix=f"this router has ranks 0..{self.num_ranks - 1}"
        )

    def report(self, rank: int, queue: int | None = None, kv_tokens: int | None = None) -> None:
        """The engine's own figures for ``rank`` (requests in flight, KV tokens held), replacing the
        router's count until the next route or finish changes it."""
        g = self._check_rank(rank)
        if queue is not None:
            self.queue[g] = check_whole("queue", queue, 0)
        if kv_tokens is not None:
            self.kv[g] = check_whole("kv_tokens", kv_tokens, 0)

    def report_kv(self, kv_tokens: np.ndarray) -> None:
        """The engine's KV tokens of every rank at once (int ``[G]``, each >= 0)."""
        kv = np.asarray(kv_tokens)
        if kv.shape != (self.num_ranks,) or (kv.size and (kv.dtype.kind not in "iuf" or (kv < 0).any())):
            raise ValueError(
                f"kv_tokens must be {self.num_ranks} counts >= 0 (one per rank), got {kv.dtype} {kv.shape}"
            )
        self.kv[:] = kv.astype(np.int64)

    def report_queue(self, queue: np.ndarray) -> None:
        """The engine's requests in flight of every rank at once (int ``[G]``, each >= 0)."""
        q = np.asarray(queue)
        if q.shape != (self.num_ranks,) or (q.size and (q.dtype.kind not in "iu" or (q < 0).any())):
            raise ValueError(
                f"queue must be {self.num_ranks} whole counts >= 0 (one per rank), got {q.dtype} {q.shape}"
            )
        self.queue[:] = q.astype(np.int64)

    def remove_rank(self, rank: int) -> None:
        """Rank ``rank`` left: no request goes there until :meth:`add_rank`; its cache is forgotten."""
        g = self._check_rank(rank)
        self.serving[g] = False
        self.caches.clear(g)

    def add_rank(self, rank: int) -> None:
        """Rank ``rank`` serves (again), with an empty cache."""
        self.serving[self._check_rank(rank)] = True

    @property
    def in_flight(self) -> int:
        """Requests routed and not finished."""
        return len(self._in_flight)
