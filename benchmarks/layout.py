"""Layout table for DeepSeek-V3 on 4 and 8 nodes of 8 H200s, decode and prefill (cost-model estimates).

Run: ``cd /work/main && PYTHONPATH=. .venv/bin/python benchmarks/layout.py [--top 6]``

Workload: the planner's SYNTHETIC Zipf skew (no DeepSeek-V3 trace is available). Placement: greedy
(DeepSeek EPLB's algorithm) for every candidate. Ratios are against the best layout of each table.
"""

from __future__ import annotations

import argparse
import time

from moe_placement.apps.planner.costmodel import CostOptions
from moe_placement.apps.planner.layout import compare_phases
from placement.cost.hardware import cluster_preset
from placement.cost.modelspec import load_model
from placement.steps import SIZING_STEP_TOKENS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--hardware", default="h200")
    args = ap.parse_args()
    model = load_model("deepseek-v3")
    cl = cluster_preset(args.hardware)
    E = model.num_logical_experts
    decode = CostOptions(phase="decode", step_tokens=SIZING_STEP_TOKENS["decode"], context_len=4096)
    prefill = CostOptions(phase="prefill", step_tokens=SIZING_STEP_TOKENS["prefill"], context_len=4096)
    for nodes in (4, 8):
        t0 = time.perf_counter()
        res = compare_phases(model, cl, nodes, decode, prefill)
        wall = time.perf_counter() - t0
        for phase in ("decode", "prefill"):
            plan = res["plans"][phase]
            o = plan.options
            print(
                f"\n## DeepSeek-V3, {nodes} x 8 {cl.name}, {phase}: {o.step_tokens} tokens/GPU/step, context {o.context_len}"
            )
            print(f"workload: {plan.workload}")
            print(
                f"{'layout':<34} {'step ms':>8} {'tok/s/GPU':>10} {'vs best':>7} {'PAR':>5} {'attn':>6} {'disp':>6} "
                f"{'moe':>6} {'comb':>6} {'TBO':>3} {'KV GB':>6} {'maxB':>5}"
            )
            best = plan.best.tokens_per_s_per_gpu
            for r in plan.feasible[: args.top]:
                c, lc, m = r.cost, r.cost.layer, r.memory
                print(
                    f"{r.candidate.label(E):<34} {c.step_time * 1e3:>8.2f} {c.tokens_per_s_per_gpu:>10,.0f} "
                    f"{c.tokens_per_s_per_gpu / best:>7.2f} {r.par:>5.2f} {lc.attention * 1e6:>6.0f} {lc.dispatch * 1e6:>6.0f} "
                    f"{lc.compute * 1e6:>6.0f} {lc.combine * 1e6:>6.0f} {'on' if lc.overlap_used else 'off':>3} "
                    f"{m.kv_free / 1e9:>6.1f} {m.max_step_tokens:>5}"
                )
            bad = [r for r in plan.results if not r.feasible]
            print(
                f"rejected for memory: {len(bad)} (e.g. {bad[-1].candidate.label(E)}: {bad[-1].reason})"
                if bad
                else "rejected: none"
            )
            for n in plan.notes:
                print(f"* {n}")
        print(f"* {res['message']}")
        print(f"({wall:.1f} s for both phases on {nodes} nodes)")


if __name__ == "__main__":
    main()
