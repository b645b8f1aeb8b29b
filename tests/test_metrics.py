"""Metrics checked against hand-computed small cases (docs/metrics.md definitions)."""

import numpy as np
import pytest

from placement import Placement, Topology
from placement.dispatch import DISPATCH, DispatchModel, get_dispatch, rank_choices
from placement.dispatch.ideal import even_choices
from placement.metrics import (
    ENGINE_RULES,
    balance_stats,
    batch_positions,
    communication,
    evaluate,
    expected_gpu_load,
    moved_slots,
    peak_lower_bound,
    rank_gpu_load,
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
    sp = step_par(pl, tr, step_tokens=1, phase="prefill")
    assert sp["num_steps"] == 2 and sp["phase"] == "prefill" and sp["step_par"] == pytest.approx(2.0)
    assert balance_stats(trace_gpu_load(pl, tr))["par"] == pytest.approx(1.0)


def test_step_par_at_least_aggregate_par_on_full_steps():
    rng = np.random.default_rng(1)
    topo = Topology(4, 8, 2)
    pl = Placement(np.array([[0, 1, 2, 3, 4, 5, 6, 7]]), 8, topo)
    picks = np.argsort(rng.random((64, 1, 8)), axis=-1)[..., :2]  # 2 distinct experts per token, as a router
    tr = RoutingTrace(num_logical_experts=8, topk_ids=picks)
    agg = balance_stats(trace_gpu_load(pl, tr))["par"]
    assert step_par(pl, tr, step_tokens=4, phase="prefill")["step_par"] >= agg - 1e-12


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
    for dispatch in [m for m in DISPATCH.values() if m.runtime]:  # the rotation our runtime applies
        exact = routed_gpu_tokens(pl, route_tokens(pl, tr.topk_ids, src, dispatch))
        expect = trace_gpu_load(pl, tr, dispatch)
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
    for dispatch in DISPATCH.values():
        slots = route_tokens(pl, tr.topk_ids, tr.source_rank, dispatch)
        nodes_ref, gpus_ref = [], []
        for t in range(T):
            s = [int(x) for x in slots[t, 0] if x >= 0]
            gpus = {int(topo.gpu_of_slot[x]) for x in s} - {int(tr.source_rank[t])}
            nodes = {int(topo.node_of_slot[x]) for x in s} - {int(tr.source_rank[t]) // topo.gpus_per_node}
            gpus_ref.append(len(gpus))
            nodes_ref.append(len(nodes))
        c = communication(pl, tr, dispatch)
        assert c["remote_gpus_per_token"] == pytest.approx(np.mean(gpus_ref))
        assert c["remote_nodes_per_token"] == pytest.approx(np.mean(nodes_ref))


# ---------------------------------------------------------------------------------------------
# Every registered model, scored against an independent token-by-token computation
# ---------------------------------------------------------------------------------------------
def _random_case(seed: int):
    """8 GPUs on 2 nodes, 3 slots each, 16 experts (8 with a second replica), 2 layers; 600 tokens."""
    rng = np.random.default_rng(seed)
    topo = Topology(ep_size=8, num_physical_experts=24, num_nodes=2)
    rows = []
    while len(rows) < 2:
        row = np.r_[np.arange(16), rng.choice(16, 8, replace=False)]
        rng.shuffle(row)
        if all(len(set(row[g * 3 : (g + 1) * 3])) == 3 for g in range(8)):  # no copy twice on a GPU
            rows.append(row)
    pl = Placement(np.array(rows), 16, topo)
    ids = np.stack([rng.choice(16, 2, replace=False) for _ in range(600)])[:, None, :].repeat(2, axis=1)
    ids[:, 1, :] = (ids[:, 1, :] * 5 + 3) % 16  # a different routing in layer 1
    ids[::9, 0, 1] = -1
    return pl, RoutingTrace(num_logical_experts=16, topk_ids=ids, source_rank=rng.integers(0, 8, 600))


def _hand_slot_loads(pl, ids, src, rows, model, layer):
    """Float64 ``[T, P]``: what each token puts on each slot of ``layer``, one token at a time, from the
    registry alone (the shares of ``rank_choices``, or the model's own ``route`` when not fractional)."""
    T, P = ids.shape[0], pl.num_physical_experts
    out = np.zeros((T, P))
    slots, weights = rank_choices(pl, layer, model)  # [G, E, R]
    for t in range(T):
        for e in ids[t, layer]:
            if e < 0:
                continue
            if model.fractional:
                for s, w in zip(slots[src[t], e], weights[src[t], e]):
                    if s >= 0:
                        out[t, s] += w
            else:
                one = np.array([[e]])
                out[t, model.route(pl, layer, one, src[t : t + 1], rows[t : t + 1], None)[0, 0]] += 1
    return out


_PER_TOKEN = [n for n, m in DISPATCH.items() if not m.needs_step_counts]  # per-step: test_step_dispatch.py


@pytest.mark.parametrize("name", _PER_TOKEN)
def test_every_model_scores_as_its_shares_applied_by_hand(name):
    model = get_dispatch(name)
    pl, tr = _random_case(7)
    src = tr.source_rank.astype(np.int64)
    rows = batch_positions(src, 32)
    G, S = 8, 3
    hand = [_hand_slot_loads(pl, tr.topk_ids, src, rows, model, l) for l in range(2)]  # [T, P] per layer
    want = np.stack([h.sum(axis=0).reshape(G, S).sum(axis=1) for h in hand])  # [L, G]
    np.testing.assert_allclose(trace_gpu_load(pl, tr, name, src, step_tokens=32), want, atol=1e-9)
    np.testing.assert_allclose(
        balance_stats(want)["par"], evaluate(pl, tr, name, step_tokens=32, src=src).balance["par"]
    )
    if model.fractional:  # rank_gpu_load is the expectation of every model
        counts = np.zeros((2, G, 16))
        for l in range(2):
            for t in range(tr.num_tokens):
                for e in tr.topk_ids[t, l]:
                    if e >= 0:
                        counts[l, src[t], e] += 1
        np.testing.assert_allclose(rank_gpu_load(pl, counts, name), want, atol=1e-9)


@pytest.mark.parametrize("name", _PER_TOKEN)
def test_every_model_step_par_by_hand(name):
    model = get_dispatch(name)
    pl, tr = _random_case(11)
    b, G = 4, 8
    T = (tr.num_tokens // (b * G)) * b * G
    tok = np.arange(T)
    src, rows, step = (tok % (b * G)) // b, tok % b, tok // (b * G)  # step_par's layout
    pars = np.zeros((2, step.max() + 1))
    for l in range(2):
        hand = _hand_slot_loads(pl, tr.topk_ids[:T], src, rows, model, l)  # [T, P]
        for s in range(step.max() + 1):
            gpu = hand[step == s].sum(axis=0).reshape(G, 3).sum(axis=1)
            pars[l, s] = gpu.max() / gpu.mean()
    unranked = RoutingTrace(num_logical_experts=16, topk_ids=tr.topk_ids)  # chunks dealt round robin
    sp = step_par(pl, unranked, step_tokens=b, dispatch=name, phase="prefill")
    assert sp["num_steps"] == step.max() + 1
    assert sp["step_par"] == pytest.approx(pars.mean(axis=1).mean(), rel=1e-12)
    assert sp["step_par_per_layer"] == pytest.approx(pars.mean(axis=1).tolist(), rel=1e-12)


def test_models_and_names_score_alike():
    pl, tr = _random_case(3)
    for name, model in DISPATCH.items():
        assert (
            evaluate(pl, tr, model, step_tokens=8).to_dict()
            == evaluate(pl, tr, name, step_tokens=8).to_dict()
        )
        assert evaluate(pl, tr, model).to_dict()["policy"] == name
    assert set(ENGINE_RULES) == {n for n, m in DISPATCH.items() if m.route is not None}


# ---------------------------------------------------------------------------------------------
# A model scored per step (the hook a model such as ``balanced`` registers through)
# ---------------------------------------------------------------------------------------------
def _first_replica_per_step(calls: list):
    """A step_load that puts a step's tokens of an expert on its first replica when the step's count is
    even, on its last when odd (it depends on the step's counts only); records each call in ``calls``."""

    def step_load(placement, layer, counts):
        calls.append((layer, counts.copy()))
        l2p = placement.logical_to_physical_map[layer]  # [E, R]
        cnt = placement.logical_replica_count[layer]  # [E]
        out = np.zeros((counts.shape[0], placement.num_physical_experts))
        for s in range(counts.shape[0]):
            for e in range(counts.shape[1]):
                pick = l2p[e, 0] if counts[s, e] % 2 == 0 else l2p[e, cnt[e] - 1]
                out[s, pick] += counts[s, e]
        return out

    return step_load


def _step_model(calls: list) -> DispatchModel:
    return DispatchModel(
        "test-per-step",
        "a per-step test rule",
        even_choices,
        needs_step_counts=True,
        fractional=False,
        step_load=_first_replica_per_step(calls),
    )


def test_a_per_step_model_is_scored_step_by_step_through_its_step_load():
    pl, tr = _random_case(5)
    calls = []
    model = _step_model(calls)
    b, G = 4, 8
    T = (tr.num_tokens // (b * G)) * b * G
    step = np.arange(T) // (b * G)
    sp = step_par(pl, RoutingTrace(16, topk_ids=tr.topk_ids), step_tokens=b, dispatch=model, phase="prefill")
    hook = _first_replica_per_step([])
    pars = np.zeros((2, step.max() + 1))
    for l in range(2):
        counts = np.zeros((step.max() + 1, 16))
        for t in range(T):
            for e in tr.topk_ids[t, l]:
                if e >= 0:
                    counts[step[t], e] += 1
        np.testing.assert_array_equal(calls[l][1], counts)  # the hook saw each step's all-reduced counts
        gpu = hook(pl, l, counts).reshape(-1, G, 3).sum(axis=2)  # [S, G]
        pars[l] = gpu.max(axis=1) / gpu.mean(axis=1)
    assert sp["step_par"] == pytest.approx(pars.mean(), rel=1e-12)
    # the whole trace: each rank's s-th batch of 32 tokens forms step s; the loads sum over steps
    src = tr.source_rank.astype(np.int64)
    calls.clear()
    gl = trace_gpu_load(pl, tr, model, src, step_tokens=32)
    assert calls[0][1].shape == ((np.bincount(src).max() + 31) // 32, 16)
    assert gl.sum() == pytest.approx((tr.topk_ids >= 0).sum())
    # rank_gpu_load reads leading axes as steps
    e = int(np.flatnonzero(pl.logical_replica_count[0] == 2)[0])  # an expert with two replicas
    per_step = np.zeros((3, 2, G, 16))
    per_step[0, :, 0, e] = 2  # an even count: first replica
    per_step[1, :, 5, e] = 3  # odd: last replica
    loads = rank_gpu_load(pl, per_step, model)  # [3, L, G]
    first, last = pl.logical_to_physical_map[0, e, :2] // 3  # their GPUs
    assert first != last
    assert loads[0, 0, first] == 2 and loads[1, 0, last] == 3
    assert loads[0, 0].sum() == 2 and loads[1, 0].sum() == 3 and loads[2].sum() == 0


def test_a_per_step_model_without_a_token_route_has_no_communication_metrics():
    pl, tr = _random_case(5)
    model = _step_model([])
    with pytest.raises(ValueError, match="no token-level route"):
        route_tokens(pl, tr.topk_ids, tr.source_rank, model)
    ev = evaluate(pl, tr, model, step_tokens=4)
    assert ev.comm is None and ev.step is not None and ev.dispatch == "test-per-step"


def test_a_step_load_of_the_wrong_shape_is_named():
    pl, tr = _random_case(5)
    model = DispatchModel(
        "bad-step",
        "returns one row",
        even_choices,
        needs_step_counts=True,
        fractional=False,
        step_load=lambda placement, layer, counts: np.zeros((1, 24)),
    )
    with pytest.raises(ValueError, match=r"returned shape \(1, 24\) for 18 steps; it must return \(18, 24\)"):
        step_par(pl, RoutingTrace(16, topk_ids=tr.topk_ids), step_tokens=4, dispatch=model, phase="prefill")


# ---------------------------------------------------------------------------------------------
# A dispatch model added in one place (docs/architecture.md "How to add a dispatch model")
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def lowest_slot_model():
    """A toy model registered here only: every rank sends all of an expert's tokens to its lowest slot."""
    from placement.dispatch import register

    def lowest_slot(placement, layer):
        slots, _ = even_choices(placement, layer)  # [G, E, R], slots ascending, -1 padded
        weights = np.zeros(slots.shape)
        weights[:, :, 0] = 1.0
        return slots, weights

    model = register(
        DispatchModel(
            "test-lowest-slot",
            "every token to its expert's lowest slot",
            lowest_slot,
            counts_only=False,
            local_first=False,
            locality_fit=False,
            table_fit="",
            runtime_route="",
        )
    )
    yield model
    del DISPATCH[model.name]


def test_a_model_registered_in_one_place_is_scored_by_the_metrics(lowest_slot_model):
    pl, tr = _random_case(5)
    load = trace_gpu_load(pl, tr, "test-lowest-slot")  # [L, G]
    want = np.zeros((2, 8))  # the same by a plain loop over the picks
    for l in range(2):
        for e in tr.topk_ids[:, l, :].ravel():
            if e >= 0:
                want[l, pl.logical_to_physical_map[l, e, 0] // 3] += 1
    assert np.allclose(load, want)
    assert not np.allclose(load, trace_gpu_load(pl, tr, "even"))  # it is not the even split renamed
    ev = evaluate(pl, tr, lowest_slot_model)
    assert ev.dispatch == "test-lowest-slot" and ev.comm is None  # no token route: no communication
    assert ev.balance["par"] == pytest.approx(balance_stats(want)["par"])
    with pytest.raises(
        ValueError, match="needs a per-token trace"
    ):  # not counts_only: counts do not score it
        evaluate(pl, RoutingTrace(16, window_counts=tr.counts()[None]), lowest_slot_model)
