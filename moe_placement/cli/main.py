"""The ``moe-placement`` command line (also ``python -m moe_placement``): the parser and the dispatcher.

The top floor: it imports every package; nothing imports it. Each sub-command lives in a module of its
own with ``add_parser(subparsers)`` and a command function (``moe_placement.cli.inspect_trace``, ``moe_placement.cli.solve``,
``moe_placement.cli.evaluate``, ``moe_placement.cli.convert``, ``moe_placement.cli.demo``; the optional ``moe_placement.cli.profile``, ``moe_placement.cli.validate`` and
``moe_placement.cli.layout``). Bad input ends with one line on stderr and exit code 2; ``--debug`` shows tracebacks.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence

from moe_placement.cli import convert, demo, evaluate, inspect_trace, solve
from moe_placement.cli.common import root_parser
from moe_placement.cli.convert import cmd_convert
from moe_placement.cli.demo import cmd_demo
from moe_placement.cli.evaluate import cmd_evaluate
from moe_placement.cli.inspect_trace import cmd_inspect
from moe_placement.cli.solve import cmd_solve

__all__ = [
    "build_parser",
    "cmd_convert",
    "cmd_demo",
    "cmd_evaluate",
    "cmd_inspect",
    "cmd_solve",
    "main",
]

# Built-in subcommands, in the order ``--help`` lists them.
_COMMANDS = (inspect_trace, solve, evaluate, convert, demo)
# Subcommands owned by optional modules: each exposes add_parser(subparsers) and run(args).
_EXTENSIONS = (
    "moe_placement.cli.profile",
    "moe_placement.cli.validate",
    "moe_placement.cli.layout",
    "moe_placement.cli.serve_demo",
    "moe_placement.cli.advise",
    "moe_placement.cli.calibrate",
    "moe_placement.cli.plan",
    "moe_placement.cli.route",
)


def build_parser() -> argparse.ArgumentParser:
    """The full parser: ``--debug``, the built-in sub-commands, then the installed extensions."""
    ap, sub = root_parser()
    for command in _COMMANDS:
        command.add_parser(sub)
    for modname in _EXTENSIONS:
        if importlib.util.find_spec(modname) is None:
            continue
        importlib.import_module(modname).add_parser(sub)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the sub-command; the exit code.

    0: done; 1: a bug (or a failed check, per command); 2: bad input; 130: interrupted (Ctrl-C at
    any point: outputs are written atomically, so nothing is left half-written); 143: SIGTERM (the
    same clean-up); 141: stdout closed early (``| head``), silently.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    logging.basicConfig(
        level=logging.DEBUG if debug else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    with _terminate_as_exception():
        return _run(argv, debug)


class Terminated(BaseException):
    """SIGTERM arrived: unwinds like Ctrl-C, so temporary files are removed and outputs stay whole."""


@contextlib.contextmanager
def _terminate_as_exception() -> Iterator[None]:
    """While a command runs, SIGTERM raises :class:`Terminated` (where Python's default would die at
    once and leave temporary files); only from the main thread and when no handler is installed."""
    installed = threading.current_thread() is threading.main_thread() and (
        signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    )

    def handler(signum, frame):
        _stop_searches()
        raise Terminated()

    if installed:
        signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        if installed:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _stop_searches() -> None:
    """Stop every CP-SAT search running now (any thread) and make later ones refuse to start, as
    Ctrl-C does (``solver.search.interrupt_solves``), so SIGTERM does not wait for a solve to
    reach its time limit. Nothing is imported here: no solver module loaded, no search running."""
    search = sys.modules.get("solver.search")
    stop = getattr(search, "interrupt_solves", None)
    if stop is not None:
        stop()


def _run(argv: list[str], debug: bool) -> int:
    """Parse and run; every outcome as an exit code (see :func:`main`)."""
    try:
        args = build_parser().parse_args(argv)
        rc = int(args.func(args) or 0)
        sys.stdout.flush()  # here, not at exit: a reader that stopped early is seen below
        return rc
    except BrokenPipeError:  # `moe-placement inspect T | head -1`: the reader has all it wanted
        _silence_stdout()
        return 141  # 128 + SIGPIPE, what a shell tool killed by the closed pipe returns
    except Terminated:
        print("moe-placement: terminated (SIGTERM); nothing half-written is left", file=sys.stderr)
        return 143
    except SystemExit as exc:  # argparse: --help (0) or a bad flag (2, its one line already printed)
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    except KeyboardInterrupt:
        print("moe-placement: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if debug:
            raise
        return _report(exc)


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's last flush does not fail on the closed pipe."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


# Errors that bad input raises past the readers: one line and exit code 2, like a ValueError.
_INPUT_LIMITS = {
    RecursionError: "the input is nested too deeply",
    MemoryError: "the input does not fit in memory",
    OverflowError: "a number in the input is out of range",
}


def _report(exc: Exception) -> int:
    """One stderr line for ``exc``; its exit code (2: bad input, 1: a bug)."""
    msg = " ".join(str(exc).split())
    for kind, what in _INPUT_LIMITS.items():
        if isinstance(exc, kind):
            detail = f" ({msg[:200]})" if msg else ""
            print(f"moe-placement: error: {what}: {kind.__name__}{detail}", file=sys.stderr)
            return 2
    if isinstance(exc, (ValueError, OSError)):  # CliError, InputFileError and bad-input ValueErrors
        print(f"moe-placement: error: {msg or type(exc).__name__}", file=sys.stderr)
        return 2
    print(
        f"moe-placement: internal error: {type(exc).__name__}: {msg} (rerun with --debug for the traceback)",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
