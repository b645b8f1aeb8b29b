"""Online rebalancing hook for a serving loop: windowed load, drift trigger, off-thread re-placement.

Shapes: L MoE layers, E logical experts, G EP ranks (GPUs).

The serving loop feeds one ``[L, E]`` count matrix per step (from the counting hook in
:mod:`profiling.hooks`) to :meth:`Rebalancer.observe`; :meth:`Rebalancer.poll` (non-blocking) hands
back a new placement when an off-thread re-solve has finished AND its predicted gain beats its
migration cost; the ``apply`` callback (e.g. the runtime's atomic ``apply_placement``) is called
with it first.

Settings mirror vLLM's ``eplb_config`` names (``window_size``, ``step_interval``,
``num_redundant_experts``, ``log_balancedness``) and SGLang's equivalents
(``eplb_rebalance_num_iterations`` ~ ``step_interval``, ``expert_distribution_recorder_buffer_size``
~ ``window_size``).

Cost model (every constant is an overridable field; link figures as in :mod:`placement.cost.hardware`):

- migration: ``T_move = max over GPUs(slots copied onto that GPU, all layers) * expert_bytes / B_link
  + alpha`` (copies to different GPUs run in parallel), :func:`placement.cost.migration.move_time`.
  ``B_link`` and ``alpha``: the bulk-copy (normal-kernel) figures of the ``nvlink4`` and ``rdma``
  presets of :mod:`placement.cost.hardware` (270 GB/s and 40 us; 44.75 GB/s and 35.5 us). One 44 MB
  DeepSeek-V3 FP8 expert: 0.16 ms over NVLink, 0.98 ms over RDMA.
- gain: ``(peak_now - peak_new)`` per step, summed over layers, times the seconds one token-expert
  assignment costs on the peak GPU, times the steps of the next window (``horizon_steps``, default
  ``window_size``). Seconds per assignment: ``6 d f / (P_flops * eta_c)`` (grouped GEMM, compute
  bound): DeepSeek-V3 ``d=7168, f=2048``, Hopper FP8 ``1979 TFLOP/s``, ``eta_c=0.54``: 82 ns.
  Decode below the knee is memory-bound, where this overstates the gain of shaving tokens; raise
  ``move_cost_scale`` to be more conservative.
- the solver's per-slot move cost (load units) is the serial copy time of one expert converted to
  load at that rate: ``(expert_bytes / B_link) / (seconds_per_assignment * horizon / window_steps)``.

Trigger policies: ``interval`` re-solves every ``step_interval`` steps (as vLLM/SGLang do);
``gain`` checks every ``check_interval`` steps whether the predicted gain (current peak minus the
peak the last solve reached on its window, per layer, less ``noise_z`` Poisson standard deviations
of the window's peak so that sampling noise alone never looks like a gain) exceeds the migration cost of one slot, and
only then re-solves. Either way a finished re-solve is applied only when the rebalance rule
(:mod:`runtime_hooks.rebalance_rule`, shared with the engine plugins) says it pays: its gain on the
current window over the horizon at least ``margin`` (hysteresis, default 1.5) times its cost, the
busiest GPU's ARRIVED experts (what crosses a link) x ``expert_bytes`` / ``B_link`` + ``alpha``, times
``stall`` (``always_apply=True`` skips that gate; the event still carries the figures and the
break-even in steps). The first full window under the
``gain`` trigger calibrates the reachable peak with one solve.

The re-solve goes through the one pipeline, :func:`solver.api.run` (solver ``migration`` on a
:class:`solver.problem.Problem` holding the window's load, the placement in service and
``config.dispatch``). Importing this module needs numpy (and the dispatch registry) only: the
solver (and its scipy/ortools stack) is imported inside the worker function.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from moe_placement.base.limits import MAX_INTERMEDIATE_SIZE, MAX_TIME_LIMIT_S, check_whole
from moe_placement.base.options import refuse_unknown_keywords
from placement.cost.hardware import DEFAULT_HARDWARE, GPUS
from placement.cost.hardware import LINKS as _HW_LINKS
from placement.cost.migration import move_time, slot_copy_seconds
from placement.dispatch import EVEN, check_dispatch
from placement.model import Placement
from runtime_hooks.rebalance_rule import Decision, RuleParams, decide

__all__ = [
    "LINKS",
    "RebalanceEvent",
    "Rebalancer",
    "RebalancerConfig",
    "migration_time",
    "seconds_per_assignment",
    "slots_copied_per_gpu",
]

log = logging.getLogger(__name__)

# link name -> (effective bandwidth B/s, latency alpha s) of a bulk weight copy, from the presets.
LINKS: dict[str, tuple[float, float]] = {
    "nvlink": _HW_LINKS["nvlink4"].kernel("normal"),
    "rdma": _HW_LINKS["rdma"].kernel("normal"),
}


def seconds_per_assignment(
    hidden_size: int, intermediate_size: int, peak_flops: float, efficiency: float
) -> float:
    """Expert compute seconds for one (token, expert) assignment: ``6 d f / (P * eta_c)`` (GLU)."""
    return 6.0 * hidden_size * intermediate_size / (peak_flops * efficiency)


@refuse_unknown_keywords
@dataclass(frozen=True)
class RebalancerConfig:
    """Rebalancer settings (frozen).

    Attributes:
        window_size: steps in the sliding load window (vLLM ``window_size``).
        step_interval: steps between re-solves under the ``interval`` trigger (vLLM ``step_interval``).
        num_redundant_experts: redundant slots per layer; checked against the placement (vLLM name).
        log_balancedness: log each step's balancedness (mean/max GPU load) at INFO.
        trigger: ``interval`` or ``gain``.
        check_interval: steps between gain checks (0: ``max(1, window_size // 8)``).
        horizon_steps: steps the gain is predicted over (0: ``window_size``).
        link: ``nvlink`` or ``rdma`` (the link weights move over); ``link_bandwidth``/``link_latency``
            override :data:`LINKS`.
        hidden_size, expert_intermediate_size, peak_flops, compute_efficiency: the per-assignment
            compute time (defaults: DeepSeek-V3 on Hopper FP8).
        move_cost_scale: multiplies the solver's per-slot move cost (> 1: more conservative).
        max_moves: total moved slots per re-placement (None: no budget).
        method, time_limit, drift_guard: the migration solver's options
            (:class:`solver.migration.MigrationOptions`).
        dispatch: the dispatch model the runtime serves with (a name in
            :data:`placement.dispatch.DISPATCH`; default ``even``), passed to the solve pipeline.
        noise_z: under the ``gain`` trigger a layer's peak saving counts only beyond ``noise_z``
            standard deviations of sampling noise of the peak GPU's window load (Poisson: ``sqrt(peak)``),
            so moves that chase noise are not predicted to pay (0 disables). The ``interval`` trigger,
            like the engines, applies whatever beats its cost on the window (no discount).
        stall: share of a migration's copy time serving waits for (1: blocking; 0: fully overlapped).
        margin: hysteresis band of the apply gate: the predicted gain must reach ``margin`` x the
            migration cost (:mod:`runtime_hooks.rebalance_rule`).
        always_apply: apply every finished re-solve that moves something, without the gain gate.
        executor: ``thread`` or ``process`` (where the re-solve runs, off the serving thread).
    """

    window_size: int = 1000
    step_interval: int = 3000
    num_redundant_experts: int | None = None
    log_balancedness: bool = False
    trigger: Literal["interval", "gain"] = "interval"
    check_interval: int = 0
    horizon_steps: int = 0
    link: Literal["nvlink", "rdma"] = "nvlink"
    link_bandwidth: float | None = None
    link_latency: float | None = None
    hidden_size: int = 7168
    expert_intermediate_size: int = 2048
    peak_flops: float = GPUS[DEFAULT_HARDWARE].flops_fp8
    compute_efficiency: float = GPUS[DEFAULT_HARDWARE].eta_compute
    move_cost_scale: float = 1.0
    max_moves: int | None = None
    method: str = "incremental"
    time_limit: float = 2.0
    drift_guard: float = 1.5
    dispatch: str = EVEN.name
    noise_z: float = 3.0
    stall: float = 1.0
    margin: float = 1.5
    always_apply: bool = False
    executor: Literal["thread", "process"] = "thread"

    def __post_init__(self) -> None:
        for name in ("window_size", "step_interval"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name} must be a positive integer number of steps, got {v!r}")
        for name in ("check_interval", "horizon_steps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
                raise ValueError(f"{name} must be an integer >= 0 (0 = default), got {v!r}")
        if self.trigger not in ("interval", "gain"):
            raise ValueError(f"trigger must be 'interval' or 'gain', got {self.trigger!r}")
        if self.link not in LINKS:
            raise ValueError(f"link must be one of {sorted(LINKS)}, got {self.link!r}")
        if self.executor not in ("thread", "process"):
            raise ValueError(f"executor must be 'thread' or 'process', got {self.executor!r}")
        for name in ("peak_flops", "compute_efficiency", "move_cost_scale", "time_limit"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and np.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a positive number, got {v!r}")
        if not (0.0 <= self.stall <= 1.0):
            raise ValueError(f"stall must be in [0, 1], got {self.stall!r}")
        if not (np.isfinite(self.margin) and self.margin >= 1.0):
            raise ValueError(f"margin must be a finite number >= 1, got {self.margin!r}")
        if not (np.isfinite(self.noise_z) and self.noise_z >= 0):
            raise ValueError(f"noise_z must be a finite number >= 0, got {self.noise_z!r}")
        check_dispatch(self.dispatch)
        if self.max_moves is not None and (int(self.max_moves) != self.max_moves or self.max_moves < 0):
            raise ValueError(f"max_moves must be a non-negative integer or None, got {self.max_moves!r}")
        self._check_more()

    def _check_more(self) -> None:
        """The fields checked only at the first re-solve (or never) before: link, sizes, solver options."""
        if self.num_redundant_experts is not None:
            check_whole(
                "num_redundant_experts", self.num_redundant_experts, 0, fix="or None to take the placement's"
            )
        for name in ("hidden_size", "expert_intermediate_size"):
            check_whole(
                name, getattr(self, name), 1, MAX_INTERMEDIATE_SIZE, fix="the model's size (e.g. 7168)"
            )
        for name, lo in (("link_bandwidth", 0.0), ("link_latency", -1.0)):
            v = getattr(self, name)
            ok = v is None or (isinstance(v, (int, float, np.number)) and not isinstance(v, bool) and v > lo)
            if not ok or (v is not None and not np.isfinite(v)):
                what = "bytes/s > 0" if lo == 0.0 else "seconds >= 0"
                raise ValueError(f"{name} must be None (the link's preset) or finite {what}, got {v!r}")
        if not self.compute_efficiency <= 1.0:
            raise ValueError(f"compute_efficiency must be in (0, 1], got {self.compute_efficiency!r}")
        if not self.time_limit <= MAX_TIME_LIMIT_S:
            raise ValueError(f"time_limit is {self.time_limit:g} s, over the accepted {MAX_TIME_LIMIT_S:g}")
        if self.method not in ("auto", "exact", "incremental"):  # solver.migration.METHODS
            raise ValueError(f"method must be 'auto', 'exact' or 'incremental', got {self.method!r}")
        if not (isinstance(self.drift_guard, (int, float)) and 1.0 <= self.drift_guard < float("inf")):
            raise ValueError(f"drift_guard must be a finite number >= 1, got {self.drift_guard!r}")

    @property
    def bandwidth(self) -> float:
        return float(self.link_bandwidth if self.link_bandwidth is not None else LINKS[self.link][0])

    @property
    def latency(self) -> float:
        return float(self.link_latency if self.link_latency is not None else LINKS[self.link][1])

    @property
    def seconds_per_assignment(self) -> float:
        return seconds_per_assignment(
            self.hidden_size, self.expert_intermediate_size, self.peak_flops, self.compute_efficiency
        )

    @property
    def effective_check_interval(self) -> int:
        return self.check_interval or max(1, self.window_size // 8)

    @property
    def effective_horizon(self) -> int:
        return self.horizon_steps or self.window_size


@dataclass(frozen=True)
class RebalanceEvent:
    """One finished re-solve: what it would move, what it would gain, whether it was applied."""

    step: int
    trigger: str
    applied: bool
    moved_slots: int
    moved_bytes: float
    migration_time_s: float
    predicted_gain_s: float
    peak_before: float
    peak_after: float
    solve_wall_s: float
    solve_thread: str
    reason: str = ""
    arrived_experts: int = 0
    break_even_steps: float = 0.0


def slots_copied_per_gpu(previous_map: np.ndarray, new_map: np.ndarray, ep_size: int) -> np.ndarray:
    """int64 ``[G]``: slots whose expert changes, per receiving GPU, summed over layers.

    Args:
        previous_map, new_map: int ``[L, P]`` physical-to-logical maps.
    """
    a, b = np.asarray(previous_map), np.asarray(new_map)
    if a.shape != b.shape:
        raise ValueError(f"maps differ in shape {a.shape} vs {b.shape}")
    changed = (a != b).reshape(a.shape[0], ep_size, -1)  # [L, G, S]
    return changed.sum(axis=(0, 2)).astype(np.int64)


def migration_time(
    previous_map, new_map, ep_size: int, expert_bytes: float, bandwidth: float, latency: float
) -> float:
    """``T_move`` seconds: the busiest receiving GPU's copies at ``bandwidth`` plus ``latency``; 0 if nothing moves."""
    return move_time(slots_copied_per_gpu(previous_map, new_map, ep_size), expert_bytes, (bandwidth, latency))


def _gpu_peaks(p2l: np.ndarray, load: np.ndarray, ep_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-layer peak and mean GPU load ``([L], [L])`` of a map ``[L, P]`` under even split of ``load [L, E]``."""
    L, P = p2l.shape
    E = load.shape[1]
    cnt = np.zeros((L, E))
    np.add.at(cnt, (np.repeat(np.arange(L), P), p2l.ravel()), 1.0)
    per_rep = load / np.maximum(cnt, 1.0)  # [L, E]
    slot = np.take_along_axis(per_rep, p2l, axis=1)  # [L, P]
    gpu = slot.reshape(L, ep_size, P // ep_size).sum(axis=2)  # [L, G]
    return gpu.max(axis=1), gpu.mean(axis=1)


RESOLVER = "migration"  # the solver of solver.api.SOLVERS the rebalancer re-places with


def _resolve_job(
    load: np.ndarray, placement, kwargs: dict, dispatch: str = EVEN.name
) -> tuple[Any, Any, float, str]:
    """Worker body (module level so a process pool can run it): the pipeline re-places ``load [L, E]``
    from ``placement`` with the migration solver's ``kwargs``; the lazy solver import lives here."""
    from solver.api import make_options, run
    from solver.problem import Problem

    t0 = time.perf_counter()
    problem = Problem.build(placement.topology, load=load, previous=placement, dispatch=dispatch)
    new, report = run(RESOLVER, problem, make_options(RESOLVER, kwargs))
    return new, report, time.perf_counter() - t0, threading.current_thread().name


def _check_arguments(placement, config, apply, executor) -> None:
    """A ValueError naming the :class:`Rebalancer` argument whose type is wrong (before: an
    AttributeError at construction, or a TypeError in the worker thread at the first re-solve)."""
    if not isinstance(placement, Placement):
        raise ValueError(
            f"current_placement must be a placement.model.Placement, got {type(placement).__name__}"
        )
    if not isinstance(config, RebalancerConfig):
        raise ValueError(
            f"config must be a RebalancerConfig, got {type(config).__name__}; build one with RebalancerConfig(**fields)"
        )
    if apply is not None and not callable(apply):
        raise ValueError(f"apply must be a callable apply(new_placement) or None, got {type(apply).__name__}")
    if executor is not None and not isinstance(executor, cf.Executor):
        raise ValueError(
            f"executor must be a concurrent.futures.Executor or None, got {type(executor).__name__}"
        )


class Rebalancer:
    """Sliding-window rebalancer driven by per-step expert counts.

    Args:
        current_placement: the :class:`placement.model.Placement` in service.
        config: :class:`RebalancerConfig`.
        expert_bytes: bytes of one expert's weights in one layer (default ``3 * hidden_size *
            expert_intermediate_size`` of the config: GLU, 1 byte per weight as in FP8).
        link: overrides ``config.link`` when given.
        apply: callback ``apply(new_placement) -> None`` (the runtime's atomic migration); when it
            raises, the old placement stays in service and the error is logged.
        executor: a ``concurrent.futures.Executor`` to run re-solves on (default: one private worker
            thread, or a one-process pool with ``config.executor == "process"``).
    """

    def __init__(
        self,
        current_placement,
        config: RebalancerConfig | None = None,
        expert_bytes: float | None = None,
        link: str | None = None,
        apply: Callable[[Any], None] | None = None,
        executor: cf.Executor | None = None,
    ):
        cfg = RebalancerConfig() if config is None else config
        _check_arguments(current_placement, cfg, apply, executor)
        if link is not None:
            if link not in LINKS:
                raise ValueError(f"link must be one of {sorted(LINKS)}, got {link!r}")
            from dataclasses import replace

            cfg = replace(cfg, link=link)
        if (
            cfg.num_redundant_experts is not None
            and cfg.num_redundant_experts != current_placement.num_redundant_experts
        ):
            raise ValueError(
                f"config says num_redundant_experts={cfg.num_redundant_experts} but the placement has "
                f"{current_placement.num_redundant_experts} ({current_placement.num_physical_experts} slots - "
                f"{current_placement.num_logical_experts} experts); make them agree"
            )
        self.config = cfg
        self.expert_bytes = float(
            expert_bytes if expert_bytes is not None else 3 * cfg.hidden_size * cfg.expert_intermediate_size
        )
        if not 0 < self.expert_bytes < float("inf"):
            raise ValueError(f"expert_bytes must be a finite number > 0, got {expert_bytes!r}")
        self.apply_fn = apply
        self._placement = current_placement
        L, E = current_placement.num_layers, current_placement.num_logical_experts
        self._ring = np.zeros((cfg.window_size, L, E))  # [W, L, E] last W steps
        self._sum = np.zeros((L, E))  # [L, E] sum of the ring
        self._filled = 0
        self.step = 0
        self._own_executor = executor is None
        if executor is None:
            executor = (
                cf.ProcessPoolExecutor(max_workers=1)
                if cfg.executor == "process"
                else cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="moe-rebalancer")
            )
        self._executor = executor
        self._future: cf.Future | None = None
        self._pending_meta: dict | None = None
        self._reachable_par: np.ndarray | None = None  # [L] PAR the last solve reached on its window
        self.history: list[RebalanceEvent] = []
        self.num_solves = 0

    # ---- state ---------------------------------------------------------------------------------
    @property
    def placement(self):
        """The placement in service."""
        return self._placement

    def set_placement(self, placement) -> None:
        """Tell the rebalancer which placement is in service (e.g. after the runtime aborted a migration,
        or when one rank decides for a multi-rank runtime and the collective apply ran elsewhere)."""
        if (placement.num_layers, placement.num_logical_experts) != self._sum.shape:
            raise ValueError(
                f"placement has {placement.num_layers} layers x {placement.num_logical_experts} experts; "
                f"the rebalancer tracks {self._sum.shape[0]} x {self._sum.shape[1]}"
            )
        self._placement = placement

    @property
    def pending(self) -> bool:
        """True while a re-solve is submitted and not yet consumed by :meth:`poll`."""
        return self._future is not None

    def window_load(self) -> np.ndarray:
        """float64 ``[L, E]``: summed counts of the last ``min(steps, window_size)`` steps."""
        return self._sum.copy()

    @property
    def window_steps(self) -> int:
        return self._filled

    def move_cost(self) -> float:
        """The solver's cost of one moved slot, in window-load units (see the module docstring)."""
        cfg = self.config
        per_slot_s = slot_copy_seconds(self.expert_bytes, (cfg.bandwidth, cfg.latency), latency=False)
        seconds_per_load = cfg.seconds_per_assignment * cfg.effective_horizon / max(self._filled, 1)
        return cfg.move_cost_scale * per_slot_s / seconds_per_load

    def rule_params(self) -> RuleParams:
        """The rebalance rule's constants (:mod:`runtime_hooks.rebalance_rule`) from the config: the
        horizon in windows of the current window's length, the noise discount under ``gain`` only."""
        cfg = self.config
        return RuleParams(
            seconds_per_assignment=cfg.seconds_per_assignment,
            expert_bytes=self.expert_bytes,
            bandwidth=cfg.bandwidth,
            latency=cfg.latency,
            stall=cfg.stall,
            horizon=cfg.effective_horizon / max(self._filled, 1),
            margin=cfg.margin,
            noise_z=cfg.noise_z if cfg.trigger == "gain" else 0.0,
            always=cfg.always_apply,
        )

    def verdict(self, new) -> Decision:
        """The rule's verdict on switching from the placement in service to ``new`` (a Placement) for
        the current window: gain over the horizon against the arrived experts' copy time."""
        from placement.churn import arrived_per_gpu

        G = self._placement.topology.ep_size
        now = _gpu_peaks(self._placement.physical_to_logical_map, self._sum, G)[0]  # [L]
        after = _gpu_peaks(new.physical_to_logical_map, self._sum, G)[0]  # [L]
        return decide(now, after, arrived_per_gpu(self._placement, new), self.rule_params())

    def predicted_gain_s(self, new_map: np.ndarray | None = None) -> float:
        """Seconds saved over the horizon by ``new_map`` (or, without one, by reaching the last solve's
        PAR in every layer) on the current window."""
        cfg = self.config
        if self._filled == 0:
            return 0.0
        G = self._placement.topology.ep_size
        peak, mean = _gpu_peaks(self._placement.physical_to_logical_map, self._sum, G)
        if new_map is not None:
            target, _ = _gpu_peaks(np.asarray(new_map), self._sum, G)
        else:
            from placement.metrics import peak_lower_bound

            lb = peak_lower_bound(self._sum, G, self._placement.num_physical_experts)
            par = self._reachable_par if self._reachable_par is not None else np.ones_like(peak)
            target = np.maximum(lb, mean * par)
        z = cfg.noise_z if cfg.trigger == "gain" else 0.0
        noise = z * np.sqrt(np.maximum(peak, 0.0))  # [L] sampling noise of the window's peak
        saved_per_step = (
            np.maximum(peak - target - noise, 0.0).sum() / self._filled
        )  # assignments / step on the peak GPU
        return float(saved_per_step * cfg.seconds_per_assignment * cfg.effective_horizon)

    # ---- serving-thread API --------------------------------------------------------------------
    def observe(self, counts) -> None:
        """Add one step's counts ``[L, E]`` (token-expert assignments per logical expert) to the window.

        May submit a re-solve to the worker; never blocks on it.
        """
        c = np.asarray(counts, dtype=np.float64)
        L, E = self._sum.shape
        if c.shape != (L, E):
            raise ValueError(
                f"counts have shape {c.shape}; expected [{L}, {E}] (layers x logical experts) per step"
            )
        if not np.all(np.isfinite(c)) or (c.size and c.min() < 0):
            raise ValueError("counts must be finite and >= 0")
        cfg = self.config
        i = self.step % cfg.window_size
        self._sum += c - self._ring[i]
        self._ring[i] = c
        self._filled = min(self._filled + 1, cfg.window_size)
        self.step += 1
        if cfg.log_balancedness:
            peak, mean = _gpu_peaks(
                self._placement.physical_to_logical_map, c, self._placement.topology.ep_size
            )
            with np.errstate(divide="ignore", invalid="ignore"):
                bal = np.where(peak > 0, mean / np.where(peak > 0, peak, 1), 1.0)
            log.info(
                "rebalancer step %d: balancedness %.4f (mean GPU load %.1f, peak %.1f, worst layer %.4f)",
                self.step,
                float(bal.mean()),
                float(mean.mean()),
                float(peak.mean()),
                float(bal.min()),
            )
        if self._future is None and self._should_trigger():
            self._submit()

    def _should_trigger(self) -> bool:
        cfg = self.config
        if cfg.trigger == "interval":
            return self.step % cfg.step_interval == 0
        if self._filled < cfg.window_size or self.step % cfg.effective_check_interval:
            return False
        if self._reachable_par is None:
            return True  # calibration solve on the first full window
        one_slot_s = slot_copy_seconds(self.expert_bytes, (cfg.bandwidth, cfg.latency))
        return self.predicted_gain_s() > cfg.move_cost_scale * one_slot_s

    def _submit(self) -> None:
        cfg = self.config
        kwargs = dict(
            max_moves=cfg.max_moves,
            move_cost=self.move_cost(),
            time_limit=cfg.time_limit,
            method=cfg.method,
            drift_guard=cfg.drift_guard,
        )
        self._pending_meta = {"step": self.step, "trigger": cfg.trigger, "fit_load": self._sum.copy()}
        self._future = self._executor.submit(
            _resolve_job, self._sum.copy(), self._placement, kwargs, cfg.dispatch
        )
        self.num_solves += 1
        log.debug("rebalancer: re-solve submitted at step %d (%s trigger)", self.step, cfg.trigger)

    def poll(self):
        """Non-blocking: the newly applied placement if a finished re-solve passed the gate, else None."""
        if self._future is None or not self._future.done():
            return None
        return self._consume()

    def wait(self, timeout: float | None = None):
        """Block until the pending re-solve (if any) finishes, then act as :meth:`poll`."""
        if self._future is None:
            return None
        cf.wait([self._future], timeout=timeout)
        return self.poll()

    def _consume(self):
        fut, meta = self._future, self._pending_meta or {}
        self._future, self._pending_meta = None, None
        try:
            new, report, wall, thread = fut.result()
        except Exception:  # a failed solve must not take serving down
            log.exception("rebalancer: re-solve failed; keeping the current placement")
            return None
        cfg = self.config
        G = self._placement.topology.ep_size
        fit = meta.get("fit_load", self._sum)
        fit_peak, fit_mean = _gpu_peaks(new.physical_to_logical_map, fit, G)
        with np.errstate(divide="ignore", invalid="ignore"):
            self._reachable_par = np.where(fit_mean > 0, fit_peak / np.where(fit_mean > 0, fit_mean, 1), 1.0)
        old_map = self._placement.physical_to_logical_map
        moved = int((old_map != new.physical_to_logical_map).sum())
        verdict = self.verdict(new)
        t_move, gain = verdict.cost_s, verdict.gain_s
        peak_before = float(_gpu_peaks(old_map, self._sum, G)[0].sum())
        peak_after = float(_gpu_peaks(new.physical_to_logical_map, self._sum, G)[0].sum())
        if moved == 0:
            applied, reason = False, "no move pays for itself"
        else:
            applied, reason = verdict.rebalance, verdict.reason
        if applied and self.apply_fn is not None:
            try:
                self.apply_fn(new)
            except Exception:
                log.exception("rebalancer: apply callback failed; keeping the current placement")
                applied, reason = False, "apply callback failed"
        ev = RebalanceEvent(
            step=int(meta.get("step", self.step)),
            trigger=str(meta.get("trigger", cfg.trigger)),
            applied=applied,
            moved_slots=moved,
            moved_bytes=moved * self.expert_bytes,
            migration_time_s=t_move,
            predicted_gain_s=gain,
            arrived_experts=verdict.arrived,
            break_even_steps=verdict.break_even_windows * max(self._filled, 1),
            peak_before=peak_before,
            peak_after=peak_after,
            solve_wall_s=wall,
            solve_thread=thread,
            reason=reason,
        )
        self.history.append(ev)
        log.info(
            "rebalancer: step %d %s: %d slots (%.1f MB), T_move %.3f ms, predicted gain %.3f ms (%s)",
            self.step,
            "applied" if applied else "skipped",
            moved,
            moved * self.expert_bytes / 1e6,
            t_move * 1e3,
            gain * 1e3,
            reason,
        )
        if applied:
            self._placement = new
            return new
        return None

    def close(self) -> None:
        """Drop a pending result and shut down the private executor (waits for a running solve)."""
        if self._future is not None:
            self._future.cancel()
        self._future = None
        if self._own_executor:
            self._executor.shutdown(wait=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
