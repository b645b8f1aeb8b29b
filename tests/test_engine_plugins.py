"""The engine plugins (``runtime_hooks.engine_plugins``): specs, output conventions, determinism, and
(when the side environment with vLLM's and SGLang's own Python code exists) the plugins loaded
through each engine's own loader and called through each engine's own entry function.

The side environment: ``MOE_ENGINES_PYTHON`` or ``<repo>/.engines-venv/bin/python``. Our package is
not installed there; the test makes its entry points visible to ``importlib.metadata`` with a
throw-away ``.dist-info`` folder (built from ``pyproject.toml``) on ``PYTHONPATH``, so the engines'
loaders discover them exactly as they would an installed package, and nothing is installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from runtime_hooks.engine_plugins import sglang_plugin, vllm_plugin
from runtime_hooks.engine_plugins.policy import (
    EngineCall,
    PolicyError,
    check_map,
    exact_seconds,
    logical_maps,
    place,
)
from runtime_hooks.engine_plugins.spec import ACCEPTED, ENV_VAR, SpecError, parse_spec, spec_from_env

ROOT = Path(__file__).resolve().parents[1]

# DeepSeek EPLB's README example: 2 layers x 12 experts, 16 replicas, 4 groups, 2 nodes, 8 GPUs, and
# the map its hierarchical policy publishes for it (our greedy reproduces it slot for slot).
README_WEIGHT = np.array(
    [
        [90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
        [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
    ]
)
README_PHY2LOG = [
    [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
    [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1],
]


def _call(engine="vllm", load=README_WEIGHT, previous=None, P=16, G=8, N=2, groups=4) -> EngineCall:
    return EngineCall(engine, np.asarray(load), P, G, N, groups, previous)


def _skewed_load(seed: int, L: int = 6, E: int = 32) -> np.ndarray:
    return np.random.default_rng(seed).gamma(0.6, 500.0, (L, E)).round()


# ---------------------------------------------------------------------------------------------
# Specs
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, kind, time_limit, max_moves, path",
    [
        ("greedy", "greedy", 2.0, None, ""),
        ("greedy:time_limit=5", "greedy", 5.0, None, ""),
        (" exact ", "exact", 2.0, None, ""),
        ("exact:time_limit=0.5", "exact", 0.5, None, ""),
        ("migration", "migration", 2.0, None, ""),
        ("migration:max_moves=64", "migration", 2.0, 64, ""),
        ("migration:max_moves=8,time_limit=3", "migration", 3.0, 8, ""),
        ("file:/tmp/a:b.json", "file", 2.0, None, "/tmp/a:b.json"),
    ],
)
def test_parse_spec(text, kind, time_limit, max_moves, path):
    spec = parse_spec(text)
    assert (spec.kind, spec.time_limit, spec.max_moves, spec.path) == (kind, time_limit, max_moves, path)


@pytest.mark.parametrize(
    "text, says",
    [
        ("bogus", "unknown policy 'bogus'"),
        ("greedy:max_moves=1", "greedy takes time_limit"),
        ("exact:time_limit=-1", "time_limit must be > 0"),
        ("exact:time_limit=abc", "time_limit must be a number"),
        ("exact:max_moves=3", "exact takes time_limit"),
        ("migration:max_moves=-2", "max_moves must be >= 0"),
        ("migration:max_moves", "migration takes max_moves, time_limit"),
        ("file:", "file: needs a path"),
        ("locality", "per-token routing"),
    ],
)
def test_bad_spec_is_one_line_naming_the_accepted_specs(text, says):
    with pytest.raises(SpecError) as err:
        parse_spec(text)
    msg = str(err.value)
    assert says in msg and ACCEPTED in msg and ENV_VAR in msg and "\n" not in msg


def test_unset_or_empty_means_no_policy():
    assert spec_from_env({}) is None and spec_from_env({ENV_VAR: "  "}) is None
    assert spec_from_env({ENV_VAR: "greedy"}).kind == "greedy"


def test_register_does_nothing_when_unset(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    for mod in ("vllm", "sglang"):  # neither engine is installed here: importing one would fail
        monkeypatch.setitem(sys.modules, mod, None)
    vllm_plugin.register()
    sglang_plugin.register()


def test_register_refuses_a_bad_spec_at_start(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "exact:time_limit=zero")
    with pytest.raises(SpecError, match="accepted specs"):
        vllm_plugin.register()
    with pytest.raises(SystemExit, match="accepted specs"):  # SGLang swallows a plugin's exceptions
        sglang_plugin.register()


def test_plugins_import_no_solver_stack():
    code = (
        "import sys, runtime_hooks.engine_plugins.vllm_plugin, runtime_hooks.engine_plugins.sglang_plugin\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('ortools', 'networkx', 'scipy', 'solver', 'torch')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


# ---------------------------------------------------------------------------------------------
# Output conventions (no engine needed)
# ---------------------------------------------------------------------------------------------
def test_greedy_reproduces_the_published_example():
    phy2log = place(parse_spec("greedy"), _call())
    assert phy2log.dtype == np.int64 and phy2log.tolist() == README_PHY2LOG


@pytest.mark.parametrize("text", ["greedy", "exact:time_limit=1", "migration", "migration:max_moves=4"])
def test_maps_follow_the_engines_conventions(text):
    load = _skewed_load(1)
    first = place(parse_spec("greedy"), _call(load=load, P=48, G=8, N=2, groups=4))
    shifted = load[:, ::-1].copy()  # a domain shift: hot experts become cold
    phy2log = place(parse_spec(text), _call(load=shifted, previous=first, P=48, G=8, N=2, groups=4))
    check_map(phy2log, 32, 48, 8, 6)
    log2phy, logcnt = logical_maps(phy2log, 32)
    assert log2phy.dtype == np.int64 and logcnt.dtype == np.int64
    assert log2phy.shape == (6, 32, int(logcnt.max())) and (logcnt.sum(axis=1) == 48).all()
    valid = log2phy >= 0
    assert (valid.sum(axis=2) == logcnt).all()
    assert (valid[:, :, :-1] >= valid[:, :, 1:]).all()  # -1 only as padding at the end
    both = valid[:, :, :-1] & valid[:, :, 1:]
    assert (np.diff(log2phy, axis=2)[both] > 0).all()  # slots ascending
    if text == "migration:max_moves=4":
        on_gpu = lambda m: {(l, p // 6, int(m[l, p])) for l in range(6) for p in range(48)}  # noqa: E731
        assert len(on_gpu(phy2log) - on_gpu(first)) <= 4


def test_greedy_keeps_slots_of_experts_that_stay():
    load = _skewed_load(2)
    first = place(parse_spec("greedy"), _call(load=load, P=48, G=8, N=2, groups=4))
    again = place(parse_spec("greedy"), _call(load=load, previous=first, P=48, G=8, N=2, groups=4))
    assert (again == first).all()


def test_invalid_previous_map_is_ignored():
    prev = np.full((2, 16), -1, dtype=np.int64)  # vLLM marks empty slots -1 (elastic EP)
    phy2log = place(parse_spec("migration"), _call(previous=prev))
    assert phy2log.tolist() == README_PHY2LOG


def test_file_spec_returns_the_file_map(tmp_path):
    from placement.formats import write_placement
    from placement.model import Placement
    from placement.topology import Topology

    mapping = np.array(README_PHY2LOG)[:, ::-1].copy()
    path = tmp_path / "placement.json"
    write_placement(Placement(mapping, 12, Topology(8, 16, 2)), path, "native")
    assert (place(parse_spec(f"file:{path}"), _call()) == mapping).all()
    with pytest.raises(PolicyError, match="layers"):
        place(parse_spec(f"file:{path}"), _call(load=np.ones((3, 12))))


def test_check_map_names_what_is_wrong():
    good = np.array(README_PHY2LOG)
    with pytest.raises(PolicyError, match="int64"):
        check_map(good.astype(np.int32), 12, 16, 8, 2)
    bad = good.copy()
    bad[0, 1] = 5  # GPU 0 now holds expert 5 twice, expert 6 nowhere
    with pytest.raises(PolicyError, match="no replica"):
        check_map(bad, 12, 16, 8, 2)
    bad[0, 14] = 6  # expert 6 back, expert 11 lost
    with pytest.raises(PolicyError, match="no replica"):
        check_map(bad, 12, 16, 8, 2)


def test_failures_fall_back_to_the_engine_default():
    torch = pytest.importorskip("torch")

    class EngineDefault:
        @classmethod
        def rebalance_experts(cls, weight, num_replicas, num_groups, num_nodes, num_ranks, old=None):
            return "engine default"

    policy = vllm_plugin.policy_class(parse_spec("file:/nonexistent/map.json"), EngineDefault)
    weight = torch.from_numpy(README_WEIGHT.astype(np.int32))
    assert issubclass(policy, EngineDefault)
    assert policy.rebalance_experts(weight, 16, 4, 2, 8, None) == "engine default"
    ours = vllm_plugin.policy_class(parse_spec("greedy"), EngineDefault).rebalance_experts(
        weight, 16, 4, 2, 8
    )
    assert ours.dtype == torch.int64 and ours.tolist() == README_PHY2LOG

    class Algorithm:
        name = "deepseek_hierarchical"

    hook = sglang_plugin.make_hook(parse_spec("file:/nonexistent/map.json"))
    args = dict(num_physical_experts=16, num_local_physical_experts=2, num_groups=4, num_nodes=2)
    assert hook(
        lambda **kw: "engine default", tokens_per_expert=weight[None], algorithm=Algorithm, **args
    ) == ("engine default")
    phy2log, log2phy, logcnt = sglang_plugin.make_hook(parse_spec("greedy"))(
        None, tokens_per_expert=weight[None], algorithm=Algorithm, **args
    )
    fitted = place(parse_spec("greedy"), _call(engine="sglang"))  # greedy placed for SGLang's table
    assert phy2log.tolist() == fitted.tolist() and log2phy.shape[:2] == (2, 12) and logcnt.sum() == 32


# ---------------------------------------------------------------------------------------------
# Determinism: byte-identical maps across processes and thread counts
# ---------------------------------------------------------------------------------------------
_SOLVE_SNIPPET = """
import sys, hashlib, numpy as np
from runtime_hooks.engine_plugins.policy import EngineCall, place
from runtime_hooks.engine_plugins.spec import parse_spec
engine = sys.argv[2]
load = np.random.default_rng(7).gamma(0.6, 500.0, (6, 32)).round()
prev = place(parse_spec("greedy"), EngineCall(engine, load, 48, 8, 2, 4, None))
out = place(parse_spec(sys.argv[1]), EngineCall(engine, load[:, ::-1].copy(), 48, 8, 2, 4, prev))
print(hashlib.sha256(out.tobytes()).hexdigest())
"""


@pytest.mark.parametrize(
    "text, engine",
    [
        ("greedy", "vllm"),
        ("migration:max_moves=16", "vllm"),
        ("exact:time_limit=1", "vllm"),
        ("greedy", "sglang"),  # fitted for SGLang's static table: its draws replayed in every process
        ("exact:time_limit=1", "sglang"),
    ],
)
def test_same_map_in_every_process_and_thread_count(text, engine):
    digests = set()
    for threads in ("1", "2"):
        env = {**os.environ, "OMP_NUM_THREADS": threads, "OPENBLAS_NUM_THREADS": threads}
        env["MKL_NUM_THREADS"] = threads
        env["PYTHONHASHSEED"] = threads  # dict and set order must not matter either
        run = subprocess.run(
            [sys.executable, "-c", _SOLVE_SNIPPET, text, engine],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
        )
        assert run.returncode == 0, run.stderr
        digests.add(run.stdout.strip())
    assert len(digests) == 1, digests


# ---------------------------------------------------------------------------------------------
# Inside the engines' own code (side environment)
# ---------------------------------------------------------------------------------------------
def _engines_python() -> Path:
    given = os.environ.get("MOE_ENGINES_PYTHON")
    path = Path(given) if given else ROOT / ".engines-venv" / "bin" / "python"
    if not path.exists():
        pytest.skip(ENGINES_SKIP)
    return path


# the same on every machine: no path of this one (issue 36)
ENGINES_SKIP = (
    "no engines environment: set MOE_ENGINES_PYTHON to a Python with vLLM's and SGLang's code, or "
    "build .engines-venv in the repository root (docs/serving.md)"
)


def test_the_skip_reason_names_no_machine_path(monkeypatch):
    monkeypatch.setenv("MOE_ENGINES_PYTHON", str(ROOT / "no-such-dir" / "python"))
    with pytest.raises(pytest.skip.Exception) as skipped:
        _engines_python()
    assert str(skipped.value) == ENGINES_SKIP and str(ROOT) not in str(skipped.value)


def _entry_points_dir(tmp_path: Path) -> Path:
    """A folder whose ``.dist-info`` declares our entry points exactly as ``pyproject.toml`` does."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    info = tmp_path / "site" / "moe_placement_plugins-0.0.0.dist-info"
    info.mkdir(parents=True)
    info.joinpath("METADATA").write_text(
        "Metadata-Version: 2.1\nName: moe-placement-plugins\nVersion: 0.0.0\n"
    )
    lines = []
    for group in ("vllm.general_plugins", "sglang.srt.plugins"):
        lines.append(f"[{group}]")
        lines += [f"{name} = {value}" for name, value in project["entry-points"][group].items()]
    info.joinpath("entry_points.txt").write_text("\n".join(lines) + "\n")
    return info.parent


_ENGINE_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import numpy as np, torch
    from placement.formats import write_placement
    from placement.model import Placement
    from placement.topology import Topology
    from runtime_hooks.engine_plugins.policy import EngineCall, check_map, place
    from runtime_hooks.engine_plugins.spec import parse_spec

    engine, workdir = sys.argv[1], sys.argv[2]
    L, E, P, G, N, GROUPS = 4, 16, 24, 8, 2, 4
    load = np.random.default_rng(3).gamma(0.6, 500.0, (L, E)).round()
    weight = torch.from_numpy(load.astype(np.int32))  # vLLM: int32 [L, E] on CPU
    file_map = np.tile(np.arange(P) % E, (L, 1))
    file_path = os.path.join(workdir, "placement.json")
    write_placement(Placement(file_map, E, Topology(G, P, N)), file_path, "native")
    out = {}

    def checked(phy2log):
        assert phy2log.dtype == torch.int64 and phy2log.device.type == "cpu", (phy2log.dtype, phy2log.device)
        check_map(phy2log.numpy(), E, P, G, L)
        return phy2log.numpy()

    if engine == "vllm":
        from tests.engine_loaders import vllm_loader

        load_with, eplb = vllm_loader()
        out["unset_untouched"] = load_with(None) is eplb.DefaultEplbPolicy
        default_map = eplb.DefaultEplbPolicy.rebalance_experts(weight, P, GROUPS, N, G, None)
        kept = load_with("migration").rebalance_experts(weight, P, GROUPS, N, G, default_map)
        # the same load again: a move does not pay, so vLLM's map stays, its co-located copies repaired
        # with one moved slot each
        per_gpu = default_map.numpy().reshape(L, G, P // G)
        extra = sum(P // G - len(set(gpu.tolist())) for layer in per_gpu for gpu in layer)
        out["kept"] = int((checked(kept) != default_map.numpy()).sum()) == extra
        ours = load_with("migration:always=1")
        out["ours_installed"] = ours is not eplb.DefaultEplbPolicy and issubclass(ours, eplb.AbstractEplbPolicy)
        first = checked(ours.rebalance_experts(weight, P, GROUPS, N, G, default_map))
        again = checked(ours.rebalance_experts(weight, P, GROUPS, N, G, default_map))
        out["repeatable"] = bool((first == again).all())
        call = EngineCall("vllm", load, P, G, N, GROUPS, default_map.numpy())
        out["ours_equals_policy"] = bool((first == place(parse_spec("migration:always=1"), call)).all())
        out["file_map"] = bool((checked(load_with("file:" + file_path).rebalance_experts(weight, P, GROUPS, N, G, None)) == file_map).all())
        try:
            load_with("bogus")
            out["bad_spec"] = "accepted"
        except ValueError as exc:
            out["bad_spec"] = str(exc)
    else:
        from tests.engine_loaders import sglang_loader

        load_with, algos, keep = sglang_loader()
        tokens = torch.from_numpy(load.astype(np.int64))[None]  # [W=1, L, E]
        algorithm = algos.compute_algorithm("auto", GROUPS, N)
        kw = dict(tokens_per_expert=tokens, num_physical_experts=P, num_local_physical_experts=P // G,
                  num_groups=GROUPS, num_nodes=N, algorithm=algorithm)
        out["unset_untouched"] = load_with(None) is keep["original"]
        d_phy, d_log2phy, d_cnt = keep["original"](**kw)
        fn = load_with("migration")
        out["ours_installed"] = fn is not keep["original"]
        call = EngineCall("sglang", load, P, G, N, GROUPS, None)
        out["ours_equals_policy"] = bool((fn(**kw)[0].numpy() == place(parse_spec("migration"), call)).all())
        runs = [fn(**kw) for _ in range(2)]
        for phy2log, log2phy, logcnt in runs:
            checked(phy2log)
            assert log2phy.dtype == torch.int64 and logcnt.dtype == torch.int64
            assert log2phy.shape[:2] == d_log2phy.shape[:2] and logcnt.shape == d_cnt.shape
            assert (logcnt.sum(dim=1) == P).all() and ((log2phy >= 0).sum(dim=2) == logcnt).all()
        out["repeatable"] = all(bool((a == b).all()) for a, b in zip(runs[0], runs[1]))
        out["file_map"] = bool((checked(load_with("file:" + file_path)(**kw)[0]).__eq__(file_map)).all())
        try:
            load_with("bogus")
            out["bad_spec"] = "accepted"
        except SystemExit as exc:
            out["bad_spec"] = str(exc)
    print("RESULT " + json.dumps(out))
    """
)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_plugin_through_the_engine_loader(engine, tmp_path):
    python = _engines_python()
    site = _entry_points_dir(tmp_path)
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{ROOT}"}
    env.pop(ENV_VAR, None)
    run = subprocess.run(
        [str(python), "-c", _ENGINE_SCRIPT, engine, str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT ") :])
    assert out == {**out, "unset_untouched": True, "ours_installed": True, "ours_equals_policy": True}
    assert out["repeatable"] and out["file_map"] and out.get("kept", True)
    assert "accepted specs" in out["bad_spec"] and "\n" not in out["bad_spec"]


@pytest.mark.parametrize("text", ["greedy", "exact:time_limit=1"])
def test_sglang_maps_are_fitted_for_its_table(text):
    from placement.metrics import rank_gpu_load
    from placement.model import Placement
    from placement.topology import Topology
    from solver.dispatch_fit import even_rank_counts

    load = _skewed_load(5)
    kw = dict(load=load, P=48, G=8, N=2, groups=None)  # global: hierarchical calls are tested below
    unfitted = place(parse_spec(text), _call(engine="vllm", **kw))  # vLLM: no table, same solve
    fitted = place(parse_spec(text), _call(engine="sglang", **kw))
    check_map(fitted, 32, 48, 8, 6)
    topo = Topology(8, 48, 2)
    counts = even_rank_counts(load, 8)  # [L, G, E]: the engine's counts split evenly over the ranks
    peak = lambda m: rank_gpu_load(Placement(m, 32, topo), counts, "sglang-static").max(axis=1).sum()  # noqa: E731
    assert peak(fitted) < peak(unfitted)  # SGLang's table sends less to the busiest GPU
    assert (np.sort(fitted, axis=1) == np.sort(unfitted, axis=1)).all()  # replica counts kept


def test_fit_budget_comes_from_the_shapes():
    from runtime_hooks.engine_plugins.policy import fit_options

    assert fit_options(2.0, 6, 32, 8).steps == 60  # small: the full search
    assert not fit_options(2.0, 61, 256, 32).enabled  # DeepSeek-V3 on 32 ranks: over a 2 s budget
    assert 0 < fit_options(20.0, 61, 256, 32).steps < 60


def test_migration_budget_is_work_not_wall_time(monkeypatch):
    from runtime_hooks.engine_plugins import policy

    load = _skewed_load(5, L=8, E=64)
    first = place(parse_spec("greedy"), _call(load=load, P=96, G=16, N=2, groups=8))
    shifted = _skewed_load(6, L=8, E=64)
    call = _call(load=shifted, previous=first, P=96, G=16, N=2, groups=8)
    monkeypatch.setattr(policy, "MIGRATION_STEPS_PER_S", 1_000_000)  # a budget that cuts the search
    maps = {place(parse_spec(f"migration:time_limit={s}"), call).tobytes() for s in (1, 1)}
    monkeypatch.setattr(policy, "MIGRATION_SAFETY_CAP", 1000.0)  # a different wall cap, same steps
    maps.add(place(parse_spec("migration:time_limit=1"), call).tobytes())
    assert len(maps) == 1
    assert policy.migration_steps(2.0) == 2 * policy.MIGRATION_STEPS_PER_S


def test_exact_declines_a_call_it_cannot_finish_within_its_budget():
    # DeepSeek-V3 shape: 58 layers x 256 experts take tens of seconds, far over the 2 s default, so the
    # policy refuses (and the hooks then run the engine's own algorithm); the decision needs only shapes
    load = np.ones((58, 256))
    call = EngineCall("vllm", load, 288, 32, 4, 8, None)
    with pytest.raises(PolicyError, match="over its 2 s budget"):
        place(parse_spec("exact"), call)
    assert exact_seconds(58, 256) > 2 >= exact_seconds(6, 32)


# ---------------------------------------------------------------------------------------------
# From any map in service (issue 26), the rebalance rule, validation of every call (issue 25)
# ---------------------------------------------------------------------------------------------
def _colocated(load: np.ndarray, P: int = 48, G: int = 8, copies: int = 1) -> np.ndarray:
    """Greedy's map with ``copies`` extra copies per layer written over another slot of the same GPU
    (an expert that keeps another replica loses that slot): an engine-style map, int64 ``[L, P]``."""
    rows = place(parse_spec("greedy"), EngineCall("vllm", load, P, G, 2, None, None)).copy()
    S = P // G
    for row in rows:
        done = 0
        for g in range(G):
            a, b = row[g * S], row[g * S + 1]
            if done < copies and a != b and (row == b).sum() >= 2:
                row[g * S + 1], done = a, done + 1
        assert done == copies
    return rows


def _shifted(seed: int = 3) -> tuple[np.ndarray, np.ndarray]:
    old = _skewed_load(seed) * 50
    return old, old[:, np.random.default_rng(seed + 1).permutation(old.shape[1])]  # a domain shift


def test_migration_starts_from_a_colocated_map_and_max_moves_is_a_hard_cap():
    old, new = _shifted()
    prev = _colocated(old, copies=2)  # 2 extra copies per layer: a repair of 12 slots in 6 layers
    call = EngineCall("vllm", new, 48, 8, 2, None, prev)
    fresh = place(parse_spec("migration:always=1"), EngineCall("vllm", new, 48, 8, 2, None, None))
    free = place(parse_spec("migration:always=1"), call)
    assert 12 <= (free != prev).sum() < (fresh != prev).sum()  # from the map in service, not from scratch
    for M in (12, 40, 100):
        out = place(parse_spec(f"migration:max_moves={M},always=1"), call)
        assert (out != prev).sum() <= M
        check_map(out, 32, 48, 8, 6)  # the co-located copies are repaired
    with pytest.raises(ValueError, match="max_moves=11"):
        place(parse_spec("migration:max_moves=11,always=1"), call)


def test_a_repair_over_the_budget_falls_back_to_the_engine_with_a_reason(caplog):
    torch = pytest.importorskip("torch")
    old, new = _shifted()
    prev = _colocated(old, copies=2)

    class EngineDefault:
        @classmethod
        def rebalance_experts(cls, weight, num_replicas, num_groups, num_nodes, num_ranks, old=None):
            return "engine default"

    policy = vllm_plugin.policy_class(parse_spec("migration:max_moves=5"), EngineDefault)
    weight = torch.from_numpy(new.astype(np.int32))
    with caplog.at_level("WARNING"):
        assert policy.rebalance_experts(weight, 48, 1, 2, 8, torch.from_numpy(prev)) == "engine default"
    assert "needs at least 12 moved slot" in caplog.text and "max_moves=5" in caplog.text


def test_a_rebalance_that_does_not_pay_keeps_the_map_in_service(caplog):
    old, new = _shifted()
    prev = _colocated(old)
    call = EngineCall("vllm", new / 1000, 48, 8, 2, None, prev)  # a tiny window: no gain pays a copy
    with caplog.at_level("INFO"):
        kept = place(parse_spec("migration"), call)
    # kept, its one co-located copy per layer repaired with one moved slot each (issue 36)
    assert kept.dtype == np.int64 and (kept != prev).sum(axis=1).tolist() == [1] * 6
    check_map(kept, 32, 48, 8, 6)
    assert "map in service kept (does not pay: gain" in caplog.text and "arrived experts" in caplog.text
    assert "6 co-located replica(s) repaired" in caplog.text
    moved = place(parse_spec("migration:always=1"), call)
    assert (moved != prev).any()
    big = EngineCall("vllm", new * 1000, 48, 8, 2, None, prev)  # a heavy window pays for the same copy
    assert (place(parse_spec("migration"), big) != prev).any()


@pytest.mark.parametrize(
    "call, says",
    [
        (EngineCall("vllm", README_WEIGHT, 17, 8, 2, 4, None), "do not divide over 8 GPUs"),
        (EngineCall("vllm", README_WEIGHT, 16, 0, 2, 4, None), "num_ranks"),
        (EngineCall("vllm", np.ones(12), 16, 8, 2, 4, None), "layers, experts"),
        (EngineCall("vllm", README_WEIGHT * np.nan, 16, 8, 2, 4, None), "finite"),
        (EngineCall("vllm", np.ones((2, 20)), 16, 8, 2, 4, None), "do not fit"),
        (EngineCall("vllm", README_WEIGHT, 16, 8, 2, 1.5, None), "num_groups"),
    ],
)
def test_calls_are_validated_first(call, says):
    with pytest.raises(PolicyError, match=says):
        place(parse_spec("greedy"), call)


def test_file_loads_are_bounded(tmp_path, monkeypatch):
    from runtime_hooks.engine_plugins import policy

    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    with pytest.raises(PolicyError, match="not a regular file"):  # would block on open
        place(parse_spec(f"file:{fifo}"), _call())
    with pytest.raises(PolicyError, match="not a regular file"):
        place(parse_spec(f"file:{tmp_path}"), _call())
    big = tmp_path / "bomb.yaml"
    big.write_text("a: &a [x, x, x, x, x, x, x, x, x]\n" * 64)
    monkeypatch.setattr(policy, "MAX_FILE_BYTES", 1024)
    with pytest.raises(PolicyError, match="over the 1024-byte cap"):
        place(parse_spec(f"file:{big}"), _call())


def test_sglang_calls_it_cannot_answer_go_to_sglang_with_a_reason(caplog):
    torch = pytest.importorskip("torch")
    weight = torch.from_numpy(README_WEIGHT.astype(np.int32))[None]
    seen = []

    def original(**kw):
        seen.append(kw["algorithm"])
        return "engine"

    class Unknown:
        name = "deepseek_next"

    class Ours:
        name = "deepseek"

    hook = sglang_plugin.make_hook(parse_spec("greedy"))
    args = dict(tokens_per_expert=weight, num_groups=4, num_nodes=2)
    with caplog.at_level("INFO"):
        assert hook(original, num_physical_experts=16, num_local_physical_experts=2, algorithm=None, **args)
        assert hook(
            original, num_physical_experts=16, num_local_physical_experts=2, algorithm=Unknown, **args
        )
        assert hook(original, num_physical_experts=16, num_local_physical_experts=3, algorithm=Ours, **args)
    assert "algorithm=None" in caplog.text and "unknown EPLB algorithm 'deepseek_next'" in caplog.text
    assert "16 physical slots do not divide into 3" in caplog.text
    assert seen[1:] == [Unknown, Ours]  # None became SGLang's own choice where SGLang is there


def test_fallback_reasons_are_never_empty(caplog):
    pytest.importorskip("torch")
    from runtime_hooks.engine_plugins.spec import failure_reason

    assert failure_reason(KeyError()) == "KeyError (no message)"
    assert failure_reason(ValueError("a\nb")) == "ValueError: a b"

    class EngineDefault:
        @classmethod
        def rebalance_experts(cls, *args):
            return "engine default"

    policy = vllm_plugin.policy_class(parse_spec("greedy"), EngineDefault)
    with caplog.at_level("WARNING"):
        assert policy.rebalance_experts(object(), 16, 4, 2, 8, None) == "engine default"
    assert "failed (AttributeError" in caplog.text and "()" not in caplog.text


@pytest.mark.parametrize("text", ["greedy", "exact:time_limit=1", "migration", "migration:max_moves=8"])
def test_no_signal_handler_is_installed(text, monkeypatch):
    torch = pytest.importorskip("torch")
    import signal

    calls = []
    monkeypatch.setattr(signal, "signal", lambda *args: calls.append(args))  # recorded, not raised:
    old, new = _shifted()  # the hooks catch every exception
    prev = place(parse_spec("greedy"), EngineCall("vllm", old, 48, 8, 2, None, None))

    class EngineDefault:
        @classmethod
        def rebalance_experts(cls, *args):
            return "engine default"

    class Algorithm:
        name = "deepseek"

    weight = torch.from_numpy(new.astype(np.int32))
    vllm_plugin.policy_class(parse_spec(text), EngineDefault).rebalance_experts(
        weight, 48, 1, 2, 8, torch.from_numpy(prev)
    )
    sglang_plugin.make_hook(parse_spec(text))(
        lambda **kw: "engine",
        tokens_per_expert=weight[None],
        num_physical_experts=48,
        num_local_physical_experts=6,
        num_groups=None,
        num_nodes=2,
        algorithm=Algorithm,
    )
    assert calls == []


def test_rule_options_parse():
    spec = parse_spec("migration:max_moves=9,always=1,horizon=3,stall=0.2,expert_bytes=1e6")
    assert (spec.max_moves, spec.always, spec.horizon, spec.stall, spec.expert_bytes) == (
        9,
        True,
        3,
        0.2,
        1e6,
    )
    for bad in ("greedy:always=2", "migration:stall=1.5", "exact:horizon=0"):
        with pytest.raises(SpecError, match="must be"):
            parse_spec(bad)


# ---------------------------------------------------------------------------------------------
# Hierarchical calls, kept maps, the file cache (issue 36)
# ---------------------------------------------------------------------------------------------
# (load [L, E], P, G, N, groups): DeepSeek EPLB's README example; vLLM's test_additional_cases #1
# (16 experts in 8 groups, 24 slots on 8 GPUs over 4 nodes); a skewed load
VLLM_CASE_1 = np.array([[50, 100, 75, 120, 90, 60, 80, 110, 40, 70, 95, 85, 65, 55, 45, 35]])
HIERARCHICAL = [(README_WEIGHT, 16, 8, 2, 4), (VLLM_CASE_1, 24, 8, 4, 8), (_skewed_load(7), 48, 8, 2, 4)]


def _split_groups(phy2log: np.ndarray, E: int, groups: int, G: int, P: int, N: int) -> int:
    """Groups (over all layers) whose replicas sit on more than one node."""
    from placement.topology import Topology
    from solver.greedy import group_nodes

    return int((group_nodes(phy2log, E, groups, Topology(G, P, N)) < 0).sum())


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("text", ["greedy", "exact:time_limit=1", "migration:always=1"])
def test_hierarchical_calls_keep_every_group_on_one_node(engine, text):
    for load, P, G, N, groups in HIERARCHICAL:
        E = load.shape[1]
        fresh = place(parse_spec(text), EngineCall(engine, load, P, G, N, groups, None))
        assert _split_groups(fresh, E, groups, G, P, N) == 0, (load.shape, P)
        shifted = load[:, ::-1].copy()  # from that map in service, a domain shift
        again = place(parse_spec(text), EngineCall(engine, shifted, P, G, N, groups, fresh))
        assert _split_groups(again, E, groups, G, P, N) == 0, (load.shape, P)


def test_migration_with_a_budget_keeps_groups_on_nodes_or_refuses():
    load, P, G, N, groups = HIERARCHICAL[2]
    first = place(parse_spec("greedy"), EngineCall("vllm", load, P, G, N, groups, None))
    shifted = load[:, ::-1].copy()
    for budget in (4, 40, 400):
        try:
            out = place(
                parse_spec(f"migration:max_moves={budget},always=1"),
                _call(load=shifted, previous=first, P=P, G=G, N=N),
            )
        except PolicyError as exc:  # the engine's own (hierarchical) algorithm then answers
            assert "max_moves" in str(exc)
            continue
        assert _split_groups(out, 32, groups, G, P, N) == 0 and (out != first).sum() <= budget


def test_check_groups_refuses_a_split_group():
    from placement.topology import Topology
    from runtime_hooks.engine_plugins.policy import check_groups

    split = np.array(README_PHY2LOG)
    split[0, [0, 15]] = split[0, [15, 0]]  # expert 5 (group 1) to node 1, expert 1 (group 0) to node 0
    check_map(split, 12, 16, 8, 2)  # a valid map otherwise
    with pytest.raises(PolicyError, match="layer 0: an expert group spans two nodes"):
        check_groups(split, 12, 4, Topology(8, 16, 2))
    check_groups(split, 12, None, Topology(8, 16, 2))  # a global call: nothing to keep


def _copied_rows(row: np.ndarray, load: np.ndarray, G: int, N: int):
    """``row [P]`` with one GPU's slot ``s > 0`` overwritten by its first (no expert left without a
    replica), for each (GPU, slot) where the hottest expert per replica the GPU lacks sits on another
    node first, then the others (``[P]`` rows)."""
    P = row.size
    S = P // G
    cross, local = [], []
    for g, s in ((g, s) for g in range(G) for s in range(1, S)):
        trial = row.copy()
        trial[g * S + s] = trial[g * S]
        cnt = np.bincount(trial, minlength=load.size)
        if cnt.min() == 0:
            continue
        score = np.where(np.isin(np.arange(load.size), trial[g * S : (g + 1) * S]), -np.inf, load / cnt)
        hot_node = int(np.flatnonzero(trial == np.argmax(score))[0]) // (P // N)
        (cross if hot_node != g // (G // N) else local).append(trial)
    return cross + local


def test_a_kept_map_is_repaired_inside_each_groups_node(caplog):
    from placement.model import Placement
    from placement.topology import Topology
    from solver.migration.slots import repair_colocated

    load, P, G, N, groups = HIERARCHICAL[2]
    prev = place(parse_spec("greedy"), EngineCall("vllm", load, P, G, N, groups, None)).copy()
    for l in range(6):  # one GPU holds its first expert twice (vLLM's maps do such things), one
        # where a repair blind to groups would take an expert of another node's group
        prev[l] = _copied_rows(prev[l], load[l], G, N)[0]
    call = EngineCall("vllm", load / 1000, P, G, N, groups, prev)  # a tiny window: nothing pays
    with caplog.at_level("INFO"):
        kept = place(parse_spec("migration"), call)
    check_map(kept, 32, P, G, 6)
    assert (kept != prev).sum(axis=1).tolist() == [1] * 6  # one slot per layer
    assert _split_groups(kept, 32, groups, G, P, N) == 0
    assert "6 co-located replica(s) repaired" in caplog.text
    # the repair blind to groups takes the hottest expert the GPU lacks, wherever its group lives
    topo = Topology(G, P, N)
    blind = repair_colocated(Placement(prev, 32, topo, allow_colocated_replicas=True), load / 1000)[0]
    assert _split_groups(blind.physical_to_logical_map, 32, groups, G, P, N) > 0


def test_the_file_cache_is_bounded(tmp_path):
    from placement.formats import write_placement
    from placement.model import Placement
    from placement.topology import Topology
    from runtime_hooks.engine_plugins import policy

    path = tmp_path / "placement.json"
    policy._FILE_CACHE.clear()
    base = np.array(README_PHY2LOG)
    for version in range(3 * policy.FILE_CACHE_ENTRIES):  # the served file rewritten again and again
        mapping = np.roll(base, version, axis=1)
        write_placement(Placement(mapping, 12, Topology(8, 16, 2)), path, "native")
        os.utime(path, ns=(version * 10**9, version * 10**9))  # a new version even within a clock tick
        assert (place(parse_spec(f"file:{path}"), _call()) == mapping).all()
        assert len(policy._FILE_CACHE) == min(version + 1, policy.FILE_CACHE_ENTRIES)
