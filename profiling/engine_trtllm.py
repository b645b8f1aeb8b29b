"""TensorRT-LLM expert statistics folders (``EXPERT_STATISTIC_PATH``).

A folder holds ``meta_info.json`` and ``rank{r}.safetensors`` with keys ``"{iter}_{layer}"`` ->
bincount ``[E]`` (logical experts), and optionally ``rank{r}_raw.safetensors`` with the same keys ->
raw ``token_selected_experts`` ``[T_{iter,rank}, k]``. Shapes: W = iterations, L = layers kept,
E = logical experts, T = tokens, K = top-k columns. Read through
:func:`profiling.engine_readers.read_engine_dump`.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import numpy as np

from moe_placement.base.fileio import InputFileError, load_json
from moe_placement.base.limits import MAX_EXPERTS
from profiling.engine_common import _array, _int, _pick, _safetensors_load
from profiling.trace import RoutingTrace, token_counts

# The readers' public logger name (users and the CLI's log format see it), kept from before the split.
logger = logging.getLogger("profiling.engine_readers")

_TRT_COUNTS = re.compile(r"^rank(?P<rank>\d+)\.safetensors$")
_TRT_RAW = re.compile(r"^rank(?P<rank>\d+)_raw\.safetensors$")
_TRT_KEY = re.compile(r"^(?P<iter>\d+)_(?P<layer>\d+)$")


def _parse_key(p: Path, key: str) -> tuple[int, int]:
    m = _TRT_KEY.match(key)
    if m is None:
        raise InputFileError(f"{p}: tensor key {key!r} is not '<iter>_<layer>'")
    return int(m.group("iter")), int(m.group("layer"))


def _read_trtllm(folder: Path, only: Path | None, E: int | None, moe_layer_ids) -> RoutingTrace:
    """A statistics folder (or one ``rank<r>*.safetensors`` of it, ``only``).

    Steps: meta_info -> classify rank files -> sum counts over ranks -> per-token trace when raw files
    exist, else counts ``[W, L, E]`` with one window per iteration.
    """
    meta_info, E, top_k = _trtllm_meta(folder, only, E)
    counts_files, raw_files = _trtllm_files(folder, only)
    info = {
        "source": str(folder if only is None else only),
        "engine": "trtllm",
        "meta_info": {k: v for k, v in meta_info.items() if isinstance(v, (int, float, str, bool))},
        "ranks": sorted(set(counts_files) | set(raw_files)),
    }
    name = folder.name if only is None else only.stem
    total, E = _trtllm_totals(counts_files, E)
    if raw_files:
        return _read_trtllm_raw(raw_files, total, E, top_k, moe_layer_ids, name, info)
    return _trtllm_count_trace(folder, total, E, moe_layer_ids, name, info)


def _trtllm_meta(folder: Path, only: Path | None, E: int | None) -> tuple[dict, int | None, int | None]:
    """``meta_info.json`` (``{}`` when reading one file without it), ``E`` checked against it, and top-k."""
    meta_file = folder / "meta_info.json"
    meta_info: dict = {}
    if meta_file.is_file():
        meta_info = load_json(meta_file)
        if not isinstance(meta_info, dict):
            raise InputFileError(
                f"{meta_file}: must be a JSON object with num_experts, num_experts_per_token"
            )
        file_E = _int(meta_file, meta_info, "num_experts")
        if not 1 <= file_E <= MAX_EXPERTS:
            raise InputFileError(
                f"{meta_file}: num_experts={file_E} is outside the accepted range 1..{MAX_EXPERTS} (MAX_EXPERTS)"
            )
        if E is not None and E != file_E:
            raise InputFileError(f"{meta_file}: num_experts={file_E} but num_logical_experts={E} was given")
        E = file_E
    elif only is None:
        raise InputFileError(
            f"{folder}: no meta_info.json; expected a TensorRT-LLM EXPERT_STATISTIC_PATH folder"
        )
    top_k = meta_info.get("num_experts_per_token")
    top_k = int(top_k) if isinstance(top_k, int) and not isinstance(top_k, bool) and top_k > 0 else None
    return meta_info, E, top_k


def _trtllm_files(folder: Path, only: Path | None) -> tuple[dict[int, Path], dict[int, Path]]:
    """Rank -> ``rank<r>.safetensors`` (counts) and rank -> ``rank<r>_raw.safetensors`` (token ids)."""
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
    return counts_files, raw_files


def _trtllm_totals(
    counts_files: dict[int, Path], E: int | None
) -> tuple[dict[tuple[int, int], np.ndarray], int | None]:
    """Counts summed over ranks: ``(iter, layer)`` -> ``[E]`` (int64, float64 once a file has floats).

    ``E`` defaults to the first tensor's length; every tensor must have it.
    """
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
    return total, E


def _trtllm_count_trace(folder: Path, total, E: int | None, moe_layer_ids, name: str, info) -> RoutingTrace:
    """Counts ``[W, L, E]`` from the summed totals; every (iteration, layer) pair must be present."""
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


def _read_trtllm_raw(raw_files, total, E, top_k, moe_layer_ids, name, info) -> RoutingTrace:
    """Per-token trace from the raw files: ids ``[T, L, K]`` ordered by iteration then rank.

    ``step_offsets`` ``[W + 1]`` bound each iteration's tokens; ``source_rank`` ``[T]`` names their rank.
    """
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
        E = max((int(a.max()) for a in raw.values() if a.size), default=0) + 1
    if E > MAX_EXPERTS:
        raise InputFileError(
            f"{f0}: raw expert ids reach {E - 1}, outside the accepted range 0..{MAX_EXPERTS - 1} (MAX_EXPERTS); "
            f"the dump is corrupt"
        )
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
        agree = _raw_matches_counts(ids, bounds, iters, layers, total, int(E))
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


def _raw_matches_counts(ids: np.ndarray, bounds: list[int], iters, layers, total, E: int) -> bool:
    """Whether the raw ids ``[T, L, K]`` of each iteration (tokens ``bounds[w]:bounds[w + 1]``) add up
    to the summed bincounts ``total[(iter, layer)]`` ``[E]`` wherever those exist."""
    agree = True
    for w, it in enumerate(iters):
        sub = token_counts(ids[bounds[w] : bounds[w + 1]], E)  # [L, E]
        for j, layer in enumerate(layers):
            if (it, layer) in total and not np.array_equal(sub[j], total[(it, layer)]):
                agree = False
    return agree
