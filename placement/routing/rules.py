"""The one registry of request-routing rules: which attention-DP rank a request is sent to.

Each rule is one :class:`RoutingRule` in :data:`ROUTING_RULES`; the router, the ``route`` command's
choices and the benchmark read the names from here. A rule is a pure function of a :class:`View` of
the ranks (their load, and where the rule asks for them, each rank's cached prefix and its node's
share of the request's experts) that returns a rank. Shapes: G ranks.

- ``round-robin``: the next serving rank in turn (the engines' default; no drift cap).
- ``least-loaded``: fewest requests in flight, then the most free KV (the fewest KV tokens held).
- ``prefix``: the longest cached prefix of the request's prompt, ties and no hit at all by load.
- ``affinity``: the rank whose node holds the largest share of the request's expert picks, ties
  (the node's ranks) by load; a request without a signature goes by load.
- ``combined``: the highest weighted score (:class:`CombinedWeights`): load, free KV, prefix hit and
  affinity, each scaled to 0..1.

Every rule but ``round-robin`` chooses among the ranks the drift cap leaves
(:func:`placement.routing.router.eligible`); ``least-loaded`` is always within it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from moe_placement.base.options import refuse_unknown_keywords

__all__ = [
    "AFFINITY",
    "COMBINED",
    "CombinedWeights",
    "LEAST_LOADED",
    "PREFIX",
    "ROUND_ROBIN",
    "ROUTING_RULES",
    "RoutingRule",
    "View",
    "get_rule",
    "rule_names",
]


@refuse_unknown_keywords
@dataclass(frozen=True)
class CombinedWeights:
    """Weights of the ``combined`` score. Each term is in 0..1, higher is better:

    - load: ``1 - q / (q_max + 1)`` with ``q`` the rank's requests in flight and ``q_max`` the most any
      serving rank holds;
    - kv: the rank's free share of its KV capacity (0 for every rank when no capacity is known);
    - prefix: the share of the request's prompt cached on the rank;
    - affinity: the rank's node's share of the request's expert picks, rescaled so that the best node
      scores 1 and the worst 0 (0 for every rank when the request has no signature or all nodes tie).

    The defaults make a full prefix hit or the best node worth more than any load difference the
    drift cap leaves, and the load term decide between equals.
    """

    load: float = 1.0
    kv: float = 0.5
    prefix: float = 2.0
    affinity: float = 2.0

    def __post_init__(self) -> None:
        for name in ("load", "kv", "prefix", "affinity"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.number)) or not (0 <= v < 1e6):
                raise ValueError(f"CombinedWeights.{name} must be a number in [0, 1e6), got {v!r}")


@dataclass(frozen=True, eq=False)
class View:
    """What a rule sees of the ranks when one request arrives (arrays ``[G]``).

    Attributes:
        queue: requests in flight per rank; kv: KV tokens held per rank; kv_capacity: tokens per rank
        or None (unknown); eligible: bool, serving and within the drift cap; serving: bool, ranks in
        service; tie: float in [0, 1), a seeded draw that breaks ties; turn: the round-robin pointer
        (the rank after the last one round-robin chose); hits: cached prefix tokens per rank (rules
        that use prefixes); prompt_tokens: the request's prompt length; affinity: the rank's node's share
        of the request's picks (rules that use affinity; None when the request has no signature).
    """

    queue: np.ndarray
    kv: np.ndarray
    kv_capacity: int | None
    eligible: np.ndarray
    serving: np.ndarray
    tie: np.ndarray
    turn: int
    hits: np.ndarray | None = None
    prompt_tokens: int = 0
    affinity: np.ndarray | None = None
    weights: CombinedWeights = CombinedWeights()


@dataclass(frozen=True)
class RoutingRule:
    """One routing rule.

    Attributes:
        name: the public name (``moe-placement route --policies``).
        summary: one line for ``--help`` and the docs.
        choose: ``View -> (rank, fallback)``: the chosen rank and, when the rule could not apply its
            own criterion, a short reason it went by load instead ("" otherwise).
        capped: chooses among the drift cap's ranks (``View.eligible``), not all serving ones.
        uses_prefix: reads ``View.hits`` (the router looks the prompt up in every rank's cache).
        uses_affinity: reads ``View.affinity`` (the router needs the placement).
        needs_placement: refuses to run without a placement (``affinity``; ``combined`` drops its
            affinity term instead).
    """

    name: str
    summary: str
    choose: Callable[[View], tuple[int, str]]
    capped: bool = True
    uses_prefix: bool = False
    uses_affinity: bool = False
    needs_placement: bool = False


def _lightest(v: View, among: np.ndarray) -> int:
    """The rank of ``among`` (bool ``[G]``) with the fewest requests, then the fewest KV tokens, then
    the lowest seeded draw."""
    idx = np.flatnonzero(among)
    order = np.lexsort((v.tie[idx], v.kv[idx], v.queue[idx]))
    return int(idx[order[0]])


def _round_robin(v: View) -> tuple[int, str]:
    G = v.serving.size
    for i in range(G):
        g = (v.turn + i) % G
        if v.serving[g]:
            return g, ""
    raise ValueError("no rank is serving")  # the router checks this first


def _least_loaded(v: View) -> tuple[int, str]:
    return _lightest(v, v.eligible), ""


def _prefix(v: View) -> tuple[int, str]:
    assert v.hits is not None
    hits = np.where(v.eligible, v.hits, -1)
    best = int(hits.max())
    if best <= 0:
        return _lightest(v, v.eligible), "no cached prefix"
    return _lightest(v, hits == best), ""


def _affinity(v: View) -> tuple[int, str]:
    if v.affinity is None:
        return _lightest(v, v.eligible), "no signature"
    a = np.where(v.eligible, v.affinity, -np.inf)
    return _lightest(v, a >= a.max() - 1e-12), ""


def _combined(v: View) -> tuple[int, str]:
    w = v.weights
    qmax = float(v.queue[v.serving].max())
    score = w.load * (1.0 - v.queue / (qmax + 1.0))
    if v.kv_capacity:
        score = score + w.kv * np.clip(1.0 - v.kv / v.kv_capacity, 0.0, 1.0)
    if v.hits is not None and v.prompt_tokens > 0:
        score = score + w.prefix * np.minimum(v.hits / v.prompt_tokens, 1.0)
    if v.affinity is not None:
        lo, hi = float(v.affinity[v.serving].min()), float(v.affinity[v.serving].max())
        if hi > lo:
            score = score + w.affinity * (v.affinity - lo) / (hi - lo)
    s = np.where(v.eligible, score, -np.inf)
    best = np.flatnonzero(s >= s.max() - 1e-12)
    return int(best[np.argmin(v.tie[best])]), ""


ROUND_ROBIN = RoutingRule("round-robin", "each serving rank in turn", _round_robin, capped=False)
LEAST_LOADED = RoutingRule("least-loaded", "fewest requests in flight, then the most free KV", _least_loaded)
PREFIX = RoutingRule(
    "prefix", "longest cached prefix of the prompt; by load when none is cached", _prefix, uses_prefix=True
)
AFFINITY = RoutingRule(
    "affinity",
    "the node holding most of the request's experts; by load without a signature",
    _affinity,
    uses_affinity=True,
    needs_placement=True,
)
COMBINED = RoutingRule(
    "combined",
    "weighted score of load, free KV, prefix hit and expert affinity",
    _combined,
    uses_prefix=True,
    uses_affinity=True,
)

ROUTING_RULES: dict[str, RoutingRule] = {
    r.name: r for r in (ROUND_ROBIN, LEAST_LOADED, PREFIX, AFFINITY, COMBINED)
}


def rule_names() -> tuple[str, ...]:
    """The registered rule names, in registry order."""
    return tuple(ROUTING_RULES)


def get_rule(rule: str | RoutingRule) -> RoutingRule:
    """The rule named ``rule`` (or ``rule`` itself); a ValueError naming the choices otherwise."""
    if isinstance(rule, RoutingRule):
        return rule
    if rule not in ROUTING_RULES:
        raise ValueError(f"unknown routing rule {rule!r}; choose from {', '.join(ROUTING_RULES)}")
    return ROUTING_RULES[rule]
