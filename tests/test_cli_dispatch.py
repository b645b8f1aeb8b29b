"""``--dispatch`` and ``--source-ranks`` on the CLI, engine maps with co-located replicas, bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moe_placement.cli.main import main
from placement.dispatch import DISPATCH, sglang_static_tables
from placement.formats import read_placement
from placement.metrics import balance_stats, source_ranks
from profiling.readers import read_trace, write_trace
from profiling.synthetic import synthetic_trace

TOPO = ["--ep-size", "8", "--num-nodes", "2", "--num-redundant", "8"]


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("d") / "trace.npz"
    write_trace(
        synthetic_trace(num_tokens=6000, num_layers=3, num_logical_experts=16, top_k=2, num_prompts=80), p
    )
    return p


@pytest.fixture(scope="module")
def greedy_file(trace_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("g") / "p.json"
    assert main(["solve", "--trace", str(trace_file), *TOPO, "-o", str(out)]) == 0
    return out


def _json(capsys, argv) -> dict:
    capsys.readouterr()
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_evaluate_sglang_static_equals_the_table_applied_token_by_token(trace_file, greedy_file, capsys):
    d = _json(
        capsys, ["evaluate", str(greedy_file), str(trace_file), "--dispatch", "sglang-static", "--json"]
    )
    pl, tr = read_placement(greedy_file), read_trace(trace_file)
    src, _ = source_ranks(tr, 8)
    table = sglang_static_tables(pl)  # [G, L, E]
    loads = np.zeros((3, 8))
    for l in range(3):
        slots = table[src[:, None], l, tr.topk_ids[:, l, :]]  # [T, k]
        loads[l] = np.bincount(slots.ravel() // pl.topology.slots_per_gpu, minlength=8)
    expect = balance_stats(loads)
    assert d["par"] == pytest.approx(expect["par"], abs=1e-12)
    assert d["par_per_layer"] == pytest.approx(expect["par_per_layer"], abs=1e-12)
    assert d["policy"] == "sglang-static"


def test_evaluate_all_prints_every_model_and_policy_is_an_alias(trace_file, greedy_file, capsys):
    d = _json(capsys, ["evaluate", str(greedy_file), str(trace_file), "--dispatch", "all", "--json"])
    assert list(d["dispatch"]) == list(DISPATCH)
    local = _json(capsys, ["evaluate", str(greedy_file), str(trace_file), "--policy", "local", "--json"])
    assert local["par"] == d["dispatch"]["local"]["par"]
    assert d["dispatch"]["sglang-static"]["par"] != d["dispatch"]["even"]["par"]


def test_source_ranks_change_the_engine_figures_not_even(trace_file, greedy_file, capsys):
    args = ["evaluate", str(greedy_file), str(trace_file), "--json", "--dispatch"]
    rr = _json(capsys, [*args, "sglang-static", "--source-ranks", "round-robin"])
    rnd = _json(capsys, [*args, "sglang-static", "--source-ranks", "random:5"])
    assert rr["par"] != rnd["par"] and rnd["source_ranks"].startswith("random by prompt")
    even_rr = _json(capsys, [*args, "even", "--source-ranks", "round-robin"])
    even_rnd = _json(capsys, [*args, "even", "--source-ranks", "random:5"])
    assert even_rr["par"] == even_rnd["par"]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--dispatch", "sglang"], "unknown dispatch model 'sglang'"),
        (["--source-ranks", "WRONG_LENGTH"], "need 6000 integer ranks"),
        (["--source-ranks", "TOO_HIGH"], "ranks must be in [0, 8)"),
        (["--source-ranks", "random:x"], "seed after 'random:'"),
    ],
)
def test_bad_dispatch_input_is_one_line_and_exit_2(trace_file, greedy_file, tmp_path, capsys, extra, message):
    np.save(tmp_path / "short.npy", np.zeros(10, dtype=np.int64))
    np.save(tmp_path / "high.npy", np.full(6000, 8, dtype=np.int64))
    files = {"WRONG_LENGTH": str(tmp_path / "short.npy"), "TOO_HIGH": str(tmp_path / "high.npy")}
    extra = [files.get(x, x) for x in extra]
    capsys.readouterr()
    assert main(["evaluate", str(greedy_file), str(trace_file), "--dispatch", "sglang-static", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def _sglang_file(tmp_path, rows) -> str:
    path = tmp_path / "engine.json"
    path.write_text(json.dumps({"physical_to_logical_map": rows}))
    return str(path)


def test_engine_map_with_colocated_replicas_is_scored_with_one_warning(trace_file, tmp_path, capsys):
    row = list(range(16)) + [0, 0, 1, 2, 3, 4, 5, 6]  # GPU 7 holds expert 0 twice (slots 16, 17... on GPU 5)
    path = _sglang_file(tmp_path, [row, row, row])
    capsys.readouterr()
    code = main(
        ["evaluate", path, str(trace_file), "--ep-size", "8", "--num-nodes", "2", "--dispatch", "all"]
    )
    out = capsys.readouterr()
    assert code == 0
    warnings = [line for line in out.err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "GPU 5 expert 0" in warnings[0] and "SGLang" in warnings[0]
    assert "sglang-static" in out.out


def test_engine_file_without_sidecar_needs_ep_size(trace_file, tmp_path, capsys):
    path = _sglang_file(tmp_path, [list(range(16)) + list(range(8))] * 3)
    capsys.readouterr()
    assert main(["evaluate", path, str(trace_file)]) == 2
    assert "ep_size" in capsys.readouterr().err


@pytest.mark.parametrize(
    "row", [[-1] + list(range(1, 16)) + list(range(8)), list(range(14)) + [15] + list(range(8)) + [15]]
)
def test_map_with_minus_one_or_an_expert_without_replica_is_rejected(trace_file, tmp_path, capsys, row):
    path = _sglang_file(tmp_path, [row] * 3)
    capsys.readouterr()
    assert main(["evaluate", path, str(trace_file), "--ep-size", "8", "--num-nodes", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and ("holds expert id -1" in err[0] or "expert 14 has no replica" in err[0])


def test_solve_for_sglang_static_never_fits_worse_than_greedy(trace_file, tmp_path, capsys):
    out = tmp_path / "s.json"
    d = _json(
        capsys,
        [
            "solve",
            "--trace",
            str(trace_file),
            *TOPO,
            "--fit-fraction",
            "0.5",
            "--dispatch",
            "sglang-static",
            "-o",
            str(out),
            "--json",
        ],
    )
    rows = {r["placement"]: r for r in d["balance"]}
    ours = [r for name, r in rows.items() if name not in ("trivial", "greedy")]
    fitted = ours[0]["fit_par"] if ours else rows["greedy"]["fit_par"]
    assert fitted <= rows["greedy"]["fit_par"] + 1e-12
    assert any("sglang-static" in n for n in d["report"]["notes"])
    assert read_placement(out).provenance.get("dispatch") == "sglang-static"


def test_engine_map_converts_and_serves_as_previous(tmp_path, capsys):
    row = list(range(16)) + [0, 0, 1, 2, 3, 4, 5, 6]  # GPU 5 holds expert 0 twice
    path = _sglang_file(tmp_path, [row, row])
    capsys.readouterr()
    out = tmp_path / "lb.yaml"
    assert (
        main(["convert", path, "-o", str(out), "--format", "trtllm", "--ep-size", "8", "--num-nodes", "2"])
        == 0
    )
    assert "GPU 5 expert 0" in capsys.readouterr().err
    load = tmp_path / "load.npy"
    np.save(load, np.random.default_rng(0).integers(1, 100, (2, 16)).astype(float))
    nxt = tmp_path / "next.json"
    argv = [
        "solve",
        "--load",
        str(load),
        *TOPO,
        "--previous",
        path,
        "--max-moves",
        "4",
        "-o",
        str(nxt),
        "--json",
    ]
    d = _json(capsys, argv)
    assert any("twice on a GPU: 2 slot(s) moved" in n for n in d["report"]["notes"])
    new = read_placement(nxt)  # a valid placement: no expert twice on a GPU
    assert not new.allow_colocated_replicas
    assert d["moved_slots"] == int((new.physical_to_logical_map != np.array([row, row])).sum())
