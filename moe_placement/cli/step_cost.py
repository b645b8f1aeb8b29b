"""``--model``, ``--hardware`` and ``--context-len``: the modelled whole-step time a command adds to its
report (``step_time`` in ``evaluate --json``), from the one cost model in :mod:`placement.cost`."""

from __future__ import annotations

import argparse

from moe_placement.base.limits import MAX_CONTEXT_LEN
from moe_placement.cli.common import CliError, bounded_int

__all__ = ["add_step_time_args", "step_time_dict"]


def add_step_time_args(p: argparse.ArgumentParser) -> None:
    """The cost-model flags (all optional; ``--model`` turns the step time on)."""
    p.add_argument(
        "--model",
        help="price whole steps with this model: a built-in name (deepseek-v3, deepseek-v2-lite, mixtral-8x7b, "
        "qwen3-30b-a3b, olmoe-1b-7b, qwen1.5-moe-a2.7b), a model JSON, or a HF config.json / folder; adds step_time to the report",
    )
    p.add_argument(
        "--hardware",
        help="GPU preset for step_time: h100, h800, h200 (default), b200, or a preset .json "
        "(benchmarks/gpu_gemm_fit.py; then step_time says calibrated: true)",
    )
    p.add_argument(
        "--context-len",
        type=bounded_int(1, MAX_CONTEXT_LEN, "MAX_CONTEXT_LEN"),
        help="cached tokens per sequence (decode) or prompt length (prefill) for step_time's attention (default 4096)",
    )


def step_time_dict(args: argparse.Namespace, placement, trace, dispatch: str, steps) -> dict | None:
    """``StepTime.to_dict()`` of ``steps`` (a :class:`placement.steps.Steps`) under ``dispatch``, or
    None when ``--model`` is not given (CliError when ``--hardware``/``--context-len`` come without it)."""
    from placement.cost.hardware import cluster_preset
    from placement.cost.modelspec import load_model
    from placement.cost.step_time import step_time

    if args.model is None:
        if args.hardware is not None or args.context_len is not None:
            raise CliError(
                "--hardware and --context-len price step_time, which needs --model (e.g. --model deepseek-v3)"
            )
        return None
    if not trace.has_tokens:
        raise CliError(
            "--model prices the trace's steps, which needs a per-token trace; this one has counts only"
        )
    try:
        model = load_model(args.model)
        cluster = cluster_preset(args.hardware or "h200", gpus_per_node=placement.topology.gpus_per_node)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    return step_time(
        placement, trace, steps, dispatch, model, cluster, context_len=args.context_len
    ).to_dict()
