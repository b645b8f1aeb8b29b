"""RoutingTrace: which experts each token selected, per MoE layer.

Shapes (T = tokens, L = MoE layers, k = top-k, E = logical experts, W = windows):

- ``topk_ids``: int16/int32 ``[T, L, k]``, selected logical expert ids; ``-1`` means no expert
  (padding, dropped token, or a k smaller than the widest layer).
- ``source_rank``: int32 ``[T]`` or None, the attention-DP rank that holds each token's request.
- ``seq_offsets``: int64 ``[S + 1]`` or None, prompt boundaries (``0 = o_0 < ... < o_S = T``).
- ``step_offsets``: int64 ``[steps + 1]`` or None, engine forward-pass boundaries.
- ``window_counts``: int64/float64 ``[W, L, E]`` or None: a counts-only trace (no per-token ids), one
  row per recorded window (engine step, question, domain, ...); ``window_labels`` names them.

A trace has per-token ids, or window counts, or both (counts then describe the same tokens).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from moe_placement.base.limits import MAX_EXPERTS, MAX_RANKS, MAX_TOTAL_TOKENS, check_layer_ids, check_whole

__all__ = ["EXPERTS_INFERRED", "RoutingTrace", "TRACE_SCHEMA", "TRACE_SCHEMA_VERSION"]

TRACE_SCHEMA = "moe-placement/routing-trace"
TRACE_SCHEMA_VERSION = 1


def _id_dtype(num_logical_experts: int):
    return np.int16 if num_logical_experts < np.iinfo(np.int16).max else np.int32


def _check_offsets(name: str, offsets, total: int) -> np.ndarray | None:
    if offsets is None:
        return None
    off = np.asarray(offsets)
    if off.dtype.kind not in "iu" or off.ndim != 1 or off.size < 2:
        raise ValueError(
            f"{name} must be a 1-D integer array of at least 2 boundaries, got {off.dtype} {off.shape}"
        )
    off = off.astype(np.int64)
    if off[0] != 0 or off[-1] != total:
        raise ValueError(
            f"{name} must start at 0 and end at the token count {total}, got {off[0]} .. {off[-1]}"
        )
    if np.any(np.diff(off) < 0):
        i = int(np.argmax(np.diff(off) < 0))
        raise ValueError(
            f"{name} must be non-decreasing; boundary {i + 1} ({off[i + 1]}) < boundary {i} ({off[i]})"
        )
    return off


def _check_total_load(wc: np.ndarray) -> None:
    """The summed load of ``window_counts`` must be finite and at most ``MAX_TOTAL_TOKENS``: a larger
    (finite) sum overflows float64 arithmetic downstream (peak / mean becomes NaN)."""
    with np.errstate(over="ignore"):  # an overflow to inf is what is checked
        total = float(np.sum(wc, dtype=np.float64)) if wc.size else 0.0
    if not np.isfinite(total) or total > MAX_TOTAL_TOKENS:
        raise ValueError(
            f"window_counts sum to {total:g} tokens, over the accepted {MAX_TOTAL_TOKENS:.0f} "
            f"(MAX_TOTAL_TOKENS = 2**53, where float64 sums stop being exact); the counts are corrupt or "
            f"in the wrong unit"
        )


def _check_num_experts(E) -> int:
    if isinstance(E, bool) or not isinstance(E, (int, np.integer)) or E < 1:
        raise ValueError(f"num_logical_experts must be a positive integer, got {E!r}")
    if E > MAX_EXPERTS:
        raise ValueError(
            f"num_logical_experts is {E}, outside the accepted range 1..{MAX_EXPERTS} (MAX_EXPERTS); "
            f"pass the model's real expert count"
        )
    return int(E)


def _labels(value) -> tuple[str, ...]:
    """Window names as strings; a bare string (whose letters would become names) is refused."""
    if isinstance(value, (str, bytes)):
        raise ValueError(f"window_labels must be a sequence of names, got the string {value!r}")
    return tuple(str(x) for x in value)


def _sequence(value, name: str) -> tuple:
    """``value`` as a tuple when it is a sequence (not a string), else a ValueError naming ``name``."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, np.ndarray)):
        raise ValueError(f"{name} must be a sequence of layer ids, got {value!r}; or leave it out")
    return tuple(value)


def _whole_list(what: str, indices, words: str) -> list[int]:
    """``indices`` as a list of ints, or a ValueError: a bare number, None or a float index is named."""
    if isinstance(indices, (str, bytes)) or not isinstance(indices, (Sequence, range, np.ndarray)):
        raise ValueError(f"{what} needs a sequence of {words}, got {indices!r}; e.g. [0, 1]")
    return [check_whole(f"{what}'s index", i, None, fix=f"pass whole-number {words}") for i in indices]


# id arrays already checked (views of them, slices of a checked trace, skip the duplicate check)
_CHECKED_IDS: weakref.WeakValueDictionary[int, np.ndarray] = weakref.WeakValueDictionary()
# metadata key a reader sets when the expert count was only inferred from the largest id in the file
EXPERTS_INFERRED = "experts_inferred"


def _checked_before(ids: np.ndarray) -> bool:
    a = ids
    while isinstance(a, np.ndarray):
        if _CHECKED_IDS.get(id(a)) is a:
            return True
        a = a.base
    return False


def _check_distinct_picks(ids: np.ndarray, layer_ids: tuple[int, ...]) -> None:
    """A token names each expert at most once per layer in its top-k (-1, no expert, may repeat): a
    router picks ``k`` distinct experts, so a repeat is a corrupt file (or padding that is not -1).
    ``ids`` is then remembered: a view of it (a slice of the trace) is not checked again."""
    if ids.shape[2] < 2 or not ids.size or _checked_before(ids):
        return
    rep = np.zeros(ids.shape[:2], dtype=bool)  # [T, L]
    for i in range(ids.shape[2]):
        for j in range(i + 1, ids.shape[2]):
            rep |= (ids[:, :, i] == ids[:, :, j]) & (ids[:, :, i] >= 0)
    if rep.any():
        t, l = (int(x) for x in np.argwhere(rep)[0])
        picks = [int(x) for x in ids[t, l]]
        dup = next(e for e in picks if picks.count(e) > 1)
        raise ValueError(
            f"topk_ids: token {t} names expert {dup} twice in layer {layer_ids[l]} (row {l}; its top-{ids.shape[2]} "
            f"is {picks}); a router picks distinct experts ({int(rep.sum())} token-layer pairs repeat one): the "
            f"trace is corrupt, or its padding is not -1"
        )
    _CHECKED_IDS[id(ids)] = ids


def _checked_source_rank(source_rank, T: int) -> np.ndarray:
    """``source_rank`` as read-only int32 ``[T]`` ranks in ``0..MAX_RANKS - 1``, else a ValueError."""
    sr = np.asarray(source_rank)
    if sr.dtype.kind not in "iu" or sr.shape != (T,):
        raise ValueError(f"source_rank must be an integer array of shape ({T},), got {sr.dtype} {sr.shape}")
    _check_source_rank(sr)
    sr = sr.astype(np.int32)
    sr.setflags(write=False)
    return sr


def _check_source_rank(sr: np.ndarray) -> None:
    if sr.size and (sr.min() < 0 or sr.max() >= MAX_RANKS):
        raise ValueError(
            f"source_rank holds ranks in [{sr.min()}, {sr.max()}], outside the accepted range "
            f"0..{MAX_RANKS - 1} (MAX_RANKS)"
        )


@dataclass(frozen=True, eq=False)
class RoutingTrace:
    """Recorded routing of one workload. Immutable; arrays are read-only."""

    num_logical_experts: int
    topk_ids: np.ndarray | None = None
    layer_ids: tuple[int, ...] = ()
    source_rank: np.ndarray | None = None
    seq_offsets: np.ndarray | None = None
    step_offsets: np.ndarray | None = None
    window_counts: np.ndarray | None = None
    window_labels: tuple[str, ...] = ()
    name: str = ""
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Check every field and freeze the arrays (read-only, canonical dtypes); named steps below."""
        E = _check_num_experts(self.num_logical_experts)
        object.__setattr__(self, "num_logical_experts", E)
        if self.topk_ids is None and self.window_counts is None:
            raise ValueError("a RoutingTrace needs topk_ids [T, L, k] or window_counts [W, L, E]")
        L = None
        if self.topk_ids is not None:
            ids = _frozen(_checked_topk_ids(self.topk_ids, E))
            object.__setattr__(self, "topk_ids", ids)
            L = ids.shape[1]
        if self.window_counts is not None:
            wc = _frozen(_checked_window_counts(self.window_counts, E, L))
            object.__setattr__(self, "window_counts", wc)
            L = wc.shape[1]
            object.__setattr__(self, "window_labels", _checked_labels(self.window_labels, wc.shape[0]))
        elif len(self.window_labels):
            raise ValueError(
                f"window_labels names {len(self.window_labels)} windows but the trace has no window_counts; drop them"
            )
        assert L is not None  # one of topk_ids / window_counts was checked above
        ids_ = check_layer_ids(_sequence(self.layer_ids, "layer_ids") or range(L))
        if len(ids_) != L:
            raise ValueError(f"layer_ids has {len(ids_)} entries but the trace has {L} layers")
        object.__setattr__(self, "layer_ids", ids_)
        if self.topk_ids is not None:
            _check_distinct_picks(self.topk_ids, ids_)
        T = self.num_tokens
        if self.source_rank is not None:
            object.__setattr__(self, "source_rank", _checked_source_rank(self.source_rank, T))
        for name in ("seq_offsets", "step_offsets"):
            off = _check_offsets(name, getattr(self, name), T)
            object.__setattr__(self, name, None if off is None else _frozen(off))
        if not isinstance(self.metadata, Mapping):
            raise ValueError(f"metadata must be a mapping (a dict), got {type(self.metadata).__name__}")
        object.__setattr__(self, "metadata", dict(self.metadata))

    # ---- shape -------------------------------------------------------------------------------
    @property
    def has_tokens(self) -> bool:
        return self.topk_ids is not None

    @property
    def num_tokens(self) -> int:
        if self.topk_ids is not None:
            return int(self.topk_ids.shape[0])
        return 0

    @property
    def num_layers(self) -> int:
        if self.topk_ids is not None:
            return int(self.topk_ids.shape[1])
        return int(self.window_counts.shape[1])  # type: ignore[union-attr]

    @property
    def experts_inferred(self) -> bool:
        """The file did not say how many experts the model has: ``num_logical_experts`` is the largest
        expert id seen + 1 (a model whose last experts were never picked has more)."""
        return bool(self.metadata.get(EXPERTS_INFERRED, False))

    def with_expert_count(self, num_logical_experts: int, source: str) -> RoutingTrace:
        """This trace over the ``num_logical_experts`` experts that ``source`` (a model, a placement)
        says the model has, when the trace's own count was only inferred (:attr:`experts_inferred`)
        and its ids fit; a trace that states its count is returned as it is (the caller compares).

        Raises:
            ValueError: the trace picks an expert id that ``source``'s count does not have.
        """
        E = _check_num_experts(num_logical_experts)
        if not self.experts_inferred or E == self.num_logical_experts:
            return self
        if E < self.num_logical_experts:
            raise ValueError(
                f"{source} has {E} experts but the trace picks expert {self.num_logical_experts - 1}; "
                f"pass the model the trace was recorded from"
            )
        meta = {k: v for k, v in self.metadata.items() if k != EXPERTS_INFERRED}
        return dataclasses.replace(self, num_logical_experts=E, metadata={**meta, "experts_from": source})

    @property
    def top_k(self) -> int | None:
        return int(self.topk_ids.shape[2]) if self.topk_ids is not None else None

    @property
    def num_windows(self) -> int:
        """Number of natural windows: prompts, steps, or recorded count windows."""
        return len(self.natural_windows())

    # ---- counts ------------------------------------------------------------------------------
    @cached_property
    def _counts(self) -> np.ndarray:
        if self.topk_ids is None:
            c = self.window_counts.sum(axis=0)  # type: ignore[union-attr]
        else:
            c = token_counts(self.topk_ids, self.num_logical_experts)
        c.setflags(write=False)
        return c

    def counts(self) -> np.ndarray:
        """Per-layer expert load ``[L, E]`` (int64, or float64 for fractional window counts)."""
        return self._counts

    # ---- windows -----------------------------------------------------------------------------
    def natural_windows(self) -> list[tuple[int, int]]:
        """Boundaries of the trace's own windows, as half-open index ranges.

        Per-token traces: prompts if ``seq_offsets`` exists, else steps, else one window.
        Counts-only traces: one per ``window_counts`` row.
        """
        if self.topk_ids is None:
            return [(i, i + 1) for i in range(self.window_counts.shape[0])]  # type: ignore[union-attr]
        off = self.seq_offsets if self.seq_offsets is not None else self.step_offsets
        if off is None:
            return [(0, self.num_tokens)]
        return [(int(a), int(b)) for a, b in zip(off[:-1], off[1:])]

    def slice_tokens(self, start: int, stop: int) -> RoutingTrace:
        """Tokens ``[start, stop)`` as a new trace (offsets clipped and re-based)."""
        if self.topk_ids is None:
            raise ValueError("slice_tokens needs a per-token trace; this one has window counts only")
        T = self.num_tokens
        start = max(0, check_whole("start", start, None, fix="pass token indices"))
        stop = min(T, check_whole("stop", stop, None, fix="pass token indices"))
        if stop <= start:
            raise ValueError(f"empty token range [{start}, {stop}) of a {T}-token trace")

        def clip(off):
            if off is None:
                return None
            inner = off[(off > start) & (off < stop)] - start
            return np.concatenate([[0], inner, [stop - start]]).astype(np.int64)

        return RoutingTrace(
            num_logical_experts=self.num_logical_experts,
            topk_ids=self.topk_ids[start:stop],
            layer_ids=self.layer_ids,
            source_rank=None if self.source_rank is None else self.source_rank[start:stop],
            seq_offsets=clip(self.seq_offsets),
            step_offsets=clip(self.step_offsets),
            name=f"{self.name}[{start}:{stop}]",
            metadata=self.metadata,
        )

    def select_windows(self, indices: Sequence[int]) -> RoutingTrace:
        """Keep the given natural windows (prompts/steps for token traces, rows for counts-only)."""
        wins = self.natural_windows()
        idx = _whole_list("select_windows", indices, "window indices")
        if not idx:
            raise ValueError("select_windows needs at least one window")
        if len(set(idx)) != len(idx):
            dup = next(i for i in idx if idx.count(i) > 1)
            raise ValueError(f"select_windows lists window {dup} twice; its tokens would be counted twice")
        for i in idx:
            if not 0 <= i < len(wins):
                raise ValueError(f"window {i} out of range: the trace has {len(wins)} windows")
        if self.topk_ids is None:
            return RoutingTrace(
                num_logical_experts=self.num_logical_experts,
                window_counts=self.window_counts[idx],  # type: ignore[index]
                window_labels=tuple(self.window_labels[i] for i in idx) if self.window_labels else (),
                layer_ids=self.layer_ids,
                name=self.name,
                metadata=self.metadata,
            )
        parts = [np.arange(*wins[i]) for i in idx]
        tok = np.concatenate(parts)
        lengths = np.array([len(p) for p in parts])
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        use_seq = self.seq_offsets is not None
        return RoutingTrace(
            num_logical_experts=self.num_logical_experts,
            topk_ids=self.topk_ids[tok],
            layer_ids=self.layer_ids,
            source_rank=None if self.source_rank is None else self.source_rank[tok],
            seq_offsets=offsets if use_seq else None,
            step_offsets=offsets if (not use_seq and self.step_offsets is not None) else None,
            name=self.name,
            metadata=self.metadata,
        )

    def select_layers(self, indices: Sequence[int]) -> RoutingTrace:
        """Keep the given layer rows (by row index, ``0 .. num_layers - 1``)."""
        idx = _whole_list("select_layers", indices, "layer rows")
        if not idx:
            raise ValueError("select_layers needs at least one layer row")
        bad = [i for i in idx if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"layer rows {bad[:8]} are outside this trace's rows 0..{self.num_layers - 1}")
        return RoutingTrace(
            num_logical_experts=self.num_logical_experts,
            topk_ids=None if self.topk_ids is None else self.topk_ids[:, idx],
            layer_ids=tuple(self.layer_ids[i] for i in idx),
            source_rank=self.source_rank,
            seq_offsets=self.seq_offsets,
            step_offsets=self.step_offsets,
            window_counts=None if self.window_counts is None else self.window_counts[:, idx],
            window_labels=self.window_labels,
            name=self.name,
            metadata=self.metadata,
        )

    def split(self, fraction: float = 0.5) -> tuple[RoutingTrace, RoutingTrace]:
        """Fit / held-out split at a window boundary: the first ``fraction`` of windows, then the rest.

        Windows are prompts (or steps) for per-token traces and rows for counts-only traces; a
        per-token trace with no boundaries is split by tokens.
        """
        real = isinstance(fraction, (int, float, np.integer, np.floating)) and not isinstance(fraction, bool)
        if not real or not 0.0 < fraction < 1.0:
            raise ValueError(f"fraction must be in (0, 1) (a number), got {fraction!r}; e.g. 0.5")
        wins = self.natural_windows()
        if len(wins) >= 2:
            cut = min(max(1, int(round(len(wins) * fraction))), len(wins) - 1)
            return self.select_windows(range(cut)), self.select_windows(range(cut, len(wins)))
        T = self.num_tokens
        if T < 2:
            raise ValueError(
                f"cannot split a trace with {max(T, len(wins))} token(s)/window(s) into fit and held-out parts"
            )
        cut = min(max(1, int(round(T * fraction))), T - 1)
        return self.slice_tokens(0, cut), self.slice_tokens(cut, T)

    def windows(self, num_windows: int) -> list[RoutingTrace]:
        """Split into ``num_windows`` consecutive groups of natural windows (or of tokens)."""
        num_windows = check_whole("num_windows", num_windows, 1, fix="e.g. 8")
        wins = self.natural_windows()
        if len(wins) >= num_windows:
            bounds = np.linspace(0, len(wins), num_windows + 1).round().astype(int)
            return [self.select_windows(range(a, b)) for a, b in zip(bounds[:-1], bounds[1:])]
        T = self.num_tokens
        if T < num_windows:
            raise ValueError(f"cannot make {num_windows} windows from {max(T, len(wins))} tokens/windows")
        bounds = np.linspace(0, T, num_windows + 1).round().astype(int)
        return [self.slice_tokens(a, b) for a, b in zip(bounds[:-1], bounds[1:])]

    def window_load(self) -> np.ndarray:
        """Load per natural window ``[W, L, E]`` (float64)."""
        if self.topk_ids is None:
            return np.asarray(self.window_counts, dtype=np.float64)
        out = [token_counts(self.topk_ids[a:b], self.num_logical_experts) for a, b in self.natural_windows()]
        return np.stack(out).astype(np.float64)

    def summary(self) -> dict:
        return {
            "name": self.name,
            "tokens": self.num_tokens,
            "layers": self.num_layers,
            "top_k": self.top_k,
            "num_logical_experts": self.num_logical_experts,
            "experts_inferred": self.experts_inferred,
            "layer_ids": list(self.layer_ids),
            "windows": len(self.natural_windows()),
            "has_source_rank": self.source_rank is not None,
            "synthetic": bool(self.metadata.get("synthetic", False)),
        }

    def __repr__(self) -> str:
        kind = (
            f"tokens={self.num_tokens}, top_k={self.top_k}"
            if self.has_tokens
            else (
                f"windows={self.window_counts.shape[0]} (counts only)"  # type: ignore[union-attr]
            )
        )
        return f"RoutingTrace({self.name!r}, {kind}, layers={self.num_layers}, experts={self.num_logical_experts})"


def token_counts(topk_ids: np.ndarray, num_logical_experts: int) -> np.ndarray:
    """Per-layer counts of selections.

    Args:
        topk_ids: int ``[T, L, k]`` with -1 for none.
        num_logical_experts: ``E``.

    Returns:
        int64 ``[L, E]``.
    """
    T, L, k = topk_ids.shape
    E = int(num_logical_experts)
    ids = topk_ids.transpose(1, 0, 2).reshape(L, T * k).astype(np.int64)  # [L, T*k]
    flat = ids + (np.arange(L, dtype=np.int64) * (E + 1))[:, None] + 1  # -1 -> slot 0 of each layer
    c = np.bincount(flat.ravel(), minlength=L * (E + 1)).reshape(L, E + 1)
    return c[:, 1:].astype(np.int64)


def _frozen(a: np.ndarray) -> np.ndarray:
    """``a`` made read-only (the trace's arrays never change after the checks)."""
    a.setflags(write=False)
    return a


def _checked_topk_ids(topk_ids, E: int) -> np.ndarray:
    """``topk_ids`` as ``[T, L, k]`` of the smallest id dtype for ``E``; ``[T, k]`` is one layer."""
    ids = np.asarray(topk_ids)
    if ids.dtype.kind not in "iu":
        raise ValueError(f"topk_ids must be integers, got dtype {ids.dtype}")
    if ids.ndim == 2:  # [T, k] for one layer
        ids = ids[:, None, :]
    if ids.ndim != 3:
        raise ValueError(f"topk_ids must be [tokens, layers, top_k], got shape {ids.shape}")
    if ids.shape[1] == 0 or ids.shape[2] == 0:
        raise ValueError(f"topk_ids has an empty layer or top-k axis: shape {ids.shape}")
    if ids.size:
        lo, hi = int(ids.min()), int(ids.max())
        if lo < -1 or hi >= E:
            raise ValueError(
                f"topk_ids hold ids in [{lo}, {hi}] but must be in [-1, {E - 1}] for "
                f"num_logical_experts={E} (-1 = no expert); pass the model's real expert count"
            )
    return np.ascontiguousarray(ids, dtype=_id_dtype(E))


def _checked_window_counts(window_counts, E: int, L: int | None) -> np.ndarray:
    """``window_counts`` as ``[W, L, E]`` (float kept, integers as int64); ``[L, E]`` is one window."""
    wc = np.asarray(window_counts)
    if wc.dtype.kind not in "iuf":
        raise ValueError(f"window_counts must be numeric, got dtype {wc.dtype}")
    if wc.ndim == 2:
        wc = wc[None]
    if wc.ndim != 3 or wc.shape[2] != E:
        raise ValueError(
            f"window_counts must be [windows, layers, {E}], got shape {tuple(np.shape(window_counts))}"
        )
    if wc.dtype.kind == "f" and not np.all(np.isfinite(wc)):
        raise ValueError("window_counts contain NaN or inf; counts must be finite")
    if wc.size and wc.min() < 0:
        raise ValueError(f"window_counts must be >= 0, found {wc.min()}")
    _check_total_load(wc)
    if L is not None and wc.shape[1] != L:
        raise ValueError(f"window_counts has {wc.shape[1]} layers but topk_ids has {L}")
    return np.ascontiguousarray(wc if wc.dtype.kind == "f" else wc.astype(np.int64))


def _checked_labels(window_labels, num_windows: int) -> tuple[str, ...]:
    """The window names, one per window (or none)."""
    labels = _labels(window_labels)
    if labels and len(labels) != num_windows:
        raise ValueError(f"window_labels has {len(labels)} names for {num_windows} windows")
    return labels
