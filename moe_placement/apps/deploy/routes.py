"""The request simulator's routes are the one registry's routing rules.

:class:`RuleRoute` adapts a rule of :data:`placement.routing.ROUTING_RULES` to the simulator's hook
``route(request: RouteRequest, view: PoolView) -> rank``: one :class:`placement.routing.Router` per pool
and simulation (kept in ``view.state``), told before every decision what the simulator holds on each
rank (:attr:`PoolView.in_flight`: requests taken and not finished; :attr:`PoolView.reserved`: KV tokens
reserved; the rank's KV budget is the router's ``kv_capacity``), so the rule sees the simulated queues,
not its own count. The request it routes is the simulator's (id, prompt tokens) plus, where the caller
gives them (``requests``), the request's prefix chain and expert signature; the pool's placement
(:attr:`PoolSim.placement`) gives the affinity terms which experts each rank's node holds.

Without a prefix chain or a signature the rules fall back as the Router documents: ``prefix`` routes
by load (no cached prefix), ``affinity`` by load (no signature), ``combined`` by load and free KV.
The simulator's built-in workloads carry neither.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from moe_placement.apps.deploy.simulator import PoolView, RouteRequest
from placement.routing import Request, Router, RouterOptions, RoutingRule, get_rule

__all__ = ["RuleRoute", "rule_route"]


@dataclass(frozen=True, eq=False)
class RuleRoute:
    """``route(request, view) -> rank`` by ``rule`` (module docstring).

    Attributes:
        rule: the routing rule (``rule_route`` takes its name).
        options: the router's options; ``kv_capacity`` None takes each pool's KV budget per rank.
        requests: what the router sees of request ``i`` beyond its length (``prefix``, ``signature``),
            indexed by the simulator's request index; None: nothing more (the fallbacks above).
    """

    rule: RoutingRule
    options: RouterOptions = RouterOptions()
    requests: Sequence[Request] | None = None

    def __call__(self, request: RouteRequest, view: PoolView) -> int:
        router = view.state.get("router")
        if router is None:
            router = view.state["router"] = self._router(view)
        router.report_queue(view.in_flight)
        router.report_kv(view.reserved)
        q = self._request(request)
        rank = router.route(q)
        router.finish(q.request_id)  # the simulator's own queues are the load (reported above)
        if router.last is not None and router.last.fallback:
            falls = view.state.setdefault("fallbacks", {})
            falls[router.last.fallback] = falls.get(router.last.fallback, 0) + 1
        return rank

    def _router(self, view: PoolView) -> Router:
        o = self.options
        if o.kv_capacity is None and view.kv_tokens >= 1:
            o = replace(o, kv_capacity=int(view.kv_tokens))
        placement = view.placement if self.rule.uses_affinity else None
        nodes = view.rank_nodes if placement is not None else None
        return Router(self.rule, view.num_ranks, o, placement, nodes)

    def _request(self, request: RouteRequest) -> Request:
        i = int(request.index)
        if self.requests is None:
            return Request(i, int(request.prompt_len))
        known = self.requests[i]
        return Request(i, int(request.prompt_len), known.signature, known.prefix, known.conversation)


def rule_route(
    rule: str | RoutingRule, options: RouterOptions | None = None, requests: Sequence[Request] | None = None
) -> RuleRoute:
    """The simulator route of ``rule`` (a name of :data:`placement.routing.ROUTING_RULES` or the rule);
    an unknown name is a ValueError naming the choices."""
    return RuleRoute(get_rule(rule), options if options is not None else RouterOptions(), requests)
