"""Goodput: the highest request rate at which at least a share ``X`` of the requests meets both latency
targets, found by simulating rates (:func:`moe_placement.apps.deploy.simulator.simulate`).

The search, on the same requests at every rate (their arrival times scale with ``1 / rate``):

1. a near-zero rate (the estimate / 1000): when even it misses, nothing is met (goodput 0);
2. bracket from the capacity estimate: double while the rate is met, halve while it is not (at most
   :data:`MAX_BRACKET` simulations each way);
3. bisect the bracket in log space ``iters`` times (each halves the ratio between its ends: 6 steps
   from a factor 2 leave 1.1%).

Attainment is not strictly monotone in the rate on a finite sample; the search keeps the highest rate
it saw met below the first rate it saw missed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from moe_placement.apps.deploy.simulator import DeploymentSim, Route, SimResult, Stop, simulate
from moe_placement.apps.deploy.workloads import Requests

__all__ = ["MAX_BRACKET", "CurvePoint", "Goodput", "Sampling", "at_rate", "percentiles_ms", "search_goodput"]

MAX_BRACKET = 10
ZERO_FACTOR = 1e-3


@dataclass(frozen=True)
class CurvePoint:
    """One simulated rate: the share of requests meeting both targets, each target alone, the p99
    latencies (ms; None when a request was never served) and whether the queue stayed bounded."""

    rate: float
    attainment: float
    ttft_ok: float
    tpot_ok: float
    ttft_p99_ms: float | None
    tpot_p99_ms: float | None
    stable: bool = True

    def to_dict(self) -> dict:
        return {
            "rate_rps": self.rate,
            "attainment": self.attainment,
            "ttft_ok": self.ttft_ok,
            "tpot_ok": self.tpot_ok,
            "ttft_p99_ms": self.ttft_p99_ms,
            "tpot_p99_ms": self.tpot_p99_ms,
            "stable": self.stable,
        }


@dataclass(frozen=True, eq=False)
class Goodput:
    """The search's answer: ``goodput_rps`` (0 when no rate is met), ``at`` the simulation whose
    percentiles are reported (at the goodput rate; the lowest rate simulated when nothing is met),
    ``curve`` every rate simulated, ascending, ``zero`` the near-zero rate's simulation and ``bracket`` the
    last ``(met, missed)`` rates (missed None: every rate tried was met)."""

    goodput_rps: float
    met: bool
    at: SimResult
    curve: tuple[CurvePoint, ...]
    zero: SimResult
    bracket: tuple[float, float | None] | None = None


def percentiles_ms(x: np.ndarray, qs=(50, 90, 99)) -> dict[str, float | None]:
    """``{"p50": ms, ...}`` of seconds ``x`` (None where the percentile is not finite)."""
    vals = np.asarray(x, dtype=np.float64)
    vals = np.where(np.isnan(vals), np.inf, vals)
    out = {}
    for q in qs:
        v = float(np.percentile(vals, q, method="higher")) if vals.size else math.inf
        out[f"p{q}"] = round(v * 1e3, 6) if math.isfinite(v) else None
    return out


@dataclass(frozen=True)
class Sampling:
    """How many requests a simulation at a rate holds, and how many of the first are a warm-up.

    Steady state is measured, not one burst: the deployment must fill (``inflight``: the requests its
    pools hold at once, each rank's sequence cap or KV budget; at a low rate only ``rate x latency_s``,
    the longest a request meeting the targets takes) and a queue that grows must have time to push waits
    past the TTFT target. A simulation at ``rate`` holds ``fill x (rate x ttft_s + min(inflight, rate x
    latency_s))`` requests (at least ``min_requests``, at most the sample's size); the first ``1 / fill``
    of them are the warm-up and are not measured.
    """

    min_requests: int
    inflight: float
    ttft_s: float
    latency_s: float
    fill: int = 4

    def count(self, rate: float, available: int) -> int:
        want = self.fill * (rate * self.ttft_s + min(self.inflight, rate * self.latency_s))
        want = math.ceil(want) if math.isfinite(want) else available
        return int(min(max(want, self.min_requests), available))

    def warmup(self, n: int) -> int:
        return n // self.fill


# A rate is unstable (its queue grows without bound) when the TTFT of the measured requests grows, over
# their arrival span, by more than this share of the TTFT target (least-squares trend).
UNSTABLE_GROWTH = 0.5


def unstable(res: SimResult, ttft_s: float) -> bool:
    """True when the served requests' TTFT trends up by more than :data:`UNSTABLE_GROWTH` x the target
    across the run: at that rate the queue grows, and a longer run would miss more."""
    ok = np.isfinite(res.first_token)
    if ok.sum() < 20:
        return False
    x, y = res.arrival[ok], (res.first_token - res.arrival)[ok]
    span = float(x.max() - x.min())
    if span <= 0:
        return False
    slope = float(np.polyfit(x - x.min(), y, 1)[0])
    return slope * span > UNSTABLE_GROWTH * ttft_s


class _Runs:
    """Simulations by rate (each rate simulated once), each on a prefix of the same requests; a run
    ends early when the TTFT target is certainly missed by more than the share allows, and a rate whose
    TTFT trends up (:func:`unstable`) is not met."""

    def __init__(self, dep, requests: Requests, targets, route: Route | None, sampling: Sampling, early=True):
        self.dep, self.requests, self.targets, self.route = dep, requests, targets, route
        self.sampling, self.early = sampling, early
        self.done: dict[float, tuple[SimResult, float]] = {}
        self.stable: dict[float, bool] = {}

    def __call__(self, rate: float) -> tuple[SimResult, float]:
        """``(measured requests' simulation, attainment)``; an unstable rate's attainment is reported as
        is but :meth:`met` says no."""
        if rate not in self.done:
            n = self.sampling.count(rate, self.requests.n)
            warm = self.sampling.warmup(n)
            ttft, tpot, share = self.targets
            stop = Stop(ttft, int(math.floor((1.0 - share) * (n - warm))), warm) if self.early else None
            with np.errstate(invalid="ignore"):
                res = simulate(self.dep, self.requests.head(n), rate, self.route, stop).tail(warm)
                self.done[rate] = (res, res.attainment(ttft, tpot))
            self.stable[rate] = not res.stopped and not unstable(res, ttft)
        return self.done[rate]

    def met(self, rate: float) -> bool:
        return self(rate)[1] >= self.targets[2] and self.stable[rate]

    def curve(self) -> tuple[CurvePoint, ...]:
        out = []
        for rate in sorted(self.done):
            res, att = self.done[rate]
            with np.errstate(invalid="ignore"):
                ttft, tpot = res.ttft, res.tpot
                t99, p99 = percentiles_ms(ttft, (99,))["p99"], percentiles_ms(tpot, (99,))["p99"]
                a, b = float((ttft <= self.targets[0]).mean()), float((tpot <= self.targets[1]).mean())
            out.append(CurvePoint(rate, att, a, b, t99, p99, self.stable[rate]))
        return tuple(out)


def search_goodput(
    dep: DeploymentSim,
    requests: Requests,
    targets: tuple[float, float, float],
    start: float | tuple[float, float],
    sampling: Sampling,
    iters: int = 6,
    route: Route | None = None,
) -> Goodput:
    """The goodput of ``dep`` (module docstring). ``targets``: ``(TTFT s, TPOT s, share X)``; ``start``:
    a capacity estimate where the bracket starts, or a bracket ``(met, missed)`` from an earlier, coarser
    search (each end checked, and moved when it does not hold); ``sampling``: requests per rate
    (prefixes of ``requests``)."""
    runs = _Runs(dep, requests, targets, route, sampling)
    est = float(start[0] if isinstance(start, tuple) else start)
    floor = max(est, 1e-9) * ZERO_FACTOR
    zero = runs(floor)[0]
    if not runs.met(floor):
        return Goodput(0.0, False, zero, runs.curve(), zero)
    met = runs.met
    if isinstance(start, tuple):
        lo, hi = _check_bracket(met, floor, *start)
    else:
        lo, hi = _bracket(met, floor, max(est, floor * 2))
    if hi is not None:
        for _ in range(iters):
            mid = math.sqrt(lo * hi)
            lo, hi = (mid, hi) if met(mid) else (lo, mid)
    return Goodput(lo, True, runs(lo)[0], runs.curve(), zero, (lo, hi))


def _bracket(met, floor: float, rate: float) -> tuple[float, float | None]:
    """``(met rate, missed rate or None)`` around ``rate``: doubled while met, else halved until met."""
    if met(rate):
        lo = rate
        for _ in range(MAX_BRACKET):
            if not met(rate * 2.0):
                return lo, rate * 2.0
            lo = rate = rate * 2.0
        return lo, None
    hi = rate
    for _ in range(MAX_BRACKET):
        rate = hi / 2.0
        if rate <= floor:
            break
        if met(rate):
            return rate, hi
        hi = rate
    return floor, hi


def _check_bracket(met, floor: float, lo: float, hi: float | None) -> tuple[float, float | None]:
    """A given bracket with each end checked: a missed ``lo`` or a met ``hi`` is moved outwards."""
    if not met(lo):
        return _bracket(met, floor, lo)
    if hi is None or met(hi):
        return _bracket(met, floor, hi if hi is not None else lo * 2.0)
    return lo, hi


def at_rate(
    dep: DeploymentSim,
    requests: Requests,
    targets: tuple[float, float, float],
    rate: float,
    sampling: Sampling,
    route: Route | None = None,
) -> Goodput:
    """One rate instead of a search (``--rate``): ``goodput_rps`` is the rate of requests that met both
    targets (``rate x attainment``); ``met`` when the attainment reaches the share."""
    runs = _Runs(dep, requests, targets, route, sampling, early=False)  # every request simulated
    res, att = runs(float(rate))
    return Goodput(float(rate) * att, runs.met(float(rate)), res, runs.curve(), res)
