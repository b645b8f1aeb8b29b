"""Noise gate: leave greedy's placement unless the fitted gain beats the sampling noise.

The exact optimum of the fitted load beats greedy by less than the sampling noise on real traces, and
then loses as often as it wins on held-out traffic. Per layer ``sigma`` = bootstrap standard deviation
of greedy's peak; :func:`solver.migration.solve_migration` re-places the layer from greedy's with
``move_cost = k * sigma`` per moved slot, or the exact layer is kept when it scores better on that
same penalised objective.

A noise source is ``("windows", [W, L, E], groups [W] or None)`` or ``("poisson", [L, E], None)``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np

from placement.model import Placement
from placement.topology import Topology
from profiling.trace import RoutingTrace
from solver.exact.common import LoadOrTrace, _aggregate, _refresh_shares, _with_layers
from solver.exact.options import ExactOptions
from solver.greedy import greedy_placement
from solver.report import LayerReport, SolveReport
from solver.weighted import even_split_peak

_GATE_BOOTSTRAP = 200  # resamples used to estimate the noise of a layer's peak

NoiseSource = tuple[str, np.ndarray, np.ndarray | None]


def _gate_noise_source(
    load_or_trace: LoadOrTrace,
    noise_gate: str | bool | None,
    robust: str | bool | None,
    node_constraint: bool,
    objective: str,
    weighted: bool | str,
) -> NoiseSource | None:
    """``("windows", [W, L, E], groups [W] or None)``, ``("poisson", [L, E], None)`` or None (gate off)."""
    if noise_gate is None or noise_gate is False or noise_gate == "off":
        return None
    if noise_gate not in ("auto", "windows", "poisson"):
        raise ValueError(f"noise_gate must be 'auto', 'windows', 'poisson' or None, got {noise_gate!r}")
    plain = not robust and not node_constraint and objective == "tokens" and weighted is not True
    if not plain:
        if noise_gate == "auto":
            return None
        raise ValueError(
            f"noise_gate={noise_gate!r} applies to the plain even-split token solve; drop robust, "
            "node_constraint, objective='decode' and weighted=True, or set noise_gate=None"
        )
    groups = None
    if isinstance(load_or_trace, RoutingTrace):
        wins = load_or_trace.window_load().astype(np.float64)
        labels = load_or_trace.window_labels
        if labels is not None and len(labels) == wins.shape[0]:
            _, inv = np.unique(np.asarray(labels, dtype=str), return_inverse=True)
            if 5 <= inv.max() + 1 < wins.shape[0]:
                groups = inv
        agg = load_or_trace.counts().astype(np.float64)
    else:
        arr = np.asarray(load_or_trace, dtype=np.float64)
        wins = arr if arr.ndim == 3 else None
        agg = arr.sum(axis=0) if arr.ndim == 3 else arr
    if noise_gate == "poisson":
        if not np.all(agg == np.round(agg)):
            raise ValueError(
                "noise_gate='poisson' needs integer token counts; pass windows (noise_gate='windows')"
            )
        return ("poisson", agg, None)
    if wins is None or wins.shape[0] < 5:
        if noise_gate == "windows":
            n = 0 if wins is None else wins.shape[0]
            raise ValueError(
                f"noise_gate='windows' needs at least 5 windows, got {n}; pass [W, L, E] windows or a trace"
            )
        # A trace is a sample of traffic: with too few windows to resample, its counts' Poisson noise is
        # the only noise estimate. A bare load array is a problem statement and is solved as given.
        if isinstance(load_or_trace, RoutingTrace) and np.all(agg == np.round(agg)):
            return ("poisson", agg, None)
        return None
    return ("windows", wins, groups)


def peak_noise(
    source: NoiseSource, placement: Placement, seed: int = 0, num_resamples: int = _GATE_BOOTSTRAP
) -> np.ndarray:
    """Sampling noise (standard deviation) of each layer's even-split peak GPU load, in tokens of the fit total.

    ``source`` is what :func:`_gate_noise_source` returns: windows are resampled with replacement (whole
    label groups when ``groups`` is given), counts by Poisson; every resample is rescaled to the fit's
    total per layer, so the noise is that of the peak's *balance*, not of the traffic volume.

    Returns: float64 ``[L]``.
    """
    kind, data, groups = source
    rng = np.random.default_rng(seed)
    B = int(num_resamples)
    if kind == "windows":
        units = data
        if groups is not None:
            units = np.stack(
                [data[groups == c].sum(axis=0) for c in range(int(groups.max()) + 1)]
            )  # [C, L, E]
        U = units.shape[0]
        wts = rng.multinomial(U, np.full(U, 1.0 / U), size=B).astype(np.float64)  # [B, U]
        total = data.sum(axis=0)  # [L, E]
        res = np.einsum("bu,ule->ble", wts, units)
    else:
        total = data
        res = rng.poisson(data, size=(B,) + data.shape).astype(np.float64)
    scale = total.sum(axis=1)[None, :, None] / np.maximum(res.sum(axis=2, keepdims=True), 1e-12)
    res = res * scale  # [B, L, E]
    p2l = placement.physical_to_logical_map
    L = p2l.shape[0]
    G, S = placement.topology.ep_size, placement.topology.slots_per_gpu
    E = total.shape[1]
    out = np.empty(L)
    for l in range(L):
        cnt = np.bincount(p2l[l], minlength=E)
        M = np.zeros((E, G))
        np.add.at(M, (p2l[l], np.arange(p2l.shape[1]) // S), 1.0 / cnt[p2l[l]])
        out[l] = (res[:, l] @ M).max(axis=1).std()
    return out


@dataclass(frozen=True)
class _Gate:
    """What every layer's gate decision shares."""

    agg: np.ndarray  # [L, E] the fitted load
    topology: Topology
    greedy: Placement  # greedy's placement of agg
    sigma: np.ndarray  # [L] noise of greedy's peak
    exact_moved: np.ndarray  # [L] slots the exact placement moves from greedy's
    source: NoiseSource
    k: float  # move cost per moved slot, in sigmas
    per_layer_s: float  # migration time limit per layer
    seed: int


def _gate_prepare(
    load_or_trace: LoadOrTrace, topology: Topology, source: NoiseSource, seed: int, layer_ids
) -> tuple[Placement, np.ndarray]:
    """What the gate needs before the exact solve: greedy's placement of the summed load and the noise
    ``[L]`` of its layers' peaks (:func:`peak_noise`)."""
    g_pl, _ = greedy_placement(
        _aggregate(load_or_trace), topology, mode="global", layer_ids=layer_ids or None
    )
    return g_pl, peak_noise(source, g_pl, seed)


def _noise_gate(
    load_or_trace: LoadOrTrace,
    topology: Topology,
    solved: tuple[Placement, SolveReport],
    source: NoiseSource,
    options: ExactOptions,
    t_start: float,
    prepared: tuple[Placement, np.ndarray] | None = None,
) -> tuple[Placement, SolveReport]:
    """Per layer: greedy's placement changed only where the fitted gain beats ``k`` sigma per moved slot.

    ``solved``: the exact solve's placement and report; ``options``: its options (``noise_k`` is ``k``;
    ``seed``, ``time_limit``, ``deterministic``); ``t_start``: when the whole solve began (``perf_counter``).

    ``prepared``: greedy's placement and its noise ``[L]`` (:func:`_gate_prepare`), made before the exact
    solve so that their cost comes out of the time limit before the exact layers run, not after.

    Re-places each layer with :func:`solver.migration.solve_migration` from greedy's placement with
    ``move_cost = k * sigma_l`` (``sigma_l``: :func:`peak_noise` of greedy's layer), then keeps the exact
    layer instead when it is at least as good on that same objective (peak + move cost x moved slots).
    The exact solve's bound stays the layer's bound; the exact objective is kept in ``extra``.
    """
    from solver.migration import moved_pairs

    pl, rep = solved
    k, seed, time_limit, deterministic = (
        float(options.noise_k),
        options.seed,
        options.time_limit,
        options.deterministic,
    )
    agg = _aggregate(load_or_trace)
    L, E = agg.shape
    g_pl, sigma = prepared or _gate_prepare(load_or_trace, topology, source, seed, pl.layer_ids)
    exact_moved = moved_pairs(g_pl, pl)  # [L]
    rows = pl.physical_to_logical_map.copy()
    layers, changed, kept_exact = [], 0, 0
    # the migration's share per layer: the 15% of time_limit the inner solve left (deterministic), or
    # what is left on the clock
    left = 0.15 * time_limit if deterministic else time_limit - (time.perf_counter() - t_start)
    per = max(0.05, left / max(L, 1))
    gate = _Gate(agg, topology, g_pl, sigma, exact_moved, source, k, per, seed)
    deadline = t_start + time_limit  # a hard wall: past it a layer is gated without the migration
    spent, out_of_time = [0.0, 0], 0
    for l, lr in enumerate(rep.layers):
        t0 = time.perf_counter()
        if t0 + (spent[0] / spent[1] if spent[1] else 0.0) > deadline:
            row, info = _quick_choice(gate, l, lr, rows)
            out_of_time += 1
        else:
            row, info = _gate_choice(gate, l, lr, rows)
            spent = [spent[0] + time.perf_counter() - t0, spent[1] + 1]
        extra = {**lr.extra, "noise_gate": info}
        if info["kept_exact"]:
            kept_exact += 1
            layers.append(replace(lr, extra=extra))
            continue
        rows[l] = row
        changed += info["took"] != "greedy"
        layers.append(_gated_layer(gate, l, lr, row, extra, info["took"]))
    desc = f"{source[0]}{'/groups' if source[2] is not None else ''}, k={k:g}"
    notes = list(rep.notes)
    if kept_exact < L:
        notes.append(
            f"noise gate ({desc}): {kept_exact} of {L} layers took the exact placement, {changed} a partial "
            f"move from greedy, {L - kept_exact - changed} kept greedy's (gain within the sampling noise)"
        )
    if out_of_time:
        notes.append(
            f"noise gate: time limit {time_limit:g} s reached: {out_of_time} of {L} layers chose between the "
            f"exact and greedy placements without a partial move from greedy"
        )
    params = {**rep.params, "noise_gate": desc, "noise_gate_exact_layers": kept_exact}
    return _with_layers(pl, rep, rows, layers, {"noise_gate": desc}, params, notes, t_start)


def _gate_choice(gate: _Gate, l: int, lr: LayerReport, rows: np.ndarray) -> tuple[np.ndarray, dict]:
    """Layer ``l``'s map ``[P]`` (the exact row of ``rows [L, P]`` or the migration's from greedy) and
    the gate's record of the choice."""
    from solver.migration import MigrationOptions, moved_pairs, run_migration  # SOLVERS["migration"]
    from solver.problem import Problem

    topology, g_pl, w = gate.topology, gate.greedy, gate.agg[l]
    G, S, E = topology.ep_size, topology.slots_per_gpu, gate.agg.shape[1]
    mc = gate.k * float(gate.sigma[l])
    g_row = g_pl.physical_to_logical_map[l]
    prev = g_pl.select_layers([l])
    problem = Problem.build(topology, load=gate.agg[l : l + 1], previous=prev)
    m_opts = MigrationOptions(move_cost=mc, time_limit=gate.per_layer_s, seed=gate.seed)
    m_pl, m_rep = run_migration(problem, m_opts)
    m_row = m_pl.physical_to_logical_map[0]
    m_obj = even_split_peak(m_row, w, G, S) + mc * int(m_rep.layers[0].extra["moved_slots"])
    e_obj = lr.objective + mc * int(gate.exact_moved[l])
    kept_exact = bool(e_obj <= m_obj)
    row = rows[l] if kept_exact else m_row
    source = gate.source
    info = {
        "sigma": float(gate.sigma[l]),
        "move_cost": mc,
        "k": gate.k,
        "source": source[0] + ("/groups" if source[2] is not None else ""),
        "exact_objective": float(lr.objective),
        "greedy_objective": float(lr.baseline_objective),
        "moved_slots_vs_greedy": int(
            moved_pairs(g_pl.select_layers([l]), Placement(row[None], E, topology))[0]
        ),
        "took": "greedy" if np.array_equal(row, g_row) else ("exact" if kept_exact else "migration"),
        "kept_exact": kept_exact,
    }
    return row, info


def _quick_choice(gate: _Gate, l: int, lr: LayerReport, rows: np.ndarray) -> tuple[np.ndarray, dict]:
    """The gate's choice without the migration (no time left): the exact row of ``rows [L, P]`` when
    its peak plus the move cost of its moved slots is at most greedy's peak, else greedy's row."""
    mc = gate.k * float(gate.sigma[l])
    g_row = gate.greedy.physical_to_logical_map[l]
    moved = int(gate.exact_moved[l])
    kept_exact = bool(lr.objective + mc * moved <= lr.baseline_objective)
    row = rows[l] if kept_exact else g_row
    info = {
        "sigma": float(gate.sigma[l]),
        "move_cost": mc,
        "k": gate.k,
        "source": gate.source[0] + ("/groups" if gate.source[2] is not None else ""),
        "exact_objective": float(lr.objective),
        "greedy_objective": float(lr.baseline_objective),
        "moved_slots_vs_greedy": moved if kept_exact else 0,
        "took": "greedy" if np.array_equal(row, g_row) else "exact",
        "kept_exact": kept_exact,
        "out_of_time": True,
    }
    return row, info


def _gated_layer(
    gate: _Gate, l: int, lr: LayerReport, row: np.ndarray, extra: dict, took: str
) -> LayerReport:
    """Layer ``l``'s report for the gated map ``row [P]``: its even-split peak, the exact bound kept."""
    topology = gate.topology
    obj = even_split_peak(row, gate.agg[l], topology.ep_size, topology.slots_per_gpu)
    extra.update(proved_by=None, fitted_objective=float(lr.objective))
    _refresh_shares(extra, row, gate.agg[l], topology)
    status = "greedy_fallback" if took == "greedy" else "heuristic"
    return replace(lr, status=status, objective=obj, bound=min(lr.bound, obj), extra=extra)
