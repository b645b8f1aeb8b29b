"""Ranges until calibrated: the constant sets are the fit of the published DeepEP tables, every set
reproduces them within the stated tolerance, and every modelled time and gain is a range with
low <= central <= high, gains taken set by set."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from placement.cost import ranges
from placement.cost.hardware import GPUS, LINKS, cluster_preset, hardware_summary
from placement.cost.modelspec import load_model
from placement.cost.ranges import Range3, cluster_sets, gain_range, set_values, value_range
from placement.cost.step_time import StepOptions, price_loads, step_loads
from placement.model import Placement
from placement.steps import make_steps
from placement.topology import Topology
from profiling.synthetic import synthetic_trace

ROOT = Path(__file__).resolve().parents[1]
LITE = load_model("deepseek-v2-lite")


def _benchmark():
    spec = importlib.util.spec_from_file_location(
        "step_model_check_fit", ROOT / "benchmarks" / "step_model_check.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def fit():
    return _benchmark().derive_sets()


def test_stored_sets_are_the_fit_of_the_published_tables(fit):
    """placement/cost/ranges.py and the presets hold exactly what the benchmark derives from the tables."""
    ll, nm, nvl = fit["rdma-low-latency"], fit["rdma-normal"], fit["nvlink-low-latency"]
    rdma = LINKS["rdma"]
    for end in ("low", "high"):
        assert (ll[end]["latency"], ll[end]["bandwidth"]) == pytest.approx(ranges.RDMA_LOW_LATENCY[end])
        assert (nm[end]["latency"], nm[end]["bandwidth"]) == pytest.approx(ranges.RDMA_NORMAL[end])
        assert nvl[end]["latency"] == pytest.approx(ranges.NVLINK_LOW_LATENCY_LATENCY[end])
    assert (ll["central"]["latency"], ll["central"]["bandwidth"]) == pytest.approx(
        (rdma.latency, rdma.bandwidth)
    )
    assert nm["central"]["bandwidth"] == pytest.approx(rdma.kernel("normal")[0])
    assert nm["central"]["latency"] == pytest.approx(rdma.kernel("normal")[1])
    assert [g.nvlink.latency for g in GPUS.values()] == pytest.approx([nvl["central"]["latency"]] * len(GPUS))
    # every kept set reproduces every figure of every table within the tolerance; the ends differ
    for sets in fit.values():
        for end in ranges.SET_NAMES:
            assert max(sets[end]["errors"].values()) <= ranges.FIT_TOLERANCE + 1e-12, sets[end]
        assert sets["low"]["latency"] < sets["central"]["latency"] < sets["high"]["latency"]
    # the NVLink-era table (the model's accounting) is fitted far better at the centre than at the ends
    assert ll["central"]["errors"]["ll-nvlink"] < 0.03 < ll["high"]["errors"]["ll-nvlink"]


def test_a_tolerance_no_set_meets_is_refused_and_a_looser_one_keeps_more():
    bench = _benchmark()
    with pytest.raises(ValueError, match="no constant set reproduces"):
        bench.derive_sets(tolerance=0.03)  # the legacy table is at best 4.9% off
    tight, loose = bench.derive_sets(tolerance=0.08), bench.derive_sets(tolerance=0.12)
    for name in tight:
        assert tight[name]["kept"] < loose[name]["kept"]
        assert loose[name]["low"]["latency"] <= tight[name]["low"]["latency"]
        assert loose[name]["high"]["latency"] >= tight[name]["high"]["latency"]


def test_cluster_sets_published_measured_and_unfitted_links(tmp_path):
    cl = cluster_preset("h200")
    sets = cluster_sets(cl)
    assert tuple(sets) == ranges.SET_NAMES and sets["central"] is cl
    assert (sets["low"].inter.latency, sets["low"].inter.bandwidth) == ranges.RDMA_LOW_LATENCY["low"]
    assert sets["high"].inter.kernel("normal") == (
        ranges.RDMA_NORMAL["high"][1],
        ranges.RDMA_NORMAL["high"][0],
    )
    assert sets["high"].intra.latency == ranges.NVLINK_LOW_LATENCY_LATENCY["high"]
    assert all(s.gpu == cl.gpu for s in sets.values())  # GEMM constants are the same in every set
    # a link without a published table spans its documented band, latency unchanged
    eth = cluster_sets(cluster_preset("h100", intra="pcie5", inter="ethernet"))
    assert (
        eth["low"].inter.bandwidth == LINKS["ethernet"].band[0]
        and eth["high"].intra.bandwidth == LINKS["pcie5"].band[1]
    )
    assert eth["low"].inter.latency == LINKS["ethernet"].latency
    # a measured preset is its own only set, and says so
    p = tmp_path / "gpu.json"
    p.write_text(json.dumps({"base": "h200", "provenance": {"times_s": [1e-5]}}))
    measured = cluster_preset(str(p))
    assert list(cluster_sets(measured)) == ["central"] and hardware_summary(measured)["measured"]
    assert value_range(lambda c: c.inter.latency, measured) == (LINKS["rdma"].latency,) * 3


def test_value_range_is_ordered_and_gains_are_taken_set_by_set():
    cl = cluster_preset("h200")
    r = value_range(lambda c: -((c.inter.latency - 36e-6) ** 2), cl)  # not monotone in the constants
    assert r.low <= r.central <= r.high and r.high == pytest.approx(-((35.5e-6 - 36e-6) ** 2))
    base = {"low": 10.0, "central": 10.0, "high": 12.0}
    opt = {"low": 9.0, "central": 9.5, "high": 12.0}
    g = gain_range(base, opt)
    assert g == pytest.approx(Range3(0.0, 10 / 9.5 - 1, 10 / 9 - 1))
    # combining extremes (the least baseline over the most option) is not a gain any set gives
    assert g.low > min(base.values()) / max(opt.values()) - 1
    with pytest.raises(ValueError, match="different sets"):
        gain_range(base, {"central": 1.0})
    assert Range3.of({"central": 2.0, "a": 1.0}).span() == [1.0, 2.0]


def test_every_modelled_time_and_gain_has_its_range_uncalibrated():
    """Decode and prefill on 2 nodes, no balancing vs a replicated map and vs the per-step split: each
    time and each gain has low <= central <= high, priced on the same loads on every set."""
    from solver.greedy import greedy_placement

    tr = synthetic_trace(
        num_tokens=2048, num_layers=2, num_logical_experts=64, top_k=6, num_prompts=64, seed=1
    )
    none = Placement.trivial(2, 64, Topology(16, 64, 2))
    static = greedy_placement(tr.counts(), Topology(16, 80, 2))[0]
    cl = cluster_preset("h200")
    for phase, b in (("decode", 8), ("prefill", 32)):
        steps = make_steps(tr, 16, phase, b)
        times = {}
        for key, pl, disp in (
            ("none", none, "even"),
            ("static", static, "even"),
            ("balanced", static, "balanced"),
        ):
            loads = step_loads(pl, tr, steps, disp, LITE, cl)
            times[key] = set_values(
                lambda c, lo=loads, d=disp, ph=phase: price_loads(lo, LITE, c, phase=ph, dispatch=d).whole_ms,
                cl,
            )
            t = Range3.of(times[key])
            assert t.low <= t.central <= t.high and t.low < t.high
        for new in ("static", "balanced"):
            g = gain_range(times["none"], times[new])
            assert g.low <= g.central <= g.high and g.low < g.high, (phase, new, g)


def test_kernel_and_overlap_are_explicit_inputs():
    """A launch that selects the low-latency kernels for prefill is priced with them; overlap on/off too."""
    tr = synthetic_trace(
        num_tokens=2048, num_layers=2, num_logical_experts=64, top_k=6, num_prompts=64, seed=2
    )
    pl = Placement.trivial(2, 64, Topology(16, 64, 2))
    cl = cluster_preset("h200")
    steps = make_steps(tr, 16, "prefill", 64)
    by_phase = step_loads(pl, tr, steps, "even", LITE, cl)
    ll = step_loads(pl, tr, steps, "even", LITE, cl, kernel="low_latency")
    assert (by_phase.kernel, ll.kernel) == ("normal", "low_latency")
    # one copy per pick off the GPU moves more than the node-deduplicated kernels
    assert ll.send[..., 1].sum() > by_phase.send[..., 1].sum()
    a = price_loads(ll, LITE, cl, phase="prefill", options=StepOptions(kernel="low_latency"))
    b = price_loads(by_phase, LITE, cl, phase="prefill")
    assert a.kernel == "low_latency" and b.kernel == "normal" and a.a2a_ms != b.a2a_ms
    with pytest.raises(ValueError, match="counted for the normal kernels"):
        price_loads(by_phase, LITE, cl, phase="prefill", options=StepOptions(kernel="low_latency"))
    off = price_loads(by_phase, LITE, cl, phase="prefill", options=StepOptions(overlap=False))
    on = price_loads(by_phase, LITE, cl, phase="prefill", options=StepOptions(overlap=True))
    auto = price_loads(by_phase, LITE, cl, phase="prefill", options=StepOptions(overlap="auto"))
    assert not off.two_batch_overlap and on.two_batch_overlap and off.overlap_saving_ms == 0
    assert on.whole_ms == pytest.approx(
        on.moe_ms + on.dispatch_overhead_ms + on.rest_ms - on.overlap_saving_ms
    )
    assert auto.whole_ms == pytest.approx(min(on.whole_ms, off.whole_ms))
    with pytest.raises(ValueError, match="two-batch overlap"):
        StepOptions(overlap="sometimes")


def test_ranges_are_cheap_because_loads_do_not_depend_on_the_constants():
    """The loads counted on one cluster set are the loads of every set (hardware does not count bytes)."""
    tr = synthetic_trace(
        num_tokens=1024, num_layers=1, num_logical_experts=64, top_k=6, num_prompts=32, seed=4
    )
    pl = Placement.trivial(1, 64, Topology(16, 64, 2))
    steps = make_steps(tr, 16, "decode", 8)
    sets = cluster_sets(cluster_preset("h200"))
    loads = {k: step_loads(pl, tr, steps, "even", LITE, c) for k, c in sets.items()}
    for k in loads:
        np.testing.assert_array_equal(loads[k].send, loads["central"].send)
    slower = dataclasses.replace(
        sets["central"], inter=dataclasses.replace(sets["central"].inter, latency=1e-3)
    )
    assert (
        price_loads(loads["central"], LITE, slower, phase="decode").a2a_ms
        > price_loads(loads["central"], LITE, sets["central"], phase="decode").a2a_ms
    )
