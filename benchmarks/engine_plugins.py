"""Our plugin policies against each engine's own EPLB default on real traces, in one run.

Traces: DeepSeek-V2-Lite chat (26 MoE layers x 64 experts; 64 + 32 slots on 32 GPUs / 4 nodes) and
Mixtral-8x7B MMLU (32 layers x 8 experts, subjects in their recorded order: a domain shift at every
subject change; 8 + 8 slots on 8 GPUs / 2 nodes), each cut into consecutive windows of prompts or
questions. Each policy fits window 0 (the map it then has in service); at every later window it
re-fits from its own map in service and is scored on the NEXT window (held out) under the engine's
own dispatch model (``vllm-hash`` / ``sglang-static``; per-question counts are dealt to the ranks
round-robin, and vLLM's hash is scored by its expectation there). Columns: mean held-out PAR, total
moved slots, wall time per re-fit, and the ratios to the engine default.

Run with the engines' side environment (it needs their code; see docs/serving.md)::

    PYTHONPATH=. .engines-venv/bin/python benchmarks/engine_plugins.py [--windows 6]

``--shift`` (issue 26's done-when figures) runs one domain shift instead: DeepSeek-V2-Lite, 16 GPUs /
2 nodes / 80 slots, vLLM's own default policy's map of prompts 0-199 in service (vLLM's code from the
side environment; without it our greedy in engine-parity mode, ``greedy_placement(parity=True)``),
re-placed for prompts 1000-1499 by vLLM's default and by our plugin's specs from that map, scored on
prompts 1500-1998 under ``vllm-hash``. Columns: moved slots and arrived experts against the map in
service, held-out PAR, its ratio to vLLM's default, the share of the gap from the old map's held-out
PAR to fresh greedy's that the map closes, and the rebalance rule's verdict (``expert_bytes`` of
DeepSeek-V2-Lite in BF16, NVLink, stall 1, vLLM's horizon of 3 windows) with its break-even in windows::

    PYTHONPATH=. .engines-venv/bin/python benchmarks/engine_plugins.py --shift

``--guarantees`` (issue 36's done-when figures) checks what every map our policies return promises,
on real traces under each engine's own calls: a fresh call per window, and a call with the engine
default's map of the previous window in service (vLLM's may hold co-located replicas; the rule may
keep it). Topologies: DeepSeek-V2-Lite on 32 GPUs / 4 nodes / 96 slots as 8 groups of 8 experts (a
hierarchical call) and on 16 GPUs / 2 nodes / 80 slots (global); Mixtral on 8 GPUs / 2 nodes / 16
slots as 2 groups of 4. Columns: calls, maps with co-located replicas, expert groups split over
nodes, and on fresh calls the peak GPU load against the engine default's (even split for vLLM;
SGLang's static table, counts split evenly over the ranks, for SGLang): worst layer and the sum::

    PYTHONPATH=. .engines-venv/bin/python benchmarks/engine_plugins.py --guarantees [--windows 4]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np
import torch

from placement.dispatch import VLLM_HASH
from placement.metrics import balance_stats, moved_slots, par, rank_expert_counts, rank_gpu_load
from placement.model import Placement
from placement.topology import Topology
from profiling.readers import default_traces_dir, read_trace
from runtime_hooks.engine_plugins.policy import ENGINE_DISPATCH, EngineCall, place
from runtime_hooks.engine_plugins.spec import parse_spec

TRACES = {  # name: (file, EP size, nodes, redundant slots)
    "deepseek-v2-lite": ("deepseek-v2-lite-chat-puffin/puffin_prompts_1-2000.npz", 32, 4, 32),
    "mixtral-mmlu": ("mixtral-8x7b-mmlu/mixtral_mmlu_counts.npz", 8, 2, 8),
}
SPECS = (
    "greedy:always=1",
    "migration:always=1",
    "migration:max_moves=64,always=1",
)  # rule off: balance vs moves


def vllm_default(load, topo, groups, previous):
    from vllm.distributed.eplb.policy import DefaultEplbPolicy

    old = None if previous is None else torch.from_numpy(previous)
    w = torch.from_numpy(load.astype(np.int32))  # [L, E]
    args = (topo.num_physical_experts, groups, topo.num_nodes, topo.ep_size, old)
    return DefaultEplbPolicy.rebalance_experts(w, *args).numpy()


def sglang_default(load, topo, groups, previous):
    from sglang.srt.eplb import eplb_algorithms as algos

    algorithm = algos.compute_algorithm("auto", groups, topo.num_nodes)
    tokens = torch.from_numpy(load.astype(np.int64))[None]  # [W=1, L, E]
    out = algos.rebalance_experts(
        tokens, topo.num_physical_experts, topo.slots_per_gpu, groups, topo.num_nodes, algorithm
    )
    return out[0].numpy()


def held_out_par(placement: Placement, window, dispatch: str) -> float:
    """PAR of ``window`` under ``dispatch``: per token where the trace has tokens, else per question
    dealt round-robin to the ranks (``rank_gpu_load``; vLLM's hash by its expectation)."""
    if window.has_tokens:
        return par(placement, window, dispatch)
    counts = rank_expert_counts(window, placement.topology.ep_size)  # [L, G, E]
    return balance_stats(rank_gpu_load(placement, counts, dispatch))["par"]


def rows_for(engine, default, windows, topo, groups):
    """One row per policy: (name, mean held-out PAR, moved slots, seconds per re-fit). Each policy
    re-fits window k from the map it has in service and is scored on window k + 1."""
    E = windows[0].num_logical_experts
    as_placement = lambda m: Placement(m, E, topo, allow_colocated_replicas=True)  # noqa: E731
    P, G, N = topo.num_physical_experts, topo.ep_size, topo.num_nodes

    def ours(text, load, prev):
        return place(parse_spec(text), EngineCall(engine, load, P, G, N, groups, prev))

    policies = [("engine default", lambda load, prev: default(load, topo, groups, prev))]
    policies += [(text, lambda load, prev, text=text: ours(text, load, prev)) for text in SPECS]
    rows = []
    for name, fn in policies:
        served = fn(windows[0].counts(), None)  # [L, P] the map in service
        pars, moved, secs = [], 0, 0.0
        for k in range(1, len(windows) - 1):
            t0 = time.perf_counter()
            new = fn(windows[k].counts(), served)
            secs += time.perf_counter() - t0
            pars.append(held_out_par(as_placement(new), windows[k + 1], ENGINE_DISPATCH[engine]))
            moved += moved_slots(as_placement(served), as_placement(new))
            served = new
        rows.append((name, float(np.mean(pars)), moved, secs / (len(windows) - 2)))
    return rows


SHIFT_SPECS = ("greedy:always=1", "migration", "migration:always=1", "migration:max_moves=300,always=1")
V2_LITE_EXPERT_BYTES = 3 * 2048 * 1408 * 2  # DeepSeek-V2-Lite: d=2048, f=1408, BF16


def _old_map(load, topo, groups):
    """``(map in service [L, P], how it was built)``: vLLM's own default policy, else greedy parity."""
    try:
        return vllm_default(load, topo, groups, None), "vLLM DefaultEplbPolicy"
    except ImportError:
        from solver.greedy import greedy_placement

        return greedy_placement(load, topo, parity=True)[0].physical_to_logical_map, "greedy parity=True"


def shift_rows(root: str) -> tuple[str, list[dict]]:
    """The ``--shift`` case: one row per policy from vLLM's own map in service."""
    from placement.churn import arrived_experts
    from runtime_hooks.engine_plugins.policy import rebalance_verdict

    tr = read_trace(os.path.join(root, TRACES["deepseek-v2-lite"][0]))
    old_load = tr.select_windows(range(0, 200)).counts()
    fit, held = tr.select_windows(range(1000, 1500)).counts(), tr.select_windows(range(1500, tr.num_windows))
    topo = Topology.from_redundant(64, 16, 16, 2)
    E, P, G, N = 64, topo.num_physical_experts, topo.ep_size, topo.num_nodes
    old, source = _old_map(old_load, topo, 1)
    as_pl = lambda m: Placement(m, E, topo, allow_colocated_replicas=True)  # noqa: E731
    maps = {"old map (kept)": old}
    t0 = time.perf_counter()
    try:
        maps["vLLM default"] = vllm_default(fit, topo, 1, old)
    except ImportError:
        pass
    secs = {"vLLM default": time.perf_counter() - t0}
    verdicts = {}
    for text in SHIFT_SPECS:
        spec = parse_spec(
            f"{text},expert_bytes={V2_LITE_EXPERT_BYTES}"
            if ":" in text
            else f"{text}:expert_bytes={V2_LITE_EXPERT_BYTES}"
        )
        t0 = time.perf_counter()
        maps[text] = place(spec, EngineCall("vllm", fit, P, G, N, 1, old))
        secs[text] = time.perf_counter() - t0
        judged = replace(spec, always=False)  # the rule's own verdict, also where always=1 overrides it
        verdicts[text] = (
            rebalance_verdict(judged, as_pl(old), maps[text], fit) if (maps[text] != old).any() else None
        )
    pars = {k: held_out_par(as_pl(m), held, VLLM_HASH.name) for k, m in maps.items()}
    p_old, p_greedy = pars["old map (kept)"], pars["greedy:always=1"]
    base = pars.get("vLLM default", p_greedy)
    rows = []
    for k, m in maps.items():
        v = verdicts.get(k)
        rows.append(
            {
                "policy": k,
                "moved": int((m != old).sum()),
                "arrived": arrived_experts(as_pl(old), as_pl(m)),
                "par": pars[k],
                "par_ratio": pars[k] / base,
                "closed": (p_old - pars[k]) / (p_old - p_greedy) if p_old > p_greedy else float("nan"),
                "seconds": secs.get(k, 0.0),
                "rule": "-"
                if v is None
                else ("pays" if v.rebalance else "keeps") + f", {v.break_even_windows:.2f} win",
            }
        )
    name = f"deepseek-v2-lite 0-199 -> 1000-1499 (held out 1500-1998), 16 GPUs / 2 nodes / 80 slots; in service: {source}"
    return name, rows


def print_shift(root: str) -> None:
    name, rows = shift_rows(root)
    print(
        f"\n{name}\n(held-out PAR under {VLLM_HASH.name}; ratio to vLLM's default; closed: share of the gap old -> fresh greedy)"
    )
    print(
        f"{'policy':<40}{'moved':>7}{'arrived':>9}{'held-out PAR':>14}{'ratio':>8}{'closed':>8}{'s':>7}  rule (break-even)"
    )
    for r in rows:
        print(
            f"{r['policy']:<40}{r['moved']:>7d}{r['arrived']:>9d}{r['par']:>14.4f}{r['par_ratio']:>8.4f}"
            f"{100 * r['closed']:>7.1f}%{r['seconds']:>7.2f}  {r['rule']}"
        )


GUARANTEE_SPECS = ("greedy", "migration", "migration:max_moves=64", "exact:time_limit=2")
GUARANTEE_CASES = (  # (trace, GPUs, nodes, redundant slots, groups)
    ("deepseek-v2-lite", 32, 4, 32, 8),
    ("deepseek-v2-lite", 16, 2, 16, 1),
    ("mixtral-mmlu", 8, 2, 8, 2),
)


def _layer_peaks(engine: str, load: np.ndarray, m: np.ndarray, topo: Topology) -> np.ndarray:
    """Peak GPU load per layer ``[L]`` the engine serves ``m [L, P]`` with (see ``--guarantees``)."""
    from solver.dispatch_fit import even_rank_counts

    pl = Placement(m, load.shape[1], topo, allow_colocated_replicas=True)
    return rank_gpu_load(pl, even_rank_counts(load, topo.ep_size), ENGINE_DISPATCH[engine]).max(axis=1)


def guarantee_rows(engine, default, windows, topo, groups):
    """One row per spec: (spec, calls, declined calls, co-located maps, split groups, worst-layer and
    summed peak ratios to the engine default on fresh calls (None when the policy declined every
    call), and the layers over 0.5% less balanced than the engine's, with in brackets those where the
    engine's map co-locates replicas)."""
    from runtime_hooks.engine_plugins.policy import PolicyError
    from solver.greedy import group_nodes, hierarchical_groups

    E = windows[0].num_logical_experts
    P, G, N = topo.num_physical_experts, topo.ep_size, topo.num_nodes
    keep = hierarchical_groups(groups, E, N)
    rows = []
    for text in GUARANTEE_SPECS:
        calls = colocated = split = declined = over = over_colocated = 0
        ratios, sums = [], [0.0, 0.0]
        for k in range(1, len(windows)):
            load, before = windows[k].counts(), default(windows[k - 1].counts(), topo, groups, None)
            base = default(load, topo, groups, None)
            for prev in (None, before):
                try:
                    m = place(parse_spec(text), EngineCall(engine, load, P, G, N, groups, prev))
                except PolicyError:  # the engine's own algorithm answers (logged by the hooks)
                    declined += 1
                    continue
                calls += 1
                per_gpu = np.sort(m.reshape(m.shape[0], G, -1), axis=2)
                colocated += int((per_gpu[:, :, 1:] == per_gpu[:, :, :-1]).any())
                if keep:
                    split += int((group_nodes(m, E, keep, topo) < 0).sum())
                if prev is None:
                    ours, theirs = _layer_peaks(engine, load, m, topo), _layer_peaks(engine, load, base, topo)
                    ratios.append(float((ours / theirs).max()))
                    worse = ours > theirs * 1.005  # [L] layers over 0.5% less balanced than the engine's
                    eng = np.sort(base.reshape(base.shape[0], G, -1), axis=2)
                    eng_col = (eng[:, :, 1:] == eng[:, :, :-1]).any(axis=(1, 2))  # [L] it co-locates there
                    over, over_colocated = (
                        over + int(worse.sum()),
                        over_colocated + int((worse & eng_col).sum()),
                    )
                    sums = [sums[0] + ours.sum(), sums[1] + theirs.sum()]
        worst = max(ratios) if ratios else None
        total = sums[0] / sums[1] if ratios else None
        rows.append((text, calls, declined, colocated, split, worst, total, f"{over} ({over_colocated})"))
    return rows


def print_guarantees(root: str, num_windows: int) -> None:
    for label, ep, nodes, redundant, groups in GUARANTEE_CASES:
        path = os.path.join(root, TRACES[label][0])
        if not os.path.exists(path):
            print(f"skip {label}: {path} not found (set MOE_TRACES_DIR)")
            continue
        windows = read_trace(path).windows(num_windows)
        E = windows[0].num_logical_experts
        topo = Topology.from_redundant(E, redundant, ep, nodes)
        print(
            f"\n{label}: {E} experts + {redundant} redundant on {ep} GPUs / {nodes} nodes, {groups} group(s)"
        )
        print(
            f"{'engine':<8}{'spec':<26}{'calls':>6}{'declined':>9}{'co-located':>11}{'split':>7}{'worst layer':>13}{'sum':>8}"
        )
        for engine, default in (("vllm", vllm_default), ("sglang", sglang_default)):
            for text, calls, declined, col, split, worst, total, over in guarantee_rows(
                engine, default, windows, topo, groups
            ):
                w = "-" if worst is None else f"{worst:.4f}"
                t = "-" if total is None else f"{total:.4f}"
                print(f"{engine:<8}{text:<26}{calls:>6}{declined:>9}{col:>11}{split:>7}{w:>13}{t:>8}  {over}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=6, help="consecutive windows per trace (>= 3)")
    ap.add_argument("--shift", action="store_true", help="the domain-shift case from vLLM's map (issue 26)")
    ap.add_argument("--guarantees", action="store_true", help="what every map of ours promises (issue 36)")
    args = ap.parse_args()
    if args.guarantees:
        print_guarantees(default_traces_dir(), args.windows)
        return
    if args.shift:
        print_shift(default_traces_dir())
        return
    for label, (rel, ep, nodes, redundant) in TRACES.items():
        path = os.path.join(default_traces_dir(), rel)
        if not os.path.exists(path):
            print(f"skip {label}: {path} not found (set MOE_TRACES_DIR)")
            continue
        trace = read_trace(path)
        windows = trace.windows(args.windows)
        E = trace.num_logical_experts
        topo = Topology.from_redundant(E, redundant, ep, nodes)
        print(
            f"\n{label}: {E} experts + {redundant} redundant on {ep} GPUs / {nodes} nodes; {args.windows} windows,"
        )
        print("each policy re-fits window k from its own map in service and is scored on window k + 1")
        for engine, default in (("vllm", vllm_default), ("sglang", sglang_default)):
            rows = rows_for(engine, default, windows, topo, 1)
            base_par, base_moved = rows[0][1], max(rows[0][2], 1)
            print(f"{engine} (dispatch {ENGINE_DISPATCH[engine]})")
            print(
                f"{'policy':<24}{'held-out PAR':>13}{'moved':>8}{'PAR ratio':>11}{'moved ratio':>13}{'s/refit':>9}"
            )
            for name, p, moved, secs in rows:
                print(
                    f"{name:<24}{p:>13.4f}{moved:>8d}{p / base_par:>11.3f}{moved / base_moved:>13.3f}{secs:>9.3f}"
                )


if __name__ == "__main__":
    main()
