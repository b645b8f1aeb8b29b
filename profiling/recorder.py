"""The routing recorder: buffers of the experts a model really selects, filled from its forward pass (torch).

The recorder captures the SELECTED expert ids of every MoE layer: the ids the block hands to its
experts, after top-k, grouped routing and score-bias correction. It never recomputes an argmax of the
gate logits.

Shapes (N = tokens of one forward, k = top-k, L = recorded MoE layers, E = logical experts,
C = ring capacity in tokens):

- a hook receives ``topk_ids`` int ``[N, k]`` (any leading dims are flattened; ``-1`` = no expert);
- counts mode keeps ``counts`` int64 ``[L, E + 1]`` on the model's device (column ``E`` counts ids
  ``>= E``, which are reported as an error when read);
- tokens mode also keeps a ring buffer int16/int32 ``[C, L, k]`` on the device.

No hook synchronises with the host: ids are accumulated with ``scatter_add_`` into preallocated tensors,
``-1`` padding is clamped to a valid index with weight 0, and every write position is a python integer
derived from static shapes. Data reach the host only in :meth:`RoutingRecorder.counts`,
:meth:`~RoutingRecorder.to_trace`, :meth:`~RoutingRecorder.mark_window` and when a streaming chunk is
flushed (after a whole forward pass, from a hook on the root module).

Streamed chunks (``stream_dir``) are read back whole with :func:`read_stream`. The hooks that feed a
recorder are registered by :func:`profiling.hooks.attach`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from moe_placement.base.fileio import InputFileError
from moe_placement.base.options import refuse_unknown_keywords
from profiling.hook_checks import check_layer_seq, check_sizes
from profiling.readers import read_trace, write_trace
from profiling.trace import RoutingTrace

__all__ = ["RecordOptions", "RoutingRecorder", "read_stream"]

log = logging.getLogger(__name__)


def _chunk_path(folder: Path, index: int) -> Path:
    return folder / f"chunk_{index:06d}.npz"


def read_stream(stream_dir: str | Path) -> RoutingTrace:
    """Concatenate the chunks a streaming recorder wrote into one per-token trace.

    Chunks are ``chunk_NNNNNN.npz`` native traces, each ``[T_i, L, k]``; prompt boundaries
    (``seq_offsets``) are kept when every chunk has them.
    """
    folder = Path(stream_dir)
    files = sorted(folder.glob("chunk_*.npz"))
    if not files:
        raise InputFileError(f"{folder}: no chunk_*.npz files; nothing was streamed there")
    parts = [read_trace(f) for f in files]
    first = parts[0]
    for f, p in zip(files, parts):
        if (
            p.layer_ids != first.layer_ids
            or p.num_logical_experts != first.num_logical_experts
            or p.top_k != first.top_k
        ):
            raise InputFileError(
                f"{f}: chunk has layers/experts/top-k unlike {files[0].name}; mixed streams in one folder"
            )
    ids = np.concatenate([p.topk_ids for p in parts])

    def joined(key):
        if not all(getattr(p, key) is not None for p in parts):
            return None
        offs, base = [np.zeros(1, np.int64)], 0
        for p in parts:
            offs.append(getattr(p, key)[1:] + base)
            base += p.num_tokens
        return np.unique(np.concatenate(offs))

    seq, step = joined("seq_offsets"), joined("step_offsets")
    meta = dict(first.metadata)
    meta["chunks"] = len(parts)
    return RoutingTrace(
        num_logical_experts=first.num_logical_experts,
        topk_ids=ids,
        layer_ids=first.layer_ids,
        seq_offsets=seq,
        step_offsets=step,
        name=str(meta.get("trace_name", first.name)),
        metadata=meta,
    )


@refuse_unknown_keywords
@dataclass(frozen=True)
class RecordOptions:
    """What a :class:`RoutingRecorder` keeps (checked when the recorder is built).

    Attributes:
        mode: ``"counts"`` (per-layer counts only) or ``"tokens"`` (counts plus per-token ids).
        capacity_tokens: ``C``, ring-buffer capacity in recorded (sampled) tokens (tokens mode).
        sample_every: keep every ``s``-th token in the per-token buffer (counts always see all tokens).
        stream_dir: if set (tokens mode), complete tokens are written to ``stream_dir/chunk_*.npz``
            whenever ``chunk_tokens`` have accumulated, so memory stays bounded by ``C``.
        chunk_tokens: tokens per streamed chunk (default ``C // 2``).
    """

    mode: str = "counts"
    capacity_tokens: int = 1 << 16
    sample_every: int = 1
    stream_dir: str | Path | None = None
    chunk_tokens: int | None = None


class RoutingRecorder:
    """Accumulates selected expert ids of ``L`` MoE layers.

    Args:
        layer_ids: the model's real layer index of each recorded row (``[L]``).
        num_logical_experts: ``E``.
        top_k: ``k``, the width of the per-token buffer (narrower layers are padded with -1).
        options: what to keep (:class:`RecordOptions`; default counts only).
        device: where the buffers live (the model's device).
    """

    def __init__(
        self,
        layer_ids: Sequence[int],
        num_logical_experts: int,
        top_k: int,
        options: RecordOptions | None = None,
        *,
        device: torch.device | str | None = None,
    ) -> None:
        o = options if options is not None else RecordOptions()
        mode, capacity_tokens, sample_every = o.mode, o.capacity_tokens, o.sample_every
        stream_dir, chunk_tokens = o.stream_dir, o.chunk_tokens
        if mode not in ("counts", "tokens"):
            raise ValueError(f"mode must be 'counts' or 'tokens', got {mode!r}")
        check_layer_seq(layer_ids)
        L = len(layer_ids)
        if L < 1:
            raise ValueError(
                "no MoE layers to record: the model has no block with experts and a router; pass adapters="
            )
        if len(set(int(x) for x in layer_ids)) != L:
            raise ValueError(f"layer_ids must be distinct, got {list(layer_ids)}")
        check_sizes(L, num_logical_experts, top_k, o)
        if stream_dir is not None and mode != "tokens":
            raise ValueError(
                "stream_dir streams per-token ids; use mode='tokens' (counts mode is already bounded)"
            )
        self.layer_ids = tuple(int(x) for x in layer_ids)
        self.num_logical_experts = int(num_logical_experts)
        self.top_k = int(top_k)
        self.mode = mode
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.capacity_tokens = int(capacity_tokens)
        self.sample_every = int(sample_every)
        self.stream_dir = Path(stream_dir) if stream_dir is not None else None
        self.chunk_tokens = int(chunk_tokens) if chunk_tokens else max(1, self.capacity_tokens // 2)
        if self.stream_dir is not None:
            if not self.stream_dir.is_dir():
                raise ValueError(f"stream_dir {self.stream_dir} does not exist; create it first")
            if self.chunk_tokens > self.capacity_tokens:
                raise ValueError(
                    f"chunk_tokens={self.chunk_tokens} exceeds capacity_tokens={self.capacity_tokens}; "
                    "use chunk_tokens <= capacity_tokens (half of it leaves room for one forward pass)"
                )
        self._id_dtype = torch.int16 if self.num_logical_experts < 32767 else torch.int32
        self._handles: list = []
        self._windows: list[np.ndarray] = []
        self._window_labels: list[str] = []
        self.reset()

    # ---- state ---------------------------------------------------------------------------------
    def reset(self) -> None:
        """Zero every buffer and counter (keeps the hooks attached)."""
        L, E = len(self.layer_ids), self.num_logical_experts
        self._counts = torch.zeros((L, E + 1), dtype=torch.int64, device=self.device)  # [L, E+1]
        self._window_base = torch.zeros((L, E + 1), dtype=torch.int64, device=self.device)
        self._seen = [0] * L  # raw tokens seen per row (python ints from shapes)
        self._written = [0] * L  # recorded (sampled) tokens per row
        self._flushed = 0  # recorded tokens already streamed to disk
        self._chunks = 0
        self._seq_bounds: list[int] = [0]  # prompt boundaries in raw tokens
        self._step_bounds: list[int] = [0]  # forward-pass boundaries in raw tokens
        self._seq_ok = True
        self._pending_shape = None
        self._windows, self._window_labels = [], []
        if self.mode == "tokens":
            self._ring = torch.full(
                (self.capacity_tokens, L, self.top_k), -1, dtype=self._id_dtype, device=self.device
            )
        else:
            self._ring = None

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def tokens_seen(self) -> int:
        """Tokens routed through every recorded layer so far (minimum over layers)."""
        return min(self._seen)

    # ---- the hot path --------------------------------------------------------------------------
    def record(self, layer_index: int, topk_ids: torch.Tensor) -> None:
        """Record one layer's selected ids for one forward pass.

        Args:
            layer_index: the row (0..L-1) in :attr:`layer_ids`, not the model's layer id.
            topk_ids: int ``[..., k']`` selected ids on any device; ``-1`` = padding (masked).
                ``k' <= top_k``; narrower rows are padded with -1 in the per-token buffer.

        Host-sync free: only shapes (python ints) decide slicing.
        """
        ids = topk_ids.detach()
        if ids.dim() == 1:
            ids = ids.unsqueeze(-1)
        k = ids.shape[-1]
        if k > self.top_k:
            raise ValueError(
                f"layer row {layer_index} selected {k} experts per token but the recorder holds top_k={self.top_k}"
            )
        ids = ids.reshape(-1, k)  # [N, k]
        n = ids.shape[0]
        if ids.device != self.device:
            ids = ids.to(self.device, non_blocking=True)
        E = self.num_logical_experts
        flat = ids.reshape(-1).to(torch.int64)  # [N*k]
        # -1 -> index 0 with weight 0; ids >= E -> overflow column E (reported when read)
        self._counts[layer_index].scatter_add_(0, flat.clamp(0, E), (flat >= 0).to(torch.int64))
        seen = self._seen[layer_index]
        self._seen[layer_index] = seen + n
        if self._ring is None:
            return
        s = self.sample_every
        if s > 1:
            first = (-seen) % s
            ids = ids[first::s]  # static-stride view: keeps raw tokens whose global index % s == 0
            n = ids.shape[0]
        if n == 0:
            return
        C = self.capacity_tokens
        pos = self._written[layer_index]
        if self.stream_dir is not None and pos + n - self._flushed > C:
            raise RuntimeError(
                f"streaming ring overflow: {pos - self._flushed} pending + {n} new tokens exceed capacity_tokens={C}; "
                f"raise capacity_tokens to at least chunk_tokens + the largest forward pass ({self.chunk_tokens} + {n})"
            )
        if n > C:  # only the newest C tokens can be kept
            ids, pos_eff, n_eff = ids[n - C :], pos + n - C, C
        else:
            pos_eff, n_eff = pos, n
        vals = ids.to(self._id_dtype)
        start = pos_eff % C
        head = min(n_eff, C - start)
        self._ring[start : start + head, layer_index, :k] = vals[:head]  # [head, k]
        if head < n_eff:
            self._ring[: n_eff - head, layer_index, :k] = vals[head:]  # wrapped part
        self._written[layer_index] = pos + n

    def _note_forward(self, args, kwargs) -> None:
        """Root pre-hook: remember the batch shape ``[B, S]`` of this forward pass."""
        x = kwargs.get("input_ids")
        if x is None:
            x = kwargs.get("inputs_embeds")
        if x is None and args and isinstance(args[0], torch.Tensor):
            x = args[0]
        shape = None
        if isinstance(x, torch.Tensor):
            if x.dtype.is_floating_point:
                shape = (
                    (x.shape[0], x.shape[1]) if x.dim() >= 3 else (1, x.shape[0]) if x.dim() == 2 else None
                )
            else:
                shape = (
                    (x.shape[0], x.shape[1]) if x.dim() == 2 else (1, x.shape[0]) if x.dim() == 1 else None
                )
        self._pending_shape = shape

    def _after_forward(self) -> None:
        """Root hook: note step / prompt boundaries, then stream a chunk once enough tokens are pending."""
        done = min(self._seen)
        n = done - self._step_bounds[-1]
        if n > 0:
            self._step_bounds.append(done)
            shape = self._pending_shape
            if self._seq_ok and shape is not None and shape[0] * shape[1] == n and shape[1] > 1:
                base = self._seq_bounds[-1]
                self._seq_bounds.extend(base + shape[1] * (b + 1) for b in range(shape[0]))
            elif self._seq_ok:
                self._seq_ok = False  # decode steps or token counts unlike B*S: prompts are not contiguous
                log.info(
                    "prompt boundaries dropped: a forward pass routed %d tokens for input shape %s", n, shape
                )
        self._pending_shape = None
        if self.stream_dir is not None and min(self._written) - self._flushed >= self.chunk_tokens:
            self.flush()

    # ---- copies to the host --------------------------------------------------------------------
    def _host_counts(self) -> np.ndarray:
        c = self._counts.cpu().numpy()  # [L, E+1]
        bad = c[:, -1]
        if bad.any():
            r = int(np.argmax(bad > 0))
            raise ValueError(
                f"layer {self.layer_ids[r]} selected {int(bad[r])} ids >= num_logical_experts={self.num_logical_experts}; "
                "the recorder was built with too few experts (pass the model's real expert count)"
            )
        return c[:, :-1]

    def counts(self) -> np.ndarray:
        """Selections per layer and expert since the last reset, int64 ``[L, E]`` (a host copy)."""
        return self._host_counts().copy()

    def mark_window(self, label: str | None = None) -> np.ndarray:
        """Close a counts window (e.g. one request batch or domain); returns its counts ``[L, E]``."""
        c = self._counts.clone()
        win = (c - self._window_base)[:, :-1].cpu().numpy()
        self._window_base = c
        self._windows.append(win)
        self._window_labels.append(label if label is not None else f"window{len(self._windows) - 1}")
        return win.copy()

    def _complete_range(self) -> tuple[int, int]:
        """Recorded-token range ``[lo, hi)`` still in the ring and seen by every layer."""
        hi = min(self._written)
        lo = max(self._flushed, hi - self.capacity_tokens, 0)
        return lo, hi

    def _ring_slice(self, lo: int, hi: int) -> np.ndarray:
        C = self.capacity_tokens
        idx = torch.arange(lo, hi, device=self.device) % C  # [hi - lo] ring rows in token order
        return self._ring.index_select(0, idx).cpu().numpy()  # [hi - lo, L, k]

    def _offsets(self, bounds: list[int], lo: int, hi: int) -> np.ndarray | None:
        """Raw-token boundaries mapped to recorded tokens ``[lo, hi)``: raw token ``t`` is recorded
        (as token ``t // s``) iff ``t % s == 0``, so boundary ``b`` maps to ``ceil(b / s)``."""
        if len(bounds) < 2:
            return None
        s = self.sample_every
        b = (np.asarray(bounds, dtype=np.int64) + s - 1) // s
        inner = b[(b > lo) & (b < hi)] - lo
        return np.unique(np.concatenate([[0], inner, [hi - lo]])).astype(np.int64)

    def _token_trace(self, lo: int, hi: int, name: str, meta: dict) -> RoutingTrace:
        return RoutingTrace(
            num_logical_experts=self.num_logical_experts,
            topk_ids=self._ring_slice(lo, hi),
            layer_ids=self.layer_ids,
            seq_offsets=self._offsets(self._seq_bounds, lo, hi) if self._seq_ok else None,
            step_offsets=self._offsets(self._step_bounds, lo, hi),
            name=name,
            metadata=meta,
        )

    def _meta(self) -> dict:
        return {
            "recorder_mode": self.mode,
            "sample_every": self.sample_every,
            "tokens_seen": self.tokens_seen,
            "capacity_tokens": self.capacity_tokens if self.mode == "tokens" else None,
        }

    def flush(self) -> Path | None:
        """Write pending complete tokens to the next stream chunk (streaming mode only)."""
        if self.stream_dir is None:
            raise ValueError("flush() needs stream_dir=; without it the ring buffer keeps the newest tokens")
        lo, hi = self._complete_range()
        if hi <= lo:
            return None
        path = _chunk_path(self.stream_dir, self._chunks)
        meta = self._meta() | {"chunk": self._chunks, "first_token": lo}
        write_trace(self._token_trace(lo, hi, f"chunk{self._chunks}", meta), path)
        self._chunks += 1
        self._flushed = hi
        return path

    def to_trace(self, name: str = "recorded") -> RoutingTrace:
        """The recording as a :class:`RoutingTrace` with the model's real ``layer_ids``.

        Counts mode: a counts-only trace, one window per :meth:`mark_window` (plus the open window
        when it holds selections), else one window. Tokens mode: the per-token ids still in the ring
        (the newest ``C`` recorded tokens), or, when streaming, every chunk on disk.
        """
        if self.mode == "counts":
            total = self._host_counts()
            wins = list(self._windows)
            labels = list(self._window_labels)
            rest = total - (np.sum(wins, axis=0) if wins else 0)
            if not wins or rest.any():
                wins.append(rest)
                labels.append(f"window{len(wins) - 1}" if len(wins) > 1 else "all")
            return RoutingTrace(
                num_logical_experts=self.num_logical_experts,
                window_counts=np.stack(wins).astype(np.int64),
                window_labels=tuple(labels),
                layer_ids=self.layer_ids,
                name=name,
                metadata=self._meta(),
            )
        self._host_counts()  # raises on out-of-range ids
        if self.stream_dir is not None:
            self.flush()
            if self._chunks == 0:
                raise ValueError("nothing recorded yet: run a forward pass before to_trace()")
            tr = read_stream(self.stream_dir)
            return RoutingTrace(
                num_logical_experts=tr.num_logical_experts,
                topk_ids=tr.topk_ids,
                layer_ids=tr.layer_ids,
                seq_offsets=tr.seq_offsets,
                step_offsets=tr.step_offsets,
                name=name,
                metadata=self._meta() | {"chunks": self._chunks, "stream_dir": str(self.stream_dir)},
            )
        lo, hi = self._complete_range()
        if hi <= lo:
            raise ValueError("nothing recorded yet: run a forward pass before to_trace()")
        meta = self._meta() | {"dropped_tokens": lo}
        if lo > 0:
            log.warning(
                "ring buffer kept the newest %d of %d recorded tokens; raise capacity_tokens or stream",
                hi - lo,
                hi,
            )
        return self._token_trace(lo, hi, name, meta)

    # ---- hooks ---------------------------------------------------------------------------------
    def detach(self) -> None:
        """Remove every hook this recorder registered (buffers stay readable)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def __enter__(self) -> RoutingRecorder:
        return self

    def __exit__(self, *exc) -> None:
        self.detach()

    def __repr__(self) -> str:
        return (
            f"RoutingRecorder(mode={self.mode!r}, layers={list(self.layer_ids)}, experts={self.num_logical_experts}, "
            f"top_k={self.top_k}, tokens_seen={self.tokens_seen}, attached={self.attached})"
        )
