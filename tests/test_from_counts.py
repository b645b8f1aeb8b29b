"""profiling.from_counts: tokens drawn from a counts-only trace keep each window's per-layer expert
counts in expectation, pick k distinct experts, and mark themselves as drawn."""

from __future__ import annotations

import numpy as np
import pytest

from profiling.from_counts import tokens_from_counts
from profiling.trace import RoutingTrace


def _counts(seed: int = 0) -> RoutingTrace:
    rng = np.random.default_rng(seed)
    W, L, E, k, T = 3, 2, 8, 2, 4000
    p = rng.dirichlet(np.ones(E) * 2.0, size=(W, L))  # [W, L, E] skewed per window
    while (k * p).max() > 0.95:  # a valid count: no expert in more than every token of its window
        p = rng.dirichlet(np.ones(E) * 2.0, size=(W, L))
    return RoutingTrace(num_logical_experts=E, window_counts=k * p * T, layer_ids=(0, 5))


def test_each_window_keeps_its_expert_counts_and_picks_are_distinct():
    tr = _counts()
    out = tokens_from_counts(tr, 2, seed=1)
    assert out.metadata["from_counts"] and out.layer_ids == (0, 5) and out.top_k == 2
    assert len(out.natural_windows()) == 3
    picks = np.sort(out.topk_ids, axis=2)
    assert (np.diff(picks, axis=2) != 0).all()  # k distinct experts per token and layer
    want = np.asarray(tr.window_counts)
    for w, (a, b) in enumerate(out.natural_windows()):
        assert b - a == 4000
        for layer in range(2):
            got = np.bincount(out.topk_ids[a:b, layer].ravel(), minlength=8)
            # binomial noise: within 5 standard deviations of each expert's expected count
            sd = np.sqrt(want[w, layer] * (1 - want[w, layer] / 4000)) + 1
            assert np.all(np.abs(got - want[w, layer]) < 5 * sd), (w, layer, got, want[w, layer])


def test_a_large_trace_is_scaled_down_and_bad_input_is_named():
    tr = _counts()
    small = tokens_from_counts(tr, 2, max_tokens=600)
    assert small.num_tokens == 600 and small.metadata["scale"] == pytest.approx(0.05)
    with pytest.raises(ValueError, match="top_k must be a whole number 1..8"):
        tokens_from_counts(tr, 9)
    empty = RoutingTrace(num_logical_experts=8, window_counts=np.zeros((2, 1, 8)), layer_ids=(0,))
    with pytest.raises(ValueError, match="window 0 routes nothing"):
        tokens_from_counts(empty, 2)


def test_an_expert_counted_over_every_token_is_in_every_token_once():
    """Counts that ask one expert for more than every token (rounded or inconsistent counts): capped at
    every token, the excess spread over the others, and still k distinct experts per token."""
    tr = RoutingTrace(
        num_logical_experts=4, window_counts=np.array([[[1500.0, 300.0, 200.0, 0.0]]]), layer_ids=(0,)
    )
    out = tokens_from_counts(tr, 2, seed=3)
    ids = out.topk_ids[:, 0, :]
    assert out.num_tokens == 1000 and (ids == 0).any(axis=1).all() and (ids[:, 0] != ids[:, 1]).all()
    share = np.bincount(ids.ravel(), minlength=4) / 1000
    assert share[3] == 0 and abs(share[1] - 0.6) < 0.06 and abs(share[2] - 0.4) < 0.06
