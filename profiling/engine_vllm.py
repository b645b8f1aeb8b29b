"""vLLM (provisional proposal) JSONL load records.

Records ``{"record_type": "eplb_load_stats", "version": 1, "step", "num_ranks", "expert_load" [L, P],
"p2l_map" [L, P]}`` (optional ``"layer_ids"``), one window per record; other record types are
skipped. Shapes: W = records, L = MoE layer rows, P = physical slots, E = logical experts. Read
through :func:`profiling.engine_readers.read_engine_dump`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from moe_placement.base.fileio import InputFileError, open_regular
from moe_placement.base.limits import MAX_EXPERTS, MAX_RANKS, check_layer_ids
from moe_placement.base.textparse import parse_json
from profiling.engine_common import _array, _check_size, _int, _pick, physical_to_logical_counts
from profiling.trace import RoutingTrace

VLLM_LOAD_RECORD = "eplb_load_stats"
VLLM_LOAD_VERSION = 1


@dataclass
class _VllmLoads:
    """The load records of the JSONL files, in file order (W kept records)."""

    loads: list[np.ndarray] = field(default_factory=list)  # W x [L, P] physical loads
    maps: list[np.ndarray] = field(default_factory=list)  # W x int64 [L, P] physical -> logical
    labels: list[str] = field(default_factory=list)  # W x "step<step>"
    steps: list[int] = field(default_factory=list)  # W
    file_ids: list[int] | None = None  # [L] real layer ids, when the records name them
    skipped: int = 0  # records of other types
    shape: tuple[int, ...] | None = None  # (L, P), the same in every record
    num_ranks: int | None = None  # of the last record


def _read_vllm_jsonl(files: list[Path], name: str, E: int | None, moe_layer_ids) -> RoutingTrace:
    """Counts ``[W, L, E]``: each record's physical loads folded into experts with its own map.

    Steps: scan the records -> ``E`` -> fold physical into logical -> pick rows and layer ids.
    """
    acc = _VllmLoads()
    for f in files:
        _scan_vllm_file(acc, f, E)
    if not acc.loads:
        raise InputFileError(
            f"{name}: no '{VLLM_LOAD_RECORD}' records ({acc.skipped} other record(s) skipped)"
        )
    if E is None:
        E = max(int(m.max()) for m in acc.maps) + 1
    logical = np.stack(
        [physical_to_logical_counts(a, m, E) for a, m in zip(acc.loads, acc.maps)]
    )  # [W, L, E]
    rows, layer_ids = _vllm_rows(files, acc.file_ids, moe_layer_ids, logical.shape[1])
    return RoutingTrace(
        num_logical_experts=int(E),
        window_counts=logical[:, rows],
        layer_ids=tuple(layer_ids),
        window_labels=tuple(acc.labels),
        name=name,
        metadata={
            "source": [str(f) for f in files],
            "engine": "vllm",
            "provisional_format": True,
            "num_ranks": acc.num_ranks,
            "steps": acc.steps,
            "skipped_records": acc.skipped,
        },
    )


def _scan_vllm_file(acc: _VllmLoads, f: Path, E: int | None) -> None:
    """Add the load records of one JSONL file to ``acc`` (blank lines ignored, other types counted)."""
    _check_size(f, 1024**3)
    with open_regular(f) as fh:
        for n, raw_line in enumerate(fh, 1):
            line = raw_line.strip()
            if not line:
                continue
            where = f"line {n}: "
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise InputFileError(
                    f"{f}: {where}not UTF-8 text ({exc.reason} at byte {exc.start})"
                ) from None
            try:
                rec = parse_json(text, "the line")
            except InputFileError as exc:
                raise InputFileError(f"{f}: {where}not a JSON record ({exc})") from None
            if not isinstance(rec, dict):
                raise InputFileError(f"{f}: {where}must be a JSON object")
            if rec.get("record_type") != VLLM_LOAD_RECORD:
                acc.skipped += 1
                continue
            _add_vllm_record(acc, f, where, rec, E)


def _add_vllm_record(acc: _VllmLoads, f: Path, where: str, rec: dict, E: int | None) -> None:
    """Check one load record against itself and the earlier ones, then append it to ``acc``.

    ``expert_load`` ``[L, P]`` (>= 0) and ``p2l_map`` int ``[L, P]`` (ids in ``[0, E)``) must match each
    other and every earlier record; ``num_ranks`` must divide ``P``.
    """
    version = _int(f, rec, "version", where)
    if version > VLLM_LOAD_VERSION:
        raise InputFileError(
            f"{f}: {where}{VLLM_LOAD_RECORD} version {version} is newer than this reader ({VLLM_LOAD_VERSION})"
        )
    step = _int(f, rec, "step", where)
    ranks = _int(f, rec, "num_ranks", where)
    load = _array(f, rec.get("expert_load"), where + "expert_load", 2, "iuf")
    m = _array(f, rec.get("p2l_map"), where + "p2l_map", 2).astype(np.int64)
    if load.shape != m.shape:
        raise InputFileError(
            f"{f}: {where}expert_load shape {load.shape} differs from p2l_map shape {m.shape}"
        )
    if acc.shape is not None and load.shape != acc.shape:
        raise InputFileError(f"{f}: {where}shape {load.shape} differs from earlier records {acc.shape}")
    shape = acc.shape = load.shape
    if ranks > MAX_RANKS:
        raise InputFileError(f"{f}: {where}num_ranks={ranks} is over the accepted {MAX_RANKS} (MAX_RANKS)")
    if ranks < 1 or shape[1] % ranks:
        raise InputFileError(f"{f}: {where}num_ranks={ranks} does not divide {shape[1]} physical experts")
    acc.num_ranks = ranks
    if load.size and load.min() < 0:
        raise InputFileError(f"{f}: {where}expert_load has a negative load")
    if m.size and m.max() >= MAX_EXPERTS:
        raise InputFileError(
            f"{f}: {where}p2l_map holds expert id {m.max()}, outside the accepted range 0..{MAX_EXPERTS - 1} "
            f"(MAX_EXPERTS); the record is corrupt"
        )
    if m.min() < 0 or (E is not None and m.max() >= E):
        raise InputFileError(f"{f}: {where}p2l_map ids span [{m.min()}, {m.max()}], expected [0, {E})")
    if "layer_ids" in rec:
        ids = rec["layer_ids"]
        if (
            not isinstance(ids, list)
            or len(ids) != shape[0]
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
        ):
            raise InputFileError(f"{f}: {where}layer_ids must list {shape[0]} integer layer ids")
        try:
            check_layer_ids(ids, "layer_ids", f"{f}: {where.rstrip(': ')}")
        except ValueError as exc:
            raise InputFileError(str(exc)) from None
        if acc.file_ids is not None and acc.file_ids != ids:
            raise InputFileError(f"{f}: {where}layer_ids {ids} differ from earlier records {acc.file_ids}")
        acc.file_ids = ids
    acc.loads.append(load)
    acc.maps.append(m)
    acc.steps.append(step)
    acc.labels.append(f"step{step}")


def _vllm_rows(files: list[Path], file_ids, moe_layer_ids, L: int) -> tuple[list[int], list[int]]:
    """Rows of the ``L`` record rows to keep and their real layer ids.

    From the records' ``layer_ids`` (``moe_layer_ids`` then selects by id), else ``moe_layer_ids``
    names the rows (one per row), else rows are numbered ``0..L-1``.
    """
    if file_ids is not None:
        rows = (
            list(range(L))
            if moe_layer_ids is None
            else [file_ids.index(i) for i in _pick(files[0], file_ids, moe_layer_ids)]
        )
        layer_ids = [file_ids[r] for r in rows]
    elif moe_layer_ids is not None:
        layer_ids = [int(i) for i in moe_layer_ids]
        if len(layer_ids) != L:
            raise InputFileError(
                f"{files[0]}: {len(layer_ids)} moe_layer_ids given for {L} MoE layer rows; give one per row"
            )
        rows = list(range(L))
    else:
        rows, layer_ids = list(range(L)), list(range(L))
    return rows, layer_ids
