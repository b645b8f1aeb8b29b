"""Helpers shared by the CLI subcommand modules (printing lives only in the CLI layer)."""

from __future__ import annotations

import sys
import time
from typing import Iterable, Iterator, TypeVar

T = TypeVar("T")

__all__ = ["CliError", "progress", "echo", "warn"]


class CliError(ValueError):
    """Bad input detected by the CLI: printed as one line, exit code 2."""


def echo(*parts, file=None) -> None:
    print(*parts, file=file or sys.stdout)


def warn(msg: str) -> None:
    print(f"moe-placement: warning: {msg}", file=sys.stderr)


def progress(items: Iterable[T], total: int | None = None, desc: str = "", min_seconds: float = 2.0) -> Iterator[T]:
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
                sys.stderr.write(f"\r{desc} [{'#' * fill}{'.' * (width - fill)}] {done}/{total} {time.perf_counter() - start:.0f}s")
            else:
                sys.stderr.write(f"\r{desc} {done} {time.perf_counter() - start:.0f}s")
            sys.stderr.flush()
    if shown:
        sys.stderr.write("\n")
