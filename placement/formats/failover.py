"""The failover folder (``moe-placement solve --failover DIR``): one map per single domain loss.

Layout of ``DIR``:

- ``index.json``: ``{"schema", "domain", "placement_sha256", "num_logical_experts", "layer_ids",
  "topology", "losses": [{"lost", "lost_gpus", "file", "reloads", "min_reloads", "moves", "par",
  "resolve_par", "ep_size", "num_nodes"}, ...]}``, one entry per GPU (``domain: gpu``) or per node
  (``node``); ``lost`` is that GPU's or node's index, ``placement_sha256`` the digest of the map the
  losses were computed from (:func:`map_digest`), ``topology`` its topology.
- one native placement per entry (``lost-gpu-<g>.json`` / ``lost-node-<n>.json``): the map to serve
  on the survivors, its topology the survivors' only.

The writer builds every file in memory and the caller publishes them as one
(:func:`moe_placement.base.fileio.atomic_write_files`); :func:`read_failover_index` checks an index
whole before anything in it is used, and :func:`find_loss` picks the entry for a set of lost GPUs.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from moe_placement.base.fileio import InputFileError, json_bytes, load_json
from placement.model import Placement

__all__ = [
    "FAILOVER_INDEX",
    "FAILOVER_SCHEMA",
    "failover_file_name",
    "find_loss",
    "index_bytes",
    "map_digest",
    "read_failover_index",
]

FAILOVER_INDEX = "index.json"
FAILOVER_SCHEMA = "moe-placement/failover-v1"
MAX_INDEX_BYTES = 16 << 20  # an index lists at most MAX_RANKS losses: far below this
_ENTRY_KEYS = ("lost", "lost_gpus", "file", "reloads", "min_reloads", "par", "resolve_par")


def map_digest(physical_to_logical_map: np.ndarray) -> str:
    """SHA-256 of a map ``[L, P]`` as little-endian int64 with its shape (one map, one digest)."""
    a = np.ascontiguousarray(np.asarray(physical_to_logical_map, dtype="<i8"))
    h = hashlib.sha256(f"{a.shape}".encode())
    h.update(a.tobytes())
    return h.hexdigest()


def failover_file_name(domain: str, index: int) -> str:
    """The file of the map for losing GPU or node ``index``."""
    return f"lost-{domain}-{int(index)}.json"


def index_bytes(
    path: Path, placement: Placement, domain: str, losses: Sequence[dict], options: dict
) -> bytes:
    """``index.json``'s bytes for ``losses`` computed from ``placement`` (``options``: how)."""
    doc = {
        "schema": FAILOVER_SCHEMA,
        "domain": domain,
        "placement_sha256": map_digest(placement.physical_to_logical_map),
        "num_logical_experts": placement.num_logical_experts,
        "layer_ids": list(placement.layer_ids),
        "topology": placement.topology.to_dict(),
        "options": dict(options),
        "losses": list(losses),
    }
    return json_bytes(path, doc)


def read_failover_index(folder: str | os.PathLike) -> dict:
    """``folder/index.json`` checked whole (schema, domain, one entry per loss with its fields, each
    entry's file a plain name inside the folder); an :class:`InputFileError` naming what is wrong."""
    path = Path(folder) / FAILOVER_INDEX
    doc = load_json(path, MAX_INDEX_BYTES)
    if not isinstance(doc, dict) or doc.get("schema") != FAILOVER_SCHEMA:
        raise InputFileError(f"{path}: not a failover index (schema {FAILOVER_SCHEMA!r} expected)")
    if doc.get("domain") not in ("gpu", "node") or not isinstance(doc.get("placement_sha256"), str):
        raise InputFileError(f"{path}: 'domain' must be gpu or node and 'placement_sha256' a digest")
    losses = doc.get("losses")
    if not isinstance(losses, list):
        raise InputFileError(f"{path}: 'losses' must be a list of entries")
    for i, entry in enumerate(losses):
        missing = [k for k in _ENTRY_KEYS if not isinstance(entry, dict) or k not in entry]
        if missing:
            raise InputFileError(f"{path}: losses[{i}] lacks {', '.join(missing)}")
        gpus = entry["lost_gpus"]
        if not isinstance(gpus, list) or not gpus or not all(type(g) is int and g >= 0 for g in gpus):
            raise InputFileError(f"{path}: losses[{i}].lost_gpus must be a non-empty list of GPU indices")
        name = entry["file"]
        if not isinstance(name, str) or not name or Path(name).name != name or name in (".", ".."):
            raise InputFileError(
                f"{path}: losses[{i}].file must be a file name inside the folder, got {name!r}"
            )
    return doc


def find_loss(doc: dict, lost_gpus: Sequence[int]) -> dict | None:
    """The entry of ``doc`` (:func:`read_failover_index`) for exactly ``lost_gpus``, or None."""
    want = sorted(int(g) for g in lost_gpus)
    for entry in doc["losses"]:
        if sorted(entry["lost_gpus"]) == want:
            return entry
    return None
