"""Where a modelled advise gain comes from: the whole-step breakdown of the no-EPLB baseline and of one
option, per phase, on the held-out half exactly as ``moe-placement advise`` prices it.

Priced as advise prices it: the all-to-all kernel its command selects per phase, the engine's default
prefill chunk, and the whole-step gain's range over the cost model's constant sets (the range is the
low and high gain over :func:`placement.cost.ranges.value_range`'s constant sets).

Run (about a minute per phase on the full DeepSeek-V2-Lite trace):
    PYTHONPATH=. MOE_TRACES_DIR=... python benchmarks/advise_breakdown.py \
        [--trace PATH] [--model deepseek-v2-lite] [--hardware h200] [--nodes 4] \
        [--option "ours|sglang-dynamic|r1"] [--phase decode] [--max-steps 200] [--v3-sized]

Prints, for the baseline (trivial placement, one replica per expert, the engine's plain routing) and
the option: whole step = attention + shared experts + dense layers + LM head (the rest) + expert GEMM +
dispatch/combine + the dispatch's own per-step cost, in ms, and each term's share of the whole-step
gain. Also: the MoE layers' balance (busiest GPU and the mean per step and layer: token-expert pairs,
and the dispatch's received RDMA picks), and the published band (moe_placement.apps.advise.phases.PUBLISHED_GAIN)
next to the modelled gain, with the gain's range over the all-to-all constant sets
(placement.cost.ranges, each set priced on the same counted loads). ``--v3-sized`` prices the same routing with DeepSeek-V3's layer sizes (as
benchmarks/step_model_check.py does), to separate the model's size from the experts per GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_placement.apps.advise import balance  # noqa: E402
from moe_placement.apps.advise.engines import ENGINES  # noqa: E402
from moe_placement.apps.advise.options import AdviseOptions, resolve_model  # noqa: E402
from moe_placement.apps.advise.phases import published_band  # noqa: E402
from placement.cost.hardware import cluster_preset  # noqa: E402
from placement.cost.modelspec import load_model  # noqa: E402
from placement.cost.primitives import attention_time, lm_head_time, mlp_time  # noqa: E402
from placement.cost.ranges import value_range  # noqa: E402
from placement.cost.step_time import StepOptions, step_time_from_arrays  # noqa: E402
from placement.cost.traffic import StepArrays, layer_flows, traffic_bytes  # noqa: E402
from placement.dispatch import get_dispatch  # noqa: E402
from placement.steps import make_steps  # noqa: E402
from profiling.readers import read_trace  # noqa: E402

TRACE = "deepseek-v2-lite-chat-puffin/puffin_prompts_1-2000.npz"


def _rest_parts(model, cluster, tokens: float, phase: str, context_len: int) -> dict[str, float]:
    """The rest of the step by part, ms (the same primitives ``rest_of_step_seconds`` sums)."""
    gpu, ms = cluster.gpu, 1e3
    return {
        "attention": model.num_layers * attention_time(model, cluster, tokens, phase, context_len) * ms,
        "shared": model.num_moe_layers * mlp_time(model, gpu, tokens, model.shared_intermediate_size) * ms,
        "dense": model.num_dense_layers * mlp_time(model, gpu, tokens, model.dense_intermediate_size) * ms,
        "lm_head": lm_head_time(model, gpu, tokens, phase, context_len) * ms,
    }


def _placements(fit, options: AdviseOptions, option_key: str):
    """``(baseline placement, option placement, option dispatch)`` built as advise builds them."""
    rows, builds = balance.plan_options(fit, options)
    by_key = {k: b for k, _, b in builds}
    base = next(r for r in rows if r.kind == balance.NO_EPLB)
    opt = next((r for r in rows if r.key == option_key), None)
    if opt is None:
        raise SystemExit(f"no option {option_key!r}; options: {', '.join(r.key for r in rows)}")
    return (by_key[base.placement_key](), base.dispatch), (by_key[opt.placement_key](), opt.dispatch)


def _balance(pl, held, steps, dispatch: str, model, kernel: str) -> str:
    """Busiest GPU / mean per step and layer (means over both): token-expert pairs, received RDMA picks."""
    t = pl.topology
    G, S = t.ep_size, steps.num_steps
    ids = np.asarray(held.topk_ids)[steps.token]
    src = np.bincount(steps.step * G + steps.rank, minlength=S * G).reshape(S, G).astype(float)
    pairs, rdma = [], []
    for layer in range(ids.shape[1]):
        flows = layer_flows(
            pl, layer, ids[:, layer, :], steps.step, steps.rank, S, get_dispatch(dispatch), steps.row
        )
        pair = flows.reshape(S, G, G, t.slots_per_gpu).sum(axis=3)  # [S, G src, G dst]
        pairs.append(pair.sum(axis=1))
        recv = traffic_bytes(pair, src, t.gpus_per_node, model.top_k, kernel, 1.0)[1]
        rdma.append(recv[..., 1])
    p, r = np.stack(pairs), np.stack(rdma)  # [L, S, G]
    return (
        f"pairs per GPU busiest/mean {p.max(axis=-1).mean():.0f}/{p.mean():.0f}; received RDMA tokens busiest/mean "
        f"{r.max(axis=-1).mean():.0f}/{r.mean():.0f}"
    )


def _print(label: str, st, parts: dict[str, float]) -> None:
    rest = " ".join(f"{k} {v:.3f}" for k, v in parts.items())
    print(
        f"  {label:<9} whole {st.whole_ms:7.3f} = rest {st.rest_ms:.3f} ({rest}) + gemm {st.gemm_ms:.3f}"
        f" + a2a {st.a2a_ms:.3f} + overhead {st.dispatch_overhead_ms:.3f}   [MoE {st.moe_ms:.3f}]"
    )


def _report(phase: str, held, options, model, cluster, args, placed) -> None:
    """One phase: each placement's step breakdown and balance, the gain with its range, as advise prices."""
    G = options.ep_size
    b = args.decode_batch if phase == "decode" else balance.prefill_tokens(held, options)
    steps = make_steps(held, G, phase, b, seed=options.seed, max_steps=args.max_steps)
    print(f"{phase}: {steps.describe()}")
    kernel = ENGINES[options.engine].a2a_kernels[phase]  # the kernel advise's command selects
    ids = np.asarray(held.topk_ids)[steps.token]
    arrays = StepArrays(ids, steps.step, steps.rank, steps.num_steps, b, phase, steps.row)

    def priced(pl, d, c):
        return step_time_from_arrays(
            pl, arrays, d, model, c, context_len=args.context_len, options=StepOptions(kernel=kernel)
        )

    out = []
    for label, (pl, d) in zip(("baseline", "option"), placed):
        st = priced(pl, d, cluster)
        held_tokens = len(steps.token) / (steps.num_steps * G)
        _print(label, st, _rest_parts(model, cluster, held_tokens, phase, args.context_len))
        print(f"            {_balance(pl, held, steps, d, model, kernel)}")
        out.append(st)
    bs, op = out
    whole = bs.whole_ms / op.whole_ms - 1.0

    def whole_on(c) -> float:  # the same gain on one of the cost model's constant sets
        if c is cluster:
            return whole
        (bp, bd), (op_, od) = placed
        return priced(bp, bd, c).whole_ms / priced(op_, od, c).whole_ms - 1.0

    rlo, _, rhi = value_range(whole_on, cluster)
    lo, hi, src = published_band(phase)
    print(
        f"  gain: whole step {whole * 100:+.2f}% (range {rlo * 100:+.2f}% to {rhi * 100:+.2f}%; published "
        f"{lo:.1f}-{hi:.1f}%, {src}); MoE part "
        f"{(bs.moe_ms / op.moe_ms - 1) * 100:+.2f}%; saved ms: gemm {bs.gemm_ms - op.gemm_ms:+.3f}, a2a "
        f"{bs.a2a_ms - op.a2a_ms:+.3f}, overhead {bs.dispatch_overhead_ms - op.dispatch_overhead_ms:+.3f}; "
        f"MoE share of the baseline step {bs.moe_ms / bs.whole_ms * 100:.1f}%"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--trace", default=str(Path(os.environ.get("MOE_TRACES_DIR", "../shared/traces")) / TRACE)
    )
    ap.add_argument("--model", default="deepseek-v2-lite")
    ap.add_argument("--hardware", default="h200")
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--engine", default="sglang")
    ap.add_argument("--option", default="ours|sglang-dynamic|r1", help="an option key of advise's table")
    ap.add_argument("--phase", choices=("decode", "prefill", "both"), default="both")
    ap.add_argument("--decode-batch", type=int, default=64)
    ap.add_argument(
        "--prefill-chunk", type=int, default=None, help="tokens per rank (default: the engine's, as advise)"
    )
    ap.add_argument("--context-len", type=int, default=4096)
    ap.add_argument("--max-steps", type=int, default=None)
    ap.add_argument("--v3-sized", action="store_true", help="DeepSeek-V3's layer sizes on the same routing")
    args = ap.parse_args(argv)
    if not Path(args.trace).is_file():
        print(f"trace not found: {args.trace} (set MOE_TRACES_DIR)", file=sys.stderr)
        return 2
    trace = read_trace(args.trace)
    model, cluster = resolve_model(args.model, trace), cluster_preset(args.hardware)
    options = AdviseOptions(
        engine=args.engine,
        nodes=args.nodes,
        decode_step_tokens=args.decode_batch,
        prefill_step_tokens=args.prefill_chunk,
        context_len=args.context_len,
    ).resolved(cluster.gpu.hbm_bytes)
    fit, held = trace.split(0.5)
    if args.v3_sized:  # V3's layers (hidden 7168, FP8, 61 layers) with the trace's experts and top-k
        v3 = load_model("deepseek-v3")
        sized = {"num_logical_experts": model.num_logical_experts, "top_k": model.top_k}
        model = dataclasses.replace(v3, name="deepseek-v3-sized", num_groups=None, topk_group=None, **sized)
    (base_pl, base_d), (opt_pl, opt_d) = _placements(fit, options, args.option)
    G = options.ep_size
    print(
        f"{trace.name}: {model.name} on {cluster.name}, {G} GPUs / {args.nodes} nodes, option {args.option}"
    )
    for phase in ("decode", "prefill") if args.phase == "both" else (args.phase,):
        _report(phase, held, options, model, cluster, args, ((base_pl, base_d), (opt_pl, opt_d)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
