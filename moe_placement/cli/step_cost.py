"""``--model``, ``--hardware``, ``--context-len``, ``--overlap``, ``--a2a-kernel``, ``--attn-tp``: the
modelled whole-step time a command adds to its report (``step_time`` in ``evaluate --json``), from the
one cost model in :mod:`placement.cost`, with its range over the constant sets
(:mod:`placement.cost.ranges`)."""

from __future__ import annotations

import argparse

from moe_placement.base.limits import MAX_CONTEXT_LEN, MAX_RANKS
from moe_placement.cli.common import CliError, bounded_int, hardware_help, model_help
from placement.cost.primitives import KERNELS, kernel_of_phase
from placement.cost.step_time import OVERLAPS
from placement.steps import PHASES

__all__ = ["add_step_time_args", "hardware_dict", "step_time_dict"]


def add_step_time_args(p: argparse.ArgumentParser) -> None:
    """The cost-model flags (all optional; ``--model`` turns the step time on)."""
    p.add_argument(
        "--model",
        help=f"price whole steps with this model: {model_help()}; adds step_time to the report",
    )
    p.add_argument(
        "--hardware",
        help=f"GPU preset for step_time: {hardware_help()} "
        "(moe-placement calibrate: its measured links are priced, and the report's hardware says measured; "
        "a GEMM refitted on a GPU also makes step_time say calibrated: true)",
    )
    p.add_argument(
        "--context-len",
        type=bounded_int(1, MAX_CONTEXT_LEN, "MAX_CONTEXT_LEN"),
        help="cached tokens per sequence (decode) or prompt length (prefill) for step_time's attention (default 4096)",
    )
    p.add_argument(
        "--overlap",
        choices=OVERLAPS,
        default=None,
        help="two-batch overlap for step_time: off (default), on, or auto (the faster, as layout picks)",
    )
    p.add_argument(
        "--a2a-kernel",
        choices=KERNELS,
        default=None,
        help="all-to-all kernel the launch selects, for step_time (default: by phase, decode "
        + ", prefill ".join(kernel_of_phase(ph) for ph in PHASES)
        + ")",
    )
    p.add_argument(
        "--attn-tp",
        type=bounded_int(1, MAX_RANKS, "MAX_RANKS"),
        default=None,
        help="attention tensor-parallel size for step_time (default 1: pure attention DP, as layout's TP1 rows)",
    )


_PRICE_FLAGS = ("hardware", "context_len", "overlap", "a2a_kernel", "attn_tp")


def step_time_dict(args: argparse.Namespace, placement, trace, dispatch: str, steps) -> dict | None:
    """``StepTime.to_dict()`` of ``steps`` (a :class:`placement.steps.Steps`) under ``dispatch``, with
    ``whole_ms_range``, ``moe_ms_range``, ``a2a_ms_range`` and ``tokens_per_s_per_gpu_range`` over the
    constant sets; None when ``--model`` is not given (CliError when a pricing flag comes without it)."""
    from placement.cost.hardware import DEFAULT_HARDWARE, cluster_preset
    from placement.cost.modelspec import load_model
    from placement.cost.ranges import Range3, cluster_sets
    from placement.cost.step_time import StepOptions, price_loads, step_loads

    if args.model is None:
        given = [f"--{f.replace('_', '-')}" for f in _PRICE_FLAGS if getattr(args, f, None) is not None]
        if given:
            raise CliError(
                f"{' and '.join(given)} price step_time, which needs --model (e.g. --model deepseek-v3)"
            )
        return None
    if not trace.has_tokens:
        raise CliError(
            "--model prices the trace's steps, which needs a per-token trace; this one has counts only"
        )
    try:
        model = load_model(args.model)
        cluster = cluster_preset(
            args.hardware or DEFAULT_HARDWARE, gpus_per_node=placement.topology.gpus_per_node
        )
        loads = step_loads(placement, trace, steps, dispatch, model, cluster, kernel=args.a2a_kernel)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    options = StepOptions(kernel=args.a2a_kernel, overlap=args.overlap or "off", attn_tp=args.attn_tp or 1)
    kw = {
        "phase": steps.phase,
        "dispatch": dispatch,
        "context_len": args.context_len,
        "step_tokens": steps.step_tokens,
        "options": options,
    }
    priced = {name: price_loads(loads, model, c, **kw) for name, c in cluster_sets(cluster).items()}
    d = priced["central"].to_dict()
    for key in ("whole_ms", "moe_ms", "a2a_ms", "tokens_per_s_per_gpu"):
        d[f"{key}_range"] = Range3.of({k: getattr(st, key) for k, st in priced.items()}).span()
    return d


def hardware_dict(args: argparse.Namespace, placement) -> dict:
    """``{preset, measured, measured_parts}`` of the ``--hardware`` that priced ``step_time``
    (:func:`placement.cost.hardware.hardware_summary`)."""
    from placement.cost.hardware import DEFAULT_HARDWARE, cluster_preset, hardware_summary

    cluster = cluster_preset(
        args.hardware or DEFAULT_HARDWARE, gpus_per_node=placement.topology.gpus_per_node
    )
    return hardware_summary(cluster)
