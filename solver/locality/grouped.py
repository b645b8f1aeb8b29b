"""``method="grouped"`` of the locality solver (:func:`solver.locality.solve_locality`): the earlier scheme,
also used for ``dispatch="even"``.

Shapes: L layers, E logical experts, P physical slots, G GPUs, N nodes, m GPUs per node, S slots per
GPU, T tokens, k top-k.

Per layer: replica counts ``c [E]`` (:func:`locality_replica_counts` or greedy's), then the node grouping
of :mod:`solver.locality.partition` (agglomerate -> CP-SAT -> token-level swaps, never worse than the
start), then each node's replicas packed onto its GPUs (:func:`solver.locality.pack.pack_node_gpus`).
"""

from __future__ import annotations

import logging
import time

import numpy as np

from placement.dispatch import get_dispatch
from placement.metrics import communication, source_ranks
from placement.model import Placement
from placement.topology import Topology
from profiling.coactivation import coactivation_counts
from profiling.trace import RoutingTrace
from solver.greedy import greedy_placement, greedy_replica_counts
from solver.locality.options import LocalityOptions
from solver.locality.pack import pack_node_gpus
from solver.locality.partition import (
    LayerProblem,
    agglomerate,
    expected_remote_nodes,
    node_loads,
    pair_objective,
    refine_cpsat,
    reps_from_member,
    swap_search,
)
from solver.report import LayerReport, SolveReport

__all__ = ["locality_replica_counts", "solve_grouped"]

log = logging.getLogger(__name__)


def locality_replica_counts(
    load: np.ndarray, num_slots: int, num_nodes: int, max_replicas: int, headroom: float = 0.0
) -> np.ndarray:
    """Replica counts ``[L, E]`` that keep greedy's balance and spend spare slots on locality.

    1. ``c_e = ceil(w_e / (m* (1 + headroom)))`` where ``m*`` is the largest per-replica load of the
       greedy counts (:func:`solver.greedy.greedy_replica_counts`): no replica is more than ``headroom``
       heavier than greedy's heaviest.
    2. Spare slots raise experts, hottest first, to one replica on every node (``N`` replicas): under the
       ``local`` dispatch every token then finds such an expert on its own node, and each node serves
       exactly its own tokens of it.
    3. Slots still left go by greedy replication (highest load per replica).

    Args:
        load: ``[L, E]``. Returns: int64 ``[L, E]`` summing to ``num_slots`` per row.
    """
    w = np.asarray(load, dtype=np.float64)
    L, E = w.shape
    cg = greedy_replica_counts(w, num_slots, max_replicas)  # [L, E]
    out = np.empty_like(cg)
    for l in range(L):
        peak = float((w[l] / cg[l]).max())
        c = (
            np.ones(E, dtype=np.int64)
            if peak <= 0
            else np.clip(np.ceil(w[l] / (peak * (1.0 + headroom)) - 1e-9), 1, max_replicas).astype(np.int64)
        )
        left = num_slots - int(c.sum())
        for e in np.argsort(-w[l], kind="stable"):
            need = max(0, min(num_nodes, max_replicas) - int(c[e]))
            if need == 0:
                continue
            if need > left:
                continue
            c[e] += need
            left -= need
        while left > 0:
            score = np.where(c < max_replicas, w[l] / c, -np.inf)
            c[int(score.argmax())] += 1
            left -= 1
        out[l] = c
    return out


def _replica_loads(prob: LayerProblem, reps: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Replicas of node ``n`` as items: ``(expert int64 [r], load float64 [r])`` under ``prob.dispatch``."""
    member = reps > 0
    c = prob.count.astype(np.float64)
    if get_dispatch(prob.dispatch).counts_only:
        per = prob.load / c  # [E]
        per_n = np.repeat(per[:, None], prob.num_nodes, axis=1)
    else:
        remote = (prob.src_count.T * ~member).sum(axis=1)  # [E]
        per_n = prob.src_count.T / np.maximum(reps, 1) + (remote / c)[:, None]  # [E, N]
    experts = np.repeat(np.arange(prob.num_experts), reps[:, n])
    return experts.astype(np.int64), per_n[experts, n]


def _layer_row(
    prob: LayerProblem, reps: np.ndarray, topology: Topology, time_limit: float = 0.0, seed: int = 0
) -> np.ndarray:
    """int64 ``[P]`` physical-to-logical row from a node layout ``reps [E, N]``."""
    m, S = topology.gpus_per_node, topology.slots_per_gpu
    row = np.empty(topology.num_physical_experts, dtype=np.int64)
    for n in range(prob.num_nodes):
        experts, loads = _replica_loads(prob, reps, n)
        gpu = pack_node_gpus(experts, loads, m, time_limit=time_limit / prob.num_nodes, seed=seed)
        for gl in range(m):
            ex = np.sort(experts[gpu == gl])  # S experts of this GPU
            g = n * m + gl
            row[g * S : (g + 1) * S] = ex
    return row


def solve_grouped(
    trace: RoutingTrace, topology: Topology, options: LocalityOptions, t0: float
) -> tuple[Placement, SolveReport]:
    """``method="grouped"`` (or ``dispatch="even"``) of :func:`solver.locality.solve_locality`, on a trace
    already cut to the layers to solve: replica counts -> per layer, node grouping and GPU packing ->
    placement and report. ``t0``: ``time.perf_counter()`` when the solve began.
    """
    o = options
    E, P, G = trace.num_logical_experts, topology.num_physical_experts, topology.ep_size
    L = trace.num_layers
    src, how = source_ranks(trace, G)
    src_node = src // topology.gpus_per_node
    load = trace.counts().astype(np.float64)  # [L, E]
    if o.replication == "locality":
        counts = locality_replica_counts(load, P, topology.num_nodes, G, o.replica_headroom)  # [L, E]
    elif o.replication == "greedy":
        counts = greedy_replica_counts(load, P, max_replicas=G)  # [L, E]
    else:
        raise ValueError(f"replication must be 'locality' or 'greedy', got {o.replication!r}")
    greedy, _ = greedy_placement(load, topology, layer_ids=trace.layer_ids)
    coact = coactivation_counts(trace).astype(np.float64)  # [L, E, E]
    per_layer_t = max(float(o.time_limit), 0.0) / max(L, 1)
    bw = 0.0 if o.comm_weight is None else 1.0 / float(o.comm_weight)
    rows = np.empty((L, P), dtype=np.int64)
    reports = []
    for l in range(L):
        tl = time.perf_counter()
        ids = trace.topk_ids[:, l, :].astype(np.int64)  # [T, k]
        prob = _layer_problem(ids, src_node, coact[l], counts[l].astype(np.int64), topology, o.dispatch)
        cap = (1.0 + o.balance_slack) * prob.mean_node_load
        # the whole call's time limit bounds the call: a layer gets its even share, at most what is
        # left over the layers left; with nothing left, no search (CP-SAT's 0.05 s floor per layer
        # and node would otherwise add up over many layers)
        t_l = min(per_layer_t, max(t0 + float(o.time_limit) - time.perf_counter(), 0.0) / (L - l))
        refine = o.refine and t_l > 0
        found = _group_layer(prob, cap, refine, t_l, o.seed + l, bw, topology.slots_per_gpu)
        rows[l] = _layer_row(prob, found["reps"], topology, 0.2 * t_l if refine else 0.0, o.seed + l)
        g_prob = _layer_problem(
            ids, src_node, coact[l], greedy.logical_replica_count[l], topology, o.dispatch
        )
        g_obj = _greedy_objective(g_prob, greedy.physical_to_logical_map[l], topology)
        reports.append(
            _layer_report(trace.layer_ids[l], prob, cap, found, g_obj, float(load[l].sum() / G), tl)
        )
    # recorded under its former key "policy", so placement files stay byte-identical
    params = {
        "balance_slack": o.balance_slack,
        "policy": o.dispatch,
        "time_limit": o.time_limit,
        "seed": o.seed,
        "refine": o.refine,
        "comm_weight": o.comm_weight,
        "replication": o.replication,
        "replica_headroom": o.replica_headroom,
        "hidden_size": o.hidden_size,
        "source_ranks": how,
    }
    placement = Placement(
        rows, E, topology, trace.layer_ids, {"solver": "locality", **params, "trace": trace.name}
    )
    notes = _grouped_notes(placement, trace, reports, how, o.balance_slack, o.dispatch, o.hidden_size)
    report = SolveReport("locality", tuple(reports), time.perf_counter() - t0, params, tuple(notes))
    log.debug("locality: %d layers in %.2fs", L, report.wall_time_s)
    return placement, report


def _layer_problem(
    ids: np.ndarray,
    src_node: np.ndarray,
    coact: np.ndarray,
    count: np.ndarray,
    topology: Topology,
    dispatch: str,
) -> LayerProblem:
    """One layer's :class:`LayerProblem` from its picks ``ids`` int64 ``[T, k]``, the tokens' source nodes
    ``src_node`` int64 ``[T]``, co-activation counts ``coact`` ``[E, E]`` and replica counts ``count``
    int64 ``[E]``."""
    N, E = topology.num_nodes, coact.shape[0]
    valid = ids >= 0
    src_count = np.zeros((N, E))
    np.add.at(src_count, (np.broadcast_to(src_node[:, None], ids.shape)[valid], ids[valid]), 1.0)
    c = coact.copy()
    np.fill_diagonal(c, 0.0)
    P, m = topology.num_physical_experts, topology.gpus_per_node
    return LayerProblem(ids, src_node, c, src_count, count, N, P // N, m, dispatch)


def _group_layer(
    prob: LayerProblem, cap: float, refine: bool, per_layer_t: float, seed: int, bw: float, S: int
) -> dict:
    """Node grouping of one layer: agglomerate, then (``refine``) CP-SAT and swaps; the result is never
    worse than the start on (node-load cap exceeded, fitted remote nodes), compared in that order.

    Returns:
        dict of ``member0`` / ``member`` bool ``[E, N]`` (start, result), ``reps`` int64 ``[E, N]``,
        ``obj0`` / ``obj`` fitted remote nodes per token, ``loads`` float64 ``[N]``, ``cap_met0``
        (the start met the cap) and ``cpsat_status``.
    """
    has_tokens = prob.ids.size > 0
    member0, extra = agglomerate(prob, cap, seed=seed, num_classes=S)
    reps0 = reps_from_member(prob, member0, extra)
    obj0 = float(expected_remote_nodes(prob, reps0).mean()) if has_tokens else 0.0
    member, cp_status = member0, "skipped"
    if refine:
        member, cp_status = refine_cpsat(
            prob, member0, extra, cap, 0.3 * per_layer_t, seed=seed, num_classes=S
        )
        member = swap_search(
            prob, member, extra, cap, 0.4 * per_layer_t, seed=seed, balance_weight=bw, num_classes=S
        )
    reps = reps_from_member(prob, member, extra)
    obj = float(expected_remote_nodes(prob, reps).mean()) if has_tokens else 0.0
    loads0, loads = node_loads(prob, reps0), node_loads(prob, reps)
    # never worse than the heuristic start: (cap excess, objective) compared in that order
    key0 = (max(0.0, loads0.max() - cap) > 1e-9 * cap, obj0)
    key1 = (max(0.0, loads.max() - cap) > 1e-9 * cap, obj)
    if key1[0] and loads.max() > loads0.max():
        key1 = (True, np.inf)
    if key1 > key0:
        reps, obj, loads, member = reps0, obj0, loads0, member0
    return {
        "member0": member0,
        "member": member,
        "reps": reps,
        "obj0": obj0,
        "obj": obj,
        "loads": loads,
        "cap_met0": bool(not key0[0]),
        "cpsat_status": cp_status,
    }


def _greedy_objective(g_prob: LayerProblem, g_row: np.ndarray, topology: Topology) -> float:
    """Fitted remote nodes per token of greedy's row ``g_row`` int64 ``[P]`` (the layer's baseline)."""
    g_reps = np.zeros((g_prob.num_experts, topology.num_nodes), dtype=np.int64)
    np.add.at(g_reps, (g_row, topology.node_of_slot), 1)
    return float(expected_remote_nodes(g_prob, g_reps).mean()) if g_prob.ids.size else 0.0


def _layer_report(
    layer_id: int, prob: LayerProblem, cap: float, found: dict, g_obj: float, mean_load: float, tl: float
) -> LayerReport:
    """The layer's report from :func:`_group_layer`'s result ``found`` (``tl``: the layer's start time)."""
    mean, loads = prob.mean_node_load, found["loads"]
    return LayerReport(
        layer_id=layer_id,
        status="heuristic",
        objective=found["obj"],
        bound=0.0,
        wall_time_s=time.perf_counter() - tl,
        baseline_objective=g_obj,
        mean_load=mean_load,
        extra={
            "heuristic_objective": found["obj0"],
            "heuristic_cap_met": found["cap_met0"],
            "node_load_ratio": float(loads.max() / mean) if mean > 0 else 1.0,
            "node_load_cap_met": bool(loads.max() <= cap + 1e-9),
            "cpsat_status": found["cpsat_status"],
            "pair_objective_start": pair_objective(prob, found["member0"]),
            "pair_objective": pair_objective(prob, found["member"]),
        },
    )


def _grouped_notes(
    placement: Placement,
    trace: RoutingTrace,
    reports: list[LayerReport],
    how: str,
    balance_slack: float,
    dispatch: str,
    hidden_size: int | None,
) -> list[str]:
    """The report's notes: sources, what the objective is, layers over the cap, fitted bytes per token."""
    notes = [
        f"source ranks: {how}",
        "objective = fitted expected remote nodes per token (local dispatch model)",
    ]
    missed = [r.layer_id for r in reports if not r.extra["node_load_cap_met"]]
    if missed:
        notes.append(f"node-load cap (1+{balance_slack}) not met in layers {missed}: best effort")
    if hidden_size is not None:
        cm = communication(placement, trace, dispatch, hidden_size=hidden_size)
        notes.append(f"fitted bytes_per_token={cm['bytes_per_token']:.0f} (hidden_size={hidden_size})")
    return notes
