"""The cost package's side of ``calibrate`` (numpy, no ranks): the message plans are the step-time model's
traffic, the fits recover known constants and tell whether time follows the busiest receiver, and a
hardware preset is "measured" only when it carries measured figures, which are then the ones priced."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from placement.cost.calibration import (
    a2a_points,
    fit_gemm,
    fit_link,
    gemm_work,
    routed_points,
    routed_traffic,
    skewed_topk,
    sweep,
)
from placement.cost.hardware import GPUS, LINKS, cluster_preset, hardware_summary, load_hardware_preset
from placement.cost.modelspec import load_model
from placement.cost.primitives import a2a_time
from placement.cost.traffic import traffic_bytes

V3 = load_model("deepseek-v3")


# ---- message plans ------------------------------------------------------------------------------
def test_plan_sizes_are_the_step_time_models_traffic_and_skew_is_exact():
    points, notes = a2a_points(V3, 8, 4, quick=True, max_rank_bytes=1e12)
    assert notes == [] and {p.link for p in points} == {"intra", "inter"}
    for p in points:
        if p.skew != 1.0:
            # the busiest receiver gets skew x the mean receiver (rounding to whole bytes aside)
            assert p.recv.max() == pytest.approx(p.skew * p.mean_recv, rel=1e-6) and p.recv.argmax() == 0
            continue
        kernel = "low_latency" if p.phase == "decode" else "normal"
        payload = V3.dispatch_bytes_per_token if p.op == "dispatch" else V3.combine_bytes_per_token
        picks = np.full((1, 8, 8), p.step_tokens * V3.top_k / 8)
        send, _ = traffic_bytes(picks, np.full((1, 8), float(p.step_tokens)), 4, V3.top_k, kernel, payload)
        col = 0 if p.link == "intra" else 1
        np.testing.assert_allclose(p.send, send[0, :, col], atol=8)  # each rank's link bytes, as priced
        assert np.all(np.diag(p.splits) == 0)
        if p.link == "inter" and kernel == "normal":  # one copy per remote node, to the same-index GPU
            assert all(set(np.flatnonzero(p.splits[i])) == {(i + 4) % 8} for i in range(8))


def test_plan_leaves_out_what_does_not_fit_and_caps_skew_at_all_to_one():
    points, notes = a2a_points(V3, 4, 4, quick=True, max_rank_bytes=20e6)
    assert notes and all("buffer limit" in n for n in notes)
    assert max(max(p.send.max(), p.recv.max()) for p in points) <= 20e6
    two, _ = a2a_points(V3, 2, 2, quick=True, max_rank_bytes=1e12)
    assert sorted({p.skew for p in two}) == [1.0, 2.0]  # 2.5 x the mean of two receivers cannot exist
    with pytest.raises(ValueError, match="multiple of gpus_per_node"):
        a2a_points(V3, 6, 4, quick=True, max_rank_bytes=1e12)


def test_routed_points_draw_distinct_experts_toward_the_hot_receiver():
    pts = routed_points(8, 4, quick=True)
    p = next(q for q in pts if q["link"] == "inter" and q["phase"] == "decode" and q["skew"] == 2.5)
    rng = np.random.default_rng(0)
    rows = []
    for r in range(8):
        ids = skewed_topk(rng, r, 8, 4, p, V3.top_k, 256)
        assert ids.shape == (p["step_tokens"], 8)
        assert all(len(set(row)) == 8 for row in ids.tolist())  # distinct picks per token
        assert set((ids // 32).ravel()) <= set(range(8)) - set(
            range(r // 4 * 4, r // 4 * 4 + 4)
        )  # remote only
        rows.append(np.bincount(ids.ravel() // 32, minlength=8))
    picks = np.array(rows, dtype=float)
    recv = picks.sum(axis=0)
    assert recv[0] > 1.5 * np.delete(recv, 0).max()  # rank 0 is the hot receiver
    busiest, mean = routed_traffic(picks, p["step_tokens"], 4, V3.top_k, "decode", 7392.0, "inter")
    assert busiest == pytest.approx(recv.max() * 7392.0) and mean == pytest.approx(recv.mean() * 7392.0)


# ---- fits ---------------------------------------------------------------------------------------
def _sweep_times(follow: str, lat=40e-6, bw=50e9, noise=0.01, seed=0):
    """Times of a skew sweep that follow the busiest receiver's bytes or the mean's."""
    rng = np.random.default_rng(seed)
    busiest, mean, group, t = [], [], [], []
    for g, size in enumerate((0.5e6, 1e6, 2e6, 4e6)):
        for skew in (1.0, 1.5, 2.0, 2.5):
            b = size * skew
            x = b if follow == "busiest" else size
            busiest.append(b), mean.append(size), group.append(g)
            t.append((lat + x / bw) * np.exp(rng.normal(0, noise, 5)))
    return np.array(busiest), np.array(mean), np.array(t), np.array(group)


def test_link_fit_recovers_latency_bandwidth_and_says_time_follows_the_busiest_receiver():
    b, m, t, g = _sweep_times("busiest")
    f = fit_link(b, m, t, g)
    assert f.latency_s == pytest.approx(40e-6, rel=0.1) and f.bytes_per_s == pytest.approx(50e9, rel=0.05)
    assert f.skew_slope == pytest.approx(1.0, abs=0.1) and f.r2 > 0.99 and f.r2 > f.mean_r2
    assert f.band[0] <= f.bytes_per_s <= f.band[1]
    # a link where skew costs nothing: the slope at fixed size is ~0 and the mean explains time better
    b, m, t, g = _sweep_times("mean")
    f = fit_link(b, m, t, g)
    assert abs(f.skew_slope) < 0.1 and f.mean_r2 > 0.99 > f.r2


def test_link_fit_states_what_it_could_not_identify():
    flat = fit_link(np.array([1e6, 2e6, 4e6]), np.array([1e6, 2e6, 4e6]), np.full((3, 3), 1e-3), np.arange(3))
    assert "lower bound" in flat.note and flat.bytes_per_s == pytest.approx(4e9) and flat.latency_s == 0.0
    assert flat.skew_slope is None  # no two skews of one size
    with pytest.raises(ValueError, match="two points"):
        fit_link(np.array([1.0]), np.array([1.0]), np.ones((1, 3)), np.zeros(1))


def test_gemm_fit_recovers_the_roofline_constants():
    n = np.array([1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048.0])
    F, M = gemm_work(7168, 2048, 8, n, 1.0)
    t = (np.maximum(F / 1.0e15, M / 4.0e12) + 5e-6) * np.exp(np.random.default_rng(1).normal(0, 0.02, n.size))
    f = fit_gemm(F, M, t)
    assert f.flops_per_s == pytest.approx(1e15, rel=0.1) and f.bytes_per_s == pytest.approx(4e12, rel=0.1)
    assert f.overhead_s == pytest.approx(5e-6, rel=0.5) and f.rms_log_error < 0.05
    # only memory-bound points: the compute figure is not identified rather than invented
    g = fit_gemm(F[:4], M[:4], M[:4] / 4e12 + 5e-6)
    assert g.flops_per_s is None and g.bytes_per_s == pytest.approx(4e12, rel=0.01)
    with pytest.raises(ValueError, match="three or more"):
        fit_gemm(F[:2], M[:2], t[:2])


def test_sweep_quick_is_smaller():
    q, full = sweep(True), sweep(False)
    assert q["repeats"] < full["repeats"] and len(q["decode"]) < len(full["decode"])
    assert max(full["prefill"]) >= 4096 and min(q["prefill"]) >= 1024  # prefill: thousands of tokens


# ---- presets: measured means measured figures, and those are priced -------------------------------
def _write(tmp_path, name: str, d: dict):
    p = tmp_path / name
    p.write_text(json.dumps(d))
    return p


def test_measured_links_are_priced_and_named_links_win(tmp_path):
    intra = {"bandwidth": 2e9, "latency": 1e-3, "normal_bandwidth": 1e9, "normal_latency": 2e-3}
    p = _write(
        tmp_path,
        "p.json",
        {"base": "h200", "name": "x", "intra": intra, "provenance": {"measured": ["a2a_intra"]}},
    )
    cl = cluster_preset(str(p), gpus_per_node=4)
    assert hardware_summary(cl) == {"preset": str(p), "measured": True, "measured_parts": ["a2a_intra"]}
    assert (cl.intra.bandwidth, cl.intra.latency, cl.intra.kernel("normal")) == (2e9, 1e-3, (1e9, 2e-3))
    assert cl.inter == LINKS["rdma"] and cl.gpu.nvlink == cl.intra
    assert float(a2a_time(cl, 4e6, 0.0, 1, 4)) == pytest.approx(1e-3 + 4e6 / 2e9)
    named = cluster_preset(str(p), intra="nvlink4", gpus_per_node=4)
    assert (
        named.intra == LINKS["nvlink4"]
        and not named.measured
        and hardware_summary(named)["measured_parts"] == []
    )
    assert (
        not cluster_preset("h200").measured and hardware_summary(cluster_preset("H200"))["preset"] == "h200"
    )


def test_a_json_preset_is_measured_only_with_measured_figures(tmp_path):
    hand = _write(tmp_path, "hand.json", {"base": "h100", "eta_compute": 0.5})
    assert not cluster_preset(str(hand)).measured  # a hand-written JSON is not a measurement
    legacy = _write(
        tmp_path,
        "fit.json",
        {
            "base": "h200",
            "eta_compute": 0.5,
            "eta_memory": 0.8,
            "gemm_overhead": 4e-6,
            "provenance": {"times_s": [1e-5, 2e-5]},
        },
    )
    cl = cluster_preset(str(legacy))
    assert cl.measured and cl.gpu.calibrated and load_hardware_preset(legacy).measured == ("gemm",)
    cpu_gemm = _write(
        tmp_path, "cpu.json", {"base": "h200", "provenance": {"measured": [], "gemm": {"applied": False}}}
    )
    cpu = cluster_preset(str(cpu_gemm)).gpu
    assert not cluster_preset(str(cpu_gemm)).measured and not cpu.calibrated
    assert replace(cpu, source="", provenance={}) == replace(GPUS["h200"], source="", provenance={})


@pytest.mark.parametrize(
    "extra, needle",
    [
        ({"provenance": {"measured": ["a2a_intra"]}}, "no 'intra' section"),
        ({"provenance": {"measured": ["nvlink"]}}, "accepted"),
        ({"provenance": {"measured": "a2a_intra"}}, "list of names"),
        ({"provenance": {"measured": ["gemm"]}}, "lacks one of"),
        ({"intra": {"bandwidth": 1e9}}, "needs ['latency']"),
        ({"intra": {"bandwidth": -1.0, "latency": 1e-5}}, "bandwidth"),
        ({"intra": {"bandwidth": 1e9, "latency": 1e-5, "speed": 3}}, "unknown 'intra' keys"),
        ({"inter": [1, 2]}, "JSON object"),
    ],
)
def test_bad_preset_is_one_line_naming_the_file(tmp_path, extra, needle):
    p = _write(tmp_path, "bad.json", {"base": "h200", **extra})
    with pytest.raises(ValueError) as info:
        cluster_preset(str(p))
    msg = str(info.value)
    assert needle in msg and str(p) in msg and "\n" not in msg


def test_cluster_measured_parts_are_checked():
    cl = cluster_preset("h200")
    with pytest.raises(ValueError, match="measured_parts"):
        replace(cl, measured_parts=("nvlink",))
