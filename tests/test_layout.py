"""Layout planner and ``moe-placement layout`` CLI tests."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moe_placement.apps.planner.costmodel import CostOptions
from moe_placement.apps.planner.layout import (
    PlanOptions,
    compare_phases,
    enumerate_candidates,
    plan_layout,
    synthetic_load,
    workload_load,
)
from moe_placement.cli.main import main
from placement.cost.hardware import cluster_preset
from placement.cost.modelspec import load_model

DSV3 = load_model("deepseek-v3")


def test_candidates_divide_and_tile_the_cluster():
    cands = enumerate_candidates(DSV3, 4, 8)
    sizes = {c.ep_size for c in cands}
    assert sizes == {1, 2, 4, 8, 16, 32}
    for c in cands:
        assert (256 + c.num_redundant) % c.ep_size == 0
        assert c.instances * c.ep_size == 32
    capped = enumerate_candidates(DSV3, 4, 8, max_redundant=16)
    assert max(c.num_redundant for c in capped) <= 16


def test_cli_end_to_end_deepseek_v3_two_nodes(tmp_path, capsys):
    from placement.formats import read_placement

    out = tmp_path / "layout"
    rc = main(
        [
            "layout",
            "--model",
            "deepseek-v3",
            "--nodes",
            "2",
            "--gpus-per-node",
            "8",
            "--hardware",
            "h200",
            "--output",
            str(out),
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0
    assert "tok/s/GPU" in text and "rejected" in text and "weights do not fit" in text
    summary = json.loads((out / "layout.json").read_text())
    best = summary["results"][0]
    assert best["feasible"] and best["ep_size"] in (8, 16)
    pl = read_placement(out / "placement.json")
    assert pl.physical_to_logical_map.shape == (58, 256 + best["num_redundant"])
    assert pl.layer_ids == DSV3.moe_layer_ids
    sg = json.loads((out / "sglang_expert_location.json").read_text())
    assert list(sg) == ["physical_to_logical_map"] and len(sg["physical_to_logical_map"]) == 61
    flags = (out / "launch_flags.sh").read_text()
    assert f"--ep-num-redundant-experts {best['num_redundant']}" in flags
    assert "--enable-dp-attention" in flags and "--enable-expert-parallel" in flags
    assert "enable_attention_dp: true" in (out / "trtllm_extra_llm_api_options.yaml").read_text()
    assert "num_slots:" in (out / "moe_load_balancer.yaml").read_text()
    assert "phase_comparison" in summary


def test_cli_bad_input_is_one_line(capsys):
    rc = main(["layout", "--model", "no-such-model", "--nodes", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and "unknown model" in err and "Traceback" not in err


def test_more_gpus_reported_not_helping_over_ethernet_with_tiny_batch():
    olmoe = load_model("olmoe-1b-7b")
    cl = cluster_preset("h100", inter="ethernet")
    plan = plan_layout(olmoe, cl, 2, CostOptions(step_tokens=4, context_len=1024))
    assert not plan.more_gpus_help
    assert plan.best.candidate.ep_size < 16
    assert any("MORE GPUS DO NOT HELP" in n for n in plan.notes)
    full = [r for r in plan.feasible if r.candidate.ep_size == 16]
    assert full and max(r.tokens_per_s_per_gpu for r in full) < plan.best.tokens_per_s_per_gpu
    # the same model and batch over RDMA is not worse spread over the nodes than over Ethernet
    rdma = plan_layout(olmoe, cluster_preset("h100"), 2, CostOptions(step_tokens=4, context_len=1024))

    def best16(p):
        return max(r.tokens_per_s_per_gpu for r in p.feasible if r.candidate.ep_size == 16)

    assert best16(rdma) > best16(plan)


def test_deepseek_v3_four_nodes_decode_uses_all_gpus_and_some_redundancy():
    cl = cluster_preset("h200")
    plan = plan_layout(DSV3, cl, 4, CostOptions(phase="decode", step_tokens=128))
    best = plan.best
    assert plan.more_gpus_help and best.candidate.ep_size == 32
    # redundancy helps a skewed load, but not unboundedly: the most replicas is not the best
    same = [r for r in plan.feasible if r.candidate.ep_size == 32]
    assert best.candidate.num_redundant > 0
    assert max(same, key=lambda r: r.candidate.num_redundant) is not best
    # one node cannot hold the KV cache of 128 x 4096-token sequences next to 32 experts per GPU
    ep8 = [r for r in plan.results if r.candidate.ep_size == 8]
    assert ep8 and not any(r.feasible for r in ep8)


def test_phase_comparison_reports_numbers():
    cl = cluster_preset("h200")
    res = compare_phases(
        DSV3,
        cl,
        2,
        CostOptions(phase="decode", step_tokens=64),
        CostOptions(phase="prefill", step_tokens=4096),
    )
    assert "decode best" in res["message"] or "one layout serves both" in res["message"]
    assert isinstance(res["separate_wins"], bool)


def test_trace_with_matching_experts_is_counted_token_by_token(deepseek_trace):
    lite = load_model("deepseek-v2-lite")
    tr = deepseek_trace.slice_tokens(0, min(deepseek_trace.num_tokens, 20000))
    plan = plan_layout(
        lite,
        cluster_preset("h100"),
        1,
        CostOptions(step_tokens=64, context_len=1024),
        trace=tr,
        plan=PlanOptions(extra_slots=(0, 1)),
    )
    assert plan.best is not None
    assert "counted from" in plan.workload and "trace" in plan.workload


def test_trace_with_other_expert_count_transfers_skew():
    from profiling.trace import RoutingTrace

    rng = np.random.default_rng(0)
    p = 1.0 / np.arange(1, 65) ** 1.0
    ids = np.stack([rng.choice(64, size=6, replace=False, p=p / p.sum()) for _ in range(3000)])[:, None, :]
    tr = RoutingTrace(64, ids.astype(np.int16), name="skewed")
    load, how = workload_load(DSV3, tr)
    assert load.shape == (58, 256) and "resampled" in how
    flat, _ = workload_load(DSV3, None)

    def skew(w):
        return float((w.max(axis=1) / w.mean(axis=1)).mean())

    assert skew(load) > skew(synthetic_load(58, 256, zipf=0.0))
    assert np.isfinite(flat).all()


# ---------------------------------------------------------------------------------------------
# one cost model: layout and evaluate --model --hardware price the same layout alike
# ---------------------------------------------------------------------------------------------
def _evaluate_step_time(capsys, placement_path, trace_path, overlap: str) -> dict:
    args = [
        "evaluate",
        str(placement_path),
        str(trace_path),
        "--model",
        "deepseek-v2-lite",
        "--hardware",
        "h200",
    ]
    args += ["--phase", "decode", "--step-tokens", "8", "--context-len", "1024", "--dispatch", "even"]
    capsys.readouterr()
    assert main([*args, "--overlap", overlap, "--json"]) == 0
    return json.loads(capsys.readouterr().out)["step_time"]


def test_layout_and_evaluate_give_the_same_step_time(tmp_path, capsys):
    """The layout's written placement, evaluated on the same trace, model, hardware, phase, tokens per
    rank, context and overlap, gets the step time and range the plan reported (one cost model)."""
    from placement.formats import write_placement
    from profiling.readers import write_trace
    from profiling.synthetic import synthetic_trace

    lite = load_model("deepseek-v2-lite")
    tr = synthetic_trace(
        num_tokens=1600, num_layers=26, num_logical_experts=64, top_k=6, num_prompts=60, seed=3
    )
    trace_path = tmp_path / "t.npz"
    write_trace(tr, trace_path)
    out = tmp_path / "plan"
    flags = ["--model", "deepseek-v2-lite", "--nodes", "2", "--hardware", "h200", "--phase", "decode"]
    flags += ["--step-tokens", "8", "--context-len", "1024", "--trace", str(trace_path), "--no-phase-compare"]
    capsys.readouterr()
    assert main(["layout", *flags, "--output", str(out)]) == 0
    best = json.loads((out / "layout.json").read_text())["results"][0]
    st = _evaluate_step_time(
        capsys, out / "placement.json", trace_path, "on" if best["two_batch_overlap"] else "off"
    )
    assert st["whole_ms"] == pytest.approx(best["step_time_ms"], rel=1e-9)
    assert st["whole_ms_range"] == pytest.approx(best["step_time_ms_range"], rel=1e-9)
    assert st["tokens_per_s_per_gpu"] == pytest.approx(best["tokens_per_s_per_gpu"], rel=1e-9)
    # a layout spanning both nodes (RDMA in the all-to-all), overlap off, from the library
    plan = plan_layout(
        lite, cluster_preset("h200"), 2, CostOptions(step_tokens=8, context_len=1024, overlap="off"), trace=tr
    )
    wide = next(r for r in plan.feasible if r.candidate.ep_size == 16)
    write_placement(wide.placement, tmp_path / "wide.json")
    st = _evaluate_step_time(capsys, tmp_path / "wide.json", trace_path, "off")
    assert st["whole_ms"] == pytest.approx(wide.cost.step_time * 1e3, rel=1e-9)
    assert st["num_steps"] == wide.cost.time.num_steps > 1
