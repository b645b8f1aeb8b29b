"""What ``advise`` returns: one :class:`Row` per option and the frozen :class:`Advice`, whose ``to_dict()``
is the JSON contract (docs/cli.md, advise).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import moe_placement.apps.advise.balance as balance
import moe_placement.apps.advise.cost as cost
import moe_placement.apps.advise.phases as phases
import moe_placement.apps.advise.rebalance as rebalance
import moe_placement.apps.advise.recommend as recommend
from moe_placement.apps.advise.engines import ENGINES
from placement.model import Placement
from placement.steps import PHASES
from profiling.trace import RoutingTrace

__all__ = ["NO_BALANCING", "Advice", "Row", "phase_figures"]

NO_BALANCING = "no balancing"


@dataclass(frozen=True)
class Row:
    """One option at ``r`` redundant slots per GPU: held-out balance, per-phase prices, memory."""

    kind: str
    dispatch: str
    redundant_per_gpu: int
    placement_key: str
    scores: balance.Scores
    decode: phases.PhasePrice | None  # None: the phase was not priced (``--phase``)
    prefill: phases.PhasePrice | None
    memory: cost.MemoryCost
    # phase -> {"whole_step_gain": (low, high), "moe_step_gain": (low, high)} over the cost model's range
    ranges: Mapping[str, Mapping[str, tuple[float, float]]] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.kind}|{self.dispatch}|r{self.redundant_per_gpu}"

    def phase(self, name: str) -> phases.PhasePrice | None:
        return self.decode if name == "decode" else self.prefill

    @property
    def priced(self) -> tuple[str, ...]:
        """The phases this row was priced on (both, or the one ``--phase`` asked for)."""
        return tuple(ph for ph in PHASES if self.phase(ph) is not None)


def _rounded(x: Any) -> Any:
    """Floats to 6 significant digits (stable, readable JSON), recursively."""
    if isinstance(x, float):
        return float(f"{x:.6g}") if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_rounded(v) for v in x]
    return x


def phase_figures(row: Row, base: Row, name: str, engine: str) -> dict:
    """One phase of the contract: whole-step and MoE gains over ``base`` (with the band), the dispatch's
    own per-step cost, memory and KV tokens the replicas take."""
    p, b = row.phase(name), base.phase(name)
    g, band = phases.gain(p, b)
    lo, hi, _ = phases.published_band(name)
    moe = b.moe_ms / p.moe_ms - 1.0 if p.moe_ms > 0 else 0.0
    rng = row.ranges.get(name, {})
    return {
        "whole_step_gain": g,
        "whole_step_gain_range": list(rng.get("whole_step_gain", (g, g))),
        "band": band,
        "published_band": [lo / 100.0, hi / 100.0],
        "moe_step_gain": moe,
        "moe_step_gain_range": list(rng.get("moe_step_gain", (moe, moe))),
        "dispatch_overhead_ms": p.dispatch_overhead_ms,
        "memory_gb": row.memory.redundant_bytes / 1e9,
        "kv_tokens_lost": row.memory.kv_tokens_lost,
        "whole_ms": p.whole_ms,
        "baseline_whole_ms": b.whole_ms,
        "moe_ms": p.moe_ms,
        "step_tokens": p.step_tokens,
        "held_out_steps": p.num_steps,
        "deepep_mode": ENGINES[engine].deepep_modes[name],
    }


@dataclass(frozen=True)
class Advice:
    """What :func:`~moe_placement.apps.advise.core.advise` found; ``to_dict`` is the ``--json`` payload
    and the HTML report's data.

    ``placements`` (key -> :class:`Placement`), ``held_out`` and ``files`` (path in ``--output`` ->
    placement and format to write there) are kept for checks and the CLI, left out of ``to_dict``.
    """

    context: Mapping[str, Any]
    rows: tuple[Row, ...]
    baseline: str
    chosen: str
    available: Mapping[str, tuple[bool, str]]
    launch: recommend.Launch
    rebalance: rebalance.Rebalance
    reason: str
    summary: str
    held_out_steps: Mapping[str, int]
    assumptions: tuple[str, ...]
    warnings: tuple[str, ...]
    hardware: Mapping[str, Any] = field(default_factory=dict)  # {preset, measured}
    # the recommendation's decision keys: min_gain, net_gain(_range), decision_stable, would_flip, ...
    decision: Mapping[str, Any] = field(default_factory=dict)
    placements: Mapping[str, Placement] = field(default_factory=dict, repr=False, compare=False)
    held_out: RoutingTrace | None = field(default=None, repr=False, compare=False)
    files: Mapping[str, tuple[Placement, int]] = field(default_factory=dict, repr=False, compare=False)

    def row(self, key: str) -> Row:
        return next(r for r in self.rows if r.key == key)

    def placement_of(self, row: Row) -> Placement:
        return self.placements[row.placement_key]

    def recommendation(self) -> dict:
        """The contract's ``recommendation`` object."""
        row, base, engine = self.row(self.chosen), self.row(self.baseline), self.context["engine"]
        return {
            "option": NO_BALANCING if row is base else row.key,
            "reason": self.reason,
            "flags": list(self.launch.flags),
            "env": list(self.launch.env),
            "launch_command": self.launch.command,
            "launch_commands": [{"node_rank": i, "command": c} for i, c in enumerate(self.launch.per_node)],
            "files": list(self.launch.files),
            "phases": {ph: phase_figures(row, base, ph, engine) for ph in base.priced},
            "rebalance": self.rebalance.to_dict(),
            **self.decision,
        }

    def _option(self, r: Row) -> dict:
        base, engine = self.row(self.baseline), self.context["engine"]
        ok, why = self.available[r.key]
        return {
            "key": r.key,
            "option": r.kind,
            "dispatch": r.dispatch,
            "redundant_per_gpu": r.redundant_per_gpu,
            "available": ok,
            "unavailable_reason": why or None,
            "fits": r.memory.fits,
            "window_par": r.scores.window_par,
            "step_par_decode": r.scores.step_par_decode,
            "step_par_prefill": r.scores.step_par_prefill,
            "phases": {ph: phase_figures(r, base, ph, engine) for ph in base.priced},
        }

    def to_dict(self) -> dict:
        return _rounded(
            {
                "recommendation": self.recommendation(),
                "summary": self.summary,
                "held_out_steps": dict(self.held_out_steps),
                "assumptions": list(self.assumptions),
                "warnings": list(self.warnings),
                "context": dict(self.context),
                "hardware": dict(self.hardware),
                "options": [self._option(r) for r in self.rows],
            }
        )
