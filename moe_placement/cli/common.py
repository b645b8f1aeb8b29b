"""Helpers shared by the CLI subcommand modules (printing lives only in the CLI layer).

Printing (:func:`echo`, :func:`warn`, :func:`format_table`, progress bars), the root parser every
sub-command hangs from, and the checked readers for file arguments (a missing or unreadable file is a
:class:`CliError`: one line on stderr, exit code 2).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import NoReturn, TypeVar

import numpy as np

from moe_placement.base.errors import CliError  # re-exported: the family lives in moe_placement.base.errors
from moe_placement.base.limits import MAX_EXPERTS, MAX_LAYER_ID, MAX_RANKS

T = TypeVar("T")

__all__ = [
    "MAX_SECONDS",
    "MAX_SEED",
    "CliError",
    "add_dispatch_args",
    "bounded_float",
    "bounded_int",
    "check_folder_outputs",
    "check_output",
    "check_writes",
    "checked_dispatch",
    "echo",
    "elapsed_bar",
    "ep_size_int",
    "expert_count_int",
    "fraction",
    "hidden_size_int",
    "hidden_layers_int",
    "input_sidecars",
    "model_arg",
    "layer_row_int",
    "non_negative_float",
    "non_negative_int",
    "num_experts_int",
    "open_load",
    "open_placement",
    "open_trace",
    "output_files",
    "positive_int",
    "add_phase_args",
    "progress",
    "reading",
    "root_parser",
    "seconds",
    "seed_int",
    "source_ranks_file",
    "warn",
    "workers_int",
]


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
class _Parser(argparse.ArgumentParser):
    """argparse with its errors as one stderr line (no usage block) and exit code 2.

    Sub-command parsers are made by the same class (argparse's default ``parser_class``). Every value
    given is stored by :class:`_Given`, so two refusals hold for every flag of every command: an empty
    value (``--hardware ''`` would otherwise fall back to the default, or be dropped), and one option
    set through two of its spellings (an alias and its flag: argparse keeps the last, silently).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register("action", None, _Given)
        self.register("action", "store", _Given)

    def error(self, message: str) -> NoReturn:
        msg = " ".join(message.split())
        self.exit(2, f"moe-placement: error: {msg} (see: {self.prog} --help)\n")

    def parse_known_args(self, args=None, namespace=None):
        ns, extras = super().parse_known_args(args, namespace)
        for dest, spellings in ns.__dict__.pop(_SPELLINGS, {}).items():
            used = list(dict.fromkeys(spellings))
            if len(used) > 1:
                self.error(
                    f"{used[0]} and {used[1]} are two spellings of one option: give it once, as {self._canonical(dest)}"
                )
        for line in ns.__dict__.pop(_WARNINGS, []):  # only once the arguments are accepted
            warn(line)
        return ns, extras

    def _canonical(self, dest: str) -> str:
        """The current spelling of the option stored in ``dest`` (its first long flag)."""
        for a in self._actions:
            if a.dest == dest and a.option_strings and not isinstance(a, DeprecatedAlias):
                return next((o for o in a.option_strings if o.startswith("--")), a.option_strings[0])
        return "--" + dest.replace("_", "-")


_SPELLINGS = "_spellings"  # namespace entry: dest -> the option strings that set it (popped after parsing)
_WARNINGS = "_parse_warnings"  # namespace entry: warnings printed once parsing succeeded


def _given(parser, namespace, action: argparse.Action, values, option_string) -> None:
    """Refuse an empty value; note which spelling set ``action.dest``."""
    items = values if isinstance(values, list) else [values]
    if any(isinstance(v, str) and not v.strip() for v in items):
        if option_string is None:
            parser.error(
                f"the {action.metavar or action.dest} argument is empty ({values!r}): give a file name"
            )
        parser.error(
            f"{option_string} {values!r} is empty: give a value, or leave the flag out for its default"
        )
    if option_string is not None:
        namespace.__dict__.setdefault(_SPELLINGS, {}).setdefault(action.dest, []).append(option_string)


class _Given(argparse._StoreAction):
    """argparse's ``store`` through :func:`_given` (empty values refused, spellings noted)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        _given(parser, namespace, self, values, option_string)
        super().__call__(parser, namespace, values, option_string)


def root_parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    """The ``moe-placement`` parser with ``--debug`` and no sub-commands yet: ``(parser, subparsers)``."""
    ap = _Parser(
        prog="moe-placement",
        description="Place the experts of a mixture-of-experts model on GPUs: inspect routing, solve, evaluate, "
        "export engine files, validate on real ranks.",
    )
    ap.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    return ap, sub


# ---------------------------------------------------------------------------------------------
# numeric flags: argparse ``type=`` functions; a bad value is one line naming the flag, the value and
# the accepted range (argparse prefixes "argument --flag:"), exit code 2
# ---------------------------------------------------------------------------------------------
MAX_SEED = 2**31 - 1  # CP-SAT's random_seed is a 32-bit int
MAX_WORKERS = 1024  # solver threads
MAX_HIDDEN_SIZE = 1 << 20  # model hidden size (DeepSeek-V3: 7168)
MAX_SECONDS = 1e7  # time limits and timeouts (about 115 days)


def _int_range(lo: int, hi: int | None, limit_name: str) -> str:
    if hi is None:
        return f"integers >= {lo}"
    return f"{lo}..{hi}" + (f" ({limit_name})" if limit_name else "")


def bounded_int(lo: int, hi: int | None = None, limit_name: str = "") -> Callable[[str], int]:
    """A ``type=`` function: an integer in ``lo..hi`` (``hi`` None: no upper bound), else one line
    naming the value and the range (``limit_name``: the constant ``hi`` comes from)."""
    accepted = _int_range(lo, hi, limit_name)

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer; accepted: {accepted}") from None
        if value < lo or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"{text} is not in the accepted range: {accepted}")
        return value

    parse.__name__ = "int"
    return parse


def bounded_float(
    lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False
) -> Callable[[str], float]:
    """A ``type=`` function: a finite number in the interval ``lo..hi`` (ends open or closed); NaN and
    infinities are refused."""
    accepted = f"{'(' if lo_open else '['}{lo:.15g}, {hi:.15g}{')' if hi_open else ']'}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number; accepted: {accepted}") from None
        inside = (value > lo if lo_open else value >= lo) and (value < hi if hi_open else value <= hi)
        if not math.isfinite(value) or not inside:
            raise argparse.ArgumentTypeError(f"{text} is not in the accepted range: {accepted}")
        return value

    parse.__name__ = "float"
    return parse


positive_int = bounded_int(1)  # sizes: tokens per step, chunk, batch, sequence length
non_negative_int = bounded_int(0)  # budgets and offsets: moves, steps between re-solves
seed_int = bounded_int(0, MAX_SEED, "seeds are 32-bit")
ep_size_int = bounded_int(1, MAX_RANKS, "MAX_RANKS")  # EP ranks, nodes
expert_count_int = bounded_int(0, MAX_EXPERTS, "MAX_EXPERTS")  # redundant slots, everywhere experts
num_experts_int = bounded_int(1, MAX_EXPERTS, "MAX_EXPERTS")  # logical experts, expert groups
hidden_layers_int = bounded_int(1, MAX_LAYER_ID + 1, "MAX_LAYER_ID + 1")
layer_row_int = bounded_int(0, MAX_LAYER_ID, "MAX_LAYER_ID")
hidden_size_int = bounded_int(1, MAX_HIDDEN_SIZE, "MAX_HIDDEN_SIZE")
workers_int = bounded_int(1, MAX_WORKERS, "MAX_WORKERS")
fraction = bounded_float(0.0, 1.0, lo_open=True)  # (0, 1]
seconds = bounded_float(0.0, MAX_SECONDS, lo_open=True)  # (0, 1e7]
non_negative_float = bounded_float(0.0, 1e12)  # slacks, margins, costs


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
@contextlib.contextmanager
def reading(path) -> Iterator[None]:
    """Turn what a hostile input file can raise past the readers (nesting deeper than the interpreter's
    stack, a size that does not fit in memory or in a C integer) into a :class:`CliError` naming it."""
    try:
        yield
    except RecursionError:
        raise CliError(f"{path}: nested too deeply to read (RecursionError); the file is corrupt") from None
    except MemoryError:
        raise CliError(
            f"{path}: does not fit in memory (MemoryError); split it or use a smaller file"
        ) from None
    except OverflowError as exc:
        raise CliError(
            f"{path}: a number in it is out of range (OverflowError: {exc}); the file is corrupt"
        ) from None


def open_trace(path: str, domains=None, experts: tuple[int, str] | None = None):
    """``--trace`` / a trace argument -> :class:`profiling.trace.RoutingTrace` (CliError when missing).

    A file that does not say how many experts the model has gets its count from ``experts``
    (``(E, what knows it)``: ``--model``, the placement), or else one warning that the count was
    inferred from the largest expert id (:meth:`~profiling.trace.RoutingTrace.with_expert_count`).
    """
    from profiling.readers import read_trace

    p = Path(path)
    if not p.exists():
        raise CliError(f"trace {p} does not exist")
    with reading(p):
        trace = read_trace(p, domains=domains)
    if experts is not None:
        try:
            return trace.with_expert_count(*experts)
        except ValueError as exc:
            raise CliError(f"{p}: {exc}") from None
    if trace.experts_inferred:
        warn(
            f"{p} does not say how many experts the model has: read as {trace.num_logical_experts} (its largest "
            f"expert id + 1); a model whose last experts were never picked has more: pass --model where the "
            f"command takes one, or a trace that records the count"
        )
    return trace


def model_arg(args: argparse.Namespace):
    """``--model`` as a :class:`~placement.cost.modelspec.ModelSpec` (None when not given), with
    ``--hidden-size`` (when the command has it) refused if it contradicts the model's own."""
    from placement.cost.modelspec import load_model

    if getattr(args, "model", None) is None:
        return None
    try:
        model = load_model(args.model)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    hidden = getattr(args, "hidden_size", None)
    if hidden is not None and hidden != model.hidden_size:
        raise CliError(
            f"--hidden-size {hidden} contradicts --model {args.model}, whose hidden size is {model.hidden_size}; "
            f"drop --hidden-size (the model gives it)"
        )
    return model


def open_load(path: str) -> np.ndarray:
    """``--load`` -> float64 ``[layers, experts]`` (an .npy, an .npz's ``counts``, or ``[W, L, E]`` summed
    over W), read without pickle and checked (:func:`profiling.readers.check_load`)."""
    from moe_placement.base.fileio import load_npy, load_npz
    from profiling.readers import check_load

    p = Path(path)
    if not p.exists():
        raise CliError(f"load file {p} does not exist")
    with reading(p):
        if p.suffix == ".npz":
            arrays = load_npz(p)
            keys = list(arrays)
            key = "counts" if "counts" in keys else (keys[0] if len(keys) == 1 else None)
            if key is None:
                raise CliError(
                    f"{p}: .npz with arrays {keys}; expected a 'counts' array [layers, experts] or one array"
                )
            arr = arrays[key]
        else:
            arr = load_npy(p)
        arr = check_load(arr, str(p))  # float64 [L, E] or [W, L, E]
    if arr.ndim == 3:
        arr = arr.sum(axis=0)  # [W, L, E] -> [L, E]
    return arr


def open_placement(path: str, *, engine_map: bool = False, warn_now: bool = True, **kw):
    """A placement file in any format :func:`placement.formats.read_placement` reads (CliError when missing).

    ``engine_map``: accept two replicas of one expert on one GPU (the engines' balancers write such
    maps), with one warning naming them and the SGLang hazard (``warn_now=False``: the caller warns
    with :func:`warn_colocated` once its own checks passed, so a refusal stays one line).
    """
    from placement.formats import read_placement

    p = Path(path)
    if not p.exists():
        raise CliError(f"placement file {p} does not exist")
    with reading(p):
        placement = read_placement(p, allow_colocated_replicas=engine_map, **kw)
    if engine_map and warn_now:
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
    if args.dispatch not in args.dispatch_choices:
        raise CliError(
            f"unknown dispatch model {args.dispatch!r}; use one of {', '.join(args.dispatch_choices)}"
        )
    return args.dispatch


class DeprecatedAlias(argparse.Action):
    """An old spelling of an option: stores like it, with one warning line on stderr.

    ``known``: the values the new option accepts; with it, an unknown value is stored without the
    warning, so the one error line of the new option's own check is all the user sees (exit 2).
    """

    def __init__(self, *args, new: str, known: Sequence[str] | None = None, **kwargs):
        self.new = new
        self.known = None if known is None else tuple(known)
        super().__init__(*args, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        _given(parser, namespace, self, values, option_string)  # with the new flag too: refused
        if self.known is None or values in self.known:
            namespace.__dict__.setdefault(_WARNINGS, []).append(
                f"{option_string} is deprecated; use {self.new}"
            )
        setattr(namespace, self.dest, values)


def hardware_help() -> str:
    """The GPU presets a ``--hardware`` flag takes, read from the registry (the default marked)."""
    from placement.cost.hardware import DEFAULT_HARDWARE, HARDWARE_NAMES

    names = ", ".join(f"{n} (default)" if n == DEFAULT_HARDWARE else n for n in HARDWARE_NAMES)
    return f"{names}, or a preset .json"


def link_names() -> str:
    """The link presets an ``--intra-link``/``--inter-link`` flag takes, read from the registry."""
    from placement.cost.hardware import LINKS

    return ", ".join(LINKS)


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    """``--nodes``, ``--gpus-per-node``, ``--hardware``, ``--intra-link``, ``--inter-link``: the cluster a
    plan is for (``layout``, ``plan``); names and defaults read from the registries."""
    from placement.cost.hardware import DEFAULT_HARDWARE

    p.add_argument("--nodes", type=ep_size_int, required=True, help="nodes in the cluster")
    p.add_argument("--gpus-per-node", type=ep_size_int, default=8)
    p.add_argument(
        "--hardware",
        default=DEFAULT_HARDWARE,
        help=f"GPU preset: {hardware_help()} (moe-placement calibrate: its measured links are priced unless "
        "--intra-link/--inter-link name others)",
    )
    p.add_argument(
        "--intra-link",
        default=None,
        help="intra-node link preset (default: the --hardware preset's measured intra link, else the GPU's "
        f"NVLink; one of {link_names()}); given, it wins over a measured one",
    )
    p.add_argument(
        "--inter-link",
        default=None,
        help="inter-node link preset (default: the --hardware preset's measured inter link, else rdma; one of "
        f"{link_names()}); given, it wins over a measured one",
    )


def model_help() -> str:
    """The built-in model names a ``--model`` flag takes, read from the registry."""
    from placement.cost.modelspec import BUILTIN_MODELS

    return f"a built-in name ({', '.join(BUILTIN_MODELS)}), a model JSON, or a HF config.json / folder"


def per_step_dispatch_names() -> str:
    """The per-step dispatch models (those that split each step's counts), from the registry."""
    from placement.dispatch import dispatch_names

    return ", ".join(dispatch_names(needs_step_counts=True))


def add_phase_args(p: argparse.ArgumentParser, what: str) -> None:
    """``--phase`` (default decode) and ``--step-tokens`` (default per phase, stated in the help);
    ``what``: what the steps are for, for the help text."""
    from placement.steps import DEFAULT_STEP_TOKENS, PHASES

    p.add_argument(
        "--phase",
        choices=PHASES,
        default=PHASES[0],
        help=f"step shape {what}: decode (each rank holds --step-tokens sequences in flight, one token of "
        "each per step, steady-state continuous batching) or prefill (chunks of --step-tokens consecutive "
        "tokens per rank); a trace that records the engine's batches is stepped by them (default decode)",
    )
    defaults = ", ".join(f"{k} {v}" for k, v in DEFAULT_STEP_TOKENS.items())
    p.add_argument(
        "--step-tokens",
        type=positive_int,
        default=None,
        help=f"tokens per rank per step (default by phase: {defaults}; the cap on a recorded engine batch)",
    )


def add_dispatch_args(
    p: argparse.ArgumentParser, *, choices: Sequence[str] | None = None, extra: str = ""
) -> None:
    """``--dispatch`` (``--policy``: its deprecated alias, which warns) and ``--source-ranks``.

    ``choices``: the names accepted (default: every model in :data:`placement.dispatch.DISPATCH`);
    the value lands in ``args.dispatch``.
    """
    from placement.dispatch import DISPATCH, EVEN

    names = tuple(choices or DISPATCH)
    metavar = "{" + ",".join(names) + "}"
    p.add_argument(
        "--dispatch",
        dest="dispatch",
        default=EVEN.name,
        metavar=metavar,
        help=f"how the engine picks a replica: {', '.join(DISPATCH)} (see docs/dispatch.md){extra}",
    )
    p.add_argument(
        "--policy",
        dest="dispatch",
        default=argparse.SUPPRESS,
        metavar=metavar,
        action=DeprecatedAlias,
        new="--dispatch",
        known=names,
        help=argparse.SUPPRESS,  # deprecated alias of --dispatch (docs/cli.md), hidden from --help
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


def check_writes(inputs: Sequence[str | Path | None], outputs: Sequence[str | Path | None]) -> None:
    """Refuse, before anything is read or written, an output that is an input (symlinks and hard links
    too), two outputs that are one file, and an output folder that is missing or not writable
    (:func:`moe_placement.base.fileio.check_outputs`; ``None`` entries skipped)."""
    from moe_placement.base.fileio import check_outputs

    check_outputs(inputs, outputs)


def input_sidecars(*paths: str | None) -> list[str]:
    """The inputs a placement file brings: the file itself and its sidecar ``<path>.meta.json``."""
    from placement.formats import sidecar_path

    out: list[str] = []
    for p in paths:
        if p is not None:
            out += [str(p), str(sidecar_path(p))]
    return out


def output_files(path: str | Path | None, fmt: str) -> list[Path]:
    """The files :func:`placement.formats.write_placement` writes for ``path`` in ``fmt``: the file and,
    for the engine formats, its sidecar (native placements carry their metadata inside)."""
    from placement.formats import FORMATS, check_output_name, sidecar_path

    if path is None:
        return []
    p = Path(path)
    check_output_name(p, fmt)  # before any work: a name that would not read back as fmt
    return [p] if fmt == FORMATS[0] else [p, sidecar_path(p)]


def check_folder_outputs(
    folder: str | Path, names: Sequence[str], inputs: Sequence[str | Path | None] = ()
) -> Path:
    """An output folder (claimed later by the command: :func:`moe_placement.base.folders.claim_folder`)
    and the files it will get: refused when it is a file, when no file can be created in it or in its
    nearest existing parent (a read-only file system too: a file is made and removed there), or when
    one of ``names`` in it is an input; the folder as a Path."""
    from moe_placement.base.fileio import check_writable_folder

    out = Path(folder)
    if out.exists() and not out.is_dir():
        raise CliError(f"output folder {out} exists and is not a folder; give a folder path")
    if out.is_dir():
        check_writes(inputs, [out / n for n in names])
        check_writable_folder(out, f"output folder {out}")
        return out
    parent = out.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise CliError(f"cannot create output folder {out}: {parent} is not a folder")
    check_writable_folder(parent, f"output folder {out}")
    return out


def source_ranks_file(spec: str | None) -> str | None:
    """``--source-ranks FILE.npy`` as a checked regular file (a FIFO or a folder is refused at once,
    instead of blocking the read); None for the named rules (round-robin, random[:SEED])."""
    from moe_placement.base.fileio import require_regular

    if spec is None:
        return None
    seed = spec.partition(":")[2] if spec.startswith("random:") else ""
    if spec in ("round-robin", "random") or seed.isdigit():
        return None
    if spec.startswith("random:"):
        raise CliError(f"--source-ranks {spec!r}: the seed after 'random:' must be a whole number")
    if not spec.endswith(".npy"):
        raise CliError(
            f"--source-ranks {spec!r} is not a rule or a rank file: use round-robin, random[:SEED] or FILE.npy"
        )
    require_regular(spec)
    return spec
