"""One solve pipeline: the library, the CLI and the registry reach the same placement by the same steps."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moe_placement.cli.main import main
from placement.dispatch import SGLANG_STATIC
from placement.formats import read_placement
from placement.metrics import expected_gpu_load, rank_expert_counts, rank_gpu_load
from placement.topology import Topology
from profiling.readers import write_trace
from profiling.synthetic import synthetic_trace
from solver.api import SOLVERS, FitOptions, SolveResult, make_options, run, solve
from solver.problem import Problem

ROOT = Path(__file__).resolve().parents[1]
TOPO = ["--ep-size", "8", "--num-nodes", "2", "--num-redundant", "8"]


@pytest.fixture(scope="module")
def fit():
    return synthetic_trace(num_tokens=6000, num_layers=3, num_logical_experts=16, top_k=2, num_prompts=80)


@pytest.fixture(scope="module")
def fit_file(fit, tmp_path_factory):
    p = tmp_path_factory.mktemp("t") / "fit.npz"
    write_trace(fit, p)
    return p


def _topo() -> Topology:
    return Topology.from_redundant(16, 8, 8, 2)


@pytest.mark.parametrize("fmt", ["native", "sglang"])
def test_library_and_cli_write_the_same_map(fit, fit_file, tmp_path, fmt):
    placement, _ = solve("greedy", topology=_topo(), trace=fit, dispatch="sglang-static")
    out = tmp_path / f"p.{fmt}"
    argv = ["solve", "--trace", str(fit_file), *TOPO, "--solver", "greedy", "--dispatch", "sglang-static"]
    assert main([*argv, "-o", str(out), "--format", fmt]) == 0
    from_cli = read_placement(out)
    assert from_cli.physical_to_logical_map.tobytes() == placement.physical_to_logical_map.tobytes()
    if fmt == "native":  # the file the library would write is the file the CLI wrote
        from placement.formats import write_placement

        mine = tmp_path / "mine.json"
        write_placement(placement, mine, "native")
        assert (
            json.loads(mine.read_text())["physical_to_logical_map"]
            == json.loads(out.read_text())["physical_to_logical_map"]
        )


def test_the_fit_step_runs_under_a_table_only(fit):
    table = solve("greedy", topology=_topo(), trace=fit, dispatch=SGLANG_STATIC.name)
    even = solve("greedy", topology=_topo(), trace=fit)
    assert isinstance(table, SolveResult) and table.fit is not None and even.fit is None
    assert even.placement is even.baseline  # greedy under even: the baseline itself
    assert any(n.startswith("sglang-static: replicas moved") for n in table.report.notes)
    counts = rank_expert_counts(fit, 8)  # [L, G, E]
    peak = lambda pl: rank_gpu_load(pl, counts, "sglang-static").max(axis=1).sum()  # noqa: E731
    assert peak(table.placement) <= peak(table.baseline)
    assert peak(table.placement) < peak(table.baseline) or not table.fit.changed_layers


def test_counts_only_problems_are_fitted_as_split_evenly_over_the_ranks(fit):
    load = fit.counts()
    result = solve("greedy", topology=_topo(), load=load, dispatch="sglang-static")
    assert result.fit is not None
    from solver.dispatch_fit import even_rank_counts

    counts = even_rank_counts(load, 8)  # [L, G, E]
    assert np.allclose(counts.sum(axis=1), load)
    peak = lambda pl: rank_gpu_load(pl, counts, "sglang-static").max(axis=1).sum()  # noqa: E731
    assert peak(result.placement) <= peak(result.baseline)
    off = run(
        "greedy", Problem.build(_topo(), load=load, dispatch="sglang-static"), fit=FitOptions(enabled=False)
    )
    assert off.fit is None and off.placement is off.baseline


def test_gated_solver_keeps_the_baseline_when_worse(fit, monkeypatch):
    from dataclasses import replace

    from placement.model import Placement

    def worst(problem, options):  # everything on the fewest GPUs it can: worse than greedy
        pl, rep = SOLVERS["greedy"].run(problem, make_options("greedy"))
        L, P = pl.physical_to_logical_map.shape
        E = problem.load.shape[1]
        p2l = np.tile(np.arange(P) % E, (L, 1))  # trivial: replicas of the low ids
        return Placement(p2l, E, problem.topology, pl.layer_ids), replace(rep, solver="worst")

    monkeypatch.setitem(SOLVERS, "worst", replace(SOLVERS["cpsat"], run=worst, fixed={}))
    load = fit.counts() * (1 + np.arange(16))[None, :]  # skewed: trivial is clearly worse
    result = solve("worst", topology=_topo(), load=load)
    assert result.objective_fallback and result.placement.provenance.get("fallback_from") == "worst"
    assert (result.placement.physical_to_logical_map == result.baseline.physical_to_logical_map).all()
    assert any("worst placed worse than greedy" in n for n in result.report.notes)
    greedy_peak = expected_gpu_load(result.baseline, load).max(axis=1).sum()
    assert expected_gpu_load(result.placement, load).max(axis=1).sum() == greedy_peak


def test_policy_is_a_deprecated_alias_that_warns(fit_file, tmp_path, capsys):
    argv = ["solve", "--trace", str(fit_file), *TOPO, "--json"]
    assert main([*argv, "--policy", "local"]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--policy is deprecated; use --dispatch" in err
    assert main([*argv, "--dispatch", "local"]) == 0
    assert "deprecated" not in capsys.readouterr().err


def test_cli_choices_come_from_the_registries():
    from moe_placement.cli.main import build_parser
    from placement.formats import FORMATS

    solve_parser = build_parser()._subparsers._group_actions[0].choices["solve"]
    actions = {a.dest: a for a in solve_parser._actions}
    assert tuple(actions["solver"].choices) == tuple(n for n, s in SOLVERS.items() if not s.needs_previous)
    assert tuple(actions["format"].choices) == tuple(FORMATS)


def test_importing_the_api_imports_no_ortools_or_networkx():
    code = (
        "import sys, solver.api\n"
        "bad = [m for m in sys.modules if m.startswith(('ortools', 'networkx'))]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
