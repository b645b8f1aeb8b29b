"""Online replay scored under the engines' dispatch rules (``replay(..., dispatch=...)``)."""

from __future__ import annotations

import numpy as np
import pytest

from moe_placement.apps.replay import question_stream, replay, token_stream
from placement.dispatch import SGLANG_DYNAMIC, DispatchModel, sglang_static_tables
from placement.dispatch.ideal import even_choices
from placement.metrics import balance_stats
from placement.topology import Topology
from profiling.synthetic import synthetic_trace
from profiling.trace import RoutingTrace


@pytest.fixture(scope="module")
def stream():
    trace = synthetic_trace(
        num_tokens=9000, num_layers=2, num_logical_experts=16, top_k=2, num_prompts=60, seed=4
    )
    return trace, token_stream(trace, ep_size=8, step_tokens=8)


def test_token_stream_knows_every_tokens_rank(stream):
    trace, st = stream
    assert np.array_equal(st.rank_steps.sum(axis=2), st.steps)
    # step 0, rank 3 holds tokens 24..31 of the trace
    ids = trace.topk_ids[24:32]
    for l in range(2):
        assert np.array_equal(st.rank_steps[0, l, 3], np.bincount(ids[:, l].ravel(), minlength=16))


def test_static_follows_the_table(stream):
    _, st = stream
    topo = Topology(ep_size=8, num_physical_experts=24, num_nodes=2)
    even = replay(st, topo, window_steps=30, strategies=("static",), dispatch="even")
    static = replay(st, topo, window_steps=30, strategies=("static",), dispatch="sglang-static")
    assert static.params["dispatch"] == "sglang-static"
    # window 1 scored by hand: every token of rank g to table[g, l, e]
    from solver.greedy import greedy_placement

    init, _ = greedy_placement(st.steps[:30].sum(axis=0), topo, layer_ids=st.layer_ids)
    table = sglang_static_tables(init)  # [G, L, E]
    held = st.rank_steps[30:60].sum(axis=0)  # [L, G, E]
    loads = np.zeros((2, 8))
    for l in range(2):
        slot = np.bincount(table[:, l, :].ravel(), weights=held[l].ravel(), minlength=24)
        loads[l] = slot.reshape(8, 3).sum(axis=1)
    row = [r for r in static.rows if r["window"] == 1][0]
    assert row["par"] == pytest.approx(balance_stats(loads)["par"], rel=1e-12)
    assert row["par"] != [r for r in even.rows if r["window"] == 1][0]["par"]


def test_counts_only_stream_cannot_be_scored_by_an_engine_rule():
    trace = synthetic_trace(num_tokens=3000, num_layers=1, num_logical_experts=8, top_k=2, num_prompts=30)
    counts = RoutingTrace(num_logical_experts=8, window_counts=trace.window_load(), layer_ids=trace.layer_ids)
    st = question_stream(counts)
    with pytest.raises(ValueError, match="needs source ranks"):
        replay(
            st,
            Topology(ep_size=4, num_physical_experts=12, num_nodes=2),
            window_steps=5,
            dispatch="vllm-hash",
        )


def _first_replica(placement, layer, counts):
    """A per-step rule for the test: every step's tokens of an expert to its first replica: ``[S, P]``."""
    out = np.zeros((counts.shape[0], placement.num_physical_experts))
    out[:, placement.logical_to_physical_map[layer, :, 0]] = counts
    return out


STEP_MODEL = DispatchModel(
    "test-first-replica",
    "every step to the first replica",
    even_choices,
    needs_step_counts=True,
    fractional=False,
    step_load=_first_replica,
)


def test_a_model_passes_as_itself_and_as_its_name(stream):
    _, st = stream
    topo = Topology(ep_size=8, num_physical_experts=24, num_nodes=2)
    by_name = replay(st, topo, window_steps=30, strategies=("static", "greedy"), dispatch="sglang-dynamic")
    by_model = replay(st, topo, window_steps=30, strategies=("static", "greedy"), dispatch=SGLANG_DYNAMIC)
    assert by_model.rows == by_name.rows and by_model.params["dispatch"] == "sglang-dynamic"


def test_a_per_step_model_scores_a_counts_only_stream_from_the_step_counts():
    trace = synthetic_trace(num_tokens=3000, num_layers=1, num_logical_experts=8, top_k=2, num_prompts=30)
    counts = RoutingTrace(num_logical_experts=8, window_counts=trace.window_load(), layer_ids=trace.layer_ids)
    st = question_stream(counts)
    topo = Topology(ep_size=4, num_physical_experts=12, num_nodes=2)
    res = replay(st, topo, window_steps=5, strategies=("static",), dispatch=STEP_MODEL)
    assert res.params["dispatch"] == "test-first-replica"
    from solver.greedy import greedy_placement

    init, _ = greedy_placement(st.steps[:5].sum(axis=0), topo, layer_ids=st.layer_ids)
    held = st.steps[5:10]  # [w, L, E]
    first = init.logical_to_physical_map[0, :, 0]  # [E]
    per_step = np.zeros((5, 4))
    for s in range(5):
        np.add.at(per_step[s], first // 3, held[s, 0])
    row = [r for r in res.rows if r["window"] == 1][0]
    assert row["par"] == pytest.approx(balance_stats(per_step.sum(axis=0)[None])["par"], rel=1e-12)
    assert row["step_par"] == pytest.approx(balance_stats(per_step)["par"], rel=1e-12)


def test_replay_reports_the_break_even_interval(stream):
    from moe_placement.apps.replay import break_even

    _, stream = stream
    topo = Topology.from_redundant(stream.steps.shape[2], 8, 8)
    res = replay(stream, topo, window_steps=8, strategies=("greedy", "static"))
    static, greedy = res.summary["static"], res.summary["greedy"]
    assert static["break_even_steps"] is None and static["arrived_experts"] == 0  # it never moves
    rows = [r for r in res.rows if r["strategy"] == "greedy" and r["arrived_experts"] > 0]
    cost = np.mean([r["rebalance_cost_s"] for r in rows])
    saved = np.mean([r["saved_s_per_step"] for r in rows])
    want = "never" if saved <= 0 else cost / saved
    assert greedy["break_even_steps"] == (want if saved <= 0 else pytest.approx(want))
    assert all(r["rebalance_cost_s"] > 0 for r in rows)
    fake = [{"arrived_experts": 3, "rebalance_cost_s": 2.0, "saved_s_per_step": 0.5}]
    assert break_even(fake) == 4.0
    assert break_even([{**fake[0], "saved_s_per_step": -0.1}]) == "never"


def test_a_window_that_routes_nothing_keeps_the_greedy_placement():
    """Greedy re-places through solver.api.solve; a window with no routed token has no balance to
    place for, so the next window keeps the map it had (nothing moves) instead of a map of zeros."""
    from moe_placement.apps.replay import ReplayStream

    steps = np.random.default_rng(0).poisson(3, (30, 2, 8)).astype(float)  # [N, L, E]
    steps[10:20] = 0
    st = ReplayStream(name="silent window", steps=steps, layer_ids=(0, 1))
    res = replay(
        st, Topology(ep_size=4, num_physical_experts=12), window_steps=10, strategies=("greedy", "static")
    )
    after = {r["strategy"]: r for r in res.rows if r["window"] == 2}
    assert after["greedy"]["moved_slots"] == 0
    assert after["greedy"]["par"] == after["static"]["par"]
