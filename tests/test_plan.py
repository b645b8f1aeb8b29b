"""``plan`` (issue 41): the KV hand-off priced in the one cost model, the request-level simulator, the
goodput search and the deployment decision. Small searches and few requests: the figures are compared
with each other and with hand computations, never with numbers copied from a run."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from moe_placement.apps.deploy import DeployOptions, plan
from moe_placement.apps.deploy.options import COLOCATED, DISAGGREGATED, REPLICAS
from moe_placement.apps.deploy.simulator import (
    DeploymentSim,
    PoolSim,
    PoolView,
    RouteRequest,
    simulate,
    zero_load,
)
from moe_placement.apps.deploy.tables import StepTable, powers_of_two
from moe_placement.apps.deploy.workloads import Requests, load_workload, sample_requests
from placement.cost.handoff import (
    HandoffSpec,
    bytes_per_s_from_bits_per_s,
    handoff_time,
    kv_handoff_bytes,
    parse_rate,
)
from placement.cost.hardware import LINKS, cluster_preset
from placement.cost.modelspec import ModelSpec

# Small searches: few requests, one chunk size, two bisection steps, 32 sequences per rank.
SMALL = dict(
    requests=100,
    max_requests=2500,
    colocated_step_tokens=(512,),
    search_iters=2,
    decode_step_tokens=32,
    max_splits=1,
)


def _options(**kw) -> DeployOptions:
    return DeployOptions(**{**SMALL, **kw})


# ---------------------------------------------------------------------------------------------
# the hand-off in the one cost model
# ---------------------------------------------------------------------------------------------
def test_the_issue_example_is_one_gib_and_43_ms_at_25_gb_per_s():
    shape = dict(hidden_size=4096, moe_intermediate_size=1024, num_logical_experts=8, top_k=2)
    m = ModelSpec(name="32-layer-gqa", num_layers=32, moe_layer_ids=tuple(range(32)), **shape)
    assert (m.num_kv_heads, m.head_dim, m.kv_cache_bytes) == (8, 128, 2.0)  # GQA, 8 KV heads x 128, BF16
    nbytes = kv_handoff_bytes(m, 8192)
    assert nbytes == 2 * 8 * 128 * 2 * 32 * 8192 == 1 << 30
    rate = bytes_per_s_from_bits_per_s(200e9)  # "200 Gbit/s" is 25 GB/s
    assert rate == parse_rate("200Gbit/s") == parse_rate("25GB/s") == 25e9
    h = handoff_time(HandoffSpec(rate, fixed_s=0.0), nbytes)
    assert h.transfer_s == pytest.approx(nbytes / 25e9) and 42e-3 < h.transfer_s < 44e-3
    assert h.exposed_s == h.transfer_s  # sent after the prefill: nothing hidden


def test_a_rate_must_say_bits_or_bytes():
    with pytest.raises(ValueError, match="bits per second"):
        parse_rate("25")
    assert parse_rate("400Gbps") == parse_rate("50GB/s") and parse_rate("1GiB/s") == 2**30


def test_layer_streaming_hides_the_transfer_behind_the_following_layers():
    spec = HandoffSpec(25e9, fixed_s=1e-3, streaming="layer")
    nbytes, layers = float(1 << 30), 32
    x = nbytes / 25e9
    long_prefill = handoff_time(spec, nbytes, prefill_s=1.0, pieces=layers)
    assert long_prefill.exposed_s == pytest.approx(1e-3 + x / layers)  # only the last layer's share is left
    short_prefill = handoff_time(spec, nbytes, prefill_s=0.01, pieces=layers)
    assert short_prefill.exposed_s == pytest.approx(1e-3 + x - 0.01 * (layers - 1) / layers)
    assert handoff_time(spec, nbytes, prefill_s=1.0, pieces=1).exposed_s == pytest.approx(1e-3 + x)


# ---------------------------------------------------------------------------------------------
# the simulator
# ---------------------------------------------------------------------------------------------
def _table(kv_cap: float = 2e5, chunk: int = 4096, longest: int = 4096) -> StepTable:
    """An affine toy table: decode 20 ms + 10 us per sequence + 20 ns per cached token; prefill 10 ms +
    50 us per token + a little per token of attention span."""
    seqs, kvs = [float(s) for s in powers_of_two(64)], list(np.linspace(0, kv_cap, 9))
    dec = np.array([[0.02 + 1e-5 * s + 2e-8 * k for k in kvs] for s in seqs])
    toks, ctx = [float(c) for c in powers_of_two(chunk)], list(np.linspace(1, 2 * longest, 9))
    pre = np.array([[0.01 + 5e-5 * c + 1e-9 * c * x for x in ctx] for c in toks])
    return StepTable(seqs, kvs, dec, toks, ctx, pre)


def _colocated(chunk: int = 1024, kv: int = 200_000, engines: int = 2, dp: int = 4) -> DeploymentSim:
    return DeploymentSim((PoolSim("both", engines, dp, kv, chunk, 64, _table()),))


def _split(link: float = 45e9, streaming: str = "layer") -> DeploymentSim:
    pools = (
        PoolSim("prefill", 2, 1, 200_000, 4096, 64, _table()),
        PoolSim("decode", 1, 4, 200_000, 4096, 64, _table()),
    )
    return DeploymentSim(pools, HandoffSpec(link, fixed_s=1e-3, streaming=streaming), 70_000.0, 61)


def _alone(prompt: int, output: int, n: int = 12) -> Requests:
    """``n`` requests of one shape, far apart (each alone on the deployment)."""
    return Requests(np.full(n, prompt), np.full(n, output), np.arange(n, dtype=np.float64) * 1e3)


def test_a_table_of_one_row_prices_every_size_as_that_row():
    """A cap of one sequence (or a chunk of one token) gives a one-point axis: it prices flat along it,
    never an IndexError."""
    one = StepTable(
        [1.0], [0.0, 100.0], np.array([[0.02, 0.03]]), [1.0], [1.0, 9.0], np.array([[0.01, 0.05]])
    )
    assert one.decode(1, 50.0) == pytest.approx(0.025) and one.decode(4, 100.0) == pytest.approx(0.03)
    assert one.decode_run(1, 0.0, 3).tolist() == pytest.approx([0.02, 0.0201, 0.0202])
    assert one.prefill(1, 5.0) == pytest.approx(0.03) and one.scaled(2.0).decode(1, 0.0) == pytest.approx(
        0.04
    )


@pytest.mark.parametrize(
    "dep", [_colocated(), _split(), _split(streaming="none")], ids=["co-located", "split", "unstreamed"]
)
def test_at_a_near_zero_rate_ttft_is_prefill_plus_handoff_and_tpot_one_decode_step(dep):
    prompt, output = 3000, 200
    res = simulate(dep, _alone(prompt, output), rate=1.0)
    first = dep.pools[0]
    # by hand: chunks of step_tokens, each priced by the table at its attention span
    pre, done, chunks = 0.0, 0, 0
    while done < prompt:
        take = min(prompt - done, first.step_tokens)
        pre += first.table.prefill(take, 2 * done + take)
        done, chunks = done + take, chunks + 1
    hand = 0.0
    if dep.handoff is not None:
        pieces = {"layer": dep.layers, "chunk": chunks, "none": 1}[dep.handoff.streaming]
        hand = handoff_time(dep.handoff, dep.kv_bytes_per_token * prompt, pre, pieces).exposed_s
    steps = dep.pools[-1].table.decode_run(1.0, float(prompt), output - 1)  # context grows a token a step
    # times are absolute (requests 1,000 s apart): a nanosecond of float rounding is allowed
    np.testing.assert_allclose(res.ttft, pre + hand, rtol=0, atol=1e-9)
    np.testing.assert_allclose(res.tpot, steps.mean(), rtol=0, atol=1e-9)
    z = zero_load(dep, prompt, output)
    assert (z.prefill_s, z.handoff_s, z.decode_step_s) == pytest.approx((pre, hand, steps.mean()), rel=1e-12)


def test_the_same_inputs_give_the_same_times_and_load_raises_latency():
    dep = _split()
    req = sample_requests(load_workload("chat"), 3000, seed=4)
    a, b = simulate(dep, req, 30.0), simulate(dep, req, 30.0)
    for x, y in zip((a.first_token, a.finish), (b.first_token, b.finish)):
        assert np.array_equal(x, y)
    busy = simulate(dep, req, 300.0)
    assert np.median(busy.ttft) > np.median(a.ttft) and np.median(busy.tpot) > np.median(a.tpot)


def test_a_route_sees_each_pool_and_picks_the_rank():
    seen = []

    def to_last(request: RouteRequest, view: PoolView) -> int:
        seen.append((view.phase, view.num_ranks, float(view.reserved.sum())))
        assert view.reserved.shape == view.waiting.shape == view.running.shape == (view.num_ranks,)
        return view.num_ranks - 1

    dep = _split()
    req = sample_requests(load_workload("code"), 200, seed=1)
    res = simulate(dep, req, 20.0, route=to_last)
    assert {p for p, *_ in seen} == {"prefill", "decode"}
    assert [n for p, n, _ in seen if p == "decode"][0] == 4 and np.isfinite(res.finish).all()
    with pytest.raises(ValueError, match="route returned 9 for a prefill pool of 2 ranks"):
        simulate(dep, req, 20.0, route=lambda r, v: 9)


def _wrapped(route, seen):
    """``route`` behind a plain callable (no fast path), recording what each decision saw."""

    def call(request: RouteRequest, view: PoolView) -> int:
        before = view.in_flight.copy()
        g = route(request, view)
        seen.append((view.phase, before, g))
        return g

    return call


def test_the_simulators_routes_are_the_registrys_rules_fed_the_simulated_queues():
    from moe_placement.apps.deploy.routes import rule_route

    dep, req = _split(), sample_requests(load_workload("code"), 300, seed=2)
    fast = simulate(dep, req, 40.0)  # the default: each rank in turn
    seen: list = []
    slow = simulate(dep, req, 40.0, route=_wrapped(rule_route("round-robin"), seen))
    for x, y in zip((fast.first_token, fast.finish), (slow.first_token, slow.finish)):
        assert np.array_equal(x, y)  # the fast path is the Router's round-robin, rank for rank
    seen.clear()
    loaded = simulate(dep, req, 40.0, route=_wrapped(rule_route("least-loaded"), seen))
    assert np.isfinite(loaded.finish).all() and seen
    # the rule sees the simulator's queues: it never picks a rank with more requests than the lightest
    assert all(q[g] == q.min() for _, q, g in seen)
    assert any(q.max() > q.min() for _, q, _ in seen)  # queues did differ (the check could fail)
    # no prefix chain: prefix falls back to load (least-loaded's choices, rank for rank)
    other = simulate(dep, req, 40.0, route=rule_route("prefix"))
    assert np.array_equal(other.first_token, loaded.first_token)
    with pytest.raises(ValueError, match="needs the expert placement"):
        simulate(dep, req, 40.0, route=rule_route("affinity"))  # the toy pools have none
    with pytest.raises(ValueError, match="unknown routing rule 'fastest'"):
        DeployOptions(route="fastest")


def test_affinity_in_the_simulator_sends_a_request_to_the_node_holding_its_experts():
    from moe_placement.apps.deploy.routes import rule_route
    from placement.model import Placement
    from placement.routing import Request, RouterOptions
    from placement.topology import Topology

    topo = Topology(ep_size=4, num_physical_experts=16, num_nodes=2)  # node 0: experts 0-7, node 1: 8-15
    placement = Placement(np.tile(np.arange(16), (2, 1)), 16, topo)
    pool = PoolSim("both", 1, 4, 200_000, 1024, 64, _table(), placement)
    n = 40
    sigs = [np.zeros((2, 16)) for _ in range(n)]
    for i, s in enumerate(sigs):
        s[:, 8 * (i % 2) : 8 * (i % 2) + 8] = 1 / 8  # even requests use node 0's experts, odd node 1's
    known = [Request(i, signature=s) for i, s in enumerate(sigs)]
    seen: list = []
    route = rule_route("affinity", RouterOptions(max_imbalance=None), known)
    res = simulate(DeploymentSim((pool,)), _alone(500, 20, n), 1.0, route=_wrapped(route, seen))
    assert np.isfinite(res.finish).all()
    assert [g // 2 for _, _, g in seen] == [i % 2 for i in range(n)]
    # a signature-less workload on the same pool: by load, counted as the documented fallback
    views: list = []
    blind = rule_route("affinity")

    def keep(request, view):
        views.append(view)
        return blind(request, view)

    simulate(DeploymentSim((pool,)), _alone(500, 20, n), 1.0, route=keep)
    assert views[-1].state["fallbacks"] == {"no signature": n}


def test_a_rank_never_holds_more_kv_than_its_budget_and_too_large_requests_are_rejected():
    peak = []

    def least(request: RouteRequest, view: PoolView) -> int:
        peak.append(float(view.reserved.max()))
        return int(np.argmin(view.reserved))

    budget = 3000  # two requests of 1,000 + 200 tokens per rank
    dep = _colocated(kv=budget, engines=1, dp=2)
    req = Requests(np.array([1000] * 40 + [5000]), np.array([200] * 40 + [10]), np.arange(41) * 0.01)
    res = simulate(dep, req, 1.0, route=least)
    assert 2400 <= max(peak) <= budget
    assert math.isinf(res.ttft[-1]) and np.isfinite(res.finish[:-1]).all()  # 5,010 tokens never fit 3,000
    # four at a time (two per rank): the ninth request cannot start before one of the first four ends
    order = np.sort(res.start[:-1])
    assert order[4] >= np.sort(res.finish[:-1])[0] - 1e-12


# ---------------------------------------------------------------------------------------------
# plans
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def split_plan():
    """Long prompts, long outputs, a tight TPOT target, 4 nodes: the book's case for splitting."""
    o = _options(prompt_len=8192, output_len=1024, ttft_ms=10000, tpot_ms=25)
    return plan("mixtral-8x7b", cluster_preset("h200", gpus_per_node=2), 4, "chat", options=o)


@pytest.fixture(scope="module")
def short_plan():
    """Very short outputs: the split only moves the KV for a few decode steps."""
    o = _options(prompt_len=2048, output_len=2, ttft_ms=1500, tpot_ms=200, max_splits=3)
    return plan("mixtral-8x7b", cluster_preset("h200", gpus_per_node=2), 4, "chat", options=o)


def _best_of(p, kinds):
    return max((r for r in p.results if r.kind in kinds), key=lambda r: r.goodput_per_gpu)


def test_long_prompts_and_outputs_with_a_tight_tpot_pick_the_split(split_plan):
    p = split_plan
    assert p.best is not None and p.best.kind == DISAGGREGATED
    colo = _best_of(p, (COLOCATED, REPLICAS))
    assert p.best.goodput_per_gpu > colo.goodput_per_gpu > 0
    assert not [w for w in p.warnings if "optimistic" in w]  # every simulation held enough requests
    gain = p.best.goodput_per_gpu / colo.goodput_per_gpu - 1
    assert f"The prefill/decode split pays ({gain * 100:+.0f}% goodput per GPU)" in p.reason
    d = p.to_dict()["deployments"][0]
    assert d["breakdown"]["handoff_bytes_per_request"] == round(kv_handoff_bytes(p.model, 8192))
    assert [pool["phase"] for pool in d["pools"]] == ["prefill", "decode"]


def test_very_short_outputs_pick_colocated_or_replicas_and_the_rule_agrees(short_plan):
    p = short_plan
    assert p.best is not None and p.best.kind in (COLOCATED, REPLICAS)
    assert p.best.goodput_per_gpu > _best_of(p, (DISAGGREGATED,)).goodput_per_gpu
    assert "short outputs (median 2 < 128 tokens)" in p.reason and "the simulator agrees" in p.reason


def test_goodput_never_grows_when_gpus_are_taken_away(short_plan):
    o = _options(prompt_len=2048, output_len=2, ttft_ms=1500, tpot_ms=200, max_splits=3)
    smaller = plan("mixtral-8x7b", cluster_preset("h200", gpus_per_node=2), 2, "chat", options=o)
    assert 0 < smaller.best.goodput.goodput_rps <= short_plan.best.goodput.goodput_rps


def test_the_handoff_is_priced_from_the_link_and_the_reason_says_which_way_it_went():
    kinds = (COLOCATED, DISAGGREGATED)
    o = _options(prompt_len=8192, output_len=256, ttft_ms=10000, tpot_ms=50, deployments=kinds, rate=0.5)
    o = DeployOptions(**{**o.__dict__, "kv_streaming": "none", "handoff_fixed_s": 0.0})  # the transfer alone
    split = {}
    for inter in ("rdma", "ethernet"):
        p = plan("mixtral-8x7b", cluster_preset("h200", inter=inter, gpus_per_node=4), 2, "chat", options=o)
        split[inter] = next(r for r in p.results if r.kind == DISAGGREGATED)
        bulk = LINKS[inter].kernel("normal")[0]  # a KV transfer is a bulk copy: the normal kernels' rate
        assert f"goes over {inter} at {bulk / 1e9:.1f} GB/s" in p.reason
        assert ("the simulator agrees" in p.reason) != ("DISAGREES" in p.reason)
    ratio = split["ethernet"].breakdown.handoff_s / split["rdma"].breakdown.handoff_s
    rates = {k: LINKS[k].kernel("normal")[0] for k in ("rdma", "ethernet")}
    assert ratio == pytest.approx(rates["rdma"] / rates["ethernet"], rel=1e-9)  # 44.75 / 9
    assert "weak interconnect (ethernet: 9.0 GB/s" in p.reason
    one = plan("mixtral-8x7b", cluster_preset("h200", gpus_per_node=4), 1, "chat", options=o)
    d = next(r for r in one.to_dict()["deployments"] if r["kind"] == DISAGGREGATED)
    assert d["handoff"]["link"] == LINKS["nvlink4"].name and "a single machine" in one.reason


def test_the_same_seed_gives_the_same_plan_bytes():
    o = _options(
        prompt_len=1024, output_len=64, deployments=(COLOCATED, DISAGGREGATED), requests=60, max_requests=600
    )
    args = ("qwen3-30b-a3b", cluster_preset("h200", gpus_per_node=2), 1, "code")
    a, b = (json.dumps(plan(*args, options=o).to_dict()) for _ in range(2))
    assert a == b
    one_rate = DeployOptions(**{**o.__dict__, "route": "prefix", "rate": 1.0})
    by_prefix = plan(*args, options=one_rate).to_dict()
    said = [x for x in by_prefix["assumptions"] if x.startswith("routing: the prefix rule")]
    assert said and "prefix routes by load (no cached prefix)" in said[0]


def test_a_trace_of_the_models_experts_ranks_layouts_on_its_first_steps():
    from profiling.synthetic import synthetic_trace

    tr = synthetic_trace(num_tokens=3000, num_layers=48, num_logical_experts=128, top_k=8, num_prompts=30)
    o = _options(prompt_len=512, output_len=32, deployments=(COLOCATED,), rate=1.0, layout_steps=4)
    p = plan("qwen3-30b-a3b", cluster_preset("h200", gpus_per_node=2), 1, trace=tr, options=o)
    said = [a for a in p.assumptions if a.startswith("layouts ranked")]
    assert said and "the first 4 steps (layout_steps" in said[0] and p.best is not None
    with pytest.raises(ValueError, match="layout_steps"):
        DeployOptions(layout_steps=0)


def test_targets_nothing_meets_say_so_and_name_the_closest():
    o = _options(
        prompt_len=8192, output_len=64, ttft_ms=1.0, tpot_ms=0.01, deployments=(COLOCATED, DISAGGREGATED)
    )
    p = plan("qwen3-30b-a3b", cluster_preset("h200", gpus_per_node=2), 1, "chat", options=o)
    d = p.to_dict()
    assert d["best"] is None and d["closest"] == d["deployments"][0]["label"] and d["launch"] is None
    assert not any(r["met_targets"] for r in d["deployments"])
    assert d["reason"].startswith("No deployment meets") and any(
        "no deployment meets" in w for w in d["warnings"]
    )


def test_bad_inputs_are_one_clear_error():
    o = _options(prompt_len=200_000, output_len=10)
    with pytest.raises(ValueError, match="longer than the model's context: prompt 200000 .* > 163840"):
        plan("deepseek-v3", "h200", 4, "chat", options=o)
    with pytest.raises(ValueError, match="too small to hold deepseek-v3"):
        plan("deepseek-v3", cluster_preset("h200", gpus_per_node=1), 1, "chat", options=_options())
    with pytest.raises(ValueError, match="DeployOptions.deployments"):
        DeployOptions(deployments=("co-located", "pipelined"))


def test_each_pool_is_placed_for_its_phase_and_holds_its_phase_on_held_out_steps(deepseek_trace):
    """Both pools at one size (8 GPUs, one layout: EP8 with 16 redundant slots) fitted on the first half
    of the DeepSeek-V2-Lite trace's first 1,000 prompts in its first 13 MoE layers (the model cut to
    those layers), each on its phase's steps; scored on the held-out half. Prefill wins on step PAR
    under the split it was fitted for; decode is at least as good within the held-out noise (two
    standard errors of the paired per-block step-time gain: decode steps of 64 sequences per rank
    average the spikes out)."""
    from dataclasses import replace

    from moe_placement.apps.advise.phases import gain, price_phase
    from moe_placement.apps.deploy.candidates import Candidate, Planner, PoolChoice, fit_phase_placements
    from moe_placement.apps.planner.layout import LayoutCandidate, evaluate_candidate
    from placement.cost.modelspec import load_model
    from placement.dispatch import BALANCED
    from placement.metrics import step_par
    from placement.steps import DEFAULT_STEP_TOKENS, make_steps

    L, G = 13, 8
    cut = dict(name="deepseek-v2-lite-13", num_layers=L + 1, moe_layer_ids=tuple(range(1, L + 1)))
    m = replace(load_model("deepseek-v2-lite"), **cut)
    trace = deepseek_trace.select_layers(range(L)).select_windows(range(1000))
    cl = cluster_preset("h200", gpus_per_node=G)
    planner = Planner(m, cl, trace, DeployOptions(fit_moves=10), (100, 250))
    opts = planner.cost_options("decode")
    layout = evaluate_candidate(
        m, cl, LayoutCandidate(G, 1, 1, 16, 1), opts, planner.load(), None, planner.search
    )
    pools = tuple(PoolChoice(ph, G, cl, 1, layout, 256) for ph in ("prefill", "decode"))
    fitted, notes = fit_phase_placements(planner, Candidate(DISAGGREGATED, pools, "one size"), trace)
    placed = {p.phase: p.result.placement for p in fitted.pools}
    assert (placed["prefill"].physical_to_logical_map != placed["decode"].physical_to_logical_map).any()
    assert all("fitted on" in n for n in notes)
    assert all(p.dispatch == BALANCED.name for p in fitted.pools)  # priced under the split they serve
    _, held = trace.split(0.5)
    for phase, other in (("prefill", "decode"), ("decode", "prefill")):
        b = DEFAULT_STEP_TOKENS[phase]
        steps = make_steps(held, G, phase, b)
        price = {w: price_phase(placed[w], held, steps, BALANCED.name, m, cl, 4096) for w in placed}
        g, band = gain(price[phase], price[other])
        assert g >= -band, (phase, g, band)
        if phase == "prefill":
            par = {w: step_par(placed[w], held, b, BALANCED.name, phase)["step_par"] for w in placed}
            assert par[phase] < par[other], par


def test_a_pool_is_priced_under_the_dispatch_it_was_placed_for():
    """One placement, two dispatches. GPU 0 holds a replica of the hottest expert beside the second
    hottest; the even split sends half the hottest expert's tokens there, the balanced split sends them
    to the other replica: a flatter GPU peak, priced as such, plus the balanced split's count all-reduce
    and split time per MoE layer."""
    from moe_placement.apps.planner.costmodel import CostOptions
    from moe_placement.apps.planner.layout import LayoutCandidate, evaluate_candidate
    from placement.cost.step_time import dispatch_overhead_seconds
    from placement.cost.traffic import expected_loads
    from placement.dispatch import BALANCED
    from placement.model import Placement
    from placement.topology import Topology

    shape = dict(hidden_size=2048, moe_intermediate_size=768, num_logical_experts=8, top_k=2)
    m = ModelSpec(name="toy-8", num_layers=2, moe_layer_ids=(0, 1), **shape)
    cl = cluster_preset("h200", gpus_per_node=4)
    row = [0, 5, 1, 0, 3, 4, 6, 1, 2, 7, 2, 3]  # 3 slots per GPU; experts 0-3 twice
    placement = Placement(np.tile(row, (2, 1)), 8, Topology.from_redundant(8, 4, 4, 1))
    load = np.tile([10.0, 1, 1, 1, 1, 6, 1, 1], (2, 1))
    cand = LayoutCandidate(4, 1, 1, 4, 1)
    even, bal = (
        evaluate_candidate(m, cl, cand, CostOptions(dispatch=d, overlap="off"), load, None, None, placement)
        for d in (CostOptions.dispatch, BALANCED.name)
    )
    peak = {  # the busiest GPU's expected tokens per layer under each split
        d: expected_loads(placement, load, 2, 128, "low_latency", d).gpu_tokens().max(axis=2).sum()
        for d in (CostOptions.dispatch, BALANCED.name)
    }
    assert peak[BALANCED.name] < 0.9 * peak[CostOptions.dispatch]
    e, b = even.cost.time, bal.cost.time
    extra = dispatch_overhead_seconds(m, cl, 4, BALANCED) * 1e3
    assert b.dispatch == BALANCED.name and b.dispatch_overhead_ms == pytest.approx(extra) and extra > 0
    assert e.dispatch_overhead_ms == 0 and b.moe_ms != e.moe_ms


def test_two_pools_of_one_topology_keep_the_faster_row_of_each_layer_for_their_phase():
    """exchange_layers: after the exchange each placement's every layer is as fast on its phase's steps
    of the fit part as the faster of the two fitted rows, and a layer changes only where the other row
    was strictly faster."""
    from moe_placement.apps.deploy.candidates import exchange_layers
    from placement.cost.modelspec import load_model
    from placement.dispatch import BALANCED
    from placement.topology import Topology
    from profiling.synthetic import synthetic_trace
    from solver.api import solve
    from solver.step.cost import step_cost_for
    from solver.step.fit import sample_step_counts, step_seconds

    fit = synthetic_trace(num_tokens=6000, num_layers=4, num_prompts=60, skew=0.9, seed=3)
    m, cl = load_model("deepseek-v2-lite"), cluster_preset("h200", gpus_per_node=4)
    topo = Topology.from_redundant(64, 8, 4, 1)
    half = fit.split(0.5)
    a, b = (solve("greedy", topology=topo, trace=t, seed=0).placement for t in half)  # two fits' rows
    assert (a.physical_to_logical_map != b.physical_to_logical_map).any(axis=1).all()
    phases, tokens = ("prefill", "decode"), (64, 16)
    (pa, pb), taken = exchange_layers([a, b], phases, tokens, fit, m, cl)
    for new, old, other, phase, t, took in zip((pa, pb), (a, b), (b, a), phases, tokens, taken):
        counts = sample_step_counts(fit, 4, t, None, 0, phase, per_rank=True)
        cost = step_cost_for(fit, phase, 4, m, cl)
        own, alt, now = (step_seconds(p, counts, BALANCED.name, cost, range(4)) for p in (old, other, new))
        np.testing.assert_allclose(now, np.minimum(own, alt), rtol=1e-12)
        assert set(took) == set(np.flatnonzero(alt < own * (1 - 1e-12)).tolist())
        unchanged = [l for l in range(4) if l not in took]
        assert (new.physical_to_logical_map[unchanged] == old.physical_to_logical_map[unchanged]).all()
    assert taken[0] and taken[1], taken  # each phase found a faster row in the other's fit
