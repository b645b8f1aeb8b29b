"""``moe-placement validate``: apply a placement on real torch.distributed ranks and check it end to end.

For each selected placement row (one MoE layer) the check launches ``ep_size`` ranks (gloo on CPU or
NCCL on GPUs) once, replays recorded routing (``--trace``; a synthetic trace with the placement's
experts and layers otherwise) through :class:`runtime_hooks.ep_layer.EPMoELayer`, and prints, per
rank, the picks ``placement.metrics`` predicts against those the rank computed, plus the largest
output difference from a single-process MoE without replication. Exit code 0 when everything
matches, 1 on any mismatch, 2 on bad input.

With ``--model DIR_OR_CONFIG`` the check runs a real transformers MoE model instead (a checkpoint
folder, or a ``config.json`` for random weights drawn with ``--seed``): every rank serves its own
prompts with the placement applied (:mod:`runtime_hooks.hf`) and its logits are compared with the
single-process model; tokens per slot are compared with ``placement.metrics.route_tokens``. A placement
whose layers or expert count do not fit the model exits 2 with the numbers; ``--layers`` then names the
placement row serving each MoE layer of the model, in model order. ``--json`` prints one object.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from moe_placement.cli.common import (
    MAX_SECONDS,
    MAX_SEED,
    CliError,
    DeprecatedAlias,
    echo,
    ep_size_int,
    hidden_size_int,
    layer_row_int,
    non_negative_int,
    open_placement,
    open_trace,
)

__all__ = ["MAX_RANKS", "add_parser", "check_numbers", "run"]

MAX_RANKS = 256  # ranks one launch may start: each is a process holding the model (gloo) or a GPU (nccl)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from placement.dispatch import EVEN, dispatch_names

    runtime, offline = dispatch_names(runtime=True), dispatch_names(runtime=False)
    p = subparsers.add_parser(
        "validate",
        help="run a placement on real torch.distributed ranks; compare outputs and per-rank tokens",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("placement", help="placement file (any format placement.formats reads)")
    p.add_argument("--trace", help="per-token routing trace to replay (default: a synthetic trace)")
    p.add_argument(
        "--ranks",
        type=int,
        help=f"ranks to launch (1..{MAX_RANKS}); must equal the placement's ep_size (default: it)",
    )
    p.add_argument(
        "--dispatch",
        dest="dispatch",
        metavar="{" + ",".join(runtime) + "}",
        default=EVEN.name,
        help=f"replica selection the runtime applies on real ranks (default {EVEN.name}); the engines' "
        f"own rules ({', '.join(offline)}) are scored by `evaluate --dispatch`",
    )
    p.add_argument(
        "--policy",
        dest="dispatch",
        default=argparse.SUPPRESS,
        action=DeprecatedAlias,
        new="--dispatch",
        known=runtime,
        help=argparse.SUPPRESS,  # deprecated alias of --dispatch (docs/cli.md), hidden from --help
    )
    p.add_argument(
        "--tokens-per-rank",
        dest="step_tokens",
        type=int,
        default=32,
        help="tokens each rank replays, one step (default 32)",
    )
    p.add_argument("--offset", type=non_negative_int, help="first replayed token of the trace (default 0)")
    p.add_argument(
        "--layers",
        type=layer_row_int,
        nargs="+",
        help="placement rows to validate (0-based; default all); with --model, the row serving each MoE "
        "layer of the model, in model order (default: rows matched by layer id)",
    )
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    p.add_argument("--hidden", type=hidden_size_int, help="hidden size of the test experts (default 32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds (>= 1) before the ranks are stopped")
    p.add_argument("--ep-size", type=ep_size_int, help="ep_size for engine formats that do not store it")
    p.add_argument("--num-nodes", type=ep_size_int, help="nodes for engine formats that do not store it")
    p.add_argument(
        "--model",
        metavar="DIR_OR_CONFIG",
        help="run a transformers MoE model: a checkpoint folder, or a config.json for seeded random weights",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        help="model dtype with --model (default float32)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=run)


MIN_TIMEOUT = 1.0  # seconds: the ranks' rendezvous alone (spawn, connect to the store) needs about this


_FLAGS = {"step_tokens": "--tokens-per-rank"}  # a dest whose flag is not its dashed spelling


def check_numbers(
    args: argparse.Namespace,
    *,
    positive: tuple[str, ...] = (),
    at_least_one: tuple[str, ...] = (),
    non_negative: tuple[str, ...] = (),
) -> None:
    """The numeric flags in range (None: not given), else one :class:`CliError` line naming the flag.

    ``positive``: finite and > 0 (seconds, at most ``moe_placement.cli.common.MAX_SECONDS``; ``timeout`` at least
    :data:`MIN_TIMEOUT`); ``at_least_one``:
    integers >= 1 (``ranks`` also at most :data:`MAX_RANKS`); ``non_negative``: integers >= 0 (``seed``
    also at most ``moe_placement.cli.common.MAX_SEED``).
    """
    import math

    def flag(name: str) -> str:
        return _FLAGS.get(name) or "--" + name.replace("_", "-")

    for name in positive:
        v = getattr(args, name, None)
        if v is not None and not (math.isfinite(v) and v > 0):
            raise CliError(f"{flag(name)} must be a finite number > 0, got {v}; e.g. {flag(name)} 300")
        if name == "timeout" and v is not None and v < MIN_TIMEOUT:  # else c10d's own connect error
            raise CliError(
                f"--timeout {v:g} s is too short for the ranks to start and meet (their rendezvous alone "
                f"takes about {MIN_TIMEOUT:g} s); use --timeout {MIN_TIMEOUT:g} or more"
            )
    for name in at_least_one:
        v = getattr(args, name, None)
        if v is not None and v < 1:
            raise CliError(f"{flag(name)} must be >= 1, got {v}")
    for name in non_negative:
        v = getattr(args, name, None)
        if v is not None and v < 0:
            raise CliError(f"{flag(name)} must be >= 0, got {v}")
    for name, limit in (("seed", MAX_SEED), *((n, MAX_SECONDS) for n in positive)):
        v = getattr(args, name, None)
        if v is not None and v > limit:
            raise CliError(f"{flag(name)} {v} is outside the accepted range 0..{limit:.0f}")
    ranks = getattr(args, "ranks", None)
    if ranks is not None and ranks > MAX_RANKS:
        raise CliError(f"--ranks {ranks} is above the limit of {MAX_RANKS} ranks per launch; use fewer ranks")


def _refuse_ignored_flags(args: argparse.Namespace) -> None:
    """A flag the chosen mode does not use is refused (one line), then the defaults are filled in."""
    unused = (
        {"--offset": args.offset, "--hidden": args.hidden}  # the model routes its own tokens, own sizes
        if args.model is not None
        else {"--dtype": args.dtype}
    )
    for flag, value in unused.items():
        if value is not None:
            where = "the replayed trace and test experts, not --model" if args.model else "--model only"
            raise CliError(f"{flag} applies to {where}; drop it")
    args.offset = 0 if args.offset is None else args.offset
    args.hidden = 32 if args.hidden is None else args.hidden
    args.dtype = args.dtype or "float32"


def _check_args(args: argparse.Namespace, placement) -> None:
    """Numeric flags, the dispatch model and the rank count, before anything is launched."""
    from runtime_hooks.ep_layer import runtime_dispatch

    check_numbers(
        args,
        positive=("timeout",),
        at_least_one=("ranks", "step_tokens", "hidden", "ep_size", "num_nodes"),
        non_negative=("seed", "offset"),
    )

    runtime_dispatch(args.dispatch)
    G = placement.topology.ep_size
    if G > MAX_RANKS:
        raise CliError(f"the placement's ep_size {G} is above the limit of {MAX_RANKS} ranks per launch")
    if args.ranks is not None and args.ranks != G:
        raise CliError(
            f"--ranks {args.ranks} differs from the placement's ep_size {G}; omit --ranks or pass {G}"
        )


def _load_placement(args):
    """The placement argument, with ``--ep-size``/``--num-nodes`` for formats that do not store them."""
    kw = {k: v for k, v in (("ep_size", args.ep_size), ("num_nodes", args.num_nodes)) if v is not None}
    return open_placement(args.placement, **kw)


def _load_trace(args, placement):
    """The trace to replay, with rows matching the placement's rows."""
    if args.trace is None:
        from profiling.synthetic import synthetic_trace

        E = placement.num_logical_experts
        n = placement.topology.ep_size * args.step_tokens + args.offset
        return synthetic_trace(
            num_tokens=max(n, 16),
            num_layers=placement.num_layers,
            num_logical_experts=E,
            top_k=min(6, E - 1),
            num_prompts=max(1, min(16, n)),
            num_clusters=min(8, E),
            seed=args.seed,
            layer_ids=placement.layer_ids,
        )
    from profiling.readers import require_data

    path = Path(args.trace)
    trace = open_trace(args.trace, experts=(placement.num_logical_experts, "the placement"))
    require_data(trace, args.trace)
    if not trace.has_tokens:
        raise CliError(f"trace {path} has counts only; validate replays per-token routing (topk_ids)")
    if trace.num_logical_experts != placement.num_logical_experts:
        raise CliError(
            f"trace {path} has {trace.num_logical_experts} experts but the placement has {placement.num_logical_experts}"
        )
    if trace.num_layers != placement.num_layers:
        missing = [l for l in placement.layer_ids if l not in trace.layer_ids]
        if missing:
            raise CliError(
                f"the placement has {placement.num_layers} layers (ids {list(placement.layer_ids)[:6]}...) but the trace "
                f"has {trace.num_layers} (ids {list(trace.layer_ids)[:6]}...); layers {missing[:6]} are missing from the trace"
            )
        trace = trace.select_layers([trace.layer_ids.index(l) for l in placement.layer_ids])
    return trace


def run(args: argparse.Namespace) -> int:
    from runtime_hooks.validate import ValidationSpec, validate_placement

    check_numbers(args, at_least_one=("ep_size", "num_nodes"))
    _refuse_ignored_flags(args)
    placement = _load_placement(args)
    _check_args(args, placement)
    if args.model is not None:
        return run_model(args, placement)
    G = placement.topology.ep_size
    trace = _load_trace(args, placement)
    rows = list(range(placement.num_layers)) if not args.layers else list(args.layers)
    bad = [r for r in rows if not 0 <= r < placement.num_layers]
    if bad:
        raise CliError(f"--layers {bad} outside the placement's rows 0..{placement.num_layers - 1}")
    placement, trace = placement.select_layers(rows), trace.select_layers(rows)
    if args.backend == "nccl":
        import torch

        if torch.cuda.device_count() < 1:
            raise CliError("--backend nccl needs CUDA GPUs and none is visible; use --backend gloo")
    spec = ValidationSpec.from_trace(
        placement,
        trace,
        step_tokens=args.step_tokens,
        offset=args.offset,
        dispatch=args.dispatch,
        hidden=args.hidden,
        ffn=max(1, args.hidden // 2),
        seed=args.seed,
    )
    source = args.trace or "synthetic trace"
    if not args.json:
        echo(
            f"validate: {G} {args.backend} ranks, {len(rows)} layer(s), dispatch {args.dispatch}, "
            f"{args.step_tokens} tokens/rank from {source} (offset {args.offset})"
        )
    t0 = time.perf_counter()
    rep = validate_placement(spec, backend=args.backend, timeout=args.timeout)
    wall = time.perf_counter() - t0
    if args.json:
        echo(json.dumps(_layer_report_dict(rep, rows, wall)))
        return 0 if rep.ok else 1
    for i, lid in enumerate(rep.layer_ids):
        pred, meas = rep.predicted[i], rep.measured[i]
        status = "ok" if (pred == meas).all() else "MISMATCH"
        echo(
            f"layer {lid} (row {rows[i]}): tokens per rank predicted/measured "
            + " ".join(f"{int(p)}/{int(m)}" for p, m in zip(pred, meas))
            + f"  [{status}]  max |y - ref| {rep.max_abs_error_per_layer[i]:.2e}"
        )
    for line in rep.checksum_mismatches[:10]:
        echo(f"checksum mismatch: {line}")
    if rep.balanced_collective_us_per_layer is not None:
        us = rep.balanced_collective_us_per_layer
        echo(
            f"step counts all-gather: {rep.balanced_collective_bytes_per_layer} bytes per layer, "
            f"{sum(us) / max(len(us), 1):.0f} us per layer (slowest rank)"
        )
    verdict = "PASS" if rep.ok else "FAIL"
    echo(
        f"{verdict}: per-rank tokens {'equal' if rep.tokens_match else 'DIFFER from'} the prediction; "
        f"max output error {rep.max_abs_error:.2e} (tolerance {rep.atol:.0e}); "
        f"{len(rep.checksum_mismatches)} checksum mismatch(es); {wall:.1f} s"
    )
    return 0 if rep.ok else 1


def _layer_report_dict(rep, rows: list[int], wall: float) -> dict:
    """The ``--json`` object of the synthetic-expert check."""
    return {
        "ok": rep.ok,
        "policy": rep.dispatch,  # the --json key keeps its name (docs/cli.md)
        "layer_ids": list(rep.layer_ids),
        "rows": rows,
        "predicted": rep.predicted.tolist(),
        "measured": rep.measured.tolist(),
        "predicted_slots": rep.predicted_slots.tolist(),
        "measured_slots": rep.measured_slots.tolist(),
        "tokens_match": rep.tokens_match,
        "balanced_collective_us_per_layer": rep.balanced_collective_us_per_layer,
        "balanced_collective_bytes_per_layer": rep.balanced_collective_bytes_per_layer,
        "max_abs_error": rep.max_abs_error,
        "atol": rep.atol,
        "checksum_mismatches": list(rep.checksum_mismatches),
        "wall_seconds": wall,
    }


def run_model(args: argparse.Namespace, placement) -> int:
    """``--model``: the placement on a real transformers model over ``ep_size`` ranks."""
    from runtime_hooks.hf_validate import HFCase, validate_hf

    G = placement.topology.ep_size
    if args.trace is not None:
        raise CliError("--model runs the model's own routing; drop --trace")
    case = HFCase(
        args.model,
        placement,
        dispatch=args.dispatch,
        seed=args.seed,
        prompts_per_rank=2,
        seq_len=max(1, -(-args.step_tokens // 2)),
        dtype=args.dtype,
        rows=tuple(args.layers) if args.layers else None,
    )
    if not args.json:
        echo(f"validate: {args.model} on {G} {args.backend} ranks, dispatch {args.dispatch}, {args.dtype}")
    rep = validate_hf(case, backend=args.backend, timeout=args.timeout)
    if args.json:
        echo(json.dumps(rep.to_dict()))
        return 0 if rep.ok else 1
    echo(
        f"model {rep.model_class}: MoE layers {list(rep.layer_ids)} served by placement rows {list(rep.rows)}"
    )
    for i, lid in enumerate(rep.layer_ids):
        status = "ok" if (rep.predicted[i] == rep.measured[i]).all() else "MISMATCH"
        echo(f"layer {lid}: tokens per slot {rep.measured[i].tolist()}  [{status}]")
    for r, b in enumerate(rep.expert_bytes_per_rank):
        echo(
            f"rank {r}: expert bytes {b['before']} -> {b['after']}, max |logits - ref| {rep.max_abs_diff_per_rank[r]:.2e}"
        )
    tol = f"tolerance {rep.atol:.0e}" if rep.dtype == "float32" else f"{rep.dtype}: reported only"
    echo(
        f"{'PASS' if rep.ok else 'FAIL'}: tokens per slot {'equal' if rep.tokens_match else 'DIFFER from'} "
        f"the prediction; max logits difference {rep.max_abs_diff:.2e} ({tol})"
    )
    return 0 if rep.ok else 1


if __name__ == "__main__":  # pragma: no cover
    ap = argparse.ArgumentParser(prog="moe-placement")
    add_parser(ap.add_subparsers(dest="command", required=True))
    a = ap.parse_args()
    raise SystemExit(a.func(a))
