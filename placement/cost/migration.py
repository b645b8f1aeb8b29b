"""Migration seconds (online rebalancing): what moving experts' weights costs, from the one cost model.

    T_move = max over GPUs of (experts arriving on that GPU x W / B_link) + alpha

(costmodel.md, "Migration": the sum over changed slots of ``W / B_link`` plus the link's
latency, copies onto different GPUs in parallel, so the busiest receiving GPU sets the time; ``W``
one expert's weights in one layer, ``B_link`` the link's bulk, normal-kernel, bandwidth). Arrived
experts (:mod:`placement.churn`) are what crosses a link: an expert already held by the GPU is a
local copy. The rebalance rule (:mod:`runtime_hooks.rebalance_rule`), the online rebalancer and
``advise`` price a migration here; :func:`rebalance_stall_seconds` is the serving time an engine's
own rearrangement is measured to stop for.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

from placement.cost.hardware import REBALANCE_STALL_S, LinkSpec

__all__ = ["move_time", "rebalance_stall_seconds", "slot_copy_seconds"]


def _bulk(link: LinkSpec | tuple[float, float]) -> tuple[float, float]:
    """``(bytes/s, latency s)`` of bulk copies over ``link`` (its normal-kernel figures)."""
    bw, lat = link.kernel("normal") if isinstance(link, LinkSpec) else link
    return float(bw), float(lat)


def move_time(arrived_per_gpu: ArrayLike, expert_bytes: float, link: LinkSpec | tuple[float, float]) -> float:
    """Seconds of a rebalance's weight copies: the busiest receiving GPU's arrived experts x
    ``expert_bytes`` over the link's bulk (normal-kernel) bandwidth, plus its latency; 0 when nothing
    arrives. ``arrived_per_gpu`` int ``[G]`` (or ``[L, G]``, summed over layers); ``link`` a
    :class:`LinkSpec` or ``(bytes/s, latency s)``."""
    a = np.asarray(arrived_per_gpu)
    per_gpu = a.sum(axis=0) if a.ndim == 2 else a
    if per_gpu.size == 0 or per_gpu.sum() == 0:
        return 0.0
    bw, lat = _bulk(link)
    return float(per_gpu.max()) * float(expert_bytes) / bw + lat


def slot_copy_seconds(
    expert_bytes: float, link: LinkSpec | tuple[float, float], slots: float = 1.0, latency: bool = True
) -> float:
    """Seconds to copy ``slots`` experts onto one GPU: ``slots x W / B_link`` (+ the link's latency)."""
    bw, lat = _bulk(link)
    return float(slots) * float(expert_bytes) / bw + (lat if latency else 0.0)


def rebalance_stall_seconds(engine: str, asynchronous: bool) -> float:
    """Serving seconds one of ``engine``'s own rearrangements stops the steps for: the high end of its
    measured range (:data:`placement.cost.hardware.REBALANCE_STALL_S`), 0 when it rebalances
    asynchronously (weights move while steps keep running)."""
    if engine not in REBALANCE_STALL_S:
        raise ValueError(
            f"no measured rearrangement stall for engine {engine!r}; known: {tuple(REBALANCE_STALL_S)}"
        )
    return 0.0 if asynchronous else float(REBALANCE_STALL_S[engine][1])
