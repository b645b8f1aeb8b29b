"""Routing statistics: hand-made cases with known answers, then the real traces."""

from __future__ import annotations

import numpy as np
import pytest

from profiling import stats
from profiling.trace import RoutingTrace


def test_hotness_and_top_share():
    load = np.array([[1, 5, 0, 4], [2, 2, 2, 2]])
    s, order = stats.hotness(load)
    np.testing.assert_allclose(s[0], [0.5, 0.4, 0.1, 0.0])
    np.testing.assert_array_equal(order[0], [1, 3, 0, 2])
    np.testing.assert_array_equal(order[1], [0, 1, 2, 3])  # ties: lower id first
    np.testing.assert_allclose(stats.top_share(load, 2), [0.9, 0.5])
    with pytest.raises(ValueError, match="n must be"):
        stats.top_share(load, 5)


def test_lorenz_curve_known_points():
    cur = stats.lorenz_curve(np.array([[1, 1, 1, 1], [0, 0, 0, 8], [0, 0, 0, 0]]))
    np.testing.assert_allclose(cur[0], [0, 0.25, 0.5, 0.75, 1])
    np.testing.assert_allclose(cur[1], [0, 0, 0, 0, 1])
    np.testing.assert_allclose(cur[2], [0, 0.25, 0.5, 0.75, 1])


def test_tv_distance_bounds_and_cases():
    assert stats.tv_distance([1, 0, 0], [0, 0, 5]) == 1.0
    assert stats.tv_distance([2, 2], [1, 1]) == 0.0  # scale-free
    np.testing.assert_allclose(stats.tv_distance([3, 1], [1, 1]), 0.25)
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 50, (20, 6)), rng.integers(0, 50, (20, 6))
    d = stats.tv_distance(a, b)
    assert d.shape == (20,) and np.all((d >= 0) & (d <= 1))
    np.testing.assert_allclose(d, stats.tv_distance(b, a))


def test_rank_correlation_matches_scipy_with_ties():
    scipy_stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(1)
    a = rng.integers(0, 5, (30, 9))  # many ties
    b = rng.integers(0, 5, (30, 9))
    ours = stats.rank_correlation(a, b)
    for r in range(30):
        ref = scipy_stats.spearmanr(a[r], b[r]).statistic
        if np.isnan(ref):
            assert np.isnan(ours[r])
        else:
            assert ours[r] == pytest.approx(ref, abs=1e-12)
    assert stats.rank_correlation([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert stats.rank_correlation([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert np.isnan(stats.rank_correlation([1, 1, 1], [1, 2, 3]))


def test_topn_overlap():
    assert stats.topn_overlap([9, 8, 0, 0], [8, 9, 0, 0], 2) == 1.0
    assert stats.topn_overlap([9, 8, 0, 0], [0, 8, 9, 0], 2) == 0.5
    assert stats.topn_overlap([9, 8, 1, 0], [0, 0, 9, 8], 2) == 0.0


def test_window_drift_and_persistence_on_hand_made_windows():
    w = np.array(
        [
            [[4, 3, 2, 1]],
            [[4, 3, 2, 1]],
            [[1, 2, 3, 4]],
        ],
        dtype=float,
    )  # [W=3, L=1, E=4]
    d = stats.window_drift(w, top_n=2)
    assert set(d) == {"tv", "spearman", "topn_overlap"} and d["tv"].shape == (2, 1)
    np.testing.assert_allclose(d["tv"][:, 0], [0.0, 0.4])
    np.testing.assert_allclose(d["spearman"][:, 0], [1.0, -1.0])
    np.testing.assert_allclose(d["topn_overlap"][:, 0], [1.0, 0.0])
    p = stats.hot_expert_persistence(w, top_n=2)
    np.testing.assert_allclose(p[0], [2 / 3, 2 / 3, 1 / 3, 1 / 3])
    ref = stats.drift_from_reference(w, w[0])
    np.testing.assert_allclose(ref["tv"][:, 0], [0.0, 0.0, 0.4])
    with pytest.raises(ValueError, match="windows >= 2"):
        stats.window_drift(w[:1])


def _ids_trace(ids, E):
    return RoutingTrace(num_logical_experts=E, topk_ids=np.asarray(ids))


def test_coactivation_lift_and_pmi_hand_case():
    # 4 tokens, 1 layer, top-2 over E=4: pair (0,1) twice, (2,3) twice -> 0,1 attract; 0,2 never meet
    tr = _ids_trace([[[0, 1]], [[0, 1]], [[2, 3]], [[3, 2]]], 4)
    co = stats.coactivation(tr)
    assert co.shape == (1, 4, 4)
    lift = stats.coactivation_lift(co, tr.num_tokens)[0]
    # P(0,1) = 1/2, P(0) = P(1) = 1/2 -> lift 2
    assert lift[0, 1] == pytest.approx(2.0) and lift[2, 3] == pytest.approx(2.0)
    assert lift[0, 2] == 0.0 and np.isnan(lift[0, 0])
    p = stats.pmi(co, tr.num_tokens)[0]
    assert p[0, 1] == pytest.approx(np.log(2)) and p[0, 2] == -np.inf
    n = stats.pmi(co, tr.num_tokens, normalized=True)[0]
    assert n[0, 1] == pytest.approx(1.0)  # log 2 / -log(1/2): always together when either appears
    assert n[0, 2] == -1.0
    # padding -1 is ignored and an unused expert gives NaN lift
    tr2 = _ids_trace([[[0, -1]], [[0, 1]]], 3)
    l2 = stats.coactivation_lift(stats.coactivation(tr2), 2)[0]
    assert np.isnan(l2[0, 2]) and l2[0, 1] == pytest.approx(1.0)


def test_layer_affinity_and_mutual_information():
    rng = np.random.default_rng(2)
    a = rng.integers(0, 6, (500, 1))
    perm = np.array([3, 5, 0, 1, 2, 4])
    same = np.stack([a, perm[a]], axis=1)  # layer 1 is a function of layer 0: [T, 2, 1]
    indep = np.stack([a, rng.integers(0, 6, (500, 1))], axis=1)
    aff = stats.layer_affinity(_ids_trace(same, 6), 0, 1)
    np.testing.assert_allclose(aff["conditional"][np.arange(6), perm], 1.0)
    np.testing.assert_allclose(aff["conditional"].sum(axis=1), 1.0)
    assert stats.layer_mutual_information(_ids_trace(same, 6))[0] == pytest.approx(1.0)
    assert stats.layer_mutual_information(_ids_trace(indep, 6))[0] < 0.05
    with pytest.raises(ValueError, match="out of range"):
        stats.layer_affinity(_ids_trace(same, 6), 0, 2)


def test_domain_distance_shape_and_symmetry():
    w = np.array([[[1, 0], [1, 1]], [[0, 1], [1, 1]], [[1, 1], [2, 2]]])  # [D=3, L=2, E=2]
    d = stats.domain_distance(w)
    assert d.shape == (2, 3, 3)
    np.testing.assert_allclose(d[0], [[0, 1, 0.5], [1, 0, 0.5], [0.5, 0.5, 0]])
    np.testing.assert_allclose(d[1], 0.0)


def test_bad_loads_are_refused():
    with pytest.raises(ValueError, match=">= 0"):
        stats.load_shares([1, -1])
    with pytest.raises(ValueError, match="num_tokens"):
        stats.coactivation_lift(np.eye(2), 0)


# ---- real traces -------------------------------------------------------------------------------
def test_deepseek_trace_statistics(deepseek_trace):
    tr = deepseek_trace
    L, E = tr.num_layers, tr.num_logical_experts
    w = stats.window_loads(tr, 8)
    assert w.shape == (8, L, E)
    np.testing.assert_allclose(w.sum(axis=0), tr.counts())
    # drift of a trace against itself is zero
    same = stats.window_drift(np.stack([tr.counts(), tr.counts()]))
    np.testing.assert_allclose(same["tv"], 0.0)
    np.testing.assert_allclose(same["spearman"], 1.0)
    d = stats.window_drift(w)
    assert np.all((d["tv"] >= 0) & (d["tv"] <= 1)) and np.all(np.abs(d["spearman"]) <= 1)
    # consecutive windows of one chat workload resemble each other more than a random reshuffle of experts
    rng = np.random.default_rng(0)
    shuffled = np.stack([w[0], w[1][:, rng.permutation(E)]])
    assert d["tv"][0].mean() < stats.window_drift(shuffled)["tv"][0].mean()
    p = stats.hot_expert_persistence(w, top_n=8)
    np.testing.assert_allclose(p.sum(axis=1), 8.0)
    s, _ = stats.hotness(tr.counts())
    np.testing.assert_allclose(s.sum(axis=1), 1.0)
    assert np.all(np.diff(s, axis=1) <= 0)
    lc = stats.lorenz_curve(tr.counts())
    assert np.all(lc <= np.linspace(0, 1, E + 1) + 1e-12)  # below the diagonal


def test_deepseek_coactivation_and_affinity(deepseek_trace):
    tr = deepseek_trace.slice_tokens(0, 20000).select_layers([0, 1, 2])
    co = stats.coactivation(tr)
    assert co.shape == (3, 64, 64)
    np.testing.assert_array_equal(co, co.transpose(0, 2, 1))
    np.testing.assert_array_equal(np.diagonal(co, axis1=1, axis2=2), tr.counts())
    lift = stats.coactivation_lift(co, tr.num_tokens)
    assert np.nanmax(lift) > 1.5  # real routing has attracted pairs
    mi = stats.layer_mutual_information(tr)
    assert mi.shape == (2,) and np.all((mi > 0) & (mi < 1))


def test_olmoe_domains_differ(olmoe_trace):
    tr = olmoe_trace
    d = stats.domain_distance(tr.window_counts)
    D = len(tr.window_labels)
    assert d.shape == (tr.num_layers, D, D)
    assert np.all((d >= 0) & (d <= 1)) and np.allclose(np.diagonal(d, axis1=1, axis2=2), 0)
    off = d[:, ~np.eye(D, dtype=bool)]
    assert off.min() > 0  # every pair of domains routes differently somewhere
