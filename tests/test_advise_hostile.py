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
    return [*args, "--engine", "vllm", "--quick", "--decode-batch", "8", "--prefill-chunk", "64", *extra]


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
    assert len(err.splitlines()) == 1 and "--output '' names no folder" in err, err


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
