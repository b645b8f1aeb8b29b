"""Argument checks of :mod:`profiling.hooks`' recorder and ``attach``: a one-line ValueError naming the
argument and a fix, before any hook is registered or any buffer allocated."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from torch import nn

from moe_placement.base.limits import MAX_EXPERTS, check_memory, check_whole

__all__ = ["check_layer_seq", "check_module", "check_sizes"]


def check_layer_seq(layer_ids) -> None:
    if isinstance(layer_ids, (str, bytes)) or not isinstance(layer_ids, (Sequence, range, np.ndarray)):
        raise ValueError(f"layer_ids must be a sequence of layer ids, got {layer_ids!r}")


def check_module(model) -> None:
    if not isinstance(model, nn.Module):
        raise ValueError(
            f"model must be a torch.nn.Module (e.g. a transformers model), got {type(model).__name__}"
        )


def check_sizes(L: int, E, k, o) -> None:
    """Whole-number sizes in range and buffers that fit in memory (``o``: the recorder's
    :class:`~profiling.hooks.RecordOptions`), else a ValueError before anything is allocated."""
    E = check_whole("num_logical_experts", E, 1, MAX_EXPERTS, fix="the model's expert count")
    k = check_whole("top_k", k, 1, E, fix="the experts each token selects (at most num_logical_experts)")
    check_whole("sample_every", o.sample_every, 1, fix="1 keeps every token")
    if o.chunk_tokens is not None:
        check_whole("chunk_tokens", o.chunk_tokens, 1, fix="or None for capacity_tokens // 2")
    nbytes = 2 * L * (E + 1) * 8  # [L, E+1] int64 counts, twice
    if o.mode == "tokens":
        C = check_whole(
            "capacity_tokens", o.capacity_tokens, 1, fix="e.g. 65536; stream_dir= keeps memory bounded"
        )
        nbytes += C * L * k * (2 if E < 32767 else 4)
    check_memory(nbytes, "the recorder's buffers", "lower capacity_tokens (and stream with stream_dir=)")
