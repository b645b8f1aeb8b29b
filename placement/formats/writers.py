"""Write placements in the engines' formats and the project's own JSON (see :mod:`placement.formats`).

Every file's bytes are built first and then written atomically (temporary file + rename), so a failure
leaves existing files untouched. Shapes: L = MoE layers, P = physical slots, H = hidden layers,
G = EP ranks, S = slots per GPU, E = logical experts.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from moe_placement.base.fileio import atomic_write_files
from placement.formats.spec import (
    _PT_SUFFIXES,
    FORMATS,
    PLACEMENT_SCHEMA,
    PLACEMENT_SCHEMA_VERSION,
    SIDECAR_SCHEMA,
    VLLM_RECORD_TYPE,
    VLLM_RECORD_VERSION,
    check_output_name,
    sidecar_path,
)
from placement.model import Placement, hidden_layer_rows, validate_map

__all__ = ["placement_files", "write_placement"]

# The public logger name of the formats (the CLI's log format shows it), kept from before the split.
logger = logging.getLogger("placement.formats")


def _jsonable(obj: Any) -> Any:
    """Provenance values as plain JSON types (numpy scalars/arrays to Python, the rest to str)."""
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return _jsonable(obj.tolist())
    if isinstance(obj, np.generic):
        return obj.item()
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return str(obj)


def _rows_json(key: str, rows: np.ndarray) -> str:
    """``{"key": [[...], ...]}`` with one row per line (readable diffs, ints only)."""
    body = ",\n".join(json.dumps([int(x) for x in row]) for row in rows)
    return "{" + json.dumps(key) + ": [\n" + body + "\n]}\n"


def _checked(placement: Placement) -> np.ndarray:
    """Re-validate before writing: a file is only ever written for a valid placement."""
    if not isinstance(placement, Placement):
        raise ValueError(f"write_placement needs a Placement, got {type(placement).__name__}")
    return validate_map(
        placement.physical_to_logical_map,
        placement.num_logical_experts,
        placement.topology,
        allow_colocated_replicas=placement.allow_colocated_replicas,
    )


def _metadata(placement: Placement, fmt: str, path: Path, **extra) -> dict:
    meta = {
        "schema": SIDECAR_SCHEMA,
        "schema_version": PLACEMENT_SCHEMA_VERSION,
        "format": fmt,
        "file": path.name,
        "num_logical_experts": placement.num_logical_experts,
        "layer_ids": list(placement.layer_ids),
        "topology": placement.topology.to_dict(),
        "allow_colocated_replicas": bool(placement.allow_colocated_replicas),
        "provenance": _jsonable(placement.provenance),
    }
    meta.update(extra)
    return meta


def write_placement(
    placement: Placement,
    path: str | os.PathLike,
    format: str = "native",
    *,
    num_hidden_layers: int | None = None,
) -> list[Path]:
    """Write ``placement`` in an engine's format (atomically) and return every file written.

    Args:
        placement: the placement (re-validated before anything is written).
        path: the main output file. Engine formats also get the sidecar ``<path>.meta.json``, which
            records the map's SHA-256 (``file_sha256``); the two are published together.
        format: one of :data:`FORMATS`. ``sglang`` writes ``torch.save`` output when ``path``
            ends in ``.pt``/``.pth`` and JSON otherwise.
        num_hidden_layers: ``sglang`` only: the model's ``config.num_hidden_layers`` ``H`` (the
            file has ``H`` rows; rows of dense layers hold the trivial map ``p % E``). Default
            ``max(layer_ids) + 1``.

    Returns:
        ``[main file]`` or ``[main file, sidecar]``.

    Raises:
        ValueError: unknown format, invalid placement, ``num_hidden_layers`` too small, a file name
            that would not read back as ``format`` (``.pt`` other than sglang, trtllm as ``.json``), or the
            output folder missing (:class:`~moe_placement.base.fileio.InputFileError`). Nothing is written
            then, and existing files keep their content.
    """
    # Build every file's bytes first, so a failure leaves the disk untouched.
    files = placement_files(placement, path, format, num_hidden_layers=num_hidden_layers)
    atomic_write_files(files)  # the map and its sidecar as one: both of this call, or neither
    L, P = placement.num_layers, placement.num_physical_experts
    logger.info(
        "wrote %s placement (%d layers x %d slots) to %s", format, L, P, ", ".join(str(f) for f, _ in files)
    )
    return [f for f, _ in files]


def placement_files(
    placement: Placement,
    path: str | os.PathLike,
    format: str = "native",
    *,
    num_hidden_layers: int | None = None,
) -> list[tuple[Path, bytes]]:
    """What :func:`write_placement` would write, as ``[(path, bytes)]`` (the map, then its sidecar),
    writing nothing: a command that writes several files publishes them all at once with
    :func:`moe_placement.base.fileio.atomic_write_files`. Same arguments and errors as :func:`write_placement`."""
    if format not in FORMATS:
        raise ValueError(f"unknown placement format {format!r}; choose one of {', '.join(FORMATS)}")
    p2l = _checked(placement)  # [L, P]
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"path must be a file name (str or os.PathLike), got {type(path).__name__}")
    out = Path(path)
    if num_hidden_layers is not None and format != "sglang":
        raise ValueError(f"num_hidden_layers applies to the sglang format only, not {format!r}")
    check_output_name(out, format)  # a name the readers would not read back as this format
    return _encode(placement, p2l, format, out, num_hidden_layers)


def _encode(
    placement: Placement, p2l: np.ndarray, fmt: str, out: Path, num_hidden_layers: int | None
) -> list[tuple[Path, bytes]]:
    """``[(path, bytes)]`` of every file to write: the main file, and the sidecar for engine formats.

    ``p2l``: int64 ``[L, P]``, validated.
    """
    if fmt == "native":
        return [(out, _native_bytes(placement, p2l))]
    if fmt == "sglang":
        data, H = _sglang_bytes(placement, p2l, out, num_hidden_layers)
        meta = _metadata(placement, fmt, out, num_hidden_layers=H)
    elif fmt == "trtllm":
        data = _trtllm_bytes(placement, p2l)
        meta = _metadata(placement, fmt, out)
    elif fmt == "vllm-ascend":
        data = _vllm_ascend_bytes(placement, p2l)
        meta = _metadata(placement, fmt, out)
    else:  # vllm (provisional)
        data = _vllm_bytes(placement, p2l)
        meta = _metadata(placement, fmt, out)
    meta["file_sha256"] = hashlib.sha256(data).hexdigest()  # binds the sidecar to this map's bytes
    return [(out, data), (sidecar_path(out), (json.dumps(meta, indent=1) + "\n").encode("utf-8"))]


def _native_bytes(placement: Placement, p2l: np.ndarray) -> bytes:
    """The native JSON: header fields, then ``physical_to_logical_map`` ``[L, P]`` one row per line."""
    doc = {
        "schema": PLACEMENT_SCHEMA,
        "schema_version": PLACEMENT_SCHEMA_VERSION,
        "num_logical_experts": placement.num_logical_experts,
        "layer_ids": list(placement.layer_ids),
        "topology": placement.topology.to_dict(),
        "allow_colocated_replicas": bool(placement.allow_colocated_replicas),
        "provenance": _jsonable(placement.provenance),
    }
    head = json.dumps(doc, indent=1)[:-2]  # drop the closing "\n}"
    rows = _rows_json("physical_to_logical_map", p2l)[1:]  # '"physical_to_logical_map": [...]}\n'
    return (head + ",\n" + rows).encode("utf-8")


def _sglang_bytes(
    placement: Placement, p2l: np.ndarray, out: Path, num_hidden_layers: int | None
) -> tuple[bytes, int]:
    """SGLang's ``--init-expert-location`` map ``[H, P]`` (``.pt`` via torch.save, else JSON) and ``H``.

    MoE rows sit at their real layer index; dense rows hold the trivial map ``p % E``.
    """
    full = hidden_layer_rows(placement, num_hidden_layers)  # [H, P]
    H = full.shape[0]
    if out.suffix not in _PT_SUFFIXES:
        return _rows_json("physical_to_logical_map", full).encode("utf-8"), H
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is an optional extra
        raise ValueError(
            "writing an SGLang .pt file needs torch (pip install 'moe-placement[torch]'); "
            "or write .json, which SGLang reads as well"
        ) from None
    buf = io.BytesIO()
    torch.save({"physical_to_logical_map": torch.from_numpy(full)}, buf)
    return buf.getvalue(), H


def _trtllm_bytes(placement: Placement, p2l: np.ndarray) -> bytes:
    """TensorRT-LLM's ``moe_load_balancer.yaml``: ``initial_global_assignments`` keyed by real layer id."""
    import yaml

    ids = list(placement.layer_ids)
    doc = {
        "num_slots": p2l.shape[1],
        "layer_updates_per_iter": 0,
        "initial_global_assignments": {int(lid): [int(x) for x in row] for lid, row in zip(ids, p2l)},
    }
    text = yaml.safe_dump(doc, sort_keys=False, default_flow_style=None, width=2**31 - 1)
    return text.encode("utf-8")


def _vllm_ascend_bytes(placement: Placement, p2l: np.ndarray) -> bytes:
    """vLLM-Ascend's ``expert_map_path`` JSON: per layer (by index), per device its slots' experts."""
    L = p2l.shape[0]
    G, S = placement.topology.ep_size, placement.topology.slots_per_gpu
    per_gpu = p2l.reshape(L, G, S)  # [L, G, S]: rank g owns slots [g*S, (g+1)*S)
    doc = {
        "moe_layer_count": L,
        "layer_list": [
            {
                "layer_id": i,
                "device_count": G,
                "device_list": [
                    {"device_id": g, "device_expert": [int(x) for x in per_gpu[i, g]]} for g in range(G)
                ],
            }
            for i in range(L)
        ],
    }
    return (json.dumps(doc, indent=1) + "\n").encode("utf-8")


def _vllm_bytes(placement: Placement, p2l: np.ndarray) -> bytes:
    """The provisional vLLM ``eplb_initial_mapping`` record (one JSON line), keyed by real layer id."""
    P = p2l.shape[1]
    ids = list(placement.layer_ids)
    doc = {
        "record_type": VLLM_RECORD_TYPE,
        "version": VLLM_RECORD_VERSION,
        "num_redundant_experts": P - placement.num_logical_experts,
        "num_slots": P,
        "initial_global_assignments": {str(lid): [int(x) for x in row] for lid, row in zip(ids, p2l)},
    }
    return (json.dumps(doc) + "\n").encode("utf-8")
