"""``solve``'s check for flags that cannot take effect on this run (issue 36): refused in one line.

A flag accepted and silently ignored makes the user believe a setting took effect (``--robust`` with
greedy, ``--source-ranks`` when nothing uses source ranks). The solver-specific flags are read from
:data:`solver.api.SOLVERS` (each spec's ``flags``), so a new solver option is covered without a change here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from moe_placement.cli.common import CliError, per_step_dispatch_names

if TYPE_CHECKING:
    from solver.api import SolverSpec

__all__ = ["refuse_ignored_flags"]


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _refuse_contradictions(args) -> None:
    """Two flags that cannot both take effect: the first would be ignored, or do nothing."""
    if args.wall_clock and getattr(args, "work_limit", None) is not None:
        raise CliError(
            f"--wall-clock bounds the search by --time-limit instead of a step budget, but --work-limit "
            f"{args.work_limit} sets one (and would bound it); give one of them"
        )
    windows, robust = getattr(args, "num_windows", None), getattr(args, "robust", None)
    if windows is not None and not robust:
        raise CliError(
            f"--num-windows {windows} sets the windows of a robust fit, but no --robust is given (the plain fit "
            f"uses the whole load); add --robust max or --robust q90, or drop it"
        )
    if windows == 1 and robust:
        raise CliError(
            f"--robust {robust} over --num-windows 1 is the plain fit; use --num-windows 2 or more"
        )


def refuse_ignored_flags(args, prob, spec: SolverSpec) -> None:
    """A flag given that cannot take effect on this run is refused (the user would believe it did):
    another solver's options, a per-step or source-rank setting nothing here uses, a format with no file.
    ``prob``: the problem read (its ``name``, ``fit`` and ``held`` traces). Sets ``args.step_tokens`` to
    its phase's default when not given (decode 64, prefill 256)."""
    from placement.dispatch import get_dispatch
    from placement.steps import DEFAULT_STEP_TOKENS, PHASES
    from solver.api import SOLVERS

    mine = set(spec.flags.values())
    for dest in sorted({d for s in SOLVERS.values() for d in s.flags.values()} - mine):
        if getattr(args, dest, None) not in (None, False):
            takers = [n for n, s in SOLVERS.items() if dest in s.flags.values()]
            raise CliError(
                f"{_flag(dest)} applies to the {' and '.join(takers)} solver{'s' * (len(takers) > 1)}, not {prob.name}; drop it, or "
                f"use {'--previous' if SOLVERS[takers[0]].needs_previous else '--solver ' + takers[0]}"
            )
    if args.wall_clock and not spec.work_per_layer:
        raise CliError(f"--wall-clock applies to a solver bounded by --work-limit, not {prob.name}; drop it")
    _refuse_contradictions(args)
    model = get_dispatch(args.dispatch)
    given = {
        "--step-tokens": args.step_tokens is not None,
        "--phase": args.phase != PHASES[0],
        "--model": args.model is not None,
        "--hardware": args.hardware is not None,
    }
    for flag in (f for f, on in given.items() if on):
        if not model.needs_step_counts:
            raise CliError(
                f"{flag} applies to a per-step dispatch model ({per_step_dispatch_names()}), not {model.name}; "
                "drop it"
            )
        if prob.fit is None or not prob.fit.has_tokens:  # the per-step fit keeps the replicas: no steps
            what = "--load has no tokens" if prob.fit is None else f"{args.trace} has counts only"
            raise CliError(
                f"{flag} shapes the per-step fit, which steps through a per-token trace; {what}, so no step is "
                f"placed for: give a per-token --trace, or drop it"
            )
    args.step_tokens = args.step_tokens or DEFAULT_STEP_TOKENS[args.phase]  # as --help says: by phase
    fit = prob.fit
    fit_ranked = bool(model.engine) and fit is not None and (fit.has_tokens or fit.window_counts is not None)
    if (
        args.source_ranks is not None
        and not fit_ranked
        and not (prob.held is not None and prob.held.has_tokens)
    ):
        raise CliError(
            f"--source-ranks {args.source_ranks}: nothing in this run uses source ranks (the {model.name} dispatch "
            f"keeps no per-rank table and no held-out tokens are scored); add --fit-fraction 0.5, or drop it"
        )
    if args.output is None and args.format != "native":
        raise CliError(f"--format {args.format} shapes the placement file, but no -o FILE is written; add -o")
    if args.load is not None and args.fit_fraction < 1.0:
        raise CliError(
            "--fit-fraction splits a trace's windows; a --load matrix has none: use --trace, or drop it"
        )
