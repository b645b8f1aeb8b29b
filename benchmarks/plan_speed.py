"""How fast ``moe-placement plan`` is: the default search on a 4-node cluster, and the simulator alone on
10,000 requests.

    PYTHONPATH=. python benchmarks/plan_speed.py            # about a minute on 2 cores
    PYTHONPATH=. python benchmarks/plan_speed.py --model deepseek-v2-lite --trace T.npz [--layout-steps 0]

Rows:

- ``plan``: :func:`moe_placement.apps.deploy.plan` with the default :class:`DeployOptions` (every kind,
  three chunk sizes, four splits, the coarse then refined goodput search) for DeepSeek-V3 on 4 nodes of 8
  H200s and the chat mix; the target is a minute on 2 cores. Beside it the layout planner's own search of
  the same cluster (``plan_layout``, one pool, one phase: the step ``plan`` repeats per pool size), as the
  baseline ratio.
- ``simulate``: 10,000 requests of the chat mix on the best deployment of each kind at its goodput rate
  and at half of it (requests/s of simulation; the target is "a few seconds").

``--trace``: the plan (and the layout planner's row) with a routing trace: layouts are priced on its
steps where it routes the model's experts, the first ``--layout-steps`` of them per layout and phase
(``DeployOptions.layout_steps``, 16; 0: every step, as ``layout --trace`` prices them).

Wall time and the process's CPU time are both printed: on a shared machine the wall time includes other
work. Every figure is of this machine; the plan's figures are modelled (cost model + simulator), not
measured on GPUs.
"""

from __future__ import annotations

import argparse
import time

from moe_placement.apps.deploy import DeployOptions, plan
from moe_placement.apps.deploy.simulator import simulate
from moe_placement.apps.deploy.workloads import load_workload, sample_requests
from moe_placement.apps.planner.costmodel import CostOptions
from moe_placement.apps.planner.layout import plan_layout
from placement.cost.hardware import cluster_preset
from placement.cost.modelspec import load_model
from profiling.readers import read_trace


def _timed(fn):
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w, time.process_time() - c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="deepseek-v3")
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--workload", default="chat")
    ap.add_argument("--requests", type=int, default=10_000, help="requests of the simulate rows")
    ap.add_argument(
        "--quick", action="store_true", help="DeployOptions.quick() instead of the default search"
    )
    ap.add_argument("--trace", help="a routing trace (layouts priced on its steps where it fits the model)")
    ap.add_argument("--layout-steps", type=int, default=16, help="trace steps priced per layout (0: all)")
    args = ap.parse_args()
    cluster = cluster_preset("h200")
    steps = args.layout_steps or None
    options = DeployOptions.quick(layout_steps=steps) if args.quick else DeployOptions(layout_steps=steps)
    model = load_model(args.model)
    trace = read_trace(args.trace) if args.trace else None
    one_pool = CostOptions(context_len=512, max_steps=steps)
    _, base_w, base_c = _timed(
        lambda: plan_layout(model, cluster, args.nodes, one_pool, trace=trace)
    )  # the one-pool planner on the same cluster
    p, plan_w, plan_c = _timed(
        lambda: plan(model, cluster, args.nodes, args.workload, trace=trace, options=options)
    )
    best = p.best or p.results[0]
    print(
        f"{args.model} on {args.nodes} x 8 h200, workload {args.workload}, trace {args.trace or 'none'} "
        f"({steps or 'all'} steps per layout); {len(p.results)} deployments searched"
    )
    print(f"best: {best.label}, {best.goodput_per_gpu:.4g} req/s per GPU (modelled)")
    for kind in dict.fromkeys(r.kind for r in p.results):
        r = next(x for x in p.results if x.kind == kind)
        print(f"  best {kind}: {r.label}, {r.goodput_per_gpu:.4g} req/s per GPU")
    print()
    print("| row | wall s | CPU s | requests | requests/s (wall) | vs layout planner |")
    print("|---|---|---|---|---|---|")
    print(f"| layout planner (plan_layout, one pool) | {base_w:.2f} | {base_c:.2f} | | | 1.0x |")
    print(f"| plan (default search) | {plan_w:.1f} | {plan_c:.1f} | | | {plan_w / base_w:.0f}x |")
    req = sample_requests(load_workload(args.workload), args.requests, seed=0, context=model.max_context_len)
    for kind in dict.fromkeys(r.kind for r in p.results):
        r = next(x for x in p.results if x.kind == kind)  # the best of the kind
        rate = r.goodput.goodput_rps or r.goodput.at.rate
        for share in (1.0, 0.5):
            res, w, c = _timed(lambda r=r, x=rate * share: simulate(r.sim, req, x))
            print(
                f"| simulate {kind}, {share:.0%} of its goodput rate ({rate * share:.4g} req/s) | {w:.2f} | {c:.2f} | "
                f"{res.prompt.size:,} | {res.prompt.size / w:,.0f} | |"
            )


if __name__ == "__main__":
    main()
