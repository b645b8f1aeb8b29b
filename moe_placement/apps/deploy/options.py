"""What ``plan`` searches and how: :class:`DeployOptions` (every knob, documented once)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from moe_placement.apps.deploy.workloads import MAX_LENGTH, MAX_REQUESTS
from moe_placement.base.options import refuse_unknown_keywords
from placement.cost.handoff import STREAMING
from placement.routing.rules import ROUND_ROBIN, get_rule

__all__ = ["DEPLOYMENT_KINDS", "COLOCATED", "DISAGGREGATED", "REPLICAS", "DeployOptions"]

COLOCATED, DISAGGREGATED, REPLICAS = "co-located", "disaggregated", "replicas"
DEPLOYMENT_KINDS = (COLOCATED, DISAGGREGATED, REPLICAS)


def _whole(name: str, v, lo: int, hi: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ValueError(f"DeployOptions.{name} must be a whole number in {lo}..{hi}, got {v!r}")


def _positive(name: str, v, hi: float = 1e12) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 < v <= hi:
        raise ValueError(f"DeployOptions.{name} must be a number in (0, {hi:g}], got {v!r}")


@refuse_unknown_keywords
@dataclass(frozen=True)
class DeployOptions:
    """How :func:`moe_placement.apps.deploy.plan.plan` searches deployments.

    Attributes:
        ttft_ms, tpot_ms: the latency targets (time to first token; time per output token after it).
        slo_attainment: share of requests that must meet both for a rate to count (goodput).
        deployments: kinds searched (:data:`DEPLOYMENT_KINDS`).
        rate: simulate this one rate (requests/s for the whole deployment) instead of searching.
        requests: the fewest requests simulated per rate; max_requests: the most (the sample's size).
        fill: a simulation holds ``fill`` times the requests the deployment has in flight (up to
            ``max_requests``) and does not measure the first ``1 / fill`` of them (the warm-up), so it
            measures steady state rather than one burst.
        seed: seeds the requests (lengths and arrivals).
        prompt_len, output_len: fix every prompt's / output's length (over the workload's).
        layouts_per_pool: best layouts of the planner's ranking simulated per pool.
        colocated_step_tokens: tokens per rank per step of a co-located step (decode tokens plus a
            prefill chunk) tried; the chunked-prefill size.
        prefill_step_tokens: tokens per rank per step of a prefill pool (its chunk).
        decode_step_tokens: the most sequences a rank decodes at once.
        max_splits: prefill:decode GPU splits tried (evenly spread over the possible ones).
        search_iters: bisection steps of the refined goodput search after the bracket (every deployment
            is first searched coarsely on fewer requests; the best of each kind, and the leader, are
            refined).
        kv_streaming: how the KV is sent (``layer``, ``chunk``, ``none``; placement.cost.handoff).
        handoff_fixed_s: fixed cost per hand-off (None: placement.cost.hardware.KV_HANDOFF_FIXED_S).
        fit_moves: move attempts per layer of the per-phase placement fit (solver.api.FitOptions).
        layout_steps: with a routing trace of the model's experts, the steps of it the layout planner
            prices per layout and phase (the first ones, ``CostOptions.max_steps``; None: every step,
            as ``layout --trace`` does by default, which costs seconds per pool size on a long trace).
        solver: the placement solver of the layout planner.
        route: the routing rule of requests to ranks, a name of :data:`placement.routing.ROUTING_RULES`
            (:mod:`moe_placement.apps.deploy.routes`); a callable route is passed to ``plan`` itself.
    """

    ttft_ms: float = 2000.0
    tpot_ms: float = 100.0
    slo_attainment: float = 0.9
    deployments: tuple[str, ...] = DEPLOYMENT_KINDS
    rate: float | None = None
    requests: int = 1000
    max_requests: int = 40000
    fill: int = 4
    seed: int = 0
    prompt_len: int | None = None
    output_len: int | None = None
    layouts_per_pool: int = 1
    colocated_step_tokens: tuple[int, ...] = (512, 2048, 8192)
    prefill_step_tokens: int = 8192
    decode_step_tokens: int = 256
    max_splits: int = 4
    search_iters: int = 4
    kv_streaming: str = "layer"
    handoff_fixed_s: float | None = None
    fit_moves: int = 10
    layout_steps: int | None = 16
    solver: str = "greedy"
    route: str = ROUND_ROBIN.name

    def __post_init__(self) -> None:
        _positive("ttft_ms", self.ttft_ms, 1e9)
        _positive("tpot_ms", self.tpot_ms, 1e9)
        _positive("slo_attainment", self.slo_attainment, 1.0)
        if self.rate is not None:
            _positive("rate", self.rate, 1e9)
        kinds = tuple(self.deployments)
        if not kinds or any(k not in DEPLOYMENT_KINDS for k in kinds) or len(set(kinds)) != len(kinds):
            raise ValueError(
                f"DeployOptions.deployments must be distinct kinds of {', '.join(DEPLOYMENT_KINDS)}, got {self.deployments!r}"
            )
        _whole("requests", self.requests, 1, MAX_REQUESTS)
        _whole("max_requests", self.max_requests, self.requests, MAX_REQUESTS)
        _whole("fill", self.fill, 2, 1000)
        _whole("seed", self.seed, 0, 2**32 - 1)
        for name in ("prompt_len", "output_len"):
            if getattr(self, name) is not None:
                _whole(name, getattr(self, name), 1, MAX_LENGTH)
        _whole("layouts_per_pool", self.layouts_per_pool, 1, 64)
        if not self.colocated_step_tokens:
            raise ValueError("DeployOptions.colocated_step_tokens needs at least one size")
        for v in self.colocated_step_tokens:
            _whole("colocated_step_tokens", v, 1, MAX_LENGTH)
        _whole("prefill_step_tokens", self.prefill_step_tokens, 1, MAX_LENGTH)
        _whole("decode_step_tokens", self.decode_step_tokens, 1, 1 << 16)
        _whole("max_splits", self.max_splits, 1, 1024)
        _whole("search_iters", self.search_iters, 0, 64)
        _whole("fit_moves", self.fit_moves, 0, 100_000)
        if self.layout_steps is not None:
            _whole("layout_steps", self.layout_steps, 1, 1 << 20)
        if self.kv_streaming not in STREAMING:
            raise ValueError(
                f"DeployOptions.kv_streaming must be one of {', '.join(STREAMING)}, got {self.kv_streaming!r}"
            )
        if not isinstance(self.route, str):
            raise ValueError(f"DeployOptions.route must be a routing rule's name, got {self.route!r}")
        get_rule(self.route)
        if self.handoff_fixed_s is not None and not (
            isinstance(self.handoff_fixed_s, (int, float)) and 0 <= self.handoff_fixed_s <= 60
        ):
            raise ValueError(
                f"DeployOptions.handoff_fixed_s must be seconds in [0, 60], got {self.handoff_fixed_s!r}"
            )

    @classmethod
    def quick(cls, **fields) -> DeployOptions:
        """A small search for a first look, notebooks and tests (``plan --quick``): one chunked-prefill
        size (2048 tokens per rank), 64 sequences per rank, 2 prefill:decode splits, 2 bisection steps,
        300 to 5000 requests per rate; ``fields`` override."""
        base = {
            "colocated_step_tokens": (2048,),
            "decode_step_tokens": 64,
            "max_splits": 2,
            "search_iters": 2,
            "requests": 300,
            "max_requests": 5000,
        }
        return cls(**{**base, **fields})

    @property
    def targets_s(self) -> tuple[float, float]:
        """``(TTFT, TPOT)`` targets in seconds."""
        return self.ttft_ms / 1e3, self.tpot_ms / 1e3
