"""Torch expert-parallel runtime, weight migration and the online rebalancing hook.

Importing this package is cheap: names resolve lazily on first use, and nothing on the serving path
imports ortools or networkx (the rebalancer loads the solver inside its worker only).

- :class:`runtime_hooks.ep_layer.EPMoELayer`: an expert-parallel MoE layer applying a ``Placement``.
- :func:`runtime_hooks.launcher.launch`: run a function on N spawned ranks (gloo or NCCL).
- :func:`runtime_hooks.validate.validate_placement`: outputs, checksums and per-rank tokens vs prediction.
- :class:`runtime_hooks.migration_core.MigrationResult`: what an atomic migration moved (both runtimes).
- :class:`runtime_hooks.rebalancer.Rebalancer`: windowed loads, trigger policy, off-thread re-solve.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "EPMoELayer": "runtime_hooks.ep_layer",
    "launch": "runtime_hooks.launcher",
    "MigrationResult": "runtime_hooks.migration_core",
    "validate_placement": "runtime_hooks.validate",
    "Rebalancer": "runtime_hooks.rebalancer",
    "RebalancerConfig": "runtime_hooks.rebalancer",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'runtime_hooks' has no attribute {name!r}")
