"""``moe-placement solve``: compute a placement, compare it with greedy (and trivial), write it.

Steps of :func:`cmd_solve`: read the problem (trace or load, topology, the placement in service,
the dispatch model) -> :func:`solver.api.run`, the one pipeline (baseline, the named solver, fit
for the dispatch model, gate against the baseline, report) -> balance rows (fitted and held-out
PAR) -> write the placement and the report -> print (table or JSON). What differs between solvers
(which flags feed their options, what is printed) is read from their :class:`solver.api.SolverSpec`.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from moe_placement.cli.common import (
    CliError,
    add_dispatch_args,
    add_phase_args,
    check_output,
    check_writes,
    checked_dispatch,
    echo,
    elapsed_bar,
    ep_size_int,
    expert_count_int,
    format_table,
    fraction,
    hardware_help,
    hidden_size_int,
    input_sidecars,
    model_arg,
    non_negative_float,
    non_negative_int,
    num_experts_int,
    open_load,
    open_placement,
    open_trace,
    output_files,
    per_step_dispatch_names,
    positive_int,
    seconds,
    seed_int,
    source_ranks_file,
    warn,
    warn_colocated,
    workers_int,
)
from moe_placement.cli.solve_failure import (
    add_failure_args,
    check_failure_args,
    failure_cap,
    failure_label,
    print_failover,
    write_failover,
)
from moe_placement.cli.solve_flags import refuse_ignored_flags

if TYPE_CHECKING:
    from placement.model import Placement
    from placement.topology import Topology
    from profiling.trace import RoutingTrace
    from solver.api import SolveResult, SolverSpec
    from solver.problem import Problem
    from solver.report import SolveReport

__all__ = ["add_parser", "cmd_solve"]


# ---------------------------------------------------------------------------------------------
# arguments
# ---------------------------------------------------------------------------------------------
def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``solve`` sub-command: problem, solver, exact-model, locality, migration and output flags."""
    p = sub.add_parser("solve", help="compute a placement")
    _add_problem_args(p)
    _add_exact_args(p)
    _add_locality_args(p)
    _add_migration_args(p)
    _add_output_args(p)
    add_failure_args(p)
    p.set_defaults(func=cmd_solve)


def _add_problem_args(p: argparse.ArgumentParser) -> None:
    """What to place and on what: the load, the topology, the solver (``solver.api.SOLVERS``, but
    those that need the placement in service: ``--previous`` picks that one) and its budget."""
    from solver.api import BASELINE, solver_names

    p.add_argument("--trace", help="routing trace to fit on")
    p.add_argument("--load", help=".npy load matrix [layers, experts] (instead of --trace)")
    p.add_argument("--ep-size", type=ep_size_int, required=True, help="EP ranks (GPUs)")
    p.add_argument("--num-nodes", type=ep_size_int, default=1)
    p.add_argument("--num-redundant", type=expert_count_int, default=0, help="redundant slots per layer")
    p.add_argument(
        "--num-groups",
        type=num_experts_int,
        help="expert groups (hierarchical greedy when they divide over nodes)",
    )
    p.add_argument("--solver", choices=solver_names(needs_previous=False), default=BASELINE)
    p.add_argument(
        "--time-limit", type=seconds, default=10.0, help="seconds for the whole solve (all layers)"
    )
    p.add_argument("--seed", type=seed_int, default=0)
    p.add_argument("--workers", type=workers_int, help="solver worker threads")


def _add_exact_args(p: argparse.ArgumentParser) -> None:
    """cpsat / milp: objective, robust fit, weighted dispatch, node constraint."""
    p.add_argument("--objective", choices=("tokens", "decode"), help="default: tokens")
    p.add_argument("--robust", help="robust fit over windows: 'max' or a quantile like q90")
    p.add_argument("--num-windows", type=positive_int, help="windows of the robust fit (default 4)")
    p.add_argument(
        "--weighted", action="store_true", help="also choose per-replica token shares (weighted dispatch)"
    )
    p.add_argument(
        "--node-constraint", action="store_true", help="keep expert groups on nodes inside the exact model"
    )


def _add_locality_args(p: argparse.ArgumentParser) -> None:
    """locality: balance slack, everywhere experts, GPU slack, sources, work limit, pairing margins."""
    p.add_argument(
        "--balance-slack",
        type=non_negative_float,
        help="locality: allowed node-load excess over the mean (default 0.02)",
    )
    p.add_argument(
        "--everywhere",
        type=expert_count_int,
        metavar="H",
        help="locality: the H hottest experts get a replica on every node (default: chosen from the slots)",
    )
    p.add_argument(
        "--gpu-slack",
        type=non_negative_float,
        metavar="X",
        help="locality: GPU peaks at most (1 + X) x greedy's on the fit trace (default 0.05)",
    )
    p.add_argument(
        "--source-model",
        choices=("auto", "trace", "uniform"),
        help="locality: attention-DP sources to fit with (auto: deal tokens round-robin when the trace "
        "has no source ranks and its prompts were dealt)",
    )
    p.add_argument(
        "--work-limit",
        type=positive_int,
        metavar="STEPS",
        help="locality: bound the search by counted steps instead of --time-limit, so the same seed "
        "gives the same placement on any machine (a step is about 1-10 ms; default 100 per layer)",
    )
    p.add_argument(
        "--wall-clock",
        action="store_true",
        help="locality: bound the search by --time-limit seconds instead of the default step budget "
        "(the placement then depends on the machine's speed and load)",
    )
    p.add_argument(
        "--share-margin",
        type=non_negative_float,
        metavar="X",
        help="locality, 2 slots per GPU: pair everywhere replicas as if (1 + X) x their fitted load "
        "(default: the busiest node's token share in the fit trace over the mean, minus 1)",
    )
    p.add_argument(
        "--drift-z",
        type=non_negative_float,
        metavar="Z",
        help="locality, 2 slots per GPU: pair single-node experts as if their fitted load plus Z x their "
        "expected drift to unseen traffic (bootstrap over the fit prompts; default 1, 0: off)",
    )
    p.add_argument(
        "--share-overload",
        type=non_negative_float,
        metavar="X",
        help="locality: the default --everywhere keeps (the busiest node's token share over the mean, "
        "minus 1) x (the everywhere experts' load share) at most X (default 0.08)",
    )
    p.add_argument("--hidden-size", type=hidden_size_int, help="model hidden size for bytes per token")


def _add_migration_args(p: argparse.ArgumentParser) -> None:
    """Re-placing the placement in service with few moves."""
    p.add_argument("--previous", help="current placement: re-place with few moves")
    p.add_argument(
        "--max-moves", type=non_negative_int, help="with --previous: at most this many moved slots"
    )
    p.add_argument(
        "--move-cost",
        type=non_negative_float,
        help="with --previous: cost of one moved slot in tokens of peak load",
    )


def _add_output_args(p: argparse.ArgumentParser) -> None:
    """Held-out scoring, the placement file (``--format``: ``placement.formats.FORMATS``), the report,
    JSON output."""
    from placement.formats import FORMATS

    p.add_argument(
        "--fit-fraction",
        type=fraction,
        default=1.0,
        help="fit on this leading fraction of the trace's windows and score the rest (held-out)",
    )
    add_dispatch_args(
        p,
        extra="; scores fitted and held-out PAR, and sglang-static/sglang-dynamic also place replicas for "
        "SGLang's table (greedy, cpsat, milp)",
    )
    add_phase_args(
        p, f"the placement is fitted for under a per-step dispatch model ({per_step_dispatch_names()})"
    )
    p.add_argument(
        "--model",
        default=None,
        help="model preset that prices the fitted steps (deepseek-v2-lite, mixtral-8x7b, ..., a model JSON "
        "or a HF config.json; default: the built-in preset with the trace's experts and top-k, else the "
        "fit balances the step peak only)",
    )
    p.add_argument(
        "--hardware",
        default=None,
        help=f"GPU preset that prices the fitted steps: {hardware_help()}",
    )
    p.add_argument("-o", "--output", help="placement file to write")
    p.add_argument("--format", choices=FORMATS, default="native")
    p.add_argument("--report", help="write the solve report JSON here")
    p.add_argument("--json", action="store_true")


def _solver_options(args, spec: SolverSpec, num_layers: int) -> dict:
    """The options the flags set: every ``spec.flags`` argument given (not None, not a false switch),
    and the default work limit (``spec.work_per_layer`` steps per layer) unless ``--wall-clock``."""
    opts: dict = {}
    for key, flag in spec.flags.items():
        value = getattr(args, flag)
        if value is not None and value is not False:
            opts[key] = value
    if spec.work_per_layer and args.work_limit is None and not args.wall_clock:
        opts["work_limit"] = spec.work_per_layer * num_layers
    return opts


# ---------------------------------------------------------------------------------------------
# the problem
# ---------------------------------------------------------------------------------------------
@dataclass
class _Problem:
    """What ``solve`` places.

    Attributes:
        name: the solver to run (``migration`` when ``--previous`` is given).
        load: float64 ``[L, E]`` token-expert assignments fitted on.
        fit: the trace fitted on (None with ``--load``).
        held: the held-out part of the trace (None unless ``--fit-fraction < 1``).
        layer_ids: ``L`` model layer indices.
        topo: the topology (``P = topo.num_physical_experts`` slots per layer).
        previous: the placement in service, physical_to_logical_map ``[L, P]`` (or None).
    """

    name: str
    load: np.ndarray
    fit: RoutingTrace | None
    held: RoutingTrace | None
    layer_ids: tuple[int, ...]
    topo: Topology
    previous: Placement | None = None


def _check_files(args) -> Path | None:
    """Every file ``solve`` reads and writes, checked before anything is read: no output is an input
    or another output, every output folder exists; ``-o`` as a Path (None when not given)."""
    outputs: list = output_files(args.output, args.format)
    if args.output is not None and args.weighted:
        outputs.append(args.output + ".weights.json")
    outputs.append(args.report)
    inputs = [args.trace, args.load, source_ranks_file(args.source_ranks), *input_sidecars(args.previous)]
    inputs += [
        args.model,
        args.hardware,
        args.model and str(Path(args.model) / "config.json"),
    ]  # preset files
    check_writes(inputs, outputs)
    return check_output(args.output)


def _read_load(args) -> tuple[np.ndarray, RoutingTrace | None, RoutingTrace | None, tuple[int, ...]]:
    """``--trace`` (split by ``--fit-fraction``) or ``--load`` -> (load [L, E] float64, fit, held, layer_ids)."""
    from profiling.readers import require_data

    if (args.trace is None) == (args.load is None):
        raise CliError("give exactly one of --trace T or --load L.npy")
    if args.load is not None:
        model_arg(args)  # --hidden-size against --model
    held = None
    if args.trace:
        model = model_arg(args)  # --model knows the expert count a trace may not say
        trace = open_trace(args.trace, experts=model and (model.num_logical_experts, f"--model {args.model}"))
        require_data(trace, args.trace)
        fit = trace
        if args.fit_fraction < 1.0:
            fit, held = trace.split(args.fit_fraction)
            require_data(fit, f"{args.trace} (the part fitted on, --fit-fraction {args.fit_fraction})")
            require_data(held, f"{args.trace} (the held-out part, --fit-fraction {args.fit_fraction})")
        return fit.counts().astype(np.float64), fit, held, trace.layer_ids
    load = open_load(args.load)
    require_data(load, args.load)
    return load, None, held, tuple(range(load.shape[0]))


def _read_previous(args, L: int, topo: Topology) -> Placement | None:
    """``--previous`` with its move budget, checked against the problem's shape ``[L, P]``."""
    if args.previous:
        previous = open_placement(
            args.previous, engine_map=True, warn_now=False, ep_size=args.ep_size, num_nodes=args.num_nodes
        )
        if previous.physical_to_logical_map.shape != (L, topo.num_physical_experts):
            raise CliError(
                f"--previous has shape {previous.physical_to_logical_map.shape} but the problem is "
                f"{L} layers x {topo.num_physical_experts} slots"
            )
        if args.max_moves is None and args.move_cost is None:
            raise CliError("--previous needs --max-moves M or --move-cost C")
        warn_colocated(args.previous, previous)
        return previous
    if args.max_moves is not None or args.move_cost is not None:
        raise CliError("--max-moves/--move-cost need --previous OLD (the current placement)")
    return None


def _read_problem(args) -> _Problem:
    """Load, topology and the placement in service, each checked (CliError names the bad flag)."""
    from placement.topology import Topology

    load, fit, held, layer_ids = _read_load(args)
    L, E = load.shape
    if args.num_redundant < 0:
        raise CliError(f"--num-redundant must be >= 0, got {args.num_redundant}")
    topo = Topology.from_redundant(E, args.num_redundant, args.ep_size, args.num_nodes)
    if args.num_groups is not None and (args.num_groups < 1 or E % args.num_groups):
        raise CliError(f"--num-groups {args.num_groups} must divide the {E} experts")
    previous = _read_previous(args, L, topo)
    from solver.api import solver_names

    name = solver_names(needs_previous=True)[0] if previous is not None else args.solver
    return _Problem(name, load, fit, held, layer_ids, topo, previous)


# ---------------------------------------------------------------------------------------------
# solving
# ---------------------------------------------------------------------------------------------
def _solver_problem(args, prob: _Problem) -> Problem:
    """The frozen problem the pipeline solves: the fitted load and trace, the topology, the layers,
    the placement in service, the dispatch model and its source ranks."""
    from solver.problem import Problem

    return Problem.build(
        prob.topo,
        load=prob.load,
        trace=prob.fit,
        layer_ids=prob.layer_ids,
        num_groups=args.num_groups,
        previous=prob.previous,
        dispatch=args.dispatch,
        source_ranks=args.source_ranks,
        failure_domain=args.failure_domain,
        failure_max_par_increase=failure_cap(args),
    )


def _solve(args, prob: _Problem, spec: SolverSpec) -> SolveResult:
    """The pipeline (:func:`solver.api.run`) under a time bar; a warning when the gate kept greedy."""
    from solver.api import BASELINE, FitOptions, make_options, run
    from solver.step.cost import DEFAULT_HARDWARE

    values = _solver_options(args, spec, prob.load.shape[0])
    options = make_options(prob.name, values, seed=args.seed, time_limit=args.time_limit)
    limit = args.time_limit if "time_limit" in spec.option_names else None
    with elapsed_bar(prob.name, limit):
        fit = FitOptions(
            step_tokens=args.step_tokens,
            phase=args.phase,
            model=args.model,
            hardware=DEFAULT_HARDWARE if args.hardware is None else args.hardware,
            time_limit=args.time_limit,  # the per-step fit stops there too (its note says so)
        )
        result = run(prob.name, _solver_problem(args, prob), options, fit)
    if result.objective_fallback:
        warn(
            f"{prob.name} found nothing better than {BASELINE} within {args.time_limit}s; "
            f"writing the {BASELINE} placement"
        )
    if getattr(result.fit, "stopped_at_limit", False):
        warn(f"--time-limit {args.time_limit:g} s ended the per-step fit: {result.fit.searched_text()}")
    return result


def _balance_rows(args, prob: _Problem, spec: SolverSpec, result: SolveResult) -> tuple[list[dict], bool]:
    """Fitted (and held-out) PAR of trivial, greedy and the solver's placement (and held-out step PAR under
    a per-step model); whether to show remote nodes."""
    from placement.dispatch import get_dispatch
    from placement.metrics import (
        balance_stats,
        evaluate,
        expected_gpu_load,
        rank_expert_counts,
        rank_gpu_load,
        resolve_source_ranks,
        step_par,
    )
    from placement.model import Placement
    from solver.api import BASELINE

    L, E = prob.load.shape
    trivial = None
    try:
        trivial = Placement.trivial(L, E, prob.topo, prob.layer_ids)
    except ValueError:
        pass
    rows = []
    held = prob.held
    held_src = None
    if held is not None and held.has_tokens and args.source_ranks is not None:
        held_src, _ = resolve_source_ranks(held, prob.topo.ep_size, args.source_ranks)
    fit_counts = None
    if (
        get_dispatch(args.dispatch).engine  # an engine's rule: fitted PAR scored under it
        and prob.fit is not None
        and (prob.fit.has_tokens or prob.fit.window_counts is not None)
    ):
        fit_counts = rank_expert_counts(prob.fit, prob.topo.ep_size, args.source_ranks)  # [L, G, E]
    # a solver that trades balance for fewer remote nodes: show both, scored with the dispatch asked for
    comm_view = spec.shows_remote and held is not None and held.has_tokens
    per_step = get_dispatch(args.dispatch).needs_step_counts and held is not None and held.has_tokens
    placed = result.is_baseline and result.fit is not None
    label = f"{BASELINE}, placed for {args.dispatch}" if placed else prob.name
    candidates = {"trivial": trivial, BASELINE: result.baseline}
    if result.unconstrained is not None and not result.unconstrained == result.baseline:
        candidates[label] = result.unconstrained  # the solver's answer without the failure domain
    candidates[failure_label(label, result)] = result.placement
    for label, pl in candidates.items():
        if pl is None:
            continue
        fit_load = (
            expected_gpu_load(pl, prob.load)
            if fit_counts is None
            else rank_gpu_load(pl, fit_counts, args.dispatch)
        )
        row = {"placement": label, "fit_par": balance_stats(fit_load)["par"]}
        if held is not None:
            ev = evaluate(pl, held, args.dispatch, src=held_src).to_dict()
            row["heldout_par"] = ev["par"]
            if per_step:  # what sets step time under a per-step split
                sp = step_par(pl, held, args.step_tokens, args.dispatch, args.phase)
                row["heldout_step_par"], row["step_phase"] = sp["step_par"], sp["phase"]
                row["step_tokens"] = sp["step_tokens"]
            if comm_view and "remote_nodes_per_token" in ev:
                row["heldout_remote_nodes"] = ev["remote_nodes_per_token"]
        rows.append(row)
    return rows, comm_view


# ---------------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------------
def _write_files(
    args, out: Path | None, prob: _Problem, spec: SolverSpec, placement: Placement, payload: dict
) -> list[str]:
    """The placement file (and weighted-dispatch weights), then the report JSON; the paths written."""
    written = []
    if out is not None:
        from placement.formats import write_placement

        written = [str(p) for p in write_placement(placement, out, args.format)]
        if args.weighted and "weighted" in spec.flags:
            from solver.exact import replica_weights, write_replica_weights

            wpath = out.with_name(out.name + ".weights.json")
            write_replica_weights(wpath, replica_weights(placement, prob.load), placement)
            written.append(str(wpath))
    if args.report:
        from moe_placement.base.fileio import atomic_write_json

        atomic_write_json(args.report, payload)
        written.append(args.report)
    return written


# ---------------------------------------------------------------------------------------------
# printing
# ---------------------------------------------------------------------------------------------
def _print_header(prob: _Problem, report: SolveReport, wall: float) -> None:
    """The problem's size and the solver's notes (general ones, then at most 3 per-layer ones)."""
    L, E = prob.load.shape
    topo = prob.topo
    echo(
        f"{prob.name}: {L} layers x {E} experts -> {topo.num_physical_experts} slots on {topo.ep_size} GPUs "
        f"({topo.num_nodes} node(s), {topo.slots_per_gpu} slots per GPU), {wall:.2f}s"
    )
    general = [n for n in report.notes if not n.startswith("layer ")]
    per_layer = [n for n in report.notes if n.startswith("layer ")]
    for n in general + per_layer[:3]:
        echo(f"note: {n}")
    if len(per_layer) > 3:
        echo(f"note: ... {len(per_layer) - 3} more per-layer notes (see --json or --report)")


def _print_balance(args, prob: _Problem, spec: SolverSpec, rows: list[dict], comm_view: bool) -> None:
    """The balance table: fitted PAR, held-out PAR and remote nodes when scored."""
    from placement.dispatch import EVEN, LOCAL, get_dispatch

    echo("balance (peak-to-average GPU load, mean over layers; 1.0 is perfect):")
    fit_rule = args.dispatch if get_dispatch(args.dispatch).engine else EVEN.name
    cols = [("placement", "placement", -1), ("fit_par", f"fitted PAR ({fit_rule})", 4)]
    if prob.held is not None:
        cols.append(("heldout_par", f"held-out PAR ({args.dispatch})", 4))
    if rows and "heldout_step_par" in rows[0]:
        r = rows[0]
        what = f"{args.dispatch}, {r['step_phase']}, {r['step_tokens']}/rank"
        cols.append(("heldout_step_par", f"held-out step PAR ({what})", 4))
    if comm_view:
        cols.append(("heldout_remote_nodes", "held-out remote nodes/token", 4))
    echo(format_table(rows, cols))
    if spec.shows_remote and prob.held is None:
        echo(
            f"tip: --fit-fraction 0.5 --dispatch {LOCAL.name} scores held-out PAR and remote nodes per token "
            "side by side"
        )


def _print_per_layer(prob: _Problem, report: SolveReport, greedy_report: SolveReport) -> None:
    """Per-layer peak load of greedy (the pipeline's baseline) and the solver, bound, gap, status (and
    moves), then the overall line."""
    name = prob.name
    lrows = []
    for g, lr in zip(greedy_report.layers, report.layers):
        lrows.append(
            {
                "layer": lr.layer_id,
                "greedy": g.objective,
                "solver": lr.objective,
                "bound": lr.bound,
                "gap": lr.gap,
                "status": lr.status,
                **({"moved": lr.extra.get("moved_slots")} if prob.previous is not None else {}),
            }
        )
    echo(f"per layer (peak GPU load in tokens; status of {name}):")
    lcols = [
        ("layer", "layer", -1),
        ("greedy", "greedy", 1),
        ("solver", name, 1),
        ("bound", "bound", 1),
        ("gap", "gap", 4),
        ("status", "status", -1),
    ]
    if prob.previous is not None:
        lcols.append(("moved", "moved", -1))
    echo(format_table(lrows, lcols))
    echo(
        f"overall: status {report.status}, objective {report.objective:.1f} vs greedy {greedy_report.objective:.1f} "
        f"({report.objective / max(greedy_report.objective, 1e-12):.4f}x), bound {report.bound:.1f}, gap {report.gap:.4f}"
    )


# ---------------------------------------------------------------------------------------------
# the command
# ---------------------------------------------------------------------------------------------
def cmd_solve(args: argparse.Namespace) -> int:
    """Steps: read the problem -> the pipeline (baseline, solver, fit, gate, report) -> balance rows ->
    write -> print."""
    from placement.metrics import arrived_experts, moved_slots
    from solver.api import SOLVERS

    checked_dispatch(args)
    out = _check_files(args)
    prob = _read_problem(args)
    spec = SOLVERS[prob.name]
    refuse_ignored_flags(args, prob, spec)
    failover = check_failure_args(args, prob.topo, prob.load.shape[1], prob.previous is not None)
    t0 = time.perf_counter()
    result = _solve(args, prob, spec)
    wall = time.perf_counter() - t0
    placement, report = result.placement, result.report
    rows, comm_view = _balance_rows(args, prob, spec, result)
    L, E = prob.load.shape
    payload = {
        "solver": prob.name,
        "topology": prob.topo.to_dict(),
        "num_logical_experts": E,
        "layers": L,
        "balance": rows,
        "report": report.to_dict(),
        "wall_time_s": wall,
    }
    if prob.previous is not None:
        payload["moved_slots"] = moved_slots(prob.previous, placement)
        payload["arrived_experts"] = arrived_experts(prob.previous, placement)
    if result.failure is not None:
        payload["failure"] = result.failure.to_dict()
    if failover is not None:  # first: the report names its maps
        payload["failover"] = write_failover(args, failover, placement, prob.load)
    written = _write_files(args, out, prob, spec, placement, payload)
    if failover is not None:
        written += [str(failover / e["file"]) for e in payload["failover"]["losses"]]
        written.append(str(failover / "index.json"))
    payload["written"] = written
    if args.json:
        echo(json.dumps(payload, indent=1, default=str))
        return 0
    _print_header(prob, report, wall)
    _print_balance(args, prob, spec, rows, comm_view)
    if spec.shows_per_layer:
        _print_per_layer(prob, report, result.baseline_report)
    if prob.previous is not None:
        echo(f"moved slots: {payload['moved_slots']} of {placement.physical_to_logical_map.size}")
    if "failover" in payload:
        print_failover(payload["failover"])
    for p in written:
        echo(f"wrote {p}")
    return 0
