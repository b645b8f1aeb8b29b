"""Online rebalancer: triggers (interval, gain, not on noise), off-thread re-solve, cost model, replay."""

from __future__ import annotations

import concurrent.futures as cf
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from placement.metrics import moved_slots
from placement.topology import Topology
from runtime_hooks.rebalancer import LINKS, Rebalancer, RebalancerConfig, migration_time
from solver.greedy import greedy_placement

ROOT = Path(__file__).resolve().parents[1]
E, L, G, RED = 16, 2, 4, 4


def _popularity(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    p = rng.pareto(1.2, size=(L, E)) + 0.2
    return p / p.sum(axis=1, keepdims=True)  # [L, E]


def _steps(pop: np.ndarray, n: int, assignments: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack(
        [np.stack([rng.multinomial(assignments, pop[l]) for l in range(L)]) for _ in range(n)]
    )  # [n, L, E]


def _placement_for(pop):
    topo = Topology.from_redundant(E, RED, G)
    return greedy_placement(pop * 1e6, topo)[0]


def test_interval_trigger_solves_every_n_steps():
    pop = _popularity(0)
    start = _placement_for(_popularity(1))  # fitted on other traffic
    cfg = RebalancerConfig(window_size=10, step_interval=10, always_apply=True)
    with Rebalancer(start, cfg) as reb:
        for _i, c in enumerate(_steps(pop, 25, 2000, 0)):
            reb.observe(c)
            if reb.pending:
                reb.wait()
        assert reb.num_solves == 2  # steps 10 and 20
        assert [e.step for e in reb.history] == [10, 20]
        assert reb.history[0].applied and reb.history[0].moved_slots > 0
        assert moved_slots(start, reb.placement) > 0


def test_gain_trigger_ignores_noise_below_the_cost():
    pop = _popularity(2)
    start = _placement_for(pop)  # fitted on this very traffic: only sampling noise remains
    cfg = RebalancerConfig(
        window_size=20, step_interval=10**6, trigger="gain", check_interval=5, link="rdma", horizon_steps=20
    )
    with Rebalancer(start, cfg, expert_bytes=44e6) as reb:
        for c in _steps(pop, 120, 4000, 1):
            reb.observe(c)
            reb.wait()
        assert reb.num_solves <= 1  # the calibration solve on the first full window, nothing after
        assert not any(e.applied for e in reb.history)
        assert reb.placement is start


def test_gain_trigger_fires_on_drift_and_applies_through_callback():
    pop_a, pop_b = _popularity(3), _popularity(3)[:, ::-1].copy()  # a domain switch: hot set reversed
    start = _placement_for(pop_a)
    applied = []
    cfg = RebalancerConfig(
        window_size=20,
        step_interval=10**6,
        trigger="gain",
        check_interval=5,
        link="nvlink",
        horizon_steps=3000,
    )
    with Rebalancer(start, cfg, expert_bytes=44e6, apply=applied.append) as reb:
        for c in _steps(pop_a, 40, 4000, 2):
            reb.observe(c)
            reb.wait()
        before = len(applied)
        assert before == 0  # same traffic with sampling noise: nothing worth its migration cost
        for c in _steps(pop_b, 60, 4000, 3):
            reb.observe(c)
            reb.wait()
        assert len(applied) > before  # the switch was detected and a re-placement applied
        ev = [e for e in reb.history if e.applied][-1]
        assert ev.predicted_gain_s > ev.migration_time_s > 0
        assert ev.peak_after < ev.peak_before
        assert reb.placement is applied[-1]


def test_resolve_runs_off_the_calling_thread():
    pop = _popularity(4)
    start = _placement_for(_popularity(5))
    gate = threading.Event()
    ex = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="test-worker")
    try:
        blocker = ex.submit(gate.wait)  # the single worker is busy until the test releases it
        cfg = RebalancerConfig(window_size=5, step_interval=5, always_apply=True)
        reb = Rebalancer(start, cfg, executor=ex)
        for c in _steps(pop, 5, 2000, 4):
            reb.observe(c)  # the 5th step submits; observe must not wait for the solve
        assert reb.pending
        assert reb.poll() is None  # not finished: poll does not block and returns nothing
        assert reb.placement is start
        gate.set()
        blocker.result(timeout=30)
        new = reb.wait(timeout=60)
        assert new is not None and reb.placement is new
        assert reb.history[0].solve_thread.startswith("test-worker")
        assert reb.history[0].solve_thread != threading.current_thread().name
    finally:
        gate.set()
        ex.shutdown(wait=True)


def test_migration_time_follows_the_cost_model():
    start = _placement_for(_popularity(6))
    p2l = start.physical_to_logical_map.copy()
    S = start.topology.slots_per_gpu
    # swap the first slots of GPU 0 and GPU 1 in layer 0: each GPU receives one expert
    p2l[0, 0], p2l[0, S] = p2l[0, S], p2l[0, 0]
    bw, alpha = LINKS["rdma"]
    t = migration_time(start.physical_to_logical_map, p2l, G, 44e6, bw, alpha)
    assert t == pytest.approx(44e6 / bw + alpha)  # parallel over GPUs: one expert per GPU
    assert migration_time(p2l, p2l, G, 44e6, bw, alpha) == 0.0
    assert (
        0.9e-3 < 44e6 / LINKS["rdma"][0] < 1.2e-3 and 0.1e-3 < 44e6 / LINKS["nvlink"][0] < 0.2e-3
    )  # costmodel.md


def test_config_and_input_errors():
    start = _placement_for(_popularity(0))
    with pytest.raises(ValueError, match="window_size"):
        RebalancerConfig(window_size=0)
    with pytest.raises(ValueError, match="trigger"):
        RebalancerConfig(trigger="sometimes")
    with pytest.raises(ValueError, match="num_redundant_experts=3"):
        Rebalancer(start, RebalancerConfig(num_redundant_experts=3))
    with Rebalancer(start, RebalancerConfig()) as reb, pytest.raises(ValueError, match=r"\[2, 16\]"):
        reb.observe(np.zeros((3, E)))


def test_log_balancedness(caplog):
    start = _placement_for(_popularity(0))
    with Rebalancer(start, RebalancerConfig(log_balancedness=True)) as reb:
        with caplog.at_level("INFO", logger="runtime_hooks.rebalancer"):
            reb.observe(_steps(_popularity(0), 1, 1000, 0)[0])
    assert any("balancedness" in r.getMessage() for r in caplog.records)


def test_import_is_light():
    code = (
        "import sys, runtime_hooks.rebalancer, moe_placement.apps.replay; "
        "bad = [m for m in ('torch', 'ortools', 'networkx', 'solver.migration') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run(
        [sys.executable, "-c", code], check=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": ""}
    )


def test_replay_domain_switch_strategies():
    from moe_placement.apps.replay import domain_stream, replay
    from profiling.trace import RoutingTrace

    pops = {"a": _popularity(7), "b": _popularity(8), "c": _popularity(9)}
    tr = RoutingTrace(
        num_logical_experts=E,
        window_counts=np.stack([pops[k] * 1e5 for k in "abc"]),
        window_labels=tuple("abc"),
    )
    stream = domain_stream(tr, ["a", "b", "c"], steps_per_domain=40, world_step_tokens=256, top_k=2, seed=0)
    assert "SAMPLED" in stream.note and stream.steps.shape == (120, L, E)
    topo = Topology.from_redundant(E, RED, G)
    budget = 4
    cfg = RebalancerConfig(
        window_size=20,
        step_interval=20,
        max_moves=budget,
        horizon_steps=3000,
        hidden_size=2048,
        expert_intermediate_size=1024,
    )
    res = replay(stream, topo, cfg, window_steps=20, expert_bytes=12.6e6)
    s = res.summary
    assert set(s) == {"migration", "greedy", "greedy+align", "static"}
    assert s["static"]["moved_slots"] == 0
    assert all(r["moved_slots"] <= budget for r in res.rows if r["strategy"] == "migration")
    assert s["greedy+align"]["moved_slots"] <= s["greedy"]["moved_slots"]
    assert s["greedy+align"]["mean_par"] == pytest.approx(s["greedy"]["mean_par"])
    assert s["migration"]["mean_par"] < s["static"]["mean_par"]  # rebalancing helps across domain switches
    assert all(r["par"] >= 1.0 and r["step_par"] >= r["par"] - 1e-9 for r in res.rows)


def test_the_dispatch_model_is_checked_and_reaches_the_solve_pipeline(monkeypatch):
    import solver.api

    with pytest.raises(ValueError, match="unknown dispatch model 'bogus'"):
        RebalancerConfig(dispatch="bogus")
    seen = []
    real_run = solver.api.run

    def spy(name, problem, options=None, fit=None):
        seen.append((name, problem.dispatch, problem.previous is not None))
        return real_run(name, problem, options, fit)

    monkeypatch.setattr(solver.api, "run", spy)
    from placement.model import Placement
    from placement.topology import Topology
    from runtime_hooks.rebalancer import _resolve_job

    topo = Topology(4, 8, 2)
    load = np.random.default_rng(0).gamma(0.6, 100.0, (2, 6)).round()
    current = Placement(np.tile(np.arange(8) % 6, (2, 1)), 6, topo)
    new, report, _, _ = _resolve_job(load, current, {"max_moves": 4}, "local")
    assert seen == [("migration", "local", True)]
    assert int((new.physical_to_logical_map != current.physical_to_logical_map).sum()) <= 4


def test_rebalance_rule_pays_only_past_its_margin():
    import math

    from runtime_hooks.rebalance_rule import RuleParams, break_even_steps, decide, transfer_seconds

    p = RuleParams(seconds_per_assignment=1e-6, expert_bytes=1e6, bandwidth=1e9, latency=0.0, margin=1.5)
    arrived = np.array([[2, 0], [1, 0]])  # [L, G]: 3 experts arrive on GPU 0
    assert transfer_seconds(arrived, p) == pytest.approx(3e-3)  # the busiest GPU: 3 x 1 ms
    now, new = np.array([5000.0, 5000.0]), np.array([3000.0, 5000.0])  # 2000 assignments saved: 2 ms
    d = decide(now, new, arrived, p)
    assert not d.rebalance and d.gain_s == pytest.approx(2e-3) and "does not pay" in d.reason
    assert d.break_even_windows == pytest.approx(1.5) and d.arrived == 3 and d.busiest_gpu == 3
    # inside the band (gain 1.2x the cost) it keeps; past 1.5x it switches; always overrides
    assert not decide(now, new, arrived, replace(p, horizon=1.8)).rebalance
    assert decide(now, new, arrived, replace(p, horizon=2.3)).rebalance
    assert decide(now, new, arrived, replace(p, always=True)).rebalance
    assert decide(now, new, arrived, replace(p, stall=0.3)).rebalance  # mostly overlapped copies
    assert not decide(now, now + 1, arrived, replace(p, horizon=100)).rebalance  # worse never pays
    assert break_even_steps(1.0, 0.0) == math.inf and break_even_steps(0.0, 0.0) == 0.0
    with pytest.raises(ValueError, match="margin"):
        RuleParams(margin=0.5)


def test_rebalancer_gate_is_the_rule_and_counts_arrived_experts():
    pop = _popularity(1)
    placement = _placement_for(pop)
    cfg = RebalancerConfig(window_size=20, step_interval=20, margin=1000.0)
    with Rebalancer(placement, cfg) as reb:
        for c in _steps(pop[::-1].copy(), 20, 4000, seed=2):
            reb.observe(c)
        assert reb.wait(timeout=60) is None  # a 1000x margin: the gain never clears the band
    ev = reb.history[-1]
    assert not ev.applied and "does not pay" in ev.reason and 0 < ev.arrived_experts <= ev.moved_slots
    assert ev.break_even_steps > 0
