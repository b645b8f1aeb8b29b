"""Size limits on what input files may declare, checked before anything is allocated.

Every reader (traces, engine dumps, placement files, the SGLang writer's hidden-layer rows) checks
the numbers a file states against these constants, so a small file cannot make the tool allocate
gigabytes (a layer id of 2e8 would make SGLang's ``[H, P]`` map 2e8 rows). The messages name the
constant. The limits are far above any real model: DeepSeek-V3 has 61 layers and 256 experts.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np

__all__ = [
    "MAX_EXPERTS",
    "MAX_LAYER_ID",
    "MAX_RANKS",
    "MAX_TOTAL_TOKENS",
    "check_layer_ids",
    "check_sequence",
]

MAX_LAYER_ID = 100_000  # largest layer id (and hidden-layer count - 1) a file may use
MAX_EXPERTS = 65_536  # logical experts per layer, and physical slots per layer
MAX_RANKS = 65_536  # EP ranks / source ranks
MAX_TOTAL_TOKENS = 2**53  # total load of a trace: above it float64 sums are no longer exact


def check_sequence(value, what: str, items: str, where: str = "") -> tuple:
    """``value`` as a tuple when it is a sequence (a list, tuple, range or array), else a one-line
    ValueError: a bare string is refused (``tuple("ab")`` would read it as its letters), and so is a
    number or None."""
    prefix = f"{where}: " if where else ""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable) or isinstance(value, dict):
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        hint = f"; a string would be read as its characters: pass [{shown}]" if isinstance(value, str) else ""
        raise ValueError(f"{prefix}{what} must be a sequence of {items}, got {shown}{hint}")
    return tuple(value)


def check_layer_ids(ids: Iterable[int], what: str = "layer_ids", where: str = "") -> tuple[int, ...]:
    """Layer ids as a tuple, each a whole number in ``0..MAX_LAYER_ID`` and all distinct, else a
    ValueError (a string, or 0.5 read as layer 0, never passes)."""
    prefix = f"{where}: " if where else ""
    out = tuple(
        check_whole(f"{prefix}{what}'s entry", i, None, fix="layer ids are whole numbers")
        for i in check_sequence(ids, what, "layer ids", where)
    )
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


# ---------------------------------------------------------------------------------------------
# sizes a model description or a library call may ask for, checked before anything is allocated
# or searched (a model of 1e9 layers, a fit of 1e12 steps, an infinite time limit)
# ---------------------------------------------------------------------------------------------
__all__ += [
    "MAX_CONTEXT_LEN",
    "MAX_FIT_STEPS",
    "MAX_HIDDEN_SIZE",
    "MAX_INTERMEDIATE_SIZE",
    "MAX_LAYERS",
    "MAX_SEARCH_SAMPLES",
    "MAX_STEP_TOKENS",
    "MAX_TIME_LIMIT_S",
    "MAX_WORK_STEPS",
    "available_memory_bytes",
    "check_memory",
]

MAX_LAYERS = MAX_LAYER_ID + 1  # decoder layers of a model description (DeepSeek-V3: 61)
MAX_HIDDEN_SIZE = 1 << 20  # a model's hidden size (DeepSeek-V3: 7168)
MAX_INTERMEDIATE_SIZE = 1 << 22  # an MLP's or expert's intermediate size (DeepSeek-V3 dense: 18432)
MAX_TIME_LIMIT_S = 1e7  # a solve's wall-clock budget, seconds (about 115 days; the CLI's MAX_SECONDS)
MAX_FIT_STEPS = 1_000_000  # search steps (swap or move attempts) per layer of a fit (defaults: 60, 300)
MAX_SEARCH_SAMPLES = 10_000  # sampled dealings / steps a fit holds at once (defaults: 16, 96)
MAX_WORK_STEPS = 10_000_000  # a search's counted-step budget (a step is 1-10 ms: up to about a day)
MAX_STEP_TOKENS = 1 << 24  # tokens per rank per step (a prefill chunk of 16M tokens)
MAX_CONTEXT_LEN = 1 << 24  # cached tokens per sequence (decode) or prompt length (prefill) a model prices


def available_memory_bytes() -> int | None:
    """Memory the machine can still give (``MemAvailable`` of ``/proc/meminfo``), or None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_memory(nbytes: float, what: str, fix: str, share: float = 0.8) -> None:
    """A ValueError, before anything is allocated, when ``what`` needs ``nbytes`` and that is more than
    ``share`` of the memory available now; ``fix`` ends the message. Nothing is checked where the
    available memory is unknown."""
    avail = available_memory_bytes()
    if avail is not None and nbytes > share * avail:
        raise ValueError(
            f"{what} needs about {nbytes / 1e9:,.1f} GB, over {share:.0%} of the {avail / 1e9:,.1f} GB of "
            f"memory available; {fix}"
        )


# ---------------------------------------------------------------------------------------------
# a library argument that must be a whole number: bool, float, str and None are named, not cast
# ---------------------------------------------------------------------------------------------
__all__ += ["check_context_len", "check_whole"]


def check_whole(name: str, value, lo: int | None = 0, hi: int | None = None, fix: str = "") -> int:
    """``value`` as an int when it is a Python or numpy integer (not a bool) in ``lo..hi``, else a
    one-line ValueError naming ``name``, the value and the accepted range; ``fix`` ends the message."""
    ok = isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
    if ok and (lo is None or lo <= value) and (hi is None or value <= hi):
        return int(value)
    span = f" {lo}..{hi:,}" if lo is not None and hi is not None else f" >= {lo}" if lo is not None else ""
    shown = repr(value) if not ok else f"{int(value):,}"
    if len(shown) > 60:
        shown = shown[:57] + "..."
    kind = "" if ok else f" ({type(value).__name__})"
    raise ValueError(f"{name} must be a whole number{span}, got {shown}{kind}{'; ' + fix if fix else ''}")


def check_context_len(value, what: str = "context_len") -> float:
    """A context length (cached tokens per decode sequence, or prompt length in prefill) as a float: a
    finite number in ``1..MAX_CONTEXT_LEN`` (bool, NaN and strings refused), else a one-line ValueError.
    The CLI's ``--context-len`` flags have the same bound, so a library call and a command agree."""
    ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))
    x = float(value) if ok else float("nan")
    if not (np.isfinite(x) and 1 <= x <= MAX_CONTEXT_LEN):
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise ValueError(
            f"{what} must be a number of tokens in 1..{MAX_CONTEXT_LEN:,} (MAX_CONTEXT_LEN), got {shown}; "
            f"it is the cached tokens per sequence (decode) or the prompt length (prefill), e.g. 4096"
        )
    return x
