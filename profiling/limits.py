"""Size limits on what input files may declare, checked before anything is allocated.

Every reader (traces, engine dumps, placement files, the SGLang writer's hidden-layer rows) checks
the numbers a file states against these constants, so a small file cannot make the tool allocate
gigabytes (a layer id of 2e8 would make SGLang's ``[H, P]`` map 2e8 rows). The messages name the
constant. The limits are far above any real model: DeepSeek-V3 has 61 layers and 256 experts.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "MAX_EXPERTS",
    "MAX_LAYER_ID",
    "MAX_RANKS",
    "MAX_TOTAL_TOKENS",
    "check_layer_ids",
]

MAX_LAYER_ID = 100_000  # largest layer id (and hidden-layer count - 1) a file may use
MAX_EXPERTS = 65_536  # logical experts per layer, and physical slots per layer
MAX_RANKS = 65_536  # EP ranks / source ranks
MAX_TOTAL_TOKENS = 2**53  # total load of a trace: above it float64 sums are no longer exact


def check_layer_ids(ids: Iterable[int], what: str = "layer_ids", where: str = "") -> tuple[int, ...]:
    """Layer ids as a tuple, each in ``0..MAX_LAYER_ID`` and all distinct, else a ValueError."""
    out = tuple(int(i) for i in ids)
    prefix = f"{where}: " if where else ""
    bad = [i for i in out if not 0 <= i <= MAX_LAYER_ID]
    if bad:
        raise ValueError(
            f"{prefix}{what} holds layer id {bad[0]}, outside the accepted range 0..{MAX_LAYER_ID} "
            f"(MAX_LAYER_ID); layer ids are the model's layer indices (0..num_hidden_layers-1)"
        )
    if len(set(out)) != len(out):
        seen: set[int] = set()
        dup = next(i for i in out if i in seen or seen.add(i))  # type: ignore[func-returns-value]
        raise ValueError(f"{prefix}{what} lists layer id {dup} twice; each layer may appear once")
    return out
