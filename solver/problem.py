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

from moe_placement.base.limits import check_layer_ids
from moe_placement.base.options import check_keywords
from placement.dispatch import EVEN, DispatchModel, check_dispatch
from placement.model import Placement
from placement.topology import Topology
from profiling.trace import RoutingTrace
from solver.failure import DEFAULT_MAX_PAR_INCREASE, check_domain, check_max_par_increase

__all__ = ["Problem", "options_from"]


@dataclass(frozen=True)
class Problem:
    """One placement problem.

    Attributes:
        topology: ``P`` physical slots over ``G`` GPUs over ``N`` nodes.
        load: ``[L, E]`` float64 tokens per logical expert (the trace's counts when a trace is given; a
            load given with a trace must equal them, else a ValueError names the first cell that differs).
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
        failure_domain: ``gpu`` or ``node``: the hottest experts get copies in two such domains
            (:mod:`solver.failure`, the pipeline's last step); None: no failure domain.
        failure_max_par_increase: the cap on that step's balance cost, per layer, against the
            placement without it (0.02: at most 2% more PAR on the fitted load; None: no cap).
    """

    topology: Topology
    load: np.ndarray = field(repr=False)
    trace: RoutingTrace | None = field(default=None, repr=False)
    layer_ids: tuple[int, ...] = ()
    num_groups: int | None = None
    previous: Placement | None = field(default=None, repr=False)
    dispatch: str = EVEN.name
    source_ranks: str | None = None
    failure_domain: str | None = None
    failure_max_par_increase: float | None = DEFAULT_MAX_PAR_INCREASE

    def __post_init__(self) -> None:
        """Refuse what no solver can place, naming the argument and the numbers (a ValueError)."""
        _check_topology(self.topology)
        L, E = _check_load(self.load)
        _check_trace(self.trace, L, E)  # layer_ids may name a subset of the rows (locality picks them)
        _check_agree(self.load, self.trace)
        _check_groups(self.num_groups, E)
        _check_previous(self.previous, L, E, self.topology)
        if self.source_ranks is not None and not isinstance(self.source_ranks, str):
            raise ValueError(
                f"source_ranks must be a spec string (round-robin, random[:SEED], a .npy path), "
                f"got {type(self.source_ranks).__name__}"
            )
        check_domain(self.failure_domain, self.topology)
        object.__setattr__(
            self, "failure_max_par_increase", check_max_par_increase(self.failure_max_par_increase)
        )

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
        failure_domain: str | None = None,
        failure_max_par_increase: float | None = DEFAULT_MAX_PAR_INCREASE,
    ) -> Problem:
        """A problem from a load ``[L, E]`` or a trace (whose counts and layer ids are then used);
        ``dispatch`` is checked (ValueError listing the models)."""
        if load is None:
            if trace is None:
                raise ValueError("a placement problem needs a load [layers, experts] or a trace")
            _check_trace(trace, None, None)
            load = trace.counts()
            if layer_ids is None:
                layer_ids = trace.layer_ids
        try:
            load = np.asarray(load, dtype=np.float64)
        except (TypeError, ValueError):
            raise ValueError(
                f"load must be numbers [layers, experts] (tokens per expert), got {type(load).__name__}"
            ) from None
        ids = () if layer_ids is None else check_layer_ids(layer_ids)  # "01" is not layers 0 and 1
        return cls(
            topology,
            load,
            trace,
            ids,
            num_groups,
            previous,
            check_dispatch(dispatch),
            source_ranks,
            failure_domain,
            failure_max_par_increase,
        )

    @property
    def layer_id_list(self) -> list[int] | None:
        """``layer_ids`` as the solvers' keyword takes it (None when not given)."""
        return list(self.layer_ids) if self.layer_ids else None


def _check_topology(topology) -> None:
    if not isinstance(topology, Topology):
        raise ValueError(
            f"topology must be a placement.topology.Topology, got {type(topology).__name__}; build one with "
            f"Topology(ep_size=G, num_physical_experts=P, num_nodes=N) or Topology.from_redundant(E, R, G, N)"
        )


def _check_load(load: np.ndarray) -> tuple[int, int]:
    """``load`` float64 ``[L, E]``, non-empty, finite, >= 0: ``(L, E)``."""
    if not isinstance(load, np.ndarray) or load.dtype != np.float64:
        raise ValueError("load must be a float64 array [layers, experts]; build problems with Problem.build")
    if load.ndim != 2 or 0 in load.shape:
        raise ValueError(f"load must be [layers, experts] with both >= 1, got shape {load.shape}")
    if not np.isfinite(load).all() or (load < 0).any():
        raise ValueError("load must be finite and >= 0 (found NaN, inf or a negative count)")
    return load.shape


def _check_trace(trace, L: int | None, E: int | None) -> None:
    """A :class:`RoutingTrace` whose layers and experts are the load's (when the load was given too)."""
    if trace is None:
        return
    if not isinstance(trace, RoutingTrace):
        raise ValueError(
            f"trace must be a profiling.trace.RoutingTrace, got {type(trace).__name__}; "
            f"read a file with profiling.readers.read_trace"
        )
    if L is not None and (trace.num_layers, trace.num_logical_experts) != (L, E):
        raise ValueError(
            f"the load is {L} layers x {E} experts but the trace is {trace.num_layers} layers x "
            f"{trace.num_logical_experts} experts; pass the trace's counts (or omit load)"
        )


def _check_agree(load: np.ndarray, trace: RoutingTrace | None) -> None:
    """A load given with a trace is the trace's counts: the solvers place the load and the fit and the
    noise models use the trace, so two different inputs would be silently mixed."""
    if trace is None:
        return
    counts = trace.counts()  # [L, E]
    differ = ~np.isclose(load, counts, rtol=1e-9, atol=1e-9)
    if differ.any():
        l, e = (int(i) for i in np.argwhere(differ)[0])
        raise ValueError(
            f"load and trace disagree: the load gives layer row {l}, expert {e} {load[l, e]:g} tokens but the "
            f"trace routes {counts[l, e]:g} there ({int(differ.sum())} of {differ.size} cells differ); a trace's "
            f"load is its counts: pass the trace alone (or the load alone, to place it without tokens)"
        )


def _check_groups(num_groups, E: int) -> None:
    if num_groups is None:
        return
    if isinstance(num_groups, (bool, np.bool_)) or not isinstance(num_groups, (int, np.integer)):
        raise ValueError(f"num_groups must be an integer or None, got {num_groups!r}")
    if num_groups < 1 or E % num_groups:
        raise ValueError(f"num_groups={num_groups} must be >= 1 and divide the {E} experts (or be None)")


def _check_previous(previous, L: int, E: int, topology: Topology) -> None:
    if previous is None:
        return
    if not isinstance(previous, Placement):
        raise ValueError(
            f"previous must be a Placement, got {type(previous).__name__}; read a file with "
            f"placement.formats.read_placement"
        )
    have = (previous.num_layers, previous.num_logical_experts, previous.num_physical_experts)
    if have != (L, E, topology.num_physical_experts):
        raise ValueError(
            f"previous has {have[0]} layers x {have[1]} experts on {have[2]} slots but the problem has {L} x {E} "
            f"on {topology.num_physical_experts}; pass the placement in service for this model and topology"
        )


def options_from(cls: type, solver: str, values: dict) -> object:
    """``cls(**values)``, with unknown keys named in a ValueError (:func:`moe_placement.base.options.check_keywords`)
    that names the solver, instead of a TypeError."""
    known = [f.name for f in fields(cls) if f.init]
    check_keywords(
        f"the {solver} solver's options", values, known, fix=f"they are the fields of {cls.__name__}"
    )
    return cls(**values)
