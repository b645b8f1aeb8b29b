"""The per-step dispatch models (``balanced``, ``sglang-lp``) and the placement fitted for them."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks.step_lp import highs_step_peak
from placement.dispatch import BALANCED, DISPATCH, SGLANG_LP, lp_shares
from placement.dispatch.balanced import balanced_step_load
from placement.formats import read_placement
from placement.metrics import route_tokens, routed_gpu_tokens, step_par
from placement.model import Placement
from placement.step_balance import balanced_quotas
from placement.topology import Topology
from profiling.trace import RoutingTrace
from solver.api import solve
from solver.step.fit import StepFitOptions, fit_for_steps, sample_step_counts, step_scores


def _case(seed: int, G: int = 8, E: int = 16, spare: int = 8, T: int = 1200, k: int = 2):
    """G GPUs on 2 nodes, (E + spare) / G slots each, 2 layers, T tokens with skewed picks."""
    rng = np.random.default_rng(seed)
    P = E + spare
    topo = Topology(ep_size=G, num_physical_experts=P, num_nodes=2)
    S = P // G
    rows = []
    while len(rows) < 2:
        row = np.r_[np.arange(E), rng.choice(E, spare, replace=False)]
        rng.shuffle(row)
        if all(len(set(row[g * S : (g + 1) * S])) == S for g in range(G)):
            rows.append(row)
    pl = Placement(np.array(rows), E, topo)
    pop = rng.dirichlet(np.full(E, 0.5))
    ids = np.stack([rng.choice(E, k, replace=False, p=pop) for _ in range(T)])[:, None, :].repeat(2, axis=1)
    ids[:, 1] = (ids[:, 1] * 5 + 3) % E
    return pl, RoutingTrace(num_logical_experts=E, topk_ids=ids, source_rank=rng.integers(0, G, T))


def test_models_are_registered_with_their_attributes():
    assert DISPATCH["balanced"] is BALANCED and DISPATCH["sglang-lp"] is SGLANG_LP
    b, lp = BALANCED, SGLANG_LP
    assert b.needs_step_counts and b.runtime and not b.fractional and b.step_load and b.route
    assert (b.engine, b.version) == ("", "")
    assert lp.needs_step_counts and not lp.runtime and not lp.fractional and lp.step_load and lp.route
    assert (lp.engine, lp.version) == ("SGLang", "0.5.23")


@pytest.mark.parametrize("seed", range(5))
def test_balanced_route_puts_exactly_the_quotas_on_each_replica(seed):
    pl, tr = _case(seed)
    rng = np.random.default_rng(seed)
    T = tr.num_tokens
    src = rng.integers(0, 8, T)
    batch = 20
    rows = np.zeros(T, np.int64)
    for g in range(8):  # each rank's tokens in batches of 20 rows
        mine = np.flatnonzero(src == g)
        rows[mine] = np.arange(mine.size) % batch
    slots = route_tokens(pl, tr.topk_ids, src, BALANCED, batch_index=rows)  # [T, L, k]
    pos = np.zeros(T, np.int64)
    for g in range(8):
        mine = np.flatnonzero(src == g)
        pos[mine] = np.arange(mine.size)
    step = pos // batch
    for l in range(2):
        l2p = pl.logical_to_physical_map[l]
        for s in range(step.max() + 1):
            ids = tr.topk_ids[step == s, l].astype(np.int64)
            counts = np.bincount(ids[ids >= 0], minlength=16)
            q = balanced_quotas(counts, l2p, 3)  # [E, R]
            got = np.bincount(slots[step == s, l].ravel(), minlength=24)
            want = np.zeros(24, np.int64)
            for e in range(16):
                for r in range(pl.logical_replica_count[l, e]):
                    want[l2p[e, r]] = q[e, r]
            assert np.array_equal(got, want)
            # the order: source rank, then row: the replica index never decreases along that order
            sel = np.flatnonzero(step == s)
            for e in range(16):
                tok, j = np.nonzero(tr.topk_ids[sel, l] == e)
                order = np.lexsort((rows[sel][tok], src[sel][tok]))
                rep = np.searchsorted(l2p[e, : pl.logical_replica_count[l, e]], slots[sel[tok], l, j])[order]
                assert np.all(np.diff(rep) >= 0)


def test_route_tokens_and_routed_gpu_tokens_agree_with_step_load():
    pl, tr = _case(3)
    src = np.arange(tr.num_tokens) % 8
    slots = route_tokens(pl, tr.topk_ids, src, BALANCED)  # default 256-row batches
    gpu = routed_gpu_tokens(pl, slots)  # [L, G]
    assert gpu.sum() == (tr.topk_ids >= 0).sum()


def test_step_par_under_balanced_is_the_peak_of_the_quotas_by_hand():
    pl, tr = _case(7)
    tr = RoutingTrace(num_logical_experts=16, topk_ids=tr.topk_ids)  # prefill chunks dealt round robin
    b, G = 10, 8
    sp = step_par(pl, tr, b, BALANCED, phase="prefill")
    S = tr.num_tokens // (b * G)
    pars = np.zeros((2, S))
    for l in range(2):
        l2p = pl.logical_to_physical_map[l]
        for s in range(S):
            ids = tr.topk_ids[s * b * G : (s + 1) * b * G, l].astype(np.int64)
            q = balanced_quotas(np.bincount(ids[ids >= 0], minlength=16), l2p, 3)
            gpu = np.zeros(G)
            for e in range(16):
                for r in range(pl.logical_replica_count[l, e]):
                    gpu[l2p[e, r] // 3] += q[e, r]
            pars[l, s] = gpu.max() / gpu.mean()
    assert sp["num_steps"] == S
    assert sp["step_par"] == pytest.approx(pars.mean(), rel=1e-12)


def _highs_peak(c: np.ndarray, l2p: np.ndarray, S: int, G: int) -> float:
    """The LP SGLang's LPLB solves, by HiGHS: min M s.t. copies sum to counts, GPU loads <= M."""
    return highs_step_peak(c, l2p, S, G)


@pytest.mark.parametrize("seed", range(6))
def test_sglang_lp_expected_peak_is_the_highs_optimum(seed):
    pytest.importorskip("scipy")
    pl, _ = _case(seed)
    rng = np.random.default_rng(100 + seed)
    counts = rng.integers(0, 60, (4, 16)) * (rng.random((4, 16)) < 0.8)  # [S, E], some experts idle
    shares = lp_shares(pl, 0, counts)  # [S, E, R]
    l2p = pl.logical_to_physical_map[0]
    assert np.allclose(shares.sum(axis=2), 1.0) and np.all(shares[:, l2p < 0] == 0)
    for s in range(4):
        gpu = np.zeros(8)
        for e in range(16):
            for r in range(pl.logical_replica_count[0, e]):
                gpu[l2p[e, r] // 3] += shares[s, e, r] * counts[s, e]
        assert gpu.max() == pytest.approx(_highs_peak(counts[s], l2p, 3, 8), rel=1e-7, abs=1e-7)


def test_sglang_lp_draws_are_seeded_and_sum_to_the_counts():
    pl, _ = _case(2)
    counts = np.random.default_rng(0).integers(0, 50, (5, 16)).astype(float)
    a = SGLANG_LP.step_load(pl, 1, counts)
    assert np.array_equal(a, SGLANG_LP.step_load(pl, 1, counts))
    p2l = pl.physical_to_logical_map[1]
    for s in range(5):
        assert np.array_equal(np.bincount(p2l, weights=a[s], minlength=16), counts[s])


def _fit_case():
    pl, tr = _case(5, T=4000)
    return pl, tr, StepFitOptions(step_tokens=8, num_steps=40, moves=60, seed=1)


def test_step_fit_is_never_worse_than_its_start_and_is_deterministic():
    pl, tr, o = _fit_case()
    out, fit = fit_for_steps(pl, tr, BALANCED, o)
    again, _ = fit_for_steps(pl, tr, BALANCED, o)
    assert np.array_equal(out.physical_to_logical_map, again.physical_to_logical_map)
    steps = sample_step_counts(
        tr.slice_tokens(0, int(round(tr.num_tokens * (1 - o.validation)))), 8, 8, 40, 1
    )
    before, after = step_scores(pl, steps, BALANCED), step_scores(out, steps, BALANCED)
    assert np.all(after <= before + 1e-9)
    assert (
        fit.fit_peak_after <= fit.fit_peak_before and fit.validation_peak_after <= fit.validation_peak_before
    )
    assert set(fit.changed_layers) == {
        l
        for l in range(2)
        if not np.array_equal(out.physical_to_logical_map[l], pl.physical_to_logical_map[l])
    }
    assert np.all(out.logical_replica_count >= 1) and fit.dispatch == BALANCED.name


def _window_peaks(pl: Placement, load: np.ndarray) -> np.ndarray:
    """Even-split window peak GPU load per layer, by hand: ``load [L, E]`` -> ``[L]``."""
    t, out = pl.topology, []
    for l in range(pl.num_layers):
        gpu = np.zeros(t.ep_size)
        for p, e in enumerate(pl.physical_to_logical_map[l]):
            gpu[p // t.slots_per_gpu] += load[l, e] / pl.logical_replica_count[l, e]
        out.append(gpu.max())
    return np.array(out)


def _greedy_fit_case():
    pl, tr, _ = _fit_case()
    return solve("greedy", topology=pl.topology, trace=tr).placement, tr


def _fit_with(pl, tr, window_slack: float, fit_window_slack: float, top_slack: float = 0.01, blends=()):
    o = StepFitOptions(
        8,
        40,
        60,
        1,
        window_slack=window_slack,
        fit_window_slack=fit_window_slack,
        top_slack=top_slack,
        count_blends=blends,
    )
    return fit_for_steps(pl, tr, BALANCED, o)[0], o


def _guarded_loads(tr, o: StepFitOptions) -> list[tuple[np.ndarray, float]]:
    """The loads the guard holds, ``[L, E]`` each, with their peak slack: each part, then the whole."""
    cuts = np.linspace(0, tr.num_tokens, o.window_parts + 1).round().astype(int)
    out = [
        (tr.slice_tokens(a, b).counts().astype(np.float64), o.window_slack)
        for a, b in zip(cuts[:-1], cuts[1:])
    ]
    return [*out, (tr.counts().astype(np.float64), o.fit_window_slack)]


@pytest.mark.parametrize("slack, fit_slack", [(0.0, 1.0), (1.0, 0.0), (0.005, 0.005)])
def test_step_fit_holds_the_window_peak_on_each_part_of_the_fit_tokens(slack, fit_slack):
    pl, tr = _greedy_fit_case()
    out, o = _fit_with(pl, tr, slack, fit_slack, top_slack=1.0)  # starting from the given placement
    assert not np.array_equal(out.physical_to_logical_map, pl.physical_to_logical_map)
    for load, sl in _guarded_loads(tr, o):
        assert np.all(_window_peaks(out, load) <= _window_peaks(pl, load) * (1 + sl) + 1e-9)


def _top_means(pl: Placement, load: np.ndarray, top: int) -> np.ndarray:
    """Mean even-split window load of the ``top`` most loaded GPUs per layer, by hand: ``[L]``."""
    t, out = pl.topology, []
    for l in range(pl.num_layers):
        gpu = np.zeros(t.ep_size)
        for p, e in enumerate(pl.physical_to_logical_map[l]):
            gpu[p // t.slots_per_gpu] += load[l, e] / pl.logical_replica_count[l, e]
        out.append(np.sort(gpu)[-top:].mean())
    return np.array(out)


@pytest.mark.parametrize("top_slack", [0.0, 0.01])
def test_step_fit_holds_the_top_gpus_mean_load_from_any_start(top_slack):
    pl, tr = _greedy_fit_case()
    out, o = _fit_with(pl, tr, 1.0, 1.0, top_slack=top_slack, blends=(0.0, 0.5, 1.0))
    assert not np.array_equal(out.physical_to_logical_map, pl.physical_to_logical_map)
    top = max(1, round(o.top_share * pl.topology.ep_size))
    for load, _ in _guarded_loads(tr, o):
        assert np.all(_top_means(out, load, top) <= _top_means(pl, load, top) * (1 + top_slack) + 1e-9)


def test_step_fit_without_the_window_guard_gives_the_window_balance_away():
    pl, tr = _greedy_fit_case()  # so the guards above are not idle on this case
    loose, o = _fit_with(pl, tr, 1.0, 1.0, top_slack=1.0)
    load = tr.counts().astype(np.float64)
    assert np.any(_window_peaks(loose, load) > _window_peaks(pl, load) * 1.02)
    top = max(1, round(o.top_share * pl.topology.ep_size))
    assert np.any(_top_means(loose, load, top) > _top_means(pl, load, top) * 1.01)


@pytest.mark.parametrize(
    "bad",
    [{"step_tokens": 0}, {"step_tokens": -3}, {"step_moves": -1}, {"steps": 1.5}, {"noise_z": float("nan")}],
)
def test_fit_options_refuse_bad_values_naming_them(bad):
    from solver.api import FitOptions

    with pytest.raises(ValueError, match=f"FitOptions.{next(iter(bad))}"):
        FitOptions(**bad)


def test_solve_pipeline_fits_for_balanced_and_gates_against_greedy():
    from solver.api import FitOptions, solve

    pl, tr, _ = _fit_case()
    res = solve(
        "greedy", topology=pl.topology, trace=tr, dispatch=BALANCED.name, fit=FitOptions(step_tokens=8)
    )
    assert res.fit is not None and res.fit.step_tokens == 8
    assert any("per-step balance" in n for n in res.report.notes)
    steps = res.fit.validation_counts
    assert (
        step_scores(res.placement, steps, BALANCED).sum() <= step_scores(res.baseline, steps, BALANCED).sum()
    )


def test_cli_evaluate_balanced_reports_step_par_and_solve_writes_a_placement(tmp_path, capsys):
    from moe_placement.cli.main import main
    from placement.formats import write_placement
    from profiling.readers import write_trace

    pl, tr, _ = _fit_case()
    tpath, ppath = tmp_path / "t.npz", tmp_path / "p.json"
    write_trace(tr, str(tpath))
    write_placement(pl, str(ppath))
    capsys.readouterr()
    assert main(["evaluate", str(ppath), str(tpath), "--dispatch", "balanced", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["policy"] == "balanced" and d["step_tokens"] == 64 and 1.0 <= d["step_par"]
    assert (
        main(["evaluate", str(ppath), str(tpath), "--dispatch", "all", "--step-tokens", "8", "--json"]) == 0
    )
    every = json.loads(capsys.readouterr().out)["dispatch"]
    assert set(every) == set(DISPATCH) and all("step_par" in v for v in every.values())
    out = tmp_path / "solved.json"
    args = ["solve", "--trace", str(tpath), "--ep-size", "8", "--num-nodes", "2", "--num-redundant", "8"]
    assert main([*args, "--dispatch", "balanced", "--step-tokens", "8", "-o", str(out)]) == 0
    assert "held-out step PAR (balanced, 8/rank)" not in capsys.readouterr().out  # no held-out part
    solved = read_placement(str(out))
    assert solved.physical_to_logical_map.shape == (2, 24)
    assert all(
        len(set(r[g * 3 : (g + 1) * 3])) == 3 for r in solved.physical_to_logical_map for g in range(8)
    )


def test_cli_solve_reports_held_out_step_par_of_each_placement(tmp_path, capsys):
    from moe_placement.cli.main import main
    from profiling.readers import write_trace

    _, tr, _ = _fit_case()
    tpath, out = tmp_path / "t.npz", tmp_path / "solved.json"
    write_trace(tr, str(tpath))
    args = ["solve", "--trace", str(tpath), "--ep-size", "8", "--num-nodes", "2", "--num-redundant", "8"]
    args += ["--dispatch", "balanced", "--step-tokens", "8", "--fit-fraction", "0.5", "-o", str(out)]
    capsys.readouterr()
    assert main([*args, "--json"]) == 0
    rows = {r["placement"]: r for r in json.loads(capsys.readouterr().out)["balance"]}
    held = tr.split(0.5)[1]
    solved = read_placement(str(out))
    want = step_par(solved, held, 8, BALANCED.name)["step_par"]
    assert rows["greedy, placed for balanced"]["heldout_step_par"] == pytest.approx(want)
    assert rows["trivial"]["heldout_step_par"] > rows["greedy"]["heldout_step_par"]
    assert main(args) == 0
    assert "held-out step PAR (balanced, decode, 8/rank)" in capsys.readouterr().out


@pytest.mark.parametrize("model", [BALANCED, SGLANG_LP])
def test_empty_picks_are_counted_nowhere(model):
    """A -1 id (a token with fewer picks) is no token of expert 0: it gets no slot and the split
    is the one of the real picks alone (what the runtime, which skips empty picks, executes)."""
    from placement.dispatch import route_layer

    topo = Topology.from_redundant(8, 4, ep_size=4, num_nodes=2)
    rng = np.random.default_rng(1)
    pl, _ = solve("greedy", topology=topo, load=rng.random((1, 8)) * 100)
    ids = np.stack([np.arange(40) % 8, (np.arange(40) + 3) % 8], axis=1)
    ids[::3, 1] = -1
    src = np.repeat(np.arange(4), 10)
    out = route_layer(pl, 0, ids, src, model, rng=np.random.default_rng(0))
    assert (out[ids < 0] == -1).all() and (out[ids >= 0] >= 0).all()
    e_of_slot = pl.physical_to_logical_map[0]
    np.testing.assert_array_equal(e_of_slot[out[ids >= 0]], ids[ids >= 0])  # a replica of the pick
    if model is BALANCED:
        c = np.bincount(ids[ids >= 0], minlength=8)
        want = balanced_step_load(pl, 0, c[None, :])[0]
        got = np.bincount(out[out >= 0], minlength=topo.num_physical_experts)
        np.testing.assert_array_equal(got, want)


def _colocated_case(seed: int, G: int, S: int, E: int) -> Placement:
    """An engine-style map (DeepSeek's greedy packs replicas freely): at least one expert twice on a GPU."""
    rng = np.random.default_rng(seed)
    P = G * S
    while True:
        row = np.r_[np.arange(E), rng.choice(E, P - E, p=rng.dirichlet(np.full(E, 0.3)))]
        rng.shuffle(row)
        per = np.sort(row.reshape(G, S), axis=1)
        if (per[:, 1:] == per[:, :-1]).any():
            topo = Topology(ep_size=G, num_physical_experts=P, num_nodes=1)
            return Placement(row[None], E, topo, allow_colocated_replicas=True)


@pytest.mark.parametrize(
    "seed, G, S, E", [(0, 32, 3, 64), (1, 32, 3, 64), (2, 4, 3, 7), (3, 3, 3, 4), (4, 8, 4, 12)]
)
def test_balanced_splits_colocated_maps_exactly_and_optimally(seed, G, S, E):
    import torch

    from placement.dispatch.balanced import route_balanced, step_map
    from runtime_hooks.step_balance import StepBalancer

    pl = _colocated_case(seed, G, S, E)
    rng = np.random.default_rng(seed)
    pop = rng.dirichlet(np.full(E, 0.4))
    T = 40 * G
    ids = np.stack([rng.choice(E, 2, replace=False, p=pop) for _ in range(T)])  # [T, 2]
    src = rng.integers(0, G, T)
    slots = route_balanced(pl, 0, ids, src)  # raised IndexError before holes were left out of the split
    l2p = step_map(pl, 0)
    counts = np.bincount(ids.ravel(), minlength=E)
    q = balanced_quotas(counts, l2p, S)  # [E, R]
    np.testing.assert_array_equal(q.sum(-1), counts)
    got = np.bincount(slots.ravel(), minlength=G * S)
    want = np.zeros(G * S, np.int64)
    want[l2p[l2p >= 0]] = q[l2p >= 0]
    np.testing.assert_array_equal(got, want)
    dropped = np.setdiff1d(np.arange(G * S), l2p[l2p >= 0])
    assert dropped.size and (got[dropped] == 0).all()  # the second copy on a GPU receives none
    peak = got.reshape(G, S).sum(1).max()
    assert peak == np.ceil(highs_step_peak(counts, l2p, S, G) - 1e-9)  # optimal over the map's replicas
    many = np.stack([counts, np.roll(counts, 3), np.zeros_like(counts)])
    ref = balanced_quotas(many, l2p, S)
    np.testing.assert_array_equal(StepBalancer(l2p, S).quotas(torch.from_numpy(many)).numpy(), ref)
    np.testing.assert_array_equal(
        StepBalancer(l2p, S, early_exit=False).quotas(torch.from_numpy(many)).numpy(), ref
    )


def test_cli_evaluate_balanced_scores_an_engine_map_with_colocated_replicas(tmp_path, capsys):
    from moe_placement.cli.main import main
    from placement.formats import write_placement
    from profiling.readers import write_trace

    pl = _colocated_case(1, 8, 4, 12)  # an engine map with an expert twice on a GPU (IndexError before)
    rng = np.random.default_rng(1)
    ids = np.stack([rng.choice(12, 2, replace=False, p=rng.dirichlet(np.full(12, 0.4))) for _ in range(320)])
    write_trace(RoutingTrace(12, topk_ids=ids[:, None, :]), tmp_path / "t.npz")
    write_placement(pl, tmp_path / "engine.json")
    assert (
        main(
            ["evaluate", str(tmp_path / "engine.json"), str(tmp_path / "t.npz"), "--dispatch", "balanced"]
            + ["--step-tokens", "16"]  # 320 tokens hold 2 decode steps of 16 tokens on each of 8 ranks
        )
        == 0
    )
    out = capsys.readouterr()
    assert "step_par" in out.out and "hold two replicas of one expert" in out.err
