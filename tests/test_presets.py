"""Model and hardware presets are checked field by field, and small inputs cannot ask for unbounded work.

Library: every bad value kind of a :class:`ModelSpec`, :class:`GpuSpec`, :class:`LinkSpec` or
:class:`ClusterSpec` field (zero, negative, NaN, infinite, string, boolean, list, huge) is a ValueError
naming the file and the field. CLI (``layout``, ``advise``): exit 2, one stderr line, nothing written.
Sizes that would allocate or run without bound are refused before any work, within seconds.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest

from placement.cost.fields import check_fields
from placement.cost.hardware import GPU_PRESET_KEYS, GPUS, LINKS, ClusterSpec, cluster_preset, load_gpu_preset
from placement.cost.modelspec import ModelSpec, check_hf_config_fits, load_model, model_from_hf_config

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "placement" / "cost" / "models"
BAD_NUMBERS = [0, -1, math.nan, math.inf, "8", True, [1], 1e300, 10**400]
BAD_TEXT = [0, True, [1], {"a": 1}, None]


def _model_dict() -> dict:
    return json.loads((MODELS / "deepseek_v2_lite.json").read_text())


def _write_json(path: Path, d: dict) -> Path:
    text = json.dumps({k: ("@BIG@" if v == 10**400 and not isinstance(v, bool) else v) for k, v in d.items()})
    path.write_text(text.replace('"@BIG@"', "1" + "0" * 400))  # a 401-digit JSON integer
    return path


# ---- model descriptions ---------------------------------------------------------------------------
MODEL_NUMBER_FIELDS = [
    "hidden_size",
    "moe_intermediate_size",
    "num_logical_experts",
    "top_k",
    "num_layers",
    "num_attention_heads",
    "num_kv_heads",
    "head_dim",
    "weight_bytes",
    "kv_cache_bytes",
    "vocab_size",
]


@pytest.mark.parametrize("value", BAD_NUMBERS, ids=repr)
@pytest.mark.parametrize("field", MODEL_NUMBER_FIELDS)
def test_model_file_refuses_bad_number_naming_file_and_field(tmp_path, field, value):
    path = _write_json(tmp_path / "m.json", {**_model_dict(), field: value})
    with pytest.raises(ValueError) as info:
        load_model(path)
    msg = str(info.value)
    assert str(path) in msg and field in msg and "accepted" in msg and "\n" not in msg


@pytest.mark.parametrize(
    "field, value",
    [
        ("kv_lora_rank", -1),
        ("kv_lora_rank", 0.5),
        ("shared_intermediate_size", math.nan),
        ("dense_intermediate_size", -3),
        ("num_shared_experts", True),
        ("first_moe_layer", 27),  # past the last layer
        ("first_moe_layer", "1"),
        ("num_groups", 0),
        ("num_groups", 5),  # does not divide 64 experts
        ("weight_bytes", 1e-300),  # would print a 300-digit time
        ("kv_cache_bytes", 9),
    ],
)
def test_model_file_refuses_other_fields(tmp_path, field, value):
    path = _write_json(tmp_path / "m.json", {**_model_dict(), field: value})
    with pytest.raises(ValueError, match=field):
        load_model(path)


@pytest.mark.parametrize("field", ["name", "source", "attention"])
@pytest.mark.parametrize("value", BAD_TEXT, ids=repr)
def test_model_text_fields_must_be_strings(field, value):
    with pytest.raises(ValueError, match=field):
        ModelSpec.from_dict({**_model_dict(), field: value}, where="m.json")


@pytest.mark.parametrize("ids", [[0, 0], [-1], [1.5], ["1"], [True], 7, []])
def test_model_layer_ids_checked(ids):
    d = {**_model_dict(), "moe_layer_ids": ids}
    d.pop("first_moe_layer")
    with pytest.raises(ValueError, match="moe_layer_ids"):
        ModelSpec.from_dict(d, where="m.json")


def test_builtin_models_load_and_a_valid_override_is_kept():
    names = (
        "deepseek-v3",
        "deepseek-v2-lite",
        "mixtral-8x7b",
        "qwen3-30b-a3b",
        "olmoe-1b-7b",
        "qwen1.5-moe-a2.7b",
    )
    for name in names:
        m = load_model(name)
        assert m.num_moe_layers >= 1 and m.kv_bytes_per_token > 0
    m = replace(load_model("deepseek-v3"), kv_cache_bytes=1)
    assert m.kv_cache_bytes == 1
    with pytest.raises(ValueError, match="kv_cache_bytes"):
        replace(m, kv_cache_bytes=-2.0)


def _hf(**over) -> dict:
    base = dict(
        model_type="mixtral",
        num_local_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=4,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
    )
    return {**base, **over}


@pytest.mark.parametrize(
    "key, value",
    [
        ("num_hidden_layers", 10**9),
        ("num_hidden_layers", "4"),
        ("num_local_experts", True),
        ("hidden_size", math.inf),
        ("num_attention_heads", -4),
        ("num_experts_per_tok", 2.5),
        ("vocab_size", [1000]),
        ("moe_layer_freq", 0),  # was a ZeroDivisionError
        ("decoder_sparse_step", 0),
        ("mlp_only_layers", ["x"]),
    ],
)
def test_hf_config_values_checked_before_use(key, value):
    cfg = _hf(**{key: value})
    if key == "moe_layer_freq":
        cfg["model_type"] = "deepseek_v3"
    with pytest.raises(ValueError, match=key):
        model_from_hf_config(cfg, where="cfg.json")


def test_hf_config_whose_weights_exceed_memory_is_refused_before_building():
    cfg = _hf(num_hidden_layers=10_000, hidden_size=16384, intermediate_size=65536, num_local_experts=256)
    with pytest.raises(ValueError, match="GB of memory available"):
        check_hf_config_fits(cfg, "cfg.json")
    check_hf_config_fits(_hf(), "cfg.json")  # a small one passes


# ---- hardware presets -----------------------------------------------------------------------------
GPU_FIELDS = [k for k in GPU_PRESET_KEYS if k != "name"]  # every number a preset may override


@pytest.mark.parametrize(
    "field, value",
    [
        (f, v)
        for f in GPU_FIELDS
        for v in [*BAD_NUMBERS, None, 1e-300]
        if not (f in ("gemm_overhead", "split_overhead") and v in (0, 1e-300))  # a zero fixed cost is valid
    ],
    ids=repr,
)
def test_gpu_preset_refuses_bad_number_naming_file_and_field(tmp_path, field, value):
    path = _write_json(tmp_path / "g.json", {"base": "h200", field: value})
    with pytest.raises(ValueError) as info:
        load_gpu_preset(path)
    msg = str(info.value)
    assert str(path) in msg and field in msg and "accepted" in msg


@pytest.mark.parametrize(
    "d, field",
    [
        ({"base": "h200", "provenance": "fitted"}, "provenance"),
        ({"base": "h200", "provenance": [1, 2]}, "provenance"),
        ({"base": "h200", "source": 3}, "source"),
        ({"base": "h200", "name": None}, "name"),
        ({"base": ["h200"]}, "base"),
        ({"base": 10**400}, "base"),
    ],
)
def test_gpu_preset_other_fields(tmp_path, d, field):
    with pytest.raises(ValueError, match=field):
        load_gpu_preset(_write_json(tmp_path / "g.json", d))


@pytest.mark.parametrize(
    "over",
    [
        {"bandwidth": 0.0},
        {"bandwidth": math.nan},
        {"latency": -1e-6},
        {"latency": math.inf},
        {"nominal_bandwidth": "50"},
        {"band": (2.0, 1.0)},
        {"band": (1.0,)},
        {"band": (math.nan, 1.0)},
    ],
)
def test_link_overrides_checked(over):
    with pytest.raises(ValueError, match=next(iter(over))):
        replace(LINKS["rdma"], **over)


@pytest.mark.parametrize("gpn", [0, -8, True, 8.0, "8", 10**6])
def test_cluster_gpus_per_node_checked(gpn):
    with pytest.raises(ValueError, match="gpus_per_node"):
        cluster_preset("h200", gpus_per_node=gpn)
    with pytest.raises(ValueError, match="gpus_per_node"):
        ClusterSpec(GPUS["h200"], LINKS["nvlink4"], LINKS["rdma"], gpn)


@pytest.mark.parametrize("intra, inter", [(3, None), (None, ["rdma"])])
def test_cluster_link_names_checked(intra, inter):
    with pytest.raises(ValueError, match="unknown link"):
        cluster_preset("h200", intra, inter)


def test_a_field_added_later_is_checked_by_its_kind():
    """The check is driven by the annotations: a new float or int field is checked without a table entry."""

    @dataclass(frozen=True)
    class Spec:
        cost: float = 1.0
        count: int = 2

        def __post_init__(self):
            check_fields(self, {}, "spec")

    Spec()
    for bad in ({"cost": math.nan}, {"cost": -1.0}, {"cost": "1"}, {"count": 1.5}, {"count": False}):
        with pytest.raises(ValueError, match=f"spec: {next(iter(bad))} is"):
            Spec(**bad)


# ---- the CLI: exit 2, one line, nothing written ---------------------------------------------------
def _run_cli(argv: list[str], capsys) -> tuple[int, str]:
    from moe_placement.cli.main import main

    rc = main(argv)
    return rc, capsys.readouterr().err.strip()


CLI_MODEL_CASES = [
    ("kv_cache_bytes", 0),
    ("kv_cache_bytes", math.nan),
    ("num_attention_heads", "128"),
    ("num_kv_heads", True),
    ("weight_bytes", -1),
    ("hidden_size", [7168]),
    ("num_layers", 10**10),
    ("vocab_size", math.inf),
]
CLI_GPU_CASES = [
    ("hbm_bytes", -1),
    ("flops_fp8", 1e-300),
    ("eta_compute", math.inf),
    ("provenance", "x"),
    ("gemm_overhead", "3e-6"),
]


def _assert_refused(rc: int, err: str, out: Path, *words: str) -> None:
    assert rc == 2 and len(err.splitlines()) == 1 and "Traceback" not in err
    assert all(w in err for w in words), err
    assert not out.exists()


@pytest.mark.parametrize("field, value", CLI_MODEL_CASES)
def test_layout_bad_model_file_exit_2(tmp_path, capsys, field, value):
    model = _write_json(tmp_path / "m.json", {**_model_dict(), field: value})
    out = tmp_path / "out"
    rc, err = _run_cli(["layout", "--model", str(model), "--nodes", "1", "--output", str(out)], capsys)
    _assert_refused(rc, err, out, str(model), field)


@pytest.mark.parametrize("field, value", CLI_GPU_CASES)
def test_layout_bad_gpu_preset_exit_2(tmp_path, capsys, field, value):
    hw = _write_json(tmp_path / "g.json", {"base": "h200", field: value})
    out = tmp_path / "out"
    argv = [
        "layout",
        "--model",
        "deepseek-v2-lite",
        "--nodes",
        "1",
        "--hardware",
        str(hw),
        "--output",
        str(out),
    ]
    rc, err = _run_cli(argv, capsys)
    _assert_refused(rc, err, out, str(hw), field)


@pytest.fixture(scope="module")
def small_trace(tmp_path_factory) -> Path:
    from profiling.readers import write_trace
    from profiling.synthetic import synthetic_trace

    path = tmp_path_factory.mktemp("trace") / "t.npz"
    write_trace(
        synthetic_trace(num_tokens=2000, num_layers=26, num_logical_experts=64, top_k=6, seed=1), path
    )
    return path


@pytest.mark.parametrize(
    "kind, field, value", [("model", *c) for c in CLI_MODEL_CASES[:5]] + [("gpu", *c) for c in CLI_GPU_CASES]
)
def test_advise_bad_presets_exit_2(tmp_path, capsys, small_trace, kind, field, value):
    if kind == "model":
        model, hw = str(_write_json(tmp_path / "m.json", {**_model_dict(), field: value})), "h200"
    else:
        model, hw = "deepseek-v2-lite", str(_write_json(tmp_path / "g.json", {"base": "h200", field: value}))
    out = tmp_path / "out"
    argv = ["advise", "--trace", str(small_trace), "--model", model, "--hardware", hw, "--nodes", "1"]
    rc, err = _run_cli([*argv, "--engine", "sglang", "--quick", "--output", str(out)], capsys)
    _assert_refused(rc, err, out, field)


# ---- unbounded sizes: refused before any work, within seconds --------------------------------------
def _subprocess(code_or_argv: str | list[str], timeout: float = 30.0) -> tuple[int, str, float]:
    argv = (
        [sys.executable, "-m", "moe_placement", *code_or_argv]
        if isinstance(code_or_argv, list)
        else [
            sys.executable,
            "-c",
            code_or_argv,
        ]
    )
    t0 = time.perf_counter()
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    return p.returncode, p.stderr.strip(), time.perf_counter() - t0


def _huge_model(tmp_path: Path, layers: int) -> Path:
    return _write_json(tmp_path / "huge.json", {**_model_dict(), "num_layers": layers})


@pytest.mark.parametrize("layers", [10**9, 10**10])
def test_huge_layer_count_refused_fast_by_layout_and_advise(tmp_path, small_trace, layers):
    model = str(_huge_model(tmp_path, layers))
    for argv in (
        ["layout", "--model", model, "--nodes", "1"],
        [
            "advise",
            "--trace",
            str(small_trace),
            "--model",
            model,
            "--nodes",
            "1",
            "--engine",
            "vllm",
            "--quick",
        ],
    ):
        rc, err, secs = _subprocess(argv)
        assert rc == 2 and "num_layers" in err and "100001" in err and len(err.splitlines()) == 1, err
        assert secs < 20


def test_huge_hf_config_refused_fast_by_profile(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(_hf(num_hidden_layers=10**9)))
    text = tmp_path / "t.txt"
    text.write_text("some text")
    rc, err, secs = _subprocess(
        ["profile", "--model", str(folder), "--text", str(text), "-o", str(tmp_path / "o.npz")]
    )
    assert rc == 2 and "num_hidden_layers" in err and len(err.splitlines()) == 1, err
    assert secs < 20 and not (tmp_path / "o.npz").exists()


@pytest.mark.parametrize(
    "flags, word",
    [
        (["--nodes", "512"], "MAX_LAYOUT_GPUS"),
        (["--nodes", "1", "--batch-per-rank", "10" + "0" * 30], "MAX_STEP_TOKENS"),
        (["--nodes", "1", "--context-len", "10" + "0" * 30], "MAX_CONTEXT_LEN"),
    ],
)
def test_layout_sizes_bounded(capsys, flags, word):
    rc, err = _run_cli(["layout", "--model", "deepseek-v3", *flags], capsys)
    assert rc == 2 and word in err and len(err.splitlines()) == 1


@pytest.mark.parametrize(
    "code, word",
    [
        ("from solver.api import FitOptions; FitOptions(steps=10**12)", "FitOptions.steps"),
        ("from solver.api import FitOptions; FitOptions(step_moves=float('inf'))", "FitOptions.step_moves"),
        ("from solver.api import FitOptions; FitOptions(dealings=10**9)", "FitOptions.dealings"),
        ("from solver.step.fit import StepFitOptions as S; S(num_steps=10**12)", "StepFitOptions.num_steps"),
        ("from solver.step.fit import StepFitOptions as S; S(moves=10**12)", "StepFitOptions.moves"),
        ("from solver.step.fit import StepFitOptions as S; S(iters=10**9)", "StepFitOptions.iters"),
        ("from solver.budget import Budget; Budget(1.0, 10**12)", "MAX_WORK_STEPS"),
        ("from solver.budget import Budget; Budget(float('inf'))", "seconds"),
        (
            "import numpy as np; from placement.topology import Topology; from solver.exact import solve_exact; "
            "solve_exact(np.ones((2, 8)), Topology(2, 8), time_limit=float('inf'))",
            "time_limit",
        ),
        (
            "import numpy as np; from placement.topology import Topology; from solver.api import solve; "
            "solve('locality', topology=Topology(2, 8), load=np.ones((2, 8)), time_limit=1e300)",
            "MAX_TIME_LIMIT_S",
        ),
        (
            "import numpy as np; from placement.topology import Topology; from solver.migration import MigrationOptions, solve_migration; "
            "from solver.greedy import greedy_placement; prev, _ = greedy_placement(np.ones((2, 8)), Topology(2, 8)); "
            "solve_migration(np.ones((2, 8)), prev, MigrationOptions(time_limit=float('nan')))",
            "time_limit",
        ),
    ],
)
def test_library_refuses_unbounded_work_fast(code, word):
    rc, err, secs = _subprocess(code)
    assert rc != 0 and "ValueError" in err and word in err, err
    assert secs < 20


def test_exact_time_limit_is_a_wall_for_all_layers():
    """3,000 layers at time_limit 2 s: the per-layer floor (0.05 s x 3,000 = 150 s) no longer applies;
    the layers past the deadline keep their start and one note says so."""
    from placement.topology import Topology
    from solver.exact import solve_exact

    rng = np.random.default_rng(0)
    load = rng.zipf(1.5, size=(3000, 16)).clip(max=1000).astype(float)
    t0 = time.perf_counter()
    pl, rep = solve_exact(load, Topology(4, 20), backend="milp", time_limit=2.0, workers=1)
    wall = time.perf_counter() - t0
    assert wall < 15, wall
    assert any("time limit 2 s reached" in n for n in rep.notes)
    assert pl.physical_to_logical_map.shape == (3000, 20)
    assert all(l.objective <= l.baseline_objective + 1e-9 for l in rep.layers)  # never worse than greedy


@pytest.mark.parametrize("d", [[1, 2], "deepseek", 3])
def test_model_description_not_an_object(d):
    with pytest.raises(ValueError, match="JSON object"):
        ModelSpec.from_dict(d, where="m.json")
    with pytest.raises(ValueError, match="JSON object"):
        model_from_hf_config(d, where="config.json")


@pytest.mark.parametrize("key", ["num_attention_heads", "num_key_value_heads", "vocab_size"])
def test_hf_zero_is_refused_not_read_as_absent(key):
    with pytest.raises(ValueError, match=key):
        model_from_hf_config(_hf(**{key: 0}), where="cfg.json")


def test_long_name_is_cut_in_messages():
    with pytest.raises(ValueError) as info:
        ModelSpec.from_dict({**_model_dict(), "name": "x" * 5_000, "top_k": 0}, where="m.json")
    assert "top_k" in str(info.value) and len(str(info.value)) < 400


@pytest.mark.parametrize(
    "kw, word",
    [({"robust": "max", "num_windows": 10**9}, "MAX_SEARCH_SAMPLES"), ({"workers": 10**6}, "workers")],
)
def test_exact_window_and_thread_counts_bounded(kw, word):
    from placement.topology import Topology
    from profiling.synthetic import synthetic_trace
    from solver.exact import solve_exact

    tr = synthetic_trace(num_tokens=500, num_layers=2, num_logical_experts=8, top_k=2)
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=word):
        solve_exact(tr, Topology(2, 8), time_limit=1.0, **kw)
    assert time.perf_counter() - t0 < 5


def test_pipeline_work_limit_bounded_for_the_whole_solve():
    """A work limit of 1e12 steps over 100,000 layers is 1e7 a layer: refused for the solve as a whole."""
    from solver.api import make_options

    with pytest.raises(ValueError, match="MAX_WORK_STEPS"):
        make_options("locality", {"work_limit": 10**12})
    assert make_options("locality", {"work_limit": 1000}).work_limit == 1000


def test_exact_time_limit_is_a_wall_through_the_noise_gate():
    """A windowed trace goes through the noise gate (greedy's noise, the gate's migration per layer):
    2,000 layers at time_limit 2 s once took minutes (0.05 s floors and a migration per layer)."""
    from placement.topology import Topology
    from profiling.trace import RoutingTrace
    from solver.exact import solve_exact

    rng = np.random.default_rng(1)
    L = 2000
    mean = rng.zipf(1.6, size=(1, L, 16)).clip(max=50) * 20
    tr = RoutingTrace(
        num_logical_experts=16, layer_ids=tuple(range(L)), window_counts=rng.poisson(mean, (8, L, 16))
    )
    t0 = time.perf_counter()
    pl, rep = solve_exact(tr, Topology(4, 20), backend="cpsat", time_limit=2.0, workers=1)
    assert time.perf_counter() - t0 < 15
    assert any("time limit" in n for n in rep.notes)
    assert all(l.objective <= l.baseline_objective + 1e-9 for l in rep.layers)


@pytest.mark.parametrize("shape", [(0, 8), (2, 0)])
def test_exact_refuses_an_empty_load_with_its_shape(shape):
    from placement.topology import Topology
    from solver.exact import solve_exact

    with pytest.raises(ValueError, match="at least one layer and one expert"):
        solve_exact(np.ones(shape), Topology(2, 8), time_limit=1.0)


def test_step_fit_count_blends_checked_item_by_item():
    from solver.step.fit import StepFitOptions

    assert StepFitOptions(count_blends=()).count_blends == ()  # no starts: search from the given placement
    with pytest.raises(ValueError, match=r"StepFitOptions.count_blends\[0\]"):
        StepFitOptions(count_blends=(math.nan,))


def test_huge_hf_config_refused_by_validate_before_the_model_is_built(tmp_path):
    """validate --model builds the model on every rank: a 1e9-layer config is refused before that."""
    pytest.importorskip("transformers")
    from runtime_hooks.hf_validate import _config

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(_hf(num_hidden_layers=10**9)))
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="num_hidden_layers is 1000000000"):
        _config(cfg)
    assert time.perf_counter() - t0 < 10
