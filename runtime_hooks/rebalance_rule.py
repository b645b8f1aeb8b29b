"""When a rebalance pays: predicted step-time gain over the next window against the migration's cost.

Shapes: L MoE layers, E logical experts, P physical slots, G EP ranks (GPUs).

Pure numpy (no torch, no solver): the online rebalancer (:mod:`runtime_hooks.rebalancer`), both
engine plugins (:mod:`runtime_hooks.engine_plugins.policy`) and the trace replay
(:mod:`moe_placement.apps.replay`) decide with the same three functions.

Model (the migration cost below; every constant a field of :class:`RuleParams`):

- **gain** over the next window: ``(sum over layers of peak_now - peak_new) x horizon x
  seconds_per_assignment``. ``peak_*`` are the peak GPU's token-expert assignments of the window
  just seen under each map (load split evenly over an expert's replicas). Assumptions, named:
  (a) the next ``horizon`` windows bring the same load as the one just seen (persistence); (b) the
  peak GPU's grouped GEMM is on every layer's critical path and compute bound, one assignment costing
  ``6 d f / (P_flops x eta_c)`` (DeepSeek-V3 on Hopper FP8: 82 ns; below the knee decode is memory
  bound and this overstates the gain); (c) nothing of the saving is hidden by overlap; (d) a
  peak saving within ``noise_z`` Poisson standard deviations of the window's peak (``sqrt(peak)``
  per layer) is sampling noise and counts for nothing.
- **cost**: ``stall x (max over GPUs of arrived experts x expert_bytes / bandwidth + latency)``, priced
  by the one cost model (:func:`placement.cost.migration.move_time`; the defaults of every constant
  come from :mod:`placement.cost`, the compute per assignment from ``assignment_seconds``).
  Arrived experts (``placement.churn``) are what crosses a link; copies onto different GPUs run in
  parallel, so the busiest receiver sets the time; ``stall`` is the share of that time serving waits
  (1: the copy blocks serving; vLLM's async EPLB overlaps most of it, about 0.1-0.3).
- **rule, with hysteresis**: rebalance only when ``gain >= margin x cost`` and ``gain > 0``, with
  ``margin`` > 1 (default 1.5). The comparison is always against the map in service, so a load that
  hovers around break-even does not make the map flip back and forth: each switch has to clear the
  band again (as a hand-over margin does). ``always`` answers yes whenever something moves.

:func:`break_even_steps`: the steps a new map must serve for its saving to repay its cost (the
rebalance interval at which a rebalance pays), ``inf`` when it saves nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from placement.cost.hardware import DEFAULT_HARDWARE, GPUS, LINKS
from placement.cost.migration import move_time
from placement.cost.modelspec import load_model
from placement.cost.primitives import assignment_seconds
from placement.metric_checks import check_map_load

__all__ = [
    "Decision",
    "RuleParams",
    "break_even_steps",
    "decide",
    "gpu_peaks",
    "peak_saving",
    "transfer_seconds",
]

# Defaults from the one cost model (placement.cost): DeepSeek-V3 FP8 on the default GPU preset (a Hopper),
# weights over NVLink 4.
_DSV3 = load_model("deepseek-v3")
DEEPSEEK_V3_EXPERT_BYTES = _DSV3.expert_bytes  # one FP8 expert of one layer: 44,040,192 B
NVLINK_BANDWIDTH, NVLINK_LATENCY = LINKS["nvlink4"].kernel("normal")  # bulk copy: 270 GB/s, 40 us
HOPPER_FP8_ASSIGNMENT_S = assignment_seconds(GPUS[DEFAULT_HARDWARE], _DSV3)  # DeepSeek-V3 expert GEMM: 82 ns


@dataclass(frozen=True)
class RuleParams:
    """The constants of the rule (module docstring).

    Attributes:
        seconds_per_assignment: expert compute seconds of one (token, expert) assignment on the peak GPU.
        expert_bytes: weight bytes of one expert in one layer.
        bandwidth: effective link bytes/s into one GPU; latency: seconds per migration.
        stall: share of the transfer time serving waits for (0: fully overlapped, 1: blocking).
        horizon: windows of the same load the new map is predicted to serve (the gain's multiplier).
        margin: hysteresis band, the multiple of the cost the gain has to reach (>= 1).
        noise_z: peak savings within ``noise_z`` x sqrt(peak) per layer count for nothing (0: off).
        always: rebalance whenever anything moves (the rule reports its figures but does not gate).
    """

    seconds_per_assignment: float = HOPPER_FP8_ASSIGNMENT_S
    expert_bytes: float = float(DEEPSEEK_V3_EXPERT_BYTES)
    bandwidth: float = NVLINK_BANDWIDTH
    latency: float = NVLINK_LATENCY
    stall: float = 1.0
    horizon: float = 1.0
    margin: float = 1.5
    noise_z: float = 0.0
    always: bool = False

    def __post_init__(self) -> None:
        for name in ("seconds_per_assignment", "expert_bytes", "bandwidth", "horizon"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a positive finite number, got {v!r}")
        if not (math.isfinite(self.latency) and self.latency >= 0):
            raise ValueError(f"latency must be a finite number of seconds >= 0, got {self.latency!r}")
        if not (0.0 <= self.stall <= 1.0):
            raise ValueError(
                f"stall must be in [0, 1] (share of the copy serving waits for), got {self.stall!r}"
            )
        if not (math.isfinite(self.margin) and self.margin >= 1.0):
            raise ValueError(
                f"margin must be a finite number >= 1 (gain / cost to clear), got {self.margin!r}"
            )
        if not (math.isfinite(self.noise_z) and self.noise_z >= 0):
            raise ValueError(f"noise_z must be a finite number >= 0, got {self.noise_z!r}")


@dataclass(frozen=True)
class Decision:
    """One verdict and its figures (all seconds over the horizon unless named otherwise).

    Attributes:
        rebalance: True to switch to the new map, False to keep the map in service.
        gain_s: predicted compute seconds saved; cost_s: predicted serving seconds lost to the copy.
        saved_assignments: peak-GPU assignments saved per window, summed over layers (after noise).
        arrived: experts that cross a link; busiest_gpu: arrived experts on the busiest receiver.
        break_even_windows: windows of this load the new map must serve to repay its cost (inf: never).
        reason: one line with the figures (for the logs).
    """

    rebalance: bool
    gain_s: float
    cost_s: float
    saved_assignments: float
    arrived: int
    busiest_gpu: int
    break_even_windows: float
    reason: str


def gpu_peaks(p2l: np.ndarray, load: np.ndarray, ep_size: int) -> np.ndarray:
    """float64 ``[L]``: each layer's peak GPU load, ``load [L, E]`` split evenly over the replicas of
    ``p2l [L, P]`` (a map may hold an expert twice on a GPU: that GPU then gets two shares). A map and a
    load that do not fit each other are refused first (:func:`placement.metric_checks.check_map_load`)."""
    p2l, w = check_map_load(p2l, load, ep_size)
    L, P = p2l.shape
    cnt = np.zeros(w.shape)
    np.add.at(cnt, (np.repeat(np.arange(L), P), p2l.ravel()), 1.0)  # [L, E] replicas
    slot = np.take_along_axis(w / np.maximum(cnt, 1.0), p2l, axis=1)  # [L, P] load per slot
    return slot.reshape(L, ep_size, P // ep_size).sum(axis=2).max(axis=1)  # [L, G] -> [L]


def peak_saving(peak_now: np.ndarray, peak_new: np.ndarray, noise_z: float = 0.0) -> float:
    """Assignments saved on the peak GPU, summed over layers: ``peak_now - peak_new`` per layer ``[L]``,
    less ``noise_z x sqrt(peak_now)`` and never below 0 per layer when ``noise_z > 0``."""
    now, new = np.asarray(peak_now, dtype=np.float64), np.asarray(peak_new, dtype=np.float64)
    if noise_z <= 0:
        return float((now - new).sum())
    return float(np.maximum(now - new - noise_z * np.sqrt(np.maximum(now, 0.0)), 0.0).sum())


def transfer_seconds(arrived_per_gpu: np.ndarray, params: RuleParams) -> float:
    """Serving seconds lost to a migration: ``stall x (busiest GPU's arrivals x expert_bytes /
    bandwidth + latency)``; ``arrived_per_gpu`` int ``[G]`` (or ``[L, G]``, summed over layers); 0 when
    nothing arrives."""
    return params.stall * move_time(arrived_per_gpu, params.expert_bytes, (params.bandwidth, params.latency))


def break_even_steps(cost_s: float, saved_s_per_step: float) -> float:
    """Steps a new map must serve to repay ``cost_s`` at ``saved_s_per_step``; ``inf`` when it saves
    nothing (the rebalance never pays), 0 when it costs nothing."""
    if cost_s <= 0:
        return 0.0
    return cost_s / saved_s_per_step if saved_s_per_step > 0 else math.inf


def decide(
    peak_now: np.ndarray, peak_new: np.ndarray, arrived_per_gpu: np.ndarray, params: RuleParams
) -> Decision:
    """Whether switching from the map in service to a new map pays over ``params.horizon`` windows.

    Args:
        peak_now, peak_new: float ``[L]`` peak GPU loads of the window just seen under the map in
            service and the new map (:func:`gpu_peaks`).
        arrived_per_gpu: int ``[G]`` or ``[L, G]`` experts arriving on each GPU
            (:func:`placement.churn.arrived_per_gpu`).
        params: :class:`RuleParams`.
    """
    a = np.asarray(arrived_per_gpu)
    per_gpu = a.sum(axis=0) if a.ndim == 2 else a  # [G]
    arrived, busiest = int(per_gpu.sum()), int(per_gpu.max()) if per_gpu.size else 0
    saved = peak_saving(peak_now, peak_new, params.noise_z)
    gain = saved * params.seconds_per_assignment * params.horizon
    cost = transfer_seconds(per_gpu, params)
    per_window = saved * params.seconds_per_assignment
    windows = break_even_steps(cost, per_window)
    figures = (
        f"gain {gain * 1e3:.3f} ms over {params.horizon:g} window(s) vs migration {cost * 1e3:.3f} ms "
        f"({arrived} arrived experts, {busiest} on the busiest GPU, stall {params.stall:g}); "
        f"break-even after {windows:.3g} window(s), margin {params.margin:g}"
    )
    if arrived == 0 and saved <= 0:
        ok, why = False, "nothing to gain"
    elif params.always:
        ok, why = True, "always rebalance"
    elif gain > 0 and gain >= params.margin * cost:
        ok, why = True, "pays"
    else:
        ok, why = False, "does not pay"
    return Decision(ok, gain, cost, saved, arrived, busiest, windows, f"{why}: {figures}")
