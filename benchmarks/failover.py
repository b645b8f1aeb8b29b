"""Failure domains and failover maps: what protection costs, what a loss costs, how fast a map comes.

    python benchmarks/failover.py [--repeats 3] [--gpus 2] [--skip-trace] [--skip-v3] [--max-moves lost|N|none]

1. DeepSeek-V3 shape (58 layers x 256 experts; 320 slots on 64 GPUs over 8 nodes with lognormal
   (sigma 0.5) and Zipf 0.8 loads, 288 slots on 32 GPUs over 4 nodes with lognormal; each layer its
   own draw; no expert groups): the greedy placement and the same with ``failure_domain="node"``;
   per single loss (every node where a node loss leaves enough slots, the first ``--gpus`` GPUs) the
   failover map's wall and CPU time (median of ``--repeats``), reloads against the fewest possible,
   moves, and its PAR against a full greedy re-solve on the survivors computed in the same run
   (``PAR / re-solve``), with that re-solve's own time beside it.
2. The DeepSeek-V2-Lite trace (skipped when ``MOE_TRACES_DIR`` lacks it; ``--skip-trace``): 32 GPUs
   over 4 nodes, 32 redundant slots, fitted on the first half of the prompts: held-out PAR with and
   without ``failure_domain="node"``, the experts protected, and every node loss as above.

PAR everywhere is peak over mean GPU load under the ``even`` dispatch model (each expert's tokens
split evenly over its copies), on the load the maps were solved for; held-out PAR on the second half.
Timings: wall clock and process CPU time on the machine it runs on (the figures in docs/results.md
come from the 2-core dev machine, shared with other jobs: its wall clock runs 2-4x the CPU time).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import numpy as np  # noqa: E402

from placement.metrics import par  # noqa: E402
from placement.topology import Topology  # noqa: E402
from solver.api import solve  # noqa: E402
from solver.failover import FailoverOptions, domain_losses, failover_map  # noqa: E402

COLS = (
    f"{'loss':<9}{'map s':>7}{'cpu s':>7}{'reloads':>9}{'fewest':>8}{'moves':>7}{'PAR':>8}{'re-solve':>10}"
    f"{'ratio':>7}{'greedy s':>10}"
)


OPTIONS = FailoverOptions()  # set by --max-moves


def v3_loads(kind: str, L: int = 58, E: int = 256, seed: int = 0) -> np.ndarray:
    """``[L, E]`` synthetic loads: lognormal(0, 0.5) or Zipf(0.8) over a random permutation per layer."""
    rng = np.random.default_rng(seed)
    if kind == "zipf0.8":
        base = 1.0 / np.arange(1, E + 1) ** 0.8
        return np.stack([rng.permutation(base) * 1e5 for _ in range(L)])
    return rng.lognormal(0.0, 0.5, (L, E)) * 1e3


def losses(topo: Topology, E: int, gpus: int) -> list[tuple[str, tuple[int, ...]]]:
    """Node losses that leave at least ``E`` slots, then the first ``gpus`` GPU losses."""
    out = []
    if (topo.ep_size - topo.gpus_per_node) * topo.slots_per_gpu >= E:
        out += [(f"node {n}", lost) for n, lost in domain_losses(topo, "node")]
    return out + [(f"gpu {g}", lost) for g, lost in domain_losses(topo, "gpu")[:gpus]]


def loss_row(label, placement, load, lost, repeats: int, num_groups) -> str:
    """One loss: the map's time and figures against a greedy re-solve timed in the same run."""
    times, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        new, rep = failover_map(placement, load, lost, OPTIONS)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    t0 = time.perf_counter()
    resolved = solve("greedy", topology=new.topology, load=load, num_groups=num_groups).placement
    greedy_s = time.perf_counter() - t0
    rpar = par(resolved, load)
    return (
        f"{label:<9}{statistics.median(times):>7.3f}{statistics.median(cpu):>7.3f}{rep.total_reloads:>9}{rep.total_min_reloads:>8}"
        f"{rep.total_moves:>7}{rep.par:>8.4f}{rpar:>10.4f}{rep.par / rpar:>7.3f}{greedy_s:>10.3f}"
    )


def v3_shape(args) -> None:
    for G, N, P, kind in ((64, 8, 320, "lognormal"), (64, 8, 320, "zipf0.8"), (32, 4, 288, "lognormal")):
        topo = Topology(G, P, N)
        load = v3_loads(kind)
        plain = solve("greedy", topology=topo, load=load)
        t0, c0 = time.perf_counter(), time.process_time()
        prot = solve("greedy", topology=topo, load=load, failure_domain="node")
        prot_s, prot_cpu = time.perf_counter() - t0, time.process_time() - c0
        f = prot.failure
        print(
            f"\nDeepSeek-V3 shape, {G} GPUs / {N} nodes / {P} slots, {kind}: greedy PAR {f.par_unconstrained:.4f}; "
            f"failure domain node PAR {f.par:.4f} ({f.par_increase:+.2%}), {sum(map(len, f.protected_experts))} of "
            f"{sum(f.protectable)} protectable protected, solved in {prot_s:.2f} s ({prot_cpu:.2f} s CPU)"
        )
        for name, pl in (("greedy", plain.placement), ("greedy + node domain", prot.placement)):
            print(f"  failover maps from {name}:\n  {COLS}")
            for label, lost in losses(topo, 256, args.gpus):
                print("  " + loss_row(label, pl, load, lost, args.repeats, None))


def real_trace(args) -> None:
    from profiling.readers import default_traces_dir, read_trace

    path = default_traces_dir() / "deepseek-v2-lite-chat-puffin" / "puffin_prompts_1-2000.npz"
    if args.skip_trace or not path.is_file():
        print("\nDeepSeek-V2-Lite trace: skipped (set MOE_TRACES_DIR to the shared traces folder)")
        return
    fit, held = read_trace(path).split(0.5)
    load = fit.counts().astype(np.float64)
    topo = Topology.from_redundant(64, 32, 32, 4)
    res = solve("greedy", topology=topo, trace=fit, failure_domain="node")
    f, unc = res.failure, res.unconstrained
    print(
        f"\nDeepSeek-V2-Lite trace, 32 GPUs / 4 nodes / 96 slots, fit on half the prompts:\n"
        f"  held-out PAR greedy {par(unc, held):.4f}, with failure domain node {par(res.placement, held):.4f} "
        f"({par(res.placement, held) / par(unc, held) - 1:+.2%}); fitted {f.par:.4f} vs {f.par_unconstrained:.4f}; "
        f"protected {sum(map(len, f.protected_experts))} of {26 * 64} (targets {sum(f.targets)} of "
        f"{sum(f.protectable)} protectable), single points of failure {np.mean(f.at_risk_share):.1%} of the load"
    )
    for name, pl in (("greedy", unc), ("greedy + node domain", res.placement)):
        print(f"  failover maps from {name}:\n  {COLS}")
        for label, lost in losses(topo, 64, args.gpus):
            print("  " + loss_row(label, pl, load, lost, args.repeats, None))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="timed failover maps per loss (median)")
    ap.add_argument("--gpus", type=int, default=2, help="GPU losses per case (the first GPUs)")
    ap.add_argument("--skip-trace", action="store_true")
    ap.add_argument("--skip-v3", action="store_true")
    ap.add_argument("--max-moves", default="lost", help="the failover move budget: lost (default), N or none")
    args = ap.parse_args()
    global OPTIONS
    moves = (
        None
        if args.max_moves == "none"
        else args.max_moves
        if args.max_moves == "lost"
        else int(args.max_moves)
    )
    OPTIONS = FailoverOptions(max_moves=moves)
    print(f"failover maps: {OPTIONS}")
    real_trace(args)
    if not args.skip_v3:
        v3_shape(args)


if __name__ == "__main__":
    main()
