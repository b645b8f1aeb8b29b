"""Dispatch models: which replica of an expert serves a token, as each engine decides it.

The registry (:data:`DISPATCH`, :class:`DispatchModel`) lives in :mod:`placement.dispatch.registry`;
one module per family of models registers them:

- :mod:`placement.dispatch.ideal`: ``even`` and ``local`` (ideals our runtime executes);
- :mod:`placement.dispatch.sglang`: ``sglang-static`` and ``sglang-dynamic`` (SGLang 0.5.23, DeepEP);
- :mod:`placement.dispatch.vllm`: ``vllm-hash`` (vLLM 0.33 EPLB);
- :mod:`placement.dispatch.sglang_lp`: ``sglang-lp`` (SGLang 0.5.23 LPLB, per-step LP shares);
- :mod:`placement.dispatch.balanced`: ``balanced`` (ours: per-step integer quotas, runtime-executable).

TensorRT-LLM's wide-EP balancer is not modelled: see ``docs/dispatch.md``. Adding a model: a module
here that registers a :class:`DispatchModel`, imported below.

Shapes: L layers, E logical experts, P physical slots, G EP ranks, R most replicas, T tokens, k top-k.
"""

from __future__ import annotations

import numpy as np

from placement.dispatch.balanced import BALANCED
from placement.dispatch.ideal import EVEN, LOCAL
from placement.dispatch.registry import (
    DISPATCH,
    DispatchModel,
    check_dispatch,
    dispatch_names,
    get_dispatch,
    register,
)
from placement.dispatch.sglang import (
    SGLANG_DYNAMIC,
    SGLANG_STATIC,
    SGLANG_STATIC_SEED,
    layer_draws,
    nearest_in_row,
    nearest_replica,
    sglang_static_tables,
)
from placement.dispatch.sglang_lp import SGLANG_LP, lp_shares
from placement.dispatch.vllm import VLLM_HASH, VLLM_HASH_MULTIPLIER, vllm_hash_replica
from placement.model import Placement

__all__ = [
    "BALANCED",
    "DISPATCH",
    "EVEN",
    "LOCAL",
    "SGLANG_DYNAMIC",
    "SGLANG_LP",
    "SGLANG_STATIC",
    "SGLANG_STATIC_SEED",
    "VLLM_HASH",
    "VLLM_HASH_MULTIPLIER",
    "DispatchModel",
    "check_dispatch",
    "dispatch_names",
    "get_dispatch",
    "layer_draws",
    "lp_shares",
    "nearest_in_row",
    "nearest_replica",
    "rank_choices",
    "register",
    "route_layer",
    "sglang_static_tables",
    "vllm_hash_replica",
]


def rank_choices(
    placement: Placement, layer: int, dispatch: str | DispatchModel
) -> tuple[np.ndarray, np.ndarray]:
    """Where rank ``g``'s tokens for expert ``e`` go, in expectation, for one layer.

    Returns:
        ``(slots int64 [G, E, R], weights float64 [G, E, R])``: slot ids (-1 padded) and the share of
        the tokens each receives (rows sum to 1). ``vllm-hash`` is even in expectation.
    """
    return get_dispatch(dispatch).choices(placement, layer)


def route_layer(
    placement: Placement,
    layer: int,
    ids: np.ndarray,
    src: np.ndarray,
    dispatch: str | DispatchModel,
    batch_index: np.ndarray | None = None,
    rng: np.random.Generator | None = None,
) -> np.ndarray:
    """Token-level slot choice of one layer under a model routed token by token.

    Args:
        ids: int ``[T, k]`` logical ids (-1: none); src: int64 ``[T]`` source rank of each token.
        dispatch: a model with a token-level ``route`` (``sglang-static``, ``sglang-dynamic``: needs
            ``rng``; ``vllm-hash``: needs ``batch_index``, int64 ``[T]``, each token's row in its
            rank's forward batch).

    Returns:
        int64 ``[T, k]`` physical slots, -1 where the id was -1.
    """
    model = get_dispatch(dispatch)
    if model.route is None:
        raise ValueError(f"route_layer models the engines' token-level rules, not {model.name!r}")
    valid = ids >= 0
    # a per-step split counts only real picks, so its route sees the -1s; the others index with them
    e = np.where(valid | model.needs_step_counts, ids, 0).astype(np.int64)  # [T, k]
    out = model.route(placement, layer, e, np.asarray(src, dtype=np.int64), batch_index, rng)
    return np.where(valid, out, -1)
