"""Speed and accuracy of the per-step balanced split (``balanced`` dispatch) at DeepSeek-V3 shape.

    python benchmarks/step_balance_speed.py [--json] [--steps 4] [--repeats 5]

256 experts x 58 MoE layers, greedy placements from the project's solver (fitted on a Zipf-skewed
load) on 288 slots / 32 GPUs / 4 nodes and 320 slots / 64 GPUs / 8 nodes. Each step draws
``64 tokens per rank x ep_size ranks x top-8`` picks from the same skewed popularity plus per-step noise.
Reports, measured in the same run: torch CPU microseconds per layer (one layer per call, and 58
layers batched in one call), CUDA when available, the HiGHS LP (scipy) per layer, and the peak of our
integer split over the LP optimum (worst and mean over steps x layers; ``optimal`` = share equal to
``ceil(LP)``, the integer optimum). ``--rounds 64`` trades twice the time for accuracy. Timings on a shared machine are noisy: compare them within a run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import numpy as np  # noqa: E402
import scipy.sparse as sp  # noqa: E402
import torch  # noqa: E402
from scipy.optimize import linprog  # noqa: E402

from placement.step_balance import ROUNDS, balanced_gpu_load  # noqa: E402
from placement.topology import Topology  # noqa: E402
from runtime_hooks.step_balance import StepBalancer  # noqa: E402
from solver.api import solve  # noqa: E402

L, E, TOP_K, TOKENS_PER_RANK = 58, 256, 8, 64


def highs_peak(c: np.ndarray, l2p: np.ndarray, S: int) -> float:
    """LP optimum of one layer: ``c [E]``, ``l2p [E, R]``."""
    e_idx, r_idx = np.nonzero(l2p >= 0)
    gpu = l2p[e_idx, r_idx] // S
    G, n = int(l2p.max()) // S + 1, len(e_idx)
    a_eq = sp.csr_matrix((np.ones(n), (e_idx, np.arange(n))), shape=(len(c), n + 1))
    a_ub = sp.hstack([sp.csr_matrix((np.ones(n), (gpu, np.arange(n))), shape=(G, n)), -np.ones((G, 1))])
    cost = np.zeros(n + 1)
    cost[-1] = 1.0
    res = linprog(cost, A_ub=a_ub, b_ub=np.zeros(G), A_eq=a_eq, b_eq=c.astype(float), method="highs")
    return float(res.fun)


def workload(G: int, steps: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Fit load ``[L, E]`` and step counts ``[steps, L, E]`` (64 tokens per rank x top-8 picks)."""
    rng = np.random.default_rng(seed)
    base = 1.0 / np.arange(1, E + 1) ** 0.9
    pop = np.stack([rng.permutation(base) for _ in range(L)])  # [L, E]
    pop /= pop.sum(1, keepdims=True)
    picks = TOKENS_PER_RANK * G * TOP_K
    counts = np.zeros((steps, L, E), dtype=np.int64)
    for s in range(steps):
        noisy = pop * rng.lognormal(0.0, 0.3, pop.shape)  # step-to-step drift
        noisy /= noisy.sum(1, keepdims=True)
        for l in range(L):
            counts[s, l] = rng.multinomial(picks, noisy[l])
    return pop * picks, counts


def timed(fn, repeats: int, sync=None) -> float:
    """Median seconds of ``fn()`` over ``repeats`` (after one warm-up)."""
    fn()
    times = []
    for _ in range(repeats):
        if sync:
            sync()
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_topology(G: int, N: int, P: int, steps: int, repeats: int, rounds: int) -> dict:
    fit, counts = workload(G, steps, seed=G)
    topo = Topology(G, P, N)
    placement, _ = solve("greedy", topology=topo, load=fit)
    l2p, S = placement.logical_to_physical_map, topo.slots_per_gpu
    batched = StepBalancer(l2p, S, rounds=rounds)
    single = StepBalancer(l2p[0], S, rounds=rounds)
    c_t = torch.from_numpy(counts)
    t_single = timed(lambda: single.quotas(c_t[0, 0], validate=False), repeats)
    t_batch = timed(lambda: batched.quotas(c_t[0], validate=False), repeats) / L
    t0 = time.perf_counter()
    lp = np.array([[highs_peak(counts[s, l], l2p[l], S) for l in range(L)] for s in range(steps)])
    t_highs = (time.perf_counter() - t0) / (steps * L)
    peak_t = batched.gpu_load(c_t, validate=False).numpy().max(-1)  # [steps, L]
    peak_np = balanced_gpu_load(counts, l2p, S, rounds=rounds).max(-1)
    ratio = peak_t / lp
    out = {
        "topology": f"{G} GPUs/{N} nodes/{P} slots",
        "ours_us_per_layer": {"single_layer_call": t_single * 1e6, f"batched_{L}_layers": t_batch * 1e6},
        "highs_us_per_layer": t_highs * 1e6,
        "worst_ratio_to_lp": float(ratio.max()),
        "mean_ratio_to_lp": float(ratio.mean()),
        "share_within_0.5pct": float((ratio <= 1.005).mean()),
        "share_integer_optimal": float((peak_t == np.ceil(lp - 1e-6)).mean()),
        "numpy_equals_torch": bool(np.array_equal(peak_t, peak_np)),
        "step_layers": int(steps * L),
    }
    if torch.cuda.is_available():
        cuda = StepBalancer(l2p, S, "cuda", rounds=rounds)
        c_cuda = c_t[0].cuda()
        t_cuda = timed(lambda: cuda.quotas(c_cuda, validate=False), repeats, torch.cuda.synchronize) / L
        out["cuda_us_per_layer"] = {f"batched_{L}_layers": t_cuda * 1e6}
        out["cuda_equals_numpy"] = bool(
            np.array_equal(cuda.gpu_load(c_t.cuda()).cpu().numpy().max(-1), peak_np)
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--steps", type=int, default=4, help="steps scored against HiGHS per topology")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=ROUNDS, help="push rounds (more: closer to the LP, slower)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = [
        run_topology(G, N, P, args.steps, args.repeats, args.rounds)
        for G, N, P in ((32, 4, 288), (64, 8, 320))
    ]
    if args.json:
        print(
            json.dumps(
                {"dispatch": "balanced", "threads": 1, "rounds": args.rounds, "results": rows}, indent=2
            )
        )
        return
    print(
        f"dispatch: balanced (per-step integer split, {args.rounds} rounds); torch CPU, 1 thread; us per layer"
    )
    head = f"{'topology':<26}{'single':>10}{'batched':>10}{'HiGHS':>10}{'worst/LP':>10}{'mean/LP':>10}{'optimal':>9}"
    print(head + ("" if "cuda_us_per_layer" not in rows[0] else f"{'CUDA':>10}"))
    for r in rows:
        o = r["ours_us_per_layer"]
        line = (
            f"{r['topology']:<26}{o['single_layer_call']:>10.0f}{o[f'batched_{L}_layers']:>10.0f}"
            f"{r['highs_us_per_layer']:>10.0f}{r['worst_ratio_to_lp']:>10.4f}{r['mean_ratio_to_lp']:>10.4f}"
            f"{r['share_integer_optimal']:>9.3f}"
        )
        if "cuda_us_per_layer" in r:
            line += f"{r['cuda_us_per_layer'][f'batched_{L}_layers']:>10.0f}"
        print(line)


if __name__ == "__main__":
    main()
