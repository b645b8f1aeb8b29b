"""What every solver takes in: one frozen :class:`Problem`, plus the solver's own frozen options.

A solver is a function ``run(problem, options) -> (Placement, SolveReport)`` registered by name in
:mod:`solver.api`. The problem says *what* to place (loads or a per-token trace, the topology, the
layers, the placement in service, the dispatch model the engine will use); the options say *how* the
solver searches (seed, budget, knobs), one frozen dataclass per solver, next to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import numpy as np

from placement.dispatch import EVEN, DispatchModel, check_dispatch
from placement.model import Placement
from placement.topology import Topology
from profiling.trace import RoutingTrace

__all__ = ["Problem", "options_from"]


@dataclass(frozen=True)
class Problem:
    """One placement problem.

    Attributes:
        topology: ``P`` physical slots over ``G`` GPUs over ``N`` nodes.
        load: ``[L, E]`` float64 tokens per logical expert (the trace's counts when a trace is given).
        trace: the per-token or per-window routing behind ``load``, or None (counts only). Solvers that
            model noise (exact's gate, locality) read it; the others use ``load``.
        layer_ids: the model's real layer index of each of the ``L`` rows (empty: ``0..L-1``).
        num_groups: expert groups of group-limited routing (DeepSeek), or None.
        previous: the placement in service (migration-aware re-placement), or None.
        dispatch: the name of the dispatch model the placement will be served with
            (:data:`placement.dispatch.DISPATCH`); the pipeline fits and gates for it.
        source_ranks: how the trace's tokens map to source ranks, where the dispatch model needs
            them (a ``--source-ranks`` spec: ``round-robin``, ``random[:SEED]``, a ``.npy`` path; None:
            the trace's own ranks, else prompts round-robin). Without per-token or per-window routing
            the counts are taken as split evenly over the ranks.
    """

    topology: Topology
    load: np.ndarray = field(repr=False)
    trace: RoutingTrace | None = field(default=None, repr=False)
    layer_ids: tuple[int, ...] = ()
    num_groups: int | None = None
    previous: Placement | None = field(default=None, repr=False)
    dispatch: str = EVEN.name
    source_ranks: str | None = None

    @classmethod
    def build(
        cls,
        topology: Topology,
        *,
        load: np.ndarray | None = None,
        trace: RoutingTrace | None = None,
        layer_ids: Sequence[int] | None = None,
        num_groups: int | None = None,
        previous: Placement | None = None,
        dispatch: str | DispatchModel = EVEN.name,
        source_ranks: str | None = None,
    ) -> Problem:
        """A problem from a load ``[L, E]`` or a trace (whose counts and layer ids are then used);
        ``dispatch`` is checked (ValueError listing the models)."""
        if load is None:
            if trace is None:
                raise ValueError("a placement problem needs a load [layers, experts] or a trace")
            load = trace.counts()
            if layer_ids is None:
                layer_ids = trace.layer_ids
        load = np.asarray(load, dtype=np.float64)
        ids = tuple(int(i) for i in (layer_ids or ()))
        return cls(topology, load, trace, ids, num_groups, previous, check_dispatch(dispatch), source_ranks)

    @property
    def layer_id_list(self) -> list[int] | None:
        """``layer_ids`` as the solvers' keyword takes it (None when not given)."""
        return list(self.layer_ids) if self.layer_ids else None


def options_from(cls: type, solver: str, values: dict) -> object:
    """``cls(**values)``, with unknown keys named in a ValueError instead of a TypeError."""
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{solver} takes no options {unknown}; its options are {sorted(known)}")
    return cls(**values)
