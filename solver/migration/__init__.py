"""Migration-aware re-placement: rebalance for new loads while moving few expert weights.

The family, one module a step (import the public names from this package):

- :mod:`solver.migration.solve`: :class:`MigrationOptions`, :func:`solve_migration` (arrays in) and
  :func:`run_migration` (the registry's ``(Problem, MigrationOptions)``): the problem, the methods and
  the pipeline, documented there.
- :mod:`solver.migration.slots`: slot bookkeeping between two placements (:func:`keep_slots`,
  :func:`moved_pairs`, :func:`align_to_previous`, the repair of co-located replicas).
- :mod:`solver.migration.search`: the incremental local search.
- :mod:`solver.migration.cpsat`: one layer as a CP-SAT model (the ``exact`` method).
- :mod:`solver.migration.dispatch`: scoring candidate layers under an engine's dispatch model.
"""

from solver.migration.slots import align_to_previous, keep_slots, moved_pairs
from solver.migration.solve import MigrationOptions, run_migration, solve_migration

__all__ = [
    "MigrationOptions",
    "align_to_previous",
    "keep_slots",
    "moved_pairs",
    "run_migration",
    "solve_migration",
]
