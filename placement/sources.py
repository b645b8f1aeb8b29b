"""Where each token comes from: the source (attention-DP) rank of every token of a trace, and the
tokens each source rank sends to each expert. The dispatch models that depend on the source rank are
scored from these (:mod:`placement.metrics`, which re-exports them).

Shapes: L layers, E logical experts, G EP ranks, T tokens, W windows.
"""

from __future__ import annotations

import numpy as np

from profiling.trace import RoutingTrace

__all__ = ["check_src_ranks", "rank_expert_counts", "resolve_source_ranks", "source_ranks"]


def source_ranks(trace: RoutingTrace, ep_size: int) -> tuple[np.ndarray, str]:
    """Attention-DP rank of every token, and how it was obtained.

    The trace's own ``source_rank`` when present (reduced mod ``ep_size`` if it was recorded on more
    ranks); else prompts round-robin over ranks when prompt boundaries exist; else tokens round-robin.

    Returns:
        (int64 ``[T]``, one of ``"trace"``, ``"round-robin by prompt"``, ``"round-robin by token"``).
    """
    T = trace.num_tokens
    if trace.source_rank is not None:
        return trace.source_rank.astype(np.int64) % ep_size, "trace"
    if trace.seq_offsets is not None:
        lengths = np.diff(trace.seq_offsets)
        return np.repeat(np.arange(lengths.size, dtype=np.int64) % ep_size, lengths), "round-robin by prompt"
    return np.arange(T, dtype=np.int64) % ep_size, "round-robin by token"


def resolve_source_ranks(
    trace: RoutingTrace, ep_size: int, spec: str | None = None
) -> tuple[np.ndarray, str]:
    """Source rank of every token from a ``--source-ranks`` spec: int64 ``[T]`` and how it was made.

    ``None``: :func:`source_ranks` (the trace's own ranks, else prompts round-robin). ``round-robin``:
    prompt ``i`` (token ``i`` without prompt boundaries) to rank ``i mod G``. ``random[:SEED]``:
    each prompt (or token) to a uniformly random rank. Anything else is a ``.npy`` file holding one
    rank per token.
    """
    if spec is None:
        return source_ranks(trace, ep_size)
    lengths = np.diff(trace.seq_offsets) if trace.seq_offsets is not None else np.ones(trace.num_tokens, int)
    unit = "prompt" if trace.seq_offsets is not None else "token"
    if spec == "round-robin":
        return np.repeat(np.arange(lengths.size, dtype=np.int64) % ep_size, lengths), f"round-robin by {unit}"
    if spec == "random" or spec.startswith("random:"):
        seed_text = spec.partition(":")[2] or "0"
        ranks = np.random.default_rng(_random_seed(spec)).integers(0, ep_size, size=lengths.size)
        return np.repeat(ranks.astype(np.int64), lengths), f"random by {unit} (seed {seed_text})"
    return _source_ranks_file(spec, trace.num_tokens, ep_size), f"file {spec}"


def check_src_ranks(src_gpu, num_tokens: int, ep_size: int) -> np.ndarray:
    """``src_gpu`` as int64 ``[T]`` ranks in ``[0, G)``, else a ValueError naming the shape or range."""
    src = np.asarray(src_gpu)
    if (
        src.shape != (num_tokens,)
        or (src.size and src.dtype.kind not in "iu")
        or (src.size and not 0 <= int(src.min()) <= int(src.max()) < ep_size)
    ):
        raise ValueError(
            f"src_gpu must be {num_tokens} integer ranks in 0..{ep_size - 1}, got {src.dtype} {src.shape}"
        )
    return src.astype(np.int64)


def rank_expert_counts(trace: RoutingTrace, ep_size: int, spec: str | None = None) -> np.ndarray:
    """Tokens each source rank sends to each expert: int64 ``[L, G, E]``.

    Per-token traces use :func:`resolve_source_ranks`; counts-only traces with windows (questions,
    domains) deal window ``i`` to rank ``i mod G`` (``round-robin``, the default) or at random.
    """
    L, E = trace.num_layers, trace.num_logical_experts
    out = np.zeros((L, ep_size, E), dtype=np.int64)
    if trace.has_tokens:
        src, _ = resolve_source_ranks(trace, ep_size, spec)
        ids = trace.topk_ids
        for l in range(L):
            valid = ids[:, l, :] >= 0
            key = np.broadcast_to(src[:, None], valid.shape)[valid] * E + ids[:, l, :][valid].astype(np.int64)
            out[l] = np.bincount(key, minlength=ep_size * E).reshape(ep_size, E)
        return out
    if trace.window_counts is None:
        raise ValueError("source ranks need a per-token trace or per-window counts; this trace has neither")
    W = trace.window_counts.shape[0]
    if spec in (None, "round-robin"):
        ranks = np.arange(W) % ep_size
    elif spec == "random" or spec.startswith("random:"):
        ranks = np.random.default_rng(_random_seed(spec)).integers(0, ep_size, size=W)
    else:
        raise ValueError(f"--source-ranks {spec!r}: a counts-only trace takes round-robin or random[:SEED]")
    np.add.at(out, (slice(None), ranks), np.moveaxis(np.asarray(trace.window_counts, dtype=np.int64), 0, 1))
    return out


MAX_SEED = 2**31 - 1  # the CLI's --seed bound


def _random_seed(spec: str) -> int:
    """The seed of ``random[:SEED]``: a whole number in ``0..MAX_SEED``, else a one-line ValueError."""
    text = spec.partition(":")[2] or "0"
    if not (text.isascii() and text.isdigit()) or len(text) > 10 or int(text) > MAX_SEED:
        raise ValueError(
            f"--source-ranks {spec[:40]!r}: the seed after 'random:' must be a whole number in 0..{MAX_SEED}"
        )
    return int(text)


def _source_ranks_file(path: str, num_tokens: int, ep_size: int) -> np.ndarray:
    """A ``.npy`` file of ``num_tokens`` integer ranks in ``[0, ep_size)`` (ValueError otherwise)."""
    if not path.endswith(".npy"):
        raise ValueError(f"--source-ranks {path!r}: use round-robin, random[:SEED] or a .npy file of ranks")
    try:
        from moe_placement.base.fileio import (
            load_npy,  # regular files only: a FIFO is refused, not read forever
        )

        arr = load_npy(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--source-ranks {path}: cannot read it as a .npy array ({exc})") from None
    if arr.shape != (num_tokens,) or arr.dtype.kind not in "iu":
        raise ValueError(
            f"--source-ranks {path}: need {num_tokens} integer ranks (one per token), got {arr.dtype} {arr.shape}"
        )
    if arr.size and (arr.min() < 0 or arr.max() >= ep_size):
        raise ValueError(
            f"--source-ranks {path}: ranks must be in [0, {ep_size}) for EP size {ep_size}, "
            f"got [{int(arr.min())}, {int(arr.max())}]"
        )
    return arr.astype(np.int64)
