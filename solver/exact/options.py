"""The exact solver's options: every keyword of :func:`solver.exact.solve_exact` but the problem's own."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from moe_placement.base.options import refuse_unknown_keywords
from placement.model import Placement

__all__ = ["ExactOptions"]


@refuse_unknown_keywords
@dataclass(frozen=True)
class ExactOptions:
    """How the exact solver searches: every keyword of :func:`solver.exact.solve_exact` but the
    problem's own (load or trace, topology, ``num_groups``, ``layer_ids``: :class:`solver.problem.Problem`).

    Attributes:
        backend: ``cpsat`` (OR-Tools CP-SAT) or ``milp`` (scipy.optimize.milp / HiGHS; small instances).
        node_constraint: keep expert groups (the problem's ``num_groups``) inside nodes (groups divide
            over nodes).
        objective: ``tokens`` (peak GPU tokens) or ``decode`` (peak per-step decode time).
        robust: None, ``max`` or ``qNN``: fit on ``num_windows`` windows (package docstring).
        weighted: ``False``; ``"shares"`` (LP shares on the even-split optimum, in ``extra``); ``True``
            (placement chosen for weighted dispatch, :func:`solver.weighted.solve_weighted`; the report's
            ``objective`` is then the weighted peak and ``extra["even_objective"]`` the even-split one).
        time_limit: total wall budget in seconds for all layers (solved in parallel on ``workers`` threads),
            finite and at most ``MAX_TIME_LIMIT_S``. A hard wall in both modes: a layer whose search would
            end past it (less a reserve for the layers not yet begun) keeps its start, greedy or local
            search, and one note says how many did; only fixed per-layer setup and reporting (about a
            millisecond a layer) can run past it.
        seed: CP-SAT random seed (also seeds the neighbourhood search).
        deterministic: ``True`` (default): one CP-SAT worker and deterministic-time limits derived from
            ``time_limit`` only, local and neighbourhood search bounded by iteration counts, so two runs
            with the same inputs and seed return the same map whatever the machine load (unless the
            wall-clock safety cap of 4x a layer's share or the time limit's wall cuts a solve, which
            ``notes`` reports).
            ``False``: wall-clock limits (uses the budget fully, not reproducible).
        hint: an extra starting placement (used when better than greedy).
        expert_bytes, hardware, step_tokens: decode cost overrides (:class:`DecodeCost`).
        local_search_iters: cap on local-search moves per layer (default ``20 * G``).
        validation: guard against over-fitting (:func:`solver.exact.guard._validation_guard`).
            ``"auto"``: when the input has windows (a trace or ``[W, L, E]``, ``W >= 5``) the last 20%
            of them are held out, exact and greedy are fitted on the rest and compared there; layers
            where exact loses keep greedy's placement (status ``greedy_fallback``,
            ``extra["validation"]``). A float in (0, 0.5] sets the held-out fraction; ``"thin"`` splits
            integer counts by seeded binomial thinning (20%) instead of windows; ``0`` or ``None``
            (default) turns the guard off. It costs 30% of ``time_limit``. When it is on, the noise
            gate is off.
        noise_gate: keep greedy's placement unless the fitted gain beats the sampling noise
            (:func:`solver.exact.gate._noise_gate`). ``"auto"`` (default): on when the input has
            windows (a trace or ``[W, L, E]`` with ``W >= 5``) and the solve is the plain even-split
            token one (no ``robust``, ``node_constraint``, ``decode``, ``weighted=True``); noise from a
            bootstrap over windows (over window labels when a trace's labels repeat, e.g. MMLU
            subjects); a trace with fewer windows (e.g. one domain's counts) uses Poisson noise of its
            counts; a bare ``[L, E]`` load is solved as given (no gate). ``"windows"``: the same, an
            error without windows. ``"poisson"``: Poisson resampling of integer counts (for
            counts-only loads; it cannot see a domain shift). ``None``/``"off"``: the plain exact
            optimum.
        noise_k: move cost per moved slot in units of the noise ``sigma`` of a layer's peak (default 1).
    """

    backend: Literal["cpsat", "milp"] = "cpsat"
    node_constraint: bool = False
    objective: Literal["tokens", "decode"] = "tokens"
    robust: str | None = None
    num_windows: int = 4
    weighted: bool | str = False
    time_limit: float = 10.0
    seed: int = 0
    workers: int | None = None
    hint: Placement | None = field(default=None, repr=False)
    expert_bytes: float | None = None
    hardware: Any = None
    deterministic: bool = True
    step_tokens: float | None = None
    local_search_iters: int | None = None
    validation: float | str | None = None
    noise_gate: str | None = "auto"
    noise_k: float = 1.0
