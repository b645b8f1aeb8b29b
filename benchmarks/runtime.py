"""Per-step wall time of the EP MoE layer on real gloo ranks: trivial vs greedy vs optimised placements.

Usage::

    PYTHONPATH=. .venv/bin/python benchmarks/runtime.py [--ranks 8] [--nodes 2] [--redundant 16]
        [--layers 4] [--tokens-per-rank 64] [--steps 20] [--ms-per-step 50] [--dispatch even]
        [--time-limit 5] [--trace PATH] [--json OUT]

Protocol: placements are fitted on the first half of the trace (DeepSeek-V2-Lite chat routing from the
shared traces folder, or a synthetic trace when absent) and scored on held-out steps from the second
half: step ``s`` gives each of the ``G`` ranks ``tokens_per_rank`` consecutive tokens (attention-DP),
replayed through ``layers`` MoE layers with dispatch/combine over ``all_to_all``.

Why a simulated device time: this machine has 2 CPU cores shared by 8 ranks, so the real expert
compute of all ranks runs in series and the step time would measure total work, not the slowest rank.
A GPU rank computes in parallel with the others; we model that by sleeping ``c`` seconds per pick a
rank computes (``c`` chosen so a perfectly balanced rank sleeps ``--ms-per-step`` per layer), which
costs no CPU. Then the step time is set by the most loaded rank (the straggler), as on GPUs, and the
ratio to greedy measures what a placement's balance is worth. The tiny real GLU compute (d=64) and the
gloo all_to_all still run for real.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from placement.metrics import route_tokens, routed_gpu_tokens
from placement.model import Placement
from placement.topology import Topology


def _bench_rank(
    rank, world_size, placements, ids, tokens_per_rank, steps, sec_per_pick, dispatch, hidden, warmup
):
    """Per rank: for each placement, time ``steps`` replayed steps; return {name: [step seconds]}."""
    import torch
    import torch.distributed as dist

    from runtime_hooks.ep_layer import EPMoELayer, ExpertWeights, replay_weights

    b, G = tokens_per_rank, world_size
    stacks = {}
    for name, pl in placements.items():
        stacks[name] = []
        for l in range(pl.num_layers):
            w = ExpertWeights.random(pl.num_logical_experts, hidden, hidden // 2, seed=l)
            layer = EPMoELayer(pl, l, w, dispatch=dispatch, name=f"{name}{l}")
            layer.simulated_seconds_per_token = sec_per_pick  # a benchmark knob, not a constructor option
            stacks[name].append(layer)
    out = {name: ([], []) for name in placements}
    g = torch.Generator().manual_seed(rank)
    # Placements take turns step by step, so load from other processes on this shared machine
    # spreads evenly over them instead of favouring whichever ran in a quiet minute.
    for s in range(warmup + steps):
        lo = s * b * G + rank * b
        tok = torch.arange(lo, lo + b)
        x0 = torch.randn(b, hidden, generator=g)
        step_ids = torch.as_tensor(np.asarray(ids[lo : lo + b], dtype=np.int64))  # [b, L, k]
        for name, layers in stacks.items():
            x = x0
            dist.barrier()
            t0 = time.perf_counter()
            n = []
            for l, layer in enumerate(layers):
                wts = replay_weights(
                    step_ids[:, l], seed=l, token_index=tok, num_experts=layer.placement.num_logical_experts
                )
                x = layer(x, step_ids[:, l], wts, tok)
                n.append(layer.last_tokens_processed)
            dt = time.perf_counter() - t0
            if s >= warmup:
                out[name][0].append(dt)
                out[name][1].append(n)
    return out


def _trace(args):
    from profiling.readers import default_traces_dir, read_trace

    path = (
        Path(args.trace)
        if args.trace
        else default_traces_dir() / "deepseek-v2-lite-chat-puffin/puffin_prompts_1-2000.npz"
    )
    if path.is_file():
        tr = read_trace(path)
        rows = np.linspace(0, tr.num_layers - 1, args.layers).round().astype(int).tolist()
        return tr.select_layers(rows), str(path)
    from profiling.synthetic import synthetic_trace

    need = 2 * (args.warmup + args.steps) * args.ranks * args.tokens_per_rank
    return synthetic_trace(
        num_tokens=max(need, 20000), num_layers=args.layers, seed=0
    ), "synthetic (shared traces absent)"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--redundant", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens-per-rank", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument(
        "--ms-per-step", type=float, default=50.0, help="simulated device ms per layer on a balanced rank"
    )
    ap.add_argument("--dispatch", "--policy", dest="dispatch", choices=("even", "local"), default="even")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--time-limit", type=float, default=5.0, help="CP-SAT seconds (whole solve)")
    ap.add_argument("--trace")
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    from solver.greedy import greedy_placement

    trace, source = _trace(args)
    fit, held = trace.split(0.5)
    topo = Topology.from_redundant(trace.num_logical_experts, args.redundant, args.ranks, args.nodes)
    load = fit.counts()
    placements = {
        "trivial": Placement.trivial(trace.num_layers, trace.num_logical_experts, topo, trace.layer_ids),
        "greedy": greedy_placement(load, topo, layer_ids=trace.layer_ids)[0],
    }
    notes = []
    try:
        import solver.exact  # noqa: F401
    except ImportError:
        notes.append("solver.exact not available: cpsat row skipped")
    else:
        from solver.api import solve

        pl, rep = solve(
            "cpsat", topology=topo, load=load, layer_ids=trace.layer_ids, time_limit=args.time_limit, seed=0
        )
        placements["cpsat"] = pl
        notes.append(f"cpsat: status {rep.status}, gap {rep.gap:.3f}, {rep.wall_time_s:.1f} s")
    G, b, k = args.ranks, args.tokens_per_rank, trace.top_k
    n_tok = (args.warmup + args.steps) * G * b
    if n_tok > held.num_tokens:
        raise SystemExit(
            f"need {n_tok} held-out tokens, the trace has {held.num_tokens}; lower --steps or --tokens-per-rank"
        )
    ids = np.asarray(held.topk_ids[:n_tok], dtype=np.int64)  # [n_tok, L, k]
    sec_per_pick = args.ms_per_step / 1000.0 / (b * k)  # a balanced rank computes b*k picks per layer

    from runtime_hooks.launcher import launch

    t0 = time.perf_counter()
    res = launch(
        _bench_rank,
        G,
        args=(placements, ids, b, args.steps, sec_per_pick, args.dispatch, args.hidden, args.warmup),
        timeout=600,
    )
    wall = time.perf_counter() - t0
    src = (np.arange(n_tok) % (G * b)) // b
    rows = []
    for name, pl in placements.items():
        step_t = np.max([r[name][0] for r in res], axis=0)  # [steps] slowest rank's view of each step
        slots = route_tokens(pl, ids, src, args.dispatch, token_index=np.arange(n_tok))
        per = routed_gpu_tokens(pl, slots[args.warmup * G * b :])  # [L, G] over measured steps
        # per-step peak/mean of computed picks, from the runtime itself
        picks = np.array([r[name][1] for r in res], dtype=np.float64)  # [G, steps, L] picks per rank
        rows.append(
            {
                "placement": name,
                "step_ms": float(np.median(step_t) * 1000),
                "device_ms": float(picks.max(axis=0).sum(axis=1).mean() * sec_per_pick * 1000),
                "step_ms_p90": float(np.percentile(step_t, 90) * 1000),
                "measured_step_par": float((picks.max(axis=0) / np.maximum(picks.mean(axis=0), 1e-9)).mean()),
                "aggregate_par": float((per.max(axis=1) / per.mean(axis=1)).mean()),
            }
        )
    g = next(r for r in rows if r["placement"] == "greedy")
    for r in rows:
        r["step_vs_greedy"] = r["step_ms"] / g["step_ms"]
        r["device_vs_greedy"] = r["device_ms"] / g["device_ms"]
    print(
        f"EP runtime benchmark: {G} gloo ranks, {args.nodes} nodes, {topo.num_physical_experts} slots/layer, "
        f"{trace.num_layers} layers, {b} tokens/rank/step, {args.steps} steps, dispatch {args.dispatch}"
    )
    print(f"trace: {source} (fit on first half, replay held-out second half)")
    print(
        f"simulated device time: {sec_per_pick * 1e6:.1f} us per pick = {args.ms_per_step:.0f} ms per layer on a "
        f"perfectly balanced rank (sleep, no CPU; see module docstring)"
    )
    hdr = (
        f"{'placement':>10} {'step ms':>9} {'p90 ms':>8} {'/greedy':>8} {'device ms':>10} {'/greedy':>8} "
        f"{'step PAR':>9} {'aggr PAR':>9}"
    )
    print(hdr)
    for r in rows:
        print(
            f"{r['placement']:>10} {r['step_ms']:9.1f} {r['step_ms_p90']:8.1f} {r['step_vs_greedy']:8.3f} "
            f"{r['device_ms']:10.1f} {r['device_vs_greedy']:8.3f} {r['measured_step_par']:9.3f} {r['aggregate_par']:9.3f}"
        )
    ideal = args.ms_per_step * trace.num_layers
    print(f"ideal (every rank exactly balanced, no communication): {ideal:.1f} ms per step")
    for n in notes:
        print(n)
    print(
        f"(launch + run {wall:.1f} s; step ms = median wall time of a step (all layers) seen by the slowest rank; "
        f"device ms = simulated device time of the straggler, sum over layers of max-rank picks x {sec_per_pick * 1e6:.1f} us; "
        f"step PAR = per-step max/mean picks per rank measured in the runtime, "
        f"per layer, averaged; aggr PAR = over all measured steps; "
        f"ms per step above ideal x step PAR is gloo all_to_all and Python overhead on 2 shared cores)"
    )
    if args.json:
        from moe_placement.base.fileio import atomic_write_json

        atomic_write_json(args.json, {"rows": rows, "args": vars(args), "notes": notes, "trace": source})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
