"""Communication-aware placement: keep co-activated experts on one node, cut cross-node dispatch.

Shapes: L layers, E logical experts, P physical slots, G GPUs (EP ranks), N nodes, m = G / N GPUs per
node, S = P / G slots per GPU, T tokens, k top-k.

Per layer, three steps:

1. Replicate: how many replicas each expert gets and on how many nodes. The default method
   (``replicated``) puts the ``h`` experts that save the most remote nodes on every node and every
   other expert on one node; ``grouped`` spreads greedy's replica counts over ``min(c_e, N)`` nodes.
2. Group experts onto nodes: maximise co-activation inside nodes (fewer remote nodes per token) with
   exactly ``P / N`` slots per node and every node's load (``local`` policy, tokens' real source ranks)
   at most ``(1 + balance_slack)`` times the mean node load.
3. Pack each node's replicas onto its ``m`` GPUs (LPT, pairs or CP-SAT), at most one replica of an
   expert per GPU, exactly ``S`` slots per GPU; ``replicated`` then repairs GPU peaks against greedy's.

The placement is meant to be served and scored with the ``local`` replica-selection policy (own GPU,
else own node, else spread over all replicas), see :mod:`placement.metrics`.

Where the pieces live (this module is the public entry; import from here):

- :mod:`solver.locality_options`: :class:`LocalityOptions`, every option documented.
- :mod:`solver.locality_fit`: ``method="replicated"`` over all layers; one layer in
  :mod:`solver.locality_replicated` (node partition :mod:`solver.locality_nodes`, GPU repair
  :mod:`solver.locality_repair`, remote-node accounting :mod:`solver.locality_reach`).
- :mod:`solver.locality_grouped`: ``method="grouped"``; its node stages in :mod:`solver.locality_partition`.
- :mod:`solver.locality_pack`: packing one node onto its GPUs (both methods).
- :mod:`solver.locality_sources`: source ranks, windows, load drift and everywhere counts of the fit trace.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from placement.metrics import balance_stats, communication, step_par, trace_gpu_load
from placement.model import Placement
from placement.topology import Topology
from profiling.trace import RoutingTrace
from solver.greedy import greedy_placement
from solver.locality_fit import solve_replicated
from solver.locality_grouped import locality_replica_counts, solve_grouped
from solver.locality_options import LocalityOptions
from solver.locality_pack import pack_node_gpus
from solver.locality_sources import _dealt_prompt_ranks, default_everywhere
from solver.locality_sources import _expected_share_excess as _expected_share_excess
from solver.locality_sources import _fit_sources as _fit_sources
from solver.locality_sources import _load_drift as _load_drift
from solver.problem import Problem
from solver.report import SolveReport

__all__ = [
    "DEFAULT_SLACKS",
    "LocalityOptions",
    "coactivation_graph",
    "default_everywhere",
    "locality_replica_counts",
    "pack_node_gpus",
    "pareto",
    "run_locality",
    "solve_locality",
]

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
        layer_ids: the trace's layer ids to solve (default all).
        every other keyword: the field of :class:`LocalityOptions` of that name (documented there).

    Returns:
        (Placement, SolveReport). Per layer: ``objective`` = fitted expected remote nodes per token,
        ``baseline_objective`` = the same for the greedy placement (``grouped``), ``bound`` = 0 (no useful
        bound); ``extra`` has the search's counters (``replicated``: partition, role trades, packing and
        repair; ``grouped``: heuristic start, node-load ratio, CP-SAT status and pair objectives).
    """
    options = LocalityOptions(
        balance_slack=balance_slack,
        policy=policy,
        time_limit=time_limit,
        seed=seed,
        num_redundant=num_redundant,
        refine=refine,
        hidden_size=hidden_size,
        comm_weight=comm_weight,
        replication=replication,
        replica_headroom=replica_headroom,
        method=method,
        num_everywhere=num_everywhere,
        num_windows=num_windows,
        window_slack=window_slack,
        gpu_slack=gpu_slack,
        single_margin=single_margin,
        source_model=source_model,
        work_limit=work_limit,
        share_margin=share_margin,
        drift_z=drift_z,
        share_overload=share_overload,
    )
    return _solve(trace, topology, layer_ids, options)


def run_locality(problem: Problem, options: LocalityOptions) -> tuple[Placement, SolveReport]:
    """The registry's entry (:mod:`solver.api`): :func:`solve_locality` on ``problem.trace`` (which
    must hold per-token picks) and ``problem.layer_ids``; ``problem.load`` is not used."""
    return _solve(problem.trace, problem.topology, problem.layer_id_list, options)


def _solve(
    trace: RoutingTrace, topology: Topology, layer_ids: Sequence[int] | None, options: LocalityOptions
) -> tuple[Placement, SolveReport]:
    """Check the input -> cut the trace to ``layer_ids`` -> the ``replicated`` or ``grouped`` method."""
    o = options
    t0 = time.perf_counter()
    _validate(trace, topology, o.balance_slack, o.policy, o.num_redundant)
    if o.comm_weight is not None and not (o.comm_weight > 0):
        raise ValueError(
            f"comm_weight must be > 0 (or None for a hard balance cap only), got {o.comm_weight}"
        )
    if layer_ids is not None:
        want = [int(x) for x in layer_ids]
        missing = [x for x in want if x not in trace.layer_ids]
        if missing:
            raise ValueError(f"layer ids {missing} are not in the trace (it has {list(trace.layer_ids)})")
        trace = trace.select_layers([trace.layer_ids.index(x) for x in want])
    if o.method not in ("replicated", "grouped"):
        raise ValueError(f"method must be 'replicated' or 'grouped', got {o.method!r}")
    if o.work_limit is not None and not (o.method == "replicated" and o.policy == "local"):
        raise ValueError(
            f"work_limit applies to method='replicated' with policy='local' only (got method={o.method!r}, "
            f"policy={o.policy!r}); use time_limit"
        )
    if o.method == "replicated" and o.policy == "local":
        return solve_replicated(trace, topology, o, t0)
    return solve_grouped(trace, topology, o, t0)


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


def _score(
    placement: Placement, held: RoutingTrace, policy: str, step_tokens: int, hidden_size: int | None
) -> dict:
    """One row of :func:`pareto`'s table: ``placement`` scored on ``held`` under ``policy``."""
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
    rows, placements = _baseline_rows(fit_trace, held_trace, topology, policy, step_tokens, hidden_size)
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
            row = {"placement": "locality", "slack": float(s), "variant": label}
            row.update(_score(pl, held_trace, policy, step_tokens, hidden_size))
            row.update(solve_s=rep.wall_time_s, num_everywhere=rep.params.get("num_everywhere"))
            rows.append(row)
            placements.append(pl)
    if redeal and held_trace.source_rank is None and held_trace.seq_offsets is not None:
        _add_redealt_ratios(rows, placements, held_trace, topology.ep_size, int(redeal), seed)
    _add_greedy_ratios(rows)
    return rows


def _add_greedy_ratios(rows: list[dict]) -> None:
    """Add ``par_vs_greedy`` and ``nodes_vs_greedy`` to every row: its PAR and remote nodes per token over
    row 0's (greedy under the table's policy); 1 where greedy's is 0."""
    base = rows[0]
    for r in rows:
        r["par_vs_greedy"] = r["par"] / base["par"] if base["par"] > 0 else 1.0
        r["nodes_vs_greedy"] = (
            r["remote_nodes_per_token"] / base["remote_nodes_per_token"]
            if base["remote_nodes_per_token"] > 0
            else 1.0
        )


def _baseline_rows(
    fit_trace: RoutingTrace,
    held_trace: RoutingTrace,
    topology: Topology,
    policy: str,
    step_tokens: int,
    hidden_size: int | None,
) -> tuple[list[dict], list[Placement]]:
    """:func:`pareto`'s first rows and their placements: greedy under ``policy`` (row 0), greedy under
    ``even`` (when ``policy`` is not ``even``) and the trivial placement."""
    t = time.perf_counter()
    greedy, _ = greedy_placement(fit_trace.counts(), topology, layer_ids=fit_trace.layer_ids)
    g_s = time.perf_counter() - t
    rows = [
        {
            "placement": "greedy",
            "slack": None,
            **_score(greedy, held_trace, policy, step_tokens, hidden_size),
            "solve_s": g_s,
        }
    ]
    placements = [greedy]
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
    return rows, placements


def _add_redealt_ratios(
    rows: list[dict],
    placements: list[Placement],
    held_trace: RoutingTrace,
    ep_size: int,
    redeal: int,
    seed: int,
) -> None:
    """Add ``par_vs_greedy_redealt`` (mean) and ``par_vs_greedy_redealt_max`` to every row: its PAR over
    row 0's (greedy under ``policy``) with the held-out prompts dealt round-robin in ``redeal`` random
    orders."""
    rng = np.random.default_rng(seed)
    lengths = np.diff(held_trace.seq_offsets)
    ratios = np.zeros((len(rows), redeal))
    for k in range(redeal):
        src = np.repeat(_dealt_prompt_ranks(lengths.size, ep_size, rng), lengths)
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
