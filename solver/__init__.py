"""Replication and placement solvers: pure functions ``(load, topology, options) -> (Placement, SolveReport)``."""

from solver.greedy import greedy_placement
from solver.report import LayerReport, SolveReport

__all__ = ["greedy_placement", "LayerReport", "SolveReport"]
