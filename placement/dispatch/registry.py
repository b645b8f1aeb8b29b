"""The one registry of dispatch models: which replica of an expert serves a token.

A :class:`DispatchModel` states what it needs (source ranks, batch rows, per-step counts), how it
routes (expected shares per source rank and expert, and token by token where the engine's rule is
not a fixed share), whether it is scored fractionally, whether our runtime can execute it, and which
engine and version it models. Every other module reads the models from here: metrics, solvers,
runtime, plugins and the CLI's choices. No other module spells a model's name.

Shapes: L layers, E logical experts, P physical slots, G EP ranks, R most replicas of one expert,
T tokens, k top-k.

Adding a model: one module in this package that builds a :class:`DispatchModel` and calls
:func:`register`, imported from ``placement/dispatch/__init__.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

__all__ = ["DISPATCH", "DispatchModel", "check_dispatch", "dispatch_names", "get_dispatch", "register"]

# (placement, layer) -> (slots int64 [G, E, R] -1 padded, weights float64 [G, E, R] rows summing to 1)
ChoicesFn = Callable[..., tuple[np.ndarray, np.ndarray]]
# (placement, layer, ids [T, k], src [T], batch_index [T] | None, rng | None) -> slots int64 [T, k]
RouteFn = Callable[..., np.ndarray]
# (placement, layer, counts float64 [S, E]: each step's all-reduced tokens per expert) -> float64 [S, P]
StepLoadFn = Callable[..., np.ndarray]


@dataclass(frozen=True)
class DispatchModel:
    """One dispatch model.

    Attributes:
        name: the public name (``--dispatch``, docs/metrics.md).
        models: the engine setting it models, or the ideal it stands for.
        engine: ``"SGLang"``, ``"vLLM"``, ... or ``""`` for an ideal no engine runs as such.
        version: the engine version whose source the model was read from (``""`` for ideals).
        engine_flag: the engine's command-line setting that selects this rule, as argv words
            (``("--ep-dispatch-algorithm", "static")``; ``("--enable-eplb",)``); ``()`` for an ideal.
            Required with ``engine``.
        needs_source_ranks: the choice depends on the rank a token comes from.
        needs_batch_rows: the choice depends on the token's row in its forward batch.
        needs_step_counts: the choice depends on each step's all-reduced counts.
        fractional: scored by expected shares (each (rank, expert) splits by ``choices``); otherwise
            routed token by token through ``route`` (a hash, a draw, a per-step split).
        choices: expected choice per (source rank, expert) of one layer (see ``ChoicesFn``).
        route: token-level choice of one layer (see ``RouteFn``), or None when ``choices`` is exact.
        step_load: tokens each slot of one layer receives in each step, from that step's counts (see
            ``StepLoadFn``). Required with ``needs_step_counts``: the metrics then score the model step
            by step through it (``placement.metrics.step_par``, ``trace_gpu_load``, ``rank_gpu_load``).

    What callers ask the model (every one must be given: :func:`register` refuses a model that leaves
    one None, so no caller ever compares against a particular model):
        counts_only: each expert's tokens split evenly over its replicas whatever their source, so the
            per-expert counts ``[L, E]`` score it exactly (no per-token trace, no source ranks).
        local_first: tokens go to the replica on their own GPU, else evenly to those on their own node,
            else evenly to all (the scorers and the runtime's routing tables add those two tiers).
            SGLang's rule is near to it but not it (its node tier takes the first replica): False there.
        locality_fit: the locality solver (``solver.locality``) can place for it: its node loads follow
            from the counts (``counts_only``) or from the counts by source node (``local_first``).
        table_fit: the fit step for a fixed per-rank table (``solver.dispatch_fit``): ``"swaps"`` (each
            rank's table is a seeded random draw: a swap search averaged over random dealings),
            ``"spread"`` (the table is a nearest-replica rule: take the node-spread layers that help),
            or ``""`` (no per-rank table to fit).
        runtime_route: what the torch runtime (``runtime_hooks``) builds to execute it: ``"table"``
            (per-rank routing tables, a rotation over the tier's replicas), ``"step"`` (per-step
            quotas from the all-reduced counts, a collective) or ``""`` (scored offline only).
    """

    name: str
    models: str
    choices: ChoicesFn
    engine: str = ""
    version: str = ""
    engine_flag: tuple[str, ...] = ()
    needs_source_ranks: bool = False
    needs_batch_rows: bool = False
    needs_step_counts: bool = False
    fractional: bool = True
    route: RouteFn | None = None
    step_load: StepLoadFn | None = None
    counts_only: bool | None = None
    local_first: bool | None = None
    locality_fit: bool | None = None
    table_fit: str | None = None
    runtime_route: str | None = None

    @property
    def runtime(self) -> bool:
        """Our runtime (EP layer, Hugging Face path) executes it."""
        return bool(self.runtime_route)

    @property
    def table(self) -> bool:
        """A fixed per-rank table that placement can be fitted for (``solver.dispatch_fit``)."""
        return bool(self.table_fit)

    def __str__(self) -> str:
        return self.name


# what every model must say (None: not said), and the values the text ones take
ASKED = ("counts_only", "local_first", "locality_fit", "table_fit", "runtime_route")
TABLE_FITS = ("", "swaps", "spread")
RUNTIME_ROUTES = ("", "table", "step")


DISPATCH: dict[str, DispatchModel] = {}


def register(model: DispatchModel) -> DispatchModel:
    """Add ``model`` to :data:`DISPATCH` (a name is registered once)."""
    if model.name in DISPATCH:
        raise ValueError(f"dispatch model {model.name!r} is registered twice")
    if model.needs_step_counts and model.step_load is None:
        raise ValueError(f"dispatch model {model.name!r} needs step counts: give it a step_load function")
    _check_asked(model)
    DISPATCH[model.name] = model
    return model


def _check_asked(model: DispatchModel) -> None:
    """ValueError naming what ``model`` leaves unsaid or says with an unknown value."""
    missing = [k for k in ASKED if getattr(model, k) is None]
    if missing:
        raise ValueError(
            f"dispatch model {model.name!r} does not say {', '.join(missing)}: give "
            f"{', '.join(k + '=' for k in missing)} in its DispatchModel(...) (see DispatchModel's docstring)"
        )
    if model.runtime_route == "step" and not model.needs_step_counts:
        raise ValueError(
            f"dispatch model {model.name!r}: runtime_route='step' splits each step's counts: set needs_step_counts"
        )
    if model.local_first and not model.needs_source_ranks:
        raise ValueError(
            f"dispatch model {model.name!r}: local_first routes by the token's rank: set needs_source_ranks"
        )
    if bool(model.engine) != bool(model.engine_flag):
        raise ValueError(
            f"dispatch model {model.name!r}: give engine_flag (the engine's setting that selects it) with "
            f"engine, and neither for an ideal (got engine={model.engine!r}, engine_flag={model.engine_flag!r})"
        )
    if model.table_fit not in TABLE_FITS:
        raise ValueError(
            f"dispatch model {model.name!r}: table_fit must be one of {TABLE_FITS}, got {model.table_fit!r}"
        )
    if model.runtime_route not in RUNTIME_ROUTES:
        raise ValueError(
            f"dispatch model {model.name!r}: runtime_route must be one of {RUNTIME_ROUTES}, got {model.runtime_route!r}"
        )


def get_dispatch(name: str | DispatchModel) -> DispatchModel:
    """The model called ``name`` (a model passes through); ValueError listing the models otherwise."""
    if isinstance(name, DispatchModel):
        return name
    try:
        return DISPATCH[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown dispatch model {name!r}; use one of {', '.join(DISPATCH)}") from None


def check_dispatch(name: str | DispatchModel) -> str:
    """The name of dispatch model ``name``, checked (ValueError listing the models otherwise)."""
    return get_dispatch(name).name


def dispatch_names(**where: bool) -> tuple[str, ...]:
    """Names of the models whose attributes equal ``where`` (e.g. ``runtime=True``), in registry order."""
    return tuple(n for n, m in DISPATCH.items() if all(getattr(m, k) == v for k, v in where.items()))
