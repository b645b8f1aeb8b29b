"""The per-step fit for a phase (``solver/step/fit.py`` with ``solver/step/cost.py``): steps of the phase,
modelled step time as the objective, and the pipeline's gate on it."""

from __future__ import annotations

import numpy as np
import pytest

from placement.cost.hardware import cluster_preset
from placement.cost.modelspec import load_model
from placement.steps import make_steps, step_counts
from placement.topology import Topology
from profiling.synthetic import synthetic_trace
from profiling.trace import RoutingTrace
from solver.api import FitOptions, solve
from solver.step.cost import StepCost, layer_seconds, model_for_trace, step_cost_for
from solver.step.fit import sample_step_counts

MIXTRAL = load_model("mixtral-8x7b")


def mixtral_like(seed: int = 0, T: int = 6000) -> RoutingTrace:
    """8 experts, top-2 (Mixtral's shape), prompts with topics."""
    return synthetic_trace(
        num_tokens=T,
        num_layers=4,
        num_logical_experts=8,
        top_k=2,
        num_prompts=60,
        num_clusters=2,
        affinity=6.0,
        seed=seed,
    )


def test_the_trace_shape_picks_the_model_and_a_wrong_model_is_refused():
    tr = mixtral_like()
    assert model_for_trace(tr).name == MIXTRAL.name
    assert (
        step_cost_for(
            synthetic_trace(num_tokens=500, num_layers=2, num_logical_experts=16, top_k=2, seed=1),
            "decode",
            8,
        )
        is None
    )
    with pytest.raises(ValueError, match="has 64 experts, top-6; the trace has 8, top-2"):
        step_cost_for(tr, "decode", 2, model="deepseek-v2-lite")


def test_decode_time_counts_active_experts_not_only_tokens():
    """Memory-bound decode: a GPU that reads a second expert for one token is slower than one that
    takes that token on an expert it already reads."""
    cost = StepCost(MIXTRAL, cluster_preset("h200", gpus_per_node=2), "decode")
    p2l = np.array([0, 1, 2, 3, 4, 5, 6, 7])  # 4 GPUs x 2 slots
    counts = np.zeros((1, 4, 8))
    counts[0, :, 0] = 4  # every rank sends 4 picks to expert 0 (GPU 0)
    one = np.zeros((1, 8))
    one[0, 0] = 16
    spread = one.copy()
    spread[0, 0], spread[0, 1] = 15, 1  # pretend one token sits on a second active expert of GPU 0
    t_one = layer_seconds(cost, one, counts, p2l, 2)
    t_two = layer_seconds(cost, spread, counts, p2l, 2)
    assert t_two[0] > t_one[0]


def test_decode_samples_are_decode_steps():
    tr = mixtral_like()
    c = sample_step_counts(tr, 4, 8, None, 3, "decode", per_rank=True)
    st = make_steps(tr, 4, "decode", 8, seed=3)
    assert np.array_equal(c, step_counts(tr, st).transpose(0, 1, 2, 3))
    more = sample_step_counts(tr, 4, 8, st.num_steps + 50, 3, "decode")
    assert more.shape[0] == st.num_steps + 50  # more steady-state starts fill the sample


@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_fit_for_a_phase_prices_its_steps_and_never_loses_to_greedy(phase):
    tr = mixtral_like()
    topo = Topology(ep_size=4, num_physical_experts=12, num_nodes=2)
    fo = FitOptions(step_tokens=16, step_moves=40, phase=phase)
    res = solve("greedy", topology=topo, trace=tr, dispatch="balanced", fit=fo)
    fit = res.fit
    assert fit is not None and fit.phase == phase and fit.cost is not None and fit.cost.phase == phase
    assert any(f"modelled {phase} step time" in n for n in res.report.notes)
    assert fit.score(res.placement) <= fit.score(res.baseline) * (1 + 1e-12)
    if fit.changed_layers:
        assert fit.time_after_us < fit.time_before_us
        assert fit.validation_peak_after <= fit.validation_peak_before


def test_no_model_for_the_shape_balances_the_peak_and_says_so():
    tr = synthetic_trace(
        num_tokens=4000, num_layers=2, num_logical_experts=16, top_k=2, num_prompts=40, seed=2
    )
    topo = Topology(ep_size=4, num_physical_experts=20, num_nodes=1)
    res = solve("greedy", topology=topo, trace=tr, dispatch="balanced", fit=FitOptions(step_moves=20))
    assert res.fit.cost is None
    assert any("balances the step peak only" in n for n in res.report.notes)


@pytest.mark.parametrize("dispatch", ["balanced", "sglang-lp"])
def test_steps_with_no_spread_or_a_silent_layer_solve(dispatch):
    """Every step alike (no per-step spread) and a layer that routes nothing used to die in numpy's
    'probabilities do not sum to 1'; both must give a valid placement."""
    T = 2000
    ids = np.tile(np.array([[0, 1], [2, 3]]), (T // 2, 1))[:, None, :].repeat(2, axis=1)  # [T, 2, 2]
    ids[:, 1, :] = -1  # layer 1 routes nothing
    tr = RoutingTrace(8, topk_ids=ids, seq_offsets=np.arange(0, T + 1, 50))
    topo = Topology(ep_size=4, num_physical_experts=12, num_nodes=2)
    for phase in ("decode", "prefill"):
        res = solve(
            "greedy", topology=topo, trace=tr, dispatch=dispatch, fit=FitOptions(step_moves=20, phase=phase)
        )
        assert res.placement.physical_to_logical_map.shape == (2, 12)
        assert np.all(res.placement.logical_replica_count >= 1)


def test_fit_options_refuse_an_unknown_phase():
    with pytest.raises(ValueError, match="FitOptions.phase must be one of decode, prefill"):
        FitOptions(phase="train")
    assert FitOptions(phase="prefill").phase_step_tokens == 256 and FitOptions().phase_step_tokens == 64


def test_cli_names_the_phase_in_evaluate_and_solve(tmp_path, capsys):
    import json

    from moe_placement.cli.main import main
    from profiling.readers import write_trace

    tr = mixtral_like()
    write_trace(tr, str(tmp_path / "t.npz"))
    out = tmp_path / "p.json"
    args = ["solve", "--trace", str(tmp_path / "t.npz"), "--ep-size", "4", "--num-nodes", "2"]
    args += ["--num-redundant", "4", "--dispatch", "balanced", "--fit-fraction", "0.5", "-o", str(out)]
    assert main([*args, "--phase", "prefill", "--step-tokens", "16"]) == 0
    text = capsys.readouterr().out
    assert "held-out step PAR (balanced, prefill, 16/rank)" in text
    assert "modelled prefill step time (mixtral-8x7b" in text
    for phase, tokens in (("decode", 64), ("prefill", 256)):
        assert main(["evaluate", str(out), str(tmp_path / "t.npz"), "--phase", phase, "--json"]) == 0
        d = json.loads(capsys.readouterr().out)
        assert d["phase"] == phase and d["step_tokens"] == tokens and isinstance(d["notes"], list)
    assert main(["evaluate", str(out), str(tmp_path / "t.npz")]) == 0
    assert "on decode steps, 64 tokens per rank" in capsys.readouterr().out


def test_layout_takes_step_tokens_as_its_tokens_per_rank():
    from moe_placement.cli.main import build_parser

    base = ["layout", "--model", "deepseek-v3", "--nodes", "1"]
    assert build_parser().parse_args([*base, "--step-tokens", "32"]).step_tokens == 32
    assert build_parser().parse_args([*base, "--batch-per-rank", "48"]).step_tokens == 48


def test_a_gated_solver_keeps_greedy_when_its_fitted_time_is_higher():
    tr = mixtral_like(seed=3)
    topo = Topology(ep_size=4, num_physical_experts=12, num_nodes=2)
    res = solve(
        "cpsat",
        topology=topo,
        trace=tr,
        dispatch="balanced",
        time_limit=4.0,
        fit=FitOptions(step_tokens=16, step_moves=20),
    )
    assert res.fit is not None and res.fit.cost is not None
    assert res.fit.score(res.placement) <= res.fit.score(res.baseline) * (1 + 1e-9)
    if res.placement is res.baseline or res.placement.provenance.get("fallback_from"):
        assert any("kept" in n for n in res.report.notes)
