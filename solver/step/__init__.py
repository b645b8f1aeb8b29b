"""Placing replicas for a dispatch model that splits every step's counts (``balanced``, ``sglang-lp``).

The family, one module a step:

- :mod:`solver.step.fit`: :class:`StepFitOptions` and :func:`fit_for_steps`, the search over sampled
  steps of a phase with its window guard (documented there).
- :mod:`solver.step.start`: the starting placements of one layer (spike-aware replica counts packed
  into one connected replica graph).
- :mod:`solver.step.cost`: the modelled MoE step time the fit scores a layer by, from the one cost
  model (:mod:`placement.cost`).

The per-step LP that checks the split is an oracle for tests and benchmarks
(``benchmarks/step_lp.py``), not a solver.
"""

from solver.step.cost import StepCost, step_cost_for
from solver.step.fit import StepFit, StepFitOptions, fit_for_steps

__all__ = ["StepCost", "StepFit", "StepFitOptions", "fit_for_steps", "step_cost_for"]
