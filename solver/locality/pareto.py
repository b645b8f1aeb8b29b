"""The held-out trade-off table of the locality solver: greedy, trivial and locality at each slack.

Shapes as in :mod:`solver.locality`. Fit on one part of a trace, score on the other with
:mod:`placement.metrics`, one row per placement and slack (:func:`pareto`);
``benchmarks/locality.py`` prints it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from placement.dispatch import EVEN, get_dispatch
from placement.metrics import balance_stats, communication, step_par, trace_gpu_load
from placement.model import Placement
from placement.topology import Topology
from profiling.trace import RoutingTrace
from solver.greedy import greedy_placement
from solver.locality.options import LocalityOptions
from solver.locality.solve import solve_locality
from solver.locality.sources import dealt_prompt_ranks

__all__ = ["DEFAULT_SLACKS", "pareto"]

DEFAULT_SLACKS = (0.0, 0.02, 0.05, 0.1)


def _score(
    placement: Placement, held: RoutingTrace, dispatch: str, step_tokens: int, hidden_size: int | None
) -> dict:
    """One row of :func:`pareto`'s table: ``placement`` scored on ``held`` under ``dispatch``."""
    bal = balance_stats(trace_gpu_load(placement, held, dispatch))
    comm = communication(placement, held, dispatch, hidden_size=hidden_size)
    sp = step_par(placement, held, step_tokens, dispatch)
    row = {
        "dispatch": dispatch,
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
    options: LocalityOptions | None = None,
    *,
    slacks: Sequence[float] = DEFAULT_SLACKS,
    variants: Sequence[dict] | None = None,
    step_tokens: int = 16,
    redeal: int = 0,
) -> list[dict]:
    """Held-out trade-off table: greedy (``dispatch`` and ``even``), trivial, and locality at each slack.

    Fits on ``fit_trace`` and scores on ``held_trace`` with :mod:`placement.metrics`. ``options``
    (:class:`LocalityOptions`, default ``LocalityOptions()``) go to :func:`solve_locality` with
    ``balance_slack`` set to each of ``slacks``; its ``dispatch`` scores every row and its ``hidden_size``
    adds ``bytes_per_token``. ``variants``: dicts of :class:`LocalityOptions` fields (set over ``options``)
    each solved at every slack, e.g. ``[{"num_everywhere": 4}, {"num_everywhere": 6}]``; each row then has
    ``variant`` (the dict's items as text).

    Returns:
        list of dicts with ``placement``, ``slack``, ``dispatch``, ``par``, ``par_worst``, ``step_par``,
        ``remote_nodes_per_token``, ``remote_gpus_per_token``, ``bytes_per_token`` (with ``hidden_size``),
        ``par_vs_greedy`` and ``nodes_vs_greedy`` (ratios to greedy under the same dispatch),
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
    o = options if options is not None else LocalityOptions()
    dispatch, hidden_size = o.dispatch, o.hidden_size
    rows, placements = _baseline_rows(fit_trace, held_trace, topology, dispatch, step_tokens, hidden_size)
    for var in variants or [{}]:
        label = " ".join(f"{k}={v}" for k, v in var.items())
        for s in slacks:
            pl, rep = solve_locality(fit_trace, topology, replace(o, **dict(var), balance_slack=float(s)))
            row = {"placement": "locality", "slack": float(s), "variant": label}
            row.update(_score(pl, held_trace, dispatch, step_tokens, hidden_size))
            row.update(solve_s=rep.wall_time_s, num_everywhere=rep.params.get("num_everywhere"))
            rows.append(row)
            placements.append(pl)
    if redeal and held_trace.source_rank is None and held_trace.seq_offsets is not None:
        _add_redealt_ratios(rows, placements, held_trace, topology.ep_size, int(redeal), o.seed)
    _add_greedy_ratios(rows)
    return rows


def _add_greedy_ratios(rows: list[dict]) -> None:
    """Add ``par_vs_greedy`` and ``nodes_vs_greedy`` to every row: its PAR and remote nodes per token over
    row 0's (greedy under the table's dispatch); 1 where greedy's is 0."""
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
    dispatch: str,
    step_tokens: int,
    hidden_size: int | None,
) -> tuple[list[dict], list[Placement]]:
    """:func:`pareto`'s first rows and their placements: greedy under ``dispatch`` (row 0), greedy under
    ``even`` (when ``dispatch`` is not ``even``) and the trivial placement."""
    t = time.perf_counter()
    greedy, _ = greedy_placement(fit_trace.counts(), topology, layer_ids=fit_trace.layer_ids)
    g_s = time.perf_counter() - t
    rows = [
        {
            "placement": "greedy",
            "slack": None,
            **_score(greedy, held_trace, dispatch, step_tokens, hidden_size),
            "solve_s": g_s,
        }
    ]
    placements = [greedy]
    if not get_dispatch(dispatch).counts_only:
        rows.append(
            {
                "placement": "greedy",
                "slack": None,
                **_score(greedy, held_trace, EVEN.name, step_tokens, hidden_size),
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
            **_score(triv, held_trace, dispatch, step_tokens, hidden_size),
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
    row 0's (greedy under ``dispatch``) with the held-out prompts dealt round-robin in ``redeal`` random
    orders."""
    rng = np.random.default_rng(seed)
    lengths = np.diff(held_trace.seq_offsets)
    ratios = np.zeros((len(rows), redeal))
    for k in range(redeal):
        src = np.repeat(dealt_prompt_ranks(lengths.size, ep_size, rng), lengths)
        par_k = np.array(
            [
                balance_stats(trace_gpu_load(p, held_trace, r["dispatch"], src=src))["par"]
                for r, p in zip(rows, placements)
            ]
        )
        ratios[:, k] = par_k / par_k[0] if par_k[0] > 0 else 1.0  # row 0: greedy under ``dispatch``
    for r, x in zip(rows, ratios):
        r["par_vs_greedy_redealt"] = float(x.mean())
        r["par_vs_greedy_redealt_max"] = float(x.max())
