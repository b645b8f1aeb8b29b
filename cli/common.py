"""Helpers shared by the CLI subcommand modules (printing lives only in the CLI layer).

Printing (:func:`echo`, :func:`warn`, :func:`format_table`, progress bars), the root parser every
sub-command hangs from, and the checked readers for file arguments (a missing or unreadable file is a
:class:`CliError`: one line on stderr, exit code 2).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

import numpy as np

T = TypeVar("T")

__all__ = [
    "CliError",
    "add_dispatch_args",
    "check_output",
    "checked_dispatch",
    "echo",
    "elapsed_bar",
    "format_table",
    "open_load",
    "open_placement",
    "open_trace",
    "progress",
    "root_parser",
    "warn",
]


class CliError(ValueError):
    """Bad input detected by the CLI: printed as one line, exit code 2."""


def echo(*parts, file=None) -> None:
    print(*parts, file=file or sys.stdout)


def warn(msg: str) -> None:
    print(f"moe-placement: warning: {msg}", file=sys.stderr)


def progress(
    items: Iterable[T], total: int | None = None, desc: str = "", min_seconds: float = 2.0
) -> Iterator[T]:
    """A text progress bar on stderr, shown only once the loop has run ``min_seconds`` and stderr is a tty
    (or when MOE_PLACEMENT_PROGRESS=1)."""
    import os

    show_any = sys.stderr.isatty() or os.environ.get("MOE_PLACEMENT_PROGRESS") == "1"
    if total is None:
        try:
            total = len(items)  # type: ignore[arg-type]
        except TypeError:
            total = None
    start = time.perf_counter()
    shown = False
    for i, item in enumerate(items):
        yield item
        if show_any and time.perf_counter() - start >= min_seconds:
            shown = True
            done = i + 1
            if total:
                width = 30
                fill = int(width * done / total)
                sys.stderr.write(
                    f"\r{desc} [{'#' * fill}{'.' * (width - fill)}] {done}/{total} {time.perf_counter() - start:.0f}s"
                )
            else:
                sys.stderr.write(f"\r{desc} {done} {time.perf_counter() - start:.0f}s")
            sys.stderr.flush()
    if shown:
        sys.stderr.write("\n")


class elapsed_bar:
    """Context manager: a time bar on stderr for one long call (a solve with a time limit).

    Shown only when stderr is a tty (or MOE_PLACEMENT_PROGRESS=1); refreshed by a daemon thread.
    """

    def __init__(self, desc: str, limit_s: float | None = None, interval: float = 0.5):
        import os
        import threading

        self.desc, self.limit, self.interval = desc, limit_s, interval
        self.show = sys.stderr.isatty() or os.environ.get("MOE_PLACEMENT_PROGRESS") == "1"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._shown = False

    def _run(self) -> None:
        start = time.perf_counter()
        while not self._stop.wait(self.interval):
            t = time.perf_counter() - start
            if self.limit:
                width = 30
                fill = min(width, int(width * t / self.limit))
                sys.stderr.write(
                    f"\r{self.desc} [{'#' * fill}{'.' * (width - fill)}] {t:.0f}/{self.limit:.0f}s"
                )
            else:
                sys.stderr.write(f"\r{self.desc} {t:.0f}s")
            sys.stderr.flush()
            self._shown = True

    def __enter__(self):
        if self.show:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self.show:
            self._thread.join()
            if self._shown:
                sys.stderr.write("\n")
        return False


# ---------------------------------------------------------------------------------------------
# the root parser
# ---------------------------------------------------------------------------------------------
def root_parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    """The ``moe-placement`` parser with ``--debug`` and no sub-commands yet: ``(parser, subparsers)``."""
    ap = argparse.ArgumentParser(
        prog="moe-placement",
        description="Place the experts of a mixture-of-experts model on GPUs: inspect routing, solve, evaluate, "
        "export engine files, validate on real ranks.",
    )
    ap.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    return ap, sub


# ---------------------------------------------------------------------------------------------
# output
# ---------------------------------------------------------------------------------------------
def format_table(rows: list[dict], cols: list[tuple[str, str, int]]) -> str:
    """Render rows as a fixed-width table; cols are (key, header, decimals or -1 for text)."""
    cells = []
    for r in rows:
        line = []
        for key, _, nd in cols:
            v = r.get(key, "")
            if isinstance(v, float) and nd >= 0:
                line.append(f"{v:.{nd}f}")
            else:
                line.append(str(v))
        cells.append(line)
    widths = [
        max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, (_, h, _) in enumerate(cols)
    ]
    out = ["  ".join(h.rjust(w) for (_, h, _), w in zip(cols, widths))]
    out += ["  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in cells]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# file arguments
# ---------------------------------------------------------------------------------------------
def open_trace(path: str, domains=None):
    """``--trace`` / a trace argument -> :class:`profiling.trace.RoutingTrace` (CliError when missing)."""
    from profiling.readers import read_trace

    p = Path(path)
    if not p.exists():
        raise CliError(f"trace {p} does not exist")
    return read_trace(p, domains=domains)


def open_load(path: str) -> np.ndarray:
    """``--load`` -> float64 ``[layers, experts]`` (an .npy, an .npz's ``counts``, or ``[W, L, E]`` summed over W)."""
    p = Path(path)
    if not p.is_file():
        raise CliError(f"load file {p} does not exist")
    try:
        arr = np.load(p, allow_pickle=False)
    except Exception as exc:  # numpy raises several types for corrupt files
        raise CliError(f"{p}: not a readable .npy array ({type(exc).__name__}: {exc})") from None
    if hasattr(arr, "files"):  # an .npz: take 'counts' or the only array
        keys = list(arr.files)
        key = "counts" if "counts" in keys else (keys[0] if len(keys) == 1 else None)
        if key is None:
            raise CliError(
                f"{p}: .npz with several arrays {keys}; expected a 'counts' array [layers, experts]"
            )
        arr = arr[key]
    arr = np.asarray(arr)
    if arr.ndim == 3:
        arr = arr.sum(axis=0)
    if arr.ndim != 2 or arr.dtype.kind not in "iuf":
        raise CliError(f"{p}: load must be a numeric [layers, experts] array, got {arr.dtype} {arr.shape}")
    if not np.all(np.isfinite(arr)) or (arr.size and arr.min() < 0):
        raise CliError(f"{p}: load must be finite and >= 0")
    return arr.astype(np.float64)


def open_placement(path: str, *, engine_map: bool = False, **kw):
    """A placement file in any format :func:`placement.formats.read_placement` reads (CliError when missing).

    ``engine_map``: accept two replicas of one expert on one GPU (the engines' balancers write such
    maps), with one warning naming them and the SGLang hazard.
    """
    from placement.formats import read_placement

    p = Path(path)
    if not p.exists():
        raise CliError(f"placement file {p} does not exist")
    placement = read_placement(p, allow_colocated_replicas=engine_map, **kw)
    if engine_map:
        warn_colocated(p, placement)
    return placement


def warn_colocated(path: Path, placement) -> None:
    """One warning naming the (layer, GPU, expert) triples that hold an expert twice, if any."""
    from placement.model import colocated_replicas

    found = colocated_replicas(placement.physical_to_logical_map, placement.topology.ep_size)
    if not found:
        return
    shown = ", ".join(f"layer {placement.layer_ids[l]} GPU {g} expert {e}" for l, g, e in found[:6])
    more = f" and {len(found) - 6} more" if len(found) > 6 else ""
    warn(
        f"{path}: {len(found)} GPU(s) hold two replicas of one expert ({shown}{more}); SGLang's static "
        "dispatch sends a GPU's own tokens to the first copy only, and with DeepEP the second copy may be "
        "left unloaded while other ranks still route to it. moe-placement's solvers never write such maps"
    )


def checked_dispatch(args: argparse.Namespace) -> str:
    """``--dispatch`` checked here rather than by argparse, so a bad name is one line (exit 2)."""
    if args.policy not in args.dispatch_choices:
        raise CliError(
            f"unknown dispatch model {args.policy!r}; use one of {', '.join(args.dispatch_choices)}"
        )
    return args.policy


class _DeprecatedAlias(argparse.Action):
    """An old spelling of an option: stores like it, with one warning line on stderr."""

    def __init__(self, *args, new: str, **kwargs):
        self.new = new
        super().__init__(*args, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        warn(f"{option_string} is deprecated; use {self.new}")
        setattr(namespace, self.dest, values)


def add_dispatch_args(
    p: argparse.ArgumentParser, *, choices: Sequence[str] | None = None, extra: str = ""
) -> None:
    """``--dispatch`` (``--policy``: its deprecated alias, which warns) and ``--source-ranks``.

    ``choices``: the names accepted (default: every model in :data:`placement.dispatch.DISPATCH`);
    the value lands in ``args.policy``.
    """
    from placement.dispatch import DISPATCH, EVEN

    names = tuple(choices or DISPATCH)
    metavar = "{" + ",".join(names) + "}"
    p.add_argument(
        "--dispatch",
        dest="policy",
        default=EVEN.name,
        metavar=metavar,
        help=f"how the engine picks a replica: {', '.join(DISPATCH)} (see docs/dispatch.md){extra}",
    )
    p.add_argument(
        "--policy",
        dest="policy",
        default=argparse.SUPPRESS,
        metavar=metavar,
        action=_DeprecatedAlias,
        new="--dispatch",
        help="deprecated alias of --dispatch",
    )
    p.set_defaults(dispatch_choices=names)
    p.add_argument(
        "--source-ranks",
        help="attention-DP rank of each token: round-robin (prompt i to rank i mod EP size; the default "
        "when the trace has prompts and no ranks), random[:SEED], or FILE.npy with one rank per token",
    )


def check_output(path: str | None) -> Path | None:
    """An output file argument -> Path (None stays None); its folder must exist, it must not be a folder."""
    if path is None:
        return None
    p = Path(path)
    if p.exists() and p.is_dir():
        raise CliError(f"output {p} is a folder; give a file path")
    if not p.parent.exists():
        raise CliError(f"output folder {p.parent} does not exist; create it first")
    return p
