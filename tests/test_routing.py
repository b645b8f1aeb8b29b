"""Request routing (issue 43): the router's rules and state, the drift cap, bad requests, prefix caches,
sessions, the multi-domain mix, the co-optimized placement, and the evaluation behind ``route``."""

from __future__ import annotations

import numpy as np
import pytest

from placement.dispatch import LOCAL
from placement.model import Placement
from placement.routing import (
    Request,
    Router,
    RouterOptions,
    eligible,
    node_holdings,
    rule_names,
    signature_of,
)
from placement.routing.prefix import PrefixCaches
from placement.routing.score import score_run
from placement.routing.sessions import (
    PROFILES,
    SessionSpec,
    generate_sessions,
    stream_from_sessions,
    validate_sessions,
)
from placement.routing.simulate import simulate, stream_from_trace
from placement.topology import Topology
from profiling.mixture import MixSpec, mix_from_counts
from profiling.trace import RoutingTrace


def two_domain_trace(requests: int = 160, seed: int = 0) -> RoutingTrace:
    """Requests of two domains: even requests pick 2 of experts 0-7, odd ones 2 of experts 8-15, in
    both layers; 24-40 tokens each."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(24, 41, size=requests)
    ids = np.empty((int(lengths.sum()), 2, 2), dtype=np.int16)
    off = np.concatenate([[0], np.cumsum(lengths)])
    for q in range(requests):
        base = 8 * (q % 2)
        for t in range(off[q], off[q + 1]):
            for layer in range(2):
                ids[t, layer] = base + rng.choice(8, size=2, replace=False)
    return RoutingTrace(num_logical_experts=16, topk_ids=ids, seq_offsets=off, name="two-domain")


def domain_placement() -> Placement:
    """Node 0 (GPUs 0-1) holds experts 0-7 and node 1 (GPUs 2-3) experts 8-15, both layers."""
    topo = Topology(ep_size=4, num_physical_experts=16, num_nodes=2)
    return Placement(np.tile(np.arange(16), (2, 1)), 16, topo)


def sig(experts, layers: int = 2, num_experts: int = 16) -> np.ndarray:
    out = np.zeros((layers, num_experts))
    out[:, list(experts)] = 1.0 / len(experts)
    return out


# ---------------------------------------------------------------------------------------------
# rules and state
# ---------------------------------------------------------------------------------------------
def test_round_robin_cycles_over_serving_ranks_and_skips_a_rank_that_left():
    r = Router("round-robin", 4)
    assert [r.route(Request(i)) for i in range(5)] == [0, 1, 2, 3, 0]
    r.remove_rank(2)
    assert [r.route(Request(10 + i)) for i in range(4)] == [1, 3, 0, 1]


def test_least_loaded_takes_the_fewest_in_flight_then_the_most_free_kv():
    r = Router("least-loaded", 3, RouterOptions(max_imbalance=None))
    r.report(0, queue=2, kv_tokens=10)
    r.report(1, queue=1, kv_tokens=500)
    r.report(2, queue=1, kv_tokens=20)
    assert r.route(Request("a", prompt_tokens=5)) == 2
    r.finish("a")
    r.report(2, queue=3)
    assert r.route(Request("b")) == 1


def test_the_same_seed_gives_the_same_ranks_and_another_seed_breaks_ties_otherwise():
    def ranks(seed):
        r = Router("least-loaded", 8, RouterOptions(seed=seed))
        out = []
        for i in range(40):
            out.append(r.route(Request(i)))
            if i % 3 == 2:
                r.finish(i - 1)
        return out

    assert ranks(3) == ranks(3)
    assert ranks(3) != ranks(4)


def test_the_drift_cap_holds_when_every_request_prefers_one_node():
    r = Router("affinity", 4, RouterOptions(max_imbalance=0.25), placement=domain_placement())
    for i in range(200):
        r.route(Request(i, signature=sig(range(8))))  # all want node 0 (ranks 0, 1)
        q = r.queue
        assert q.max() <= np.ceil(1.25 * q.sum() / 4 - 1e-9) + 1  # one request over the cap at most
    assert r.queue[:2].sum() > r.queue[2:].sum()  # the preferred node still takes more
    assert not eligible(np.array([9, 0, 0, 0]), np.ones(4, bool), 0.1)[0]


def test_affinity_without_a_signature_routes_by_load_and_says_so():
    r = Router("affinity", 4, placement=domain_placement())
    r.report(0, queue=3)
    r.report(1, queue=3)
    r.report(3, queue=1)
    assert r.route(Request("x")) == 2 and r.last.fallback == "no signature"
    assert r.route(Request("z", signature=np.zeros((2, 16)))) in (2, 3) and r.last.fallback == "no signature"
    assert r.route(Request("y", signature=sig([9, 10]))) in (2, 3) and r.last.fallback == ""


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda r: r.route(Request("a")) and r.route(Request("a")), "already in flight"),
        (lambda r: r.finish("nope"), "not in flight"),
        (lambda r: r.route(Request("s", signature=np.ones((3, 16)))), "signature must be"),
        (lambda r: r.route(Request("n", signature=np.full((2, 16), np.nan))), "signature must be"),
        (lambda r: r.report(7, queue=1), "rank must be"),
        (lambda r: r.remove_rank(-1), "rank must be"),
        (lambda r: r.route(Request("p", prompt_tokens=-3)), "prompt_tokens"),
        (lambda r: [r.remove_rank(g) for g in range(4)] and r.route(Request("q")), "no rank is serving"),
    ],
)
def test_bad_calls_are_one_clear_value_error(call, match):
    r = Router("combined", 4, placement=domain_placement())
    with pytest.raises(ValueError, match=match):
        call(r)
    r.add_rank(0)
    assert r.route(Request("after")) in range(4)  # the router still works


def test_rules_that_need_the_placement_or_an_unknown_rule_are_refused():
    with pytest.raises(ValueError, match="needs the expert placement"):
        Router("affinity", 4)
    with pytest.raises(ValueError, match="unknown routing rule 'fastest'"):
        Router("fastest", 4)
    with pytest.raises(ValueError, match="EP ranks"):
        Router("affinity", 8, placement=domain_placement())
    assert Router("combined", 4).route(Request(0)) in range(4)  # no affinity term without a placement


def test_ranks_that_are_not_ep_ranks_name_their_node_and_report_their_queues_at_once():
    """Two attention-DP ranks of two GPUs each (attention TP 2) over the 4-GPU, 2-node placement."""
    r = Router(
        "affinity", 2, RouterOptions(max_imbalance=None), domain_placement(), rank_nodes=np.array([0, 1])
    )
    assert r.route(Request("b", signature=sig(range(8, 16)))) == 1
    assert r.route(Request("a", signature=sig(range(8)))) == 0
    r.report_queue(np.array([5, 0]))
    assert r.route(Request("c")) == 1  # no signature: by load, from the queues just reported
    with pytest.raises(ValueError, match="rank_nodes must be 2 node indices in 0..1"):
        Router("affinity", 2, placement=domain_placement(), rank_nodes=np.array([0, 2]))
    with pytest.raises(ValueError, match="queue must be 2 whole counts"):
        r.report_queue(np.array([1, -1]))


def test_a_request_in_flight_on_a_rank_that_left_finishes_normally():
    r = Router("least-loaded", 2)
    g = r.route(Request("a"))
    r.remove_rank(g)
    assert r.finish("a") == g and r.in_flight == 0
    assert r.route(Request("b")) == 1 - g


# ---------------------------------------------------------------------------------------------
# prefix caches
# ---------------------------------------------------------------------------------------------
def test_a_segment_hits_only_behind_its_whole_prefix_and_leaves_go_first():
    c = PrefixCaches(2, capacity=100)
    c.insert(0, [("sys", 40), ("turn0", 30)])
    assert c.hit(0, [("sys", 40), ("turn0", 30), ("turn1", 10)]) == 70
    assert c.hit(0, [("turn0", 30)]) == 0  # the same key under another parent is another entry
    assert c.hits([("sys", 40)]) == [40, 0]
    c.insert(0, [("other", 50)])  # 120 > 100 tokens: the least recent leaf (turn0) goes, not sys
    assert c.hit(0, [("sys", 40), ("turn0", 30)]) == 40 and c.held(0) <= 100


def test_prefix_routing_raises_the_hit_rate_on_multi_turn_sessions():
    trace = two_domain_trace(40)
    doc = generate_sessions(SessionSpec(conversations=30, concurrency=128, think_steps=20.0, seed=2))
    stream = stream_from_sessions(doc, trace, range(40), signature_tokens=8)
    rates = {}
    for name in ("least-loaded", "prefix"):
        run = simulate(stream, Router(name, 16, RouterOptions(max_imbalance=0.5)))
        prompt = sum(r.prompt_tokens for r in stream.requests)
        rates[name] = run.hit.sum() / prompt
    assert rates["prefix"] > 0.8 and rates["prefix"] > 3 * rates["least-loaded"]


def test_prefix_routing_falls_back_to_load_without_repeated_prefixes():
    trace = two_domain_trace(60)
    stream = stream_from_trace(trace, range(60), 4, 4, signature_tokens=8)
    runs = {n: simulate(stream, Router(n, 4)) for n in ("least-loaded", "prefix")}
    assert runs["prefix"].fallbacks == {"no cached prefix": 60}
    assert np.array_equal(runs["prefix"].rank_of, runs["least-loaded"].rank_of)


# ---------------------------------------------------------------------------------------------
# affinity and the co-optimized placement
# ---------------------------------------------------------------------------------------------
def test_signatures_and_node_holdings():
    ids = np.array([[[0, 1]], [[1, -1]]])
    s = signature_of(ids, 4)
    assert np.allclose(s, [[1 / 3, 2 / 3, 0, 0]])
    h = node_holdings(domain_placement())
    assert h.shape == (2, 2, 16) and h[0, :, :8].all() and not h[0, :, 8:].any()


def test_affinity_routing_cuts_remote_bytes_on_a_two_domain_trace():
    trace = two_domain_trace()
    pl = domain_placement()
    stream = stream_from_trace(trace, range(160), 4, 4, signature_tokens=8)
    fig = {
        n: score_run(pl, trace, stream, simulate(stream, Router(n, 4, placement=pl)), LOCAL, hidden_size=128)
        for n in ("round-robin", "affinity")
    }
    assert fig["affinity"]["remote_bytes_per_step"] < 0.2 * fig["round-robin"]["remote_bytes_per_step"]
    assert fig["affinity"]["remote_fraction"] < 0.1 < fig["round-robin"]["remote_fraction"]
    assert fig["affinity"]["busiest_rank_load"] < 1.6


def test_the_affinity_solver_gives_each_node_a_domain_and_stays_within_its_balance_gate():
    from placement.metrics import trace_gpu_load
    from solver.affinity import AffinityOptions, group_sources
    from solver.api import solve

    trace = two_domain_trace()
    topo = Topology(ep_size=4, num_physical_experts=16, num_nodes=2)
    opts = {"uniform_candidate": False}
    placed, report = solve("affinity", topology=topo, trace=trace, dispatch=LOCAL.name, options=opts)
    h = node_holdings(placed)  # [N, L, E]: one node per domain in every layer
    assert sorted(h[:, 0, :8].sum(axis=1).tolist()) == [0, 8] and sorted(
        h[:, 1, 8:].sum(axis=1).tolist()
    ) == [0, 8]
    assert report.status == "heuristic" and report.solver == "affinity"
    assert all(lr.objective == 0.0 < lr.baseline_objective for lr in report.layers)  # fitted remote nodes
    greedy, _ = solve("greedy", topology=topo, trace=trace)
    d0 = int(np.argmax(h[:, 0, :8].sum(axis=1)))  # the node holding domain 0's experts
    groups = np.where(np.arange(160) % 2 == 0, d0, 1 - d0)
    routed = group_sources(groups, np.diff(trace.seq_offsets), 2)
    ours = trace_gpu_load(placed, trace, LOCAL, routed).max(axis=1)
    base = trace_gpu_load(
        greedy, trace, LOCAL, np.repeat(np.arange(160) % 4, np.diff(trace.seq_offsets))
    ).max(axis=1)
    assert (ours <= (1 + AffinityOptions().balance_slack) * base).all()


def test_the_affinity_solver_keeps_the_candidate_with_fewer_fitted_copies():
    import re

    from solver.api import solve

    trace = two_domain_trace(80)
    topo = Topology(ep_size=4, num_physical_experts=16, num_nodes=2)
    opts = {"uniform_candidate": True, "work_limit": 40}
    _, report = solve("affinity", topology=topo, trace=trace, dispatch=LOCAL.name, options=opts)
    scored = {}
    for n in report.notes:
        m = re.match(r"(placed for .*): ([0-9.]+) remote node copies", n)
        if m:
            scored[m.group(1)] = float(m.group(2))
    kept = next(n for n in report.notes if n.startswith("kept: "))[len("kept: ") :]
    assert len(scored) == 2 and scored[kept] == min(scored.values())


def test_affinity_options_refuse_bad_values():
    from solver.affinity import AffinityOptions

    with pytest.raises(ValueError, match="rounds"):
        AffinityOptions(rounds=0)
    with pytest.raises(ValueError, match="unknown keyword 'slack'"):
        AffinityOptions(slack=1)


# ---------------------------------------------------------------------------------------------
# sessions and the multi-domain mix
# ---------------------------------------------------------------------------------------------
def test_generated_sessions_follow_the_profile_and_the_seed():
    doc = generate_sessions(SessionSpec(profile="sharegpt", conversations=800, seed=2))
    assert doc == generate_sessions(SessionSpec(profile="sharegpt", conversations=800, seed=2))
    turns = [len(c["turns"]) for c in doc["conversations"]]
    answers = [t["output_tokens"] for c in doc["conversations"] for t in c["turns"]]
    mean_turns, _, mean_answer = PROFILES["sharegpt"]
    assert abs(np.mean(turns) / mean_turns - 1) < 0.15 and abs(np.mean(answers) / mean_answer - 1) < 0.15
    validate_sessions(doc)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda d: d.update(schema="x"), "not a sessions workload"),
        (lambda d: d["conversations"].append(dict(d["conversations"][0])), "appears twice"),
        (lambda d: d["conversations"][0]["turns"][0].update(output_tokens=-1), "output_tokens must be"),
        (lambda d: d["conversations"][0]["turns"][0].update(tokens=3), "unknown key"),
        (lambda d: d["conversations"][0].update(system="nope"), "not in system_prompts"),
        (lambda d: d["conversations"][0].update(turns=[]), "non-empty list of turns"),
    ],
)
def test_a_bad_workload_names_the_field(edit, match):
    doc = generate_sessions(SessionSpec(conversations=3))
    edit(doc)
    with pytest.raises(ValueError, match=match):
        validate_sessions(doc)


def test_the_mix_draws_each_request_from_its_domains_counts():
    wc = np.zeros((2, 1, 8), dtype=np.int64)
    wc[0, 0, :3] = [50, 30, 20]
    wc[1, 0, 5:] = [10, 10, 10]
    src = RoutingTrace(num_logical_experts=8, window_counts=wc, window_labels=("a", "b"))
    mix = mix_from_counts(src, 2, MixSpec(num_requests=50, mean_tokens=10, request_noise=0.3, seed=1))
    dom = np.repeat(mix.metadata["request_domain"], np.diff(mix.seq_offsets))
    ids = mix.topk_ids[:, 0, :]
    assert set(np.unique(ids[dom == 0])) <= {0, 1, 2} and set(np.unique(ids[dom == 1])) <= {5, 6, 7}
    assert (ids[:, 0] != ids[:, 1]).all() and mix.metadata["synthetic"]
    with pytest.raises(ValueError, match="top_k"):
        mix_from_counts(src, 8)


def test_every_registered_rule_runs_in_the_evaluation():
    from moe_placement.apps.routing import RouteOptions, evaluate_routing

    trace = two_domain_trace(120)
    opts = RouteOptions(ep_size=4, num_nodes=2, num_redundant=0, step_tokens=4, hidden_size=128)
    report = evaluate_routing(trace, opts, placement=domain_placement())
    assert set(report.rules) == set(rule_names()) and set(report.baselines) == {
        "round-robin on greedy",
        "least-loaded on greedy",
    }
    d = report.to_dict()
    assert d["placement"] == {"co_optimized": False, "source": "given"} and d["held_out_requests"] == 60
    keys = {"remote_bytes_per_step", "remote_fraction", "step_par", "busiest_rank_load", "hit_rate"}
    assert all(keys <= set(v) for v in d["policies"].values())
    assert (
        d["policies"]["affinity"]["remote_bytes_per_step"]
        < d["policies"]["round-robin"]["remote_bytes_per_step"]
    )


def _two_domain_model():
    """A model shaped like the two-domain trace (16 experts, top-2, 2 MoE layers) for the cost model."""
    from placement.cost.modelspec import ModelSpec

    shape = dict(hidden_size=7168, moe_intermediate_size=256, num_logical_experts=16, top_k=2)  # bytes weigh
    return ModelSpec(name="two-domain", num_layers=2, moe_layer_ids=(0, 1), **shape)


@pytest.fixture(scope="module")
def simulated_report():
    from moe_placement.apps.routing import RouteOptions, evaluate_routing

    shape = dict(ep_size=4, num_nodes=2, num_redundant=0, step_tokens=4, model=_two_domain_model())
    opts = RouteOptions(**shape, sim_requests=800, ttft_ms=20.0)  # a steady state within 800 requests
    return evaluate_routing(two_domain_trace(120), opts, placement=domain_placement())


def test_each_rule_gets_tpot_and_goodput_from_the_request_simulator(simulated_report):
    """What a rule changes in the simulator: affinity keeps a domain's tokens on the node holding its
    experts, so the one cost model prices its routed decode steps faster and the simulator's steps
    are scaled to that price; least-loaded balances the simulated queues, so it sustains a higher rate
    than round-robin; prefix (no repeated prefix) simulates as least-loaded."""
    d = simulated_report.to_dict()
    sim, rows = d["simulation"], d["policies"]
    assert sim["simulated"] and sim["max_seqs_per_rank"] == 4
    assert not [w for w in d["warnings"] if "no goodput" in w]
    for name, r in {**rows, **d["baselines"]}.items():
        t = r["tpot_ms"]
        assert 0 < t["p50"] <= t["p90"] <= t["p99"], name
        assert r["ttft_ms"]["p50"] > 0 and r["goodput_rps_per_gpu"] > 0, name
    rr, ll, aff = rows["round-robin"], rows["least-loaded"], rows["affinity"]
    assert aff["decode_step_ms"] < rr["decode_step_ms"]
    assert aff["decoded_tokens_per_step"] == rr["decoded_tokens_per_step"]  # one table point anchors both
    ratio = aff["decode_step_ms"] / rr["decode_step_ms"]
    assert aff["step_scale"] / rr["step_scale"] == pytest.approx(ratio, rel=1e-4)
    assert ll["goodput_rps_per_gpu"] > rr["goodput_rps_per_gpu"]
    assert sim["rate_rps"] == pytest.approx(rr["goodput_rps_per_gpu"] * 4, rel=1e-5)  # round-robin's goodput
    keys = ("tpot_ms", "ttft_ms", "goodput_rps_per_gpu")
    assert all(rows["prefix"][k] == ll[k] for k in keys)


def test_without_a_model_the_simulation_keys_are_null_and_the_reason_is_given():
    from moe_placement.apps.routing import RouteOptions, evaluate_routing

    opts = RouteOptions(ep_size=4, num_nodes=2, num_redundant=0, step_tokens=4, rules=("round-robin",))
    d = evaluate_routing(two_domain_trace(40), opts, placement=domain_placement()).to_dict()
    assert d["simulation"]["simulated"] is False and "give --model" in d["simulation"]["why"]
    r = d["policies"]["round-robin"]
    assert r["tpot_ms"] is None and r["goodput_rps_per_gpu"] is None and r["decode_step_ms"] is None
    with pytest.raises(ValueError, match="sim_requests"):
        RouteOptions(ep_size=4, num_nodes=2, num_redundant=0, sim_requests=-1)


# ---------------------------------------------------------------------------------------------
# the route command
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    from profiling.readers import write_trace

    path = tmp_path_factory.mktemp("route") / "two_domain.npz"
    write_trace(two_domain_trace(120), path)
    return str(path)


def _route(args, capsys):
    from moe_placement.cli.main import main

    rc = main(["route", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_route_json_has_the_issues_keys_and_a_co_optimized_placement(trace_file, tmp_path, capsys):
    import json

    out_file = tmp_path / "placed.json"
    args = [
        "--trace",
        trace_file,
        "--ep-size",
        "4",
        "--num-nodes",
        "2",
        "--num-redundant",
        "0",
        "--step-tokens",
        "4",
    ]
    args += ["--hidden-size", "128", "--co-optimize", "--json", "--output", str(out_file)]
    args += ["--workload", "lmsys:20", "--save-workload", str(tmp_path / "w.json")]
    rc, out, err = _route(args, capsys)
    assert rc == 0, err
    d = json.loads(out)
    assert set(d) >= {"policies", "placement", "held_out_requests", "assumptions", "warnings", "simulation"}
    assert set(d["policies"]) == set(rule_names()) and d["placement"]["co_optimized"] is True
    for figures in d["policies"].values():
        assert {
            "remote_bytes_per_step",
            "remote_fraction",
            "step_par",
            "busiest_rank_load",
            "hit_rate",
            "tpot_ms",
            "ttft_ms",
            "goodput_rps_per_gpu",
        } <= set(figures)
    assert d["simulation"]["simulated"] is False  # no model has the trace's 16 experts: null, said why
    assert d["policies"]["prefix"]["hit_rate"] > d["policies"]["round-robin"]["hit_rate"]
    assert out_file.exists() and validate_sessions(json.loads((tmp_path / "w.json").read_text()))


@pytest.mark.parametrize(
    "args, match",
    [
        (["--ep-size", "4"], "route needs --trace"),
        (["--policies", "round-robin,fastest"], "--policies: unknown rule 'fastest'"),
        (["--workload", "sharegpt:x"], "conversation count"),
        (["--num-redundant", "3"], "do not divide"),
        (["--co-optimize", "--placement", "p.json"], "use one"),
        (["--serve"], "--serve needs"),
        (["--model", "deepseek-v2-lite"], "has 64 experts, top-6; the trace has 16, top-2"),
        (["--sim-requests", "-1"], "--sim-requests"),
    ],
)
def test_route_bad_input_is_one_line_and_exit_2(trace_file, capsys, args, match):
    base = ["--trace", trace_file, "--ep-size", "4", "--num-nodes", "2", "--num-redundant", "0"]
    if args[:1] == ["--ep-size"]:
        base = []
    rc, out, err = _route(base + args, capsys)
    assert rc == 2 and match in err and len(err.strip().splitlines()) == 1
