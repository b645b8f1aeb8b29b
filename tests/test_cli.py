"""The CLI as users run it: real subprocess for the entry point, main() in-process for speed."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moe_placement.cli.main import main
from profiling.readers import find_shared_traces, write_trace
from profiling.synthetic import synthetic_trace

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def small_trace(tmp_path_factory):
    p = tmp_path_factory.mktemp("t") / "trace.npz"
    write_trace(
        synthetic_trace(num_tokens=4000, num_layers=3, num_logical_experts=16, top_k=2, num_prompts=40), p
    )
    return p


def test_python_dash_m_entry_point(small_trace):
    r = subprocess.run(
        [sys.executable, "-m", "moe_placement", "inspect", str(small_trace), "--json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert len(d["layers"]) == 3 and d["summary"]["synthetic"] is True


def test_solve_writes_file_and_prints_before_after(small_trace, tmp_path, capsys):
    out = tmp_path / "p.json"
    rc = main(
        [
            "solve",
            "--trace",
            str(small_trace),
            "--ep-size",
            "4",
            "--num-nodes",
            "2",
            "--num-redundant",
            "4",
            "--solver",
            "greedy",
            "-o",
            str(out),
            "--fit-fraction",
            "0.5",
            "--json",
        ]
    )
    assert rc == 0
    d = json.loads(capsys.readouterr().out)
    rows = {r["placement"]: r for r in d["balance"]}
    assert rows["greedy"]["fit_par"] <= rows["trivial"]["fit_par"]
    assert "heldout_par" in rows["greedy"]
    from placement.formats import read_placement

    pl = read_placement(out)
    assert pl.num_physical_experts == 20 and pl.topology.ep_size == 4


def test_evaluate_json(small_trace, tmp_path, capsys):
    out = tmp_path / "p.json"
    assert (
        main(["solve", "--trace", str(small_trace), "--ep-size", "4", "--num-redundant", "4", "-o", str(out)])
        == 0
    )
    capsys.readouterr()
    assert (
        main(["evaluate", str(out), str(small_trace), "--policy", "local", "--step-tokens", "8", "--json"])
        == 0
    )
    d = json.loads(capsys.readouterr().out)
    for key in (
        "par",
        "balancedness",
        "imbalance_ratio",
        "step_par",
        "remote_nodes_per_token",
        "remote_gpus_per_token",
    ):
        assert key in d
    assert d["par"] >= 1.0 and d["balancedness"] == pytest.approx(
        np.mean([1 / x for x in d["par_per_layer"]])
    )


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["inspect", "/no/such/trace.npz"], "does not exist"),
        (["solve", "--load", "{load}", "--ep-size", "7"], "do not divide over ep_size=7"),
        (
            ["solve", "--load", "{load}", "--ep-size", "4", "--num-nodes", "3"],
            "does not divide over num_nodes=3",
        ),
        (["solve", "--load", "{bad}", "--ep-size", "4"], "NaN, inf or negative entries"),
        (["solve", "--ep-size", "4"], "exactly one of --trace"),
        (["solve", "--load", "{load}", "--ep-size", "4", "-o", "/no/such/dir/p.json"], "does not exist"),
        (["solve", "--load", "{load}", "--ep-size", "4", "--max-moves", "3"], "need --previous"),
        (["evaluate", "{load}", "{load}"], "placement"),
    ],
)
def test_bad_input_exit_code_2_one_line(argv, fragment, tmp_path, capsys):
    load = tmp_path / "load.npy"
    np.save(load, np.ones((2, 8)))
    bad = tmp_path / "bad.npy"
    np.save(bad, -np.ones((2, 8)))
    argv = [a.format(load=load, bad=bad) for a in argv]
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith("moe-placement: error:")
    assert fragment in err
    assert "Traceback" not in err


def test_inspect_and_greedy_solve_on_every_shared_trace(traces_dir, tmp_path, capsys):
    paths = find_shared_traces()
    assert paths
    for p in paths:
        assert main(["inspect", str(p), "--json"]) == 0
        d = json.loads(capsys.readouterr().out)
        E = d["summary"]["num_logical_experts"]
        ep = 8 if E % 8 == 0 else 4
        red = (-E) % ep + ep  # a redundant count that divides
        out = tmp_path / (p.stem + ".json")
        assert (
            main(
                [
                    "solve",
                    "--trace",
                    str(p),
                    "--ep-size",
                    str(ep),
                    "--num-redundant",
                    str(red),
                    "-o",
                    str(out),
                    "--json",
                ]
            )
            == 0
        )
        s = json.loads(capsys.readouterr().out)
        rows = {r["placement"]: r for r in s["balance"]}
        assert rows["greedy"]["fit_par"] <= rows["trivial"]["fit_par"] + 1e-9
        assert out.is_file()


def test_inspect_streamed_equals_loaded(small_trace, capsys):
    assert main(["inspect", str(small_trace), "--json"]) == 0
    full = json.loads(capsys.readouterr().out)["layers"]
    assert main(["inspect", str(small_trace), "--json", "--chunk-tokens", "333"]) == 0
    streamed = json.loads(capsys.readouterr().out)["layers"]
    assert [r["max_over_mean"] for r in streamed] == pytest.approx([r["max_over_mean"] for r in full])


def test_demo_pipeline_end_to_end(tmp_path, capsys):
    """The README's main job: inspect -> solve -> evaluate -> engine files -> validate on 8 gloo ranks."""
    pytest.importorskip("torch")
    rc = main(["demo", "--out", str(tmp_path), "--quick", "--tokens", "6000", "--layers", "2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    for name in (
        "trace.npz",
        "placement.json",
        "sglang_init_expert_location.json",
        "moe_load_balancer.yaml",
        "vllm_ascend_expert_map.json",
    ):
        assert (tmp_path / name).is_file()
    assert "PASS: per-rank tokens equal the prediction" in out
    sg = json.loads((tmp_path / "sglang_init_expert_location.json").read_text())
    assert list(sg) == ["physical_to_logical_map"]


@pytest.mark.parametrize("budget", [["--work-limit", "200"], []], ids=["given", "default"])
def test_locality_work_limit_writes_the_same_placement_twice(tmp_path, budget):
    # without --work-limit the CLI's default is a step budget too (100 per layer), not the seconds
    p = tmp_path / "t.npz"
    write_trace(
        synthetic_trace(
            num_tokens=4000,
            num_layers=2,
            num_logical_experts=16,
            top_k=4,
            num_prompts=100,
            num_clusters=2,
            affinity=30.0,
            skew=0.2,
            seed=5,
        ),
        p,
    )
    outs = []
    for i, tl in enumerate(("0.05", "3")):  # the seconds differ; the step budget decides
        out = tmp_path / f"p{i}.json"
        assert (
            main(
                [
                    "solve",
                    "--trace",
                    str(p),
                    "--ep-size",
                    "8",
                    "--num-nodes",
                    "2",
                    "--num-redundant",
                    "8",
                    "--solver",
                    "locality",
                    *budget,
                    "--time-limit",
                    tl,
                    "-o",
                    str(out),
                ]
            )
            == 0
        )
        outs.append(json.loads(out.read_text()))
    assert outs[0]["physical_to_logical_map"] == outs[1]["physical_to_logical_map"]


def _locality_cli(tmp_path, trace: Path, name: str, redundant: int, *flags: str):
    """Run ``solve --solver locality`` on 8 GPUs / 2 nodes with a step budget; (exit code, placement doc or None)."""
    out = tmp_path / f"{name}.json"
    rc = main(
        [
            "solve",
            "--trace",
            str(trace),
            "--ep-size",
            "8",
            "--num-nodes",
            "2",
            "--num-redundant",
            str(redundant),
            "--solver",
            "locality",
            "--work-limit",
            "100",
            *flags,
            "-o",
            str(out),
        ]
    )
    return rc, (json.loads(out.read_text()) if out.exists() else None)


def test_locality_drift_z_reaches_the_pairing(tmp_path):
    p = tmp_path / "t.npz"
    # 8 experts on 8 GPUs with 8 redundant slots: two slots per GPU, the pairing path that uses drift_z
    write_trace(
        synthetic_trace(
            num_tokens=4000,
            num_layers=2,
            num_logical_experts=8,
            top_k=2,
            num_prompts=100,
            num_clusters=2,
            affinity=30.0,
            skew=0.6,
            seed=5,
        ),
        p,
    )
    maps = {}
    for z in ("0", "3"):
        rc, doc = _locality_cli(tmp_path, p, f"p{z}", 8, "--drift-z", z)
        assert rc == 0 and doc["provenance"]["drift_z"] == float(z)
        maps[z] = doc["physical_to_logical_map"]
    assert maps["0"] != maps["3"]  # step budgets: the same search both times, only the margin differs
    assert _locality_cli(tmp_path, p, "bad", 8, "--drift-z", "-1") == (2, None)


def test_locality_share_overload_caps_the_default_everywhere_count(tmp_path):
    p = tmp_path / "t.npz"
    # 30 prompts dealt to 8 ranks (2 nodes): one node holds more of the tokens than the other
    write_trace(
        synthetic_trace(
            num_tokens=3000,
            num_layers=2,
            num_logical_experts=16,
            top_k=4,
            num_prompts=30,
            num_clusters=2,
            affinity=30.0,
            skew=0.6,
            seed=5,
        ),
        p,
    )
    h = {}
    for x in ("0", "10"):
        rc, doc = _locality_cli(tmp_path, p, f"p{x}", 16, "--share-overload", x)
        assert rc == 0 and doc["provenance"]["share_overload"] == float(x)
        assert (
            doc["provenance"]["share_excess"] > 0
        )  # dealt prompts: the busiest node is expected above the mean
        pl = np.array(doc["physical_to_logical_map"])  # [L, P]; node n owns slots [n * 16, (n + 1) * 16)
        h[x] = [len(set(row[:16].tolist()) & set(row[16:].tolist())) for row in pl]
    assert h["0"] == [0, 0]  # unequal node shares and no overload allowed: no expert on both nodes
    assert min(h["10"]) > 0  # uncapped: the slots pay for everywhere experts
    assert _locality_cli(tmp_path, p, "bad", 16, "--share-overload", "-0.1") == (2, None)


def test_solve_locality_reports_remote_nodes_beside_par(tmp_path, capsys):
    p = tmp_path / "clustered.npz"
    # 400 prompts: with a few dozen, which topic the held-out prompts dealt to a node happen to share
    # decides the held-out remote nodes as much as the placement does
    write_trace(
        synthetic_trace(
            num_tokens=8000,
            num_layers=2,
            num_logical_experts=16,
            top_k=4,
            num_prompts=400,
            num_clusters=2,
            affinity=30.0,
            skew=0.2,
            seed=3,
        ),
        p,
    )
    assert (
        main(
            [
                "solve",
                "--trace",
                str(p),
                "--ep-size",
                "4",
                "--num-nodes",
                "2",
                "--num-redundant",
                "4",
                "--solver",
                "locality",
                "--time-limit",
                "4",
                "--fit-fraction",
                "0.5",
                "--policy",
                "local",
                "--json",
            ]
        )
        == 0
    )
    rows = {r["placement"]: r for r in json.loads(capsys.readouterr().out)["balance"]}
    assert rows["locality"]["heldout_remote_nodes"] < rows["greedy"]["heldout_remote_nodes"]


def test_policy_is_a_deprecated_alias_that_warns(small_trace, tmp_path, capsys):
    """``--policy`` still sets the dispatch model, with one deprecation line on stderr."""
    out, trace = tmp_path / "p.json", str(small_trace)
    assert main(["solve", "--trace", trace, "--ep-size", "4", "--num-redundant", "4", "-o", str(out)]) == 0
    capsys.readouterr()
    rc = main(["evaluate", str(out), trace, "--policy", "sglang-static", "--json"])
    captured = capsys.readouterr()
    assert (
        rc == 0 and captured.err.count("\n") == 1 and "--policy is deprecated; use --dispatch" in captured.err
    )
    assert json.loads(captured.out)["policy"] == "sglang-static"


@pytest.mark.parametrize("command", ["validate", "evaluate"])
def test_policy_with_an_unknown_model_is_one_error_line(command, small_trace, tmp_path, capsys):
    """``--policy nosuch`` reaches the same check as ``--dispatch nosuch``: one line, exit 2 (no
    deprecation line on top of the error)."""
    out, trace = tmp_path / "p.json", str(small_trace)
    assert main(["solve", "--trace", trace, "--ep-size", "4", "--num-redundant", "4", "-o", str(out)]) == 0
    capsys.readouterr()
    argv = [command, str(out)] + (["--trace", trace] if command == "validate" else [trace])
    rc = main([*argv, "--policy", "nosuch"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "unknown dispatch model 'nosuch'" in err, err
    assert main([*argv, "--dispatch", "nosuch"]) == 2 and capsys.readouterr().err == err
