"""Step PAR by step shape: the reference table of issue 33 (prefill-shaped vs decode steps).

    MOE_TRACES_DIR=/work/shared/traces python benchmarks/step_shapes.py [--max-steps 200]

DeepSeek-V2-Lite's shared trace, fit on the first half, scored on the second (held-out); greedy
(:func:`solver.api.solve` ``"greedy"``) with one spare slot per GPU, 96 slots on 32 GPUs / 4 nodes.
For each step shape (:func:`placement.steps.make_steps`: ``prefill`` = chunks of consecutive tokens,
``decode`` = one token of each of b sequences in flight per rank), the held-out step PAR (largest GPU
load over the mean, averaged over steps and layers):

- ``even``: every replica of an expert takes the same share of its tokens
  (:func:`placement.metrics.step_par` under ``even``);
- ``best split``: the exact fractional optimum of each step's min-max split
  (:func:`placement.step_balance.lp_peak`), the floor any per-step dispatch can reach on this map.

Prints one markdown row per shape; the README's and docs/results.md's step-shape figures come from it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from placement.dispatch import EVEN  # noqa: E402
from placement.metrics import step_par  # noqa: E402
from placement.step_balance import lp_peak  # noqa: E402
from placement.steps import make_steps, step_counts  # noqa: E402
from placement.topology import Topology  # noqa: E402
from profiling.readers import default_traces_dir, read_trace  # noqa: E402
from solver.api import solve  # noqa: E402

DEEPSEEK = "deepseek-v2-lite-chat-puffin/puffin_prompts_1-2000.npz"
SHAPES = (("prefill", 64), ("decode", 64), ("decode", 16))  # (phase, tokens per rank per step)


def best_split_par(pl, held, phase: str, step_tokens: int, max_steps: int) -> float:
    """Mean over steps and layers of the LP optimum's peak over the mean GPU load."""
    G = pl.topology.ep_size
    steps = make_steps(held, G, phase, step_tokens, max_steps=max_steps)
    counts = step_counts(held, steps).sum(axis=2)  # [S, L, E] tokens per step, layer and expert
    peak = lp_peak(counts, pl.logical_to_physical_map, pl.topology.slots_per_gpu)  # [S, L]
    mean = counts.sum(axis=2) / G  # [S, L]
    live = mean > 0
    return float((peak[live] / mean[live]).mean())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-steps", type=int, default=200, help="held-out steps per shape (default 200)")
    args = ap.parse_args()
    path = default_traces_dir() / DEEPSEEK
    if not path.exists():
        print(f"skip: {path} not found (set MOE_TRACES_DIR)")
        return 0
    fit, held = read_trace(str(path)).split(0.5)
    topo = Topology(ep_size=32, num_physical_experts=fit.num_logical_experts + 32, num_nodes=4)
    pl = solve("greedy", topology=topo, trace=fit).placement
    print("| trace | config | phase | tokens/rank | held steps | step PAR even | step PAR best split |")
    print("|---|---|---|---|---|---|---|")
    for phase, b in SHAPES:
        even = step_par(pl, held, b, EVEN, phase, max_steps=args.max_steps)
        best = best_split_par(pl, held, phase, b, args.max_steps)
        print(
            f"| DeepSeek-V2-Lite held-out | greedy, 32 GPUs / 4 nodes / {topo.num_physical_experts} slots "
            f"| {phase} | {b} | {even['num_steps']} | {even['step_par']:.3f} | {best:.3f} |"
        )
    return 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    raise SystemExit(main())
