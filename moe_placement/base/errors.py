"""The project's one exception family, exported from here.

Every error the package raises on purpose derives from :class:`MoePlacementError` and from the builtin
a caller already catches (as networkx's exceptions do), so ``except MoePlacementError`` catches all of
ours and ``except ValueError`` still catches bad input:

=====================  ============================  =================================================
class                  builtin it also derives from  raised when
=====================  ============================  =================================================
``InputFileError``     ``ValueError``                a file cannot be read as the expected format
``CliError``           ``ValueError``                the CLI finds bad input (one line, exit code 2)
``SpecError``          ``ValueError``                ``MOE_PLACEMENT_EPLB`` is malformed
``EngineCallError``    ``ValueError``                an engine hook cannot answer a call (the engine
                                                     then runs its own algorithm)
``WorkerError``        ``RuntimeError``              a launched rank raised
``WorkerTimeout``      ``TimeoutError``              launched ranks did not finish in time
=====================  ============================  =================================================

The classes stay importable where callers found them before (``moe_placement.base.fileio.InputFileError``,
``moe_placement.cli.common.CliError``, ``runtime_hooks.launcher.WorkerError`` ...): those modules re-export these.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "CliError",
    "EngineCallError",
    "InputFileError",
    "MoePlacementError",
    "SpecError",
    "WorkerError",
    "WorkerTimeout",
]


class MoePlacementError(Exception):
    """The base of every exception the package raises on purpose."""


class InputFileError(MoePlacementError, ValueError):
    """A file could not be read as the expected format. The message names the file and the field."""


class CliError(MoePlacementError, ValueError):
    """Bad input detected by the CLI: printed as one line, exit code 2."""


class SpecError(MoePlacementError, ValueError):
    """A malformed ``MOE_PLACEMENT_EPLB`` value; its message is one line naming the accepted specs."""


class EngineCallError(MoePlacementError, ValueError):
    """Our engine hook cannot answer this call (the hook then runs the engine's own algorithm). The
    engine plugins, where the engines call their hook a policy, import it as ``PolicyError``."""


class WorkerError(MoePlacementError, RuntimeError):
    """A rank raised; ``.rank`` and ``.remote_traceback`` say which and where."""

    def __init__(self, rank: int, remote_traceback: str):
        self.rank = rank
        self.remote_traceback = remote_traceback
        super().__init__(f"rank {rank} failed:\n{remote_traceback}")


class WorkerTimeout(MoePlacementError, TimeoutError):
    """Some ranks did not finish in time; ``.ranks`` lists them."""

    def __init__(self, ranks: Sequence[int], timeout: float):
        self.ranks = list(ranks)
        super().__init__(
            f"ranks {self.ranks} did not finish within {timeout:.1f} s; all workers were terminated "
            f"(raise timeout= if the work is simply slow)"
        )
