"""Request routing on held-out requests: routing rule x metric, with the uniform-arrival baselines in
the same run, as ratios (issue 43).

Cases (each skipped with its reason when its shared trace is absent):

- ``olmoe-mix``: a multi-domain mix: OLMoE-1B-7B's per-domain expert counts (6 domains: arxiv, book,
  c4, github, tulu, wikipedia; 3 layers) drawn into per-token requests (:mod:`profiling.mixture`:
  synthetic per-token picks shaped by real counts, a lognormal per-request factor of sigma 0.5).
- ``mixtral-mmlu``: the Mixtral-8x7B MMLU trace's per-question counts (each request one question, its
  picks drawn from that question's own counts), the 57 subjects grouped into MMLU's 4 categories.
- ``deepseek-v2-lite``: DeepSeek-V2-Lite chat, real per-token routing of one domain (chat prompts);
  the first ``--layers`` MoE layers.
- ``sessions``: multi-turn chat shaped like ShareGPT (:mod:`placement.routing.sessions`,
  ``--conversations``) whose conversations take their routing from DeepSeek-V2-Lite's held-out prompts:
  prefix-cache hit rate and the TTFT it saves (greedy's placement; no co-optimization).

Each case: fit on the first half of the requests, route the other half (Poisson arrivals,
``--step-tokens`` requests in flight per rank), the placement co-optimized for affinity routing
(``solve("affinity")``), every rule on it, and round-robin / least-loaded on greedy's and the locality
solver's placements for uniform arrival. Dispatch ``local``; bytes with the built-in model's hidden
size (OLMoE 2048, Mixtral 4096, DeepSeek-V2-Lite 2048). Time (modelled, H200 preset): each rule's routed
decode step by the one cost model, and TPOT (p50, p99, at round-robin's goodput rate) and goodput per GPU
through the request simulator on the co-located deployment of the topology
(:mod:`moe_placement.apps.routing_sim`; ``--sim-requests``). The checks of issue 43 are printed under
each table.

    PYTHONPATH=. python benchmarks/routing.py                       # every case (a few minutes)
    PYTHONPATH=. python benchmarks/routing.py --cases olmoe-mix --redundant 32
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from moe_placement.apps.routing import RouteOptions, evaluate_routing, rules_table
from placement.routing.sessions import SessionSpec, generate_sessions
from profiling.mixture import MixSpec, mix_from_counts
from profiling.readers import default_traces_dir, read_trace

# MMLU's subjects -> its four categories (the grouping of the MMLU paper's released evaluation code)
_STEM = (
    "abstract_algebra astronomy college_biology college_chemistry college_computer_science college_mathematics "
    "college_physics computer_security conceptual_physics electrical_engineering elementary_mathematics "
    "high_school_biology high_school_chemistry high_school_computer_science high_school_mathematics "
    "high_school_physics high_school_statistics machine_learning"
)
_HUMANITIES = (
    "formal_logic high_school_european_history high_school_us_history high_school_world_history "
    "international_law jurisprudence logical_fallacies moral_disputes moral_scenarios philosophy prehistory "
    "professional_law world_religions"
)
_SOCIAL = (
    "econometrics high_school_geography high_school_government_and_politics high_school_macroeconomics "
    "high_school_microeconomics high_school_psychology human_sexuality professional_psychology public_relations "
    "security_studies sociology us_foreign_policy"
)
_OTHER = (
    "anatomy business_ethics clinical_knowledge college_medicine global_facts human_aging management marketing "
    "medical_genetics miscellaneous nutrition professional_accounting professional_medicine virology"
)
MMLU_CATEGORIES = {
    s: cat
    for cat, names in (("stem", _STEM), ("humanities", _HUMANITIES), ("social", _SOCIAL), ("other", _OTHER))
    for s in names.split()
}

CASES = {
    # name: (trace file, top-k for a counts trace or None, default topology (ep, nodes, redundant), the
    # issue's claim checked on it: "cut" (>= 25% fewer bytes, busiest rank within 10%), "no-harm", or "")
    "olmoe-mix": ("olmoe-domains/olmoe_counts.npz", 8, (16, 4, 64), "cut"),
    "mixtral-mmlu": ("mixtral-8x7b-mmlu/mixtral_mmlu_counts.npz", 2, (8, 2, 0), ""),
    "deepseek-v2-lite": (
        "deepseek-v2-lite-chat-puffin/puffin_prompts_1-2000.npz",
        None,
        (16, 4, 32),
        "no-harm",
    ),
    "sessions": ("deepseek-v2-lite-chat-puffin/puffin_prompts_1-2000.npz", None, (16, 4, 32), "prefix"),
}


def _trace(name: str, args):
    rel, top_k, _, _ = CASES[name]
    path = default_traces_dir() / rel
    if not path.is_file():
        return None, f"{rel} not found (set MOE_TRACES_DIR)"
    src = read_trace(path)
    if name == "olmoe-mix":
        return mix_from_counts(src, top_k, MixSpec(num_requests=args.requests, seed=args.seed)), ""
    if name == "mixtral-mmlu":
        spec = MixSpec(num_requests=args.requests, request_noise=0.0, seed=args.seed)
        return mix_from_counts(src, top_k, spec, group=MMLU_CATEGORIES), ""
    return src.select_layers(list(range(min(args.layers, src.num_layers)))), ""


def _checks(report, claim: str) -> list[str]:
    """The ratios to round-robin for uniform arrival, and the issue's claim for this case."""
    rows = {**report.rules, **report.baselines}
    aff, ll = rows.get("affinity"), rows.get("least-loaded")
    key = (
        "remote_bytes_per_step"
        if aff and aff.get("remote_bytes_per_step") is not None
        else "remote_copies_per_step"
    )
    uniform = {k: v for k, v in rows.items() if k.startswith("round-robin on ")}
    if claim == "prefix" and ll:
        px = rows["prefix"]
        ok = px["hit_rate"] > ll["hit_rate"]
        ms = lambda f: "n/a" if f.get("ttft_saved_ms") is None else f"{f['ttft_saved_ms']:.2f} ms"  # noqa: E731
        return [
            f"check (prefix raises the hit rate over least-loaded): {px['hit_rate']:.3f} vs {ll['hit_rate']:.3f}: "
            f"{'PASS' if ok else 'FAIL'}; mean TTFT saved per request {ms(px)} vs {ms(ll)} (modelled)"
        ]
    out = []
    if not aff or not uniform:
        return out
    for base, fig in uniform.items():
        out.append(f"affinity (co-optimized) / {base}: {key} {aff[key] / fig[key]:.3f}")
    best = min(uniform.values(), key=lambda f: f[key])
    if claim == "cut" and ll:
        ok = (
            aff[key] <= 0.75 * uniform["round-robin on greedy"][key]
            and aff["busiest_rank_load"] <= 1.10 * ll["busiest_rank_load"]
        )
        out.append(
            f"check (>= 25% fewer bytes than round-robin on greedy, busiest rank within 10% of least-loaded's "
            f"{ll['busiest_rank_load']:.3f}: {aff['busiest_rank_load']:.3f}): {'PASS' if ok else 'FAIL'}"
        )
    elif claim == "no-harm":
        ok = aff[key] <= 1.01 * best[key]
        out.append(
            f"check (no harm: within 1% of the best uniform-arrival round-robin): {'PASS' if ok else 'FAIL'}"
        )
    return out


_COLS = (
    ("remote_bytes_per_step", "MB/step", 1e-6),
    ("remote_bytes_per_step_ratio", "x rr-greedy", 1),
    ("remote_fraction", "remote share", 1),
    ("step_par", "step_par", 1),
    ("step_par_ratio", "x rr-greedy", 1),
    ("busiest_rank_load", "busiest rank", 1),
    ("hit_rate", "hit rate", 1),
    ("decode_step_ms", "step ms", 1),
    ("tpot_p50", "TPOT p50 ms", 1),
    ("tpot_p99", "TPOT p99 ms", 1),
    ("goodput_rps_per_gpu", "goodput/GPU", 1),
)


def _table(report) -> str:
    rows = rules_table(report)
    head = f"{'rule':>26s} " + " ".join(f"{h:>12s}" for _, h, _ in _COLS)
    lines = [head]
    for r in rows:
        tpot = r.get("tpot_ms") or {}
        r["tpot_p50"], r["tpot_p99"] = tpot.get("p50"), tpot.get("p99")
        cells = []
        for k, _, scale in _COLS:
            v = r.get(k)
            cells.append(f"{v * scale:12.4f}" if isinstance(v, float) else f"{'-':>12s}")
        lines.append(f"{r['name']:>26s} " + " ".join(cells))
    return "\n".join(lines)


def run_case(name: str, args) -> dict | None:
    trace, why = _trace(name, args)
    if trace is None:
        print(f"== {name}: skipped: {why}")
        return None
    ep, nodes, redundant = CASES[name][2]
    ep, nodes = args.ep or ep, args.nodes or nodes
    redundant = redundant if args.redundant is None else args.redundant
    b = args.step_tokens or (8 if name == "deepseek-v2-lite" else 32)
    sessions = name == "sessions"
    options = RouteOptions(
        ep_size=ep,
        num_nodes=nodes,
        num_redundant=redundant,
        co_optimize=not sessions,
        step_tokens=b,
        baseline_solvers=("greedy",) if sessions else ("greedy", "locality"),
        seed=args.seed,
        sim_requests=args.sim_requests,
    )
    spec = SessionSpec("sharegpt", args.conversations, concurrency=ep * b, seed=args.seed)
    t0 = time.perf_counter()
    report = evaluate_routing(trace, options, workload=generate_sessions(spec) if sessions else None)
    took = time.perf_counter() - t0
    print(
        f"== {name}: {trace!r}, ep {ep} / {nodes} nodes / {redundant} redundant, {b} requests in flight per rank, "
        f"dispatch local, {report.held_out_requests} held-out requests ({took:.0f} s)"
    )
    print(_table(report))
    for line in _checks(report, CASES[name][3]):
        print(line)
    for a in report.assumptions:
        print(f"  note: {a}")
    for w in report.warnings:
        print(f"  warning: {w}")
    return {"case": name, "seconds": took, **report.to_dict()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    ap.add_argument("--ep", type=int, help="EP size (default per case)")
    ap.add_argument("--nodes", type=int, help="nodes (default per case)")
    ap.add_argument("--redundant", type=int, help="redundant slots per layer (default per case)")
    ap.add_argument("--step-tokens", type=int, help="requests in flight per rank (default 32; DeepSeek 8)")
    ap.add_argument("--requests", type=int, default=6000, help="requests drawn for the mixes (half held out)")
    ap.add_argument("--layers", type=int, default=8, help="DeepSeek-V2-Lite: the first N MoE layers")
    ap.add_argument(
        "--conversations", type=int, default=400, help="sessions: conversations (ShareGPT-shaped)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--sim-requests", type=int, default=20000, help="most requests of one request simulation (0: none)"
    )
    ap.add_argument("--json", help="write every case's report here")
    args = ap.parse_args(argv)
    out = [r for r in (run_case(c, args) for c in args.cases) if r is not None]
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
