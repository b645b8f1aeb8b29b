"""Metrics checked against hand-computed small cases (docs/metrics.md definitions)."""

import numpy as np
import pytest

from placement import Placement, Topology
from placement.metrics import (
    balance_stats,
    communication,
    evaluate,
    expected_gpu_load,
    moved_slots,
    peak_lower_bound,
    route_tokens,
    routed_gpu_tokens,
    source_ranks,
    step_par,
    trace_gpu_load,
)
from profiling.trace import RoutingTrace

# 4 GPUs in 2 nodes, 2 slots each; expert 0 on GPU0 and GPU2, expert 1 on GPU0 and GPU3.
TOPO = Topology(ep_size=4, num_physical_experts=8, num_nodes=2)
P2L = np.array([[0, 1, 2, 3, 4, 0, 5, 1]])
PL = Placement(P2L, 6, TOPO)
TRACE = RoutingTrace(
    num_logical_experts=6,
    topk_ids=np.array([[[0, 2]], [[1, 5]], [[3, 4]]]),
    source_rank=np.array([3, 3, 0]),
)


def test_even_split_par_balancedness_imbalance():
    load = np.array([[10.0, 6.0, 3.0, 2.0, 4.0, 5.0]])
    gl = expected_gpu_load(PL, load)
    # e0: 5 on GPU0 and GPU2; e1: 3 on GPU0 and GPU3
    np.testing.assert_allclose(gl, [[8.0, 5.0, 9.0, 8.0]])
    s = balance_stats(gl)
    assert s["par"] == pytest.approx(9 / 7.5)
    assert s["balancedness"] == pytest.approx(7.5 / 9)
    assert s["imbalance_ratio"] == pytest.approx(1.5 / 7.5)


def test_local_policy_prefers_own_gpu_then_own_node():
    slots = route_tokens(PL, TRACE.topk_ids, TRACE.source_rank, "local")
    # t0 from GPU3 (node 1): e0 -> its node-1 replica (slot 5 on GPU2); e2 only on GPU1 (slot 2)
    # t1 from GPU3: e1 and e5 both on GPU3 (slots 7, 6); t2 from GPU0: e3 slot 3, e4 slot 4
    assert slots[:, 0, :].tolist() == [[5, 2], [7, 6], [3, 4]]
    gl = trace_gpu_load(PL, TRACE, "local")
    np.testing.assert_allclose(gl, [[0.0, 2.0, 2.0, 2.0]])
    np.testing.assert_array_equal(routed_gpu_tokens(PL, slots), gl.astype(int))


def test_even_policy_rotates_over_replicas_and_splits_fractionally():
    slots = route_tokens(PL, TRACE.topk_ids, TRACE.source_rank, "even")
    # token 0 pick 0 -> replica (0+0)%2 of e0 = slot 0; token 1 pick 0 -> replica (1+0)%2 of e1 = slot 7
    assert slots[0, 0, 0] == 0 and slots[1, 0, 0] == 7
    gl = trace_gpu_load(PL, TRACE, "even")
    np.testing.assert_allclose(gl, [[1.0, 2.0, 1.5, 1.5]])


def test_remote_nodes_and_gpus_per_token_hand_computed():
    c = communication(PL, TRACE, "local", hidden_size=128)
    # t0: remote node {0}, remote GPUs {2, 1}; t1: none; t2: node {1}, GPUs {1, 2}
    assert c["remote_nodes_per_token"] == pytest.approx(2 / 3)
    assert c["remote_gpus_per_token"] == pytest.approx(4 / 3)
    assert c["source_ranks"] == "trace"
    assert c["bytes_per_token"] == pytest.approx(4 / 3 * (128 + 4 + 256))
    ce = communication(PL, TRACE, "even")
    # even: t0 e0 -> slot 0 (GPU0, node 0), e2 -> GPU1: node {0}, GPUs {0, 1}
    assert ce["remote_nodes_per_token"] == pytest.approx(2 / 3)


def test_padding_ids_are_ignored():
    tr = RoutingTrace(
        num_logical_experts=6, topk_ids=np.array([[[0, -1]], [[-1, -1]]]), source_rank=np.array([0, 0])
    )
    slots = route_tokens(PL, tr.topk_ids, tr.source_rank, "local")
    assert slots[0, 0].tolist() == [0, -1] and slots[1, 0].tolist() == [-1, -1]
    c = communication(PL, tr, "local")
    assert c["remote_nodes_per_token"] == 0.0  # the all-padding token does not count
    assert trace_gpu_load(PL, tr, "local").sum() == 1.0


def test_step_par_hand_case():
    topo = Topology(2, 2, 1)
    pl = Placement(np.array([[0, 1]]), 2, topo)
    # 2 steps of 1 token per rank: step 0 both tokens pick expert 0, step 1 both pick expert 1
    tr = RoutingTrace(num_logical_experts=2, topk_ids=np.array([[[0]], [[0]], [[1]], [[1]]]))
    sp = step_par(pl, tr, step_tokens=1)
    assert sp["num_steps"] == 2 and sp["step_par"] == pytest.approx(2.0)
    assert balance_stats(trace_gpu_load(pl, tr))["par"] == pytest.approx(1.0)


def test_step_par_at_least_aggregate_par_on_full_steps():
    rng = np.random.default_rng(1)
    topo = Topology(4, 8, 2)
    pl = Placement(np.array([[0, 1, 2, 3, 4, 5, 6, 7]]), 8, topo)
    tr = RoutingTrace(num_logical_experts=8, topk_ids=rng.integers(0, 8, (64, 1, 2)))
    agg = balance_stats(trace_gpu_load(pl, tr))["par"]
    assert step_par(pl, tr, step_tokens=4)["step_par"] >= agg - 1e-12


def test_moved_slots_and_shape_check():
    other = Placement(np.array([[1, 0, 2, 3, 4, 0, 5, 1]]), 6, TOPO)
    assert moved_slots(PL, other) == 2
    assert moved_slots(PL, PL) == 0
    with pytest.raises(ValueError, match="differ in shape"):
        moved_slots(PL, np.zeros((2, 8), int))


def test_lower_bound_is_max_of_mean_and_hot_share():
    load = np.array([[100.0, 1.0, 1.0, 1.0]])
    # 4 GPUs, 6 slots -> at most 3 replicas of the hot expert: 100/3 > mean 103/4
    assert peak_lower_bound(load, 4, 6)[0] == pytest.approx(100 / 3)
    assert peak_lower_bound(np.array([[5.0, 5.0, 5.0, 5.0]]), 2, 4)[0] == pytest.approx(10.0)


def test_source_ranks_fallbacks():
    tr = RoutingTrace(
        num_logical_experts=2, topk_ids=np.zeros((5, 1, 1), int), seq_offsets=np.array([0, 2, 5])
    )
    src, how = source_ranks(tr, 4)
    assert how == "round-robin by prompt" and src.tolist() == [0, 0, 1, 1, 1]
    tr2 = RoutingTrace(num_logical_experts=2, topk_ids=np.zeros((5, 1, 1), int))
    src, how = source_ranks(tr2, 2)
    assert how == "round-robin by token" and src.tolist() == [0, 1, 0, 1, 0]


def test_mismatched_trace_rejected_with_numbers():
    tr = RoutingTrace(num_logical_experts=7, topk_ids=np.zeros((2, 1, 1), int))
    with pytest.raises(ValueError, match="7 logical experts but the placement has 6"):
        evaluate(PL, tr)
    counts_only = RoutingTrace(num_logical_experts=6, window_counts=np.ones((2, 1, 6)))
    with pytest.raises(ValueError, match="needs a per-token trace"):
        evaluate(PL, counts_only, "local")
    assert evaluate(PL, counts_only, "even").balance["par"] >= 1.0


def test_real_trace_exact_routing_close_to_expectation(deepseek_trace):
    from solver.greedy import greedy_placement

    tr = deepseek_trace.select_windows(range(200))
    topo = Topology.from_redundant(64, 32, 32, 4)
    pl, _ = greedy_placement(tr.counts(), topo, layer_ids=tr.layer_ids)
    src, _ = source_ranks(tr, 32)
    for policy in ("even", "local"):
        exact = routed_gpu_tokens(pl, route_tokens(pl, tr.topk_ids, src, policy))
        expect = trace_gpu_load(pl, tr, policy)
        assert exact.sum() == pytest.approx(expect.sum())  # every pick lands somewhere
        assert np.abs(exact - expect).max() <= 0.1 * expect.max()


@pytest.mark.parametrize("G, N", [(8, 2), (66, 3)])  # 66 GPUs exercises the non-bitmask path
def test_communication_matches_brute_force(G, N):
    rng = np.random.default_rng(G)
    E, k, T = 40, 4, 120
    S = -(-E // G) + (1 if G < E else 0)
    topo = Topology(G, G * S, N)
    from solver.greedy import greedy_placement

    pl, _ = greedy_placement(rng.integers(1, 50, (1, E)).astype(float), topo)
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(T)])[:, None, :]
    ids[::7, 0, -1] = -1
    tr = RoutingTrace(num_logical_experts=E, topk_ids=ids, source_rank=rng.integers(0, G, T))
    for policy in ("even", "local"):
        slots = route_tokens(pl, tr.topk_ids, tr.source_rank, policy)
        nodes_ref, gpus_ref = [], []
        for t in range(T):
            s = [int(x) for x in slots[t, 0] if x >= 0]
            gpus = {int(topo.gpu_of_slot[x]) for x in s} - {int(tr.source_rank[t])}
            nodes = {int(topo.node_of_slot[x]) for x in s} - {int(tr.source_rank[t]) // topo.gpus_per_node}
            gpus_ref.append(len(gpus))
            nodes_ref.append(len(nodes))
        c = communication(pl, tr, policy)
        assert c["remote_gpus_per_token"] == pytest.approx(np.mean(gpus_ref))
        assert c["remote_nodes_per_token"] == pytest.approx(np.mean(nodes_ref))
