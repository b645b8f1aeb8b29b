"""Failure domains and failover maps (issue 46): what the pipeline protects, what a loss costs.

Library: :func:`solver.api.solve` with ``failure_domain`` (:mod:`solver.failure`, the pipeline's last
step) and :func:`solver.failover.failover_map`; the CLI's ``solve --failure-domain --failover DIR``;
the issue's acceptance case on the real DeepSeek-V2-Lite trace (skipped without the shared traces).
Every expectation is computed here from the maps, independently of the code under test.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import DEEPSEEK, shared_trace_path

from moe_placement.cli.main import main
from placement.formats import read_placement
from placement.formats.failover import map_digest, read_failover_index
from placement.metrics import expected_gpu_load, par
from placement.model import Placement
from placement.topology import Topology
from solver.api import solve
from solver.failover import FailoverOptions, domain_losses, failover_map, survivor_topology
from solver.failure import protect


def _nodes_holding(pl: Placement) -> np.ndarray:
    """int ``[L, E]``: distinct nodes holding each expert."""
    t = pl.topology
    L, E = pl.num_layers, pl.num_logical_experts
    on = np.zeros((L, E, t.num_nodes), dtype=bool)
    on[np.arange(L)[:, None], pl.physical_to_logical_map, t.node_of_slot[None, :]] = True
    return on.sum(axis=2)


def _hottest(load: np.ndarray, k: int, l: int) -> list[int]:
    return [int(e) for e in np.argsort(-load[l], kind="stable")[:k]]


def _load(L=3, E=16, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).gamma(1.5, 1.0, (L, E)) * 1000


# ---------------------------------------------------------------------------------------------
# failure domains in the pipeline
# ---------------------------------------------------------------------------------------------
def test_node_domain_spreads_what_hierarchical_greedy_keeps_on_one_node():
    load, topo = _load(), Topology(8, 24, 2)  # 16 experts, 8 redundant slots, 4 groups over 2 nodes
    plain = solve("greedy", topology=topo, load=load, num_groups=4).placement
    assert (_nodes_holding(plain) == 1).all()  # hierarchical: every copy of a group on its node
    res = solve(
        "greedy", topology=topo, load=load, num_groups=4, failure_domain="node", failure_max_par_increase=None
    )
    pl, rep = res.placement, res.failure
    nodes = _nodes_holding(pl)
    for l in range(3):
        assert rep.targets[l] == rep.protectable[l] == 8
        hot = _hottest(load, 8, l)
        assert (nodes[l, hot] >= 2).all()
        assert list(rep.protected_experts[l]) == [
            e for e in np.argsort(-load[l], kind="stable") if nodes[l, e] >= 2
        ]
        assert sorted(rep.protected_experts[l] + rep.single_points_of_failure[l]) == list(range(16))
    assert res.unconstrained == plain and rep.par_unconstrained == pytest.approx(par(plain, load))
    assert pl.provenance["failure_domain"] == "node" and "failure domain node" in res.report.notes[-1]


@pytest.mark.parametrize("seed", range(6))
def test_every_target_is_protected_whatever_the_cap_left(seed):
    load, topo = _load(L=4, E=16, seed=20 + seed), Topology(8, 24, 2)
    res = solve("greedy", topology=topo, load=load, num_groups=4, failure_domain="node")
    nodes, rep = _nodes_holding(res.placement), res.failure
    for l in range(4):
        assert (nodes[l, _hottest(load, rep.targets[l], l)] >= 2).all()
        assert _layer_par(res.placement, load, l) <= _layer_par(res.unconstrained, load, l) * 1.02 + 1e-12


def _layer_par(pl: Placement, load: np.ndarray, l: int) -> float:
    gpu = expected_gpu_load(pl, load)[l]
    return float(gpu.max() / gpu.mean())


def test_gpu_domain_gives_the_hottest_experts_two_copies():
    load = _load(L=2, E=12, seed=3)
    load[:, 0] = 20000  # greedy gives this one many copies: the others get fewer
    res = solve(
        "greedy", topology=Topology(4, 16, 1), load=load, failure_domain="gpu", failure_max_par_increase=None
    )
    cnt = res.placement.logical_replica_count
    for l in range(2):
        assert (cnt[l, _hottest(load, 4, l)] >= 2).all()
        assert set(res.failure.protected_experts[l]) == set(np.flatnonzero(cnt[l] >= 2))


def test_the_cap_protects_fewer_hottest_first_and_says_so():
    load = np.ones((1, 8))
    load[0, 0] = 100.0  # greedy: 4 copies of expert 0; protecting 4 experts leaves it 2
    topo = Topology(4, 12, 1)
    free = solve(
        "greedy", topology=topo, load=load, failure_domain="gpu", failure_max_par_increase=None
    ).failure
    assert free.targets == (4,) and free.par > free.par_unconstrained * 1.02
    capped = solve("greedy", topology=topo, load=load, failure_domain="gpu", failure_max_par_increase=0.02)
    rep = capped.failure
    assert rep.targets[0] < rep.protectable[0] and rep.capped_layers == (0,)
    assert rep.par <= rep.par_unconstrained * 1.02 + 1e-12
    assert 0 in rep.protected_experts[0]  # the hottest first
    assert "fewer than the redundant slots allow in 1 layer(s) (the 2.0% cap" in rep.note()


def test_the_gates_compare_unconstrained_placements_and_the_domain_step_is_not_undone():
    load, topo = _load(L=2, E=16, seed=5), Topology(8, 24, 2)
    options = {"workers": 1, "deterministic": True}
    res = solve("cpsat", topology=topo, load=load, time_limit=1, options=options, failure_domain="node")
    peak = lambda pl: expected_gpu_load(pl, load).max(axis=1).sum()  # noqa: E731
    assert peak(res.unconstrained) <= peak(res.baseline) * (1 + 1e-9)  # the gate, like with like
    assert res.failure.par_unconstrained == pytest.approx(par(res.unconstrained, load))
    nodes = _nodes_holding(res.placement)
    assert all((nodes[l, _hottest(load, res.failure.targets[l], l)] >= 2).all() for l in range(2))
    assert (_nodes_holding(res.unconstrained) >= 2).sum() < (nodes >= 2).sum()  # served: the protected map
    with pytest.raises(ValueError, match="fresh placements"):
        solve("migration", topology=topo, load=load, previous=res.unconstrained, failure_domain="gpu")


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"failure_domain": "rack"}, "gpu, node"),
        ({"failure_domain": "node", "topology": Topology(8, 24, 1)}, "two or more nodes"),
        ({"failure_domain": "gpu", "failure_max_par_increase": -0.1}, ">= 0"),
        ({"failure_domain": "gpu", "failure_max_par_increase": float("nan")}, "finite"),
    ],
)
def test_bad_failure_arguments_are_refused_by_name(kwargs, words):
    args = {"topology": Topology(8, 24, 2), "load": _load()} | kwargs
    with pytest.raises(ValueError, match=words):
        solve("greedy", **args)


# ---------------------------------------------------------------------------------------------
# failover maps
# ---------------------------------------------------------------------------------------------
def _survivor_membership(pl: Placement, lost) -> tuple[np.ndarray, np.ndarray]:
    """``(rows [L, G', S] of the survivors, experts with a surviving copy bool [L, E])``."""
    t = pl.topology
    keep = [g for g in range(t.ep_size) if g not in set(lost)]
    rows = pl.physical_to_logical_map.reshape(pl.num_layers, t.ep_size, -1)[:, keep]
    alive = np.zeros((pl.num_layers, pl.num_logical_experts), dtype=bool)
    alive[np.arange(pl.num_layers)[:, None], rows.reshape(pl.num_layers, -1)] = True
    return rows, alive


def test_reloads_only_experts_without_a_surviving_copy_into_surplus_slots():
    load, topo = _load(L=3, E=16, seed=2), Topology(8, 40, 2)
    pl = solve("greedy", topology=topo, load=load, num_groups=4).placement  # groups on nodes: many reloads
    lost = domain_losses(topo, "node")[1][1]
    assert lost == (4, 5, 6, 7)
    new, rep = failover_map(pl, load, lost, FailoverOptions(max_moves=0))
    assert new.topology == Topology(4, 20, 1) == survivor_topology(topo, lost)
    before, alive = _survivor_membership(pl, lost)
    after = new.physical_to_logical_map.reshape(3, 4, 5)
    for l in range(3):
        missing = np.flatnonzero(~alive[l])
        assert rep.min_reloads[l] == rep.reloads[l] == missing.size > 0 and rep.moves[l] == 0
        assert sorted(set(new.physical_to_logical_map[l])) == list(range(16))  # every expert served
        changed = before[l] != after[l]
        assert changed.sum() == missing.size  # one slot per reload, every other slot kept
        assert sorted(after[l][changed]) == sorted(missing)
        cnt = np.bincount(before[l].ravel(), minlength=16)
        assert (cnt[before[l][changed]] >= 2).all()  # only surplus replicas were dropped


def test_moves_stay_within_budget_balance_and_repeat_exactly():
    load, topo = _load(L=4, E=16, seed=4), Topology(8, 32, 2)
    pl = protect(solve("greedy", topology=topo, load=load).placement, load, "node")[0]
    for _, lost in domain_losses(topo, "node") + domain_losses(topo, "gpu")[:3]:
        zero = failover_map(pl, load, lost, FailoverOptions(max_moves=0))[1]
        new, rep = failover_map(pl, load, lost)
        again = failover_map(pl, load, lost)[0]
        assert np.array_equal(new.physical_to_logical_map, again.physical_to_logical_map)  # deterministic
        assert rep.reloads == zero.reloads == rep.min_reloads
        assert rep.total_moves <= len(lost) * 4 * 4 - rep.total_reloads  # default: the lost GPUs' slots
        assert rep.par <= zero.par + 1e-12 and rep.par == pytest.approx(par(new, load))
        few = failover_map(pl, load, lost, FailoverOptions(max_moves=3))[1]
        assert few.total_moves <= 3


@pytest.mark.parametrize(
    "lost, words",
    [
        ((8,), "0..7"),
        ((1, 1), "twice"),
        (tuple(range(8)), "no survivor"),
        ((), "empty"),
        (tuple(range(6)), "fewer than"),
    ],
)
def test_bad_losses_are_refused_with_the_numbers(lost, words):
    pl = solve("greedy", topology=Topology(8, 24, 2), load=_load()).placement
    with pytest.raises(ValueError, match=words):
        failover_map(pl, _load(), lost)


# ---------------------------------------------------------------------------------------------
# the CLI
# ---------------------------------------------------------------------------------------------
def _solve_cli(tmp_path, capsys, *extra) -> tuple[int, str, str]:
    npy = tmp_path / "load.npy"
    np.save(npy, _load(L=3, E=16, seed=7))
    base = ["solve", "--load", str(npy), "--ep-size", "8", "--num-nodes", "2", "--num-redundant", "16"]
    rc = main([*base, *extra])
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_writes_the_failure_report_and_one_failover_map_per_loss(tmp_path, capsys):
    folder = tmp_path / "failover"
    rc, out, _ = _solve_cli(tmp_path, capsys, "--failure-domain", "node", "--failover", str(folder), "--json")
    assert rc == 0
    d = json.loads(out)
    f = d["failure"]
    assert f["domain"] == "node" and len(f["protected_experts"]) == 3 and f["par_unconstrained"] > 0
    assert {"single_points_of_failure", "par"} <= set(f)
    index = read_failover_index(folder)
    assert index["domain"] == "node" and [e["lost"] for e in index["losses"]] == [0, 1]
    assert [e["lost_gpus"] for e in index["losses"]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    for e in index["losses"]:
        pl = read_placement(folder / e["file"])
        assert pl.topology == Topology(4, 16, 1) and e["min_reloads"] == e["reloads"]
        assert e["par"] == pytest.approx(par(pl, _load(L=3, E=16, seed=7)))
        assert e["resolve_par"] >= 1.0
    # a second run for GPU losses replaces the node maps: one run's folder, whole
    rc, _, _ = _solve_cli(tmp_path, capsys, "--failure-domain", "gpu", "--failover", str(folder))
    assert rc == 0 and sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) == sorted(
        ["index.json"] + [f"lost-gpu-{g}.json" for g in range(8)]
    )


def test_cli_failover_digest_names_the_map_solved(tmp_path, capsys):
    out = tmp_path / "p.json"
    rc, _, _ = _solve_cli(
        tmp_path, capsys, "--failure-domain", "gpu", "--failover", str(tmp_path / "f"), "-o", str(out)
    )
    assert rc == 0
    assert read_failover_index(tmp_path / "f")["placement_sha256"] == map_digest(
        read_placement(out).physical_to_logical_map
    )


@pytest.mark.parametrize(
    "extra, words",
    [
        (("--failover", "DIR"), "--failure-domain"),
        (("--failure-domain", "node", "--failover-max-moves", "3"), "--failover DIR"),
        (("--failure-domain", "node", "--node-constraint", "--solver", "cpsat"), "give one of them"),
        (("--failure-domain", "node", "--num-redundant", "8", "--failover", "DIR"), "no failover map"),
        (
            ("--failure-domain", "node", "--failover", "FOREIGN"),
            "which no earlier `solve-failover` run wrote",
        ),
    ],
)
def test_cli_refuses_what_cannot_work_in_one_line(tmp_path, capsys, extra, words):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "mine.txt").write_text("keep me")
    (foreign / "index.json").write_text("{}")  # a file the command would write, not written by it
    extra = [str(tmp_path / "dir") if a == "DIR" else str(foreign) if a == "FOREIGN" else a for a in extra]
    rc, _, err = _solve_cli(tmp_path, capsys, *extra)  # the last --num-redundant given wins
    assert rc == 2 and err.count("\n") == 1 and words in err, err
    assert (foreign / "mine.txt").read_text() == "keep me" and not (tmp_path / "dir").exists()


# ---------------------------------------------------------------------------------------------
# the acceptance case, on real routing
# ---------------------------------------------------------------------------------------------
def test_deepseek_v2_lite_node_domain_and_every_node_loss():
    from profiling.readers import read_trace

    trace = read_trace(shared_trace_path(DEEPSEEK))
    fit, held = trace.split(0.5)
    load = fit.counts().astype(np.float64)
    topo = Topology.from_redundant(64, 32, 32, 4)
    res = solve("greedy", topology=topo, trace=fit, failure_domain="node")
    pl, rep = res.placement, res.failure
    nodes = _nodes_holding(pl)
    for l in range(pl.num_layers):  # every one of the hottest experts it set out to protect: two nodes
        assert (nodes[l, _hottest(load, rep.targets[l], l)] >= 2).all()
    assert sum(rep.targets) >= 0.95 * sum(rep.protectable)  # the cap lowered a few layers at most
    assert par(pl, held) <= 1.02 * par(res.unconstrained, held)  # held-out balance, even split
    for n, lost in domain_losses(topo, "node"):
        new, fo = failover_map(pl, load, lost, FailoverOptions(resolve=True))
        _, alive = _survivor_membership(pl, lost)
        assert list(fo.min_reloads) == list((~alive).sum(axis=1)) == list(fo.reloads)
        assert all(len(set(row)) == 64 for row in new.physical_to_logical_map)
        assert fo.par <= 1.05 * fo.resolve_par, (n, fo.par, fo.resolve_par)
        peak = expected_gpu_load(new, load).max(axis=1)
        assert peak.shape == (26,) and new.topology.ep_size == 24


# ---------------------------------------------------------------------------------------------
# the engine plugins' core (without the engines: tests/test_engine_failover.py runs vLLM's code)
# ---------------------------------------------------------------------------------------------
def test_plugin_spec_failure_domain_protects_on_a_hierarchical_call():
    from runtime_hooks.engine_plugins.policy import EngineCall, place
    from runtime_hooks.engine_plugins.spec import SpecError, parse_spec

    load = _load(L=2, E=16, seed=9)
    call = EngineCall("vllm", load, 24, 8, 2, num_groups=4)
    rows = place(parse_spec("greedy:failure_domain=node,failure_max_par_increase=0.05"), call)
    pl = Placement(rows, 16, Topology(8, 24, 2))
    nodes = _nodes_holding(pl)
    assert all((nodes[l, _hottest(load, 4, l)] >= 2).all() for l in range(2))
    plain = Placement(place(parse_spec("greedy"), call), 16, Topology(8, 24, 2))
    assert (_nodes_holding(plain) == 1).all()  # without the domain: every group on one node
    for bad in ("greedy:failure_domain=rack", "migration:failure_domain=node", "greedy:failover_moves=-1"):
        with pytest.raises(SpecError):
            parse_spec(bad)


def test_plugin_answers_a_scale_down_with_the_failover_map():
    from runtime_hooks.engine_plugins.policy import EngineCall, place
    from runtime_hooks.engine_plugins.spec import parse_spec

    load = _load(L=2, E=16, seed=10)
    old = solve("greedy", topology=Topology(8, 32, 2), load=load).placement
    call = EngineCall(
        "vllm", load, 24, 6, 2, num_groups=4, previous=old.physical_to_logical_map
    )  # ranks 6, 7 left
    want = failover_map(Placement(old.physical_to_logical_map, 16, Topology(8, 32, 1)), load, (6, 7))[0]
    for spec in ("migration", "exact", "file:/nowhere.json"):
        assert np.array_equal(place(parse_spec(spec), call), want.physical_to_logical_map), spec


def test_cli_refuses_an_output_that_a_failover_map_would_overwrite(tmp_path, capsys):
    folder = tmp_path / "f"
    folder.mkdir()
    rc, _, err = _solve_cli(
        tmp_path,
        capsys,
        "--failure-domain",
        "node",
        "--failover",
        str(folder),
        "-o",
        str(folder / "lost-node-0.json"),
    )
    assert rc == 2 and err.count("\n") == 1 and not any(folder.iterdir()), err


def test_cli_report_names_the_failover_maps_and_none_lifts_the_cap(tmp_path, capsys):
    report = tmp_path / "r.json"
    argv = ["--failure-domain", "gpu", "--failover", str(tmp_path / "f"), "--report", str(report)]
    rc, _, _ = _solve_cli(tmp_path, capsys, *argv, "--failure-max-par-increase", "none")
    d = json.loads(report.read_text())
    assert rc == 0 and d["failure"]["max_par_increase"] is None and d["failure"]["capped_layers"] == []
    assert [e["lost"] for e in d["failover"]["losses"]] == list(range(8))
