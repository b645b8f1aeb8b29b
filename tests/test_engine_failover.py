"""vLLM's elastic scale-down answered by our plugin with the failover map (issue 46), in vLLM's code.

vLLM 0.33 shrinks an elastic EP deployment in ``EplbState.rearrange`` (its scale-down branch): every
old rank calls the EPLB policy with the load of the last rebalance (int64 ``[L, E]``), ``num_replicas
= P_old // G_old * G_new``, the nodes that keep a rank (1 when the ranks do not divide over them),
``num_ranks = G_new`` and the old map ``[L, P_old]``; the survivors are ranks ``0..G_new-1``. The
script below installs our plugin through vLLM's own plugin loader (:mod:`engine_loaders`) and calls
the policy exactly so; the maps come back here and are checked against
:func:`solver.failover.failover_map` and against the maps themselves. Needs the engines' side
environment (skipped with a machine-independent reason without it). Marked slow: importing vLLM
takes about 20 s of it on the 2-core dev machine; the checks themselves take well under a second.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap

import numpy as np
import pytest
from test_engine_plugins import ROOT, _engines_python, _entry_points_dir

from moe_placement.cli.main import main
from placement.formats import read_placement
from placement.model import Placement
from placement.topology import Topology
from runtime_hooks.engine_plugins.spec import ENV_VAR
from solver.api import solve
from solver.failover import FailoverOptions, failover_map

pytestmark = pytest.mark.slow

L, E, G, N, S, GROUPS = 3, 16, 8, 2, 5, 4  # 40 slots on 8 ranks over 2 nodes

_SCRIPT = textwrap.dedent(
    """
    import json, logging, sys
    import torch
    from tests.engine_loaders import vllm_loader

    messages = []

    class Catch(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    logger = logging.getLogger("runtime_hooks.engine_plugins")
    logger.addHandler(Catch(level=logging.INFO))
    logger.setLevel(logging.INFO)
    load_with, _ = vllm_loader()
    out = []
    for case in json.loads(sys.argv[1]):
        policy = load_with(case["spec"])
        del messages[:]
        weight = torch.tensor(case["weight"], dtype=torch.int64)  # the last rebalance's load, [L, E]
        old = torch.tensor(case["old"], dtype=torch.int64)  # the map in service, [L, P_old]
        args = (weight, case["num_replicas"], case["num_groups"], case["num_nodes"], case["num_gpus"], old)
        first = policy.rebalance_experts(*args)  # as EplbState.rearrange calls it
        again = policy.rebalance_experts(*args)  # another old rank: the same inputs
        out.append({"map": first.tolist(), "dtype": str(first.dtype), "device": str(first.device),
                    "same": bool(torch.equal(first, again)), "log": list(messages)})
    print("RESULT " + json.dumps(out))
    """
)


def _vllm_scale_down_args(G_new: int) -> dict:
    """What vLLM's scale-down branch passes besides the maps, for the tail ranks removed."""
    survivors_nodes = len({g // (G // N) for g in range(G_new)})
    nodes = survivors_nodes if G_new % survivors_nodes == 0 else 1
    return {"num_replicas": S * G_new, "num_groups": GROUPS, "num_nodes": nodes, "num_gpus": G_new}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The placement in service (solved with a node failure domain and ``--failover DIR``), its load,
    the folder, and every case's answer from vLLM's code."""
    python = _engines_python()
    tmp = tmp_path_factory.mktemp("failover")
    load = np.random.default_rng(11).integers(100, 5000, (L, E)).astype(np.int64)
    np.save(tmp / "load.npy", load.astype(np.float64))
    folder = tmp / "failover"
    argv = ["solve", "--load", str(tmp / "load.npy"), "--ep-size", str(G), "--num-nodes", str(N)]
    argv += ["--num-redundant", str(G * S - E), "--num-groups", str(GROUPS), "--failure-domain", "node"]
    assert main([*argv, "--failover", str(folder), "-o", str(tmp / "p.json")]) == 0
    old = read_placement(tmp / "p.json").physical_to_logical_map
    other = solve(
        "greedy", topology=Topology(G, G * S, N), load=load.astype(float)
    ).placement.physical_to_logical_map
    scale_up = old.copy()
    scale_up[:, -S:] = -1  # a rank joining: its slots empty
    cases = {
        "node, computed": ("migration", old, 4),
        "gpu, reloads only": ("greedy:failover_moves=0", old, 7),
        "node, from the folder": (f"migration:failover={folder}", old, 4),
        "node, folder of another map": (f"exact:failover={folder}", other, 4),
        "scale-up": ("greedy", scale_up, G),
    }
    payload = [
        {"spec": spec, "weight": load.tolist(), "old": m.tolist(), **_vllm_scale_down_args(g)}
        for spec, m, g in cases.values()
    ]
    site = _entry_points_dir(tmp)
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{ROOT}", "OMP_NUM_THREADS": "1"}
    env.pop(ENV_VAR, None)
    run = subprocess.run(
        [str(python), "-c", _SCRIPT, json.dumps(payload)],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    answers = dict(zip(cases, json.loads(lines[-1][len("RESULT ") :])))
    return {"load": load.astype(np.float64), "old": old, "other": other, "folder": folder, "answers": answers}


def _ours(old: np.ndarray, load: np.ndarray, G_new: int, moves="lost") -> Placement:
    pl = Placement(old, E, Topology(G, G * S, 1))
    return failover_map(pl, load, tuple(range(G_new, G)), FailoverOptions(max_moves=moves))[0]


def test_a_scale_down_is_answered_with_the_failover_map_identically_on_every_rank(served):
    a = served["answers"]["node, computed"]
    got = np.array(a["map"])
    assert a["dtype"] == "torch.int64" and a["device"] == "cpu" and a["same"]
    assert got.shape == (L, S * 4)
    assert np.array_equal(got, _ours(served["old"], served["load"], 4).physical_to_logical_map)
    assert any("scale-down from 8 to 4 ranks: failover map computed" in m for m in a["log"]), a["log"]


def test_reloads_only_keeps_every_surviving_slot_but_those_the_missing_experts_take(served):
    a = served["answers"]["gpu, reloads only"]
    got = np.array(a["map"])  # [L, 35]: rank 7 left
    old = served["old"]
    assert np.array_equal(got, _ours(old, served["load"], 7, moves=0).physical_to_logical_map)
    for l in range(L):
        before = old[l, : S * 7]
        missing = sorted(set(range(E)) - set(before.tolist()))
        changed = got[l] != before
        assert sorted(got[l][changed].tolist()) == missing  # only experts with no surviving copy arrive
        assert (np.bincount(before, minlength=E)[before[changed]] >= 2).all()  # into surplus replicas' slots
        assert sorted(set(got[l].tolist())) == list(range(E))


def test_the_precomputed_folder_is_served_only_for_the_map_it_was_computed_from(served):
    a = served["answers"]["node, from the folder"]
    want = read_placement(served["folder"] / "lost-node-1.json").physical_to_logical_map
    assert np.array_equal(np.array(a["map"]), want)
    assert any("lost-node-1.json served" in m for m in a["log"]), a["log"]
    b = served["answers"]["node, folder of another map"]
    assert np.array_equal(
        np.array(b["map"]), _ours(served["other"], served["load"], 4).physical_to_logical_map
    )
    assert any("computed from another map" in m for m in b["log"]), b["log"]


def test_scale_up_keeps_placing_as_before(served):
    a = served["answers"]["scale-up"]
    got = np.array(a["map"])
    assert got.shape == (L, G * S) and all(sorted(set(r)) == list(range(E)) for r in got.tolist())
    assert not any("scale-down" in m for m in a["log"]), a["log"]
