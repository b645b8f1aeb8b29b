"""Every option placed and priced as the command runs: the held-out steps per phase, the all-to-all kernel
the engine's command selects for each phase, two-batch overlap when the command turns it on, and the
memory the replicas take. Used for the advice itself and, with other knobs or the halves swapped, for its
stability checks (:mod:`moe_placement.apps.advise.stability`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

import moe_placement.apps.advise.balance as balance
import moe_placement.apps.advise.cost as cost
import moe_placement.apps.advise.phases as phases
from moe_placement.apps.advise.advice import Row
from moe_placement.apps.advise.engines import ENGINES
from moe_placement.apps.advise.options import AdviseOptions
from placement.cost.hardware import ClusterSpec
from placement.cost.modelspec import ModelSpec
from placement.cost.ranges import value_range
from placement.model import Placement
from placement.steps import Steps, priced_phase
from profiling.trace import RoutingTrace

__all__ = ["Progress", "held_steps", "memory", "price", "rows", "run_stage", "step_tokens", "with_ranges"]

log = logging.getLogger(__name__)
# (items, total, description) -> the same items (a progress bar, or the identity)
Progress = Callable[[Iterable, int, str], Iterable]
UNSCORED = balance.Scores(math.nan, math.nan, math.nan)  # rows of a stability check: balance not scored


def run_stage(steps: list[tuple[str, Callable[[], Any]]], progress: Progress, desc: str) -> list[Any]:
    """Run each ``(name, fn)`` under ``progress`` (one stage of the advice); their results in order."""
    out = []
    for name, fn in progress(steps, len(steps), desc):
        log.debug("advise: %s", name)
        out.append(fn())
    return out


def step_tokens(held: RoutingTrace, options: AdviseOptions) -> dict[str, int]:
    """Tokens per rank per step of each priced phase (prefill capped so one step fits the held-out half)."""
    every = {"decode": options.decode_step_tokens, "prefill": balance.prefill_tokens(held, options)}
    return {ph: every[ph] for ph in options.priced_phases}


def held_steps(held: RoutingTrace, options: AdviseOptions) -> dict[str, Steps]:
    """The held-out steps of each priced phase."""
    return {
        ph: phases.held_out_steps(held, options.ep_size, ph, b, options.seed)
        for ph, b in step_tokens(held, options).items()
    }


def kernel(options: AdviseOptions, steps: Steps) -> str:
    """The all-to-all kernel the printed command runs these steps with (recorded engine batches: decode's)."""
    ph = priced_phase(steps.phase)
    return ENGINES[options.engine].a2a_kernels[ph]


def price(
    placement: Placement,
    held: RoutingTrace,
    steps: dict[str, Steps],
    dispatch: str,
    model: ModelSpec,
    cluster: ClusterSpec,
    options: AdviseOptions,
) -> dict[str, phases.PhasePrice]:
    """``placement`` under ``dispatch`` priced on each phase's held-out steps, as the command runs them."""
    on = options.overlap == "on"
    return {
        ph: phases.price_phase(
            placement,
            held,
            st,
            dispatch,
            model,
            cluster,
            options.context_len,
            kernel=kernel(options, st),
            overlap=on,
        )
        for ph, st in steps.items()
    }


def memory(model: ModelSpec, cluster: ClusterSpec, options: AdviseOptions, r: int) -> cost.MemoryCost:
    """Replica memory at ``r`` redundant slots per GPU, at the decode batch x context (``(E + R0) / G =
    ceil(E / G)``: the engines' minimum R0 fills the padding; ``r`` slots are on top)."""
    return cost.replica_memory(
        model, cluster, options.ep_size, r, options.decode_step_tokens, options.context_len
    )


def rows(
    fit: RoutingTrace,
    held: RoutingTrace,
    model: ModelSpec,
    cluster: ClusterSpec,
    options: AdviseOptions,
    progress: Progress,
    scored: bool = True,
) -> tuple[list[Row], dict[str, Placement], dict[str, Steps]]:
    """Placements for every option (fitted on ``fit``), then each row priced per phase on ``held``'s
    steps; ``scored`` False leaves the held-out balance scores out (a stability check needs prices only)."""
    opts, builds = balance.plan_options(fit, options)
    built = run_stage([(d, b) for _, d, b in builds], progress, "placements")
    placements = {k: p for (k, _, _), p in zip(builds, built)}
    steps = held_steps(held, options)

    def one(o: balance.Option) -> Row:
        pl = placements[o.placement_key]
        s = balance.score(pl, held, o.dispatch, options) if scored else UNSCORED
        p = price(pl, held, steps, o.dispatch, model, cluster, options)
        mem = memory(model, cluster, options, o.redundant_per_gpu)
        return Row(
            o.kind,
            o.dispatch,
            o.redundant_per_gpu,
            o.placement_key,
            s,
            p.get("decode"),
            p.get("prefill"),
            mem,
        )

    out = run_stage([(o.key, lambda o=o: one(o)) for o in opts], progress, "held-out prices")
    return out, placements, steps


def with_ranges(
    rows_: list[Row],
    base: Row,
    placements: dict[str, Placement],
    steps: dict[str, Steps],
    held: RoutingTrace,
    model: ModelSpec,
    cluster: ClusterSpec,
    options: AdviseOptions,
) -> list[Row]:
    """Each row with the range of its whole-step and MoE gains over the cost model's constant sets
    (:func:`placement.cost.ranges.value_range`); prices on a set other than ``cluster`` are
    computed once per row and set."""
    memo: dict[tuple[str, str], dict[str, phases.PhasePrice]] = {}
    central = repr(cluster)

    def prices(row: Row, c: ClusterSpec) -> dict[str, phases.PhasePrice]:
        key = (row.key, repr(c))
        if key not in memo:
            if key[1] == central:
                memo[key] = {ph: row.phase(ph) for ph in row.priced}
            else:
                memo[key] = price(placements[row.placement_key], held, steps, row.dispatch, model, c, options)
        return memo[key]

    def ranges(row: Row, ph: str) -> dict[str, tuple[float, float]]:
        def whole(c: ClusterSpec) -> float:
            return phases.gain(prices(row, c)[ph], prices(base, c)[ph])[0]

        def moe(c: ClusterSpec) -> float:
            p, b = prices(row, c)[ph], prices(base, c)[ph]
            return b.moe_ms / p.moe_ms - 1.0 if p.moe_ms > 0 else 0.0

        lo, _, hi = value_range(whole, cluster)
        mlo, _, mhi = value_range(moe, cluster)
        return {"whole_step_gain": (lo, hi), "moe_step_gain": (mlo, mhi)}

    return [replace(r, ranges={ph: ranges(r, ph) for ph in r.priced}) for r in rows_]
