"""Greedy baseline speed and quality on DeepSeek-V3-shaped problems.

    python benchmarks/greedy_speed.py [--repeats 5]

Prints wall time per call (median of repeats) for 58 layers x 256 experts onto 288 slots on 32 GPUs
(4 nodes) and 320 slots on 64 GPUs (8 nodes), for the global and hierarchical policies, with the
mean peak-to-average GPU load of trivial and greedy placements on the same loads (Zipf 0.8 / 1.2,
lognormal). The published PyTorch implementation is quoted at 0.2-1.2 s for this size; the target
here is under 100 ms.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import numpy as np  # noqa: E402

from placement import Placement, Topology  # noqa: E402
from placement.metrics import balance_stats, expected_gpu_load  # noqa: E402
from solver.greedy import greedy_placement  # noqa: E402


def loads(kind: str, L: int, E: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind.startswith("zipf"):
        s = float(kind[4:])
        base = 1.0 / np.arange(1, E + 1) ** s
        return np.stack([rng.permutation(base) * 1e5 for _ in range(L)])
    return rng.lognormal(0.0, 1.0, (L, E)) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    L, E = 58, 256
    print(
        f"{'topology':<22}{'load':<10}{'policy':<14}{'time ms':>9}{'trivial PAR':>13}{'greedy PAR':>12}{'greedy/trivial':>16}"
    )
    for G, N, P in ((32, 4, 288), (64, 8, 320)):
        topo = Topology(G, P, N)
        for kind in ("zipf0.8", "zipf1.2", "lognormal"):
            w = loads(kind, L, E, seed=0)
            triv = balance_stats(expected_gpu_load(Placement.trivial(L, E, topo), w))["par"]
            for policy in ("global", "hierarchical"):
                times = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    pl, _ = greedy_placement(w, topo, num_groups=8, mode=policy)
                    times.append((time.perf_counter() - t0) * 1e3)
                par = balance_stats(expected_gpu_load(pl, w))["par"]
                print(
                    f"{f'{G} GPUs/{N} nodes/{P}':<22}{kind:<10}{policy:<14}{statistics.median(times):>9.1f}"
                    f"{triv:>13.4f}{par:>12.4f}{par / triv:>16.4f}"
                )


if __name__ == "__main__":
    main()
