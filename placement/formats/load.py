"""Placement files in: safe loading, field checks and format detection (see :mod:`placement.formats`).

All input is loaded safely after a size check, from regular files only (a FIFO or a device is refused
at once): JSON and YAML through :mod:`moe_placement.base.textparse` (duplicate keys refused, YAML alias expansion
bounded, no ``!!python`` tags), ``.pt`` with ``torch.load(weights_only=True)``. Layer ids are bounded by
:data:`moe_placement.base.limits.MAX_LAYER_ID`. Malformed content raises :class:`~moe_placement.base.fileio.InputFileError`
naming the file, the field and the expected form.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from moe_placement.base.fileio import InputFileError, read_regular_bytes, require_regular, safe_torch_load
from moe_placement.base.limits import MAX_LAYER_ID, check_layer_ids
from moe_placement.base.textparse import parse_json, parse_yaml
from placement.formats.spec import _PT_SUFFIXES, _YAML_SUFFIXES, PLACEMENT_SCHEMA, VLLM_RECORD_TYPE

__all__ = ["MAX_PT_BYTES", "MAX_TEXT_BYTES", "detect_format"]

# Refuse input files above these sizes before parsing them.
MAX_TEXT_BYTES = 512 * 1024**2
MAX_PT_BYTES = 2 * 1024**3


def _read_text(p: Path, data: bytes | None = None) -> str:
    if data is None:
        data = read_regular_bytes(p, MAX_TEXT_BYTES, "a placement file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputFileError(f"{p}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def _parse_json(p: Path, text: str):
    return parse_json(text, str(p))


def _parse_yaml(p: Path, text: str):
    return parse_yaml(text, str(p))


def _load_pt(p: Path, data: bytes | None = None):
    return safe_torch_load(p, MAX_PT_BYTES, "a .pt placement", data=data)


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _int_field(p: Path, obj: Mapping, key: str, where: str = "") -> int:
    if key not in obj:
        raise InputFileError(f"{p}: {where}missing field {key!r}; expected an integer")
    v = obj[key]
    if not _is_int(v):
        raise InputFileError(f"{p}: {where}field {key!r} must be an integer, got {v!r:.60}")
    return int(v)


def _int_matrix(p: Path, obj, field: str) -> np.ndarray:
    """A nested list (or tensor) of integers as int64 ``[rows, cols]``."""
    if hasattr(obj, "numpy") and hasattr(obj, "dtype"):  # a torch tensor from a .pt file
        obj = obj.detach().cpu().numpy()
    try:
        arr = np.asarray(obj)
    except (ValueError, TypeError):
        arr = None
    if arr is None or arr.ndim != 2 or arr.dtype.kind not in "iu" or arr.shape[1] == 0:
        desc = "ragged or mixed rows" if arr is None or arr.dtype == object else f"{arr.dtype} {arr.shape}"
        raise InputFileError(
            f"{p}: field {field!r} must be a 2-D array of integer expert ids [layers, slots], got {desc}"
        )
    return arr.astype(np.int64)


def _int_list(p: Path, obj, field: str, length: int | None = None) -> np.ndarray:
    if not isinstance(obj, list) or not all(_is_int(x) for x in obj):
        raise InputFileError(
            f"{p}: field {field!r} must be a list of integer expert ids, got {str(obj)[:60]}"
        )
    if length is not None and len(obj) != length:
        raise InputFileError(f"{p}: field {field!r} has {len(obj)} entries, expected {length}")
    return np.asarray(obj, dtype=np.int64)


def _layer_key(p: Path, key, field: str) -> int:
    if _is_int(key) or isinstance(key, str) and key.strip().isdigit():
        k = int(key)
    else:
        raise InputFileError(
            f"{p}: field {field!r} has key {key!r}; expected a non-negative integer layer id"
        )
    if k < 0:
        raise InputFileError(f"{p}: field {field!r} has layer id {k}; expected >= 0")
    if k > MAX_LAYER_ID:
        raise InputFileError(
            f"{p}: field {field!r} has layer id {k}, outside the accepted range 0..{MAX_LAYER_ID} "
            f"(MAX_LAYER_ID); layer ids are the model's layer indices"
        )
    return k


def _opt_int_list(p: Path, obj: Mapping, key: str) -> list[int] | None:
    if key not in obj or obj[key] is None:
        return None
    v = obj[key]
    if not isinstance(v, list) or not all(_is_int(x) for x in v):
        raise InputFileError(f"{p}: field {key!r} must be a list of integers, got {str(v)[:60]}")
    return [int(x) for x in v]


def _layer_id_list(p: Path, obj: Mapping, key: str) -> list[int] | None:
    """An optional list of layer ids: integers in ``0..MAX_LAYER_ID``, each once."""
    ids = _opt_int_list(p, obj, key)
    if ids is not None:
        try:
            check_layer_ids(ids, f"field {key!r}", str(p))
        except ValueError as exc:
            raise InputFileError(str(exc)) from None
    return ids


# ---------------------------------------------------------------------------------------------
# format detection
# ---------------------------------------------------------------------------------------------


def _format_of(doc) -> str | None:
    if not isinstance(doc, dict):
        return None
    if doc.get("schema") == PLACEMENT_SCHEMA:
        return "native"
    if doc.get("record_type") == VLLM_RECORD_TYPE:
        return "vllm"
    if "layer_list" in doc or "moe_layer_count" in doc:
        return "vllm-ascend"
    if "physical_to_logical_map" in doc or "logical_count" in doc:
        return "sglang"
    if "initial_global_assignments" in doc or "num_slots" in doc:
        return "trtllm"
    return None


def _load_any(p: Path) -> tuple[Any, str]:
    """Load a placement file safely; return ``(content, kind)`` with kind ``json``/``yaml``/``pt``."""
    doc, kind, _ = load_with_digest(p)
    return doc, kind


def load_with_digest(p: Path) -> tuple[Any, str, str]:
    """``(content, kind, sha256 hex of the bytes parsed)``: the file is read once, so the digest is
    that of the content returned even while another process replaces the file."""
    require_regular(p)
    pt = p.suffix in _PT_SUFFIXES
    data = read_regular_bytes(
        p, MAX_PT_BYTES if pt else MAX_TEXT_BYTES, "a .pt placement" if pt else "a placement file"
    )
    digest = hashlib.sha256(data).hexdigest()
    if pt:
        return _load_pt(p, data), "pt", digest
    text = _read_text(p, data)
    if p.suffix in _YAML_SUFFIXES:
        return _parse_yaml(p, text), "yaml", digest
    if p.suffix == ".json" or text.lstrip()[:1] in ("{", "["):
        return _parse_json(p, text), "json", digest
    return _parse_yaml(p, text), "yaml", digest


def detect_format(path: str | os.PathLike) -> str:
    """The placement format of a file, from its content (and ``.pt`` suffix)."""
    p = Path(path)
    doc, _ = _load_any(p)
    fmt = _format_of(doc)
    if fmt is None:
        raise InputFileError(_unknown_msg(p, doc))
    return fmt


def _unknown_msg(p: Path, doc) -> str:
    keys = sorted(map(str, doc))[:8] if isinstance(doc, dict) else type(doc).__name__
    return (
        f"{p}: not a placement file in any known format (found {keys}); expected native "
        f"(schema {PLACEMENT_SCHEMA!r}), sglang (physical_to_logical_map), trtllm (num_slots, "
        f"initial_global_assignments), vllm-ascend (moe_layer_count, layer_list) or vllm "
        f"(record_type {VLLM_RECORD_TYPE!r})"
    )
