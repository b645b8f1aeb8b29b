"""The torch EP runtime on real gloo process groups, replaying DeepSeek-V2-Lite routing.

Launches are batched: one 4-rank world checks every (placement, policy) pair; one 8-rank world (slow)
does the same at 8 ranks. Workers must be module-level functions (they are pickled by name).
"""

from __future__ import annotations

import json
import multiprocessing
import time

import numpy as np
import pytest
import torch

from placement.dispatch import BALANCED
from placement.metrics import route_tokens
from placement.model import Placement
from placement.topology import Topology
from runtime_hooks.ep_layer import (
    ExpertWeights,
    build_routing_tables,
    reference_moe,
    replay_weights,
    route_slots,
)
from runtime_hooks.launcher import WorkerError, WorkerTimeout, launch
from runtime_hooks.step_balance import StepBalancer
from runtime_hooks.step_dispatch import pick_slots, quota_slot_tokens
from runtime_hooks.validate import ValidationSpec, collect_report, validate_rank
from solver.greedy import greedy_placement

LAYERS = [0, 13]  # two DeepSeek MoE rows: keeps each world short


@pytest.fixture(scope="module")
def ds2(deepseek_trace):
    return deepseek_trace.select_layers(LAYERS)


def _placements(trace, ep_size: int, num_nodes: int = 2, redundant: int = 16):
    """trivial, greedy and (when the exact solver exists) CP-SAT placements for the trace's counts."""
    topo = Topology.from_redundant(trace.num_logical_experts, redundant, ep_size, num_nodes)
    load = trace.counts()
    out = {
        "trivial": Placement.trivial(trace.num_layers, trace.num_logical_experts, topo, trace.layer_ids),
        "greedy": greedy_placement(load, topo, layer_ids=trace.layer_ids)[0],
    }
    try:
        import solver.exact  # noqa: F401
    except ImportError:
        return out
    from solver.api import solve

    out["exact"], _ = solve(
        "cpsat", topology=topo, load=load, layer_ids=trace.layer_ids, time_limit=1.0, seed=0
    )
    return out


def _random_placement(rng, L, E, topo):
    """A valid placement with random replication (no two replicas of an expert on one rank)."""
    G, S = topo.ep_size, topo.slots_per_gpu
    rows = []
    for _ in range(L):
        while True:
            extra = rng.choice(E, topo.num_physical_experts - E, replace=True)
            ids = rng.permutation(np.concatenate([np.arange(E), extra]))
            if all(len(set(ids[g * S : (g + 1) * S])) == S for g in range(G)):
                rows.append(ids)
                break
    return Placement(np.array(rows), E, topo)


# ---- replica selection: torch port == placement.metrics.route_tokens ------------------------------
@pytest.mark.parametrize("policy", ["even", "local"])
def test_route_slots_equals_route_tokens(ds2, policy):
    rng = np.random.default_rng(1)
    ids = np.asarray(ds2.topk_ids[5000:5600], dtype=np.int64)  # [600, 2, 6]
    ids[::17, :, 2] = -1  # some empty picks
    T = ids.shape[0]
    for G, N in ((4, 2), (8, 2), (8, 4)):
        topo = Topology.from_redundant(64, 16, G, N)
        cands = list(_placements_fast(ds2, topo)) + [_random_placement(rng, 2, 64, topo)]
        for pl in cands:
            src = rng.integers(0, G, T)
            tok = 1000 + rng.permutation(T)  # arbitrary global indices
            want = route_tokens(pl, ids, src, policy, token_index=tok)  # [T, L, k]
            for l in range(pl.num_layers):
                tab = build_routing_tables(pl, l)
                got = route_slots(
                    tab, torch.as_tensor(ids[:, l]), torch.as_tensor(tok), torch.as_tensor(src), policy
                )
                np.testing.assert_array_equal(got.numpy(), want[:, l])


def test_runtime_accepts_what_the_registry_marks_runtime():
    from placement.dispatch import DISPATCH, dispatch_names
    from runtime_hooks.ep_layer import runtime_dispatch

    pl = Placement.from_map(np.array([[0, 1, 2, 3, 4, 5, 6, 7, 0, 2, 4, 6]]), 8, ep_size=4, num_nodes=2)
    tab = build_routing_tables(pl, 0)
    ids = torch.tensor([[0, 2], [4, 6], [1, -1], [0, 4]])
    tok, src = torch.arange(4), torch.tensor([0, 1, 2, 3])
    runtime = dispatch_names(runtime=True)
    assert runtime and set(runtime) < set(DISPATCH)
    for name, model in DISPATCH.items():
        if model.runtime and model.needs_step_counts:  # split by every rank's counts: StepDispatch
            assert runtime_dispatch(name) is model
            with pytest.raises(ValueError, match="StepDispatch") as err:
                route_slots(tab, ids, tok, src, name)
            assert "\n" not in str(err.value)
            continue
        if model.runtime:
            assert runtime_dispatch(name) is model
            by_name = route_slots(tab, ids, tok, src, name)
            np.testing.assert_array_equal(route_slots(tab, ids, tok, src, model).numpy(), by_name.numpy())
            want = route_tokens(pl, ids.numpy()[:, None, :], src.numpy(), name, token_index=tok.numpy())
            np.testing.assert_array_equal(by_name.numpy(), want[:, 0])
            continue
        with pytest.raises(ValueError) as err:
            route_slots(tab, ids, tok, src, name)
        msg = str(err.value)
        assert "\n" not in msg and repr(name) in msg and all(r in msg for r in runtime), msg
        with pytest.raises(ValueError, match="scored offline only"):
            ValidationSpec(pl, np.zeros((4, 1, 2), dtype=np.int64), 1, dispatch=name)
    with pytest.raises(ValueError, match="unknown dispatch model 'nope'"):
        runtime_dispatch("nope")


def _step_slots(pl, ids, src, G):
    """Every rank's picks under ``balanced`` as the runtime computes them (no process group)."""
    from placement.dispatch.balanced import step_map

    E = pl.num_logical_experts
    l2p = torch.tensor(step_map(pl, 0))  # [E, R]
    counts = torch.stack(
        [torch.bincount(torch.as_tensor(ids[src == g][ids[src == g] >= 0]), minlength=E) for g in range(G)]
    )  # [G, E]
    q = StepBalancer(l2p, pl.topology.slots_per_gpu).quotas(counts.sum(0))  # [E, R]
    out = np.full(ids.shape, -1, dtype=np.int64)
    for g in range(G):
        out[src == g] = pick_slots(torch.as_tensor(ids[src == g]), counts, q, l2p, g).numpy()
    return out, counts.sum(0).numpy()


def test_balanced_pick_slots_follow_the_registry_route(ds2):
    """The torch contract == the registry's numpy route; per-slot picks == the numpy quotas."""
    rng = np.random.default_rng(2)
    for G, N in ((4, 2), (8, 2)):
        topo = Topology.from_redundant(64, 16, G, N)
        for pl in list(_placements_fast(ds2, topo)) + [_random_placement(rng, 2, 64, topo)]:
            row = pl.select_layers([1])
            T = int(rng.integers(1, 80)) * G
            ids = np.asarray(ds2.topk_ids[7000 : 7000 + T, 1], dtype=np.int64)  # [T, 6] no -1
            src = np.sort(rng.integers(0, G, T))  # ranks hold uneven shares, tokens grouped by rank
            got, total = _step_slots(row, ids, src, G)
            row_in_batch = np.arange(T) - np.searchsorted(src, src)  # [T] one batch (step) per rank
            want = route_tokens(row, ids[:, None, :], src, BALANCED, batch_index=row_in_batch)[:, 0]
            np.testing.assert_array_equal(got, want)
            slots = np.bincount(got.ravel(), minlength=row.num_physical_experts)
            np.testing.assert_array_equal(slots, quota_slot_tokens(row, total[None], BALANCED)[0])
            # empty picks route nowhere and do not count
            ids[::5, 2] = -1
            got, total = _step_slots(row, ids, src, G)
            assert (got[ids < 0] == -1).all() and total.sum() == (ids >= 0).sum()
            slots = np.bincount(got[got >= 0], minlength=row.num_physical_experts)
            np.testing.assert_array_equal(slots, quota_slot_tokens(row, total[None], BALANCED)[0])


def test_launcher_refuses_non_positive_timeouts():
    for kw in ({"timeout": 0}, {"timeout": -1.0}, {"pg_timeout": 0}, {"grace": 0}, {"timeout": float("nan")}):
        with pytest.raises(ValueError, match="must be > 0 seconds"):
            launch(_rank_info, 2, args=("x",), **kw)
    assert multiprocessing.active_children() == []  # refused before any rank started


def _placements_fast(trace, topo):
    yield Placement.trivial(trace.num_layers, 64, topo, trace.layer_ids)
    yield greedy_placement(trace.counts(), topo, layer_ids=trace.layer_ids)[0]


def test_reference_moe_matches_dense_loop():
    w = ExpertWeights.random(6, 8, 4, seed=3)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 8, generator=g)
    ids = torch.tensor([[0, 1], [2, -1], [5, 0], [3, 3], [4, 1]])
    wts = replay_weights(ids, 0, num_experts=6)
    assert torch.all(wts[ids < 0] == 0)
    want = torch.zeros_like(x)
    for t in range(5):
        for j in range(2):
            e = int(ids[t, j])
            if e >= 0:
                h = w.w1[e] @ x[t]
                gate, up = h.chunk(2)
                want[t] += wts[t, j] * (w.w2[e] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(reference_moe(x, ids, wts, w), want, atol=1e-6, rtol=1e-5)


# ---- multi-rank worlds -----------------------------------------------------------------------------
def _validate_many(rank, world_size, specs):
    return [validate_rank(rank, world_size, s) for s in specs]


def _check_world(ds2, G, step_tokens):
    specs, names = [], []
    for name, pl in _placements(ds2, G).items():
        for dispatch in ("even", "local", BALANCED.name):
            specs.append(
                ValidationSpec.from_trace(
                    pl,
                    ds2,
                    step_tokens=step_tokens,
                    offset=20000,
                    dispatch=dispatch,
                    hidden=16,
                    ffn=8,
                    seed=G,
                )
            )
            names.append(f"{name}/{dispatch}")
    results = launch(_validate_many, G, args=(specs,), timeout=90)
    for i, (spec, name) in enumerate(zip(specs, names)):
        rep = collect_report(spec, [r[i] for r in results])
        np.testing.assert_array_equal(rep.measured, rep.predicted, err_msg=f"{name}: per-rank picks differ")
        assert rep.predicted.sum() == (spec.topk_ids >= 0).sum(), name  # every pick computed exactly once
        assert rep.max_abs_error <= spec.atol, f"{name}: max |y - ref| = {rep.max_abs_error}"
        assert not rep.checksum_mismatches, f"{name}: {rep.checksum_mismatches[:3]}"
        np.testing.assert_array_equal(
            rep.measured_slots, rep.predicted_slots, err_msg=f"{name}: per-slot picks"
        )
        assert rep.ok
        step = spec.dispatch == BALANCED.name  # per-slot picks == numpy quotas, and the gather is timed
        assert (
            (rep.balanced_collective_bytes_per_layer == 4 * G * 64)
            if step
            else rep.balanced_collective_us_per_layer is None
        )
        if step:
            assert len(rep.balanced_collective_us_per_layer) == 2
            assert all(u > 0 for u in rep.balanced_collective_us_per_layer)
    # placements really differ in per-rank load, so equality above is not vacuous
    peaks = {
        n: collect_report(s, [r[i] for r in results]).measured.max()
        for i, (s, n) in enumerate(zip(specs, names))
    }
    assert len(set(peaks.values())) > 1


def test_four_ranks_all_placements_both_policies(ds2):
    _check_world(ds2, 4, step_tokens=24)


@pytest.mark.slow
def test_eight_ranks_all_placements_both_policies(ds2):
    _check_world(ds2, 8, step_tokens=12)


# ---- launcher ------------------------------------------------------------------------------------
def _raise_on_rank_two(rank, world_size):
    import torch.distributed as dist

    if rank == 2:
        raise ValueError("boom on purpose")
    dist.barrier()  # the others block in a collective; the launcher must still end them
    return rank


def _sleep_forever(rank, world_size):
    time.sleep(600 if rank == 1 else 0)
    return rank


def _rank_info(rank, world_size, tag):
    import torch.distributed as dist

    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return (rank, world_size, tag, float(t), torch.get_num_threads())


def test_launcher_results_errors_timeouts_and_no_orphans():
    out = launch(_rank_info, 3, args=("x",), timeout=60)
    assert out == [(r, 3, "x", 6.0, 1) for r in range(3)]
    with pytest.raises(WorkerError) as err:
        launch(_raise_on_rank_two, 4, timeout=60, grace=1.0)
    assert err.value.rank == 2 and "ValueError: boom on purpose" in str(err.value)
    assert "_raise_on_rank_two" in err.value.remote_traceback
    with pytest.raises(WorkerTimeout) as tmo:
        launch(_sleep_forever, 2, timeout=4)
    assert tmo.value.ranks == [1]
    assert multiprocessing.active_children() == []  # every rank of every launch was joined
    with pytest.raises(ValueError, match="world_size"):
        launch(_rank_info, 0)


# ---- moe-placement validate ------------------------------------------------------------------------
def test_cli_validate_end_to_end(tmp_path, ds2, capsys):
    from moe_placement.cli.main import main
    from placement.formats import write_placement
    from profiling.readers import write_trace

    pl = _placements(ds2, 4)["greedy"]
    write_placement(pl, tmp_path / "p.json", "native")
    write_trace(ds2.slice_tokens(30000, 30400), tmp_path / "t.npz")
    rc = main(
        [
            "validate",
            str(tmp_path / "p.json"),
            "--trace",
            str(tmp_path / "t.npz"),
            "--ranks",
            "4",
            "--policy",
            "local",
            "--tokens-per-rank",
            "16",
            "--layers",
            "1",
            "--hidden",
            "16",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "PASS" in out and "[ok]" in out and f"layer {ds2.layer_ids[1]} (row 1)" in out
    # balanced, trace-driven, two rows in one launch: per-slot picks == numpy quotas, the gather's cost
    argv = ["validate", str(tmp_path / "p.json"), "--trace", str(tmp_path / "t.npz"), "--ranks", "4"]
    rc = main([*argv, "--dispatch", BALANCED.name, "--layers", "0", "1", "--hidden", "16", "--json"])
    rep = json.loads(capsys.readouterr().out)
    assert rc == 0 and rep["ok"] and rep["tokens_match"] and rep["policy"] == BALANCED.name, rep
    assert rep["measured_slots"] == rep["predicted_slots"] and rep["max_abs_error"] <= 1e-5
    assert rep["balanced_collective_bytes_per_layer"] == 4 * 4 * 64
    assert len(rep["balanced_collective_us_per_layer"]) == 2
    for bad in ("nope", "Balanced"):  # an unknown model name: one line, exit 2, nothing launched
        assert main([*argv, "--dispatch", bad]) == 2
        err = capsys.readouterr().err
        assert f"unknown dispatch model {bad!r}" in err and BALANCED.name in err and err.count("\n") == 1, err
    # bad input: exit 2 with one line naming the numbers
    assert main(["validate", str(tmp_path / "p.json"), "--ranks", "8"]) == 2
    assert "ep_size 4" in capsys.readouterr().err
    assert (
        main(
            [
                "validate",
                str(tmp_path / "p.json"),
                "--trace",
                str(tmp_path / "t.npz"),
                "--tokens-per-rank",
                "500",
            ]
        )
        == 2
    )
    assert main(["validate", str(tmp_path / "p.json"), "--layers", "7"]) == 2


def test_validation_report_flags_mismatches():
    from runtime_hooks.validate import ValidationReport

    good = ValidationReport(np.array([[3, 4]]), np.array([[3, 4]]), 1e-7, (1e-7,), (), 1e-4, "even")
    assert good.ok
    assert not ValidationReport(np.array([[3, 4]]), np.array([[4, 3]]), 1e-7, (1e-7,), (), 1e-4, "even").ok
    assert not ValidationReport(np.array([[3, 4]]), np.array([[3, 4]]), 1e-2, (1e-2,), (), 1e-4, "even").ok
    assert not ValidationReport(
        np.array([[3, 4]]), np.array([[3, 4]]), 0.0, (0.0,), ("slot 3",), 1e-4, "even"
    ).ok


def _edge_rank(rank, world_size, pl):
    w = ExpertWeights.random(8, 16, 8, seed=1)
    from runtime_hooks.ep_layer import EPMoELayer

    layer = EPMoELayer(pl, 0, w)
    T = 0 if rank == 0 else 3  # rank 0 has no tokens at all
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(T, 16, generator=g)
    ids = (
        torch.full((T, 2), -1) if rank == 1 else torch.randint(0, 8, (T, 2), generator=g)
    )  # rank 1: no picks
    wts = torch.rand(T, 2, generator=g)
    y = layer(x, ids, wts, torch.arange(T) + 10 * rank)
    err = float((y - reference_moe(x, ids, wts, w)).abs().max()) if T else 0.0
    y2 = layer(x)  # the layer's own router (softmax top-k)
    ids_r, w_r = layer.route(x, 2)
    err_router = float((y2 - reference_moe(x, ids_r, w_r, w)).abs().max()) if T else 0.0
    return y.shape, err, err_router


def test_empty_ranks_padding_and_router_path():
    pl = Placement.trivial(1, 8, Topology(3, 12))
    out = launch(_edge_rank, 3, args=(pl,), timeout=60)
    assert [tuple(o[0]) for o in out] == [(0, 16), (3, 16), (3, 16)]
    assert all(o[1] < 1e-5 and o[2] < 1e-5 for o in out)
    assert torch.equal(replay_weights(torch.full((2, 3), -1), 0, num_experts=4), torch.zeros(2, 3))
