"""Placement co-optimized with affinity routing: the ``affinity`` solver.

Requests will be routed by expert affinity (:mod:`placement.routing`): a request goes to a rank whose
node holds most of its experts, so a node's tokens come from the requests it holds the experts of,
not from a uniform share of all traffic. The solver places for that, alternating the two halves of
the problem on the fit trace's requests (``seq_offsets``), as k-means alternates its two steps:

1. group: request signatures (:func:`solver.request_groups.request_signatures`) in one group per node,
   each at most ``(1 + group_slack) / N`` of the tokens (:func:`~solver.request_groups.balanced_groups`,
   seeded k-means);
2. place: each node's demand ``[N, E]`` per layer (the picks of its group) placed by
   :func:`solver.affinity_place.place_layer`: a node gets the experts its group uses, an expert all
   groups use goes on every node, nodes balanced, heavy replicas split, replicas packed onto the node's
   GPUs (one replica of an expert per GPU);
3. route: every fit request to the node whose experts hold the largest share of its picks (what the
   affinity rule does), within the same per-group token cap; back to 2 for ``rounds`` rounds, keeping
   the round with the largest fitted local share of the picks;
4. against uniform arrival: the locality solver's placement for uniform arrival
   (:mod:`solver.locality`, ``uniform_candidate``) is the other candidate. Each candidate's fit
   requests are routed by affinity (step 3's rule) and the one with fewer fitted remote node copies
   (node-deduplicated, summed over layers, on a seeded sample of at most ``sample_tokens`` fit tokens)
   is kept: with one domain the groups share their experts and co-activation, which the locality
   solver places for, matters more than the groups;
5. gate, per layer, on the whole fit trace: the layer's fitted peak GPU load (requests routed by step
   3's rule, dealt round-robin over their node's ranks, under the dispatch model) at most ``(1 + balance_slack)`` x greedy's under uniform arrival
   (every fit request dealt round-robin over all ranks); otherwise greedy's layer (``greedy_fallback``);
6. report: per layer the fitted remote nodes per token under the routed sources (``objective``)
   against greedy's under uniform arrival (``baseline_objective``), on the sample.

Shapes: L layers, E logical experts, Q fit requests, T fit tokens, G ranks, N nodes, m GPUs per node.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np

from moe_placement.base.limits import check_whole
from moe_placement.base.options import refuse_unknown_keywords
from placement.dispatch import LOCAL, dispatch_names, get_dispatch
from placement.metrics import communication, source_ranks, trace_gpu_load
from placement.model import Placement
from placement.routing.requests import local_share, node_holdings
from placement.topology import Topology
from profiling.trace import RoutingTrace
from solver.affinity_place import place_layer
from solver.greedy import greedy_placement
from solver.locality.options import LocalityOptions
from solver.locality.solve import solve_locality
from solver.problem import Problem
from solver.report import LayerReport, SolveReport
from solver.request_groups import assign_capacity, balanced_groups, request_signatures

__all__ = ["AffinityOptions", "group_sources", "run_affinity"]


@refuse_unknown_keywords
@dataclass(frozen=True)
class AffinityOptions:
    """How the ``affinity`` solver places (module docstring).

    Attributes:
        group_slack: a request group holds at most ``(1 + group_slack) / N`` of the fit tokens.
        node_slack: node loads balanced to within ``(1 + node_slack)`` x the mean (step 2).
        split_at: a replica heavier than this times its node's mean GPU load gets a second one (step 2).
        balance_slack: the gate: a layer's fitted peak GPU load at most ``(1 + balance_slack)`` x greedy's
            under uniform arrival, else greedy's layer.
        rounds: place-and-route rounds (step 3).
        uniform_candidate: also place for uniform arrival with the locality solver (step 4).
        work_limit: the locality solver's counted search steps (None: 100 per layer, the CLI's default).
        sample_tokens: fit tokens (whole requests, a seeded sample) steps 4 and 6 score on.
        dispatch: the dispatch model served with; its node loads follow the local-first tiers
            (``local``), or it spreads every expert's picks over its replicas (``even``).
        seed: seeds the grouping.
    """

    group_slack: float = 0.01
    node_slack: float = 0.05
    split_at: float = 1.3
    balance_slack: float = 0.1
    rounds: int = 3
    uniform_candidate: bool = True
    work_limit: int | None = None
    sample_tokens: int = 16384
    dispatch: str = LOCAL.name
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("group_slack", "node_slack", "balance_slack"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.number)) or not (0 <= v <= 10):
                raise ValueError(f"{name} must be a number in [0, 10], got {v!r}")
        if isinstance(self.split_at, bool) or not (1.0 <= float(self.split_at) <= 100.0):
            raise ValueError(f"split_at must be a number in [1, 100], got {self.split_at!r}")
        check_whole("rounds", self.rounds, 1, 100)
        check_whole("sample_tokens", self.sample_tokens, 1, 1 << 30)
        if self.work_limit is not None:
            check_whole("work_limit", self.work_limit, 1, 1 << 40)
        check_whole("seed", self.seed, 0, 2**32 - 1)
        if not get_dispatch(self.dispatch).locality_fit:
            fits = ", ".join(dispatch_names(locality_fit=True))
            raise ValueError(
                f"the affinity solver places for a dispatch model whose node loads it can model ({fits}); "
                f"{self.dispatch!r} is not one"
            )


def group_sources(groups: np.ndarray, lengths: np.ndarray, gpus_per_node: int) -> np.ndarray:
    """int64 ``[T]``: each token's rank when request ``q`` goes to node ``groups[q]``, a node's requests
    dealt round-robin over its ranks (``lengths [Q]``: tokens per request)."""
    within = np.zeros(groups.size, dtype=np.int64)
    for n in np.unique(groups):
        mine = np.flatnonzero(groups == n)
        within[mine] = np.arange(mine.size) % gpus_per_node
    return np.repeat(groups * gpus_per_node + within, lengths)


def _place(trace: RoutingTrace, sigs: np.ndarray, tokens: np.ndarray, groups: np.ndarray, topo: Topology, o):
    """Step 2 on every layer: the placement for ``groups [Q]``."""
    N = topo.num_nodes
    picks = sigs * tokens[:, None, None]  # [Q, L, E] picks of each request (shares x tokens)
    demand = np.stack([picks[groups == n].sum(axis=0) for n in range(N)])  # [N, L, E]
    rows = [
        place_layer(demand[:, l], topo.gpus_per_node, topo.slots_per_gpu, o.node_slack, o.split_at)
        for l in range(trace.num_layers)
    ]
    return Placement(np.stack(rows), trace.num_logical_experts, topo, trace.layer_ids)


def _route_by_share(
    placement: Placement, sigs: np.ndarray, tokens: np.ndarray, cap: float
) -> tuple[np.ndarray, float]:
    """Step 3's rule: each request's node ``[Q]`` (largest local share within ``cap`` tokens per node)
    and the token-weighted local share of the picks it gives."""
    N = placement.topology.num_nodes
    hold = node_holdings(placement)
    share = np.stack([local_share(s, hold) for s in sigs]) if N > 1 else np.ones((len(sigs), 1))
    groups = assign_capacity(-share, tokens, cap) if N > 1 else np.zeros(len(sigs), dtype=np.int64)
    return groups, float(np.dot(share[np.arange(groups.size), groups], tokens) / tokens.sum())


def _rounds(trace: RoutingTrace, sigs: np.ndarray, tokens: np.ndarray, topo: Topology, o: AffinityOptions):
    """Steps 1-3: the best ``(placement, fitted local share per round)``."""
    N = topo.num_nodes
    groups = balanced_groups(sigs, tokens, N, o.group_slack, o.seed)
    cap = (1.0 + o.group_slack) * tokens.sum() / N
    best, history = None, []
    for _ in range(int(o.rounds)):
        placed = _place(trace, sigs, tokens, groups, topo, o)
        routed, fitted = _route_by_share(placed, sigs, tokens, cap)
        history.append(fitted)
        if best is None or fitted > best[1]:
            best = (placed, fitted)
        groups = routed
    assert best is not None
    return best[0], history


def _sample(trace: RoutingTrace, sample_tokens: int, seed: int) -> RoutingTrace:
    """Whole fit requests drawn (seeded) until ``sample_tokens`` tokens, in trace order (all when fewer)."""
    off = trace.seq_offsets
    assert off is not None
    if trace.num_tokens <= sample_tokens:
        return trace
    order = np.random.default_rng(seed).permutation(off.size - 1)
    lengths = np.diff(off)[order]
    take = np.sort(order[: int(np.searchsorted(np.cumsum(lengths), sample_tokens)) + 1])
    return trace.select_windows(take.tolist())


def _copies(
    placement: Placement, trace: RoutingTrace, src: np.ndarray, dispatch: str
) -> tuple[float, np.ndarray]:
    """Fitted remote node copies of ``trace`` under ``src`` (sum over tokens and layers), and per layer
    the remote nodes per token ``[L]``."""
    per_layer = np.asarray(communication(placement, trace, dispatch, src=src)["remote_nodes_per_layer"])
    assert trace.topk_ids is not None
    has = (trace.topk_ids >= 0).any(axis=2).sum(axis=0)
    return float(per_layer @ has), per_layer


def _candidates(trace, topo, o, sigs, tokens) -> list[tuple[str, Placement]]:
    """Steps 1-4's placements: the co-optimized one (with its rounds' fitted shares in its name) and,
    with ``uniform_candidate``, the locality solver's for uniform arrival."""
    placed, history = _rounds(trace, sigs, tokens, topo, o)
    out = [
        (
            "placed for affinity routing (fitted local share per round: "
            + ", ".join(f"{h:.3f}" for h in history)
            + ")",
            placed,
        )
    ]
    if o.uniform_candidate and topo.num_nodes > 1:
        work = o.work_limit if o.work_limit is not None else 100 * trace.num_layers
        loc = LocalityOptions(dispatch=o.dispatch, seed=o.seed, work_limit=work)
        out.append(("placed for uniform arrival (locality solver)", solve_locality(trace, topo, loc)[0]))
    return out


def run_affinity(problem: Problem, options: AffinityOptions) -> tuple[Placement, SolveReport]:
    """The registry's entry (:mod:`solver.api`): the steps of the module docstring on ``problem.trace``."""
    t0 = time.perf_counter()
    trace, topo, o = problem.trace, problem.topology, options
    if trace is None or not trace.has_tokens or trace.seq_offsets is None:
        raise ValueError("the affinity solver needs a per-token trace with request boundaries (seq_offsets)")
    if problem.layer_ids and tuple(problem.layer_ids) != tuple(trace.layer_ids):
        trace = trace.select_layers([trace.layer_ids.index(x) for x in problem.layer_ids])
    sigs, tokens = request_signatures(trace)
    sample = _sample(trace, o.sample_tokens, o.seed)
    s_sigs, s_tokens = request_signatures(sample)
    cap = (1.0 + o.group_slack) * s_tokens.sum() / topo.num_nodes
    scored = []
    for name, pl in _candidates(trace, topo, o, sigs, tokens):
        groups, _ = _route_by_share(pl, s_sigs, s_tokens, cap)
        src = group_sources(groups, np.diff(sample.seq_offsets), topo.gpus_per_node)
        scored.append((_copies(pl, sample, src, o.dispatch)[0], name, pl, src))
    return _gate(trace, sample, o, scored, (sigs, tokens), t0)


def _gate(
    trace, sample, o: AffinityOptions, scored: list, full: tuple, t0: float
) -> tuple[Placement, SolveReport]:
    """Steps 5-6 on the candidate of ``scored`` (``(copies, name, placement, sample sources)`` each) with
    the fewest copies: per-layer balance gate against greedy under uniform arrival on the whole fit
    trace (``full``: its signatures and tokens per request), then the report (on the sample)."""
    _, chosen, placed, src = min(scored, key=lambda x: x[0])
    topo = placed.topology
    sigs, tokens = full
    groups, _ = _route_by_share(placed, sigs, tokens, (1.0 + o.group_slack) * tokens.sum() / topo.num_nodes)
    routed = group_sources(groups, np.diff(trace.seq_offsets), topo.gpus_per_node)  # [T] whole fit trace
    greedy, _ = greedy_placement(trace.counts(), topo, layer_ids=trace.layer_ids)
    ours = trace_gpu_load(placed, trace, o.dispatch, routed).max(axis=1)  # [L] fitted peaks
    base = trace_gpu_load(
        greedy, trace, o.dispatch, source_ranks(replace(trace, source_rank=None), topo.ep_size)[0]
    )
    kept = ours <= (1.0 + o.balance_slack) * base.max(axis=1)  # [L]
    base = base.max(axis=1)
    uniform, _ = source_ranks(replace(sample, source_rank=None), topo.ep_size)
    rows = np.where(kept[:, None], placed.physical_to_logical_map, greedy.physical_to_logical_map)
    params = {
        "solver": "affinity",
        **{k: getattr(o, k) for k in ("group_slack", "node_slack", "split_at", "balance_slack", "dispatch")},
        **{k: getattr(o, k) for k in ("rounds", "uniform_candidate", "work_limit", "sample_tokens", "seed")},
    }
    result = Placement(
        rows, trace.num_logical_experts, topo, trace.layer_ids, {**params, "trace": trace.name}
    )
    _, ours_rn = _copies(result, sample, src, o.dispatch)
    _, base_rn = _copies(greedy, sample, uniform, o.dispatch)
    layers = tuple(
        LayerReport(
            int(lid), "heuristic" if k else "greedy_fallback", float(a), 0.0, baseline_objective=float(b)
        )
        for lid, a, b, k in zip(trace.layer_ids, ours_rn, base_rn, kept)
    )
    notes = _notes(sample, scored, chosen, (ours, base), kept, o)
    return result, SolveReport("affinity", layers, time.perf_counter() - t0, params, tuple(notes))


def _notes(sample, scored, chosen: str, peaks: tuple, kept, o: AffinityOptions) -> list[str]:
    """The report's notes: the candidates' fitted copies, the one kept, the peaks and the gated layers."""
    ours, base = peaks
    layer_ids, tokens = sample.layer_ids, sample.num_tokens
    notes = [f"scored on {sample.seq_offsets.size - 1} fit requests ({tokens} tokens), routed by affinity"]
    notes += [
        f"{name}: {c / tokens:.3f} remote node copies per token over the layers" for c, name, _, _ in scored
    ]
    notes.append(f"kept: {chosen}")
    notes.append(
        f"fitted peak GPU load (sum over layers) {ours.sum():.1f} under affinity-routed sources vs greedy's "
        f"{base.sum():.1f} under uniform arrival ({ours.sum() / base.sum():.3f}x), dispatch {o.dispatch}"
    )
    if not kept.all():
        ids = [int(layer_ids[i]) for i in np.flatnonzero(~kept)]
        notes.append(
            f"{len(ids)} layer(s) over the balance gate ({1 + o.balance_slack:.2f}x greedy's peak) keep greedy's "
            f"placement: {ids[:8]}{' ...' if len(ids) > 8 else ''}"
        )
    return notes
