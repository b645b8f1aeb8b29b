"""Starting placements for the per-step fit (``solver/step/start.py``)."""

from __future__ import annotations

import networkx as nx
import numpy as np
import pytest

from solver.greedy import balanced_packing, replicate
from solver.step.start import connected_packing, spike_weights, start_rows


def _islands(row: np.ndarray, G: int, S: int) -> int:
    """Connected groups of GPUs, two GPUs linked when they hold replicas of one expert."""
    graph = nx.Graph()
    graph.add_nodes_from(range(G))
    for e in np.unique(row):
        gpus = np.flatnonzero(row == e) // S
        graph.add_edges_from(zip(gpus[:-1], gpus[1:]))
    return nx.number_connected_components(graph)


def _greedy_row(load: np.ndarray, counts: np.ndarray, G: int, S: int) -> np.ndarray:
    experts = np.repeat(np.arange(load.size), counts)
    pack, rank = balanced_packing((load[experts] / counts[experts])[None], G, item_key=experts[None])
    row = np.empty(G * S, np.int64)
    row[pack[0] * S + rank[0]] = experts
    return row


@pytest.mark.parametrize("E, G, S, seed", [(64, 32, 3, 0), (64, 64, 2, 1), (16, 8, 3, 2), (256, 64, 5, 5)])
def test_connected_packing_links_the_gpus_that_greedy_leaves_as_islands(E, G, S, seed):
    rng = np.random.default_rng(seed)
    load = rng.permutation(1.0 / np.arange(1, E + 1) ** 0.9) * rng.uniform(0.8, 1.2, E) * 1000  # Zipf-like
    counts = replicate(load[None], G * S, max_replicas=G)[2][0]
    greedy = _greedy_row(load, counts, G, S)
    assert _islands(greedy, G, S) > 1  # greedy closes small cycles: islands that cannot share load
    for slack in (0.0, 0.03, 1.0):
        row = connected_packing(load, counts, G, S, slack)
        np.testing.assert_array_equal(np.bincount(row, minlength=E), counts)  # the counts asked for
        per_gpu = np.sort(row.reshape(G, S), axis=1)
        assert not (per_gpu[:, 1:] == per_gpu[:, :-1]).any()  # never two replicas of one expert on a GPU
        gpu = (load / counts)[row].reshape(G, S).sum(axis=1)
        assert (
            gpu.max() <= load.sum() / G + slack * load.sum() / G + (load / counts).max()
        )  # near greedy's bound
        if slack == 0.0:  # greedy's rule, up to ties
            assert _islands(row, G, S) == _islands(greedy, G, S)
        else:
            assert _islands(row, G, S) <= _islands(greedy, G, S)
    links = int((counts - 1).sum())  # replicas beyond the first: one spare slot per GPU gives G links
    assert _islands(connected_packing(load, counts, G, S, 1.0), G, S) == max(1, G - links)


def test_spike_weights_give_a_spiking_cold_expert_a_replica():
    rng = np.random.default_rng(4)
    E, N = 16, 200
    steps = rng.poisson(50, (N, E)).astype(float)
    steps[:, 0] = 30.0  # steady and above the spiky one on average
    steps[:, 1] = np.where(np.arange(N) % 8 == 0, 240.0, 0.0)  # cold on average, 240 in one step of 8
    load = steps.sum(axis=0)
    by_mean = replicate(spike_weights(load, steps, 0.0, 0.9)[None], E + 4)[2][0]
    by_spike = replicate(spike_weights(load, steps, 1.0, 0.95)[None], E + 4)[2][0]
    assert by_mean[1] == 1 and by_spike[1] > 1
    np.testing.assert_allclose(spike_weights(load, steps, 0.0, 0.9), load / load.sum())


def test_start_rows_name_each_blend_and_are_deterministic():
    rng = np.random.default_rng(5)
    load, steps = rng.uniform(10, 100, 24), rng.poisson(20, (30, 24)).astype(float)
    a = start_rows(load, steps, 8, 4, (0.0, 1.0), 0.9, 0.03)
    b = start_rows(load, steps, 8, 4, (0.0, 1.0), 0.9, 0.03)
    assert [n for n, _ in a] == ["blend 0", "blend 1"]
    assert all(np.array_equal(x, y) for (_, x), (_, y) in zip(a, b))
