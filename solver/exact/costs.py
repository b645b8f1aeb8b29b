"""Per-replica cost tables and the bounds that hold for any placement.

Shapes: ``L`` layers, ``E`` logical experts, ``G`` GPUs, ``P`` physical slots, ``W`` windows,
``R = rmax`` the most replicas one expert can have (``min(G, 1 + P - E)``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np

from placement.cost.hardware import DEFAULT_HARDWARE, GPUS, GpuSpec
from placement.cost.modelspec import load_model
from placement.cost.primitives import assignment_seconds
from placement.metrics import peak_lower_bound
from placement.steps import SIZING_STEP_TOKENS

__all__ = ["DecodeCost", "count_lower_bound", "layer_cost_table"]

# ---------------------------------------------------------------------------------------------
# Decode cost: hardware figures from placement.cost.hardware, the expert from the DeepSeek-V3 preset
# ---------------------------------------------------------------------------------------------
_DSV3 = load_model("deepseek-v3")  # FP8 expert: 3 * d * f bytes with d = 7168, f = 2048


def _token_time_us(gpu: GpuSpec) -> float:
    """Compute microseconds of one routed DeepSeek-V3 token above the knee (``6 d f / (P eta_c)``)."""
    return assignment_seconds(gpu, _DSV3) * 1e6


def _hbm_effective(gpu: GpuSpec) -> float:
    """Effective HBM bytes/s of a weight-read-bound GEMM (``BW eta_m``)."""
    return gpu.hbm_bandwidth * gpu.eta_memory


@dataclass(frozen=True)
class DecodeCost:
    """Per-step decode cost of one replica (defaults: DeepSeek-V3 FP8 on the default GPU preset, costmodel.md).

    Attributes:
        step_tokens: decode tokens per attention-DP rank in one step (default: the decode size a
            deployment is sized at, ``placement.steps.SIZING_STEP_TOKENS``).
        top_k: routed experts per token.
        token_time_us: compute time per routed token on one GPU (``6 d f / (FLOP/s * eta_c)``).
        expert_bytes: bytes of one expert's weights (read once per step when it has a token).
        hbm_bytes_per_s: effective HBM bandwidth.
    """

    step_tokens: float = float(SIZING_STEP_TOKENS["decode"])
    top_k: int = 8
    token_time_us: float = _token_time_us(GPUS[DEFAULT_HARDWARE])
    expert_bytes: float = float(_DSV3.expert_bytes)
    hbm_bytes_per_s: float = _hbm_effective(GPUS[DEFAULT_HARDWARE])

    def to_params(self) -> dict:
        """The fields as a placement file's ``params.decode_cost`` records them: ``step_tokens`` under
        its file key ``batch_tokens_per_gpu`` (docs/formats.md), first, as before."""
        fields = {k: getattr(self, k) for k in self.__dataclass_fields__}
        return {"batch_tokens_per_gpu": fields.pop("step_tokens"), **fields}

    @property
    def read_time_us(self) -> float:
        return self.expert_bytes / self.hbm_bytes_per_s * 1e6

    @classmethod
    def build(cls, expert_bytes=None, hardware=None, top_k=None) -> DecodeCost:
        """Defaults overridden by ``expert_bytes``, a hardware preset name (``placement.cost.hardware.GPUS``)
        or a dict of fields."""
        dc = cls()
        if isinstance(hardware, str):
            key = hardware.lower()
            if key not in GPUS:
                raise ValueError(f"unknown hardware {hardware!r}; use one of {sorted(GPUS)} or a dict")
            gpu = GPUS[key]
            dc = replace(dc, hbm_bytes_per_s=_hbm_effective(gpu), token_time_us=_token_time_us(gpu))
        elif isinstance(hardware, Mapping):
            unknown = set(hardware) - set(cls.__dataclass_fields__)
            if unknown:
                raise ValueError(
                    f"unknown decode cost fields {sorted(unknown)}; use {sorted(cls.__dataclass_fields__)}"
                )
            dc = replace(dc, **dict(hardware))
        elif hardware is not None:
            raise ValueError(
                f"hardware must be a name or a dict of DecodeCost fields, got {type(hardware).__name__}"
            )
        if expert_bytes is not None:
            if not expert_bytes > 0:
                raise ValueError(f"expert_bytes must be > 0, got {expert_bytes}")
            dc = replace(dc, expert_bytes=float(expert_bytes))
        if top_k is not None and not (isinstance(hardware, Mapping) and "top_k" in hardware):
            dc = replace(dc, top_k=int(top_k))
        return dc


# ---------------------------------------------------------------------------------------------
# Bounds and cost tables
# ---------------------------------------------------------------------------------------------
def _max_replicas(E: int, G: int, P: int) -> int:
    """``rmax``: the most replicas one expert can have (one per GPU, and every other expert keeps one)."""
    return max(1, min(G, 1 + P - E))


def count_lower_bound(load: np.ndarray, ep_size: int, num_physical_experts: int) -> np.ndarray:
    """Lower bound on the even-split peak GPU load, per layer, for any placement.

    ``max(mean, T*)`` with ``T*`` the least ``T`` for which the replica counts every expert needs to
    stay under ``T`` (``max(1, ceil(w_e / T))``, at most ``min(G, 1 + P - E)`` each) fit in ``P``
    slots. Dominates :func:`placement.metrics.peak_lower_bound`.

    Args:
        load: ``[L, E]`` (or ``[E]``). Returns: float64 ``[L]`` (or a float).
    """
    w = np.asarray(load, dtype=np.float64)
    if w.ndim == 1:
        return float(count_lower_bound(w[None], ep_size, num_physical_experts)[0])
    L, E = w.shape
    G, P = int(ep_size), int(num_physical_experts)
    rmax = _max_replicas(E, G, P)
    out = np.empty(L)
    r = np.arange(1, rmax + 1)
    for l in range(L):
        wl = w[l]
        # candidate peaks are the shares w_e / r; the least feasible one is the bound
        cand = np.unique((wl[:, None] / r[None, :]).ravel())
        cand = cand[cand >= wl.max() / rmax]

        def need(T):
            if T <= 0:
                return math.inf
            return np.maximum(1, np.ceil(wl / T - 1e-12)).sum()  # noqa: B023 (called in this iteration)

        lo, hi = 0, len(cand) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if need(cand[mid]) <= P:
                hi = mid
            else:
                lo = mid + 1
        out[l] = max(wl.sum() / G, cand[lo] if len(cand) else 0.0)
    return np.maximum(out, peak_lower_bound(w, G, P))


def layer_cost_table(
    windows: np.ndarray,
    rmax: int,
    objective: str = "tokens",
    decode: DecodeCost | None = None,
    num_gpus: int = 1,
) -> np.ndarray:
    """Per-replica cost ``c[w, e, r]`` for ``r = 0..rmax`` (index 0 unused, set to +inf).

    Args:
        windows: ``[W, E]`` loads of one layer.
        objective: ``tokens`` (``w_e / r``) or ``decode`` (microseconds per step, module docstring).
    Returns:
        float64 ``[W, E, rmax + 1]``.
    """
    w = np.asarray(windows, dtype=np.float64)
    r = np.arange(rmax + 1, dtype=np.float64)
    r[0] = np.nan
    if objective == "tokens":
        c = w[:, :, None] / r[None, None, :]
    elif objective == "decode":
        dc = decode or DecodeCost()
        tot = w.sum(axis=1, keepdims=True)
        frac = np.divide(w, tot, out=np.zeros_like(w), where=tot > 0)
        lam = frac * dc.top_k * dc.step_tokens * num_gpus  # [W, E] selections per step
        per = lam[:, :, None] / r[None, None, :]
        c = dc.token_time_us * per + dc.read_time_us * (1.0 - np.exp(-per))
    else:
        raise ValueError(f"unknown objective {objective!r}; use 'tokens' or 'decode'")
    c[:, :, 0] = np.inf
    return c
