"""Placing replicas for the engine's own dispatch rule (SGLang's static or dynamic table).

SGLang sends a rank's tokens to the replica on its own GPU, else to the first replica on its own node
(when not all replicas are there), else by a fixed table. So a second replica of an expert on a node
that already holds one receives nothing from that node's ranks, and where an expert's replicas sit
decides how its load splits. The ranks left without a near replica get a "fair" pick that each rank
draws from its own seeded generator, so across ranks the split is uneven, but fixed: it is known
before serving. The step here keeps the replica counts a solver chose and moves replicas between GPUs,
layer after layer, replaying every rank's generator as SGLang will:

    spread replicas over nodes -> per layer: search swaps for an even table -> keep if it holds on
    the fit part and on a validation part -> check the whole placement -> report

The search scores a layer's table by its peak GPU load averaged over random dealings of the fit
prompts to the ranks (which rank draws which prompt is luck that held-out traffic draws anew, and a
replica served by few ranks is noisier). A layer changes only if the change lowers the peak on the fit
part's real dealing, does not raise it on a validation part (the last fifth of the fit windows), and
its mean gain over the dealings exceeds ``noise_z`` standard errors (0 by default: on the shared
traces a 2-sigma demand, with bootstrap resamples of the prompts, cost more gains than it saved).

Without per-token or per-window routing (an engine's rebalance call, a bare load ``[L, E]``),
:func:`fit_for_dispatch_load` takes every expert's tokens as split evenly over the source ranks
(each rank sends ``load / G``): the one dealing, and the fit and validation parts are all that split.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Any

import numpy as np

from moe_placement.base.options import options_or_fields, refuse_unknown_keywords
from placement.dispatch import (
    DISPATCH,
    SGLANG_STATIC_SEED,
    get_dispatch,
    layer_draws,
    nearest_in_row,
)
from placement.metrics import rank_expert_counts, rank_gpu_load
from placement.model import Placement, compute_logical_maps, hidden_layer_rows
from profiling.trace import RoutingTrace
from solver.greedy import group_nodes, hierarchical_groups

__all__ = [
    "DispatchFit",
    "TableFitOptions",
    "even_rank_counts",
    "fit_for_dispatch",
    "fit_for_dispatch_load",
    "spread_over_nodes",
]

log = logging.getLogger(__name__)


@refuse_unknown_keywords
@dataclass(frozen=True)
class TableFitOptions:
    """How :func:`fit_for_dispatch` searches a layer's table.

    Attributes:
        steps: swap attempts per layer (a model whose ``table_fit`` is ``"swaps"``).
        seed: seeds the swaps and the random dealings.
        dealings: random dealings of the fit prompts to the ranks that the search averages its peak over.
        noise_z: standard errors the mean gain over the dealings must exceed to change a layer (0: any gain).
    """

    steps: int = 60
    seed: int = 0
    dealings: int = 16
    noise_z: float = 0.0


@dataclass(frozen=True)
class DispatchFit:
    """What the step did: the layers it changed and the peaks (sum over layers) before and after."""

    dispatch: str
    changed_layers: tuple[int, ...]
    fit_peak_before: float
    fit_peak_after: float
    validation_peak_before: float
    validation_peak_after: float

    def note(self) -> str:
        return (
            f"{self.dispatch}: replicas moved for the engine's table in {len(self.changed_layers)} layer(s) "
            f"(fit peak {self.fit_peak_before:.0f} -> {self.fit_peak_after:.0f}, validation "
            f"{self.validation_peak_before:.0f} -> {self.validation_peak_after:.0f} tokens, summed over layers)"
        )


def spread_over_nodes(placement: Placement, load: np.ndarray) -> Placement:
    """The same replica counts, packed so an expert's replicas sit on distinct nodes where they can.

    Replicas are taken heaviest first (``load [L, E]`` split evenly over each expert's replicas) and
    each goes to the least-loaded GPU with a free slot that does not hold the expert, preferring nodes
    that do not hold it yet.
    """
    rows = [_spread_layer(placement, l, load[l]) for l in range(placement.num_layers)]
    return Placement(
        np.stack(rows),
        placement.num_logical_experts,
        placement.topology,
        placement.layer_ids,
        placement.provenance,
    )


def _spread_layer(placement: Placement, layer: int, load: np.ndarray) -> np.ndarray:
    """One layer's map ``[P]``; ``load [E]`` tokens per expert."""
    t = placement.topology
    G, S, m = t.ep_size, t.slots_per_gpu, t.gpus_per_node
    cnt = placement.logical_replica_count[layer]  # [E]
    experts = np.repeat(np.arange(cnt.size), cnt)  # one entry per replica
    share = load[experts] / cnt[experts]
    order = np.lexsort((experts, -share))  # heaviest first, ties by expert id
    gpu_load = np.zeros(G)
    free = np.full(G, S)
    holds = np.zeros((G, cnt.size), dtype=bool)
    slots: list[list[int]] = [[] for _ in range(G)]
    for i in order:
        e = experts[i]
        node_has = holds.reshape(t.num_nodes, m, -1)[:, :, e].any(axis=1)  # [N]
        allowed = (free > 0) & ~holds[:, e]
        fresh = allowed & ~np.repeat(node_has, m)
        pool = fresh if fresh.any() else allowed
        if not pool.any():  # the heaviest-first packing painted itself into a corner: keep the layer
            return placement.physical_to_logical_map[layer].copy()
        g = int(np.flatnonzero(pool)[np.argmin(gpu_load[pool])])
        slots[g].append(int(e))
        holds[g, e] = True
        free[g] -= 1
        gpu_load[g] += share[i]
    return np.array([e for g in range(G) for e in sorted(slots[g])], dtype=np.int64)


def _peaks(placement: Placement, counts: np.ndarray, dispatch: str) -> np.ndarray:
    """Peak GPU load per layer ``[L]`` under ``dispatch`` from tokens per (rank, expert) ``[L, G, E]``."""
    return rank_gpu_load(placement, counts, dispatch).max(axis=1)


def even_rank_counts(load: np.ndarray, ep_size: int) -> np.ndarray:
    """Tokens per (source rank, expert) float64 ``[L, G, E]`` when every expert's ``load [L, E]`` is
    split evenly over the ``ep_size`` ranks (what is assumed without routing per token or window)."""
    w = np.asarray(load, dtype=np.float64)
    return np.repeat(w[:, None, :] / ep_size, ep_size, axis=1)


def _mix(base: Placement, other: Placement, take: np.ndarray) -> Placement:
    """``base`` with the layers where ``take [L]`` is true taken from ``other``."""
    p2l = np.where(take[:, None], other.physical_to_logical_map, base.physical_to_logical_map)
    return Placement(p2l, base.num_logical_experts, base.topology, base.layer_ids, base.provenance)


def _draw(states: list, row: np.ndarray, E: int, topology) -> tuple[np.ndarray, list]:
    """SGLang's static table ``[G, E]`` for map row ``[P]`` with every rank's generator at ``states``,
    and the states after those draws."""
    l2p, cnt = compute_logical_maps(row[None, :], E)
    rngs = [random.Random() for _ in states]
    for rng, state in zip(rngs, states):
        rng.setstate(state)
    table = layer_draws(l2p[0], cnt[0], nearest_in_row(l2p[0], cnt[0], topology), rngs)
    return table, [rng.getstate() for rng in rngs]


class _LayerSearch:
    """One layer's candidates scored with SGLang's exact table, every rank's generator at ``states``.

    ``share [K, G, E]``: tokens per (rank, expert) under K random dealings of the fit prompts to the
    ranks (the search's score: which rank drew which prompt is luck that held-out traffic redraws);
    ``train`` and ``check``: real tokens per (rank, expert) ``[G, E]`` of the fit and validation parts.
    """

    def __init__(
        self,
        placement: Placement,
        states: list,
        share: np.ndarray,
        train: np.ndarray,
        check: np.ndarray,
        within_node: bool = False,
    ):
        self.topo = placement.topology
        self.E = placement.num_logical_experts
        self.states, self.share, self.train, self.check = states, share, train, check
        self.within_node = within_node  # swaps only between GPUs of one node (groups stay on nodes)

    def table(self, row: np.ndarray) -> tuple[np.ndarray, list]:
        """Every rank's choice ``[G, E]`` for map row ``[P]``, and the generators' states after it."""
        return _draw(self.states, row, self.E, self.topo)

    def gpu_load(self, table: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """GPU loads ``[G]`` when rank g sends ``counts[g, e]`` tokens to expert e (``table [G, E]``)."""
        slot = np.bincount(table.ravel(), weights=counts.ravel(), minlength=self.topo.num_physical_experts)
        return slot.reshape(self.topo.ep_size, -1).sum(axis=1)

    def score(self, row: np.ndarray) -> tuple[float, np.ndarray]:
        """The search's score: the peak GPU load averaged over the random dealings of the fit prompts
        (``share [K, G, E]``), and the mean GPU loads ``[G]`` behind it."""
        table = self.table(row)[0]
        loads = np.stack([self.gpu_load(table, dealt) for dealt in self.share])  # [K, G]
        return float(loads.max(axis=1).mean()), loads.mean(axis=0)

    def search(self, row: np.ndarray, steps: int, rng: np.random.Generator) -> np.ndarray:
        """Swap a slot of the busiest GPU with a slot elsewhere (in its node, ``within_node``) while
        that lowers the score."""
        S = self.topo.slots_per_gpu
        node_slots = row.size // self.topo.num_nodes
        best, (peak, loads) = row, self.score(row)
        for _ in range(steps):
            g = int(np.argmax(loads))
            a = g * S + int(rng.integers(S))
            if self.within_node:
                b = a // node_slots * node_slots + int(rng.integers(node_slots))
            else:
                b = int(rng.integers(row.size))
            h = b // S
            if (
                h == g
                or best[a] == best[b]
                or best[a] in best[h * S : (h + 1) * S]
                or best[b] in best[g * S : (g + 1) * S]
            ):
                continue
            cand = best.copy()
            cand[a], cand[b] = best[b], best[a]
            cand_peak, cand_loads = self.score(cand)
            if cand_peak < peak - 1e-9:
                best, peak, loads = cand, cand_peak, cand_loads
        return best


def _beats_noise(layer: _LayerSearch, base: np.ndarray, cand: np.ndarray, z: float) -> bool:
    """``cand`` lowers the peak on the fit part's real dealing, does not raise it on the validation
    part, and its mean gain over the random dealings exceeds ``z`` standard errors of that mean."""
    t_base, t_cand = layer.table(base)[0], layer.table(cand)[0]
    if layer.gpu_load(t_cand, layer.train).max() >= layer.gpu_load(t_base, layer.train).max():
        return False
    if layer.gpu_load(t_cand, layer.check).max() > layer.gpu_load(t_base, layer.check).max():
        return False
    gain = np.array(
        [layer.gpu_load(t_base, d).max() - layer.gpu_load(t_cand, d).max() for d in layer.share]
    )  # [K] paired: the same dealing under both tables
    if gain.size < 2:  # one dealing (counts split evenly over the ranks): no spread to measure
        return bool(gain.mean() > 0)
    return bool(gain.mean() > z * gain.std(ddof=1) / np.sqrt(gain.size))


def _searched(
    placement: Placement,
    start: Placement,
    fit_parts,
    steps: int,
    seed: int,
    z: float = 0.0,
    within_node: bool = False,
) -> tuple[Placement, np.ndarray]:
    """Layer by layer: the better of the placement's and ``start``'s row for an even table, improved by
    swaps (inside nodes when ``within_node``), kept where :func:`_beats_noise` says the gain is real.

    Returns the placement and a bool ``[L]`` of the layers changed.
    """
    dealt, train, check = fit_parts  # [K, L, G, E], [L, G, E], [L, G, E]
    G = placement.topology.ep_size
    states = [random.Random(SGLANG_STATIC_SEED).getstate() for _ in range(G)]
    rng = np.random.default_rng(seed)
    row_of = {lid: l for l, lid in enumerate(placement.layer_ids)}
    full = hidden_layer_rows(placement)  # [H, P]: SGLang draws over every hidden layer, in order
    rows: list = [None] * placement.num_layers
    changed = np.zeros(placement.num_layers, dtype=bool)
    for h in range(full.shape[0]):
        l = row_of.get(h)
        if l is None:  # a dense layer's trivial row: its replicas still advance every rank's generator
            states = _draw(states, full[h], placement.num_logical_experts, placement.topology)[1]
            continue
        layer = _LayerSearch(placement, states, dealt[:, l], train[l], check[l], within_node)
        base = placement.physical_to_logical_map[l]
        begin = min((base, start.physical_to_logical_map[l]), key=lambda r: layer.score(r)[0])
        cand = layer.search(begin.copy(), steps, rng)
        keep = _beats_noise(layer, base, cand, z)
        rows[l] = cand if keep else base
        changed[l] = keep and not np.array_equal(rows[l], base)
        states = layer.table(rows[l])[1]
    p2l = np.stack(rows)
    out = Placement(
        p2l, placement.num_logical_experts, placement.topology, placement.layer_ids, placement.provenance
    )
    return out, changed


def _random_dealings(trace: RoutingTrace, ep_size: int, num: int, seed: int) -> np.ndarray:
    """Tokens per (rank, expert) ``[K, L, G, E]`` for ``num`` random dealings of the trace's windows to
    the ranks: which rank draws which prompt is luck that held-out traffic draws anew."""
    return np.stack([rank_expert_counts(trace, ep_size, f"random:{seed * 1000 + k}") for k in range(num)])


def _mixed(
    placement: Placement, spread: Placement, train, check, dispatch: str
) -> tuple[Placement, np.ndarray]:
    """``sglang-dynamic``: each layer from ``spread`` where its expected peak is lower on the fit part
    and not higher on the validation part (``train``, ``check``: ``[L, G, E]``); the bool ``[L]`` of
    the layers taken."""
    before, after = _peaks(placement, train, dispatch), _peaks(spread, train, dispatch)
    v_before, v_after = _peaks(placement, check, dispatch), _peaks(spread, check, dispatch)
    take = (after < before) & (v_after <= v_before)
    return (_mix(placement, spread, take) if take.any() else placement), take


def _check_table(dispatch: str) -> str:
    """The name of ``dispatch``, a model with a fixed per-rank table (ValueError otherwise)."""
    model = get_dispatch(dispatch)
    if not model.table:
        tables = [n for n, m in DISPATCH.items() if m.table]
        raise ValueError(f"placing for a dispatch table needs one of {tables}, not {model.name!r}")
    return model.name


def fit_for_dispatch(
    placement: Placement,
    fit: RoutingTrace,
    dispatch: str,
    source_ranks: str | None = None,
    *,
    num_groups: int | None = None,
    options: TableFitOptions | None = None,
    **fields: Any,
) -> tuple[Placement, DispatchFit]:
    """Move replicas so SGLang's rule splits the load better, layer by layer, fit and validated.

    Args:
        placement: the solver's placement (its replica counts are kept).
        fit: the fit trace (per-token, or per-window counts dealt to ranks); its last fifth of windows
            validates each layer's choice.
        dispatch: ``sglang-static`` (exact tables, swap search) or ``sglang-dynamic`` (expectation).
        source_ranks: the ``--source-ranks`` spec (None: the trace's ranks, else prompts round-robin).
        num_groups: expert groups of a hierarchical placement: when the placement keeps each group
            on one node (:func:`solver.greedy.group_nodes`), replicas move only inside their node.
        options: how the search runs (:class:`TableFitOptions`); or its fields as keywords
            (``steps=40, seed=1``), not both.

    Returns:
        The placement (its peaks summed over layers never higher than the input's on the fit part nor
        on the validation part) and what changed.
    """
    dispatch = _check_table(dispatch)
    o = options_or_fields(TableFitOptions, options, fields, "fit_for_dispatch")
    if not fit.has_tokens and fit.window_counts is None:
        raise ValueError(
            f"placing for {dispatch} from a trace needs per-token or per-window routing (source ranks "
            "decide it); for counts only use fit_for_dispatch_load"
        )
    train, check = fit.split(0.8) if len(fit.natural_windows()) >= 5 else (fit, fit)
    G = placement.topology.ep_size
    parts = (rank_expert_counts(train, G, source_ranks), rank_expert_counts(check, G, source_ranks))
    static = get_dispatch(dispatch).table_fit == "swaps"
    dealt = _random_dealings(train, G, o.dealings, o.seed) if static else None  # [K, L, G, E]
    return _fit(placement, train.counts(), dealt, parts, dispatch, o, num_groups)


def fit_for_dispatch_load(
    placement: Placement,
    load: np.ndarray,
    dispatch: str,
    *,
    steps: int = 60,
    seed: int = 0,
    num_groups: int | None = None,
) -> tuple[Placement, DispatchFit]:
    """:func:`fit_for_dispatch` for counts only: ``load [L, E]`` taken as split evenly over the ranks
    (:func:`even_rank_counts`), which is then the one dealing, the fit part and the validation part;
    ``num_groups`` as there."""
    dispatch = _check_table(dispatch)
    counts = even_rank_counts(load, placement.topology.ep_size)  # [L, G, E]
    dealt = counts[None] if get_dispatch(dispatch).table_fit == "swaps" else None  # [1, L, G, E]
    w = np.asarray(load, dtype=np.float64)
    search = TableFitOptions(steps=steps, seed=seed)
    return _fit(placement, w, dealt, (counts, counts), dispatch, search, num_groups)


def _fit(
    placement: Placement,
    train_load: np.ndarray,
    dealt: np.ndarray | None,
    parts: tuple[np.ndarray, np.ndarray],
    dispatch: str,
    search: TableFitOptions,
    num_groups: int | None,
) -> tuple[Placement, DispatchFit]:
    """Spread over nodes, then search layer by layer (``sglang-static``, ``dealt [K, L, G, E]``) or
    take the spread layers that help (``sglang-dynamic``), then check the whole. A placement that
    keeps ``num_groups`` expert groups each on one node keeps them there: no spread, swaps inside nodes.

    ``train_load [L, E]``: the fit part's tokens per expert; ``parts``: tokens per (rank, expert)
    ``[L, G, E]`` of the fit part and of the validation part.
    """
    train, check = parts
    keep_nodes = _groups_on_nodes(placement, num_groups)
    spread = placement if keep_nodes else spread_over_nodes(placement, train_load)
    if dealt is not None:
        fit_parts = (dealt, train, check)
        chosen, take = _searched(
            placement, spread, fit_parts, search.steps, search.seed, search.noise_z, keep_nodes
        )
    else:
        chosen, take = _mixed(placement, spread, train, check, dispatch)
    return _checked(placement, chosen, take, train, check, dispatch)


def _groups_on_nodes(placement: Placement, num_groups: int | None) -> bool:
    """``placement`` is hierarchical for ``num_groups`` (they divide over its nodes) and keeps every
    group on one node in every layer."""
    t = placement.topology
    if hierarchical_groups(num_groups, placement.num_logical_experts, t.num_nodes) is None:
        return False
    nodes = group_nodes(placement.physical_to_logical_map, placement.num_logical_experts, num_groups, t)
    return bool((nodes >= 0).all())


def _checked(placement, chosen, take, train, check, dispatch) -> tuple[Placement, DispatchFit]:
    """Keep ``chosen`` only if its peaks summed over layers are no higher than the input's on the fit
    part and on the validation part (``[L, G, E]`` each; SGLang's draws carry from layer to layer:
    score the whole)."""
    before, v_before = _peaks(placement, train, dispatch), _peaks(placement, check, dispatch)
    got, v_got = _peaks(chosen, train, dispatch), _peaks(chosen, check, dispatch)
    if got.sum() > before.sum() or v_got.sum() > v_before.sum():
        chosen, take, got, v_got = placement, np.zeros_like(take), before, v_before
    result = DispatchFit(
        dispatch,
        tuple(int(placement.layer_ids[l]) for l in np.flatnonzero(take)),
        float(before.sum()),
        float(got.sum()),
        float(v_before.sum()),
        float(v_got.sum()),
    )
    log.info(result.note())
    return chosen.with_provenance(dispatch=dispatch, dispatch_fit_layers=list(result.changed_layers)), result
