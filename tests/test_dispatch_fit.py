"""Placing replicas for SGLang's table (solver.dispatch_fit)."""

from __future__ import annotations

import numpy as np
import pytest

from placement.metrics import rank_expert_counts, rank_gpu_load
from placement.model import Placement
from placement.topology import Topology
from profiling.synthetic import synthetic_trace
from solver.dispatch_fit import fit_for_dispatch, spread_over_nodes
from solver.greedy import greedy_placement

TOPO = Topology(ep_size=8, num_physical_experts=16, num_nodes=4)  # 8 experts, 2 slots per GPU


@pytest.fixture(scope="module")
def fit_trace():
    return synthetic_trace(
        num_tokens=12000, num_layers=3, num_logical_experts=8, top_k=2, num_prompts=150, skew=1.0, seed=1
    )


def _spread_share(placement) -> float:
    """Share of replicated experts (over layers) whose replicas sit on as many nodes as they can."""
    node = TOPO.node_of_slot
    hits = total = 0
    for l in range(placement.num_layers):
        for row in placement.logical_to_physical_map[l]:
            slots = row[row >= 0]
            if len(slots) > 1:
                total += 1
                hits += len(set(node[slots])) == min(len(slots), TOPO.num_nodes)
    return hits / total


def test_spread_keeps_counts_and_puts_replicas_on_distinct_nodes(fit_trace):
    greedy, _ = greedy_placement(fit_trace.counts(), TOPO)
    spread = spread_over_nodes(greedy, fit_trace.counts())
    assert np.array_equal(spread.logical_replica_count, greedy.logical_replica_count)
    assert _spread_share(spread) > _spread_share(greedy) and _spread_share(spread) >= 0.8


def test_fit_never_raises_the_fitted_or_validation_peak(fit_trace):
    greedy, _ = greedy_placement(fit_trace.counts(), TOPO)
    ours, res = fit_for_dispatch(greedy, fit_trace, "sglang-static", steps=40)
    assert (
        res.fit_peak_after <= res.fit_peak_before and res.validation_peak_after <= res.validation_peak_before
    )
    assert np.array_equal(ours.logical_replica_count, greedy.logical_replica_count)
    counts = rank_expert_counts(fit_trace.split(0.8)[0], 8)
    before = rank_gpu_load(greedy, counts, "sglang-static").max(axis=1).sum()
    after = rank_gpu_load(ours, counts, "sglang-static").max(axis=1).sum()
    assert after == pytest.approx(res.fit_peak_after) and before == pytest.approx(res.fit_peak_before)
    assert res.changed_layers and after < before  # on this skewed trace the table can be evened out
    assert ours.provenance["dispatch"] == "sglang-static"


def test_fit_takes_its_options_object_or_their_keywords(fit_trace):
    from solver.dispatch_fit import TableFitOptions

    greedy, _ = greedy_placement(fit_trace.counts(), TOPO)
    a, ra = fit_for_dispatch(greedy, fit_trace, "sglang-static", options=TableFitOptions(steps=10, seed=2))
    b, rb = fit_for_dispatch(greedy, fit_trace, "sglang-static", steps=10, seed=2)
    assert np.array_equal(a.physical_to_logical_map, b.physical_to_logical_map) and ra == rb
    with pytest.raises(
        ValueError, match="fit_for_dispatch: unknown keyword 'stepz' .*fields of TableFitOptions"
    ):
        fit_for_dispatch(greedy, fit_trace, "sglang-static", stepz=10)
    with pytest.raises(ValueError, match="not both"):
        fit_for_dispatch(greedy, fit_trace, "sglang-static", options=TableFitOptions(), steps=10)


def test_dynamic_and_bad_models(fit_trace):
    greedy, _ = greedy_placement(fit_trace.counts(), TOPO)
    _, res = fit_for_dispatch(greedy, fit_trace, "sglang-dynamic")
    assert res.fit_peak_after <= res.fit_peak_before
    with pytest.raises(ValueError, match="sglang-static"):
        fit_for_dispatch(greedy, fit_trace, "even")


def test_search_replays_the_same_draws_as_the_dispatch_model():
    # dense layers 0 and 2 (trivial rows in SGLang's map) draw before and between the MoE layers
    import random

    from placement.dispatch import sglang_static_tables
    from placement.model import Placement, hidden_layer_rows
    from solver.dispatch_fit import _draw

    rng = np.random.default_rng(3)
    rows = []
    for _ in range(3):
        while True:
            row = np.concatenate([np.arange(8), rng.integers(0, 8, 8)])
            rng.shuffle(row)
            if all(len(set(g)) == 2 for g in row.reshape(8, 2)):
                break
        rows.append(row)
    pl = Placement(np.stack(rows), 8, TOPO, layer_ids=(1, 3, 4))
    states = [random.Random(42).getstate() for _ in range(8)]
    tables = []
    for row in hidden_layer_rows(pl):
        table, states = _draw(states, row, 8, TOPO)
        tables.append(table)
    assert np.array_equal(np.stack(tables, axis=1)[:, [1, 3, 4]], sglang_static_tables(pl))


def test_spreading_keeps_a_layer_it_cannot_pack():
    """The heaviest-first spread can run out of GPUs that lack an expert (here the last replica of
    expert 3 or 1 finds only its own GPU free); the layer is then kept as it was, never broken."""
    topo = Topology.from_redundant(6, 2, ep_size=2, num_nodes=2)  # 8 slots, 4 per GPU
    p2l = np.array([[0, 4, 3, 1, 3, 1, 5, 2]])
    pl = Placement(p2l, 6, topo)
    load = np.array([[6.67, 0.34, 0.43, 0.97, 56.22, 0.26]])
    out = spread_over_nodes(pl, load)
    np.testing.assert_array_equal(out.physical_to_logical_map, p2l)
