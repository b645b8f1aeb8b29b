"""STAND-INS for three interfaces other branches of issue 42 are adding, kept in this one module so each
switches with a one-line change once its branch is merged (nothing else in ``apps/advise`` needs to change):

- :func:`gain_range` -> ``placement.cost.ranges.value_range(fn, cluster)`` (the cost model's low /
  central / high constant sets of an uncalibrated cluster). Here: the central cluster only, ``(x, x, x)``.
- :func:`hardware_summary` -> the calibration branch's ``hardware_summary(cluster)``
  (``{"preset", "measured"}``). Here: the preset's name and :attr:`GpuSpec.calibrated`.
- :func:`price_arrays` -> ``placement.cost.step_time.step_time_from_arrays(..., kernel=..., overlap=...)``
  (the all-to-all kernel and two-batch overlap as explicit inputs of the one cost model). Here:
  composed from the current ``step_time_from_arrays``: the MoE part priced with the kernel's phase and
  the rest of the step with the step's own phase; two-batch overlap as two micro-batches (the step's
  batch rows split by parity), the step taking ``2 max(compute, all-to-all)`` of one micro-batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from placement.cost.hardware import ClusterSpec
from placement.cost.modelspec import ModelSpec
from placement.cost.primitives import PHASES, kernel_of_phase
from placement.cost.step_time import StepArrays, StepTime, rest_of_step_seconds, step_time_from_arrays
from placement.model import Placement

__all__ = ["gain_range", "hardware_summary", "price_arrays"]


def gain_range(fn: Callable[[ClusterSpec], float], cluster: ClusterSpec) -> tuple[float, float, float]:
    """``(low, central, high)`` of ``fn`` over the cost model's constant sets of ``cluster``.

    STAND-IN: evaluates the central cluster only. Switch to
    ``return placement.cost.ranges.value_range(fn, cluster)`` when that module exists.
    """
    x = float(fn(cluster))
    return x, x, x


def hardware_summary(cluster: ClusterSpec) -> dict:
    """``{"preset": name, "measured": bool}``: the GPU preset and whether its figures were measured.

    STAND-IN for the calibration branch's ``hardware_summary(cluster)``; measured = the preset holds
    measured times (:attr:`placement.cost.hardware.GpuSpec.calibrated`), never the file's suffix.
    """
    return {"preset": cluster.gpu.name, "measured": bool(cluster.gpu.calibrated)}


def _priced_phase(arrays: StepArrays) -> str:
    return arrays.phase if arrays.phase in PHASES else PHASES[0]  # engine batches: priced as decode


def _with_kernel(placement, arrays, dispatch, model, cluster, context_len, kernel) -> StepTime:
    """The step with the MoE layers' all-to-all on ``kernel``, the rest of the step on its own phase."""
    phase = _priced_phase(arrays)
    if kernel is None or kernel == kernel_of_phase(phase):
        return step_time_from_arrays(placement, arrays, dispatch, model, cluster, context_len=context_len)
    other = next(ph for ph in PHASES if kernel_of_phase(ph) == kernel)
    st = step_time_from_arrays(
        placement, replace(arrays, phase=other), dispatch, model, cluster, context_len=context_len
    )
    ok = arrays.step >= 0
    held = float(ok.sum()) / (arrays.num_steps * placement.topology.ep_size)
    rest = rest_of_step_seconds(
        model, cluster, held if held > 0 else arrays.step_tokens, phase, st.context_len
    )
    rest_ms = rest * 1e3
    return replace(
        st, whole_ms=st.moe_ms + st.dispatch_overhead_ms + rest_ms, rest_ms=rest_ms, phase=arrays.phase
    )


def _half(arrays: StepArrays, parity: int) -> StepArrays:
    """One micro-batch of two-batch overlap: the tokens in even (0) or odd (1) rows of each rank's batch."""
    rows = arrays.rows if arrays.rows is not None else np.arange(arrays.step.size)
    m = rows % 2 == parity
    return StepArrays(
        arrays.topk_ids[m],
        arrays.step[m],
        arrays.src[m],
        arrays.num_steps,
        max(1, math.ceil(arrays.step_tokens / 2)),
        arrays.phase,
        rows[m] // 2,
    )


def price_arrays(
    placement: Placement,
    arrays: StepArrays,
    dispatch: str,
    model: ModelSpec,
    cluster: ClusterSpec,
    *,
    context_len: float,
    kernel: str | None = None,
    overlap: bool = False,
) -> StepTime:
    """The one cost model's step time with the all-to-all ``kernel`` the command selects and two-batch
    ``overlap`` on or off.

    STAND-IN: switch to ``step_time_from_arrays(placement, arrays, dispatch, model, cluster,
    context_len=context_len, kernel=kernel, overlap=overlap)`` when the cost model takes both.
    """
    if not overlap:
        return _with_kernel(placement, arrays, dispatch, model, cluster, context_len, kernel)
    halves = [
        _with_kernel(placement, _half(arrays, p), dispatch, model, cluster, context_len, kernel)
        for p in (0, 1)
    ]
    compute = sum(h.rest_ms + h.gemm_ms + h.dispatch_overhead_ms for h in halves) / 2
    comm = sum(h.a2a_ms for h in halves) / 2
    return replace(
        halves[0],
        whole_ms=2.0 * max(compute, comm),
        moe_ms=sum(h.moe_ms for h in halves),
        gemm_ms=sum(h.gemm_ms for h in halves),
        a2a_ms=sum(h.a2a_ms for h in halves),
        dispatch_overhead_ms=sum(h.dispatch_overhead_ms for h in halves),
        rest_ms=sum(h.rest_ms for h in halves),
        step_tokens=arrays.step_tokens,
    )
