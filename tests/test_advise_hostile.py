"""advise against hostile input (issue 46, kinds 1, 4 and 7): each case advised wrongly, crashed or
contradicted itself before; each test here failed before its fix."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from test_advise import _model_json, _options, _skewed

from moe_placement.apps.advise import AdviseOptions, advise, render_html
from moe_placement.cli.main import main
from profiling.readers import write_trace
from profiling.synthetic import synthetic_trace

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def lite(tmp_path_factory) -> str:
    """A model JSON of DeepSeek-V2-Lite's per-expert shape with the synthetic traces' 16 experts, top-4, 3 layers."""
    return _model_json(tmp_path_factory.mktemp("m"), "deepseek-v2-lite", "deepseek-v2-lite", 16, 4, 3)


def _cli(tmp_path: Path, model: str, *extra: str, trace=None) -> list[str]:
    path = tmp_path / "t.npz"
    write_trace(trace if trace is not None else _skewed(), path)
    args = ["advise", "--trace", str(path), "--model", model, "--nodes", "1", "--gpus-per-node", "4"]
    args += ["--engine", "vllm", "--quick", "--decode-batch", "8", "--prefill-chunk", "64", "--min-gain", "0"]
    args += ["--no-stability"]  # checked in tests/test_advise_stability.py
    return [*args, *extra]


# -- kind 4: library calls that raised AttributeError
@pytest.mark.parametrize("engine", [None, 5, "trtllm"])
def test_options_name_the_engine_field_and_its_values(engine):
    with pytest.raises(ValueError, match=r"engine must be one of sglang, vllm, got"):
        AdviseOptions(engine=engine, nodes=1)


@pytest.mark.parametrize("model", [5, None, ""])
def test_advise_names_the_model_argument_and_its_values(model):
    with pytest.raises(ValueError, match=r"model must be 'auto', a built-in model name \(deepseek-v3.*got"):
        advise(_skewed(tokens=4000, num_prompts=40), model, "h200", _options("vllm"))


@pytest.mark.parametrize("kw, field", [({"progress": 5}, "progress"), ({"output": ""}, "output")])
def test_advise_names_a_bad_progress_or_output(lite, kw, field):
    with pytest.raises(ValueError, match=rf"^{field} must be"):
        advise(_skewed(tokens=4000, num_prompts=40), lite, "h200", _options("vllm"), **kw)


# -- kind 1: advised wrongly without saying so
def test_a_json_preset_without_measured_figures_is_not_calibrated(tmp_path, capsys, lite):
    plain, fitted = tmp_path / "plain.json", tmp_path / "fitted.json"
    plain.write_text(json.dumps({"base": "h200", "eta_compute": 0.5}))
    fitted.write_text(
        json.dumps({"base": "h200", "eta_compute": 0.5, "provenance": {"times_s": [1e-5, 2e-5]}})
    )
    for preset, measured in ((plain, False), (fitted, True)):
        assert main([*_cli(tmp_path, lite, "--hardware", str(preset)), "--json"]) == 0
        d = json.loads(capsys.readouterr().out)
        assert d["context"]["calibrated"] is measured and d["hardware"]["measured"] is measured
        assert ("analytic, not calibrated" in d["assumptions"][0]) is not measured


def test_empty_output_is_refused(tmp_path, capsys, lite):
    assert main(_cli(tmp_path, lite, "--output", "")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--output '' is empty" in err, err


def test_one_prompt_trace_is_not_described_as_split_by_prompts(lite):
    one = synthetic_trace(
        num_tokens=6000, num_layers=3, num_logical_experts=16, top_k=4, num_prompts=1, seed=2
    )
    assert len(one.natural_windows()) == 1
    d = advise(one, lite, "h200", _options("vllm")).to_dict()
    split = next(a for a in d["assumptions"] if a.startswith("balance:"))
    assert (
        "prompts" not in split.replace("one prompt", "") and "tokens (the trace has one prompt)" in split
    ), split


# -- kind 7: output contradicting itself or the project
def test_relative_output_puts_absolute_paths_in_the_command(tmp_path, capsys, monkeypatch, lite):
    args = _cli(tmp_path, lite, "--json", "--output", "rel/out")
    monkeypatch.chdir(tmp_path)
    assert main(args) == 0
    rec = json.loads(capsys.readouterr().out)["recommendation"]
    assert rec["files"], rec["option"]
    for f in rec["files"]:
        assert Path(f).is_absolute() and Path(f).is_file() and str(tmp_path / "rel" / "out") in f
    assert "rel/out" not in rec["launch_command"].replace(str(tmp_path / "rel" / "out"), "")


_PATH = re.compile(
    r"(?<![\w/.-])((?:docs|benchmarks|tools|moe_placement|placement|profiling|solver)/[\w/.-]+\.(?:md|py))"
)


def test_report_and_json_cite_only_files_the_project_has(lite):
    adv = advise(_skewed(), lite, "h200", _options("sglang"))
    text = render_html(adv) + json.dumps(adv.to_dict())
    cited = set(_PATH.findall(text))
    assert cited, "the report names its sources"
    missing = sorted(c for c in cited if not (ROOT / c).is_file())
    assert not missing, missing


@pytest.mark.parametrize(
    "extra",
    [["--context-len", "16000000"], ["--hardware", "{tiny}"]],
    ids=["huge-context", "tiny-hbm-preset"],
)
def test_nothing_fits_is_said_in_one_line_not_advised(tmp_path, capsys, lite, extra):
    tiny = tmp_path / "tiny.json"
    tiny.write_text(json.dumps({"base": "h200", "hbm_bytes": 5e8}))
    args = _cli(tmp_path, lite, *[e.replace("{tiny}", str(tiny)) for e in extra])
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "nothing fits in memory" in err and "lower --decode-batch" in err, (
        err
    )


def test_a_gain_on_one_held_out_step_has_no_band_and_is_not_called_stable(lite):
    one_chunk = _options("vllm", prefill_step_tokens=3000, min_gain=0.0, stability=True)
    d = advise(_skewed(), lite, "h200", one_chunk).to_dict()
    assert d["held_out_steps"]["prefill"] == 1
    rows = [o["phases"]["prefill"] for o in d["options"] if o["option"] != "no EPLB"]
    assert rows and all(p["band"] is None for p in rows)  # null, not 0.00%
    rec = d["recommendation"]
    assert rec["decision_stable"] is False
    assert any("prefill figures rest on one held-out step" in u for u in rec["stability"]["unknown"])
    if rec["option"] != "no balancing":
        assert "band unknown: one held-out step" in d["summary"]


def test_vllm_no_balancing_command_enables_no_eplb(lite, tmp_path):
    """Qwen1.5-MoE (60 experts) on 16 GPUs with vLLM: vLLM has no EPLB for Qwen2MoeForCausalLM, so the
    advice is no balancing, and the command must not turn on EPLB, redundant experts or our plugin
    (vLLM refuses num_redundant_experts without EPLB, and places 60 experts 4 or 3 per GPU)."""
    model = _model_json(tmp_path, "deepseek-v2-lite", "qwen1.5-moe-a2.7b", 60, 4, 2)
    tr = _skewed(experts=60, top_k=4, tokens=40000, num_layers=2)
    opts = AdviseOptions.quick_form(
        "vllm",
        2,
        gpus_per_node=8,
        decode_step_tokens=2,
        prefill_step_tokens=16,
        quick_prompts=1000,
        stability=False,
    )
    d = advise(tr, model, "h200", opts).to_dict()
    rec = d["recommendation"]
    assert rec["option"] == "no balancing" and rec["flags"] == [] and rec["env"] == [] and rec["files"] == []
    for c in rec["launch_commands"]:
        for word in (
            "--enable-eplb",
            "--eplb-config",
            "num_redundant_experts",
            "MOE_PLACEMENT_EPLB",
            "VLLM_PLUGINS",
        ):
            assert word not in c["command"], (word, c["command"])
    assert any("without EPLB vLLM places 3 or 4 experts per GPU" in w for w in d["warnings"]), d["warnings"]


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_every_node_gets_its_command(lite, engine):
    opts = AdviseOptions.quick_form(
        engine,
        2,
        gpus_per_node=2,
        decode_step_tokens=4,
        prefill_step_tokens=64,
        min_gain=0.0,
        stability=False,
    )
    d = advise(_skewed(), lite, "h200", opts).to_dict()
    nodes = d["recommendation"]["launch_commands"]
    assert [n["node_rank"] for n in nodes] == [0, 1]
    assert nodes[0]["command"] == d["recommendation"]["launch_command"]
    if engine == "sglang":
        assert "--node-rank 0" in nodes[0]["command"] and "--node-rank 1" in nodes[1]["command"]
        assert all("--dist-init-addr HEAD_IP:5000" in n["command"] for n in nodes)
        assert all(
            "--attn-dp-size 4" in n["command"] and "--enable-dp-attention" not in n["command"] for n in nodes
        )
    else:
        assert "--headless" not in nodes[0]["command"]
        assert "--headless" in nodes[1]["command"] and "--data-parallel-start-rank 2" in nodes[1]["command"]
        assert all("--data-parallel-address HEAD_IP" in n["command"] for n in nodes)


def test_counts_only_traces_get_window_level_figures_with_the_caveat(traces_dir, capsys):
    """Mixtral on MMLU (per-question counts, no token): advised, not refused, with the caveat said in the
    summary and the warnings, and the context marking the trace counts-only."""
    from tests.conftest import MIXTRAL

    path = traces_dir / MIXTRAL
    if not path.is_file():
        pytest.skip(f"shared trace {MIXTRAL} not found (set MOE_TRACES_DIR to the shared traces folder)")
    args = [
        "advise",
        "--trace",
        str(path),
        "--nodes",
        "1",
        "--engine",
        "vllm",
        "--quick",
        "--json",
        "--no-stability",
    ]
    assert main(args) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["context"]["trace"]["counts_only"] is True and d["context"]["model"] == "mixtral-8x7b"
    assert d["held_out_steps"]["decode"] > 0 and d["options"]
    caveat = "window-level figures"
    assert any(caveat in w for w in d["warnings"]) and caveat in d["summary"]


def test_decode_is_priced_on_decode_routing_when_the_trace_has_it(traces_dir, tmp_path):
    """The Qwen1.5-MoE trace records vLLM's batches (its held-out half: decode steps): decode is priced on
    them, with no 'priced on prompt tokens' warning; a prompt-only trace gets the warning."""
    from tests.conftest import QWEN

    path = traces_dir / QWEN
    if not path.is_file():
        pytest.skip(f"shared trace {QWEN} not found (set MOE_TRACES_DIR to the shared traces folder)")
    model = _model_json(tmp_path, "qwen1.5-moe-a2.7b", "qwen1.5-moe-a2.7b", 60, 4, 5)
    opts = AdviseOptions(engine="sglang", nodes=1, gpus_per_node=4, redundant_per_gpu=(1,), stability=False)
    from profiling.readers import read_trace

    d = advise(read_trace(path), model, "h200", opts).to_dict()
    held = next(a for a in d["assumptions"] if a.startswith("held-out decode"))
    assert "engine steps" in held and "recorded engine batches" in held, held
    assert not any("priced on prompt tokens" in w for w in d["warnings"])
    prompts = advise(
        _skewed(tokens=4000, num_prompts=40),
        _model_json(tmp_path, "deepseek-v2-lite", "deepseek-v2-lite", 16, 4, 3),
        "h200",
        _options("vllm"),
    )
    assert any("priced on prompt tokens" in w for w in prompts.to_dict()["warnings"])
