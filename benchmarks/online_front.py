"""The moves-vs-held-out-PAR front of migration-aware re-placement on domain shifts (issue 26).

Usage::

    PYTHONPATH=. python benchmarks/online_front.py [--traces deepseek,mixtral] [--budgets 25,50,100,200,300,500]
                                                   [--dispatch even,sglang-static,vllm-hash] [--json out.json]

A placement fitted on an old window is serving; the load shifts (DeepSeek-V2-Lite: later prompts of
the chat trace; Mixtral-8x7B: MMLU's STEM subjects -> the humanities). From two maps in service,
``ours`` (greedy with replicas on distinct GPUs) and ``engine`` (the published EPLB packing as vLLM
and SGLang run it, ``greedy_placement(parity=True)``; where it puts no expert twice on a GPU, extra
copies are written onto their own GPU as an engine's balancer does), each method re-places for the
new fit window and is scored on a held-out window of the new domain:

- ``migration`` with ``max_moves`` in ``--budgets`` (planned for the dispatch model it is scored with);
- ``worst-layers``: greedy from scratch, aligned to the map in service, for the layers that gain most
  per moved slot, while the budget allows (the other layers stay as they are);
- ``greedy`` from scratch (the published balancer, aligned to the map in service: the fair baseline),
  in the same run.

Per point: moved slots and arrived experts (both counted against the map in service), held-out PAR
under the dispatch model, PAR / greedy's, and ``closed``: the share of the gap from the map in
service's held-out PAR to fresh greedy's that the point closes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from moe_placement.base.fileio import atomic_write_text
from placement.churn import arrived_experts
from placement.dispatch import EVEN, SGLANG_STATIC, VLLM_HASH, get_dispatch
from placement.metrics import balance_stats, moved_slots, par, rank_expert_counts, rank_gpu_load
from placement.model import Placement
from placement.topology import Topology
from profiling.readers import default_traces_dir, read_trace
from solver.greedy import greedy_placement
from solver.migration import MigrationOptions, align_to_previous, run_migration
from solver.migration.slots import colocated_extra_copies
from solver.problem import Problem

STEM = (
    "abstract_algebra",
    "astronomy",
    "college_",
    "computer_security",
    "conceptual_physics",
    "electrical_engineering",
    "elementary_mathematics",
    "high_school_biology",
    "high_school_chemistry",
    "high_school_computer_science",
    "high_school_mathematics",
    "high_school_physics",
    "high_school_statistics",
    "machine_learning",
)
HUMANITIES = (
    "formal_logic",
    "high_school_european_history",
    "high_school_us_history",
    "high_school_world_history",
    "international_law",
    "jurisprudence",
    "logical_fallacies",
    "moral_disputes",
    "moral_scenarios",
    "philosophy",
    "prehistory",
    "professional_law",
    "world_religions",
)


def _deepseek(root: Path):
    """``(name, topology, old load [L, E], new fit trace, held-out trace)``: the map in service was
    fitted on prompts 0-199; the new fit window is 1000-1499, held out 1500-1998; 16 GPUs / 2 nodes /
    80 slots."""
    tr = read_trace(root / "deepseek-v2-lite-chat-puffin/puffin_prompts_1-2000.npz")
    n = tr.num_windows
    old = tr.select_windows(range(0, 200)).counts()
    fit, held = tr.select_windows(range(1000, 1500)), tr.select_windows(range(1500, n))
    name = "deepseek-v2-lite, prompts 0-199 -> 1000-1499 (held out 1500-1998), 16 GPUs / 2 nodes / 80 slots"
    return name, Topology.from_redundant(64, 16, 16, 2), old, fit, held


def _olmoe(root: Path):
    """OLMoE arxiv -> github, 16 GPUs / 2 nodes / 80 slots. One window per domain: the new domain's
    counts are both fitted and scored (the old map never saw them)."""
    from profiling.trace import RoutingTrace

    with np.load(root / "olmoe-domains/olmoe_counts.npz", allow_pickle=False) as z:
        old, new, ids = z["expert_counts__arxiv"], z["expert_counts__github"], z["layer_ids"]
    parts = np.repeat(new[None] // 16, 16, axis=0)  # [16, L, E]: dealt evenly to the 16 source ranks
    parts[0] += new - parts.sum(axis=0)
    fit = RoutingTrace(64, layer_ids=tuple(int(i) for i in ids), window_counts=parts, name="olmoe github")
    name = "olmoe arxiv -> github (scored on github's counts), 16 GPUs / 2 nodes / 80 slots"
    return name, Topology.from_redundant(64, 16, 16, 2), old.astype(float), fit, fit


def _mixtral(root: Path):
    """Mixtral MMLU: STEM questions -> humanities (even questions fit, odd held out); 8 GPUs / 2 nodes
    / 16 slots."""
    path = root / "mixtral-8x7b-mmlu/mixtral_mmlu_counts.npz"
    tr = read_trace(path)
    with np.load(path, allow_pickle=False) as z:
        subj = z["subjects"][z["subject_index"]]  # [Q] subject of each question
    stem = np.flatnonzero([any(s.startswith(p) for p in STEM) for s in subj])
    hum = np.flatnonzero(np.isin(subj, HUMANITIES))
    old = tr.select_windows(stem).counts()
    fit, held = tr.select_windows(hum[0::2]), tr.select_windows(hum[1::2])
    return (
        "mixtral-8x7b mmlu, STEM -> humanities (odd questions held out), 8 GPUs / 2 nodes / 16 slots",
        Topology.from_redundant(8, 8, 8, 2),
        old,
        fit,
        held,
    )


def engine_map(load: np.ndarray, topo: Topology, seed: int = 0) -> Placement:
    """The published EPLB packing (``parity=True``); where it co-locates nothing, one extra copy per
    layer is written over a slot of its own GPU (an expert with another replica loses that slot)."""
    pl, _ = greedy_placement(load, topo, parity=True)
    if colocated_extra_copies(pl).sum():
        return pl
    rng, S = np.random.default_rng(seed), topo.slots_per_gpu
    rows = pl.physical_to_logical_map.copy()  # [L, P]
    for row in rows:
        for _ in range(100):
            g, s, t = rng.integers(topo.ep_size), *rng.choice(S, 2, replace=False)
            a, b = row[g * S + s], row[g * S + t]
            if a != b and (row == b).sum() >= 2:
                row[g * S + t] = a
                break
    return Placement(
        rows, pl.num_logical_experts, topo, pl.layer_ids, pl.provenance, allow_colocated_replicas=True
    )


def worst_layers(start: Placement, fresh: Placement, fit_load: np.ndarray, budget: int) -> Placement:
    """``start`` with whole layers taken from ``fresh`` (aligned to ``start``'s valid repair), most
    even-split peak gain per moved slot first, while the moved slots (against ``start``) fit ``budget``."""
    from placement.metrics import expected_gpu_load

    gain = expected_gpu_load(start, fit_load).max(axis=1) - expected_gpu_load(fresh, fit_load).max(axis=1)
    cost = (start.physical_to_logical_map != fresh.physical_to_logical_map).sum(axis=1)  # [L]
    rows, spent = start.physical_to_logical_map.copy(), 0
    for l in np.argsort(-gain / np.maximum(cost, 1), kind="stable"):
        if gain[l] > 0 and spent + cost[l] <= budget:
            rows[l], spent = fresh.physical_to_logical_map[l], spent + int(cost[l])
    colo = start.allow_colocated_replicas
    return Placement(
        rows, start.num_logical_experts, start.topology, start.layer_ids, {}, allow_colocated_replicas=colo
    )


def held_par(pl: Placement, held, dispatch: str) -> float:
    """Mean-over-layers PAR of ``pl`` on ``held`` under ``dispatch``: token by token on a per-token
    trace, else from tokens per (source rank, expert) with windows dealt round-robin to the ranks
    (expected shares; vLLM's hash is even in expectation there)."""
    if held.has_tokens:
        return par(pl, held, dispatch)
    counts = rank_expert_counts(held, pl.topology.ep_size)  # [L, G, E]
    return balance_stats(rank_gpu_load(pl, counts, dispatch))["par"]


def _point(start, new, held, dispatch, par_old, par_greedy) -> dict:
    p = held_par(new, held, dispatch)
    gap = par_old - par_greedy
    return {
        "moved": moved_slots(start, new),
        "arrived": arrived_experts(start, new),
        "par": p,
        "par_vs_greedy": p / par_greedy,
        "closed": (par_old - p) / gap if gap > 1e-12 else float("nan"),
    }


def front(case, budgets, dispatches, time_limit: float) -> list[dict]:
    """Every (start, dispatch, method, budget) point of one case."""
    name, topo, old, fit, held = case
    w = fit.counts()  # [L, E]
    starts = {"ours": greedy_placement(old, topo)[0], "engine": engine_map(old, topo)}
    rows = []
    for sname, start in starts.items():
        fresh = align_to_previous(greedy_placement(w, topo)[0], _valid(start, w))
        for d in dispatches:
            par_old, par_greedy = held_par(start, held, d), held_par(fresh, held, d)
            base = {"case": name, "start": sname, "dispatch": d, "par_start": par_old}
            g = _point(start, fresh, held, d, par_old, par_greedy)
            rows.append({**base, "method": "greedy", "budget": None, **g})
            for b in budgets:
                prob = Problem.build(topo, load=w, trace=fit, previous=start, dispatch=d)
                try:
                    new, _ = run_migration(prob, MigrationOptions(max_moves=b, time_limit=time_limit))
                except ValueError as exc:  # a budget below the repair the map in service needs
                    rows.append({**base, "method": "migration", "budget": b, "error": str(exc)})
                    continue
                rows.append(
                    {
                        **base,
                        "method": "migration",
                        "budget": b,
                        **_point(start, new, held, d, par_old, par_greedy),
                    }
                )
                wl = worst_layers(start, fresh, w, b)
                rows.append(
                    {
                        **base,
                        "method": "worst-layers",
                        "budget": b,
                        **_point(start, wl, held, d, par_old, par_greedy),
                    }
                )
    return rows


def _valid(start: Placement, w: np.ndarray) -> Placement:
    from solver.migration.slots import repair_colocated

    return repair_colocated(start, w)[0] if start.allow_colocated_replicas else start


def _print(rows: list[dict]) -> None:
    head = (
        f"{'start':>6} {'dispatch':>13} {'method':>12} {'budget':>6} {'moved':>6} {'arrived':>7} "
        f"{'start PAR':>9} {'held-out PAR':>12} {'/greedy':>8} {'closed':>7}"
    )
    case = None
    for r in rows:
        if r["case"] != case:
            case = r["case"]
            print(f"\n{case}\n{head}")
        b = "-" if r["budget"] is None else r["budget"]
        if "error" in r:
            print(f"{r['start']:>6} {r['dispatch']:>13} {r['method']:>12} {b:>6}  {r['error'][:80]}")
            continue
        print(
            f"{r['start']:>6} {r['dispatch']:>13} {r['method']:>12} {b:>6} {r['moved']:>6} {r['arrived']:>7} "
            f"{r['par_start']:>9.4f} {r['par']:>12.4f} {r['par_vs_greedy']:>8.4f} {100 * r['closed']:>6.1f}%"
        )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", default="deepseek,olmoe,mixtral")
    ap.add_argument("--budgets", default="25,50,100,200,300,500")
    ap.add_argument("--dispatch", default=",".join((EVEN.name, SGLANG_STATIC.name, VLLM_HASH.name)))
    ap.add_argument("--time-limit", type=float, default=5.0, help="seconds per migration solve")
    ap.add_argument("--json", help="write every point here")
    args = ap.parse_args(argv)
    root = default_traces_dir()
    cases = {"deepseek": _deepseek, "olmoe": _olmoe, "mixtral": _mixtral}
    budgets = [int(b) for b in args.budgets.split(",")]
    dispatches = [get_dispatch(d).name for d in args.dispatch.split(",")]
    rows = []
    for t in args.traces.split(","):
        try:
            case = cases[t](root)
        except FileNotFoundError as exc:
            print(f"skip {t}: {exc} (set MOE_TRACES_DIR)")
            continue
        rows += front(case, budgets, dispatches, args.time_limit)
    _print(rows)
    if args.json:
        atomic_write_text(args.json, json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
