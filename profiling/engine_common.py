"""Shared pieces of the engine-dump readers: safe loading, field checks, physical -> logical conversion.

Shapes: H = hidden layers (the engine's layer axis), L = MoE layers, E = logical experts,
P = physical slots, T = tokens, k = top-k. Public names are re-exported by
:mod:`profiling.engine_readers`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from moe_placement.base.fileio import (
    DEFAULT_MAX_ARRAY_BYTES,
    InputFileError,
    require_regular,
    safe_torch_load,
)
from moe_placement.base.limits import MAX_EXPERTS

__all__ = ["MAX_DUMP_BYTES", "physical_to_logical_counts", "physical_to_logical_ids"]

MAX_DUMP_BYTES = DEFAULT_MAX_ARRAY_BYTES


# ---------------------------------------------------------------------------------------------
# physical -> logical
# ---------------------------------------------------------------------------------------------


def physical_to_logical_counts(
    physical_count: np.ndarray, physical_to_logical_map: np.ndarray, num_logical_experts: int
) -> np.ndarray:
    """Fold per-slot counts into per-expert counts (scatter-add over each expert's replicas).

    Args:
        physical_count: ``[..., L, P]`` tokens per physical slot (ints or floats, >= 0).
        physical_to_logical_map: int ``[L, P]``, ids in ``[0, E)``.
        num_logical_experts: ``E``.

    Returns:
        ``[..., L, E]`` (int64 for integer input, else float64).
    """
    pc = np.asarray(physical_count)
    p2l = np.asarray(physical_to_logical_map, dtype=np.int64)
    L, P = p2l.shape
    E = int(num_logical_experts)
    if pc.shape[-2:] != (L, P):
        raise ValueError(f"physical counts have shape {pc.shape}, expected [..., {L}, {P}] to match the map")
    lead = pc.shape[:-2]
    flat = pc.reshape(-1, L * P)  # [N, L*P]
    dtype = np.int64 if pc.dtype.kind in "iub" else np.float64
    out = np.zeros((flat.shape[0], L * E), dtype=dtype)  # [N, L*E]
    index = (np.arange(L, dtype=np.int64)[:, None] * E + p2l).ravel()  # [L*P] flat (layer, expert)
    np.add.at(out, (slice(None), index), flat.astype(dtype))  # type: ignore[arg-type]
    return out.reshape(*lead, L, E)


def physical_to_logical_ids(ids: np.ndarray, physical_to_logical_map: np.ndarray) -> np.ndarray:
    """Map physical slot ids to logical expert ids, layer by layer; ``-1`` stays ``-1``.

    Args:
        ids: int ``[L, T, k]`` physical slot ids in ``[-1, P)``.
        physical_to_logical_map: int ``[L, P]``.

    Returns:
        int32 ``[L, T, k]`` logical ids, ``-1`` where the input was ``-1``.
    """
    ids = np.asarray(ids, dtype=np.int64)
    p2l = np.asarray(physical_to_logical_map, dtype=np.int64)
    layer = np.arange(p2l.shape[0])[:, None, None]  # [L, 1, 1]
    out = p2l[layer, np.maximum(ids, 0)]  # [L, T, k]
    return np.where(ids >= 0, out, -1).astype(np.int32)


# ---------------------------------------------------------------------------------------------
# safe loading helpers
# ---------------------------------------------------------------------------------------------


def _check_size(p: Path, limit: int = MAX_DUMP_BYTES) -> None:
    require_regular(p)
    size = p.stat().st_size
    if size > limit:
        raise InputFileError(
            f"{p}: {size / 1e9:.1f} GB is over the {limit / 1e9:.1f} GB limit for an engine dump"
        )


def _torch_load(p: Path):
    return safe_torch_load(p, MAX_DUMP_BYTES, "SGLang .pt dumps")


def _safetensors_load(p: Path) -> dict[str, np.ndarray]:
    _check_size(p)
    try:
        from safetensors.numpy import load_file
    except ImportError:  # pragma: no cover - optional extra
        raise InputFileError(
            f"{p}: reading .safetensors needs the safetensors package (pip install safetensors)"
        ) from None
    try:
        return load_file(str(p))
    except Exception as exc:  # noqa: BLE001 - SafetensorError, dtype not supported by numpy, ...
        raise InputFileError(f"{p}: not a readable safetensors file ({type(exc).__name__}: {exc})") from None


def _array(p: Path, value, field: str, ndim: int | tuple[int, ...], kinds: str = "iu") -> np.ndarray:
    """A tensor/list field as a numpy array of the given rank(s) and dtype kind."""
    ndims = (ndim,) if isinstance(ndim, int) else tuple(ndim)
    if hasattr(value, "detach") and hasattr(value, "numpy"):  # torch tensor
        try:
            value = value.detach().cpu().numpy()
        except (TypeError, RuntimeError) as exc:  # e.g. bfloat16
            raise InputFileError(f"{p}: field {field!r} has an unsupported tensor dtype ({exc})") from None
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError):
        arr = None
    if arr is None or arr.ndim not in ndims or arr.dtype.kind not in kinds:
        got = (
            "ragged or non-numeric data" if arr is None or arr.dtype == object else f"{arr.dtype} {arr.shape}"
        )
        kind = "integer" if kinds == "iu" else "numeric"
        rank = " or ".join(f"{n}-D" for n in ndims)
        raise InputFileError(f"{p}: field {field!r} must be a {rank} {kind} array, got {got}")
    if arr.dtype.kind == "f" and not np.all(np.isfinite(arr)):
        raise InputFileError(f"{p}: field {field!r} contains NaN or inf")
    return arr


def _int(p: Path, obj: dict, key: str, where: str = "") -> int:
    v = obj.get(key) if isinstance(obj, dict) else None
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise InputFileError(f"{p}: {where}field {key!r} must be an integer, got {v!r:.60}")
    return int(v)


def _check_map(p: Path, p2l: np.ndarray, E: int | None, field: str) -> int:
    """Validate a physical->logical map and return ``E``."""
    lo, hi = int(p2l.min()), int(p2l.max())
    if lo < 0:
        raise InputFileError(f"{p}: field {field!r} holds expert id {lo}; ids must be >= 0")
    if hi >= MAX_EXPERTS:
        raise InputFileError(
            f"{p}: field {field!r} holds expert id {hi}, outside the accepted range 0..{MAX_EXPERTS - 1} "
            f"(MAX_EXPERTS); the dump is corrupt or not from a supported engine"
        )
    if E is None:
        return hi + 1
    if hi >= E:
        raise InputFileError(
            f"{p}: field {field!r} holds expert id {hi} but num_logical_experts={E}; pass the model's real expert count"
        )
    return int(E)


def _moe_rows(p: Path, active: np.ndarray, moe_layer_ids: Sequence[int] | None, what: str) -> list[int]:
    """Rows of the engine's hidden-layer axis to keep: ``moe_layer_ids`` or the rows with any load."""
    H = active.shape[0]
    if moe_layer_ids is not None:
        ids = [int(i) for i in moe_layer_ids]
        bad = [i for i in ids if not 0 <= i < H]
        if bad:
            raise InputFileError(
                f"{p}: moe_layer_ids {bad} are outside the dump's {H} layer rows (0..{H - 1})"
            )
        if len(set(ids)) != len(ids) or not ids:
            raise InputFileError(f"{p}: moe_layer_ids must be distinct and non-empty, got {ids}")
        return ids
    rows = [int(i) for i in np.flatnonzero(active)]
    if not rows:
        raise InputFileError(
            f"{p}: the {what} holds no routed tokens in any of its {H} layer rows; record some traffic, or pass "
            f"moe_layer_ids to keep the (empty) MoE rows"
        )
    return rows


def _pick(p: Path, layers: list[int], moe_layer_ids) -> list[int]:
    """Layer ids to keep: ``moe_layer_ids`` (each must be one of ``layers``), else all ``layers``."""
    if moe_layer_ids is None:
        return layers
    ids = [int(i) for i in moe_layer_ids]
    missing = [i for i in ids if i not in layers]
    if missing:
        raise InputFileError(f"{p}: moe_layer_ids {missing} are not in the dump (it has layers {layers})")
    return ids
