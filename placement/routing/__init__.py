"""Request routing: which attention-DP rank each request goes to (issue 43).

- :mod:`placement.routing.requests`: :class:`Request` and the expert signature a request is routed by.
- :mod:`placement.routing.rules`: the registry of routing rules (:data:`ROUTING_RULES`).
- :mod:`placement.routing.router`: :class:`Router`, the stateful router (``route``, ``finish``).
- :mod:`placement.routing.prefix`: the per-rank prefix caches (least recently used, in tokens).
- :mod:`placement.routing.sessions`: the multi-turn session workload (format and generator).
- :mod:`placement.routing.simulate`: decode steps of routed requests, and their scores.
"""

from placement.routing.requests import (
    DEFAULT_SIGNATURE_TOKENS,
    Request,
    local_share,
    node_holdings,
    signature_of,
)
from placement.routing.router import Decision, Router, RouterOptions, eligible
from placement.routing.rules import ROUTING_RULES, CombinedWeights, RoutingRule, get_rule, rule_names

__all__ = [
    "DEFAULT_SIGNATURE_TOKENS",
    "ROUTING_RULES",
    "CombinedWeights",
    "Decision",
    "Request",
    "Router",
    "RouterOptions",
    "RoutingRule",
    "eligible",
    "get_rule",
    "local_share",
    "node_holdings",
    "rule_names",
    "signature_of",
]
