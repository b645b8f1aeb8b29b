"""Conformance of our dispatch models with SGLang's and vLLM's own code, on real traces.

Runs in the side environment that holds the engines' Python code (``../shared/tools/engines-venv.sh
.engines-venv``; see docs/dispatch.md), from the repository root::

    TRITON_INTERPRET=1 PYTHONPATH=. .engines-venv/bin/python benchmarks/engine_conformance.py \
        [--max-tokens 20000] [--write-fixtures tests/fixtures/engine_dispatch.json]

For each trace and topology, on greedy placements and on random ones (some with two replicas of an
expert on one GPU), it prints the tokens whose slot differs and the largest GPU-load difference:

- ``sglang-static``: every rank's table from SGLang's ``_compute_logical_to_all_physical_map`` and
  ``compute_logical_to_rank_dispatch_physical_map`` (run per rank, as each rank's process does), then
  each token's slot from SGLang's ``topk_ids_logical_to_physical`` with that rank's table, against
  :func:`placement.metrics.route_tokens` and :func:`placement.metrics.trace_gpu_load`.
- ``vllm-hash``: vLLM's fused EPLB mapping kernel (``eplb_map_to_physical_and_record``, run by
  Triton's interpreter on the CPU) on each rank's forward batches, against ``route_tokens``.

SGLang's server configuration is replaced by a stand-in holding DeepEP as the all-to-all backend and
the topology's node count (what the functions read); the engines' functions themselves run unchanged.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from placement.metrics import batch_positions, route_tokens, source_ranks, trace_gpu_load
from placement.model import Placement, hidden_layer_rows
from placement.topology import Topology
from profiling.readers import default_traces_dir, read_trace
from solver.greedy import greedy_placement

SGLANG_VERSION = "0.5.23"
VLLM_VERSION = "0.33.0"


# ---------------------------------------------------------------------------------------------
# The engines' functions
# ---------------------------------------------------------------------------------------------
def sglang_module(ep_size: int, num_nodes: int):
    """SGLang's expert_location module, reading a DeepEP configuration with ``num_nodes`` nodes."""
    import sglang.srt.eplb.expert_location as el

    moe = types.SimpleNamespace(moe_a2a_backend="deepep", ep_join_mode="none", ep_dispatch_algorithm="static")
    el.get_exec = lambda: types.SimpleNamespace(moe=moe)
    el.get_parallel = lambda: types.SimpleNamespace(ep_size=ep_size, nnodes=num_nodes)
    return el


def sglang_tables(placement: Placement) -> np.ndarray:
    """Every rank's static table ``[G, L, E]`` for the placement's MoE rows, each computed as that
    rank's process computes it from the map SGLang reads (one row per hidden layer, dense rows
    trivial: :func:`placement.model.hidden_layer_rows`)."""
    t = placement.topology
    el = sglang_module(t.ep_size, t.num_nodes)
    p2l = torch.tensor(hidden_layer_rows(placement))  # [H, P]
    out = []
    for rank in range(t.ep_size):
        l2a = el._compute_logical_to_all_physical_map(p2l, placement.num_logical_experts, t.ep_size, rank)
        out.append(
            el.compute_logical_to_rank_dispatch_physical_map(l2a, t.ep_size, p2l.shape[1], rank).numpy()
        )
    return np.stack(out)[:, list(placement.layer_ids), :]


def sglang_slots(tables: np.ndarray, ids: np.ndarray, src: np.ndarray) -> np.ndarray:
    """Slots ``[T, L, k]`` from SGLang's static dispatch function, one rank's tokens at a time."""
    from sglang.srt.eplb.expert_location_dispatch import (
        ExpertLocationDispatchInfo,
        topk_ids_logical_to_physical,
    )

    out = np.full(ids.shape, -1, dtype=np.int64)
    for rank in np.unique(src):
        rows = np.flatnonzero(src == rank)
        for l in range(ids.shape[1]):
            table = torch.tensor(tables[rank, l])
            info = ExpertLocationDispatchInfo("static", table, table[:, None], torch.ones_like(table), 0)
            topk = torch.tensor(ids[rows, l, :].astype(np.int64))
            out[rows, l, :] = topk_ids_logical_to_physical(topk, info).numpy()
    return out


def vllm_kernel():
    """vLLM's fused EPLB mapping function, compiled by Triton's interpreter (CPU)."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import triton
    import triton.language
    import vllm.platforms
    import vllm.triton_utils as vtu

    vtu.triton, vtu.tl = triton, triton.language  # vLLM hides Triton where it finds no GPU
    type(vllm.platforms.current_platform).is_cuda_alike = lambda self: True
    from vllm.model_executor.layers.fused_moe.router import base_router

    return base_router.eplb_map_to_physical_and_record


def vllm_slots(placement: Placement, ids: np.ndarray, src: np.ndarray, batch_tokens: int) -> np.ndarray:
    """Slots ``[T, L, k]`` from vLLM's kernel, run on each rank's forward batches of ``batch_tokens``."""
    kernel = vllm_kernel()
    l2p = torch.tensor(placement.logical_to_physical_map)
    cnt = torch.tensor(placement.logical_replica_count)
    pos = batch_positions(src, batch_tokens)
    batch = np.zeros(src.size, dtype=np.int64)
    for rank in np.unique(src):
        rows = np.flatnonzero(src == rank)
        batch[rows] = np.arange(rows.size) // batch_tokens
    out = np.full(ids.shape, -1, dtype=np.int64)
    load = torch.zeros(placement.num_physical_experts, dtype=torch.int64)
    for rank, b in sorted(set(zip(src.tolist(), batch.tolist()))):
        rows = np.flatnonzero((src == rank) & (batch == b))
        rows = rows[np.argsort(pos[rows])]  # the batch's rows in order
        for l in range(ids.shape[1]):
            topk = torch.tensor(ids[rows, l, :].astype(np.int64))
            out[rows, l, :] = kernel(topk, load, l2p[l], cnt[l], torch.tensor(False), None).numpy()
    return out


# ---------------------------------------------------------------------------------------------
# Placements and the comparison
# ---------------------------------------------------------------------------------------------
def random_placement(E: int, topo: Topology, L: int, seed: int, colocated: bool, layer_ids=None) -> Placement:
    """Every expert once plus random extra replicas; ``colocated`` allows two on one GPU."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(L):
        while True:
            row = np.concatenate([np.arange(E), rng.integers(0, E, topo.num_physical_experts - E)])
            rng.shuffle(row)
            per_gpu = row.reshape(topo.ep_size, -1)
            if colocated or all(len(set(g)) == len(g) for g in per_gpu):
                break
        rows.append(row)
    return Placement(np.stack(rows), E, topo, tuple(layer_ids or ()), allow_colocated_replicas=colocated)


def compare(name: str, placement: Placement, trace, batch_tokens: int, skip_vllm: bool) -> dict:
    """Mismatching tokens and the largest GPU-load difference, per dispatch model."""
    src, how = source_ranks(trace, placement.topology.ep_size)
    ids = trace.topk_ids
    theirs = sglang_slots(sglang_tables(placement), ids, src)
    ours = route_tokens(placement, ids, src, "sglang-static")
    gpu = placement.topology.gpu_of_slot
    loads = np.stack(
        [
            np.bincount(gpu[theirs[:, l][theirs[:, l] >= 0]], minlength=placement.topology.ep_size)
            for l in range(ids.shape[1])
        ]
    )
    diff = np.abs(loads - trace_gpu_load(placement, trace, "sglang-static", src)).max()
    row = {
        "case": name,
        "sources": how,
        "tokens": int(ids.shape[0]),
        "sglang_static_mismatch": int((theirs != ours).any(axis=2).sum()),
        "sglang_static_load_diff": float(diff),
    }
    if not skip_vllm:
        theirs = vllm_slots(placement, ids, src, batch_tokens)
        ours = route_tokens(placement, ids, src, "vllm-hash", batch_index=batch_positions(src, batch_tokens))
        row["vllm_hash_mismatch"] = int((theirs != ours).any(axis=2).sum())
    return row


def head(trace, max_tokens: int):
    """The first whole windows (prompts or steps) of a trace, up to ``max_tokens`` tokens."""
    ends = np.array([b for _, b in trace.natural_windows()])
    return trace.select_windows(range(max(1, int((ends <= max_tokens).sum()))))


def cases(trace, max_layers: int):
    """(name, placement) pairs on a trace: greedy and random at several topologies."""
    E = trace.num_logical_experts
    L = min(trace.num_layers, max_layers)
    sub = trace.select_layers(list(range(L))) if L < trace.num_layers else trace
    for ep, nodes, spare in ((8, 2, 1), (16, 4, 2), (32, 4, 1), (64, 8, 1)):
        P = -(-E // ep) * ep + ep * spare  # spare slots per GPU beyond the experts, divisible by ep
        topo = Topology(ep_size=ep, num_physical_experts=P, num_nodes=nodes)
        greedy, _ = greedy_placement(sub.counts(), topo)
        yield f"greedy ep{ep}/{nodes}n P={P}", greedy, sub
        yield f"random ep{ep}/{nodes}n", random_placement(E, topo, L, ep, False, sub.layer_ids), sub
        yield f"random+coloc ep{ep}/{nodes}n", random_placement(E, topo, L, ep + 1, True, sub.layer_ids), sub


# ---------------------------------------------------------------------------------------------
# Golden fixtures for the test suite (no engines needed there)
# ---------------------------------------------------------------------------------------------
def fixtures() -> dict:
    """Small placements with the engines' own answers: SGLang tables, vLLM slots."""
    out = {"engines": {"sglang": SGLANG_VERSION, "vllm": VLLM_VERSION}, "cases": []}
    rng = np.random.default_rng(7)
    cases = (  # (E, G, N, P, co-located, MoE layer ids: gaps are dense layers, trivial rows in SGLang's map)
        (8, 4, 2, 12, False, (0, 1, 2)),
        (16, 8, 2, 24, False, (1, 2, 3)),
        (8, 4, 2, 16, True, (0, 2, 3)),
        (12, 6, 3, 24, False, (2, 4, 5)),
    )
    for E, G, N, P, coloc, layer_ids in cases:
        topo = Topology(ep_size=G, num_physical_experts=P, num_nodes=N)
        pl = random_placement(E, topo, 3, int(rng.integers(1e6)), coloc, layer_ids)
        ids = rng.integers(0, E, size=(40, 3, 2))
        src = rng.integers(0, G, size=40)
        batch_tokens = 8
        out["cases"].append(
            {
                "num_logical_experts": E,
                "ep_size": G,
                "num_nodes": N,
                "colocated": coloc,
                "layer_ids": list(layer_ids),
                "physical_to_logical_map": pl.physical_to_logical_map.tolist(),
                "sglang_static_tables": sglang_tables(pl).tolist(),
                "topk_ids": ids.tolist(),
                "source_ranks": src.tolist(),
                "batch_tokens": batch_tokens,
                "vllm_hash_slots": vllm_slots(pl, ids, src, batch_tokens).tolist(),
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=20000, help="first N tokens of each trace")
    ap.add_argument("--max-layers", type=int, default=4)
    ap.add_argument("--batch-tokens", type=int, default=256, help="tokens per rank per forward batch (vLLM)")
    ap.add_argument("--skip-vllm", action="store_true", help="SGLang only (the Triton interpreter is slow)")
    ap.add_argument("--write-fixtures", type=Path, default=None)
    args = ap.parse_args()
    if args.write_fixtures:
        args.write_fixtures.parent.mkdir(parents=True, exist_ok=True)
        args.write_fixtures.write_text(json.dumps(fixtures()) + "\n")
        print(f"wrote {args.write_fixtures}")
    root = default_traces_dir()
    paths = {
        "deepseek-v2-lite": "deepseek-v2-lite-chat-puffin/puffin_prompts_1-2000.npz",
        "qwen1.5-moe": "qwen15-moe-gsm8k-decode/qwen15_gsm8k_layers_0_8_12_18_23.npz",
    }
    print(
        f"engines: SGLang {SGLANG_VERSION}, vLLM {VLLM_VERSION}; first {args.max_tokens} tokens, "
        f"{args.max_layers} layers; vLLM batches of {args.batch_tokens} tokens per rank"
    )
    total = {"sglang": 0, "vllm": 0}
    for label, rel in paths.items():
        if not (root / rel).exists():
            print(f"skip {label}: {root / rel} not found (set MOE_TRACES_DIR)")
            continue
        trace = head(read_trace(root / rel), args.max_tokens)
        for name, pl, sub in cases(trace, args.max_layers):
            row = compare(f"{label} {name}", pl, sub, args.batch_tokens, args.skip_vllm)
            total["sglang"] += row["sglang_static_mismatch"]
            total["vllm"] += row.get("vllm_hash_mismatch", 0)
            print(json.dumps(row))
    print(f"mismatching tokens: sglang-static {total['sglang']}, vllm-hash {total['vllm']}")


if __name__ == "__main__":
    main()
