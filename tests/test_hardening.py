"""Issue 9: property-based and fuzz tests for the core model, the trace readers and the CLI.

Hypothesis runs with the derandomised 'ci' profile from conftest.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from moe_placement.base.fileio import InputFileError, load_npz
from moe_placement.cli.main import main
from placement import Placement, Topology
from placement.metrics import (
    balance_stats,
    communication,
    expected_gpu_load,
    peak_lower_bound,
    trace_gpu_load,
)
from profiling.readers import read_trace, write_trace
from profiling.synthetic import synthetic_trace
from profiling.trace import RoutingTrace
from solver.greedy import greedy_placement

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------
# strategies
# ---------------------------------------------------------------------------------------------
@st.composite
def problems(draw):
    """A random valid topology and load: E experts, G GPUs in N nodes, R redundant slots."""
    N = draw(st.sampled_from([1, 2]))
    m = draw(st.sampled_from([1, 2, 4]))
    G = N * m
    E = draw(st.integers(2, 12))
    S = draw(st.integers(1, E))
    if S * G < E:
        S = -(-E // G)
    if S > E:
        S = E
    topo = Topology(G, S * G, N)
    load = np.array(draw(st.lists(st.integers(0, 1000), min_size=E, max_size=E)), dtype=float)[None]
    layers = draw(st.integers(1, 3))
    return topo, np.repeat(load, layers, axis=0) * np.arange(1, layers + 1)[:, None]


@pytest.mark.parametrize(
    "gpu_load, words",
    [
        (np.zeros((2, 4)), "zero everywhere"),
        (np.array([[1.0, -1.0]]), "negative or non-finite"),
        (np.array([[1.0, np.nan]]), "negative or non-finite"),
        (np.array([[np.inf, 1.0]]), "negative or non-finite"),
        (np.zeros((0, 4)), "empty"),
    ],
)
def test_balance_stats_refuses_undefined_and_bad_loads(gpu_load, words):
    with pytest.raises(ValueError, match=words):
        balance_stats(gpu_load)
    assert balance_stats(np.array([[0.0, 0.0], [1.0, 3.0]]))["par_per_layer"] == [1.0, 1.5]  # one idle layer


def test_peak_lower_bound_refuses_impossible_sizes():
    load = np.ones((1, 8))
    for ep, phys in [(0, 8), (4, 7), (-1, 16)]:
        with pytest.raises(ValueError, match=f"ep_size={ep}, num_physical_experts={phys}"):
            peak_lower_bound(load, ep, phys)
    assert peak_lower_bound(load, 4, 8).tolist() == [2.0]


@given(problems())
def test_greedy_always_valid_and_par_at_least_one(prob):
    topo, load = prob
    E = load.shape[1]
    if topo.num_physical_experts < E:
        return
    assume(load.sum() > 0)  # the PAR of zero load is undefined (test_balance_stats_refuses_...)
    pl, rep = greedy_placement(load, topo)
    assert (pl.logical_replica_count >= 1).all()  # no expert without a replica
    s = balance_stats(expected_gpu_load(pl, load))
    assert s["par"] >= 1.0 - 1e-12
    assert all(lr.bound <= lr.objective + 1e-6 for lr in rep.layers)


@given(problems(), st.randoms(use_true_random=False))
def test_metrics_invariant_to_gpu_permutation_within_nodes_and_expert_relabelling(prob, rnd):
    topo, load = prob
    E = load.shape[1]
    if topo.num_physical_experts < E:
        return
    assume(load.sum() > 0)  # the PAR of zero load is undefined (test_balance_stats_refuses_...)
    pl, _ = greedy_placement(load, topo)
    base = balance_stats(expected_gpu_load(pl, load))
    # permute GPUs inside each node (move whole slot blocks)
    S, m = topo.slots_per_gpu, topo.gpus_per_node
    order = []
    for n in range(topo.num_nodes):
        gpus = list(range(n * m, (n + 1) * m))
        rnd.shuffle(gpus)
        order += gpus
    slot_order = np.concatenate([np.arange(g * S, (g + 1) * S) for g in order])
    permuted = Placement(pl.physical_to_logical_map[:, slot_order], E, topo)
    assert balance_stats(expected_gpu_load(permuted, load))["par"] == pytest.approx(base["par"])
    # relabel experts consistently in the map and the load
    perm = np.array(rnd.sample(range(E), E))
    relabelled = Placement(perm[pl.physical_to_logical_map], E, topo)
    new_load = np.empty_like(load)
    new_load[:, perm] = load
    assert balance_stats(expected_gpu_load(relabelled, new_load))["par"] == pytest.approx(base["par"])


def test_communication_invariant_to_expert_relabelling():
    tr = synthetic_trace(
        num_tokens=600, num_layers=2, num_logical_experts=16, top_k=3, num_prompts=12, seed=5
    )
    topo = Topology(4, 20, 2)
    pl, _ = greedy_placement(tr.counts(), topo)
    perm = np.random.default_rng(0).permutation(16)
    tr2 = RoutingTrace(num_logical_experts=16, topk_ids=perm[tr.topk_ids], seq_offsets=tr.seq_offsets)
    pl2 = Placement(perm[pl.physical_to_logical_map], 16, topo)
    for policy in ("even", "local"):
        a, b = communication(pl, tr, policy), communication(pl2, tr2, policy)
        assert a["remote_nodes_per_token"] == pytest.approx(b["remote_nodes_per_token"])
        np.testing.assert_allclose(trace_gpu_load(pl, tr, policy), trace_gpu_load(pl2, tr2, policy))


@given(
    st.lists(st.integers(-3, 20), min_size=0, max_size=60),
    st.integers(1, 4),
    st.integers(1, 16),
)
def test_trace_construction_is_valid_or_clear_error(values, k, E):
    arr = np.array(values, dtype=np.int64)
    arr = arr[: (arr.size // k) * k].reshape(-1, 1, k)
    try:
        tr = RoutingTrace(num_logical_experts=E, topk_ids=arr)
    except ValueError as exc:
        assert "must be" in str(exc) or "empty" in str(exc)
        return
    assert tr.counts().sum() == int((arr >= 0).sum())


@given(st.lists(st.integers(-2, 9), min_size=1, max_size=24), st.sampled_from([1, 2, 3]), st.integers(1, 8))
def test_placement_construction_is_valid_or_clear_error(values, G, E):
    arr = np.array(values)
    P = (arr.size // G) * G
    if P == 0:
        return
    try:
        pl = Placement(arr[:P][None], E, Topology(G, P, 1))
    except ValueError as exc:
        assert str(exc)  # a message, not a bare exception
        return
    assert (pl.logical_replica_count >= 1).all()


# ---------------------------------------------------------------------------------------------
# file readers: corrupted, truncated, hostile
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def good_npz(tmp_path_factory):
    p = tmp_path_factory.mktemp("npz") / "good.npz"
    write_trace(
        synthetic_trace(num_tokens=300, num_layers=2, num_logical_experts=8, top_k=2, num_prompts=6), p
    )
    return p


@given(st.integers(0, 4000), st.binary(min_size=0, max_size=64))
def test_truncated_or_corrupted_npz_gives_clear_error(good_npz, tmp_path_factory, cut, junk):
    data = good_npz.read_bytes()
    bad = tmp_path_factory.mktemp("bad") / "bad.npz"
    cut = min(cut, len(data) - 1)
    bad.write_bytes(data[:cut] + junk)
    try:
        tr = read_trace(bad)
    except ValueError as exc:
        assert str(bad) in str(exc)
        return
    assert tr.num_tokens > 0  # a junk suffix after a complete archive may still read correctly


def test_pickled_object_arrays_are_never_loaded(tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    p = tmp_path / "evil.npz"
    np.savez(p, topk_ids=np.array([Evil()], dtype=object))
    with pytest.raises(InputFileError, match="pickle"):
        read_trace(p)
    assert not marker.exists()


def test_declared_size_checked_before_allocation(good_npz):
    with pytest.raises(InputFileError, match="over the"):
        load_npz(good_npz, max_bytes=100)


@pytest.mark.parametrize(
    "arrays, fragment",
    [
        ({"topk_ids": np.zeros((3, 2), dtype=np.float32)}, "must be integer"),
        ({"topk_ids": np.full((3, 1, 2), 9), "counts": np.zeros((1, 4))}, "must be in"),
        ({"counts": np.array(["a", "b"])}, "must be numeric"),
        ({"something": np.zeros(3)}, "not a routing trace"),
        ({"topk_ids": np.zeros((4, 1, 1), int), "segment": np.zeros(3)}, "'segment' has shape"),
        ({"schema": np.array("other/schema")}, "is not"),
    ],
)
def test_wrong_fields_named_in_errors(tmp_path, arrays, fragment):
    p = tmp_path / "x.npz"
    np.savez(p, **arrays)
    with pytest.raises(ValueError, match=fragment):
        read_trace(p)


# ---------------------------------------------------------------------------------------------
# atomic outputs
# ---------------------------------------------------------------------------------------------
def test_failed_write_leaves_existing_file(tmp_path):
    target = tmp_path / "out.json"
    target.write_text("precious")

    def boom():
        from moe_placement.base.fileio import atomic_write

        with atomic_write(target) as fh:
            fh.write(b"half")
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        boom()
    assert target.read_text() == "precious"
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]  # temp file removed


def test_write_killed_half_way_leaves_existing_file(tmp_path):
    target = tmp_path / "big.bin"
    target.write_bytes(b"old")
    script = (
        f"import sys, time; sys.path.insert(0, {str(ROOT)!r})\n"
        "from moe_placement.base.fileio import atomic_write\n"
        f"with atomic_write({str(target)!r}) as fh:\n"
        "    fh.write(b'x' * 1000000); fh.flush(); print('writing', flush=True); time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert target.read_bytes() == b"old"


# ---------------------------------------------------------------------------------------------
# CLI fuzz: every subcommand on bad inputs -> exit 2, one line, no traceback, outputs untouched
# ---------------------------------------------------------------------------------------------
def _bad_corpus(d: Path, good_npz: Path) -> list[Path]:
    files = {
        "empty.npz": b"",
        "random.npz": bytes(range(256)) * 3,
        "truncated.npz": good_npz.read_bytes()[:200],
        "bad.json": b'{"physical_to_logical_map": [[0, 1], [2',
        "wrongkeys.json": json.dumps({"hello": 1}).encode(),
        "badshape.json": json.dumps({"physical_to_logical_map": [[0, 1, 2], [0, 1]]}).encode(),
        "negative.json": json.dumps({"physical_to_logical_map": [[0, -5, 1, 2]]}).encode(),
        "garbage.yaml": b"num_slots: [unclosed\n  - : :",
        "python.yaml": b"!!python/object/apply:os.system ['echo pwned']\n",
        "notutf8.json": b"\xff\xfe\xfa",
        "deep.json": b"[" * 100000 + b"]" * 100000,
    }
    out = []
    for name, data in files.items():
        p = d / name
        p.write_bytes(data)
        out.append(p)
    return out


def test_cli_fuzz_bad_inputs(tmp_path, good_npz, capsys):
    corpus = _bad_corpus(tmp_path, good_npz)
    sentinel = tmp_path / "existing_output.json"
    commands = []
    for bad in corpus:
        commands += [
            ["inspect", str(bad)],
            ["solve", "--trace", str(bad), "--ep-size", "2", "-o", str(sentinel)],
            ["solve", "--load", str(bad), "--ep-size", "2", "-o", str(sentinel)],
            ["evaluate", str(bad), str(good_npz)],
            ["convert", str(bad), "-o", str(sentinel), "--format", "sglang", "--ep-size", "2"],
            ["convert", str(bad), "-o", str(sentinel), "--format", "trace"],
        ]
    for argv in commands:
        sentinel.write_text("keep me")
        rc = main(argv)
        err = capsys.readouterr().err
        assert rc == 2, (argv, err)
        assert err.count("\n") == 1 and err.startswith("moe-placement: error:"), (argv, err)
        assert "Traceback" not in err
        assert sentinel.read_text() == "keep me", argv
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert leftovers == []


def test_cli_subprocess_has_no_traceback(tmp_path):
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"PK\x03\x04garbage")
    r = subprocess.run(
        [sys.executable, "-m", "moe_placement", "inspect", str(bad)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.count("\n") == 1


# ---------------------------------------------------------------------------------------------
# resource bounds: chunked statistics for traces too large to load
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("compress", [True, False])
def test_stream_counts_equal_full_counts_with_bounded_chunks(tmp_path, compress):
    from moe_placement.base.fileio import atomic_save_npz, iter_npz_array_chunks
    from profiling.readers import stream_counts

    tr = synthetic_trace(
        num_tokens=2500, num_layers=3, num_logical_experts=16, top_k=2, num_prompts=20, seed=9
    )
    p = tmp_path / "t.npz"
    atomic_save_npz(p, compress=compress, topk_ids=np.asarray(tr.topk_ids))
    sizes = [c.shape[0] for c in iter_npz_array_chunks(p, "topk_ids", 300)]
    assert max(sizes) == 300 and sum(sizes) == 2500
    np.testing.assert_array_equal(stream_counts(p, 16, chunk_tokens=300), tr.counts())


def test_stream_counts_rejects_truncated_and_out_of_range(tmp_path):
    from profiling.readers import stream_counts

    p = tmp_path / "t.npz"
    np.savez(p, topk_ids=np.full((10, 1, 2), 7))
    with pytest.raises(InputFileError, match="outside"):
        stream_counts(p, 4)
    data = (tmp_path / "t.npz").read_bytes()
    (tmp_path / "cut.npz").write_bytes(data[: len(data) // 2])
    with pytest.raises(InputFileError):
        stream_counts(tmp_path / "cut.npz", 8)


# ---------------------------------------------------------------------------------------------
# topology sizes bounded by moe_placement.base.limits (issue 25)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "build, fragment",
    [
        (
            lambda: Topology(70_000, 70_000),
            "ep_size is 70000, outside the accepted range 1..65536 (MAX_RANKS",
        ),
        (lambda: Topology(1, 70_000), "num_physical_experts is 70000, outside the accepted range 1..65536"),
        (
            lambda: Topology(2, 4, 70_000),
            "num_nodes is 70000, outside the accepted range 1..65536 (MAX_RANKS",
        ),
        (lambda: Topology.from_redundant(65_000, 1_000, 1), "use at most 536 redundant experts"),
        (lambda: Topology.from_redundant(70_000, 0, 1), "num_logical_experts is 70000"),
        (lambda: Topology(0, 4), "ep_size must be >= 1, got 0"),
    ],
)
def test_topology_sizes_are_bounded_with_the_limit_named(build, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        build()


def test_topology_at_the_limits_is_accepted():
    from moe_placement.base.limits import MAX_EXPERTS, MAX_RANKS

    t = Topology(MAX_RANKS, MAX_EXPERTS, MAX_RANKS)
    assert t.slots_per_gpu == 1 and t.gpus_per_node == 1
    assert Topology.from_redundant(MAX_EXPERTS - 8, 8, 8).num_physical_experts == MAX_EXPERTS


# ---------------------------------------------------------------------------------------------
# issue 36: nothing routed has no balance (library metrics)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ids", [np.full((30, 2, 2), -1), np.zeros((0, 2, 2), dtype=np.int64)])
def test_metrics_refuse_a_trace_that_routes_nothing(ids):
    from placement.metrics import evaluate, par, step_par

    trace = RoutingTrace(8, topk_ids=ids)
    pl = Placement.trivial(2, 8, Topology(4, 8, 1))
    for call in (
        lambda: par(pl, trace),
        lambda: evaluate(pl, trace),
        lambda: evaluate(pl, trace, "balanced"),
        lambda: step_par(pl, trace, 4),
        lambda: par(pl, np.zeros((2, 8))),
    ):
        with pytest.raises(ValueError, match="0 tokens|every expert load is 0"):
            call()
    ok = ids.copy()
    if ok.shape[0]:
        ok[0, :, 0] = 3  # one routed pick: a defined (and valid) ratio
        assert par(pl, RoutingTrace(8, topk_ids=ok)) == pytest.approx(4.0)


# ---------------------------------------------------------------------------------------------
# issue 36: solver.api.solve refuses what it cannot place, naming the argument and the numbers
# ---------------------------------------------------------------------------------------------
def _api_trace():
    return synthetic_trace(num_tokens=200, num_layers=2, num_logical_experts=8, top_k=2)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"topology": None}, "topology must be a placement.topology.Topology, got NoneType"),
        ({"topology": {"ep_size": 4, "num_physical_experts": 8}}, "got dict"),
        ({"load": np.ones((3, 8))}, "the load is 3 layers x 8 experts but the trace is 2 layers x 8 experts"),
        ({"load": np.ones((2, 6))}, "the load is 2 layers x 6 experts but the trace is 2 layers x 8"),
        ({"trace": None, "load": np.zeros((2, 8))}, "every expert load is 0 (all 2 layers x 8 experts)"),
        ({"trace": None, "load": np.ones((0, 8))}, "got shape (0, 8)"),
        ({"trace": None, "load": "abc"}, "load must be numbers [layers, experts]"),
        ({"num_groups": 0}, "num_groups=0 must be >= 1 and divide the 8 experts"),
        ({"num_groups": -1}, "num_groups=-1"),
        ({"num_groups": 3}, "num_groups=3"),
        ({"num_groups": 2.5}, "num_groups must be an integer or None, got 2.5"),
        ({"num_groups": True}, "num_groups must be an integer"),
        ({"trace": "t.npz"}, "trace must be a profiling.trace.RoutingTrace, got str"),
        ({"previous": "p.json"}, "previous must be a Placement, got str"),
        ({"source_ranks": 3}, "source_ranks must be a spec string"),
    ],
)
def test_library_solve_refuses_bad_arguments_with_a_value_error(kwargs, fragment):
    from solver.api import solve

    args = {"topology": Topology.from_redundant(8, 0, 4), "trace": _api_trace(), **kwargs}
    with pytest.raises(ValueError) as info:
        solve("greedy", **args)
    assert fragment in str(info.value)


def test_library_solve_refuses_a_previous_placement_of_another_shape():
    from solver.api import solve

    topo = Topology.from_redundant(8, 0, 4)
    prev = Placement.trivial(3, 8, topo)
    with pytest.raises(
        ValueError, match="previous has 3 layers x 8 experts on 8 slots but the problem has 2 x 8"
    ):
        solve("migration", topology=topo, trace=_api_trace(), previous=prev, options={"max_moves": 2})
    ok = solve("migration", topology=topo, trace=_api_trace(), previous=Placement.trivial(2, 8, topo))
    assert ok.placement.num_layers == 2


def test_output_piped_to_a_reader_that_stops_early_is_silent(tmp_path):
    """``moe-placement inspect T | head -1``: no 'Broken pipe' error; exit 141 (128 + SIGPIPE)."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 4, (20, 3000, 1))  # 3,000 layers: the table is far over a pipe's buffer
    write_trace(RoutingTrace(4, topk_ids=ids), tmp_path / "wide.npz")
    for extra in ([], ["--json"]):
        proc = subprocess.Popen(
            [sys.executable, "-m", "moe_placement", "inspect", str(tmp_path / "wide.npz"), *extra],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert proc.stdout.readline()  # the first line, then the reader goes away
        proc.stdout.close()
        rc = proc.wait(timeout=60)
        err = proc.stderr.read().decode()
        assert rc == 141 and err == "", (rc, err)


def _lib_calls():
    """(name, call, fragment): library calls on odd input, each a ValueError/TypeError naming it."""
    import torch

    from placement.formats import write_placement
    from placement.metrics import route_tokens, step_par
    from placement.step_balance import balanced_quotas
    from runtime_hooks.step_balance import StepBalancer

    topo = Topology(4, 8, 1)
    pl = Placement.trivial(2, 8, topo)
    tr = synthetic_trace(num_tokens=100, num_layers=2, num_logical_experts=8, top_k=2, num_prompts=5)
    l2p = pl.logical_to_physical_map[0]
    huge = np.full(8, 2**60)
    return [
        (
            "provenance",
            lambda d: Placement(np.arange(8)[None], 8, topo, (0,), [1]),
            "provenance must be a mapping",
        ),
        ("topology", lambda d: Placement(np.arange(8)[None], 8, {"ep_size": 4}), "topology must be a"),
        ("trace rows", lambda d: tr.select_layers([5]), "outside this trace's rows 0..1"),
        ("placement rows", lambda d: pl.select_layers([7]), "outside this placement's rows 0..1"),
        ("placement to folder", lambda d: write_placement(pl, d), "it is a folder"),
        ("trace to folder", lambda d: write_trace(tr, d), "it is a folder"),
        ("write_trace type", lambda d: write_trace("t.npz", d / "t.npz"), "needs a RoutingTrace"),
        ("read_trace E", lambda d: read_trace(d / "t.npz", num_logical_experts=0), "positive integer, got 0"),
        (
            "step_par float",
            lambda d: step_par(pl, tr, 2.5),
            "step_tokens must be a positive integer (tokens per rank per step), got 2.5",
        ),
        ("route oob", lambda d: route_tokens(pl, np.full((5, 2, 2), 99), np.zeros(5, int)), "in [-1, 8)"),
        ("quotas huge", lambda d: balanced_quotas(huge, l2p, 2), "over 1099511627776 tokens in one step"),
        ("torch huge", lambda d: StepBalancer(l2p, 2).quotas(torch.from_numpy(huge)), "in one step (2**40)"),
    ]


@pytest.mark.parametrize("index", range(12))
def test_library_calls_on_odd_input_raise_a_clear_error(tmp_path, index):
    name, call, fragment = _lib_calls()[index]
    write_trace(
        synthetic_trace(num_tokens=50, num_layers=1, num_logical_experts=8, top_k=2, num_prompts=5),
        tmp_path / "t.npz",
    )
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises((ValueError, TypeError)) as info:
        call(tmp_path)
    assert fragment in str(info.value), (name, str(info.value))
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no temporary file left
