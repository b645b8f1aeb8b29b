"""Search budgets: wall-clock seconds, or a fixed amount of work for results that do not depend on the
machine's speed.

A local search bounded by seconds returns different placements on a fast and a slow machine (and on
one machine under different load). With ``work`` set, every loop is bounded by counted search steps
instead, and CP-SAT by its deterministic time, so one seed gives one placement everywhere; the seconds
are then ignored.
"""

from __future__ import annotations

import math
import numbers
import time

from moe_placement.base.limits import MAX_TIME_LIMIT_S, MAX_WORK_STEPS

__all__ = ["Budget", "as_budget", "check_time_limit"]

# CP-SAT deterministic time (its own work unit, about a second on a current core) per budget step
CPSAT_DET_PER_STEP = 0.005


class Budget:
    """What a search may still spend: ``seconds`` of wall time, or ``work`` counted steps when given.

    A step is one scan of a local search (score all moves, apply the best) or one repair step; callers
    :meth:`tick` once per step and test :meth:`ok` before the next.
    """

    def __init__(self, seconds: float, work: int | None = None):
        whole = isinstance(work, numbers.Integral) and not isinstance(work, bool)
        if work is not None and not (whole and 0 <= work <= MAX_WORK_STEPS):
            raise ValueError(
                f"work is {work!r} steps; accepted: an integer in 0..{MAX_WORK_STEPS} (MAX_WORK_STEPS: a "
                f"step is 1-10 ms), or None for a wall-clock budget"
            )
        _check_seconds(seconds, "a budget's seconds", 0.0)
        self.seconds = max(float(seconds), 0.0)
        self.work = None if work is None else int(work)
        self.used = 0
        self._deadline = time.perf_counter() + self.seconds

    def ok(self) -> bool:
        """True while the budget lasts."""
        if self.work is not None:
            return self.used < self.work
        return time.perf_counter() < self._deadline

    def tick(self, n: int = 1) -> None:
        self.used += int(n)

    def left_fraction(self) -> float:
        """Share of the budget not yet spent, in [0, 1]."""
        if self.work is not None:
            return max(self.work - self.used, 0) / self.work if self.work > 0 else 0.0
        if self.seconds <= 0:
            return 0.0
        return max(self._deadline - time.perf_counter(), 0.0) / self.seconds

    def part(self, fraction: float) -> Budget:
        """A new budget of ``fraction`` of this one's total (seconds or work), starting now."""
        f = max(float(fraction), 0.0)
        return Budget(self.seconds * f, None if self.work is None else int(round(self.work * f)))

    def rest(self) -> Budget:
        """A new budget of what is left of this one (the caller stops using this one)."""
        if self.work is not None:
            return Budget(0.0, max(self.work - self.used, 0))
        return Budget(max(self._deadline - time.perf_counter(), 0.0))

    def cpsat(self, parameters) -> None:
        """Set a CP-SAT solver's limits from this budget (deterministic time when ``work`` is set)."""
        if self.work is not None:
            parameters.max_deterministic_time = max(self.work * CPSAT_DET_PER_STEP, 0.01)
            parameters.max_time_in_seconds = 600.0  # a safety net only; never reached in normal runs
        else:
            parameters.max_time_in_seconds = max(self.seconds, 0.05)

    def __repr__(self) -> str:
        return (
            f"Budget(work={self.work}, used={self.used})"
            if self.work is not None
            else f"Budget({self.seconds:.3g}s)"
        )


def _check_seconds(value: object, what: str, low: float) -> float:
    """``value`` as float when a real number with ``low < value <= MAX_TIME_LIMIT_S`` (``low`` 0.0:
    ``>= 0``), else a one-line ValueError naming it."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    try:
        x = float(value) if ok else math.nan  # type: ignore[arg-type]
    except OverflowError:
        x = math.inf
    if not (math.isfinite(x) and (x > low if low > 0 else x >= 0) and x <= MAX_TIME_LIMIT_S):
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise ValueError(
            f"{what} is {shown}; accepted: a finite number of seconds in "
            f"{'(0' if low > 0 else '[0'}, {MAX_TIME_LIMIT_S:g}] (MAX_TIME_LIMIT_S); a time limit is a wall-clock budget"
        )
    return x


def check_time_limit(value: object, what: str = "time_limit") -> float:
    """A solve's time limit as float: a finite number of seconds in ``(0, MAX_TIME_LIMIT_S]`` (bool,
    NaN and infinities refused), else a one-line ValueError naming ``what`` and the range."""
    return _check_seconds(value, what, 1e-300)


def as_budget(limit: float | Budget) -> Budget:
    """``limit`` seconds as a :class:`Budget` (a Budget passes through)."""
    return limit if isinstance(limit, Budget) else Budget(float(limit))
