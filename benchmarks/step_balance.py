"""Per-step balance on held-out traffic: greedy under every dispatch model vs ``solve --dispatch balanced``.

    MOE_TRACES_DIR=/work/shared/traces python benchmarks/step_balance.py [--quick] [--json out.json]

Fit on the first half of each trace, score on the second half, 64 tokens per rank per step, one spare
slot per GPU (``num_redundant = ep_size``). Per configuration, in one run:

- step PAR (``step_par``, docs/metrics.md) of greedy under every registered dispatch model;
- ``solve --dispatch balanced`` (:func:`solver.api.solve` with ``dispatch="balanced"``) under
  ``balanced``: step PAR, its ratio to greedy's under ``balanced`` (greedy's best per-step split),
  window PAR under ``even`` against greedy's, and its split's peak over the LP optimum on the same
  placement (``lp_peak``, mean over held-out steps and layers);
- a lower bound on step PAR for any placement with these slots
  (:func:`solver.step_fit.step_lower_bound_par`);
- modelled MoE expert time of the peak GPU per layer (solver/planner/costmodel.py, docs/costmodel.md;
  DeepSeek-V2-Lite or Mixtral-8x7B on H200), mean over held-out steps, at 64 tokens per rank (decode,
  near the memory-bound knee) and at 4096 per rank (prefill, compute-bound; the same split scaled).

Mixtral's shared trace holds exact per-question counts, not per-token routing: its tokens are made
from them (each question's tokens carry its exact expert counts per layer, in random order inside the
question), so its steps mix real questions but not real token order. OLMoE's domain files hold one
count vector per domain (no steps): not used. Qwen1.5-MoE's GSM8K decode trace (another model and
domain, 60 experts, 5 layers logged) is per-token but short: its held-out half holds only a few steps
at these sizes (the ``held steps`` column), and its model has no built-in cost model spec (no times).
Mixtral is also fitted on MMLU's STEM questions and scored on the humanities, and the reverse.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from placement.cost.hardware import GPUS  # noqa: E402
from placement.cost.modelspec import load_model  # noqa: E402
from placement.cost.primitives import gemm_time  # noqa: E402
from placement.dispatch import DISPATCH, EVEN, get_dispatch  # noqa: E402
from placement.metrics import par, step_par  # noqa: E402
from placement.step_balance import lp_peak  # noqa: E402
from placement.topology import Topology  # noqa: E402
from profiling.readers import default_traces_dir, read_trace  # noqa: E402
from profiling.trace import RoutingTrace  # noqa: E402
from solver.api import FitOptions, solve  # noqa: E402
from solver.step_fit import sample_step_counts, step_lower_bound_par  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from online_front import HUMANITIES, STEM  # noqa: E402

STEP_TOKENS, PREFILL_TOKENS = 64, 4096
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


def step_gpu_peak(placement, layer: int, counts: np.ndarray, dispatch) -> np.ndarray:
    """Peak GPU tokens per step ``[N]`` of one layer: the model's ``step_load``, else the even split."""
    model, t = get_dispatch(dispatch), placement.topology
    if model.step_load is not None:
        slot = model.step_load(placement, layer, counts)  # [N, P]
    else:
        p2l = placement.physical_to_logical_map[layer]
        slot = counts[:, p2l] / placement.logical_replica_count[layer][p2l][None, :]
    return slot.reshape(counts.shape[0], t.ep_size, -1).sum(axis=2).max(axis=1)


def peak_time_us(counts: np.ndarray, placement, model, scale: float, dispatch) -> float:
    """Modelled expert-FFN time (us) of the peak GPU per layer and step, mean: ``counts [N, L, E]``."""
    gpu, t = GPUS["h200"], placement.topology
    d, f = model.hidden_size, model.moe_intermediate_size
    out = []
    for l in range(placement.num_layers):
        n = step_gpu_peak(placement, l, counts[:, l], dispatch) * scale  # [N] peak tokens
        act = n * (model.dispatch_bytes_per_token + 2 * d + 4 * f)
        out.append(
            gemm_time(gpu, 6.0 * d * f * n, t.slots_per_gpu * model.expert_bytes + act, model.weight_bytes)
        )
    return float(np.mean(out) * 1e6)


def lp_ratio(placement, counts: np.ndarray, dispatch) -> float:
    """Mean over steps and layers of the split's peak over the LP optimum on the same placement."""
    t, r = placement.topology, []
    for l in range(placement.num_layers):
        peak = step_gpu_peak(placement, l, counts[:, l], dispatch)
        lp = lp_peak(counts[:, l], placement.logical_to_physical_map[l], t.slots_per_gpu)
        r.append(peak / np.maximum(lp, 1e-12))
    return float(np.mean(r))


def run_config(label: str, fit: RoutingTrace, held: RoutingTrace, G: int, N: int, model, moves: int) -> dict:
    E = fit.num_logical_experts
    topo = Topology(ep_size=G, num_physical_experts=E + G, num_nodes=N)
    t0 = time.perf_counter()
    result = solve("greedy", topology=topo, trace=fit, dispatch=PER_STEP, fit=FitOptions(step_moves=moves))
    wall = time.perf_counter() - t0
    greedy, ours = result.baseline, result.placement
    row = {"trace": label, "config": f"{G} GPUs / {N} node{'s' * (N > 1)} / {E + G} slots", "solve_s": wall}
    for name in DISPATCH:
        row[f"greedy {name}"] = step_par(greedy, held, STEP_TOKENS, name)["step_par"]
    row["ours"] = step_par(ours, held, STEP_TOKENS, PER_STEP)["step_par"]
    row["ratio"] = row["ours"] / row[f"greedy {PER_STEP}"]
    row["window even greedy"], row["window even ours"] = par(greedy, held, EVEN), par(ours, held, EVEN)
    counts = sample_step_counts(held, G, STEP_TOKENS, None)  # [N, L, E] the disjoint held-out steps
    row["lower bound"] = step_lower_bound_par(counts, G, E + G)
    row["held steps"] = counts.shape[0]
    row["ours / LP"] = lp_ratio(ours, counts, PER_STEP)
    if model is None:  # no built-in cost model spec for this model
        return row
    for tag, b in (("decode", STEP_TOKENS), ("prefill", PREFILL_TOKENS)):
        s = b / STEP_TOKENS
        row[f"{tag} us greedy even"] = peak_time_us(counts, greedy, model, s, EVEN)
        row[f"{tag} us greedy balanced"] = peak_time_us(counts, greedy, model, s, PER_STEP)
        row[f"{tag} us ours balanced"] = peak_time_us(counts, ours, model, s, PER_STEP)
    return row


def print_rows(rows: list[dict]) -> None:
    names = list(DISPATCH)
    print("| trace | config | " + " | ".join(f"greedy {n}" for n in names) + " | ours balanced | ours/greedy "
          "| window PAR even greedy -> ours | ours/LP | lower bound | held steps | solve s |")  # fmt: skip
    print("|" + "---|" * (len(names) + 9))
    for r in rows:
        cells = [r["trace"], r["config"], *(f"{r[f'greedy {n}']:.3f}" for n in names), f"{r['ours']:.3f}"]
        cells += [f"{r['ratio']:.3f}", f"{r['window even greedy']:.4f} -> {r['window even ours']:.4f}"]
        cells += [
            f"{r['ours / LP']:.4f}",
            f"{r['lower bound']:.3f}",
            str(r["held steps"]),
            f"{r['solve_s']:.0f}",
        ]
        print("| " + " | ".join(cells) + " |")
    print("\nmodelled expert time of the peak GPU per layer, us (H200): greedy even / greedy balanced / ours")
    print("| trace | config | decode 64/rank | prefill 4096/rank |\n|---|---|---|---|")
    for r in (r for r in rows if "decode us ours balanced" in r):
        dec = " / ".join(
            f"{r[f'decode us {k}']:.1f}" for k in ("greedy even", "greedy balanced", "ours balanced")
        )
        pre = " / ".join(
            f"{r[f'prefill us {k}']:.0f}" for k in ("greedy even", "greedy balanced", "ours balanced")
        )
        print(f"| {r['trace']} | {r['config']} | {dec} | {pre} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick", action="store_true", help="fewer search moves (200 per layer), DeepSeek 32/4 only"
    )
    ap.add_argument(
        "--moves",
        type=int,
        default=FitOptions().step_moves,
        help="search moves per layer (the default fit's)",
    )
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    root = default_traces_dir()
    moves = 200 if args.quick else args.moves
    rows = []
    ds = root / "deepseek-v2-lite-chat-puffin/puffin_prompts_1-2000.npz"
    if ds.exists():
        tr, spec = read_trace(str(ds)), load_model("deepseek-v2-lite")
        for G, N in ((32, 4),) if args.quick else ((32, 4), (64, 8)):
            rows.append(run_config("DeepSeek-V2-Lite", *tr.split(0.5), G, N, spec, moves))
            print(json.dumps({k: v for k, v in rows[-1].items() if "us" not in k}), flush=True)
    else:
        print(f"skip deepseek: {ds} not found (set MOE_TRACES_DIR)")
    mx = root / "mixtral-8x7b-mmlu/mixtral_mmlu_counts.npz"
    if mx.exists() and not args.quick:
        tr, spec = mixtral_tokens(mx, 400), load_model("mixtral-8x7b")
        for G, N in ((8, 2), (4, 1)):
            rows.append(run_config("Mixtral-8x7B", *tr.split(0.5), G, N, spec, moves))
        dom = mixtral_domains(mx)
        for a, b in (("STEM", "humanities"), ("humanities", "STEM")):
            for G, N in ((8, 2), (4, 1)):
                rows.append(
                    run_config(f"Mixtral-8x7B, fit {a}, held out {b}", dom[a], dom[b], G, N, spec, moves)
                )
    qw = root / "qwen15-moe-gsm8k-decode/qwen15_gsm8k_layers_0_8_12_18_23.npz"
    if qw.exists() and not args.quick:  # another model and domain (GSM8K decode in vLLM); few steps
        fit, held = read_trace(str(qw)).split(0.5)
        for G, N in ((4, 1), (6, 1), (12, 2)):
            rows.append(run_config("Qwen1.5-MoE GSM8K", fit, held, G, N, None, moves))
    print_rows(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
