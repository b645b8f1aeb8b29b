"""Issue 25 (reliability round 2): what an adversarial pass over the library layers found.

Outputs keep their mode and never overwrite an input; inputs are regular files only; YAML alias bombs,
duplicate keys, deep nesting, huge declared sizes and non-finite loads end as one ValueError naming the
file; the exact solver's placement does not depend on the wall clock, and Ctrl-C during a CP-SAT solve
reaches Python as KeyboardInterrupt instead of aborting the process.
"""

from __future__ import annotations

import json
import math
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from moe_placement.base.fileio import (
    InputFileError,
    atomic_write_bytes,
    atomic_write_json,
    check_outputs,
    load_json,
    load_npy,
    load_npz,
    safe_torch_load,
)
from moe_placement.base.limits import MAX_EXPERTS, MAX_LAYER_ID
from placement import Placement, Topology
from placement.formats import read_placement, write_placement
from placement.model import hidden_layer_rows
from profiling.engine_readers import read_engine_dump
from profiling.readers import check_load, read_trace, require_data
from profiling.trace import TRACE_SCHEMA, RoutingTrace

ROOT = Path(__file__).resolve().parents[1]
POSIX = os.name == "posix"


@pytest.fixture
def alarm():
    """Fail (instead of hanging forever) when a read blocks: SIGALRM after 5 s."""
    if not hasattr(signal, "SIGALRM"):
        pytest.skip("needs SIGALRM")

    def fire(signum, frame):
        raise TimeoutError("the read blocked")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(5)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def _placement(layer_ids=(0, 1)) -> Placement:
    p2l = np.array([[0, 1, 2, 3, 0, 1]] * len(layer_ids))  # [L, 6] over 2 GPUs x 3 slots
    return Placement(p2l, 4, Topology(ep_size=2, num_physical_experts=6), tuple(layer_ids))


# ---------------------------------------------------------------------------------------------
# 1. outputs: modes, same-file and folder checks; inputs: regular files only
# ---------------------------------------------------------------------------------------------
@pytest.mark.skipif(not POSIX, reason="POSIX permission bits")
def test_atomic_write_keeps_the_mode_of_a_replaced_file(tmp_path):
    target = tmp_path / "out.json"
    target.write_text("old")
    for mode in (0o644, 0o640, 0o604):
        os.chmod(target, mode)
        atomic_write_bytes(target, b"new")
        assert stat.S_IMODE(os.stat(target).st_mode) == mode
        assert target.read_bytes() == b"new"


@pytest.mark.skipif(not POSIX, reason="POSIX permission bits")
def test_atomic_write_gives_a_new_file_the_umask_mode(tmp_path):
    old = os.umask(0o027)
    try:
        atomic_write_bytes(tmp_path / "a.json", b"x")
        os.umask(0o002)
        atomic_write_bytes(tmp_path / "b.json", b"x")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "a.json").st_mode) == 0o640
    assert stat.S_IMODE(os.stat(tmp_path / "b.json").st_mode) == 0o664


def test_check_outputs_refuses_an_output_that_is_an_input(tmp_path):
    src = tmp_path / "in.json"
    src.write_text("{}")
    link = tmp_path / "link.json"
    link.symlink_to(src)
    hard = tmp_path / "hard.json"
    os.link(src, hard)
    (tmp_path / "sub").mkdir()
    for out in (src, link, hard, tmp_path / "sub" / ".." / "in.json"):
        with pytest.raises(InputFileError, match="destroy the input"):
            check_outputs([src], [out])
    assert src.read_text() == "{}"


def test_check_outputs_refuses_two_outputs_that_are_one_file(tmp_path):
    a = tmp_path / "a.json"
    link = tmp_path / "alias.json"
    link.symlink_to(a)  # dangling until a is written
    with pytest.raises(InputFileError, match="same file"):
        check_outputs([], [a, tmp_path / "a.json"])
    with pytest.raises(InputFileError, match="same file"):
        check_outputs([], [a, link])


def test_check_outputs_refuses_missing_or_unusable_folders(tmp_path):
    with pytest.raises(InputFileError, match="does not exist"):
        check_outputs([], [tmp_path / "nope" / "out.json"])
    (tmp_path / "adir").mkdir()
    with pytest.raises(InputFileError, match="a folder"):
        check_outputs([], [tmp_path / "adir"])
    if POSIX and os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir()
        os.chmod(ro, 0o555)
        try:
            with pytest.raises(InputFileError, match="not writable"):
                check_outputs([], [ro / "out.json"])
        finally:
            os.chmod(ro, 0o755)


def test_check_outputs_accepts_distinct_paths_and_skips_none(tmp_path):
    src = tmp_path / "in.json"
    src.write_text("{}")
    check_outputs([src, None], [tmp_path / "out.json", None, tmp_path / "out.json.meta.json"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.json"]  # nothing written


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_fifo_inputs_are_refused_at_once(tmp_path, alarm):
    readers = {
        "f.json": [load_json, read_placement],
        "f.yaml": [read_placement],
        "f.npz": [load_npz, read_trace],
        "f.npy": [load_npy],
        "f.jsonl": [read_engine_dump, read_trace],
        "f.pt": [lambda p: safe_torch_load(p, 1024, "a test file"), read_placement],
        "f.safetensors": [read_engine_dump],
    }
    for name, fns in readers.items():
        fifo = tmp_path / name
        os.mkfifo(fifo)
        for fn in fns:
            with pytest.raises(InputFileError, match="FIFO, not a regular file"):
                fn(fifo)


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_device_inputs_are_refused(alarm):
    for fn in (load_json, read_placement, load_npz, load_npy):
        with pytest.raises(InputFileError, match="device, not a regular file"):
            fn("/dev/zero")


# ---------------------------------------------------------------------------------------------
# 2. YAML aliases, duplicate keys, deep nesting
# ---------------------------------------------------------------------------------------------
def _alias_bomb(levels: int = 9, width: int = 9) -> str:
    lines = ["a0: &a0 [1, 2, 3, 4, 5, 6, 7, 8, 9]"]
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]")
    lines.append("num_slots: 6")
    lines.append(f"initial_global_assignments: {{0: *a{levels - 1}}}")
    return "\n".join(lines) + "\n"


def test_yaml_alias_bomb_is_refused_fast(tmp_path):
    bomb = tmp_path / "moe_load_balancer.yaml"
    bomb.write_text(_alias_bomb())
    assert bomb.stat().st_size < 600
    t0 = time.perf_counter()
    with pytest.raises(InputFileError, match="aliases .* expand to over"):
        read_placement(bomb, ep_size=2)
    assert time.perf_counter() - t0 < 5.0


def test_yaml_recursive_alias_is_refused(tmp_path):
    f = tmp_path / "rec.yaml"
    f.write_text("num_slots: 6\ninitial_global_assignments: &x {0: *x}\n")
    with pytest.raises(InputFileError, match="recursive"):
        read_placement(f, ep_size=2)


def test_yaml_small_aliases_still_read(tmp_path):
    f = tmp_path / "lb.yaml"
    f.write_text(
        "num_slots: 6\nlayer_updates_per_iter: 0\n"
        "initial_global_assignments:\n  3: &row [0, 1, 2, 3, 0, 1]\n  5: *row\n"
    )
    pl = read_placement(f, ep_size=2)
    assert pl.layer_ids == (3, 5)
    assert pl.physical_to_logical_map.tolist() == [[0, 1, 2, 3, 0, 1]] * 2


def test_yaml_duplicate_keys_are_refused(tmp_path):
    f = tmp_path / "lb.yaml"
    f.write_text(
        "num_slots: 6\ninitial_global_assignments:\n  3: [0, 1, 2, 3, 0, 1]\n  3: [1, 0, 2, 3, 0, 1]\n"
    )
    with pytest.raises(InputFileError, match=r"key 3 twice \(line 4\)"):
        read_placement(f, ep_size=2)
    f.write_text("num_slots: 6\nnum_slots: 7\ninitial_global_assignments: {0: [0, 1, 2, 3, 0, 1]}\n")
    with pytest.raises(InputFileError, match="'num_slots' twice"):
        read_placement(f, ep_size=2)


def test_yaml_written_by_the_trtllm_writer_round_trips(tmp_path):
    pl = _placement((1, 4))
    write_placement(pl, tmp_path / "lb.yaml", "trtllm")
    assert read_placement(tmp_path / "lb.yaml") == pl


def test_json_duplicate_keys_are_refused(tmp_path):
    write_placement(_placement(), tmp_path / "p.json")
    doc = (tmp_path / "p.json").read_text()
    dup = doc.replace('"num_logical_experts": 4', '"num_logical_experts": 4, "num_logical_experts": 5')
    (tmp_path / "p.json").write_text(dup)
    with pytest.raises(InputFileError, match=r"p\.json: .*'num_logical_experts' twice"):
        read_placement(tmp_path / "p.json")
    (tmp_path / "m.json").write_text('{"a": 1, "a": 2}')
    with pytest.raises(InputFileError, match="'a' twice"):
        load_json(tmp_path / "m.json")


def _vllm_line(**over) -> str:
    rec = {
        "record_type": "eplb_load_stats",
        "version": 1,
        "step": 0,
        "num_ranks": 2,
        "expert_load": [[5, 1, 2, 3]],
        "p2l_map": [[0, 1, 2, 0]],
    }
    rec.update(over)
    return json.dumps(rec)


def test_jsonl_duplicate_keys_and_deep_lines_name_the_file(tmp_path):
    f = tmp_path / "stats.jsonl"
    f.write_text(_vllm_line()[:-1] + ', "step": 3}\n')
    with pytest.raises(InputFileError, match=r"stats\.jsonl: line 1: .*'step' twice"):
        read_engine_dump(f)
    f.write_text("[" * 200_000 + "]" * 200_000 + "\n")
    with pytest.raises(InputFileError, match=r"stats\.jsonl: line 1: .*nested too deeply"):
        read_engine_dump(f)


@pytest.mark.parametrize("depth", [50, 900, 5_000, 200_000])
def test_deep_json_ends_as_a_value_error_naming_the_file(tmp_path, depth):
    f = tmp_path / "deep.json"
    write_placement(_placement(), f)
    doc = json.loads(f.read_text())
    text = json.dumps(doc)[:-1] + ', "provenance_extra": ' + "[" * depth + "]" * depth + "}"
    f.write_text(text)
    try:
        pl = read_placement(f)
    except InputFileError as exc:
        assert "deep.json" in str(exc)
    else:
        assert pl == _placement()
    (tmp_path / "deep2.json").write_text('{"physical_to_logical_map": ' + "[" * depth + "]" * depth + "}")
    with pytest.raises(InputFileError, match="deep2.json"):
        read_placement(tmp_path / "deep2.json", ep_size=2)


def test_deep_trace_metadata_names_the_file(tmp_path):
    f = tmp_path / "t.npz"
    np.savez(
        f,
        schema=np.array(TRACE_SCHEMA),
        num_logical_experts=np.array(4),
        window_counts=np.ones((1, 1, 4)),
        metadata_json=np.array("[" * 200_000 + "]" * 200_000),
    )
    with pytest.raises(InputFileError, match=r"t\.npz: field 'metadata_json'"):
        read_trace(f)


# ---------------------------------------------------------------------------------------------
# 3. declared sizes, layer ids, totals, empty data
# ---------------------------------------------------------------------------------------------
def test_huge_layer_ids_are_refused_before_allocation(tmp_path):
    f = tmp_path / "p.json"
    write_placement(_placement(), f)
    doc = json.loads(f.read_text())
    doc["layer_ids"] = [0, 200_000_000]
    f.write_text(json.dumps(doc))
    assert f.stat().st_size < 1000
    with pytest.raises(InputFileError, match="MAX_LAYER_ID"):
        read_placement(f)
    y = tmp_path / "lb.yaml"
    y.write_text("num_slots: 6\ninitial_global_assignments: {200000000: [0, 1, 2, 3, 0, 1]}\n")
    with pytest.raises(InputFileError, match="MAX_LAYER_ID"):
        read_placement(y, ep_size=2)
    with pytest.raises(ValueError, match="MAX_LAYER_ID"):
        read_placement(y, ep_size=2, layer_ids=[MAX_LAYER_ID + 1])


def test_negative_or_duplicate_layer_ids_are_refused(tmp_path):
    f = tmp_path / "p.json"
    write_placement(_placement(), f)
    doc = json.loads(f.read_text())
    for ids, match in (([1, 1], "layer id 1 twice"), ([-1, 2], "layer id -1")):
        doc["layer_ids"] = ids
        f.write_text(json.dumps(doc))
        with pytest.raises(InputFileError, match=match):
            read_placement(f)
    t = tmp_path / "t.npz"
    for ids, match in (([3, 3], "layer id 3 twice"), ([0, -2], "layer id -2")):
        np.savez(t, counts=np.ones((2, 4)), layer_ids=np.array(ids))
        with pytest.raises(InputFileError, match=rf"t\.npz: .*{match}"):
            read_trace(t)


def test_sglang_hidden_layer_rows_are_bounded():
    pl = _placement((0, 5))
    assert hidden_layer_rows(pl).shape == (6, 6)
    with pytest.raises(ValueError, match="MAX_LAYER_ID"):
        hidden_layer_rows(pl, num_hidden_layers=10**9)
    # an in-memory placement with a huge id (never read from a file) is refused too
    big = Placement(pl.physical_to_logical_map, 4, pl.topology, (0, 10**8))
    with pytest.raises(ValueError, match="MAX_LAYER_ID"):
        hidden_layer_rows(big)


def test_trace_header_claiming_huge_expert_count_is_refused(tmp_path):
    f = tmp_path / "t.npz"
    np.savez(
        f,
        schema=np.array(TRACE_SCHEMA),
        num_logical_experts=np.array(10**8),
        topk_ids=np.zeros((3, 1, 2), dtype=np.int32),
    )
    with pytest.raises(InputFileError, match=r"t\.npz: .*MAX_EXPERTS"):
        read_trace(f)
    np.savez(f, topk_ids=np.array([[[0, 2**30]]], dtype=np.int32))  # E = max id + 1
    with pytest.raises(InputFileError, match="MAX_EXPERTS"):
        read_trace(f)


def test_vllm_expert_id_of_3e8_is_refused(tmp_path):
    f = tmp_path / "stats.jsonl"
    f.write_text(_vllm_line(p2l_map=[[0, 1, 2, 300_000_000]]) + "\n")
    with pytest.raises(InputFileError, match="MAX_EXPERTS"):
        read_engine_dump(f)
    f.write_text(_vllm_line(num_ranks=2**40) + "\n")
    with pytest.raises(InputFileError, match="MAX_RANKS"):
        read_engine_dump(f)
    f.write_text(_vllm_line(layer_ids=[10**9]) + "\n")
    with pytest.raises(InputFileError, match="MAX_LAYER_ID"):
        read_engine_dump(f)
    f.write_text(_vllm_line() + "\n")
    assert read_engine_dump(f).counts().tolist() == [[8, 1, 2]]  # slots 0 and 3 hold expert 0


def test_trtllm_meta_claiming_huge_expert_count_is_refused(tmp_path):
    (tmp_path / "meta_info.json").write_text(json.dumps({"num_experts": 10**8, "num_experts_per_token": 2}))
    (tmp_path / "rank0.safetensors").write_bytes(b"")
    with pytest.raises(InputFileError, match="MAX_EXPERTS"):
        read_engine_dump(tmp_path)


@pytest.mark.parametrize("value", [1e308, float(2**54)])
def test_non_representable_load_sums_are_refused_at_read_time(tmp_path, value):
    f = tmp_path / "c.npz"
    np.savez(f, counts=np.array([[value, value, 1.0, 0.0]]))
    with pytest.raises(InputFileError, match=r"c\.npz: .*MAX_TOTAL_TOKENS"):
        read_trace(f)
    np.savez(f, counts=np.array([[2**62, 2**62, 1, 0]], dtype=np.int64))  # would overflow int64 sums
    with pytest.raises(InputFileError, match="MAX_TOTAL_TOKENS"):
        read_trace(f)
    with pytest.raises(ValueError, match=r"load\.npy: .*MAX_TOTAL_TOKENS"):
        check_load(np.array([[value, value]]), "load.npy")


def test_check_load_refuses_bad_arrays_and_passes_good_ones():
    good = np.array([[3.0, 1.0], [0.0, 2.0]])
    assert check_load(good, "x").tolist() == good.tolist()
    for bad, match in (
        (np.array([[np.nan, 1.0]]), "NaN"),
        (np.array([[-1, 1]]), "negative"),
        (np.array([1.0, 2.0]), "layers, experts"),
        (np.zeros((1, MAX_EXPERTS + 1)), "MAX_EXPERTS"),
    ):
        with pytest.raises(ValueError, match=match):
            check_load(bad, "load.npy")


def test_json_writer_refuses_nan_and_keeps_the_old_file(tmp_path):
    f = tmp_path / "report.json"
    f.write_text('{"old": 1}')
    for bad in ({"par": math.nan}, {"x": [1.0, math.inf]}):
        with pytest.raises(ValueError, match="NaN or an infinity"):
            atomic_write_json(f, bad)
    assert f.read_text() == '{"old": 1}'
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]  # no temporary left behind
    atomic_write_json(f, {"par": 1.25})
    assert json.loads(f.read_text()) == {"par": 1.25}


def test_empty_and_all_zero_traces_read_but_are_refused_for_solving(tmp_path):
    f = tmp_path / "empty.npz"
    np.savez(f, topk_ids=np.zeros((0, 2, 2), dtype=np.int32), counts=np.zeros((2, 4)))
    tr = read_trace(f)  # inspect may still report it
    assert tr.num_tokens == 0
    with pytest.raises(ValueError, match="empty.npz: the trace has 0 tokens"):
        require_data(tr, "empty.npz")
    np.savez(f, counts=np.zeros((2, 4)))
    with pytest.raises(ValueError, match="every expert load is 0"):
        require_data(read_trace(f), "empty.npz")
    with pytest.raises(ValueError, match="every expert load is 0"):
        require_data(np.zeros((2, 4)), "load.npy")
    require_data(RoutingTrace(4, window_counts=np.ones((1, 2, 4))), "ok")
    require_data(np.ones((2, 4)), "ok")


def test_good_yaml_json_and_npy_still_load(tmp_path):
    write_placement(_placement((2, 7)), tmp_path / "p.json")
    assert read_placement(tmp_path / "p.json") == _placement((2, 7))
    np.save(tmp_path / "load.npy", np.arange(8.0).reshape(2, 4))
    assert load_npy(tmp_path / "load.npy").tolist() == np.arange(8.0).reshape(2, 4).tolist()
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(InputFileError, match="pickle"):
        load_npy(tmp_path / "obj.npy")
    assert yaml.safe_load((tmp_path / "p.json").read_text())["layer_ids"] == [2, 7]


# ---------------------------------------------------------------------------------------------
# 4. exact solver: no wall clock in the placement; Ctrl-C reaches Python
# ---------------------------------------------------------------------------------------------
def test_cpsat_provenance_does_not_depend_on_the_wall_clock(monkeypatch):
    """Two runs give the same provenance, statuses and map: the search stops on deterministic-time
    limits and proven optima, never on the wall clock.

    The run keeps the deterministic budget a 0.6 s limit gives (0.085 CP-SAT units per layer) but has
    50x the wall room (time_limit 30 s, units per second of share 0.01 instead of 0.5). At 0.6 s the
    whole solve's wall (a hard limit) bound first on a loaded machine (4 busy processes on 2 cores: the
    maps differed in 5 runs of 5; even idle the first run could leave its last layer unsearched), so the
    test measured the load, not the solver. A cut by the wall clock shows as a note, asserted absent."""
    from solver.exact import solve_exact

    time_limit = 30.0
    monkeypatch.setattr("solver.exact.cpsat._DET_FACTOR", 0.5 * 0.6 / time_limit)
    rng = np.random.default_rng(3)
    load = rng.zipf(1.4, size=(3, 16)).astype(float)
    topo = Topology(ep_size=4, num_physical_experts=20)
    runs = [solve_exact(load, topo, time_limit=time_limit, workers=1, noise_gate=None) for _ in range(2)]
    (pl0, rep0), (pl1, rep1) = runs
    assert rep0.notes == () and rep1.notes == (), (rep0.notes, rep1.notes)  # nothing cut by the wall
    statuses = [lr.status for lr in rep0.layers]
    assert statuses == [lr.status for lr in rep1.layers]
    assert "time_limit" in statuses  # one layer stops on its deterministic budget, not proven optimal
    assert pl0.provenance == pl1.provenance
    assert np.array_equal(pl0.physical_to_logical_map, pl1.physical_to_logical_map)
    # the per-layer budget is time_limit's share alone, not what the setup left of it
    assert pl0.provenance["per_layer_limit_s"] == pytest.approx(time_limit * 1 / 3 * 0.85, rel=0, abs=0)


def test_cpsat_never_installs_its_sigint_handler():
    from solver.exact.cpsat import _cp_solver

    assert _cp_solver(0, 1.0, 2.0).parameters.catch_sigint_signal is False
    assert _cp_solver(0, None, 2.0).parameters.catch_sigint_signal is False


_SIGINT_SCRIPT = textwrap.dedent(
    """
    import sys
    import numpy as np
    from placement.topology import Topology
    from solver.exact import solve_exact

    load = np.random.default_rng(0).zipf(1.3, size=(2, 64)).astype(float)
    topo = Topology(ep_size=8, num_physical_experts=72)
    print("start", flush=True)
    try:
        solve_exact(load, topo, time_limit=60.0, workers=int(sys.argv[1]), noise_gate=None)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        sys.exit(3)
    print("finished", flush=True)
    """
)


@pytest.mark.skipif(not POSIX, reason="SIGINT to a subprocess")
@pytest.mark.parametrize("workers", [1, 2])
def test_ctrl_c_during_a_cpsat_solve_is_a_keyboard_interrupt(tmp_path, workers):
    script = tmp_path / "solve.py"
    script.write_text(_SIGINT_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, str(script), str(workers)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    try:
        assert proc.stdout.readline().strip() == "start"
        time.sleep(2.5)  # greedy start and model build done: CP-SAT is searching
        t0 = time.perf_counter()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert "bad_function_call" not in err
    assert proc.returncode == 3, (proc.returncode, out, err[-2000:])  # not -6 (SIGABRT) nor a normal end
    assert "interrupted" in out
    assert time.perf_counter() - t0 < 10.0  # the search stopped; it did not run out its 60 s
