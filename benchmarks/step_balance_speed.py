"""Speed and accuracy of the per-step balanced split (``balanced`` dispatch) at DeepSeek-V3 shape.

    python benchmarks/step_balance_speed.py [--json] [--steps 4] [--repeats 5]

256 experts x 58 MoE layers, greedy placements from the project's solver (fitted on a Zipf-skewed
load) on 288 slots / 32 GPUs / 4 nodes and 320 slots / 64 GPUs / 8 nodes. Each step draws
``64 tokens per rank x ep_size ranks x top-8`` picks from the same skewed popularity plus per-step noise.
Reports, measured in the same run: torch CPU microseconds per layer (one layer per call, and 58
layers batched in one call), with the CPU's early exit (rows proven optimal leave, the loop stops when
none is left; the default on CPU) and with every round (``fixed``, what the CUDA path runs), CUDA
when available, the HiGHS LP (scipy) per layer, and the peak of our
integer split over the LP optimum (worst and mean over steps x layers; ``optimal`` = share equal to
``ceil(LP)``, the integer optimum); ``--json`` adds the top-level torch ops of one single-layer call
(``torch_ops_single_layer_call``: each a kernel launch or a view on CUDA). ``--rounds 96`` trades 1.5x the time for the last integer-optimal
step-layers. Timings on a shared machine are noisy: compare them within a run.

``--traces`` adds an accuracy table over the shared real traces (``$MOE_TRACES_DIR``, skipped when
absent): DeepSeek-V2-Lite on 32 GPUs / 4 nodes and 64 GPUs / 8 nodes (steps of 64 tokens per rank, all
26 layers), Mixtral-8x7B MMLU on 4 GPUs / 1 node and 8 GPUs / 2 nodes (150 questions as steps, all 32
layers); greedy placements with one spare slot per GPU, every step-layer scored against HiGHS.
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
import torch  # noqa: E402

from benchmarks.step_lp import highs_step_peak  # noqa: E402
from placement.step_balance import ROUNDS, balanced_gpu_load  # noqa: E402
from placement.topology import Topology  # noqa: E402
from runtime_hooks.step_balance import StepBalancer  # noqa: E402
from solver.api import solve  # noqa: E402

L, E, TOP_K, TOKENS_PER_RANK = 58, 256, 8, 64


def highs_peak(c: np.ndarray, l2p: np.ndarray, S: int) -> float:
    """LP optimum of one layer: ``c [E]``, ``l2p [E, R]`` (:func:`benchmarks.step_lp.highs_step_peak`)."""
    return highs_step_peak(c, l2p, S)


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


def torch_ops(fn) -> int:
    """Top-level torch ops one call of ``fn`` issues (each a kernel launch or a view on CUDA)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.cpu_parent is None)


def run_topology(G: int, N: int, P: int, steps: int, repeats: int, rounds: int) -> dict:
    fit, counts = workload(G, steps, seed=G)
    topo = Topology(G, P, N)
    placement, _ = solve("greedy", topology=topo, load=fit)
    l2p, S = placement.logical_to_physical_map, topo.slots_per_gpu
    batched = StepBalancer(l2p, S, rounds=rounds)
    single = StepBalancer(l2p[0], S, rounds=rounds)
    fixed = StepBalancer(l2p, S, rounds=rounds, early_exit=False)  # every round, as the CUDA path runs
    fixed_single = StepBalancer(l2p[0], S, rounds=rounds, early_exit=False)
    c_t = torch.from_numpy(counts)
    t_single = timed(lambda: single.quotas(c_t[0, 0], validate=False), repeats)
    t_batch = timed(lambda: batched.quotas(c_t[0], validate=False), repeats) / L
    t_fixed = timed(lambda: fixed.quotas(c_t[0], validate=False), repeats) / L
    t_fixed_single = timed(lambda: fixed_single.quotas(c_t[0, 0], validate=False), repeats)
    t0 = time.perf_counter()
    lp = np.array([[highs_peak(counts[s, l], l2p[l], S) for l in range(L)] for s in range(steps)])
    t_highs = (time.perf_counter() - t0) / (steps * L)
    peak_t = batched.gpu_load(c_t, validate=False).numpy().max(-1)  # [steps, L]
    peak_np = balanced_gpu_load(counts, l2p, S, rounds=rounds).max(-1)
    ratio = peak_t / lp
    out = {
        "topology": f"{G} GPUs/{N} nodes/{P} slots",
        "ours_us_per_layer": {"single_layer_call": t_single * 1e6, f"batched_{L}_layers": t_batch * 1e6},
        "ours_fixed_rounds_us_per_layer": {
            "single_layer_call": t_fixed_single * 1e6,
            f"batched_{L}_layers": t_fixed * 1e6,
        },
        "torch_ops_single_layer_call": {
            "early_exit": torch_ops(lambda: single.quotas(c_t[0, 0], validate=False)),
            "fixed_rounds": torch_ops(lambda: fixed_single.quotas(c_t[0, 0], validate=False)),
        },
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


def _trace_cases():
    """``(name, l2p [L, E, R], S, counts [B, L, E])`` per shared-trace case (none when traces are absent)."""
    from profiling.readers import default_traces_dir, read_trace

    d = default_traces_dir()
    ds, mix = (
        d / "deepseek-v2-lite-chat-puffin/puffin_prompts_1-2000.npz",
        d / "mixtral-8x7b-mmlu/mixtral_mmlu_counts.npz",
    )
    cases = []
    if ds.is_file():
        trace = read_trace(ds)
        ids = np.asarray(trace.topk_ids, dtype=np.int64)  # [T, L, k]
        E = trace.num_logical_experts
        for G, nodes in ((32, 4), (64, 8)):
            pl, _ = solve("greedy", topology=Topology.from_redundant(E, G, G, nodes), trace=trace)
            per = TOKENS_PER_RANK * G
            steps = ids[: ids.shape[0] // per * per].reshape(-1, per, ids.shape[1], ids.shape[2])
            c = np.zeros(steps.shape[:1] + (ids.shape[1], E), np.int64)  # [B, L, E]
            for l in range(ids.shape[1]):
                c[:, l] = np.stack([np.bincount(s.ravel(), minlength=E) for s in steps[:, :, l]])
            cases.append(
                (
                    f"DeepSeek-V2-Lite {G} GPUs/{nodes} nodes",
                    pl.logical_to_physical_map,
                    pl.topology.slots_per_gpu,
                    c,
                )
            )
    if mix.is_file():
        trace = read_trace(mix)
        raw = np.load(mix)["counts"]  # [questions, L, E]
        pick = np.random.default_rng(0).choice(raw.shape[0], 150, replace=False)
        for G, nodes in ((4, 1), (8, 2)):
            pl, _ = solve("greedy", topology=Topology.from_redundant(8, G, G, nodes), trace=trace)
            cases.append(
                (
                    f"Mixtral-8x7B {G} GPUs/{nodes} nodes",
                    pl.logical_to_physical_map,
                    pl.topology.slots_per_gpu,
                    raw[pick].astype(np.int64),
                )
            )
    return cases


def trace_accuracy(rounds: int) -> list[dict]:
    """Peak over the LP optimum on every step-layer of the shared traces (torch CPU, batched)."""
    rows = []
    for name, l2p, S, c in _trace_cases():
        B, Ln, _ = c.shape
        peak = (
            StepBalancer(l2p, S, rounds=rounds).gpu_load(torch.from_numpy(c), validate=False).numpy().max(-1)
        )
        lp = np.array([[highs_peak(c[b, l], l2p[l], S) for l in range(Ln)] for b in range(B)])  # [B, L]
        ratio = peak / lp
        rows.append(
            {
                "case": name,
                "step_layers": int(B * Ln),
                "share_within_0.5pct": float((ratio <= 1.005).mean()),
                "share_integer_optimal": float((peak == np.ceil(lp - 1e-6)).mean()),
                "worst_ratio_to_lp": float(ratio.max()),
            }
        )
    return rows


def print_trace_table(rows: list[dict]) -> None:
    note = "" if rows else "; none found: set MOE_TRACES_DIR"
    print(f"\nshared traces (greedy, 1 spare slot per GPU{note})")
    print(f"{'case':<34}{'step-layers':>12}{'<=0.5%':>9}{'optimal':>9}{'worst/LP':>10}")
    for r in rows:
        print(
            f"{r['case']:<34}{r['step_layers']:>12}{r['share_within_0.5pct']:>9.4f}"
            f"{r['share_integer_optimal']:>9.4f}{r['worst_ratio_to_lp']:>10.4f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--steps", type=int, default=4, help="steps scored against HiGHS per topology")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=ROUNDS, help="push rounds (more: closer to the LP, slower)")
    ap.add_argument("--traces", action="store_true", help="add the accuracy table over the shared traces")
    args = ap.parse_args()
    torch.set_num_threads(1)
    traces = trace_accuracy(args.rounds) if args.traces else []
    rows = [
        run_topology(G, N, P, args.steps, args.repeats, args.rounds)
        for G, N, P in ((32, 4, 288), (64, 8, 320))
    ]
    if args.json:
        print(
            json.dumps(
                {
                    "dispatch": "balanced",
                    "threads": 1,
                    "rounds": args.rounds,
                    "results": rows,
                    "traces": traces,
                },
                indent=2,
            )
        )
        return
    print(
        f"dispatch: balanced (per-step integer split, {args.rounds} rounds); torch CPU, 1 thread; us per layer"
    )
    print(
        "single / batched: early exit on CPU (rows proven optimal stop); fixed: every round (the CUDA path)"
    )
    head = (
        f"{'topology':<26}{'single':>10}{'batched':>10}{'fixed 1':>10}{'fixed 58':>10}{'HiGHS':>10}"
        f"{'worst/LP':>10}{'mean/LP':>10}{'optimal':>9}"
    )
    print(head + ("" if "cuda_us_per_layer" not in rows[0] else f"{'CUDA':>10}"))
    for r in rows:
        o, f = r["ours_us_per_layer"], r["ours_fixed_rounds_us_per_layer"]
        line = (
            f"{r['topology']:<26}{o['single_layer_call']:>10.0f}{o[f'batched_{L}_layers']:>10.0f}"
            f"{f['single_layer_call']:>10.0f}{f[f'batched_{L}_layers']:>10.0f}"
            f"{r['highs_us_per_layer']:>10.0f}{r['worst_ratio_to_lp']:>10.4f}{r['mean_ratio_to_lp']:>10.4f}"
            f"{r['share_integer_optimal']:>9.3f}"
        )
        if "cuda_us_per_layer" in r:
            line += f"{r['cuda_us_per_layer'][f'batched_{L}_layers']:>10.0f}"
        print(line)
    if args.traces:
        print_trace_table(traces)


if __name__ == "__main__":
    main()
