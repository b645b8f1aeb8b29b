"""Communication-aware placement on real per-token traces: held-out PAR vs cross-node dispatch.

Fits on the first half of prompts (``trace.split(0.5)``), scores on the second half with the ``local``
replica-selection policy (greedy also under ``even`` for reference), for ep 16/32/64 on 2/4/8 nodes.
Prints one Pareto table per trace and topology: greedy, trivial and the locality solver at several
node-balance slacks, with ratios to greedy (same policy) in the same run.

    PYTHONPATH=. .venv/bin/python benchmarks/locality.py            # full (minutes)
    PYTHONPATH=. .venv/bin/python benchmarks/locality.py --quick    # a few layers, one slack
"""

from __future__ import annotations

import argparse
import sys
import time

from placement.topology import Topology
from profiling.readers import default_traces_dir, read_trace
from solver.locality import LocalityOptions, pareto

TRACES = {
    # name: (relative path, hidden size, {ep_size: (num_nodes, num_redundant)})
    "deepseek-v2-lite": (
        "deepseek-v2-lite-chat-puffin/puffin_prompts_1-2000.npz",
        2048,
        {16: (2, 16), 32: (4, 32), 64: (8, 64)},
    ),
    "qwen1.5-moe-decode": (
        "qwen15-moe-gsm8k-decode/qwen15_gsm8k_layers_0_8_12_18_23.npz",
        2048,
        {16: (2, 20), 32: (4, 36), 64: (8, 68)},
    ),
}


def _fmt(v, nd=4):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--quick", action="store_true", help="4 layers, ep 32/4 nodes and ep 64/8 nodes, one slack"
    )
    ap.add_argument("--traces", nargs="*", default=list(TRACES), choices=list(TRACES))
    ap.add_argument("--ep", nargs="*", type=int, default=None, help="EP sizes (default 16 32 64)")
    ap.add_argument(
        "--slacks", nargs="*", type=float, default=None, help="node-load slacks (default 0.02 0.04)"
    )
    ap.add_argument("--headroom", type=float, default=0.2, help="replica_headroom (method grouped)")
    ap.add_argument("--method", default="replicated", choices=["replicated", "grouped"])
    ap.add_argument(
        "--everywhere",
        nargs="*",
        type=int,
        default=None,
        help="num_everywhere values to sweep (method replicated; default: the solver's default)",
    )
    ap.add_argument(
        "--gpu-slack",
        type=float,
        default=None,
        help="GPU peak cap: (1 + X) x greedy's peak per fit view (default: the solver's)",
    )
    ap.add_argument(
        "--drift-z",
        type=float,
        default=None,
        help="two-slot pairing margin in expected drifts of each expert's load (default: the solver's)",
    )
    ap.add_argument(
        "--share-overload",
        type=float,
        default=None,
        help="cap of the default everywhere count: busiest node's extra token share x everywhere load "
        "share (default: the solver's, 0.08)",
    )
    ap.add_argument(
        "--single-margin",
        type=int,
        default=None,
        help="single-node experts per node at most ceil(n / N) + this (default: the solver's, 0)",
    )
    ap.add_argument(
        "--nodes",
        type=int,
        default=None,
        help="number of nodes (default: 2/4/8 for ep 16/32/64); GPUs per node = ep / nodes",
    )
    ap.add_argument(
        "--redundant",
        type=int,
        default=None,
        help="redundant slots (default: the trace's table, ep for DeepSeek-V2-Lite: 2 slots per GPU)",
    )
    ap.add_argument(
        "--swap-halves",
        action="store_true",
        help="fit on the second half of the prompts and score on the first",
    )
    ap.add_argument(
        "--windows", type=int, default=1, help="fit windows used as balance views (1: fit total only)"
    )
    ap.add_argument("--layers", type=int, default=None, help="use the first N layers only")
    ap.add_argument(
        "--time-limit", type=float, default=None, help="solver seconds per solve (default 8 s per layer)"
    )
    ap.add_argument(
        "--work-limit",
        type=int,
        default=None,
        help="bound each solve by counted search steps (reproducible on any machine) instead of time",
    )
    ap.add_argument(
        "--redeal",
        type=int,
        default=0,
        help="also score PAR on K random re-dealings of the held-out prompts (mean and worst ratio)",
    )
    ap.add_argument("--step-tokens", type=int, default=16, help="tokens per rank per step for step_par")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    eps = args.ep or ([32, 64] if args.quick else [16, 32, 64])
    slacks = args.slacks or ([0.02] if args.quick else [0.02, 0.04])
    nlayers = args.layers or (4 if args.quick else None)
    root = default_traces_dir()
    for name in args.traces:
        rel, hidden, topos = TRACES[name]
        path = root / rel
        if not path.is_file():
            print(f"skip {name}: {path} not found (set MOE_TRACES_DIR)")
            continue
        trace = read_trace(path)
        if nlayers:
            trace = trace.select_layers(range(min(nlayers, trace.num_layers)))
        fit, held = trace.split(0.5)
        if args.swap_halves:
            fit, held = held, fit
        E = trace.num_logical_experts
        for ep in eps:
            if ep not in topos and (args.nodes is None or args.redundant is None):
                print(f"skip {name} ep {ep}: no default topology (give --nodes and --redundant)")
                continue
            nodes, red = topos.get(ep, (args.nodes, args.redundant))
            nodes = args.nodes if args.nodes is not None else nodes
            red = args.redundant if args.redundant is not None else red
            if ep % nodes or (E + red) % ep:
                print(
                    f"skip {name} ep {ep}: {nodes} nodes must divide ep and {E} + {red} slots must divide "
                    f"evenly over {ep} GPUs"
                )
                continue
            topo = Topology.from_redundant(E, red, ep, nodes)
            tl = args.time_limit if args.time_limit is not None else 8.0 * trace.num_layers
            t0 = time.perf_counter()
            opts = {"method": args.method}
            if args.method == "grouped":
                opts["replica_headroom"] = args.headroom
            else:
                opts.update(num_windows=args.windows)
                for key in ("gpu_slack", "work_limit", "drift_z", "single_margin", "share_overload"):
                    if getattr(args, key) is not None:
                        opts[key] = getattr(args, key)
            variants = [{"num_everywhere": h} for h in args.everywhere] if args.everywhere else None
            rows = pareto(
                fit,
                held,
                topo,
                LocalityOptions(seed=args.seed, time_limit=tl, hidden_size=hidden, **opts),
                slacks=slacks,
                step_tokens=args.step_tokens,
                variants=variants,
                redeal=args.redeal,
            )
            halves = " (fit: 2nd half, held out: 1st)" if args.swap_halves else ""
            print(
                f"\n## {name} [{args.method}]{halves}: {E} experts, {trace.num_layers} layers, ep {ep}, {nodes} nodes, {red} redundant "
                f"({topo.slots_per_gpu} slots/GPU); fit {fit.num_tokens} tokens, held-out {held.num_tokens}; "
                f"source ranks: {rows[0]['source_ranks']}; step = {args.step_tokens} tokens/rank; "
                f"hidden {hidden}; {time.perf_counter() - t0:.0f}s"
            )
            cols = [
                ("placement", "placement"),
                ("num_everywhere", "everywhere"),
                ("slack", "slack"),
                ("dispatch", "dispatch"),
                ("par", "held PAR"),
                ("par_vs_greedy", "/greedy"),
                ("step_par", "step PAR"),
                ("remote_nodes_per_token", "remote nodes"),
                ("nodes_vs_greedy", "/greedy"),
                ("remote_gpus_per_token", "remote GPUs"),
                ("bytes_per_token", "bytes/token"),
                ("solve_s", "solve s"),
            ]
            if args.redeal:
                cols[6:6] = [
                    ("par_vs_greedy_redealt", f"/greedy {args.redeal} re-dealt"),
                    ("par_vs_greedy_redealt_max", "worst"),
                ]
            print(" | ".join(h for _, h in cols))
            for r in rows:
                print(
                    " | ".join(
                        _fmt(
                            r.get(k), 0 if k == "bytes_per_token" else (2 if k in ("slack", "solve_s") else 4)
                        )
                        for k, _ in cols
                    )
                )
            g = rows[0]
            loc = [r for r in rows if r["placement"] == "locality"]
            ok = [r for r in loc if r["par"] <= 1.02 * g["par"]]
            if ok:
                best = min(ok, key=lambda r: r["remote_nodes_per_token"])
                print(
                    f"best within 2% of greedy's held-out PAR: everywhere {best.get('num_everywhere')}, "
                    f"slack {best['slack']}: remote nodes "
                    f"{best['nodes_vs_greedy']:.3f}x greedy (target <= 0.70)"
                )
            else:
                print("no locality row within 2% of greedy's held-out PAR")
            front, best_n = [], float("inf")
            for r in sorted(loc, key=lambda r: (r["par"], r["remote_nodes_per_token"])):
                if r["remote_nodes_per_token"] < best_n:
                    front.append(r)
                    best_n = r["remote_nodes_per_token"]
            print(
                "Pareto frontier (held PAR x greedy, remote nodes x greedy): "
                + ", ".join(
                    f"({r['par_vs_greedy']:.3f}, {r['nodes_vs_greedy']:.3f}; h={r.get('num_everywhere')}, s={r['slack']})"
                    for r in front
                )
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
