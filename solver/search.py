"""Running a CP-SAT search so that Ctrl-C and SIGTERM stop it at once (every CP-SAT call of the project).

OR-Tools' own SIGINT handler is never installed (``catch_sigint_signal = False``; with it, a Ctrl-C
during a solve in a worker thread aborted the process with ``std::bad_function_call``). A solve on the
main thread runs in a helper thread while the main thread waits interruptibly, so Ctrl-C stops the
search at once and reaches Python as ``KeyboardInterrupt``; solves in worker threads are stopped by
:func:`interrupt_solves` (Ctrl-C, or the CLI's SIGTERM handler) and then raise ``KeyboardInterrupt``
themselves. No OR-Tools import here: the solver objects come from the callers.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["interrupt_solves", "reset_interrupt", "run_solve"]


_ACTIVE: set = set()  # solvers searching now (any thread)
_ACTIVE_LOCK = threading.Lock()
_INTERRUPTED = threading.Event()  # set by Ctrl-C on the main thread until the next solve starts


def reset_interrupt() -> None:
    """Forget an earlier Ctrl-C (called when a new solve starts)."""
    _INTERRUPTED.clear()


def interrupt_solves() -> None:
    """Ctrl-C on the main thread: stop every running search; later solves raise ``KeyboardInterrupt``."""
    _INTERRUPTED.set()
    with _ACTIVE_LOCK:
        for solver in list(_ACTIVE):
            solver.stop_search()


def run_solve(solver: Any, model: Any) -> Any:
    """``solver.solve(model)`` (its status) with Ctrl-C delivered as ``KeyboardInterrupt``.

    On the main thread the search runs in a helper thread while the main thread waits on an Event
    (interruptible), so the signal is handled at once; on a worker thread it runs in place and raises
    after a stop by :func:`interrupt_solves`.
    """
    if _INTERRUPTED.is_set():
        raise KeyboardInterrupt
    solver.parameters.catch_sigint_signal = False
    with _ACTIVE_LOCK:
        _ACTIVE.add(solver)
    try:
        if threading.current_thread() is not threading.main_thread():
            status = solver.solve(model)
            if _INTERRUPTED.is_set():
                raise KeyboardInterrupt
            return status
        box: dict[str, Any] = {}
        done = threading.Event()

        def search() -> None:
            try:
                box["status"] = solver.solve(model)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                box["error"] = exc
            finally:
                done.set()

        helper = threading.Thread(target=search, name="cpsat-solve", daemon=True)
        helper.start()
        # wait on an Event, not on helper.join(): a join interrupted by Ctrl-C leaves the thread
        # half-finished and the interpreter aborts at exit
        try:
            while not done.wait(0.1):
                pass
        except KeyboardInterrupt:
            interrupt_solves()
            done.wait()
            helper.join()
            raise
        helper.join()
        if "error" in box:
            raise box["error"]
        return box["status"]
    finally:
        with _ACTIVE_LOCK:
            _ACTIVE.discard(solver)
