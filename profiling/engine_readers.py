"""Read the routing statistics that serving engines dump, as :class:`~profiling.trace.RoutingTrace`.

Shapes: H = hidden layers (the engine's layer axis), L = MoE layers kept, E = logical experts,
P = physical slots, W = windows (steps / forward passes / iterations), T = tokens, k = top-k.

Supported dumps (see ``docs/formats.md``):

- SGLang expert-distribution recorder, ``stat`` mode: one ``torch.save`` file
  ``dict(rank, logical_count [W, H, E], average_utilization_rate_over_window)``, summed over ranks by
  SGLang -> counts-only trace, one window per buffered step.
- SGLang ``per_pass`` / ``per_token`` mode: one file per rank,
  ``dict(records=[dict(forward_pass_id, rank, gatherer_key, global_physical_count [H, P],
  topk_ids_of_layer [H, T, 8] (per_token only), ...)], last_physical_to_logical_map [H, P])``.
  Counts and ids are PHYSICAL slots: converted to logical experts with the map. Ranks are merged:
  one window (step) per ``forward_pass_id``; per-token traces carry ``source_rank``.
- TensorRT-LLM statistics folder: ``meta_info.json`` + ``rank{r}.safetensors`` with keys
  ``"{iter}_{layer}"`` -> bincount ``[num_experts]`` (logical), summed over ranks, one window per
  iteration. With ``rank{r}_raw.safetensors`` (same keys, each the raw ``token_selected_experts``
  ``[T_{iter,rank}, k]`` of that rank's tokens; assumed layout: for one iteration and rank every
  layer sees the same tokens in the same order) a per-token trace is built instead, tokens ordered by
  iteration then rank.
- vLLM (provisional proposal) JSONL: records ``{"record_type": "eplb_load_stats", "version": 1,
  "step", "num_ranks", "expert_load": [[...]] [L, P], "p2l_map": [[...]] [L, P]}`` (optional
  ``"layer_ids"``), one window per record; other record types are skipped.

Layer axes: SGLang rows are every hidden layer (dense layers are all-zero rows, dropped unless
``moe_layer_ids`` names the MoE rows); TensorRT-LLM keys are real layer ids; vLLM rows are MoE layers
(real ids from the record's ``layer_ids`` or ``moe_layer_ids``). Real layer ids are kept.

Everything is loaded safely (``torch.load(weights_only=True)``, safetensors, JSON); malformed input
raises :class:`~profiling.fileio.InputFileError` naming the file and the field.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from profiling.fileio import DEFAULT_MAX_ARRAY_BYTES, InputFileError, load_json, safe_torch_load
from profiling.trace import RoutingTrace, token_counts

__all__ = ["physical_to_logical_counts", "physical_to_logical_ids", "read_engine_dump"]

logger = logging.getLogger(__name__)

MAX_DUMP_BYTES = DEFAULT_MAX_ARRAY_BYTES
VLLM_LOAD_RECORD = "eplb_load_stats"
VLLM_LOAD_VERSION = 1

_SGLANG_FILE = re.compile(r"^expert_distribution_recorder_(?P<time>[0-9.]+?)(?:_(?P<rank>\d+))?\.pt$")
_TRT_COUNTS = re.compile(r"^rank(?P<rank>\d+)\.safetensors$")
_TRT_RAW = re.compile(r"^rank(?P<rank>\d+)_raw\.safetensors$")
_TRT_KEY = re.compile(r"^(?P<iter>\d+)_(?P<layer>\d+)$")


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
    if not p.is_file():
        raise InputFileError(f"{p}: no such file")
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


# ---------------------------------------------------------------------------------------------
# SGLang
# ---------------------------------------------------------------------------------------------


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


def _read_sglang_detail(dumps, name: str, E: int | None, moe_layer_ids) -> RoutingTrace:
    p2l = None
    records: list[tuple[int, int, Path, dict]] = []
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
        ids = np.concatenate(chunks, axis=1).transpose(1, 0, 2)  # [T, H, K]
        rows = _moe_rows(f0, np.asarray((ids >= 0).any(axis=(0, 2))), moe_layer_ids, "per_token dump")
        ids = ids[:, rows]
        used = (ids >= 0).any(axis=(0, 1))  # [K] drop top-k columns that are padding everywhere
        if used.any():
            ids = ids[:, :, : int(np.flatnonzero(used).max()) + 1]
        else:
            ids = ids[:, :, :1]
        # one step per forward_pass_id (all ranks' tokens of that pass)
        bounds, total, last = [0], 0, None
        for fp, n in pass_of_chunk:
            if last is not None and fp != last:
                bounds.append(total)
            total += n
            last = fp
        bounds.append(total)
        return RoutingTrace(
            num_logical_experts=E,
            topk_ids=ids,
            layer_ids=tuple(rows),
            source_rank=np.concatenate(ranks),
            step_offsets=np.asarray(bounds, dtype=np.int64),
            name=name,
            metadata=meta,
        )

    # Sum each pass's ranks in slot space first (one shared map), then fold slots into experts once.
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


# ---------------------------------------------------------------------------------------------
# TensorRT-LLM
# ---------------------------------------------------------------------------------------------


def _parse_key(p: Path, key: str) -> tuple[int, int]:
    m = _TRT_KEY.match(key)
    if m is None:
        raise InputFileError(f"{p}: tensor key {key!r} is not '<iter>_<layer>'")
    return int(m.group("iter")), int(m.group("layer"))


def _read_trtllm(folder: Path, only: Path | None, E: int | None, moe_layer_ids) -> RoutingTrace:
    meta_file = folder / "meta_info.json"
    meta_info: dict = {}
    if meta_file.is_file():
        meta_info = load_json(meta_file)
        if not isinstance(meta_info, dict):
            raise InputFileError(
                f"{meta_file}: must be a JSON object with num_experts, num_experts_per_token"
            )
        file_E = _int(meta_file, meta_info, "num_experts")
        if E is not None and E != file_E:
            raise InputFileError(f"{meta_file}: num_experts={file_E} but num_logical_experts={E} was given")
        E = file_E
    elif only is None:
        raise InputFileError(
            f"{folder}: no meta_info.json; expected a TensorRT-LLM EXPERT_STATISTIC_PATH folder"
        )
    top_k = meta_info.get("num_experts_per_token")
    top_k = int(top_k) if isinstance(top_k, int) and not isinstance(top_k, bool) and top_k > 0 else None

    counts_files: dict[int, Path] = {}
    raw_files: dict[int, Path] = {}
    candidates = [only] if only is not None else sorted(folder.glob("rank*.safetensors"))
    for f in candidates:
        if (m := _TRT_RAW.match(f.name)) is not None:
            raw_files[int(m.group("rank"))] = f
        elif (m := _TRT_COUNTS.match(f.name)) is not None:
            counts_files[int(m.group("rank"))] = f
        else:
            raise InputFileError(
                f"{f}: not a TensorRT-LLM statistics file name (rank<r>.safetensors or rank<r>_raw.safetensors)"
            )
    if not counts_files and not raw_files:
        raise InputFileError(f"{folder}: no rank<r>.safetensors files")
    info = {
        "source": str(folder if only is None else only),
        "engine": "trtllm",
        "meta_info": {k: v for k, v in meta_info.items() if isinstance(v, (int, float, str, bool))},
        "ranks": sorted(set(counts_files) | set(raw_files)),
    }
    name = folder.name if only is None else only.stem

    # counts: sum over ranks per (iter, layer)
    total: dict[tuple[int, int], np.ndarray] = {}
    for _rank, f in sorted(counts_files.items()):
        for key, value in _safetensors_load(f).items():
            it, layer = _parse_key(f, key)
            arr = _array(f, value, key, 1, "iuf")
            if E is None:
                E = arr.size
            if arr.size != E:
                raise InputFileError(f"{f}: tensor {key!r} has {arr.size} entries, expected num_experts={E}")
            if arr.size and arr.min() < 0:
                raise InputFileError(f"{f}: tensor {key!r} has a negative count")
            total[(it, layer)] = total.get((it, layer), 0) + arr.astype(
                np.float64 if arr.dtype.kind == "f" else np.int64
            )

    if raw_files:
        return _read_trtllm_raw(raw_files, total, E, top_k, moe_layer_ids, name, info)

    iters = sorted({it for it, _ in total})
    layers = sorted({layer for _, layer in total})
    missing = [(it, layer) for it in iters for layer in layers if (it, layer) not in total]
    if missing:
        it, layer = missing[0]
        raise InputFileError(
            f"{folder}: no statistics for key '{it}_{layer}' ({len(missing)} iteration/layer pair(s) missing); "
            f"the dump is incomplete: re-record or remove the partial iterations"
        )
    if not total or E is None:
        raise InputFileError(f"{folder}: the rank<r>.safetensors files hold no statistics")
    layers = _pick(folder, layers, moe_layer_ids)
    counts = np.stack([np.stack([total[(it, layer)] for layer in layers]) for it in iters])  # [W, L, E]
    return RoutingTrace(
        num_logical_experts=int(E),
        window_counts=counts,
        layer_ids=tuple(layers),
        window_labels=tuple(f"iter{it}" for it in iters),
        name=name,
        metadata=info,
    )


def _pick(p: Path, layers: list[int], moe_layer_ids) -> list[int]:
    if moe_layer_ids is None:
        return layers
    ids = [int(i) for i in moe_layer_ids]
    missing = [i for i in ids if i not in layers]
    if missing:
        raise InputFileError(f"{p}: moe_layer_ids {missing} are not in the dump (it has layers {layers})")
    return ids


def _read_trtllm_raw(raw_files, total, E, top_k, moe_layer_ids, name, info) -> RoutingTrace:
    raw: dict[tuple[int, int, int], np.ndarray] = {}  # (iter, rank, layer) -> [T, k]
    for rank, f in sorted(raw_files.items()):
        for key, value in _safetensors_load(f).items():
            it, layer = _parse_key(f, key)
            arr = np.asarray(value)
            if arr.ndim == 1 and top_k and arr.size % top_k == 0:
                arr = arr.reshape(-1, top_k)  # flat token_selected_experts
            arr = _array(f, arr, key, 2)
            raw[(it, rank, layer)] = arr
    f0 = next(iter(raw_files.values()))
    if E is None:
        E = max(int(a.max()) for a in raw.values() if a.size) + 1
    iters = sorted({it for it, _, _ in raw})
    ranks = sorted({r for _, r, _ in raw})
    layers = _pick(f0, sorted({layer for _, _, layer in raw}), moe_layer_ids)
    K = max(a.shape[1] for a in raw.values())
    chunks, src, bounds = [], [], [0]
    for it in iters:
        for rank in ranks:
            per_layer = []
            for layer in layers:
                a = raw.get((it, rank, layer))
                if a is None:
                    raise InputFileError(
                        f"{raw_files[rank]}: no raw tensor '{it}_{layer}' while other layers of iteration {it} have one"
                    )
                per_layer.append(np.pad(a, ((0, 0), (0, K - a.shape[1])), constant_values=-1))
            n = {a.shape[0] for a in per_layer}
            if len(n) != 1:
                raise InputFileError(
                    f"{raw_files[rank]}: iteration {it} has different token counts per layer {sorted(n)}; expected the "
                    f"same tokens in every layer (the assumed raw layout)"
                )
            chunks.append(np.stack(per_layer, axis=1))  # [T, L, K]
            src.append(np.full(per_layer[0].shape[0], rank, dtype=np.int32))
        bounds.append(bounds[-1] + sum(c.shape[0] for c in chunks[-len(ranks) :]))
    ids = np.concatenate(chunks)  # [T, L, K]
    if ids.size and (ids.min() < -1 or ids.max() >= E):
        raise InputFileError(
            f"{f0}: raw expert ids span [{ids.min()}, {ids.max()}], expected [-1, {E}) for num_experts={E}"
        )
    info = {**info, "per_token": "rank<r>_raw.safetensors"}
    if total:  # cross-check against the bincount files where they cover the same (iter, layer)
        agree = True
        for w, it in enumerate(iters):
            sub = token_counts(ids[bounds[w] : bounds[w + 1]], int(E))  # [L, E]
            for j, layer in enumerate(layers):
                if (it, layer) in total and not np.array_equal(sub[j], total[(it, layer)]):
                    agree = False
        info["raw_matches_counts"] = agree
        if not agree:
            logger.warning("%s: raw token ids do not add up to the rank<r>.safetensors counts", name)
    return RoutingTrace(
        num_logical_experts=int(E),
        topk_ids=ids,
        layer_ids=tuple(layers),
        source_rank=np.concatenate(src),
        step_offsets=np.asarray(bounds, dtype=np.int64),
        name=name,
        metadata=info,
    )


# ---------------------------------------------------------------------------------------------
# vLLM (provisional JSONL)
# ---------------------------------------------------------------------------------------------


def _read_vllm_jsonl(files: list[Path], name: str, E: int | None, moe_layer_ids) -> RoutingTrace:
    loads, maps, labels, steps = [], [], [], []
    file_ids = None
    skipped = 0
    shape = None
    num_ranks = None
    for f in files:
        _check_size(f, 1024**3)
        with open(f, "rb") as fh:
            for n, raw_line in enumerate(fh, 1):
                line = raw_line.strip()
                if not line:
                    continue
                where = f"line {n}: "
                try:
                    rec = json.loads(line.decode("utf-8"))
                except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                    raise InputFileError(f"{f}: {where}not a JSON record ({exc})") from None
                if not isinstance(rec, dict):
                    raise InputFileError(f"{f}: {where}must be a JSON object")
                if rec.get("record_type") != VLLM_LOAD_RECORD:
                    skipped += 1
                    continue
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
                if shape is not None and load.shape != shape:
                    raise InputFileError(
                        f"{f}: {where}shape {load.shape} differs from earlier records {shape}"
                    )
                shape = load.shape
                if ranks < 1 or shape[1] % ranks:
                    raise InputFileError(
                        f"{f}: {where}num_ranks={ranks} does not divide {shape[1]} physical experts"
                    )
                num_ranks = ranks
                if load.size and load.min() < 0:
                    raise InputFileError(f"{f}: {where}expert_load has a negative load")
                if m.min() < 0 or (E is not None and m.max() >= E):
                    raise InputFileError(
                        f"{f}: {where}p2l_map ids span [{m.min()}, {m.max()}], expected [0, {E})"
                    )
                if "layer_ids" in rec:
                    ids = rec["layer_ids"]
                    if (
                        not isinstance(ids, list)
                        or len(ids) != shape[0]
                        or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
                    ):
                        raise InputFileError(f"{f}: {where}layer_ids must list {shape[0]} integer layer ids")
                    if file_ids is not None and file_ids != ids:
                        raise InputFileError(
                            f"{f}: {where}layer_ids {ids} differ from earlier records {file_ids}"
                        )
                    file_ids = ids
                loads.append(load)
                maps.append(m)
                steps.append(step)
                labels.append(f"step{step}")
    if not loads:
        raise InputFileError(f"{name}: no '{VLLM_LOAD_RECORD}' records ({skipped} other record(s) skipped)")
    if E is None:
        E = max(int(m.max()) for m in maps) + 1
    logical = np.stack([physical_to_logical_counts(a, m, E) for a, m in zip(loads, maps)])  # [W, L, E]
    L = logical.shape[1]
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
    return RoutingTrace(
        num_logical_experts=int(E),
        window_counts=logical[:, rows],
        layer_ids=tuple(layer_ids),
        window_labels=tuple(labels),
        name=name,
        metadata={
            "source": [str(f) for f in files],
            "engine": "vllm",
            "provisional_format": True,
            "num_ranks": num_ranks,
            "steps": steps,
            "skipped_records": skipped,
        },
    )


# ---------------------------------------------------------------------------------------------
# entry point
# ---------------------------------------------------------------------------------------------


def read_engine_dump(
    path: str | os.PathLike,
    *,
    num_logical_experts: int | None = None,
    moe_layer_ids: Sequence[int] | None = None,
) -> RoutingTrace:
    """Read an engine's routing statistics dump (file or folder) as a trace.

    Args:
        path: an SGLang ``expert_distribution_recorder_*.pt`` file or a folder of them; a
            TensorRT-LLM statistics folder (``meta_info.json`` + ``rank<r>.safetensors``) or one of its
            ``.safetensors`` files (that rank only); a vLLM ``.jsonl`` file or a folder of them.
        num_logical_experts: ``E`` when the dump does not say it (default: from the dump, or the
            largest id in the physical->logical map + 1); checked against the dump when it does.
        moe_layer_ids: SGLang: the hidden-layer rows that are MoE layers (default: rows with any
            load); TensorRT-LLM: the layer ids to keep; vLLM: the real ids of the rows.

    Returns:
        A :class:`RoutingTrace` (counts-only with one window per step/pass/iteration, or per-token
        with ``step_offsets`` and ``source_rank`` for SGLang ``per_token`` and TensorRT-LLM raw dumps).

    Raises:
        InputFileError (a ValueError) naming the file and field.
    """
    p = Path(path)
    E = None if num_logical_experts is None else int(num_logical_experts)
    if E is not None and E < 1:
        raise ValueError(f"num_logical_experts must be >= 1, got {E}")
    if p.is_dir():
        if (p / "meta_info.json").is_file():
            return _read_trtllm(p, None, E, moe_layer_ids)
        sg = sorted(p.glob("expert_distribution_recorder_*.pt"))
        if sg:
            return _read_sglang(sg, p.name, E, moe_layer_ids)
        jl = sorted(p.glob("*.jsonl"))
        if jl:
            return _read_vllm_jsonl(jl, p.name, E, moe_layer_ids)
        raise InputFileError(
            f"{p}: folder holds no engine dump: expected meta_info.json + rank<r>.safetensors (TensorRT-LLM), "
            f"expert_distribution_recorder_*.pt (SGLang) or *.jsonl (vLLM)"
        )
    if not p.is_file():
        raise InputFileError(f"{p}: no such file or folder")
    if p.suffix in (".pt", ".pth"):
        return _read_sglang([p], p.stem, E, moe_layer_ids)
    if p.suffix == ".safetensors":
        return _read_trtllm(p.parent, p, E, moe_layer_ids)
    if p.suffix == ".jsonl":
        return _read_vllm_jsonl([p], p.stem, E, moe_layer_ids)
    raise InputFileError(
        f"{p}: unknown engine dump type {p.suffix!r}; expected .pt, .safetensors, .jsonl or a folder"
    )
