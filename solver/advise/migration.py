"""The migration side of the advice: what a rebalance moves and costs, how fast the load drifts, and
the rebalance interval at which it pays.

Shapes: L layers (the trace's), E logical experts, P physical slots, G GPUs, W windows.

- drift: windows ``0..W-1`` of the whole trace; a placement fitted on window ``i`` scored on window
  ``i + 1`` (stale) against one fitted on ``i + 1`` itself (fresh, in-sample: the best a rebalance
  at that moment could do).
- rebalance cost: arrived experts (``placement.churn``) x one expert's bytes of the model, scaled
  from the trace's layers to the model's MoE layers; seconds = the busiest GPU's arriving bytes over
  the link (RDMA when the EP group spans nodes, else NVLink), plus its latency.
- break-even: rebalancing every ``I`` seconds saves ``s I`` (``s`` = 1 - t_fresh / t_stale of the
  decode MoE step) and costs ``T_move``; it pays when ``I >= T_move / s``, never when ``s <= 0``.
- front: from a placement fitted on the first window of the fit half, re-placed for the whole fit
  half by the ``migration`` solver under a few ``max_moves`` budgets, scored on the held-out half.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from placement.churn import arrived_per_gpu
from placement.cost.hardware import ClusterSpec
from placement.cost.modelspec import ModelSpec
from placement.dispatch import EVEN
from placement.metrics import moved_slots, par
from placement.model import Placement
from placement.topology import Topology
from profiling.trace import RoutingTrace
from solver.advise.cost import moe_step_time
from solver.api import solve

__all__ = [
    "BreakEven",
    "Drift",
    "FrontPoint",
    "MoveCost",
    "break_even",
    "drift_steps",
    "front_steps",
    "move_cost",
]

# Work limit of one migration solve (incremental search steps): deterministic on any machine.
MIGRATION_MAX_STEPS = 40_000_000
NO_GAIN = 1e-4  # a relative step-time saving below this is "no gain": the rebalance never pays


@dataclass(frozen=True)
class MoveCost:
    """One rebalance: arrived experts (on the trace's layers), bytes and seconds on the model's side."""

    arrived_experts: int
    bytes: float
    seconds: float


def move_cost(
    previous: Placement, new: Placement, model: ModelSpec, cluster: ClusterSpec, nodes: int
) -> MoveCost:
    """What going from ``previous`` to ``new`` moves (module docstring)."""
    per_gpu = arrived_per_gpu(previous, new)  # [L, G]
    scale = model.num_moe_layers / previous.num_layers
    gpu_bytes = per_gpu.sum(axis=0) * model.expert_bytes * scale  # [G]
    link = cluster.inter if nodes > 1 else cluster.intra
    busiest = float(gpu_bytes.max()) if gpu_bytes.size else 0.0
    seconds = busiest / link.bandwidth + (link.latency if busiest > 0 else 0.0)
    return MoveCost(int(per_gpu.sum()), float(gpu_bytes.sum()), seconds)


@dataclass(frozen=True)
class Drift:
    """Per window pair ``i -> i + 1``: stale and fresh held-out PAR, and the full re-placement's cost."""

    stale_par: tuple[float, ...]
    fresh_par: tuple[float, ...]
    moves: tuple[MoveCost, ...]
    window_tokens: float

    @property
    def ratio(self) -> float:
        """Mean stale / fresh PAR (1.0: no drift)."""
        return float(np.mean(np.asarray(self.stale_par) / np.asarray(self.fresh_par)))


def drift_steps(
    trace: RoutingTrace,
    topo: Topology,
    dispatch: str,
    num_windows: int,
    model: ModelSpec,
    cluster: ClusterSpec,
    nodes: int,
) -> tuple[list[tuple[str, Callable[[], None]]], Callable[[], Drift]]:
    """Steps (description, run) that fit and score window by window, and the function collecting them."""
    wins = trace.windows(num_windows)
    fitted: list[Placement] = []
    pars: list[tuple[float, float]] = []

    def fit_one(i: int) -> None:
        fitted.append(solve("greedy", topology=topo, trace=wins[i]).placement)
        if i > 0:
            pars.append((par(fitted[i - 1], wins[i], dispatch), par(fitted[i], wins[i], dispatch)))

    steps = [(f"drift window {i + 1}/{len(wins)}", lambda i=i: fit_one(i)) for i in range(len(wins))]

    def collect() -> Drift:
        moves = tuple(move_cost(a, b, model, cluster, nodes) for a, b in zip(fitted[:-1], fitted[1:]))
        tokens = float(np.mean([w.num_tokens for w in wins]))
        return Drift(tuple(p[0] for p in pars), tuple(p[1] for p in pars), moves, tokens)

    return steps, collect


@dataclass(frozen=True)
class FrontPoint:
    """One budget of the migration front."""

    max_moves: int | None
    moved_slots: int
    move: MoveCost
    held_out_par: float


def front_steps(
    fit: RoutingTrace,
    held: RoutingTrace,
    topo: Topology,
    dispatch: str,
    fractions: tuple[float, ...],
    num_windows: int,
    cost_side: tuple[ModelSpec, ClusterSpec, int],
) -> tuple[list[tuple[str, Callable[[], None]]], Callable[[], list[FrontPoint]]]:
    """Steps of the migration front (module docstring) and the function collecting its points."""
    model, cluster, nodes = cost_side
    state: dict = {}
    points: list[FrontPoint] = []

    def start() -> None:
        first = fit.windows(num_windows)[0]
        state["previous"] = solve("greedy", topology=topo, trace=first).placement
        full = solve("greedy", topology=topo, trace=fit).placement
        state["full_moves"] = moved_slots(state["previous"], full)

    def one(f: float) -> None:
        prev = state["previous"]
        budget = None if f >= 1.0 else int(round(f * state["full_moves"]))
        opts = {"max_moves": budget, "max_steps": MIGRATION_MAX_STEPS}
        new = solve(
            "migration",
            topology=topo,
            trace=fit,
            previous=prev,
            dispatch=EVEN.name,
            time_limit=120.0,
            options=opts,
        )
        pl = new.placement
        points.append(
            FrontPoint(
                budget,
                moved_slots(prev, pl),
                move_cost(prev, pl, model, cluster, nodes),
                par(pl, held, dispatch),
            )
        )

    steps = [("migration front: first-window placement", start)]
    steps += [(f"migration front: budget {f:g}", lambda f=f: one(f)) for f in fractions]
    return steps, lambda: list(points)


@dataclass(frozen=True)
class BreakEven:
    """When a rebalance pays: ``interval_s`` None means never."""

    saving: float
    move_s: float
    interval_s: float | None
    interval_steps: float | None
    window_s: float
    pays_at_window: bool


def break_even(
    drift: Drift,
    model: ModelSpec,
    cluster: ClusterSpec,
    nodes: int,
    slots_per_gpu: int,
    step_par_decode: float,
    decode_batch: int,
) -> BreakEven:
    """The break-even rebalance interval at the decode batch (module docstring)."""
    fresh = moe_step_time(model, cluster, nodes, slots_per_gpu, step_par_decode, decode_batch).step_s
    stale = moe_step_time(
        model, cluster, nodes, slots_per_gpu, step_par_decode * drift.ratio, decode_batch
    ).step_s
    saving = 1.0 - fresh / stale if stale > 0 else 0.0
    move_s = float(np.mean([m.seconds for m in drift.moves])) if drift.moves else 0.0
    G = nodes * cluster.gpus_per_node
    window_s = drift.window_tokens / (G * decode_batch) * fresh
    if saving <= NO_GAIN:
        return BreakEven(saving, move_s, None, None, window_s, False)
    interval = move_s / saving
    return BreakEven(saving, move_s, interval, interval / fresh, window_s, interval <= window_s)
