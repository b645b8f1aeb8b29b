"""SGLang expert-distribution recorder dumps (``stat``, ``per_pass`` and ``per_token`` modes).

Shapes: H = hidden layers (SGLang's layer axis: every layer, dense ones all-zero), L = MoE layers kept,
E = logical experts, P = physical slots, W = windows (buffered steps / forward passes), T = tokens,
K = top-k columns. Read through :func:`profiling.engine_readers.read_engine_dump`.
"""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path
from typing import Any

import numpy as np

from moe_placement.base.fileio import InputFileError
from profiling.engine_common import (
    _array,
    _check_map,
    _int,
    _moe_rows,
    _torch_load,
    physical_to_logical_counts,
    physical_to_logical_ids,
)
from profiling.trace import RoutingTrace

# The readers' public logger name (users and the CLI's log format see it), kept from before the split.
logger = logging.getLogger("profiling.engine_readers")

_SGLANG_FILE = re.compile(r"^expert_distribution_recorder_(?P<time>[0-9.]+?)(?:_(?P<rank>\d+))?\.pt$")


def _sglang_sort_key(p: Path):
    m = _SGLANG_FILE.match(p.name)
    if m is None:
        return (math.inf, 0, p.name)
    try:
        t = float(m.group("time"))
    except ValueError:
        t = math.inf
    return (t, int(m.group("rank") or 0), p.name)


def _read_sglang(files: list[Path], name: str, E: int | None, moe_layer_ids) -> RoutingTrace:
    files = sorted(files, key=_sglang_sort_key)
    dumps = [(f, _torch_load(f)) for f in files]
    kinds = set()
    for f, d in dumps:
        if isinstance(d, dict) and "logical_count" in d:
            kinds.add("stat")
        elif isinstance(d, dict) and "records" in d:
            kinds.add("detail")
        else:
            keys = sorted(map(str, d))[:8] if isinstance(d, dict) else type(d).__name__
            raise InputFileError(
                f"{f}: not an SGLang expert-distribution dump (found {keys}); expected a dict with "
                f"'logical_count' (stat mode) or 'records' and 'last_physical_to_logical_map' (per_pass/per_token)"
            )
    if len(kinds) > 1:
        raise InputFileError(f"{name}: mixes stat-mode and per_pass/per_token dumps; read them separately")
    if "stat" in kinds:
        return _read_sglang_stat(dumps, name, E, moe_layer_ids)
    return _read_sglang_detail(dumps, name, E, moe_layer_ids)


def _read_sglang_stat(dumps, name: str, E: int | None, moe_layer_ids) -> RoutingTrace:
    parts: list[np.ndarray] = []
    ranks, rates = [], []
    for f, d in dumps:
        arr = _array(f, d["logical_count"], "logical_count [steps, layers, experts]", (2, 3), "iuf")
        if arr.ndim == 2:  # [H, E]: one step
            arr = arr[None]
        if arr.size and arr.min() < 0:
            raise InputFileError(f"{f}: field 'logical_count' has a negative count {arr.min()}")
        if parts and arr.shape[1:] != parts[0].shape[1:]:
            raise InputFileError(
                f"{f}: logical_count layers x experts {arr.shape[1:]} differ from {parts[0].shape[1:]} in {dumps[0][0].name}"
            )
        parts.append(arr)
        ranks.append(d.get("rank"))
        rate = d.get("average_utilization_rate_over_window")
        rates.append(float(rate) if isinstance(rate, (int, float)) and not isinstance(rate, bool) else None)
    counts = np.concatenate(parts)  # [W, H, E]
    f0 = dumps[0][0]
    if E is not None and counts.shape[2] != E:
        raise InputFileError(f"{f0}: logical_count has {counts.shape[2]} experts but num_logical_experts={E}")
    rows = _moe_rows(f0, counts.sum(axis=0).sum(axis=1) > 0, moe_layer_ids, "stat dump")
    if counts.dtype.kind != "f":
        counts = counts.astype(np.int64)
    return RoutingTrace(
        num_logical_experts=counts.shape[2],
        window_counts=counts[:, rows],  # [W, L, E]
        layer_ids=tuple(rows),
        window_labels=tuple(f"step{i}" for i in range(counts.shape[0])),
        name=name,
        metadata={
            "source": [str(f) for f, _ in dumps],
            "engine": "sglang",
            "recorder_mode": "stat",
            "rank": ranks[0] if len(ranks) == 1 else ranks,
            "average_utilization_rate_over_window": rates[0] if len(rates) == 1 else rates,
            "num_hidden_layers": int(counts.shape[1]),
        },
    )


# One per-forward-pass record: (forward_pass_id, rank, file, record dict).
_Record = tuple[int, int, Path, dict]


def _read_sglang_detail(dumps, name: str, E: int | None, moe_layer_ids) -> RoutingTrace:
    """``per_pass`` / ``per_token`` dumps: records in (pass, rank) order, slots mapped to experts.

    Steps: one shared map and the records -> ``E`` -> per-token ids, or per-pass counts.
    """
    p2l, records = _sglang_records(dumps)  # [H, P] int64
    f0 = dumps[0][0]
    E = _check_map(f0, p2l, E, "last_physical_to_logical_map")
    H, P = p2l.shape
    if not records:
        raise InputFileError(f"{name}: the dump has no records; record some traffic before dumping")
    records.sort(key=lambda t: (t[0], t[1]))
    per_token = all("topk_ids_of_layer" in r for *_, r in records)
    if not per_token and any("topk_ids_of_layer" in r for *_, r in records):
        logger.warning("%s: only some records carry topk_ids_of_layer; reading physical counts only", name)
    meta: dict[str, Any] = {
        "source": [str(f) for f, _ in dumps],
        "engine": "sglang",
        "recorder_mode": "per_token" if per_token else "per_pass",
        "ranks": sorted({r for _, r, _, _ in records}),
        "num_hidden_layers": H,
        "num_physical_experts": P,
        "note": "physical ids converted with last_physical_to_logical_map",
    }
    if per_token:
        return _sglang_token_trace(records, p2l, E, f0, moe_layer_ids, name, meta)
    return _sglang_pass_trace(records, p2l, E, f0, moe_layer_ids, name, meta)


def _sglang_records(dumps) -> tuple[np.ndarray, list[_Record]]:
    """The map every file shares (int64 ``[H, P]``) and all files' records, unsorted.

    Raises when a file lacks the map, or when the map differs between files (the placement changed).
    """
    p2l = None
    records: list[_Record] = []
    for f, d in dumps:
        if "last_physical_to_logical_map" not in d:
            raise InputFileError(
                f"{f}: missing field 'last_physical_to_logical_map' [layers, physical experts]"
            )
        m = _array(f, d["last_physical_to_logical_map"], "last_physical_to_logical_map", 2).astype(np.int64)
        if p2l is None:
            p2l, p2l_file = m, f
        elif m.shape != p2l.shape or not np.array_equal(m, p2l):
            raise InputFileError(
                f"{f}: last_physical_to_logical_map differs from the one in {p2l_file.name}; the placement changed "
                f"during recording, so physical counts cannot be converted consistently: read the files separately"
            )
        recs = d["records"]
        if not isinstance(recs, list):
            raise InputFileError(f"{f}: field 'records' must be a list of per-forward-pass dicts")
        for i, r in enumerate(recs):
            where = f"records[{i}]: "
            if not isinstance(r, dict):
                raise InputFileError(f"{f}: {where}must be a dict, got {type(r).__name__}")
            records.append((_int(f, r, "forward_pass_id", where), _int(f, r, "rank", where), f, r))
    assert p2l is not None
    return p2l, records


def _sglang_token_ids(records: list[_Record], p2l: np.ndarray) -> tuple[np.ndarray, list, list]:
    """Every record's ``topk_ids_of_layer`` as logical ids.

    Args:
        records: in (pass, rank) order.
        p2l: int64 ``[H, P]``.

    Returns:
        int32 ``[T, H, K]`` logical ids (``-1`` pads narrower records), the source rank of each
        record's tokens (int32 ``[T_r]`` arrays) and ``(forward_pass_id, T_r)`` per record.
    """
    H, P = p2l.shape
    chunks, ranks, pass_of_chunk = [], [], []
    for fp, rank, f, r in records:
        ids = _array(f, r["topk_ids_of_layer"], f"records[fp={fp}].topk_ids_of_layer", 3)  # [H, T, K]
        if ids.shape[0] != H:
            raise InputFileError(
                f"{f}: records[fp={fp}].topk_ids_of_layer has {ids.shape[0]} layers, the map {H}"
            )
        if ids.size and (ids.min() < -1 or ids.max() >= P):
            raise InputFileError(
                f"{f}: records[fp={fp}].topk_ids_of_layer holds slot ids in [{ids.min()}, {ids.max()}], expected [-1, {P})"
            )
        chunks.append(physical_to_logical_ids(ids, p2l))  # [H, T, K] logical
        ranks.append(np.full(ids.shape[1], rank, dtype=np.int32))
        pass_of_chunk.append((fp, ids.shape[1]))
    widths = {c.shape[2] for c in chunks}
    K = max(widths)
    chunks = [np.pad(c, ((0, 0), (0, 0), (0, K - c.shape[2])), constant_values=-1) for c in chunks]
    return np.concatenate(chunks, axis=1).transpose(1, 0, 2), ranks, pass_of_chunk  # [T, H, K]


def _pass_bounds(pass_of_chunk: list[tuple[int, int]]) -> list[int]:
    """Token offsets ``[W + 1]`` of the steps: one step per ``forward_pass_id`` (all ranks' tokens)."""
    bounds, total, last = [0], 0, None
    for fp, n in pass_of_chunk:
        if last is not None and fp != last:
            bounds.append(total)
        total += n
        last = fp
    bounds.append(total)
    return bounds


def _sglang_token_trace(records, p2l, E: int, f0: Path, moe_layer_ids, name: str, meta) -> RoutingTrace:
    """``per_token`` mode: ids ``[T, L, k]`` of the MoE rows, unused top-k padding columns dropped."""
    ids, ranks, pass_of_chunk = _sglang_token_ids(records, p2l)  # [T, H, K]
    rows = _moe_rows(f0, np.asarray((ids >= 0).any(axis=(0, 2))), moe_layer_ids, "per_token dump")
    ids = ids[:, rows]
    used = (ids >= 0).any(axis=(0, 1))  # [K] drop top-k columns that are padding everywhere
    if used.any():
        ids = ids[:, :, : int(np.flatnonzero(used).max()) + 1]
    else:
        ids = ids[:, :, :1]
    bounds = _pass_bounds(pass_of_chunk)
    return RoutingTrace(
        num_logical_experts=E,
        topk_ids=ids,
        layer_ids=tuple(rows),
        source_rank=np.concatenate(ranks),
        step_offsets=np.asarray(bounds, dtype=np.int64),
        name=name,
        metadata=meta,
    )


def _sglang_pass_trace(records, p2l, E: int, f0: Path, moe_layer_ids, name: str, meta) -> RoutingTrace:
    """``per_pass`` mode: counts ``[W, L, E]``, one window per forward pass (its ranks summed)."""
    # Sum each pass's ranks in slot space first (one shared map), then fold slots into experts once.
    H, P = p2l.shape
    passes = sorted({fp for fp, *_ in records})
    pass_index = {fp: i for i, fp in enumerate(passes)}
    phys: np.ndarray | None = None  # [W, H, P]
    for fp, _rank, f, r in records:
        if "global_physical_count" not in r:
            raise InputFileError(
                f"{f}: records[fp={fp}] has no 'global_physical_count' [layers, physical experts]"
            )
        c = _array(f, r["global_physical_count"], f"records[fp={fp}].global_physical_count", 2, "iuf")
        if c.shape != (H, P):
            raise InputFileError(
                f"{f}: records[fp={fp}].global_physical_count has shape {c.shape}, expected ({H}, {P})"
            )
        if c.size and c.min() < 0:
            raise InputFileError(f"{f}: records[fp={fp}].global_physical_count has a negative count")
        if phys is None or (c.dtype.kind == "f" and phys.dtype.kind != "f"):
            dtype = np.float64 if c.dtype.kind == "f" else np.int64
            phys = np.zeros((len(passes), H, P), dtype=dtype) if phys is None else phys.astype(dtype)
        phys[pass_index[fp]] += c
    assert phys is not None
    counts = physical_to_logical_counts(phys, p2l, E)  # [W, H, E] ranks merged per pass
    rows = _moe_rows(f0, counts.sum(axis=(0, 2)) > 0, moe_layer_ids, "per_pass dump")
    return RoutingTrace(
        num_logical_experts=E,
        window_counts=counts[:, rows],
        layer_ids=tuple(rows),
        window_labels=tuple(f"pass{fp}" for fp in passes),
        name=name,
        metadata=meta,
    )
