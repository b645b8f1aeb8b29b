"""Read and write routing traces: the project's own npz format and the shared npz layouts.

Engine dumps (SGLang recorder, TensorRT-LLM statistics folders) live in :mod:`profiling.engine_readers`;
:func:`read_trace` dispatches to them by what the path looks like.

Supported layouts, detected by keys:

- native: ``schema == "moe-placement/routing-trace"`` (written by :func:`write_trace`).
- per-token: ``topk_ids [T, L, k]`` with optional ``seq_offsets``, ``layer_ids``, ``counts [L, E]``,
  ``segment`` / ``batch_id`` (vLLM logger layout: segment 0 and 1 rows are start-up dummies and dropped
  by default), ``source_rank``.
- counts only: ``counts [L, E]`` or ``[W, L, E]`` (one row per question/step), optional ``subjects`` /
  ``subject_index`` labels.
- per-domain counts: ``expert_counts__<domain> [L, E]``, one window per domain.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from moe_placement.base.fileio import (
    InputFileError,
    atomic_write_bytes,
    iter_npz_array_chunks,
    load_npz,
    npz_bytes,
)
from moe_placement.base.limits import (
    MAX_EXPERTS,
    MAX_TOTAL_TOKENS,
    check_layer_ids,
    check_sequence,
    check_whole,
)
from moe_placement.base.textparse import parse_json
from profiling.trace import (
    EXPERTS_INFERRED,
    TRACE_SCHEMA,
    TRACE_SCHEMA_VERSION,
    RoutingTrace,
    _check_num_experts,
)

__all__ = [
    "check_load",
    "default_traces_dir",
    "find_shared_traces",
    "read_trace",
    "require_data",
    "stream_counts",
    "trace_bytes",
    "write_trace",
]

_PROJECT_ROOT = Path(__file__).resolve().parents[1]
_COUNTS_KEY = "expert_counts"  # read_trace's default per-domain key prefix


def default_traces_dir() -> Path:
    """``$MOE_TRACES_DIR`` if set, else the folder ``shared/traces`` beside the project root (or the cwd)."""
    env = os.environ.get("MOE_TRACES_DIR")
    if env:
        return Path(env)
    for base in (_PROJECT_ROOT, Path.cwd()):
        cand = (base / ".." / "shared" / "traces").resolve()
        if cand.is_dir():
            return cand
    return (_PROJECT_ROOT / ".." / "shared" / "traces").resolve()


def find_shared_traces() -> list[Path]:
    """Every ``.npz`` under the traces folder (empty when it is absent)."""
    d = default_traces_dir()
    return sorted(d.glob("*/*.npz")) if d.is_dir() else []


def _int_scalar(arrays, key, path):
    v = np.asarray(arrays[key])
    if v.size != 1 or v.dtype.kind not in "iu":
        raise InputFileError(f"{path}: field {key!r} must be one integer, got {v.dtype} {v.shape}")
    return int(v.ravel()[0])


def _int_vector(arrays, key, path) -> np.ndarray:
    """Field ``key`` as int64 ``[n]``: a 1-D integer array (or floats holding whole numbers), else an
    InputFileError naming it."""
    v = np.asarray(arrays[key])
    if v.ndim == 1 and v.dtype.kind == "f" and np.isfinite(v).all() and (v == np.round(v)).all():
        v = v.astype(np.int64)  # whole numbers saved as floats, read as before
    if v.ndim != 1 or v.dtype.kind not in "iu":
        raise InputFileError(
            f"{path}: field {key!r} must be a 1-D integer array, got {v.dtype} of shape {v.shape}"
        )
    return v.astype(np.int64)


def _layer_ids(arrays, path) -> tuple[int, ...]:
    """Field ``layer_ids`` as a tuple of ints (``()`` when absent): whole numbers only, never 0.5 read as 0."""
    if "layer_ids" not in arrays:
        return ()
    if np.asarray(arrays["layer_ids"]).ndim == 0:
        return (_int_scalar(arrays, "layer_ids", path),)
    return tuple(int(x) for x in _int_vector(arrays, "layer_ids", path))


def _str_scalar(arrays, key, default=""):
    if key not in arrays:
        return default
    v = np.asarray(arrays[key])
    return str(v.ravel()[0]) if v.size else default


def read_trace(
    path: str | os.PathLike,
    *,
    num_logical_experts: int | None = None,
    domains: Sequence[str] | None = None,
    keep_segments: Sequence[int] | None = None,
    counts_key: str = "expert_counts",
    max_bytes: int | None = None,
    moe_layer_ids: Sequence[int] | None = None,
) -> RoutingTrace:
    """Read any supported trace file or engine dump folder.

    Args:
        path: an ``.npz`` file, an SGLang ``.pt`` dump, or a TensorRT-LLM statistics folder.
        num_logical_experts: ``E`` when the file does not say it (default: from counts or max id + 1).
        domains: for per-domain files, which domains to keep (default: all, sorted).
        keep_segments: for files with a ``segment`` array, the segments to keep (default: ``(2, 3)``
            when the vLLM-logger layout is recognised, else all).
        counts_key: the per-domain key prefix (``expert_counts`` or ``expert_counts_top1``).
        moe_layer_ids: engine dumps whose layer axis holds every hidden layer (SGLang): the MoE rows
            to keep (default: rows that are not all zero).

    Raises:
        InputFileError (a ValueError) naming the file, the field and the expected form.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise InputFileError(f"path must be a file name (str or os.PathLike), got {type(path).__name__}")
    p = Path(path)
    domains, keep_segments, moe_layer_ids = _checked_args(
        p, num_logical_experts, domains, keep_segments, counts_key, max_bytes, moe_layer_ids
    )
    if p.is_dir() or p.suffix in (".pt", ".pth", ".safetensors", ".jsonl"):
        from profiling.engine_readers import read_engine_dump

        _no_domains(p, domains)
        _only_npz(p, keep_segments=keep_segments, counts_key=counts_key != _COUNTS_KEY or None)
        return read_engine_dump(p, num_logical_experts=num_logical_experts, moe_layer_ids=moe_layer_ids)
    _only_npz(p, moe_layer_ids=moe_layer_ids, as_="moe_layer_ids picks the MoE rows of an engine dump")
    kwargs = {} if max_bytes is None else {"max_bytes": max_bytes}
    arrays = load_npz(p, **kwargs)
    try:
        trace = _from_arrays(arrays, p, num_logical_experts, domains, keep_segments, counts_key)
        return _with_count(trace, num_logical_experts)
    except InputFileError:
        raise
    except ValueError as exc:
        raise InputFileError(f"{p}: {exc}") from None


def _checked_args(p, num_logical_experts, domains, keep_segments, counts_key, max_bytes, moe_layer_ids):
    """:func:`read_trace`'s arguments checked (an InputFileError naming the file): ``(domains,
    keep_segments, moe_layer_ids)`` as tuples. A bare string is refused where names or numbers are
    listed (``"arxiv"`` would be read as the domains a, r, x, i, v)."""
    try:
        if num_logical_experts is not None:
            _check_num_experts(num_logical_experts)
        if max_bytes is not None:
            check_whole("max_bytes", max_bytes, 1, fix="the largest uncompressed size to read, in bytes")
        if not isinstance(counts_key, str) or not counts_key:
            raise ValueError(f"counts_key must be a field prefix such as 'expert_counts', got {counts_key!r}")
        domains = None if domains is None else check_sequence(domains, "domains", "domain names")
        if keep_segments is not None:
            keep_segments = tuple(
                check_whole("keep_segments' entry", x, None)
                for x in check_sequence(keep_segments, "keep_segments", "segment numbers")
            )
        if moe_layer_ids is not None:
            moe_layer_ids = check_layer_ids(moe_layer_ids, "moe_layer_ids")
    except ValueError as exc:
        raise InputFileError(f"{p}: {exc}") from None
    return domains, keep_segments, moe_layer_ids


def _only_npz(p, as_: str = "", **given) -> None:
    """Refuse an argument given for a file it does not apply to (it would be silently ignored)."""
    for name, value in given.items():
        if value is not None:
            what = as_ or f"{name} applies to the .npz layouts that have it"
            raise InputFileError(f"{p}: {name} was given, but {what}; drop it for this file")


def _with_count(trace: RoutingTrace, num_logical_experts: int | None) -> RoutingTrace:
    """``num_logical_experts`` asked for a file that states a count: the file's, or a count it only
    inferred widened to it; a different stated count is refused (it was silently ignored)."""
    if num_logical_experts is None or num_logical_experts == trace.num_logical_experts:
        return trace
    if trace.experts_inferred:
        return trace.with_expert_count(num_logical_experts, f"num_logical_experts={num_logical_experts}")
    raise ValueError(
        f"the file states {trace.num_logical_experts} experts but num_logical_experts={num_logical_experts} was "
        f"asked; read it without num_logical_experts, or pass the trace of that model"
    )


def _from_arrays(arrays, p, num_logical_experts, domains, keep_segments, counts_key) -> RoutingTrace:
    """Dispatch on the layout the keys show: native, per-token, per-domain counts or counts."""
    if keep_segments is not None and "segment" not in arrays:
        raise InputFileError(f"{p}: keep_segments was given, but the file has no 'segment' field; drop it")
    if counts_key != _COUNTS_KEY and not any(k.startswith(counts_key + "__") for k in arrays):
        raise InputFileError(
            f"{p}: counts_key {counts_key!r} was given, but the file has no '{counts_key}__<domain>' field; drop it"
        )
    if "schema" in arrays:
        _no_domains(p, domains)
        return _native_trace(arrays, p)
    layer_ids = _layer_ids(arrays, p)
    if "topk_ids" in arrays:
        _no_domains(p, domains)
        return _token_trace(arrays, p, num_logical_experts, keep_segments, layer_ids)
    domain_keys = sorted(k for k in arrays if k.startswith(counts_key + "__"))
    if domain_keys:
        return _domain_trace(arrays, p, num_logical_experts, domains, counts_key, domain_keys, layer_ids)
    _no_domains(p, domains)
    if "counts" in arrays:
        return _counts_trace(arrays, p, num_logical_experts, layer_ids)
    raise InputFileError(
        f"{p}: not a routing trace: no 'topk_ids', 'counts', '{counts_key}__<domain>' or native 'schema' field "
        f"(fields present: {sorted(arrays)[:8]})"
    )


def _no_domains(p, domains) -> None:
    """``domains`` picks windows of a per-domain file only; anywhere else it would be ignored."""
    if domains is not None:
        raise InputFileError(
            f"{p}: domains {list(domains)[:4]} were asked for, but this trace has no per-domain counts "
            f"('<key>__<domain>' fields); drop --domains"
        )


def _native_metadata(arrays, p) -> dict:
    """Check ``schema`` / ``schema_version`` and parse ``metadata_json`` (a JSON object, default ``{}``)."""
    schema = _str_scalar(arrays, "schema")
    if schema != TRACE_SCHEMA:
        raise InputFileError(f"{p}: schema {schema!r} is not {TRACE_SCHEMA!r}")
    version = _int_scalar(arrays, "schema_version", p) if "schema_version" in arrays else 0
    if version > TRACE_SCHEMA_VERSION:
        raise InputFileError(
            f"{p}: trace schema version {version} is newer than this reader ({TRACE_SCHEMA_VERSION}); upgrade moe-placement"
        )
    meta = {}
    if "metadata_json" in arrays:
        meta = parse_json(_str_scalar(arrays, "metadata_json", "{}"), f"{p}: field 'metadata_json'")
        if not isinstance(meta, dict):
            raise InputFileError(f"{p}: field 'metadata_json' must hold a JSON object")
    return meta


def _native_trace(arrays, p) -> RoutingTrace:
    """The native layout written by :func:`write_trace`: every field as stored."""
    meta = _native_metadata(arrays, p)
    if "num_logical_experts" not in arrays:
        raise InputFileError(f"{p}: native trace lacks field 'num_logical_experts'")
    return RoutingTrace(
        num_logical_experts=_int_scalar(arrays, "num_logical_experts", p),
        topk_ids=arrays.get("topk_ids"),
        layer_ids=_layer_ids(arrays, p),
        source_rank=arrays.get("source_rank"),
        seq_offsets=arrays.get("seq_offsets"),
        step_offsets=arrays.get("step_offsets"),
        window_counts=arrays.get("window_counts"),
        window_labels=tuple(str(x) for x in arrays["window_labels"]) if "window_labels" in arrays else (),
        name=_str_scalar(arrays, "name", p.stem),
        metadata=meta,
    )


def _token_ids(arrays, p, num_logical_experts) -> tuple[np.ndarray, int, bool]:
    """``topk_ids`` as int32 ``[T, L, k]`` (``[T, k]`` gets L = 1), ``E``, and whether ``E`` was only
    inferred.

    ``E``: ``num_logical_experts``, else the last axis of ``counts_real`` / ``counts``, else max id + 1
    (inferred: a model whose last experts were never picked has more; every id -1 is refused: nothing
    was routed).
    """
    ids = np.asarray(arrays["topk_ids"])
    if ids.dtype.kind not in "iu" or ids.ndim not in (2, 3):
        raise InputFileError(
            f"{p}: field 'topk_ids' must be integer [tokens, layers, top_k], got {ids.dtype} {ids.shape}"
        )
    if ids.ndim == 2:
        ids = ids[:, None, :]
    E = num_logical_experts
    counts_field = "counts_real" if "counts_real" in arrays else ("counts" if "counts" in arrays else None)
    if E is None and counts_field is not None:
        shape = np.asarray(arrays[counts_field]).shape
        if not shape or shape[-1] < 1:
            raise InputFileError(
                f"{p}: field {counts_field!r} must be counts [..., experts], got shape {shape}; or drop it"
            )
        E = int(shape[-1])
    inferred = E is None and ids.size > 0
    if inferred and int(ids.max()) < 0:
        T, L, k = ids.shape
        raise InputFileError(
            f"{p}: nothing was routed: every topk_ids entry is -1 (no expert) in all {T} tokens x {L} layers x "
            f"top-{k}, so there is no load to place or score (nor an expert count to read); record routed "
            f"traffic, or check that the right rows were dumped"
        )
    if E is None:
        E = int(ids.max()) + 1 if ids.size else 1
    if ids.size and int(E) <= MAX_EXPERTS and (int(ids.min()) < -1 or int(ids.max()) >= int(E)):
        # checked before the int32 cast, which would wrap 2**32 + 2 to expert 2 and -2**32 - 1 to padding
        raise InputFileError(
            f"{p}: topk_ids hold ids in [{int(ids.min())}, {int(ids.max())}] but must be in [-1, {int(E) - 1}] "
            f"for num_logical_experts={int(E)} (-1 = no expert); pass the model's real expert count"
        )
    return ids.astype(np.int32), E, inferred


def _segment_keep(arrays, p, T: int, keep_segments, meta: dict) -> np.ndarray | None:
    """Rows to keep by ``segment`` ``[T]``: bool ``[T]``, or None to keep all (notes the drop in ``meta``)."""
    if "segment" not in arrays:
        return None
    seg = _int_vector(arrays, "segment", p)
    if seg.shape != (T,):
        raise InputFileError(f"{p}: field 'segment' has shape {seg.shape}, expected ({T},)")
    segs = (
        tuple(keep_segments) if keep_segments is not None else ((2, 3) if "counts_real" in arrays else None)
    )
    if segs is None:
        return None
    keep = np.isin(seg, segs)
    meta["kept_segments"] = list(segs)
    meta["dropped_rows"] = int((~keep).sum())
    return keep


def _batch_steps(arrays, p, T: int, keep: np.ndarray | None) -> np.ndarray | None:
    """Step offsets int64 ``[S + 1]`` where ``batch_id`` ``[T]`` changes (over the kept rows), or None."""
    if "batch_id" not in arrays:
        return None
    b = _int_vector(arrays, "batch_id", p)
    if b.shape != (T,):
        raise InputFileError(f"{p}: field 'batch_id' has shape {b.shape}, expected ({T},)")
    bk = b if keep is None else b[keep]
    change = np.flatnonzero(np.diff(bk) != 0) + 1
    return np.concatenate([[0], change, [bk.size]]).astype(np.int64)


def _token_trace(arrays, p, num_logical_experts, keep_segments, layer_ids) -> RoutingTrace:
    """Per-token layout: ``topk_ids [T, L, k]``, start-up segments dropped, optional offsets and ranks."""
    ids, E, inferred = _token_ids(arrays, p, num_logical_experts)  # [T, L, k] int32
    T = ids.shape[0]
    meta = {"source_file": str(p), **({EXPERTS_INFERRED: True} if inferred else {})}
    seq = arrays.get("seq_offsets")
    source = arrays.get("source_rank")
    keep = _segment_keep(arrays, p, T, keep_segments, meta)  # [T] bool or None
    step = _batch_steps(arrays, p, T, keep)
    if keep is not None:
        ids = ids[keep]
        if source is not None:
            source = np.asarray(source)[keep]
        if seq is not None:
            raise InputFileError(
                f"{p}: both 'segment' and 'seq_offsets' present; cannot filter prompt boundaries"
            )
    if seq is not None:
        seq = _int_vector(arrays, "seq_offsets", p)
        if seq.size and seq.max() > ids.shape[0]:
            raise InputFileError(
                f"{p}: field 'seq_offsets' reaches token {int(seq.max())} but the trace has {ids.shape[0]} tokens; "
                f"prompt boundaries must lie in 0..{ids.shape[0]}"
            )
        if seq.size and seq[-1] != ids.shape[0]:  # the last prompt's end, when the file leaves it out
            seq = np.concatenate([seq, [ids.shape[0]]])
    return RoutingTrace(
        num_logical_experts=E,
        topk_ids=ids,
        layer_ids=layer_ids,
        source_rank=source,
        seq_offsets=seq,
        step_offsets=step,
        name=p.stem,
        metadata=meta,
    )


def _domain_trace(
    arrays, p, num_logical_experts, domains, counts_key, domain_keys, layer_ids
) -> RoutingTrace:
    """Per-domain counts ``<counts_key>__<domain> [L, E]``: one window per chosen domain."""
    avail = [k.split("__", 1)[1] for k in domain_keys]
    chosen = list(domains) if domains else avail
    missing = [d for d in chosen if d not in avail]
    if missing:
        raise InputFileError(f"{p}: no domain(s) {missing}; available: {avail}")
    stack = np.stack([np.asarray(arrays[f"{counts_key}__{d}"]) for d in chosen])  # [W, L, E]
    if stack.ndim != 3:
        raise InputFileError(f"{p}: per-domain counts must be [layers, experts], got {stack.shape[1:]}")
    return RoutingTrace(
        num_logical_experts=num_logical_experts or stack.shape[2],
        window_counts=stack,
        window_labels=tuple(chosen),
        layer_ids=layer_ids,
        name=p.stem,
        metadata={"source_file": str(p), "windows": "domains"},
    )


def _counts_trace(arrays, p, num_logical_experts, layer_ids) -> RoutingTrace:
    """Counts only: ``counts [L, E]`` or ``[W, L, E]``, windows labelled by ``subjects[subject_index]``."""
    c = np.asarray(arrays["counts"])
    if c.ndim not in (2, 3) or c.dtype.kind not in "iuf":
        raise InputFileError(
            f"{p}: field 'counts' must be numeric [layers, experts] or [windows, layers, experts], got {c.dtype} {c.shape}"
        )
    labels: tuple[str, ...] = ()
    if c.ndim == 3 and "subject_index" in arrays and "subjects" in arrays:
        subj = np.asarray(arrays["subjects"]).astype(str)
        si = _int_vector(arrays, "subject_index", p)
        if si.shape != (c.shape[0],) or (si.size and (si.min() < 0 or si.max() >= subj.size)):
            raise InputFileError(f"{p}: 'subject_index' does not match 'counts' rows or 'subjects'")
        labels = tuple(subj[si])
    return RoutingTrace(
        num_logical_experts=num_logical_experts or c.shape[-1],
        window_counts=c,
        window_labels=labels,
        layer_ids=layer_ids,
        name=p.stem,
        metadata={"source_file": str(p)},
    )


def write_trace(trace: RoutingTrace, path: str | os.PathLike) -> None:
    """Write the native npz format (atomically)."""
    atomic_write_bytes(path, trace_bytes(trace))


def trace_bytes(trace: RoutingTrace) -> bytes:
    """The native npz file :func:`write_trace` writes, as bytes (for a folder published as a unit)."""
    if not isinstance(trace, RoutingTrace):
        raise TypeError(f"write_trace needs a RoutingTrace, got {type(trace).__name__}")
    arrays: dict[str, Any] = {
        "schema": np.array(TRACE_SCHEMA),
        "schema_version": np.array(TRACE_SCHEMA_VERSION),
        "num_logical_experts": np.array(trace.num_logical_experts),
        "layer_ids": np.asarray(trace.layer_ids, dtype=np.int64),
        "name": np.array(trace.name),
        "metadata_json": np.array(json.dumps(dict(trace.metadata), default=str)),
    }
    for key in ("topk_ids", "source_rank", "seq_offsets", "step_offsets", "window_counts"):
        v = getattr(trace, key)
        if v is not None:
            arrays[key] = np.asarray(v)
    if trace.window_labels:
        arrays["window_labels"] = np.asarray(trace.window_labels, dtype=str)
    return npz_bytes(**arrays)


def stream_counts(path: str | os.PathLike, num_logical_experts: int, chunk_tokens: int = 65536) -> np.ndarray:
    """Per-layer expert counts ``[L, E]`` of a per-token npz trace, read in chunks of tokens.

    For traces too large to load: memory is bounded by ``chunk_tokens`` rows of ``topk_ids``.
    (Start-up rows of the vLLM-logger layout are not filtered here: use :func:`read_trace` for those.)
    """
    from profiling.trace import token_counts

    if not 1 <= int(num_logical_experts) <= MAX_EXPERTS:
        raise ValueError(
            f"num_logical_experts must be in 1..{MAX_EXPERTS} (MAX_EXPERTS), got {num_logical_experts}"
        )
    total = None
    for chunk in iter_npz_array_chunks(path, "topk_ids", chunk_tokens):
        if chunk.ndim == 2:
            chunk = chunk[:, None, :]
        if chunk.dtype.kind not in "iu" or chunk.ndim != 3:
            raise InputFileError(f"{path}: field 'topk_ids' must be integer [tokens, layers, top_k]")
        ids = chunk.astype(np.int64)
        if ids.size and (ids.max() >= num_logical_experts or ids.min() < -1):
            raise InputFileError(
                f"{path}: field 'topk_ids' holds ids in [{ids.min()}, {ids.max()}], outside [-1, {num_logical_experts - 1}]"
            )
        c = token_counts(ids, num_logical_experts)
        total = c if total is None else total + c
    if total is None:
        raise InputFileError(f"{path}: field 'topk_ids' has no tokens")
    return total


def check_load(load, where: str) -> np.ndarray:
    """A load array (``[L, E]`` or ``[W, L, E]``, e.g. from a ``.npy`` file) as float64, checked.

    Raises:
        ValueError naming ``where``: not numeric, not 2-D/3-D, NaN, inf or negative entries, more than
        ``MAX_EXPERTS`` experts, or a total above ``MAX_TOTAL_TOKENS`` (2**53: float64 sums stop being
        exact, and a finite but huge load such as 1e308 makes peak / mean NaN).
    """
    arr = np.asarray(load)
    if arr.dtype.kind not in "iuf" or arr.ndim not in (2, 3):
        raise ValueError(
            f"{where}: a load must be a numeric [layers, experts] or [windows, layers, experts] array, "
            f"got {arr.dtype} {arr.shape}"
        )
    if arr.shape[-1] > MAX_EXPERTS:
        raise ValueError(
            f"{where}: the load has {arr.shape[-1]} experts, over the accepted {MAX_EXPERTS} (MAX_EXPERTS)"
        )
    if 0 in arr.shape[-2:]:
        raise ValueError(f"{where}: a load needs at least one layer and one expert, got shape {arr.shape}")
    arr = arr.astype(np.float64)
    if not np.all(np.isfinite(arr)) or (arr.size and arr.min() < 0):
        raise ValueError(f"{where}: the load holds NaN, inf or negative entries; loads are token counts >= 0")
    with np.errstate(over="ignore"):  # an overflow to inf is what is checked
        total = float(arr.sum())
    if not np.isfinite(total) or total > MAX_TOTAL_TOKENS:
        raise ValueError(
            f"{where}: the load sums to {total:g} tokens, over the accepted {MAX_TOTAL_TOKENS:.0f} "
            f"(MAX_TOTAL_TOKENS = 2**53); the counts are corrupt or in the wrong unit"
        )
    return arr


def require_data(data: RoutingTrace | np.ndarray, where: str) -> None:
    """Refuse a trace or load that holds no routed tokens, before solving or scoring from it.

    Readers accept empty traces (``inspect`` may report one); solving a placement from zero load, or
    scoring one on it, has no meaning (every placement ties, peak / mean is 0 / 0).

    Args:
        data: a :class:`RoutingTrace`, or a load ``[L, E]`` / ``[W, L, E]``.
        where: the file (or option) the data came from; it starts the message.

    Raises:
        ValueError: no tokens, or every load zero (and, for arrays, what :func:`check_load` refuses).
    """
    if isinstance(data, RoutingTrace):
        if data.has_tokens and data.num_tokens == 0:
            raise ValueError(
                f"{where}: the trace has 0 tokens; record some traffic, or pick windows/layers that hold tokens"
            )
        total = float(np.sum(data.counts(), dtype=np.float64))
        shape = (data.num_layers, data.num_logical_experts)
    else:
        arr = check_load(data, where)
        total, shape = float(arr.sum()), arr.shape[-2:]
    if total <= 0:
        raise ValueError(
            f"{where}: every expert load is 0 (all {shape[0]} layers x {shape[1]} experts): nothing is routed, "
            f"so balance (peak / mean of zero load) is undefined; record traffic first, or check the chosen "
            f"layers and windows"
        )
