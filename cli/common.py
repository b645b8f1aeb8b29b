"""Helpers shared by the CLI subcommand modules (printing lives only in the CLI layer)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")

__all__ = ["CliError", "progress", "echo", "warn"]


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
