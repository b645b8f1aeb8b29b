"""``advise``: the JSON contract, what the engines can run, refusals and warnings, the launch command,
rebalancing judged out of sample, reproducibility, and a report that renders."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moe_placement.apps.advise import AdviseOptions, advise, render_html
from moe_placement.apps.advise.balance import trace_topology
from moe_placement.apps.advise.engines import min_redundant
from moe_placement.apps.advise.phases import price_phase
from moe_placement.apps.advise.rebalance import JudgeSpec, judge
from moe_placement.apps.advise.report import PLOT_COUNT
from moe_placement.cli.main import main
from placement.cost.hardware import cluster_preset
from placement.cost.modelspec import load_model
from placement.cost.step_time import step_time
from placement.steps import make_steps
from profiling.readers import write_trace
from profiling.synthetic import synthetic_trace
from profiling.trace import RoutingTrace
from solver.api import solve

ROOT = Path(__file__).resolve().parents[1]
PHASE_KEYS = {"whole_step_gain", "moe_step_gain", "dispatch_overhead_ms", "memory_gb", "kv_tokens_lost"}


def _model_json(tmp: Path, base: str, name: str, experts: int, top_k: int, layers: int) -> str:
    """A model JSON of a preset's per-expert shape with the trace's experts, top-k and MoE layers."""
    d = dataclasses.asdict(load_model(base))
    d.update(name=name, num_logical_experts=experts, top_k=top_k, num_layers=layers + 1)
    d["moe_layer_ids"] = list(range(1, layers + 1))
    path = tmp / f"{name}-{experts}.json"
    path.write_text(json.dumps(d))
    return str(path)


def _skewed(experts: int = 16, top_k: int = 4, tokens: int = 24000, **kw) -> RoutingTrace:
    args = dict(num_layers=3, num_logical_experts=experts, top_k=top_k, num_prompts=160, skew=1.0, seed=3)
    args.update(kw)
    return synthetic_trace(num_tokens=tokens, **args)


def _options(engine: str, **kw) -> AdviseOptions:
    """Small settings; any gain beyond its band is taken (min_gain 0) and the stability checks are left
    to tests/test_advise_stability.py (they re-run the advice several times)."""
    base = dict(gpus_per_node=4, decode_step_tokens=8, prefill_step_tokens=64, quick_prompts=1000)
    base.update(min_gain=0.0, stability=False)
    base.update(kw)
    return AdviseOptions.quick_form(engine, 1, **base)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="module")
def sglang_advice(model_dir):
    model = _model_json(model_dir, "deepseek-v2-lite", "deepseek-v2-lite", 16, 4, 3)
    return advise(_skewed(), model, "h200", _options("sglang"), output="OUT")


def test_contract_keys_are_stable_and_json_is_reproducible(sglang_advice, model_dir):
    d = sglang_advice.to_dict()
    assert {"recommendation", "held_out_steps", "assumptions", "warnings"} <= set(d)
    rec = d["recommendation"]
    assert {"option", "flags", "launch_command", "files", "phases", "rebalance"} <= set(rec)
    assert set(rec["phases"]) == {"decode", "prefill"}
    for ph in rec["phases"].values():
        assert PHASE_KEYS <= set(ph)
    assert {"interval_steps", "out_of_sample_gain", "stall_ms"} <= set(rec["rebalance"])
    assert set(d["held_out_steps"]) == {"decode", "prefill"}
    text = " ".join(d["assumptions"])
    assert "analytic, not calibrated" in text and "h200" in text and "placement.cost.step_time" in text
    model = _model_json(model_dir, "deepseek-v2-lite", "deepseek-v2-lite", 16, 4, 3)
    again = advise(_skewed(), model, "h200", _options("sglang"), output="OUT")
    assert json.dumps(again.to_dict()) == json.dumps(d)
    assert render_html(again) == render_html(sglang_advice)


def test_gains_are_whole_step_and_match_the_priced_rows(sglang_advice, model_dir):
    adv = sglang_advice
    base = adv.row(adv.baseline)
    for row in adv.rows:
        for ph in ("decode", "prefill"):
            p, b = row.phase(ph), base.phase(ph)
            assert p.whole_ms > p.moe_ms > 0  # the rest of the step is priced too
            got = adv.to_dict()["options"][adv.rows.index(row)]["phases"][ph]["whole_step_gain"]
            assert got == pytest.approx(b.whole_ms / p.whole_ms - 1, rel=1e-4, abs=1e-9)
    # the row's price is the one cost model's on the same placement and held-out decode steps
    row = next(r for r in adv.rows if r.redundant_per_gpu > 0)
    model = load_model(_model_json(model_dir, "deepseek-v2-lite", "deepseek-v2-lite", 16, 4, 3))
    cluster = cluster_preset("h200", gpus_per_node=4)
    steps = make_steps(adv.held_out, 4, "decode", 8)
    whole = step_time(
        adv.placement_of(row), adv.held_out, steps, row.dispatch, model, cluster, context_len=4096
    )
    assert row.decode.num_steps == steps.num_steps and row.decode.phase == "decode"
    assert whole.whole_ms == pytest.approx(row.decode.whole_ms, rel=1e-3)
    assert whole.moe_ms == pytest.approx(row.decode.moe_ms, rel=1e-3)


def test_lp_is_never_available_without_its_overhead_priced(sglang_advice):
    d = sglang_advice.to_dict()
    lp = [o for o in d["options"] if o["dispatch"] == "sglang-lp"]
    assert lp, "the SGLang options include lp"
    for o in lp:
        assert (
            o["phases"]["decode"]["dispatch_overhead_ms"] > 0
            and o["phases"]["prefill"]["dispatch_overhead_ms"] > 0
        )
    # a row whose overhead is zero (unpriced) is refused
    from moe_placement.apps.advise.recommend import availability

    row = next(r for r in sglang_advice.rows if r.dispatch == "sglang-lp")
    unpriced = dataclasses.replace(row, decode=dataclasses.replace(row.decode, dispatch_overhead_ms=0.0))
    ok, why = availability("sglang", "deepseek-v2-lite", unpriced)
    assert not ok and "not priced" in why
    # lp on a model SGLang's LP solver does not know is greyed with the reason
    ok, why = availability("sglang", "qwen3-30b-a3b", row)
    assert not ok and "Qwen3MoeForCausalLM" in why


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_command_names_only_files_written_and_sglang_has_nnodes(tmp_path, capsys, model_dir, engine):
    path = tmp_path / "t.npz"
    write_trace(_skewed(), path)
    model = _model_json(model_dir, "deepseek-v2-lite", "deepseek-v2-lite", 16, 4, 3)
    out = tmp_path / "out"
    args = ["advise", "--trace", str(path), "--model", model, "--nodes", "1", "--gpus-per-node", "4"]
    args += ["--engine", engine, "--quick", "--decode-batch", "8", "--prefill-chunk", "64", "--json"]
    args += ["--no-stability"]
    args += ["--min-gain", "0"]  # the synthetic model's gains are under 1%: take any beyond its band
    assert main([*args, "--output", str(out)]) == 0
    d = json.loads(capsys.readouterr().out)
    rec = d["recommendation"]
    if engine == "sglang":
        assert "--nnodes 1" in rec["launch_command"] and "--ep-size 4" in rec["launch_command"]
    assert rec["option"] != "no balancing", rec["reason"]  # a skewed trace pays on this synthetic model
    assert rec["files"] and all(Path(f).is_file() and Path(f).parent == out for f in rec["files"])
    named = [w.split("=file:")[-1] for w in rec["launch_command"].split() if str(out) in w]
    assert named and all(Path(f).is_file() for f in named)
    if engine == "sglang":
        stored = json.loads(Path(rec["files"][0]).read_text())["physical_to_logical_map"]
        assert len(stored) == 4 and len(stored[1]) == 16 + 4 * int(rec["option"].rsplit("|r", 1)[1])


def test_vllm_command_starts_as_ep(model_dir):
    model = _model_json(model_dir, "qwen3-30b-a3b", "qwen3-30b-a3b", 16, 4, 3)
    adv = advise(_skewed(), model, "h200", _options("vllm"), output="OUT")
    cmd = adv.to_dict()["recommendation"]["launch_command"]
    assert cmd.startswith("vllm serve") or "vllm serve" in cmd
    assert "--enable-expert-parallel" in cmd and "--data-parallel-size 4" in cmd
    if "--enable-eplb" in cmd:
        cfg = json.loads(cmd.split("--eplb-config '")[1].split("'")[0])
        assert (16 + cfg["num_redundant_experts"]) % 4 == 0


def test_mixtral_on_sglang_gets_no_eplb_flags(model_dir):
    model = _model_json(model_dir, "mixtral-8x7b", "mixtral-8x7b", 8, 2, 3)
    tr = _skewed(experts=8, top_k=2)
    d = advise(tr, model, "h200", _options("sglang"), output="OUT").to_dict()
    rec = d["recommendation"]
    assert rec["option"] == "no balancing" and rec["flags"] == [] and rec["files"] == []
    for flag in ("--enable-eplb", "--ep-dispatch-algorithm", "--init-expert-location", "--ep-num-redundant"):
        assert flag not in rec["launch_command"]
    greyed = [o for o in d["options"] if o["option"] in ("engine EPLB", "ours")]
    assert greyed and all(
        not o["available"] and "MixtralForCausalLM" in o["unavailable_reason"] for o in greyed
    )


def test_sixty_experts_on_sixteen_gpus_is_advised(model_dir):
    model = _model_json(model_dir, "deepseek-v2-lite", "qwen1.5-moe-a2.7b", 60, 4, 2)
    tr = _skewed(experts=60, top_k=4, tokens=40000, num_layers=2)
    opts = AdviseOptions.quick_form(
        "sglang",
        2,
        gpus_per_node=8,
        decode_step_tokens=2,
        prefill_step_tokens=16,
        quick_prompts=1000,
        stability=False,
    )
    assert min_redundant(60, 16) == 4
    adv = advise(tr, model, "h200", opts, output="OUT")
    d = adv.to_dict()
    assert any("4 redundant slots" in w for w in d["warnings"])
    for o in d["options"]:
        P = adv.placements[adv.row(o["key"]).placement_key].topology.num_physical_experts
        assert P % 16 == 0 and P >= 64
    flag = [f for f in d["recommendation"]["flags"] if f.startswith("--ep-num-redundant-experts")]
    assert flag and (60 + int(flag[0].split()[1])) % 16 == 0


def test_refusals_name_the_numbers(model_dir):
    with pytest.raises(ValueError, match="EP needs more than one rank"):
        AdviseOptions(engine="vllm", nodes=1, gpus_per_node=1)
    tr = _skewed()
    with pytest.raises(ValueError, match=r"16 experts.*deepseek-v3 has 256 experts"):
        advise(tr, "deepseek-v3", "h200", _options("vllm"))
    model = _model_json(model_dir, "deepseek-v2-lite", "deepseek-v2-lite", 16, 4, 5)  # 5 layers, trace has 3
    with pytest.raises(ValueError, match=r"3 MoE layers.*5 MoE layers"):
        advise(tr, model, "h200", _options("vllm"))
    counts = RoutingTrace(num_logical_experts=16, window_counts=np.ones((4, 2, 16)), layer_ids=(0, 1))
    with pytest.raises(ValueError, match=r"any top-k \(counts only\), 2 MoE layers.*5 MoE layers"):
        advise(
            counts, model, "h200", _options("vllm")
        )  # counts-only: advised (with a caveat) when it matches


def test_short_trace_is_warned_or_refused_with_strict(model_dir):
    model = _model_json(model_dir, "deepseek-v2-lite", "deepseek-v2-lite", 16, 4, 3)
    tr = _skewed(tokens=2000, num_prompts=20)
    d = advise(tr, model, "h200", _options("vllm", decode_step_tokens=16)).to_dict()
    assert d["held_out_steps"]["decode"] < 20
    assert any("held-out decode steps" in w for w in d["warnings"])
    with pytest.raises(ValueError, match="--strict: only .* held-out decode steps"):
        advise(tr, model, "h200", _options("vllm", decode_step_tokens=16, strict=True))


def _rebalance_verdict(trace: RoutingTrace, engine: str, model_path: str, b: int = 64):
    opts = _options(engine, windows=5)
    topo = trace_topology(16, 2, opts)
    fit, held = trace.split(0.5)
    static = solve("greedy", topology=topo, trace=fit).placement
    model, cluster = load_model(model_path), cluster_preset("h200", gpus_per_node=4)

    def price(pl, window):
        steps = make_steps(window, 4, "decode", b)
        return price_phase(pl, window, steps, "vllm-hash", model, cluster, 4096).whole_ms

    return judge(held, static, topo, price, JudgeSpec(engine, b, 5, 0.005))


def test_stationary_trace_gets_no_periodic_rebalance_and_a_drifting_one_does(model_dir):
    model = _model_json(model_dir, "deepseek-v2-lite", "deepseek-v2-lite", 16, 4, 3)
    still = _skewed(tokens=40000, drift=0.0, affinity=0.0)
    rb = _rebalance_verdict(still, "vllm", model)
    assert rb.out_of_sample_gain is not None  # judged, not skipped
    assert rb.interval_steps is None and "no periodic rebalance" in rb.reason
    # the traffic the static placement was fitted on (uniform) gives way to a skewed mix: re-placing
    # from the last window pays out of sample
    before = _skewed(tokens=20000, drift=0.0, affinity=0.0, skew=0.0, seed=1)
    after = _skewed(tokens=20000, drift=0.0, affinity=0.0, skew=2.0, seed=2)
    shifted = RoutingTrace(
        num_logical_experts=16,
        topk_ids=np.concatenate([before.topk_ids, after.topk_ids]),
        layer_ids=after.layer_ids,
    )
    rb = _rebalance_verdict(shifted, "vllm", model)
    assert rb.interval_steps is not None and rb.out_of_sample_gain > 0.005, rb
    assert rb.stall_ms == 0 and rb.async_  # vLLM's async EPLB keeps serving


def test_report_headers_say_modelled_and_flags_come_first(sglang_advice):
    page = render_html(sglang_advice)
    assert page.count("<svg") == PLOT_COUNT
    heads = [h.split("</h2>")[0] for h in page.split("<h2>")[1:]]
    assert heads and all("modelled" in h for h in heads)
    assert page.index("launch_server") < page.index("Options (modelled")


def test_report_renders_in_headless_chromium(sglang_advice, tmp_path):
    exe = shutil.which("chromium")
    if exe is None:
        pytest.skip("chromium not installed (apt-get install -y chromium): the screenshot test needs it")
    page = tmp_path / "advise.html"
    page.write_text(render_html(sglang_advice))
    shot = tmp_path / "shot.png"
    cmd = [
        exe,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        f"--screenshot={shot}",
        "--window-size=1200,2400",
    ]
    subprocess.run([*cmd, page.as_uri()], check=True, capture_output=True, timeout=120)
    import matplotlib.image as mpimg

    img = mpimg.imread(shot)[..., :3]  # [H, W, 3] floats in 0..1
    non_white = float((img.min(axis=2) < 0.9).mean())
    assert img.std() > 0.05 and non_white > 0.03, (img.std(), non_white)
    lower = img[img.shape[0] // 2 :]  # the plots' band is drawn too, not only the text at the top
    assert float((lower.min(axis=2) < 0.9).mean()) > 0.02


def test_cli_progress_is_one_line_per_stage_off_a_terminal(tmp_path, model_dir):
    path = tmp_path / "t.npz"
    write_trace(_skewed(), path)
    model = _model_json(model_dir, "deepseek-v2-lite", "deepseek-v2-lite", 16, 4, 3)
    cmd = [
        sys.executable,
        "-m",
        "moe_placement",
        "advise",
        "--trace",
        str(path),
        "--nodes",
        "1",
        "--gpus-per-node",
        "4",
    ]
    cmd += ["--engine", "vllm", "--quick", "--decode-batch", "8", "--prefill-chunk", "64", "--model", model]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stderr
    stages = [line for line in res.stderr.splitlines() if line.startswith("advise: ")]
    other = "advise: stability, fitted on the second half: "
    want = ["advise: placements", "advise: held-out prices", other + "placements", other + "held-out prices"]
    want += ["advise: stability: sweep", "advise: rebalance"]
    assert [s.split(" (")[0] for s in stages] == want
    assert "recommendation:" in res.stdout and "no EPLB|even|r0" in res.stdout


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--engine", "trtllm"], "invalid choice"),
        (["--nodes", "0"], "--nodes"),
        (["--gpus-per-node", "1"], "EP needs more than one rank"),
        (["--model", "no-such-model"], "no-such-model"),
        (["--model", "deepseek-v3"], "deepseek-v3 has 256 experts"),
        (["--decode-batch", "100000"], "held-out half"),
        (["--strict", "--prefill-chunk", "4096"], "--strict"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, model_dir, extra, needle):
    path = tmp_path / "t.npz"
    write_trace(_skewed(tokens=4000, num_prompts=40), path)
    model = _model_json(model_dir, "deepseek-v2-lite", "deepseek-v2-lite", 16, 4, 3)
    args = [
        "advise",
        "--trace",
        str(path),
        "--quick",
        "--nodes",
        "1",
        "--gpus-per-node",
        "4",
        "--engine",
        "vllm",
    ]
    args += ["--model", model, "--decode-batch", "8", *extra]  # later flags win in argparse
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err


def test_published_band_is_the_calibration_tables_over_none_rows():
    """advise's published band per phase is the span of benchmarks/step_model_check.py's "over none"
    rows (the figures are written there once, with their sources)."""
    import importlib.util
    from pathlib import Path

    from moe_placement.apps.advise.phases import PUBLISHED_GAIN

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "step_model_check.py"
    spec = importlib.util.spec_from_file_location("step_model_check_gains", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for phase, (lo, hi, _) in PUBLISHED_GAIN.items():
        rows = [r for r in mod.PUBLISHED_GAINS.values() if r[0] == phase and r[1][0] == "none"]
        assert rows and (lo, hi) == (min(r[2] for r in rows), max(r[3] for r in rows)), phase


def test_engine_batches_trace_without_model_is_one_line_naming_the_fix(capsys):
    """The Qwen1.5 trace (recorded engine batches, 60 experts, 5 of 24 layers logged) has no built-in
    model of its shape: refused in one line that names the built-in it nearly matches and what to pass."""
    from tests.conftest import QWEN, shared_trace_path

    path = shared_trace_path(QWEN)
    assert main(["advise", "--trace", str(path), "--nodes", "1", "--engine", "vllm"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "60 experts, top-4 and 5 MoE layers" in err and "a model JSON" in err, err
    assert "qwen1.5-moe-a2.7b has them but 24 MoE layers" in err, err  # the built-in it nearly is


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_phase_prices_and_recommends_one_phase_only(sglang_advice, model_dir, tmp_path, phase):
    """``--phase``: only that phase is priced (its figures are those of the two-phase run, option by
    option), the choice is made on it alone, and the report and CLI table render without the other."""
    model = _model_json(model_dir, "deepseek-v2-lite", "deepseek-v2-lite", 16, 4, 3)
    one = advise(_skewed(), model, "h200", _options("sglang", phase=phase), output="OUT")
    d, both = one.to_dict(), sglang_advice.to_dict()
    other = "decode" if phase == "prefill" else "prefill"
    assert set(d["held_out_steps"]) == {phase} and set(d["recommendation"]["phases"]) <= {phase}
    for mine, full in zip(d["options"], both["options"]):
        assert mine["key"] == full["key"] and set(mine["phases"]) == {phase}
        assert mine["phases"][phase] == full["phases"][phase]
    assert any(f"--phase {phase}" in a for a in d["assumptions"])
    assert other not in d["summary"].split("Rebalance:")[0]
    gains = {o["key"]: o["phases"][phase]["whole_step_gain"] for o in d["options"] if o["available"]}
    if d["recommendation"]["option"] != "no balancing":
        assert gains[d["recommendation"]["option"]] > 0
    assert "not priced" in render_html(one)
    trace = tmp_path / "t.npz"
    write_trace(_skewed(), trace)
    args = [
        "advise",
        "--trace",
        str(trace),
        "--quick",
        "--no-stability",
        "--nodes",
        "1",
        "--gpus-per-node",
        "4",
    ]
    args += ["--engine", "sglang", "--model", model, "--decode-batch", "8"]
    chunk = ["--prefill-chunk", "64"] if phase == "prefill" else []  # --phase decode prices no prefill chunk
    assert main([*args, *chunk, "--phase", phase, "--json"]) == 0
    assert main([*args, "--phase", "both"]) == 2


def test_band_warning_names_the_side_and_the_published_figures():
    from moe_placement.apps.advise.phases import band_warning, published_band

    lo, hi, src = published_band("decode")
    assert band_warning("decode", (lo + hi) / 200.0, "why") is None
    above = band_warning("decode", hi / 100.0 + 0.03, "2 experts per GPU")
    below = band_warning("decode", lo / 100.0 - 0.01, "why")
    assert above is not None and f"is above the published {lo:g}-{hi:g}%" in above and src in above
    assert "2 experts per GPU" in above and "modelled, not measured" in above
    assert below is not None and "is below the published" in below
    assert "is above" in band_warning("prefill", 0.5, "why")


def test_auto_finds_the_shared_traces_models_and_their_launch_ids():
    """Every model the shared traces were recorded from that has a built-in preset is found by ``auto``
    from a trace of its shape (experts, top-k, MoE layers), with a Hugging Face id and an architecture
    the engine table knows; Qwen1.5-MoE (60 experts, top-4, 24 layers) among them."""
    from moe_placement.apps.advise.engines import ARCHITECTURES
    from moe_placement.apps.advise.options import resolve_model
    from moe_placement.apps.advise.recommend import HF_IDS

    for name in ("deepseek-v2-lite", "mixtral-8x7b", "olmoe-1b-7b", "qwen1.5-moe-a2.7b"):
        ref = load_model(name)
        ids = np.zeros((8, ref.num_moe_layers, ref.top_k), dtype=np.int16)
        ids[:] = np.arange(ref.top_k)
        tr = RoutingTrace(num_logical_experts=ref.num_logical_experts, topk_ids=ids)
        got = resolve_model("auto", tr)
        assert dataclasses.replace(got, name=ref.name) == ref, name
        assert got.name in HF_IDS and got.name in ARCHITECTURES, got.name
