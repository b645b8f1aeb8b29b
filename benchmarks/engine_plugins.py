"""Our plugin policies against each engine's own EPLB default on a real trace, in one run.

Trace: DeepSeek-V2-Lite chat (26 MoE layers x 64 experts), split into three consecutive windows of
prompts. Each policy fits window 0 (the map it would have in service), re-fits window 1 from that map,
and is scored on window 2 (held out) under the engine's own dispatch model
(``vllm-hash`` / ``sglang-static``). Columns: held-out PAR (peak / mean GPU tokens), moved slots from
the map in service, wall time, and the ratios to the engine default.

Run with the engines' side environment (it needs their code)::

    PYTHONPATH=. .engines-venv/bin/python benchmarks/engine_plugins.py [--ep 32 --nodes 4 --redundant 32]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np
import torch

from placement.metrics import moved_slots, par
from placement.model import Placement
from placement.topology import Topology
from profiling.readers import default_traces_dir, read_trace
from runtime_hooks.engine_plugins.policy import DISPATCH, EngineCall, place
from runtime_hooks.engine_plugins.spec import parse_spec

TRACE = "deepseek-v2-lite-chat-puffin/puffin_prompts_1-2000.npz"
SPECS = ("greedy", "migration", "migration:max_moves=64")


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


def rows_for(engine, default, windows, topo, groups):
    """One row per policy: (name, held-out PAR, moved slots, seconds). Each policy re-fits from the
    map it would itself have in service (its own fit on window 0)."""
    fit0, fit1 = windows[0].counts(), windows[1].counts()  # [L, E]
    E = fit0.shape[1]
    as_placement = lambda m: Placement(m, E, topo, allow_colocated_replicas=True)  # noqa: E731
    P, G, N = topo.num_physical_experts, topo.ep_size, topo.num_nodes

    def ours(text, load, prev):
        return place(parse_spec(text), EngineCall(engine, load, P, G, N, groups, prev))

    policies = [("engine default", lambda load, prev: default(load, topo, groups, prev))]
    policies += [(text, lambda load, prev, text=text: ours(text, load, prev)) for text in SPECS]
    rows = []
    for name, fn in policies:
        served = fn(fit0, None)  # [L, P] the map in service
        t0 = time.perf_counter()
        new = fn(fit1, served)
        secs = time.perf_counter() - t0
        p = par(as_placement(new), windows[2], DISPATCH[engine])
        rows.append((name, p, moved_slots(as_placement(served), as_placement(new)), secs))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ep", type=int, default=32)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--redundant", type=int, default=32)
    args = ap.parse_args()
    trace = read_trace(os.path.join(default_traces_dir(), TRACE))
    windows = trace.windows(3)
    E = trace.counts().shape[1]
    topo = Topology.from_redundant(E, args.redundant, args.ep, args.nodes)
    print(
        f"DeepSeek-V2-Lite, {E} experts + {args.redundant} redundant on {args.ep} GPUs / {args.nodes} nodes;"
    )
    print("each policy fits window 0, re-fits window 1 from its own map, is scored on window 2")
    for engine, default in (("vllm", vllm_default), ("sglang", sglang_default)):
        rows = rows_for(engine, default, windows, topo, 1)
        base_par, base_moved = rows[0][1], max(rows[0][2], 1)
        print(f"\n{engine} (dispatch {DISPATCH[engine]})")
        print(f"{'policy':<24}{'held-out PAR':>13}{'moved':>8}{'PAR ratio':>11}{'moved ratio':>13}{'s':>8}")
        for name, p, moved, secs in rows:
            print(
                f"{name:<24}{p:>13.4f}{moved:>8d}{p / base_par:>11.3f}{moved / base_moved:>13.3f}{secs:>8.3f}"
            )


if __name__ == "__main__":
    main()
