"""Per-step balance by phase on held-out traffic: greedy vs ``solve --phase P --dispatch balanced``.

    MOE_TRACES_DIR=/work/shared/traces python benchmarks/step_balance.py [--quick] [--phase P] [--json out.json]

Fit on the first half of each trace, score on the second half, one spare slot per GPU
(``num_redundant = ep_size``), for each phase (``--phase``; default both): steps of that phase
(:func:`placement.steps.make_steps`: decode = steady-state continuous batching, prefill = chunks of
consecutive tokens; a trace that records its engine's batches is stepped by them, phase ``engine``)
with the phase's default tokens per rank (decode 64, prefill 256; ``--step-tokens`` overrides).
Per configuration and phase, in one run:

- held-out step PAR (``step_par``) of greedy under ``even`` and under ``balanced`` (greedy's best
  per-step split), and of ``solve --phase P --dispatch balanced`` (:func:`solver.api.solve`, the fit
  for that phase, priced by the model's preset on H200) under ``balanced``, with its ratio to greedy's;
- window PAR under ``even`` of both;
- modelled MoE time per step (:func:`placement.cost.step_time.step_time`, the one cost model: each
  GPU's grouped GEMM from its tokens and active experts, dispatch and combine over NVLink and RDMA,
  the phase's kernels) on the same held-out steps: greedy even / greedy balanced / ours balanced, and
  the ratio ours / greedy balanced (the model has no preset for Qwen1.5-MoE: no times there).

``--quick`` (about 5 minutes on 2 cores): DeepSeek 32/4, Mixtral 8/2, Qwen 4/1, 30 moves per layer.
Mixtral's shared trace holds exact per-question counts, not per-token routing: its tokens are made
from them (each question's tokens carry its exact expert counts per layer, in random order inside the
question), so its steps mix real questions but not real token order; a question is a sequence.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from placement.cost.hardware import cluster_preset  # noqa: E402
from placement.cost.modelspec import load_model  # noqa: E402
from placement.cost.step_time import step_time  # noqa: E402
from placement.dispatch import DISPATCH, EVEN  # noqa: E402
from placement.metrics import par, step_par  # noqa: E402
from placement.steps import PHASES, make_steps  # noqa: E402
from placement.topology import Topology  # noqa: E402
from profiling.readers import default_traces_dir, read_trace  # noqa: E402
from profiling.trace import RoutingTrace  # noqa: E402
from solver.api import FitOptions, solve  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from online_front import HUMANITIES, STEM  # noqa: E402

PER_STEP = next(n for n, m in DISPATCH.items() if m.needs_step_counts and m.runtime)  # ours


def mixtral_tokens(path: Path, questions: int | np.ndarray, seed: int = 0, name: str = "") -> RoutingTrace:
    """A per-token trace from MMLU questions of the exact counts: ``questions`` evenly spaced ones of
    the whole set, or these question indices."""
    rng = np.random.default_rng(seed)
    with np.load(path, allow_pickle=False) as z:
        counts, n_tok = z["counts"], z["n_tokens"]
    if np.ndim(questions) == 0:
        questions = np.linspace(0, counts.shape[0] - 1, int(questions)).astype(int)
    blocks = []
    for q in questions:
        n = int(n_tok[q])
        ids = np.empty((n, counts.shape[1], 2), np.int64)
        for l in range(counts.shape[1]):
            flat = np.repeat(np.arange(8), counts[q, l])[: 2 * n]  # sorted: t and t+n never match
            flat = np.pad(flat, (0, 2 * n - flat.size), constant_values=-1)
            ids[:, l] = np.stack([flat[:n], flat[n:]], axis=1)[rng.permutation(n)]
        blocks.append(ids)
    ids = np.concatenate(blocks)
    offsets = np.r_[0, np.cumsum([b.shape[0] for b in blocks])]
    return RoutingTrace(
        8, topk_ids=ids, seq_offsets=offsets, name=name or "mixtral mmlu (tokens from counts)"
    )


def mixtral_domains(path: Path, questions: int = 400) -> dict[str, RoutingTrace]:
    """Per-token traces of ``questions`` evenly spaced MMLU questions of the STEM subjects and of the
    humanities (the subject lists of ``benchmarks/online_front.py``)."""
    with np.load(path, allow_pickle=False) as z:
        subject = z["subjects"][z["subject_index"]]  # [Q] subject of each question
    picks = {
        "STEM": np.flatnonzero([any(s.startswith(p) for p in STEM) for s in subject]),
        "humanities": np.flatnonzero(np.isin(subject, HUMANITIES)),
    }
    out = {}
    for name, idx in picks.items():
        chosen = idx[np.linspace(0, idx.size - 1, questions).astype(int)]
        out[name] = mixtral_tokens(path, chosen, name=f"mixtral mmlu {name}")
    return out


def _times(pl, held, steps, model, cluster) -> tuple[float, float]:
    """Modelled ``(moe_ms, whole_ms)`` per step of ``pl`` under the per-step split on ``steps``."""
    t = step_time(pl, held, steps, PER_STEP, model, cluster)
    return t.moe_ms, t.whole_ms


def run_config(label, fit, held, G: int, N: int, model, moves: int, phase: str, b: int | None) -> dict:
    """One row: greedy and the fit for ``phase`` on the held-out steps of that phase."""
    E = fit.num_logical_experts
    topo = Topology(ep_size=G, num_physical_experts=E + G, num_nodes=N)
    fo = FitOptions(step_moves=moves, phase=phase, step_tokens=b, model=model.name if model else None)
    t0 = time.perf_counter()
    result = solve("greedy", topology=topo, trace=fit, dispatch=PER_STEP, fit=fo)
    wall = time.perf_counter() - t0
    greedy, ours = result.baseline, result.placement
    sp = step_par(ours, held, b, PER_STEP, phase)
    row = {"trace": label, "config": f"{G} GPUs / {N} node{'s' * (N > 1)} / {E + G} slots"}
    row.update(phase=sp["phase"], step_tokens=sp["step_tokens"], solve_s=wall, held_steps=sp["num_steps"])
    row["greedy even"] = step_par(greedy, held, b, EVEN, phase)["step_par"]
    row["greedy balanced"] = step_par(greedy, held, b, PER_STEP, phase)["step_par"]
    row["ours"] = sp["step_par"]
    row["ratio"] = row["ours"] / row["greedy balanced"]
    row["window even greedy"], row["window even ours"] = par(greedy, held, EVEN), par(ours, held, EVEN)
    if model is None:  # no built-in cost model spec for this model
        return row
    cluster = cluster_preset("h200", gpus_per_node=topo.gpus_per_node)
    steps = make_steps(held, G, phase, b)
    even = step_time(greedy, held, steps, EVEN, model, cluster)
    row["moe ms greedy even"] = even.moe_ms
    row["moe ms greedy balanced"], row["whole ms greedy balanced"] = _times(
        greedy, held, steps, model, cluster
    )
    row["moe ms ours"], row["whole ms ours"] = _times(ours, held, steps, model, cluster)
    row["time ratio"] = row["moe ms ours"] / row["moe ms greedy balanced"]
    return row


def print_rows(rows: list[dict]) -> None:
    print(
        "| trace | config | phase, tokens/rank | greedy even | greedy balanced | ours balanced | ours/greedy "
        "| window PAR even greedy -> ours | MoE ms greedy even / balanced / ours | MoE time ours/greedy "
        "| held steps | solve s |"
    )
    print("|" + "---|" * 12)
    for r in rows:
        cells = [r["trace"], r["config"], f"{r['phase']}, {r['step_tokens']}"]
        cells += [f"{r[k]:.3f}" for k in ("greedy even", "greedy balanced", "ours", "ratio")]
        cells.append(f"{r['window even greedy']:.4f} -> {r['window even ours']:.4f}")
        if "moe ms ours" in r:
            ms = (r["moe ms greedy even"], r["moe ms greedy balanced"], r["moe ms ours"])
            cells += [" / ".join(f"{x:.3f}" for x in ms), f"{r['time ratio']:.4f}"]
        else:
            cells += ["(no model preset)", "-"]
        cells += [str(r["held_steps"]), f"{r['solve_s']:.0f}"]
        print("| " + " | ".join(cells) + " |", flush=True)


def _configs(root: Path, quick: bool):
    """``(label, fit, held, G, N, model)`` of every configuration to run."""
    ds = root / "deepseek-v2-lite-chat-puffin/puffin_prompts_1-2000.npz"
    if ds.exists():
        tr, spec = read_trace(str(ds)), load_model("deepseek-v2-lite")
        for G, N in ((32, 4),) if quick else ((32, 4), (64, 8)):
            yield "DeepSeek-V2-Lite", *tr.split(0.5), G, N, spec
    else:
        print(f"skip deepseek: {ds} not found (set MOE_TRACES_DIR)")
    mx = root / "mixtral-8x7b-mmlu/mixtral_mmlu_counts.npz"
    if mx.exists():
        tr, spec = mixtral_tokens(mx, 400), load_model("mixtral-8x7b")
        for G, N in ((8, 2),) if quick else ((8, 2), (4, 1)):
            yield "Mixtral-8x7B", *tr.split(0.5), G, N, spec
        if not quick:
            dom = mixtral_domains(mx)
            for a, b in (("STEM", "humanities"), ("humanities", "STEM")):
                yield f"Mixtral-8x7B, fit {a}, held out {b}", dom[a], dom[b], 8, 2, spec
    qw = root / "qwen15-moe-gsm8k-decode/qwen15_gsm8k_layers_0_8_12_18_23.npz"
    if qw.exists():  # another model and domain (GSM8K decode in vLLM), stepped by its recorded batches
        fit, held = read_trace(str(qw)).split(0.5)
        for G, N in ((4, 1),) if quick else ((4, 1), (12, 2)):
            yield "Qwen1.5-MoE GSM8K (vLLM batches)", fit, held, G, N, None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick", action="store_true", help="DeepSeek 32/4, Mixtral 8/2, Qwen 4/1; 30 moves per layer"
    )
    ap.add_argument("--phase", choices=PHASES, action="append", help="phase to run (repeat; default both)")
    ap.add_argument(
        "--step-tokens", type=int, default=None, help="tokens per rank per step (default by phase)"
    )
    ap.add_argument(
        "--moves",
        type=int,
        default=None,
        help=f"search moves per layer (default {FitOptions().step_moves}, --quick 30)",
    )
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    moves = args.moves if args.moves is not None else (30 if args.quick else FitOptions().step_moves)
    rows = []
    for label, fit, held, G, N, spec in _configs(default_traces_dir(), args.quick):
        phases = args.phase or PHASES
        if held.step_offsets is not None:
            phases = phases[:1]  # stepped by the recorded batches whatever the phase: one row
        for phase in phases:
            rows.append(run_config(label, fit, held, G, N, spec, moves, phase, args.step_tokens))
            print(json.dumps(rows[-1]), flush=True)
    print_rows(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
