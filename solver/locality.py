"""Communication-aware placement: keep co-activated experts on one node, cut cross-node dispatch.

Shapes: L layers, E logical experts, P physical slots, G GPUs (EP ranks), N nodes, m = G / N GPUs per
node, S = P / G slots per GPU, T tokens, k top-k.

Per layer, three steps (node-level details in :mod:`solver.locality_partition`):

1. Replicate: replica counts ``c [E]`` from the greedy balancer (:func:`solver.greedy.greedy_replica_counts`).
   Expert ``e`` lives on ``min(c_e, N)`` different nodes, so a hot expert's replicas spread over nodes
   and more tokens find one on their own node.
2. Group experts onto nodes: maximise co-activation inside nodes (graph heuristic, CP-SAT, token-level
   swaps) with exactly ``P / N`` slots per node and every node's load (``local`` policy, tokens' real
   source ranks) at most ``(1 + balance_slack)`` times the mean node load.
3. Pack each node's replicas onto its ``m`` GPUs (LPT, then pairwise swaps), at most one replica of an
   expert per GPU, exactly ``S`` slots per GPU.

The placement is meant to be served and scored with the ``local`` replica-selection policy (own GPU,
else own node, else spread over all replicas), see :mod:`placement.metrics`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np

from placement.metrics import (
    balance_stats,
    communication,
    source_ranks,
    step_par,
    trace_gpu_load,
)
from placement.model import Placement
from placement.topology import Topology
from profiling.coactivation import coactivation_counts
from profiling.trace import RoutingTrace
from solver.budget import Budget
from solver.greedy import balanced_packing, greedy_placement, greedy_replica_counts
from solver.locality_partition import (
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

__all__ = [
    "DEFAULT_SLACKS",
    "coactivation_graph",
    "default_everywhere",
    "pack_node_gpus",
    "pareto",
    "solve_locality",
]

log = logging.getLogger(__name__)

DEFAULT_SLACKS = (0.0, 0.02, 0.05, 0.1)


def coactivation_graph(coact: np.ndarray, min_weight: float = 0.0):
    """Weighted co-activation graph of one layer (networkx).

    Args:
        coact: ``[E, E]`` pair counts (diagonal ignored).
        min_weight: drop edges with weight ``<= min_weight``.

    Returns:
        ``networkx.Graph`` with nodes ``0..E-1`` (attribute ``load`` = diagonal count) and edge attribute ``weight``.
    """
    import networkx as nx

    c = np.asarray(coact, dtype=np.float64)
    if c.ndim != 2 or c.shape[0] != c.shape[1]:
        raise ValueError(f"coact must be a square [E, E] matrix, got shape {c.shape}")
    g = nx.Graph()
    for e in range(c.shape[0]):
        g.add_node(e, load=float(c[e, e]))
    iu, ju = np.nonzero(np.triu(c, 1) > min_weight)
    g.add_weighted_edges_from((int(i), int(j), float(c[i, j])) for i, j in zip(iu, ju))
    return g


def locality_replica_counts(
    load: np.ndarray, num_slots: int, num_nodes: int, max_replicas: int, headroom: float = 0.0
) -> np.ndarray:
    """Replica counts ``[L, E]`` that keep greedy's balance and spend spare slots on locality.

    1. ``c_e = ceil(w_e / (m* (1 + headroom)))`` where ``m*`` is the largest per-replica load of the
       greedy counts (:func:`solver.greedy.greedy_replica_counts`): no replica is more than ``headroom``
       heavier than greedy's heaviest.
    2. Spare slots raise experts, hottest first, to one replica on every node (``N`` replicas): under the
       ``local`` policy every token then finds such an expert on its own node, and each node serves
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
    """Replicas of node ``n`` as items: ``(expert int64 [r], load float64 [r])`` under ``prob.policy``."""
    member = reps > 0
    c = prob.count.astype(np.float64)
    if prob.policy == "even":
        per = prob.load / c  # [E]
        per_n = np.repeat(per[:, None], prob.num_nodes, axis=1)
    else:
        remote = (prob.src_count.T * ~member).sum(axis=1)  # [E]
        per_n = prob.src_count.T / np.maximum(reps, 1) + (remote / c)[:, None]  # [E, N]
    experts = np.repeat(np.arange(prob.num_experts), reps[:, n])
    return experts.astype(np.int64), per_n[experts, n]


def pack_node_gpus(
    experts: np.ndarray,
    loads: np.ndarray,
    num_gpus: int,
    max_rounds: int = 200,
    time_limit: float = 0.0,
    seed: int = 0,
) -> np.ndarray:
    """Pack one node's replicas onto its GPUs: exactly ``len/num_gpus`` each, distinct experts per GPU.

    LPT (:func:`solver.greedy.balanced_packing` with the expert as key), then pairwise swaps that lower
    the heaviest GPU, then (``time_limit > 0``) CP-SAT minimising the peak, hinted with that.

    Args:
        experts: int64 ``[r]`` logical expert of each replica; loads: float64 ``[r]`` (the replicas of one
            expert on a node split its load evenly, so they must carry equal loads).

    Returns:
        int64 ``[r]`` GPU (0..num_gpus-1 within the node) of each replica.
    """
    experts = np.asarray(experts, dtype=np.int64)
    loads = np.asarray(loads, dtype=np.float64)
    if experts.size:
        lo = np.full(int(experts.max()) + 1, np.inf)
        hi = np.full(lo.size, -np.inf)
        np.minimum.at(lo, experts, loads)
        np.maximum.at(hi, experts, loads)
        bad = np.flatnonzero(hi - lo > 1e-9 * np.maximum(np.abs(hi), 1.0))
        if bad.size:
            e = int(bad[0])
            raise ValueError(
                f"replicas of expert {e} carry unequal loads ({lo[e]:g} to {hi[e]:g}); a node splits "
                f"an expert's load evenly over its replicas: pass load / replicas for each"
            )
    pack, _ = balanced_packing(loads[None, :], num_gpus, item_key=experts[None, :])
    gpu = _swap_improve(experts, loads, pack[0].copy(), num_gpus, max_rounds)
    if time_limit > 0 and loads.size > num_gpus:
        gpu = _pack_cpsat(experts, loads, gpu, num_gpus, time_limit, seed)
    return gpu


def _pack_cpsat(experts, loads, gpu0, num_gpus, time_limit, seed):
    """CP-SAT packing of one node's replicas (min peak GPU load), hinted with ``gpu0``; never worse than it.

    The replicas of one expert carry equal loads (its node load split evenly), so this is
    :func:`solver.locality_replicated.pack_node_exact` with the replica counts fixed.
    """
    from solver.locality_replicated import pack_node_exact

    uniq, local, r = np.unique(experts, return_inverse=True, return_counts=True)
    base = np.bincount(local, weights=loads, minlength=uniq.size)[None, :]  # [1, n]
    per = loads.size // num_gpus
    hint = np.stack([np.sort(local[gpu0 == g]) for g in range(num_gpus)])  # [G, per] local expert indices
    _, slot_expert, _ = pack_node_exact(base, num_gpus, per, time_limit, seed=seed, hint=(r, hint), counts=r)
    gpu = np.empty(loads.size, dtype=np.int64)
    for i in range(uniq.size):  # replicas of expert i take its GPUs in order
        gpu[local == i] = np.flatnonzero((slot_expert == i).any(axis=1))
    return gpu


def _swap_improve(experts, loads, gpu, num_gpus, max_rounds):
    """Pairwise swaps that lower the heaviest GPU (keeps slot counts and distinct experts per GPU)."""
    for _ in range(max_rounds):
        gl = np.bincount(gpu, weights=loads, minlength=num_gpus)
        hi = int(gl.argmax())
        best = None
        for i in np.flatnonzero(gpu == hi):
            for j in np.flatnonzero(gpu != hi):
                d = loads[i] - loads[j]
                if d <= 1e-12:
                    continue
                o = gpu[j]
                new_peak = max(gl[hi] - d, gl[o] + d)
                if new_peak >= gl[hi] - 1e-12:
                    continue
                # distinct experts per GPU after the swap
                if experts[j] != experts[i] and (
                    np.any(experts[gpu == hi] == experts[j]) or np.any(experts[gpu == o] == experts[i])
                ):
                    continue
                if best is None or new_peak < best[0]:
                    best = (new_peak, i, j)
        if best is None:
            break
        _, i, j = best
        gpu[i], gpu[j] = gpu[j], gpu[i]
    return gpu


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


def _validate(
    trace: RoutingTrace, topology: Topology, balance_slack: float, policy: str, num_redundant
) -> None:
    if not isinstance(trace, RoutingTrace) or not trace.has_tokens:
        raise ValueError("the locality solver needs a per-token RoutingTrace (topk_ids), not counts only")
    E, P, G = trace.num_logical_experts, topology.num_physical_experts, topology.ep_size
    if E > P:
        raise ValueError(f"{E} logical experts do not fit in {P} physical slots; add {E - P} or more slots")
    if topology.slots_per_gpu > E:
        raise ValueError(
            f"{topology.slots_per_gpu} slots per GPU exceed the {E} experts; use at most {E * G - E} redundant experts"
        )
    if num_redundant is not None and int(num_redundant) != P - E:
        raise ValueError(
            f"num_redundant={num_redundant} disagrees with the topology ({P} slots - {E} experts = {P - E}); "
            f"build the topology with Topology.from_redundant({E}, {num_redundant}, ep_size, num_nodes)"
        )
    if not (0.0 <= balance_slack <= 10.0) or not np.isfinite(balance_slack):
        raise ValueError(
            f"balance_slack must be in [0, 10] (0.02 = node loads within 2% of the mean), got {balance_slack}"
        )
    if policy not in ("local", "even"):
        raise ValueError(f"policy must be 'local' or 'even', got {policy!r}")


def solve_locality(
    trace: RoutingTrace,
    topology: Topology,
    *,
    balance_slack: float = 0.02,
    policy: str = "local",
    time_limit: float = 10.0,
    seed: int = 0,
    layer_ids: Sequence[int] | None = None,
    num_redundant: int | None = None,
    refine: bool = True,
    hidden_size: int | None = None,
    comm_weight: float | None = None,
    replication: str = "locality",
    replica_headroom: float = 0.2,
    method: str = "replicated",
    num_everywhere: int | None = None,
    num_windows: int = 1,
    window_slack: float = 0.5,
    gpu_slack: float = 0.05,
    single_margin: int | None = 0,
    source_model: str = "auto",
    work_limit: int | None = None,
    share_margin: float | None = None,
    drift_z: float = 1.0,
    share_overload: float = 0.08,
) -> tuple[Placement, SolveReport]:
    """Communication-aware placement fitted on a per-token trace.

    Args:
        trace: per-token routing (``topk_ids [T, L, k]``); its ``source_rank`` is used when present,
            else prompts (or tokens) round-robin over the ``G`` attention-DP ranks (see report notes).
        topology: ``P`` slots over ``G`` GPUs over ``N`` nodes.
        balance_slack: node loads (expected tokens under ``policy``) at most ``(1 + slack) x`` the mean;
            the trade-off knob (larger: more locality, less balance).
        policy: replica-selection policy the placement will be served with (``local`` or ``even``).
        time_limit: seconds for the whole solve (split evenly over layers: CP-SAT and swap search).
        seed: seeds Louvain, CP-SAT and the swap search.
        layer_ids: the trace's layer ids to solve (default all).
        num_redundant: optional check against the topology's ``P - E``.
        refine: run CP-SAT and the token-level swap search after the heuristic.
        hidden_size: model hidden size; adds fitted ``bytes_per_token`` to the notes.
        comm_weight: None (default) minimises remote nodes under the hard balance cap; a number ``w > 0``
            also rewards node balance in the swap search: objective ``remote_nodes + (max/mean - 1) / w``
            (``method="grouped"`` only).
        method: ``"replicated"`` (default, ``local`` policy only; :mod:`solver.locality_replicated`): the
            ``num_everywhere`` experts get a replica on every node (the hottest, then traded for "hub"
            experts where that cuts remote nodes), the rest one node each, nodes packed exactly, then
            GPU peaks repaired against greedy's on every fit window.
            ``"grouped"``: the earlier scheme (greedy replica counts spread over nodes, co-activation
            grouping); also used for ``policy="even"``.
        num_everywhere: experts replicated on every node (each costs ``N - 1`` slots). Default: per layer,
            :func:`default_everywhere` (as many as the slots allow after splitting heavy experts and a
            packing margin, and no more than ``share_overload`` allows); DeepSeek-V2-Lite gets 12 at
            ep16/2 nodes, 8 at ep32/4 nodes, 2-4 at ep64/8 nodes with 2 slots per GPU, 8-10 (instead of
            13-15 by slots alone) with 3.
        share_overload: caps the default ``num_everywhere``: an everywhere replica serves its own node's
            tokens, so the busiest node's share of the tokens (``1 + d`` times the mean) puts ``d x`` the
            everywhere experts' share of the layer's load on that node on top of its fair share. Unseen
            traffic deals the shares anew, so ``d`` is what a random dealing of the fit trace's prompts gives
            on average (:func:`_expected_share_excess`: 0.38 for DeepSeek-V2-Lite's fit half at 8 nodes; the
            trace's own ranks when it has them; 0 for tokens dealt round-robin, where the cap never binds).
            The default keeps ``d x`` that share at most ``share_overload`` (0.08), a value calibrated at
            ep64/8 nodes with 3 slots per GPU on DeepSeek-V2-Lite, the only benchmark topology where it binds
            (``benchmarks/locality.py --ep 64 --redundant 128``, with ``--everywhere`` and
            ``--share-overload`` to sweep). With unequal shares, 0 gives no everywhere experts unless
            ``num_everywhere`` asks for them; 10 turns the cap off.
        num_windows: consecutive prompt groups of the fit trace used as extra balance views (node caps,
            GPU packing and repair). Default 1 (the fit total only): on DeepSeek-V2-Lite (8 layers, ep32 and
            ep64) 4 windows gave worse held-out PAR and more remote nodes, the packing fitting the
            windows' noise.
        window_slack: node-load cap on each window, ``(1 + window_slack) x`` that window's mean.
        gpu_slack: GPU peak cap on the fit total and every window: ``(1 + gpu_slack) x`` greedy's peak
            on the same view (0: no heavier than greedy where the search can reach it), both under the
            sources the solver fits with (``source_model``). Default 0.05: with the fit sources dealt evenly
            a tighter cap mostly forces cross-node swaps that cost remote nodes without lowering held-out
            PAR; ``benchmarks/locality.py --gpu-slack X`` shows the trade-off.
        source_model: attention-DP sources the solver fits with (scoring always uses the trace's or the
            dealt ones, see :func:`placement.metrics.source_ranks`). ``"auto"`` (default): the trace's own
            ranks when it has them; when prompts were dealt round-robin (no ranks in the trace), tokens
            dealt round-robin instead, so every rank has its expected, equal share. Prompt lengths vary so
            much that dealt prompts leave nodes with very different token shares (the report's first note
            prints the range: 19-31% on DeepSeek-V2-Lite's fit half at 4 nodes), unseen traffic deals
            them differently, and everywhere-replicated experts follow those shares; the imbalance also
            inflates greedy's fitted peak, which loosens the GPU caps. ``"trace"``: the scoring sources;
            ``"uniform"``: always deal tokens.
        work_limit: ``method="replicated"`` only: bound the searches by counted steps (about
            ``work_limit / L`` per layer: partition scans, kicks, repair steps; CP-SAT by its deterministic
            time) instead of ``time_limit``, so one seed gives one placement on any machine at any load.
            A step costs about 1-10 ms (more experts and nodes: more); ``time_limit`` is then ignored.
        share_margin: with two slots per GPU, everywhere replicas are paired as if
            ``(1 + share_margin) x`` their fitted load (their load follows their node's token share).
            None (default): the busiest node's token share over the mean, minus 1, under the scoring
            sources on the fit trace (dealt prompts: 0.34 on DeepSeek-V2-Lite's fit half at 8 nodes;
            0 when tokens are dealt, since shares are then equal).
        drift_z: with two slots per GPU, every single-node expert is paired as if its fitted load plus
            ``drift_z`` times its expected drift to unseen traffic (a bootstrap over the fit trace's
            prompts, :func:`_load_drift`), so experts whose load is uncertain get split or lighter
            partners. Default 1.0; 0 turns it off.
        single_margin: single-node experts per node at most ``ceil(n_single / N) + single_margin``
            (None: only the slot limit); 0 keeps spare slots on every node for splitting its heavy experts.

    Returns:
        (Placement, SolveReport). Per layer: ``objective`` = fitted expected remote nodes per token,
        ``baseline_objective`` = the same for the greedy placement, ``bound`` = 0 (no useful bound);
        ``extra`` has the heuristic start, node-load ratio, CP-SAT status and pair objectives.
    """
    t0 = time.perf_counter()
    _validate(trace, topology, balance_slack, policy, num_redundant)
    if comm_weight is not None and not (comm_weight > 0):
        raise ValueError(f"comm_weight must be > 0 (or None for a hard balance cap only), got {comm_weight}")
    if layer_ids is not None:
        want = [int(x) for x in layer_ids]
        missing = [x for x in want if x not in trace.layer_ids]
        if missing:
            raise ValueError(f"layer ids {missing} are not in the trace (it has {list(trace.layer_ids)})")
        trace = trace.select_layers([trace.layer_ids.index(x) for x in want])
    if method not in ("replicated", "grouped"):
        raise ValueError(f"method must be 'replicated' or 'grouped', got {method!r}")
    if work_limit is not None and not (method == "replicated" and policy == "local"):
        raise ValueError(
            f"work_limit applies to method='replicated' with policy='local' only (got method={method!r}, "
            f"policy={policy!r}); use time_limit"
        )
    if method == "replicated" and policy == "local":
        return _solve_replicated(
            trace,
            topology,
            balance_slack=balance_slack,
            time_limit=time_limit,
            seed=seed,
            num_everywhere=num_everywhere,
            num_windows=num_windows,
            window_slack=window_slack,
            gpu_slack=gpu_slack,
            hidden_size=hidden_size,
            t0=t0,
            single_margin=single_margin,
            source_model=source_model,
            work_limit=work_limit,
            share_margin=share_margin,
            drift_z=drift_z,
            share_overload=share_overload,
        )
    E, P, G, N = (
        trace.num_logical_experts,
        topology.num_physical_experts,
        topology.ep_size,
        topology.num_nodes,
    )
    m, S = topology.gpus_per_node, topology.slots_per_gpu
    L = trace.num_layers
    src, how = source_ranks(trace, G)
    src_node = src // m
    load = trace.counts().astype(np.float64)  # [L, E]
    if replication == "locality":
        counts = locality_replica_counts(load, P, N, G, replica_headroom)  # [L, E]
    elif replication == "greedy":
        counts = greedy_replica_counts(load, P, max_replicas=G)  # [L, E]
    else:
        raise ValueError(f"replication must be 'locality' or 'greedy', got {replication!r}")
    greedy, _ = greedy_placement(load, topology, layer_ids=trace.layer_ids)
    coact = coactivation_counts(trace).astype(np.float64)  # [L, E, E]
    per_layer_t = max(float(time_limit), 0.0) / max(L, 1)
    bw = 0.0 if comm_weight is None else 1.0 / float(comm_weight)
    rows = np.empty((L, P), dtype=np.int64)
    reports = []
    for l in range(L):
        tl = time.perf_counter()
        ids = trace.topk_ids[:, l, :].astype(np.int64)  # [T, k]
        valid = ids >= 0
        src_count = np.zeros((N, E))
        np.add.at(src_count, (np.broadcast_to(src_node[:, None], ids.shape)[valid], ids[valid]), 1.0)
        c = coact[l].copy()
        np.fill_diagonal(c, 0.0)
        prob = LayerProblem(ids, src_node, c, src_count, counts[l].astype(np.int64), N, P // N, m, policy)
        cap = (1.0 + balance_slack) * prob.mean_node_load
        member0, extra = agglomerate(prob, cap, seed=seed + l, num_classes=S)
        reps0 = reps_from_member(prob, member0, extra)
        obj0 = float(expected_remote_nodes(prob, reps0).mean()) if ids.size else 0.0
        member, cp_status = member0, "skipped"
        if refine:
            member, cp_status = refine_cpsat(
                prob, member0, extra, cap, 0.3 * per_layer_t, seed=seed + l, num_classes=S
            )
            member = swap_search(
                prob, member, extra, cap, 0.4 * per_layer_t, seed=seed + l, balance_weight=bw, num_classes=S
            )
        reps = reps_from_member(prob, member, extra)
        obj = float(expected_remote_nodes(prob, reps).mean()) if ids.size else 0.0
        loads0, loads = node_loads(prob, reps0), node_loads(prob, reps)
        # never worse than the heuristic start: (cap excess, objective) compared in that order
        key0 = (max(0.0, loads0.max() - cap) > 1e-9 * cap, obj0)
        key1 = (max(0.0, loads.max() - cap) > 1e-9 * cap, obj)
        if key1[0] and loads.max() > loads0.max():
            key1 = (True, np.inf)
        if key1 > key0:
            reps, obj, loads, member = reps0, obj0, loads0, member0
        rows[l] = _layer_row(prob, reps, topology, 0.2 * per_layer_t if refine else 0.0, seed + l)
        g_reps = np.zeros((E, N), dtype=np.int64)
        np.add.at(g_reps, (greedy.physical_to_logical_map[l], topology.node_of_slot), 1)
        g_prob = LayerProblem(
            ids, src_node, c, src_count, greedy.logical_replica_count[l], N, P // N, m, policy
        )
        g_obj = float(expected_remote_nodes(g_prob, g_reps).mean()) if ids.size else 0.0
        mean = prob.mean_node_load
        reports.append(
            LayerReport(
                layer_id=trace.layer_ids[l],
                status="heuristic",
                objective=obj,
                bound=0.0,
                wall_time_s=time.perf_counter() - tl,
                baseline_objective=g_obj,
                mean_load=float(load[l].sum() / G),
                extra={
                    "heuristic_objective": obj0,
                    "heuristic_cap_met": bool(not key0[0]),
                    "node_load_ratio": float(loads.max() / mean) if mean > 0 else 1.0,
                    "node_load_cap_met": bool(loads.max() <= cap + 1e-9),
                    "cpsat_status": cp_status,
                    "pair_objective_start": pair_objective(prob, member0),
                    "pair_objective": pair_objective(prob, member),
                },
            )
        )
    params = {
        "balance_slack": balance_slack,
        "policy": policy,
        "time_limit": time_limit,
        "seed": seed,
        "refine": refine,
        "comm_weight": comm_weight,
        "replication": replication,
        "replica_headroom": replica_headroom,
        "hidden_size": hidden_size,
        "source_ranks": how,
    }
    placement = Placement(
        rows, E, topology, trace.layer_ids, {"solver": "locality", **params, "trace": trace.name}
    )
    notes = [
        f"source ranks: {how}",
        "objective = fitted expected remote nodes per token (local policy model)",
    ]
    missed = [r.layer_id for r in reports if not r.extra["node_load_cap_met"]]
    if missed:
        notes.append(f"node-load cap (1+{balance_slack}) not met in layers {missed}: best effort")
    if hidden_size is not None:
        cm = communication(placement, trace, policy, hidden_size=hidden_size)
        notes.append(f"fitted bytes_per_token={cm['bytes_per_token']:.0f} (hidden_size={hidden_size})")
    report = SolveReport("locality", tuple(reports), time.perf_counter() - t0, params, tuple(notes))
    log.debug("locality: %d layers in %.2fs", L, report.wall_time_s)
    return placement, report


def _window_of_tokens(trace: RoutingTrace, num_windows: int) -> np.ndarray:
    """int64 ``[T]``: consecutive prompt groups (or token chunks without prompt boundaries), ``0..W-1``."""
    T = trace.num_tokens
    W = max(1, int(num_windows))
    if trace.seq_offsets is not None and trace.seq_offsets.size - 1 >= W:
        off = trace.seq_offsets
        n = off.size - 1
        return np.repeat((np.arange(n) * W) // n, np.diff(off)).astype(np.int64)
    return (np.arange(T) * W // max(T, 1)).astype(np.int64)


def default_everywhere(
    load: np.ndarray,
    num_slots: int,
    num_nodes: int,
    gpus_per_node: int,
    margin: float = 0.25,
    share_excess: float = 0.0,
    share_overload: float = np.inf,
) -> int:
    """Default number of everywhere experts of one layer: the most the spare slots can pay for.

    Each everywhere expert costs ``N - 1`` slots. The spare slots ``R = P - E`` must also pay for splitting
    every single-node expert heavier than a GPU's mean load ``g = sum(load) / G`` into
    ``ceil(load / g)`` replicas on its node, plus ``margin x G`` slots left for the exact packing. Returns
    the largest ``h`` (hottest first) with ``(N - 1) h + splits(h) + margin G <= R`` and
    ``share_excess x (load share of the h hottest) <= share_overload``, 0 if none.

    Args:
        load: float64 ``[E]`` fitted picks per expert.
        share_excess: ``d``: the busiest node's token share over the mean, minus 1 (everywhere replicas
            serve their own node's tokens, so that node gets ``d x`` their load share on top of its fair
            share); share_overload: the most of that allowed (see :func:`solve_locality`).
    """
    w = np.asarray(load, dtype=np.float64)
    E, N, m = w.size, int(num_nodes), int(gpus_per_node)
    G, R = N * m, int(num_slots) - w.size
    if N < 2 or w.sum() <= 0:
        return 0
    g = w.sum() / G
    order = np.argsort(-w, kind="stable")
    top = np.concatenate([[0.0], np.cumsum(w[order])]) / w.sum()  # load share of the h hottest
    best = 0
    for h in range(0, min(R // (N - 1), E) + 1):
        splits = np.maximum(np.ceil(w[order[h:]] / g - 1e-9) - 1, 0).sum()
        if (N - 1) * h + splits + margin * G <= R and max(float(share_excess), 0.0) * top[
            h
        ] <= share_overload + 1e-12:
            best = h
    return best


def _load_drift(trace: RoutingTrace, seed: int = 0, draws: int = 64) -> np.ndarray:
    """Expected change of each expert's load from the fit trace to unseen traffic: float64 ``[L, E]``.

    Bootstrap over the trace's natural windows (prompts, else steps; 64-token chunks when it has fewer
    than two): the standard deviation of an expert's share of the picks over ``draws`` resamples of the
    windows, in picks of the fit trace, times ``sqrt(2)`` (the fit total and the unseen traffic are two
    independent samples).
    """
    T, L, _ = trace.topk_ids.shape
    E = trace.num_logical_experts
    bounds = trace.natural_windows()
    if len(bounds) > 1:
        unit = np.repeat(np.arange(len(bounds)), [b - a for a, b in bounds])
    else:
        unit = np.arange(T) // 64
    U = int(unit.max()) + 1 if T else 0
    out = np.zeros((L, E))
    if U < 2:
        return out
    rng = np.random.default_rng(seed)
    w = rng.multinomial(U, np.full(U, 1.0 / U), size=draws).astype(np.float64)  # [B, U]
    for l in range(L):
        ids = trace.topk_ids[:, l, :]
        v = ids >= 0
        uu = np.broadcast_to(unit[:, None], ids.shape)[v]
        cnt = np.bincount(uu * E + ids[v].astype(np.int64), minlength=U * E).reshape(U, E).astype(np.float64)
        draw = w @ cnt  # [B, E]
        share = draw / np.maximum(draw.sum(axis=1, keepdims=True), 1.0)
        out[l] = share.std(axis=0) * cnt.sum() * np.sqrt(2.0)
    return out


def _node_shares(src: np.ndarray, gpus_per_node: int, num_nodes: int) -> np.ndarray:
    """Share of the tokens each node's ranks hold: float64 ``[N]`` from source ranks ``src`` int64 ``[T]``."""
    return np.bincount(src // int(gpus_per_node), minlength=int(num_nodes)) / max(src.size, 1)


def _share_excess(src: np.ndarray, gpus_per_node: int, num_nodes: int) -> float:
    """The busiest node's token share over the mean, minus 1, under source ranks ``src`` int64 ``[T]``."""
    return (
        float(_node_shares(src, gpus_per_node, num_nodes).max() * int(num_nodes) - 1.0) if src.size else 0.0
    )


def _dealt_prompt_ranks(num_prompts: int, ep_size: int, rng: np.random.Generator) -> np.ndarray:
    """Rank of every prompt, int64 ``[U]``, when prompts in a random order are dealt round-robin."""
    rank = np.empty(int(num_prompts), dtype=np.int64)
    rank[rng.permutation(int(num_prompts))] = np.arange(int(num_prompts)) % int(ep_size)
    return rank


def _expected_share_excess(
    trace: RoutingTrace,
    src: np.ndarray,
    how: str,
    gpus_per_node: int,
    num_nodes: int,
    seed: int = 0,
    draws: int = 64,
) -> float:
    """The busiest node's token share over the mean, minus 1, that unseen traffic should be expected to give.

    Prompts dealt round-robin (``how == "round-robin by prompt"``): the mean over ``draws`` random orders of
    the fit trace's prompts dealt round-robin to the ranks (the realized dealing is one draw of that; on
    DeepSeek-V2-Lite's halves at 8 nodes it was 0.34 and 0.61 where the mean is 0.38 and 0.36). Otherwise the
    shares under ``src`` int64 ``[T]`` (the trace's own ranks; 0 for tokens dealt round-robin).
    """
    N, m = int(num_nodes), int(gpus_per_node)
    if not src.size:
        return 0.0
    if how != "round-robin by prompt" or trace.seq_offsets is None:
        return _share_excess(src, m, N)
    lengths = np.diff(trace.seq_offsets).astype(np.float64)  # [U]
    rng = np.random.default_rng(seed)
    out = 0.0
    for _ in range(int(draws)):
        rank = _dealt_prompt_ranks(lengths.size, N * m, rng)
        share = np.bincount(rank // m, weights=lengths, minlength=N) / lengths.sum()
        out += float(share.max() * N - 1.0)
    return out / int(draws)


def _fit_sources(
    src: np.ndarray, how: str, source_model: str, ep_size: int, gpus_per_node: int = 1
) -> tuple[np.ndarray, str]:
    """Source ranks the solver fits with: int64 ``[T]`` and a description.

    ``"auto"``: the trace's own ranks when it has them; when they were made up by dealing prompts
    round-robin, tokens round-robin instead. Prompt lengths vary a lot (one long conversation can hold
    a rank's tokens for the whole trace), so the dealt ranks' token shares are an accident of the fit
    trace that unseen traffic does not repeat; dealing tokens gives every rank its expected, equal share.
    ``"trace"``: exactly the scoring ranks. ``"uniform"``: always tokens round-robin. The description
    gives the range of the replaced sources' per-node token shares.
    """
    if source_model not in ("auto", "trace", "uniform"):
        raise ValueError(f"source_model must be 'auto', 'trace' or 'uniform', got {source_model!r}")
    if source_model == "trace" or (source_model == "auto" and how in ("trace", "round-robin by token")):
        return src, how
    share = _node_shares(src, gpus_per_node, int(ep_size) // int(gpus_per_node))
    return (
        np.arange(src.size, dtype=np.int64) % int(ep_size),
        f"{how} (node token shares {share.min():.0%}-{share.max():.0%}); fitted with tokens round-robin "
        f"(equal shares)",
    )


def _solve_replicated(
    trace,
    topology,
    *,
    balance_slack,
    time_limit,
    seed,
    num_everywhere,
    num_windows,
    window_slack,
    gpu_slack,
    hidden_size,
    t0,
    single_margin,
    source_model,
    work_limit=None,
    share_margin=None,
    drift_z=1.0,
    share_overload=0.08,
) -> tuple[Placement, SolveReport]:
    """``method="replicated"`` of :func:`solve_locality` (policy ``local``)."""
    from solver.locality_replicated import remote_nodes_fit, solve_replicated_layer

    E, P, G, N = (
        trace.num_logical_experts,
        topology.num_physical_experts,
        topology.ep_size,
        topology.num_nodes,
    )
    m, L = topology.gpus_per_node, trace.num_layers
    if not (0.0 <= window_slack <= 10.0):
        raise ValueError(f"window_slack must be in [0, 10], got {window_slack}")
    if not (-0.5 < gpu_slack <= 10.0):
        raise ValueError(f"gpu_slack must be in (-0.5, 10], got {gpu_slack}")
    if int(num_windows) < 1:
        raise ValueError(f"num_windows must be >= 1, got {num_windows}")
    if work_limit is not None and int(work_limit) < 1:
        raise ValueError(
            f"work_limit must be >= 1 search steps (or None to use time_limit), got {work_limit}"
        )
    h_max = (P - E) // (N - 1) if N > 1 else E
    if num_everywhere is not None:
        h = int(num_everywhere)
        if h < 0 or h > h_max:
            raise ValueError(
                f"num_everywhere={h} must be in [0, {h_max}] ({P - E} redundant slots, {N} nodes)"
            )
    if not (0.0 <= float(share_overload) <= 10.0):
        raise ValueError(
            f"share_overload must be in [0, 10] (0.08: the busiest node's extra token share times the "
            f"everywhere experts' load share at most 8%), got {share_overload}"
        )
    src, how = source_ranks(trace, G)
    if share_margin is None:  # the busiest node's token share under the scoring sources, over the mean
        share_margin = _share_excess(src, m, N)
    elif not (0.0 <= float(share_margin) <= 10.0):
        raise ValueError(
            f"share_margin must be in [0, 10] (0.3 = pair everywhere replicas as 30% heavier), "
            f"got {share_margin}"
        )
    if not (0.0 <= float(drift_z) <= 10.0):
        raise ValueError(
            f"drift_z must be in [0, 10] (1 = pair single-node experts at their fitted load plus one "
            f"expected drift), got {drift_z}"
        )
    src_scoring, how_scoring = src, how
    src, how = _fit_sources(src, how, source_model, G, m)
    src_node = src // m
    win = _window_of_tokens(trace, num_windows)
    W = int(win.max()) + 1 if win.size else 1
    load = trace.counts().astype(np.float64)
    greedy, _ = greedy_placement(load, topology, layer_ids=trace.layer_ids)
    # greedy's GPU peaks on the fit total and on every window: the GPU caps (same policy, same sources)
    g_views = [trace_gpu_load(greedy, trace, "local", src=src)]
    if W > 1:
        for w in range(W):
            idx = np.flatnonzero(win == w)
            sub = trace.slice_tokens(int(idx[0]), int(idx[-1]) + 1)
            g_views.append(trace_gpu_load(greedy, sub, "local", src=src[idx]))
    g_peak = np.stack([v.max(axis=1) for v in g_views], axis=1)  # [L, V]
    per_layer = max(float(time_limit), 0.0) / max(L, 1)
    rows = np.empty((L, P), dtype=np.int64)
    reports = []
    # expected share excess of unseen traffic: only the default everywhere count needs it
    share_excess = (
        None
        if num_everywhere is not None
        else _expected_share_excess(trace, src_scoring, how_scoring, m, N, seed)
    )
    hs = [
        int(num_everywhere)
        if num_everywhere is not None
        else default_everywhere(
            load[l], P, N, m, share_excess=share_excess, share_overload=float(share_overload)
        )
        for l in range(L)
    ]
    # expected load drift of every expert (used by the two-slot pairing, which runs on one view only)
    pairs = topology.slots_per_gpu == 2 and W == 1
    drift = _load_drift(trace, seed) * float(drift_z) if drift_z and pairs else None  # [L, E]
    for l in range(L):
        tl = time.perf_counter()
        ids = trace.topk_ids[:, l, :].astype(np.int64)
        if work_limit is None:  # seconds
            b_part, b_pack, b_rep = 0.6 * per_layer, 0.2 * per_layer / N, 0.2 * per_layer
        else:  # counted steps: the same placement on any machine
            wl = int(work_limit) / max(L, 1)
            b_part, b_pack, b_rep = (Budget(0.0, max(int(round(f * wl)), 1)) for f in (0.6, 0.2 / N, 0.2))
        row, info = solve_replicated_layer(
            ids,
            src_node,
            win,
            W,
            E,
            topology,
            hs[l],
            balance_slack,
            b_part,
            seed=seed + l,
            window_slack=window_slack,
            pack_time=b_pack,
            gpu_cap=g_peak[l] * (1.0 + gpu_slack),
            repair_time=b_rep,
            single_margin=single_margin,
            share_margin=share_margin,
            drift=None if drift is None else drift[l],
        )
        rows[l] = row
        on_node = np.zeros((E, N), dtype=bool)
        on_node[row, topology.node_of_slot] = True
        every = on_node.all(axis=1)
        node_of = on_node.argmax(axis=1)
        obj = float(remote_nodes_fit(node_of, every, ids, src_node, N).mean()) if ids.size else 0.0
        reports.append(
            LayerReport(
                layer_id=trace.layer_ids[l],
                status="heuristic",
                objective=obj,
                bound=0.0,
                wall_time_s=time.perf_counter() - tl,
                baseline_objective=None,
                mean_load=float(load[l].sum() / G),
                extra=info,
            )
        )
    params = {
        "balance_slack": balance_slack,
        "policy": "local",
        "time_limit": time_limit,
        "seed": seed,
        "work_limit": work_limit,
        "share_margin": round(float(share_margin), 4),
        "drift_z": float(drift_z),
        "share_overload": float(share_overload),
        "share_excess": None if share_excess is None else round(share_excess, 4),
        "method": "replicated",
        "num_everywhere": hs[0]
        if num_everywhere is not None
        else f"auto ({min(hs)}-{max(hs)}, mean {np.mean(hs):.1f})",
        "num_windows": W,
        "window_slack": window_slack,
        "gpu_slack": gpu_slack,
        "single_margin": single_margin,
        "source_model": source_model,
        "hidden_size": hidden_size,
        "source_ranks": how,
    }
    placement = Placement(
        rows, E, topology, trace.layer_ids, {"solver": "locality", **params, "trace": trace.name}
    )
    g_comm = communication(greedy, trace, "local", src=src, hidden_size=hidden_size)
    comm = communication(placement, trace, "local", src=src, hidden_size=hidden_size)
    h_txt = str(hs[0]) if len(set(hs)) == 1 else f"{min(hs)}-{max(hs)} (per layer)"
    fitted = (
        f"method replicated: {h_txt} experts on every node; fitted remote_nodes_per_token "
        f"{comm['remote_nodes_per_token']:.3f} vs greedy {g_comm['remote_nodes_per_token']:.3f}"
    )
    notes = [f"source ranks: {how}", fitted]
    if hidden_size is not None:
        notes.append(f"fitted bytes_per_token={comm['bytes_per_token']:.0f} (hidden_size={hidden_size})")
    over = [r.layer_id for r in reports if r.extra.get("excess_end", 0.0) > 1e-9]
    if over:
        notes.append(
            f"GPU peak above (1+{gpu_slack}) x greedy's on some fit view in layers {over}: best effort"
        )
    report = SolveReport("locality", tuple(reports), time.perf_counter() - t0, params, tuple(notes))
    return placement, report


def _score(
    placement: Placement, held: RoutingTrace, policy: str, step_tokens: int, hidden_size: int | None
) -> dict:
    bal = balance_stats(trace_gpu_load(placement, held, policy))
    comm = communication(placement, held, policy, hidden_size=hidden_size)
    sp = step_par(placement, held, step_tokens, policy)
    row = {
        "policy": policy,
        "par": bal["par"],
        "par_worst": bal["par_worst"],
        "step_par": sp["step_par"],
        "remote_nodes_per_token": comm["remote_nodes_per_token"],
        "remote_gpus_per_token": comm["remote_gpus_per_token"],
        "source_ranks": comm["source_ranks"],
    }
    if hidden_size is not None:
        row["bytes_per_token"] = comm["bytes_per_token"]
    return row


def pareto(
    fit_trace: RoutingTrace,
    held_trace: RoutingTrace,
    topology: Topology,
    slacks: Sequence[float] = DEFAULT_SLACKS,
    policy: str = "local",
    seed: int = 0,
    time_limit: float = 10.0,
    hidden_size: int | None = None,
    step_tokens: int = 16,
    refine: bool = True,
    options: dict | None = None,
    variants: Sequence[dict] | None = None,
    redeal: int = 0,
) -> list[dict]:
    """Held-out trade-off table: greedy (``policy`` and ``even``), trivial, and locality at each slack.

    Fits on ``fit_trace`` and scores on ``held_trace`` with :mod:`placement.metrics`; ``options`` go to
    :func:`solve_locality` (e.g. ``replica_headroom``). ``variants``: option dicts (merged over ``options``)
    each solved at every slack, e.g. ``[{"num_everywhere": 4}, {"num_everywhere": 6}]``; each row then has
    ``variant`` (the dict's items as text).

    Returns:
        list of dicts with ``placement``, ``slack``, ``policy``, ``par``, ``par_worst``, ``step_par``,
        ``remote_nodes_per_token``, ``remote_gpus_per_token``, ``bytes_per_token`` (with ``hidden_size``),
        ``par_vs_greedy`` and ``nodes_vs_greedy`` (ratios to greedy under the same policy),
        ``solve_s``. With ``redeal=K`` (held-out prompts dealt round-robin, no recorded ranks) also
        ``par_vs_greedy_redealt`` and ``par_vs_greedy_redealt_max``: the mean and the largest PAR ratio to
        greedy over ``K`` random re-orderings of the held-out prompts before dealing them (which ranks
        the long requests land on moves held-out PAR by a percent or two at 8 nodes).
    """
    if (
        fit_trace.num_logical_experts != held_trace.num_logical_experts
        or fit_trace.layer_ids != held_trace.layer_ids
    ):
        raise ValueError("fit and held-out traces must have the same experts and layers")
    if int(redeal) < 0:
        raise ValueError(f"redeal must be >= 0 re-dealings, got {redeal}")
    rows: list[dict] = []
    placements: list[Placement] = []
    t = time.perf_counter()
    greedy, _ = greedy_placement(fit_trace.counts(), topology, layer_ids=fit_trace.layer_ids)
    g_s = time.perf_counter() - t
    base = _score(greedy, held_trace, policy, step_tokens, hidden_size)
    rows.append({"placement": "greedy", "slack": None, **base, "solve_s": g_s})
    placements.append(greedy)
    if policy != "even":
        rows.append(
            {
                "placement": "greedy",
                "slack": None,
                **_score(greedy, held_trace, "even", step_tokens, hidden_size),
                "solve_s": g_s,
            }
        )
        placements.append(greedy)
    triv = Placement.trivial(
        fit_trace.num_layers, fit_trace.num_logical_experts, topology, fit_trace.layer_ids
    )
    rows.append(
        {
            "placement": "trivial",
            "slack": None,
            **_score(triv, held_trace, policy, step_tokens, hidden_size),
            "solve_s": 0.0,
        }
    )
    placements.append(triv)
    for var in variants or [{}]:
        opts = {**dict(options or {}), **dict(var)}
        label = " ".join(f"{k}={v}" for k, v in var.items())
        for s in slacks:
            pl, rep = solve_locality(
                fit_trace,
                topology,
                balance_slack=float(s),
                policy=policy,
                time_limit=time_limit,
                seed=seed,
                refine=refine,
                **opts,
            )
            rows.append(
                {
                    "placement": "locality",
                    "slack": float(s),
                    "variant": label,
                    **_score(pl, held_trace, policy, step_tokens, hidden_size),
                    "solve_s": rep.wall_time_s,
                    "num_everywhere": rep.params.get("num_everywhere"),
                }
            )
            placements.append(pl)
    if redeal and held_trace.source_rank is None and held_trace.seq_offsets is not None:
        rng = np.random.default_rng(seed)
        lengths = np.diff(held_trace.seq_offsets)
        G = topology.ep_size
        ratios = np.zeros((len(rows), int(redeal)))
        for k in range(int(redeal)):
            src = np.repeat(_dealt_prompt_ranks(lengths.size, G, rng), lengths)
            par_k = np.array(
                [
                    balance_stats(trace_gpu_load(p, held_trace, r["policy"], src=src))["par"]
                    for r, p in zip(rows, placements)
                ]
            )
            ratios[:, k] = par_k / par_k[0] if par_k[0] > 0 else 1.0  # row 0: greedy under ``policy``
        for r, x in zip(rows, ratios):
            r["par_vs_greedy_redealt"] = float(x.mean())
            r["par_vs_greedy_redealt_max"] = float(x.max())
    for r in rows:
        r["par_vs_greedy"] = r["par"] / base["par"] if base["par"] > 0 else 1.0
        r["nodes_vs_greedy"] = (
            r["remote_nodes_per_token"] / base["remote_nodes_per_token"]
            if base["remote_nodes_per_token"] > 0
            else 1.0
        )
    return rows
