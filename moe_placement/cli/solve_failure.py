"""``solve``'s failure-domain flags: ``--failure-domain``, its cap, and the failover folder.

- ``--failure-domain gpu|node`` puts the problem's failure domain (:mod:`solver.failure`, the
  pipeline's last step); ``--failure-max-par-increase X`` caps its balance cost (default 0.02).
- ``--failover DIR`` writes one map per single loss of that domain (:func:`solver.failover.failover_map`
  on the placement solved, for the fitted load) and ``DIR/index.json``
  (:mod:`placement.formats.failover`), all published as one; ``--failover-max-moves`` sets each map's
  move budget.

Every flag is checked before anything is solved (:func:`check_failure_args`).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from moe_placement.cli.common import CliError, echo, format_table

if TYPE_CHECKING:
    from placement.model import Placement
    from solver.api import SolveResult

FAILOVER_COMMAND = "solve-failover"  # the command name in the failover folder's manifest

__all__ = [
    "add_failure_args",
    "check_failure_args",
    "failure_cap",
    "failure_label",
    "print_failover",
    "write_failover",
]


def _cap(text: str) -> float:
    """``--failure-max-par-increase``: a finite number >= 0, or ``none`` (no cap: ``inf`` here, so that
    it differs from the flag not given)."""
    from solver.failure import check_max_par_increase

    if text.strip().lower() == "none":
        return float("inf")
    try:
        return check_max_par_increase(float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number >= 0 (or none); e.g. 0.02") from None


def _moves(text: str) -> int | str | None:
    """``--failover-max-moves``: a whole number >= 0, ``lost`` (the default) or ``none`` (no budget)."""
    from solver.failover import DEFAULT_MAX_MOVES

    word = text.strip().lower()
    if word in (DEFAULT_MAX_MOVES, "none"):
        return None if word == "none" else DEFAULT_MAX_MOVES
    if not word.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number >= 0, {DEFAULT_MAX_MOVES} or none")
    return int(word)


def add_failure_args(p: argparse.ArgumentParser) -> None:
    """The failure-domain flags of ``solve``."""
    from solver.failure import DEFAULT_MAX_PAR_INCREASE, DOMAINS

    p.add_argument(
        "--failure-domain",
        choices=DOMAINS,
        help="spread copies of the hottest experts over GPUs or nodes so that losing one leaves a copy; "
        "the report names the single points of failure",
    )
    p.add_argument(
        "--failure-max-par-increase",
        type=_cap,
        metavar="X",
        help=f"with --failure-domain: at most X more PAR per layer than without it, else fewer experts are "
        f"protected, hottest first (default {DEFAULT_MAX_PAR_INCREASE}; none: no cap)",
    )
    p.add_argument(
        "--failover",
        metavar="DIR",
        help="with --failure-domain: write DIR/index.json and one map per lost GPU or node, ready to serve "
        "on the survivors",
    )
    p.add_argument(
        "--failover-max-moves",
        type=_moves,
        metavar="N",
        help="with --failover: expert copies beyond the reloads per map (default lost: as many as the lost "
        "GPUs held, less the reloads; 0: reloads only; none: no budget)",
    )


def check_failure_args(args, topo, num_experts: int, previous: bool) -> Path | None:
    """The failure flags against each other and the topology, before anything is solved; the failover
    folder as a Path (None without ``--failover``)."""
    from moe_placement.cli.common import check_folder_outputs
    from placement.formats.failover import FAILOVER_INDEX
    from solver.failure import check_domain

    domain = args.failure_domain
    given = [
        f
        for f, v in (
            ("--failure-max-par-increase", args.failure_max_par_increase),
            ("--failover", args.failover),
            ("--failover-max-moves", args.failover_max_moves),
        )
        if v is not None
    ]
    if domain is None:
        if given:
            raise CliError(f"{given[0]} applies with --failure-domain gpu|node; add it, or drop {given[0]}")
        return None
    if args.failover_max_moves is not None and args.failover is None:
        raise CliError(
            "--failover-max-moves sets the moves of the --failover maps; add --failover DIR or drop it"
        )
    if previous:
        raise CliError(
            "--failure-domain applies to a fresh placement, not to --previous (migration); drop one"
        )
    if domain == "node" and getattr(args, "node_constraint", False):
        raise CliError(
            "--node-constraint keeps every expert group on one node but --failure-domain node spreads copies "
            "over nodes; give one of them"
        )
    try:
        check_domain(domain, topo)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    if args.failover is None:
        return None
    _check_losses(domain, topo, num_experts)
    from placement.formats.failover import failover_file_name
    from solver.failover import domain_losses

    names = [FAILOVER_INDEX] + [failover_file_name(domain, i) for i, _ in domain_losses(topo, domain)]
    out = check_folder_outputs(args.failover, names, [args.trace, args.load, args.output, args.report])
    from moe_placement.base.folders import claim_folder

    with claim_folder(
        out, FAILOVER_COMMAND, names
    ):  # refused now (another run, foreign files), before solving
        pass
    return out


def _check_losses(domain: str, topo, E: int) -> None:
    """Every single loss of ``domain`` must leave at least ``E`` slots, else no failover map exists."""
    lost = 1 if domain == "gpu" else topo.gpus_per_node
    left = (topo.ep_size - lost) * topo.slots_per_gpu
    if left < E:
        raise CliError(
            f"losing one {domain} leaves {topo.ep_size - lost} GPUs x {topo.slots_per_gpu} slots = {left} slots for "
            f"{E} experts: no failover map serves every expert; add redundant slots (--num-redundant), GPUs, "
            f"or use a smaller failure domain"
        )


def failure_cap(args) -> float | None:
    """The problem's ``failure_max_par_increase``: the flag's value, its default when not given, None
    for ``none``."""
    from solver.failure import DEFAULT_MAX_PAR_INCREASE

    cap = args.failure_max_par_increase
    if cap is None:
        return DEFAULT_MAX_PAR_INCREASE
    return None if cap == float("inf") else cap


def failure_label(label: str, result: SolveResult) -> str:
    """The balance table's label of the placement served: ``label`` plus its failure domain."""
    return label if result.failure is None else f"{label}, failure domain {result.failure.domain}"


def write_failover(args, out: Path, placement: Placement, load: np.ndarray) -> dict:
    """Every map of ``--failover``, computed and published as one run's folder
    (:func:`moe_placement.base.folders.publish_folder`: an earlier run's maps not rewritten are removed,
    files this command did not write are never touched). Returns ``{"dir", "domain", "losses"}`` for the JSON and the table."""
    from moe_placement.base.folders import publish_folder
    from placement.formats import placement_files
    from placement.formats.failover import FAILOVER_INDEX, failover_file_name, index_bytes
    from solver.failover import DEFAULT_MAX_MOVES, FailoverOptions, domain_losses, failover_map

    domain = args.failure_domain
    moves = DEFAULT_MAX_MOVES if args.failover_max_moves is None else args.failover_max_moves
    options = FailoverOptions(max_moves=moves, resolve=True, num_groups=args.num_groups)
    files, losses = [], []
    for index, lost in domain_losses(placement.topology, domain):
        new, rep = failover_map(placement, load, lost, options)
        name = failover_file_name(domain, index)
        files += placement_files(new, out / name, "native")
        losses.append(_entry(index, lost, name, new, rep))
    opts = {"max_moves": moves, "min_gain": options.min_gain, "target": options.target, "load": "fitted"}
    files.append((out / FAILOVER_INDEX, index_bytes(out / FAILOVER_INDEX, placement, domain, losses, opts)))
    publish_folder(out, {Path(f).name: data for f, data in files}, FAILOVER_COMMAND)
    return {"dir": str(out), "domain": domain, "losses": losses}


def _entry(index: int, lost, name: str, new: Placement, rep) -> dict:
    return {
        "lost": int(index),
        "lost_gpus": list(rep.lost_gpus),
        "file": name,
        "reloads": rep.total_reloads,
        "min_reloads": rep.total_min_reloads,
        "moves": rep.total_moves,
        "par": rep.par,
        "resolve_par": rep.resolve_par,
        "ep_size": new.topology.ep_size,
        "num_nodes": new.topology.num_nodes,
    }


def print_failover(summary: dict) -> None:
    """One row per loss: reloads (and the fewest possible), moves, PAR, a full re-solve's PAR."""
    rows = [
        {**e, "lost": f"{summary['domain']} {e['lost']}", "ratio": e["par"] / e["resolve_par"]}
        for e in summary["losses"]
    ]
    echo(
        f"failover maps in {summary['dir']} (one per lost {summary['domain']}; PAR on the fitted load, even split):"
    )
    cols = [
        ("lost", "lost", -1),
        ("reloads", "reloads", -1),
        ("min_reloads", "fewest", -1),
        ("moves", "moves", -1),
        ("par", "PAR", 4),
        ("resolve_par", "re-solve PAR", 4),
        ("ratio", "PAR / re-solve", 4),
    ]
    echo(format_table(rows, cols))
