"""A step-time and memory model for MoE serving with attention-DP and expert-EP (no GPU needed).

Follows ``docs/costmodel.md`` (shared). Shapes: L MoE layers, E logical experts, P physical slots,
G EP ranks (GPUs), N nodes, m = G/N GPUs per node, S steps sampled from a trace.

Per MoE layer and GPU ``g`` (decode or prefill step, ``b`` tokens per attention-DP rank):

- expert compute (grouped GEMM with the small-GEMM penalty)::

      F_g = 6 d f n_g ;  M_g = A_g W + n_g (activation bytes) ;
      T_comp(g) = max(F_g / (P eta_c), M_g / (BW eta_m)) + t0

  ``n_g`` token-expert pairs on ``g`` (from :func:`placement.metrics.expected_gpu_load` or, with a
  trace, :func:`placement.metrics.route_tokens`), ``A_g`` experts with at least one token, ``W`` one
  expert's weights (``3 d f b_w``).
- dispatch and combine::

      T_a2a = alpha + max_g max(NVLink_bytes(g) / B_nvl, RDMA_bytes(g) / B_rdma)   (send and receive)

  ``a2a_mode="normal"`` (prefill; DeepEP normal kernels): node-deduplicated, a token crosses RDMA
  once per remote node it needs and NVLink fans it out. ``a2a_mode="low_latency"`` (decode; DeepEP
  low-latency kernels): one copy per (token, expert) pair, off-node copies over RDMA, on-node over
  NVLink. Without a token trace the bytes are an analytic expectation from per-expert loads assuming
  the ``k`` picks of a token are independent; with a trace they are counted token by token.
- attention: projections with the GEMM formula, plus the attention core
  ``max(FLOPs / (P_bf16 eta_attn), KV read / (BW eta_m)) + t0``; shared
  experts, dense MLP layers and the LM head with the GEMM formula above.
- layer: ``T_attn + T_shared + T_dispatch + max_g T_comp + T_combine``; with two-batch overlap
  (two micro-batches of ``b/2``) ``2 max(T_attn + T_shared + T_comp, T_dispatch + T_combine)``
  evaluated at ``b/2``. ``overlap="auto"`` keeps the faster of the two (an engine turns TBO off when
  it does not pay: at tiny batches each half re-reads every expert's weights).
- memory per GPU: non-expert weights + ``slots_per_gpu x W x L_moe`` (every redundant slot costs one
  expert's weights in every MoE layer) + a runtime reserve; the rest is KV cache.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np

from solver.hardware import ClusterSpec, GpuSpec

__all__ = [
    "ModelSpec",
    "load_model",
    "model_from_hf_config",
    "BUILTIN_MODELS",
    "CostOptions",
    "Workload",
    "analytic_workload",
    "trace_workload",
    "gemm_time",
    "a2a_time",
    "LayerCost",
    "MemoryBreakdown",
    "StepCost",
    "memory_per_gpu",
    "step_cost",
]

log = logging.getLogger(__name__)
_MODELS_DIR = Path(__file__).with_name("models")
BUILTIN_MODELS = {
    "deepseek-v3": "deepseek_v3.json",
    "deepseek-r1": "deepseek_v3.json",
    "deepseek-v2-lite": "deepseek_v2_lite.json",
    "mixtral-8x7b": "mixtral_8x7b.json",
    "qwen3-30b-a3b": "qwen3_30b_a3b.json",
    "olmoe-1b-7b": "olmoe_1b_7b.json",
    "olmoe": "olmoe_1b_7b.json",
}


# ---------------------------------------------------------------------------------------------
# Model description
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelSpec:
    """What the cost model needs to know about an MoE model.

    Attributes:
        hidden_size: ``d``; moe_intermediate_size: ``f`` of one routed expert (GLU, 3 matrices).
        num_logical_experts: routed experts ``E``; top_k: ``k``.
        num_layers: all decoder layers; moe_layer_ids: the real indices of the MoE layers.
        shared_intermediate_size: total intermediate size of the shared expert(s) (0 = none).
        dense_intermediate_size: ``f`` of the dense MLP in non-MoE layers.
        weight_bytes: bytes per weight of the linear layers (1 FP8, 2 BF16).
        attention: ``"mla"`` (DeepSeek multi-head latent attention) or ``"gqa"``.
        kv_cache_bytes: bytes per cached element (2 = BF16 cache).
        num_groups / topk_group: group-limited routing (DeepSeek), None if absent.
    """

    name: str
    hidden_size: int
    moe_intermediate_size: int
    num_logical_experts: int
    top_k: int
    num_layers: int
    moe_layer_ids: tuple[int, ...]
    num_shared_experts: int = 0
    shared_intermediate_size: int = 0
    dense_intermediate_size: int = 0
    weight_bytes: float = 2.0
    attention: str = "gqa"
    num_attention_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    vocab_size: int = 32000
    kv_cache_bytes: float = 2.0
    num_groups: int | None = None
    topk_group: int | None = None
    source: str = ""

    def __post_init__(self) -> None:
        ints = ("hidden_size", "moe_intermediate_size", "num_logical_experts", "top_k", "num_layers")
        for k in ints:
            v = getattr(self, k)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                raise ValueError(f"model {self.name!r}: {k} must be a positive integer, got {v!r}")
        if self.top_k > self.num_logical_experts:
            raise ValueError(
                f"model {self.name!r}: top_k={self.top_k} exceeds {self.num_logical_experts} experts"
            )
        ids = tuple(int(i) for i in self.moe_layer_ids)
        if not ids or min(ids) < 0 or max(ids) >= self.num_layers or len(set(ids)) != len(ids):
            raise ValueError(
                f"model {self.name!r}: moe_layer_ids must be distinct indices in [0, {self.num_layers}), got {self.moe_layer_ids}"
            )
        object.__setattr__(self, "moe_layer_ids", ids)
        if self.attention not in ("mla", "gqa"):
            raise ValueError(f"model {self.name!r}: attention must be 'mla' or 'gqa', got {self.attention!r}")
        if self.attention == "mla" and not (self.kv_lora_rank and self.qk_rope_head_dim):
            raise ValueError(f"model {self.name!r}: MLA needs kv_lora_rank and qk_rope_head_dim")

    # ---- derived sizes (elements or bytes) ----
    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layer_ids)

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - self.num_moe_layers

    @property
    def expert_bytes(self) -> float:
        """One routed expert's weights in one layer: ``3 d f b_w`` (DeepSeek-V3 FP8: 44,040,192 B)."""
        return 3.0 * self.hidden_size * self.moe_intermediate_size * self.weight_bytes

    @property
    def attention_params(self) -> float:
        """Linear-layer parameters of one attention block."""
        d, H = self.hidden_size, self.num_attention_heads
        if self.attention == "mla":
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            q = d * self.q_lora_rank + self.q_lora_rank * H * qk if self.q_lora_rank else d * H * qk
            kv = d * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank * H * (
                self.qk_nope_head_dim + self.v_head_dim
            )
            return float(q + kv + H * self.v_head_dim * d)
        hd = self.head_dim
        return float(d * H * hd + 2 * d * self.num_kv_heads * hd + H * hd * d)

    @property
    def kv_bytes_per_token_layer(self) -> float:
        """KV-cache bytes of one token in one layer (MLA: the latent plus the rope key)."""
        if self.attention == "mla":
            return (self.kv_lora_rank + self.qk_rope_head_dim) * self.kv_cache_bytes
        return 2.0 * self.num_kv_heads * self.head_dim * self.kv_cache_bytes

    @property
    def kv_bytes_per_token(self) -> float:
        return self.kv_bytes_per_token_layer * self.num_layers

    @property
    def dispatch_bytes_per_token(self) -> float:
        """FP8 with 128-element scales (``d + d/128*4``) for FP8 models, else BF16 (``2d``)."""
        d = self.hidden_size
        return d + d / 128 * 4 if self.weight_bytes <= 1 else 2.0 * d

    @property
    def combine_bytes_per_token(self) -> float:
        return 2.0 * self.hidden_size

    def non_expert_bytes(self, attn_tp: int = 1) -> float:
        """Weights every GPU holds besides routed experts (attention, dense MLPs and embeddings split over
        ``attn_tp``; shared experts and routers replicated). Embeddings and LM head in BF16."""
        d = self.hidden_size
        attn = self.attention_params * self.num_layers * self.weight_bytes / attn_tp
        dense = 3.0 * d * self.dense_intermediate_size * self.num_dense_layers * self.weight_bytes / attn_tp
        shared = 3.0 * d * self.shared_intermediate_size * self.num_moe_layers * self.weight_bytes
        router = d * self.num_logical_experts * self.num_moe_layers * 4.0
        embed = 2.0 * self.vocab_size * d * 2.0 / attn_tp
        return attn + dense + shared + router + embed

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["moe_layer_ids"] = list(self.moe_layer_ids)
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "model description") -> ModelSpec:
        d = dict(d)
        if "moe_layer_ids" not in d and "first_moe_layer" in d:
            d["moe_layer_ids"] = list(range(int(d.pop("first_moe_layer")), int(d["num_layers"])))
        d.pop("first_moe_layer", None)
        d.pop("notes", None)
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)}; known: {sorted(known)}")
        missing = [
            k
            for k in (
                "name",
                "hidden_size",
                "moe_intermediate_size",
                "num_logical_experts",
                "top_k",
                "num_layers",
                "moe_layer_ids",
            )
            if k not in d
        ]
        if missing:
            raise ValueError(f"{where}: missing keys {missing}")
        d["moe_layer_ids"] = tuple(d["moe_layer_ids"])
        return cls(**d)


def _dtype_bytes(cfg: Mapping[str, Any]) -> float:
    q = cfg.get("quantization_config") or {}
    if isinstance(q, Mapping) and str(q.get("quant_method", "")).lower() == "fp8":
        return 1.0
    dt = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").lower()
    return 4.0 if "32" in dt else 1.0 if "8" in dt else 2.0


def model_from_hf_config(cfg: Mapping[str, Any], name: str | None = None) -> ModelSpec:
    """Map a HF ``config.json`` dict of a DeepSeek-V2/V3, Mixtral, Qwen2/3-MoE or OLMoE model.

    Fields read: ``n_routed_experts | num_local_experts | num_experts``, ``moe_intermediate_size``
    (else ``intermediate_size``), ``num_experts_per_tok``, ``first_k_dense_replace`` and
    ``moe_layer_freq`` (DeepSeek), ``decoder_sparse_step`` and ``mlp_only_layers`` (Qwen),
    ``n_shared_experts`` / ``shared_expert_intermediate_size``, MLA's ``kv_lora_rank``,
    ``qk_rope_head_dim`` etc., ``quantization_config.quant_method == "fp8"`` for FP8 weights.
    """
    c = dict(cfg)
    mt = str(c.get("model_type", "")).lower()
    where = f"config.json ({mt or 'unknown model_type'})"

    def need(*keys):
        for k in keys:
            if c.get(k) is not None:
                return c[k]
        raise ValueError(f"{where}: none of {keys} is present; is this an MoE model config?")

    E = int(need("n_routed_experts", "num_local_experts", "num_experts"))
    L = int(need("num_hidden_layers"))
    d = int(need("hidden_size"))
    k = int(need("num_experts_per_tok", "moe_topk", "top_k"))
    dense_f = int(c.get("intermediate_size") or 0)
    f = int(c.get("moe_intermediate_size") or dense_f)
    if f <= 0:
        raise ValueError(f"{where}: no moe_intermediate_size or intermediate_size")
    if "first_k_dense_replace" in c or mt.startswith("deepseek"):
        first = int(c.get("first_k_dense_replace") or 0)
        freq = int(c.get("moe_layer_freq") or 1)
        moe = [i for i in range(L) if i >= first and i % freq == 0]
    elif "decoder_sparse_step" in c or "mlp_only_layers" in c:
        step = int(c.get("decoder_sparse_step") or 1)
        only = set(int(i) for i in (c.get("mlp_only_layers") or []))
        moe = [i for i in range(L) if i not in only and (i + 1) % step == 0]
    else:
        moe = list(range(L))
    n_shared = int(c.get("n_shared_experts") or 0)
    shared_f = n_shared * f
    if c.get("shared_expert_intermediate_size"):
        shared_f = int(c["shared_expert_intermediate_size"])
        n_shared = max(n_shared, 1)
    H = int(c.get("num_attention_heads") or 32)
    mla = bool(c.get("kv_lora_rank"))
    head_dim = int(c.get("head_dim") or (c.get("v_head_dim") if mla else 0) or (d // H))
    return ModelSpec(
        name=name or str(c.get("_name_or_path") or mt or "hf-model"),
        hidden_size=d,
        moe_intermediate_size=f,
        num_logical_experts=E,
        top_k=k,
        num_layers=L,
        moe_layer_ids=tuple(moe),
        num_shared_experts=n_shared,
        shared_intermediate_size=shared_f,
        dense_intermediate_size=dense_f if len(moe) < L else 0,
        weight_bytes=_dtype_bytes(c),
        attention="mla" if mla else "gqa",
        num_attention_heads=H,
        num_kv_heads=int(c.get("num_key_value_heads") or H),
        head_dim=head_dim,
        kv_lora_rank=int(c.get("kv_lora_rank") or 0),
        q_lora_rank=int(c.get("q_lora_rank") or 0),
        qk_rope_head_dim=int(c.get("qk_rope_head_dim") or 0),
        qk_nope_head_dim=int(c.get("qk_nope_head_dim") or 0),
        v_head_dim=int(c.get("v_head_dim") or 0),
        vocab_size=int(c.get("vocab_size") or 32000),
        num_groups=int(c["n_group"]) if c.get("n_group") else None,
        topk_group=int(c["topk_group"]) if c.get("topk_group") else None,
        source=f"HF config.json, model_type={mt}",
    )


def load_model(name_or_path: str | Path) -> ModelSpec:
    """A built-in model (``deepseek-v3``, ``deepseek-r1``, ``deepseek-v2-lite``, ``mixtral-8x7b``,
    ``qwen3-30b-a3b``, ``olmoe-1b-7b``), a model-description JSON, or a HF ``config.json`` (or a
    folder holding one)."""
    from profiling.fileio import load_json

    key = str(name_or_path).lower()
    if key in BUILTIN_MODELS:
        return ModelSpec.from_dict(load_json(_MODELS_DIR / BUILTIN_MODELS[key]), where=BUILTIN_MODELS[key])
    p = Path(name_or_path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ValueError(
            f"unknown model {name_or_path!r}: not a built-in ({sorted(BUILTIN_MODELS)}) and no such file"
        )
    d = load_json(p)
    if not isinstance(d, dict):
        raise ValueError(f"{p}: expected a JSON object")
    if "moe_layer_ids" in d or "first_moe_layer" in d:
        return ModelSpec.from_dict(d, where=str(p))
    return model_from_hf_config(d, name=p.parent.name if p.name == "config.json" else p.stem)


# ---------------------------------------------------------------------------------------------
# Options and primitive timings
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CostOptions:
    """Knobs of one evaluation.

    Attributes:
        phase: ``decode`` (``batch_per_rank`` sequences, each attending ``context_len`` cached tokens)
            or ``prefill`` (``batch_per_rank`` prompt tokens of prompts ``context_len`` long).
        batch_per_rank: tokens per GPU per step ``b``.
        a2a_mode: ``auto`` (decode -> low_latency, prefill -> normal), ``normal`` or ``low_latency``.
        overlap: ``off``, ``on`` (two-batch overlap) or ``auto`` (the faster; reported).
        attn_tp: attention tensor-parallel size inside an attention-DP group.
        reserve_fraction: HBM kept for activations, CUDA graphs, communication buffers
            (SGLang's ``mem_fraction_static`` 0.9 leaves 0.1; band 0.05-0.2).
    """

    phase: Literal["decode", "prefill"] = "decode"
    batch_per_rank: int = 128
    context_len: int = 4096
    a2a_mode: Literal["auto", "normal", "low_latency"] = "auto"
    overlap: Literal["off", "on", "auto"] = "auto"
    attn_tp: int = 1
    reserve_fraction: float = 0.10

    def __post_init__(self) -> None:
        if self.phase not in ("decode", "prefill"):
            raise ValueError(f"phase must be 'decode' or 'prefill', got {self.phase!r}")
        if self.batch_per_rank < 1 or self.context_len < 1 or self.attn_tp < 1:
            raise ValueError(
                f"batch_per_rank, context_len and attn_tp must be >= 1, got {self.batch_per_rank}, {self.context_len}, {self.attn_tp}"
            )
        if self.a2a_mode not in ("auto", "normal", "low_latency") or self.overlap not in (
            "off",
            "on",
            "auto",
        ):
            raise ValueError(
                f"a2a_mode in auto/normal/low_latency and overlap in off/on/auto, got {self.a2a_mode}, {self.overlap}"
            )
        if not 0 <= self.reserve_fraction < 1:
            raise ValueError(f"reserve_fraction must be in [0, 1), got {self.reserve_fraction}")

    @property
    def mode(self) -> str:
        if self.a2a_mode != "auto":
            return self.a2a_mode
        return "low_latency" if self.phase == "decode" else "normal"


def gemm_time(gpu: GpuSpec, flops, bytes_moved, weight_bytes: float = 1.0):
    """``max(F / (P eta_c), M / (BW eta_m)) + t0`` (seconds); ``flops``/``bytes_moved`` broadcast."""
    P = gpu.peak_flops(weight_bytes) * gpu.eta_compute
    BW = gpu.hbm_bandwidth * gpu.eta_memory
    return (
        np.maximum(np.asarray(flops, dtype=np.float64) / P, np.asarray(bytes_moved, dtype=np.float64) / BW)
        + gpu.gemm_overhead
    )


def a2a_time(cluster: ClusterSpec, nvl_bytes, rdma_bytes, num_nodes: int, ep_size: int):
    """``alpha + max(NVLink_bytes / B_nvl, RDMA_bytes / B_rdma)`` per GPU; 0 when ``ep_size == 1``.

    ``alpha`` is the inter-node latency when the EP group spans nodes, else the intra-node one.
    """
    if ep_size <= 1:
        return np.zeros_like(np.asarray(nvl_bytes, dtype=np.float64))
    alpha = cluster.inter.latency if num_nodes > 1 else cluster.intra.latency
    return alpha + np.maximum(
        np.asarray(nvl_bytes, float) / cluster.intra.bandwidth,
        np.asarray(rdma_bytes, float) / cluster.inter.bandwidth,
    )


# ---------------------------------------------------------------------------------------------
# Workload: per-slot tokens and per-GPU traffic of one step
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class Workload:
    """What one step asks of each GPU, per MoE layer (``S`` sampled steps; analytic: ``S = 1``).

    Attributes:
        slot_tokens: float64 ``[S, L, P]`` token-expert pairs per physical slot (expectations or counts).
        nvl_bytes / rdma_bytes: float64 ``[S, L, G]`` payload units per GPU for one all-to-all, the max of
            sent and received (multiply by dispatch or combine bytes per token).
        exact: True when counted from a token trace (then ``slot_tokens`` are integers).
        how: a sentence saying where the numbers come from.
    """

    slot_tokens: np.ndarray
    nvl_units: np.ndarray
    rdma_units: np.ndarray
    slots_per_gpu: int
    exact: bool
    how: str

    def gpu_tokens(self, scale: float = 1.0) -> np.ndarray:
        """``[S, L, G]`` token-expert pairs per GPU (``scale`` = fraction of the batch, 0.5 for a TBO half)."""
        S, L, P = self.slot_tokens.shape
        return self.slot_tokens.reshape(S, L, P // self.slots_per_gpu, self.slots_per_gpu).sum(axis=3) * scale

    def active_experts(self, scale: float = 1.0) -> np.ndarray:
        """``[S, L, G]`` expected slots with at least one token in a batch of ``scale`` x the step.

        Analytic: Poisson, ``1 - exp(-lambda scale)``; counted: each of ``n`` tokens kept with
        probability ``scale``, ``1 - (1 - scale)^n``.
        """
        n = self.slot_tokens
        if self.exact:
            act = 1.0 - np.power(1.0 - min(scale, 1.0), n)
        else:
            act = 1.0 - np.exp(-n * scale)
        S, L, P = n.shape
        return act.reshape(S, L, P // self.slots_per_gpu, self.slots_per_gpu).sum(axis=3)


def _normalized(load: np.ndarray, k: int) -> np.ndarray:
    """Pick probabilities ``[L, E]`` summing to 1 per layer, capped at ``1/k`` (picks are distinct)."""
    w = np.asarray(load, dtype=np.float64)
    s = w.sum(axis=1, keepdims=True)
    p = np.where(s > 0, w / np.where(s > 0, s, 1), 1.0 / w.shape[1])
    for _ in range(8):  # water-fill the cap
        over = p > 1.0 / k
        if not over.any():
            break
        excess = (p - 1.0 / k).clip(min=0).sum(axis=1, keepdims=True)
        p = np.minimum(p, 1.0 / k)
        free = np.where(p < 1.0 / k, p, 0)
        p = p + excess * free / np.maximum(free.sum(axis=1, keepdims=True), 1e-300)
    return p


def analytic_workload(placement, load: np.ndarray, top_k: int, batch_per_rank: int, mode: str) -> Workload:
    """Expected workload of one step from per-expert loads (picks assumed independent).

    Args:
        placement: :class:`placement.model.Placement` with ``G`` ranks over ``N`` nodes.
        load: ``[L, E]`` relative load per logical expert (any scale; the skew is what matters).
        top_k: ``k``; batch_per_rank: ``b`` tokens per rank; mode: ``normal`` or ``low_latency``.
    """
    from placement.metrics import expected_gpu_load

    t = placement.topology
    G, N, m, k, b = t.ep_size, t.num_nodes, t.gpus_per_node, int(top_k), float(batch_per_rank)
    p = _normalized(load, k)  # [L, E]
    picks = b * G * k
    cnt = placement.logical_replica_count  # [L, E]
    p2l = placement.physical_to_logical_map  # [L, P]
    slot = np.take_along_axis(p / cnt, p2l, axis=1) * picks  # [L, P] expected pairs per slot
    gpu_pairs = expected_gpu_load(placement, p * picks)  # [L, G]
    pi_g = gpu_pairs / picks  # [L, G] probability that one pick lands on GPU g
    node = t.node_of_gpu
    pi_n = np.zeros((pi_g.shape[0], N))
    np.add.at(pi_n.T, node, pi_g.T)  # [L, N]
    same_node = pi_n[:, node]  # [L, G] mass on the GPU's own node
    if G == 1:
        zero = np.zeros_like(pi_g)
        nvl, rdma = zero, zero
    elif mode == "low_latency":
        # one copy per (token, pick); off-node copies over RDMA, on-node (other GPU) over NVLink
        rdma_send = b * k * (1.0 - same_node)
        nvl_send = b * k * (same_node - pi_g)
        rdma_recv = (G - m) * b * k * pi_g
        nvl_recv = (m - 1) * b * k * pi_g
        nvl, rdma = np.maximum(nvl_send, nvl_recv), np.maximum(rdma_send, rdma_recv)
    elif mode == "normal":
        hit_n = 1.0 - np.power(1.0 - np.clip(pi_n, 0, 1), k)  # [L, N] a token needs node n
        hit_g = 1.0 - np.power(1.0 - np.clip(pi_g, 0, 1), k)  # [L, G] a token needs GPU g
        rdma_send = b * (hit_n.sum(axis=1, keepdims=True) - hit_n[:, node])
        rdma_recv = (G - m) * b * hit_n[:, node] / m  # landing spread over the node's GPUs
        nvl_recv = G * b * hit_g * (m - 1) / m  # forwarded inside the node (1/m lands directly)
        node_mean = np.zeros_like(pi_n)
        np.add.at(node_mean.T, node, nvl_recv.T)
        nvl_send = node_mean[:, node] / m
        nvl, rdma = np.maximum(nvl_send, nvl_recv), np.maximum(rdma_send, rdma_recv)
    else:
        raise ValueError(f"a2a mode must be 'normal' or 'low_latency', got {mode!r}")
    how = f"analytic expectation from per-expert loads ({mode}: independent picks, even replica split)"
    return Workload(slot[None], np.asarray(nvl)[None], np.asarray(rdma)[None], t.slots_per_gpu, False, how)


def trace_workload(
    placement, trace, batch_per_rank: int, mode: str, max_steps: int = 4, policy: str = "even"
) -> Workload:
    """Workload counted token by token from a per-token trace.

    Step ``s`` holds ``b x G`` consecutive tokens, token ``t`` of a step on rank ``t // b`` (as
    :func:`placement.metrics.step_par`); replicas are chosen by :func:`placement.metrics.route_tokens`.
    Up to ``max_steps`` steps, evenly spread over the trace.
    """
    from placement.metrics import route_tokens

    if not trace.has_tokens:
        raise ValueError("trace_workload needs a per-token trace (topk_ids); this one has counts only")
    t = placement.topology
    G, P, m = t.ep_size, t.num_physical_experts, t.gpus_per_node
    b = int(batch_per_rank)
    per_step = b * G
    total = trace.num_tokens // per_step
    if total < 1:
        raise ValueError(
            f"the trace has {trace.num_tokens} tokens, fewer than one step of {b} tokens x {G} ranks = {per_step}; "
            f"use a smaller --batch-per-rank or a longer trace"
        )
    starts = np.unique(np.linspace(0, total - 1, num=min(max_steps, total)).astype(int)) * per_step
    L = placement.num_layers
    slot_tokens = np.zeros((len(starts), L, P))
    nvl = np.zeros((len(starts), L, G))
    rdma = np.zeros((len(starts), L, G))
    src = np.arange(per_step) // b  # [T'] rank of each token in a step
    src_node = src // m
    for i, s0 in enumerate(starts):
        ids = np.asarray(trace.topk_ids[s0 : s0 + per_step])  # [T', L, k]
        slots = route_tokens(
            placement, ids, src, policy, token_index=np.arange(s0, s0 + per_step)
        )  # [T', L, k]
        valid = slots >= 0
        gpu = np.where(valid, t.gpu_of_slot[np.maximum(slots, 0)], -1)  # [T', L, k]
        nd = np.where(valid, gpu // m, -1)
        for l in range(L):
            sl = slots[:, l][valid[:, l]]
            slot_tokens[i, l] = np.bincount(sl, minlength=P)
            g = gpu[:, l]  # [T', k]
            n = nd[:, l]
            v = valid[:, l]
            off_node = v & (n != src_node[:, None])
            on_node = v & (n == src_node[:, None]) & (g != src[:, None])
            if mode == "low_latency":
                rs = np.bincount(src, weights=off_node.sum(axis=1), minlength=G)
                ns = np.bincount(src, weights=on_node.sum(axis=1), minlength=G)
                rr = np.bincount(g[off_node], minlength=G)
                nr = np.bincount(g[on_node], minlength=G)
            else:
                # distinct remote nodes per token (RDMA), distinct GPUs per token (NVLink fan-out)
                key_n = np.where(off_node, n, -1)
                key_n = np.sort(key_n, axis=1)
                first_n = (key_n >= 0) & np.concatenate(
                    [np.ones((key_n.shape[0], 1), bool), key_n[:, 1:] != key_n[:, :-1]], axis=1
                )
                rs = np.bincount(src, weights=first_n.sum(axis=1), minlength=G)
                tok_n = np.repeat(np.arange(key_n.shape[0]), key_n.shape[1]).reshape(key_n.shape)
                landing = key_n * m + (src[tok_n] % m)  # lands on the same-index GPU of the remote node
                rr = np.bincount(landing[first_n], minlength=G)
                key_g = np.where(v & (g != src[:, None]), g, -1)
                key_g = np.sort(key_g, axis=1)
                first_g = (key_g >= 0) & np.concatenate(
                    [np.ones((key_g.shape[0], 1), bool), key_g[:, 1:] != key_g[:, :-1]], axis=1
                )
                nr = np.bincount(key_g[first_g], minlength=G).astype(float) * (m - 1) / m
                ns = np.full(G, nr.mean())
            rdma[i, l] = np.maximum(rs, rr)
            nvl[i, l] = np.maximum(ns, nr)
    how = f"counted from {len(starts)} step(s) of the trace {trace.name!r} via route_tokens ({mode}, policy {policy})"
    return Workload(slot_tokens, nvl, rdma, t.slots_per_gpu, True, how)


# ---------------------------------------------------------------------------------------------
# Layer and step
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerCost:
    """Mean per-MoE-layer times in seconds (mean over layers and sampled steps)."""

    attention: float
    shared: float
    dispatch: float
    compute: float
    combine: float
    no_overlap: float
    overlapped: float
    used: float
    overlap_used: bool
    compute_mean: float
    active_experts_max: float
    tokens_per_expert: float
    memory_bound: bool


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per GPU."""

    hbm: float
    non_expert: float
    expert: float
    redundant: float
    reserve: float
    kv_free: float
    kv_needed: float
    kv_per_sequence: float

    @property
    def fits(self) -> bool:
        return self.kv_free >= self.kv_needed and self.kv_free >= 0

    @property
    def max_batch_per_rank(self) -> int:
        return int(max(self.kv_free, 0) // self.kv_per_sequence) if self.kv_per_sequence > 0 else 0

    def explain(self) -> str:
        gb = 1e9
        used = self.non_expert + self.expert + self.reserve
        if self.kv_free < 0:
            return (
                f"weights do not fit: {self.expert / gb:.1f} GB experts (incl. {self.redundant / gb:.1f} GB redundant) + "
                f"{self.non_expert / gb:.1f} GB other weights + {self.reserve / gb:.1f} GB reserve = {used / gb:.1f} GB "
                f"> {self.hbm / gb:.1f} GB HBM"
            )
        return (
            f"KV cache does not fit: needs {self.kv_needed / gb:.1f} GB, {self.kv_free / gb:.1f} GB left after "
            f"{self.expert / gb:.1f} GB experts (incl. {self.redundant / gb:.1f} GB redundant) + "
            f"{self.non_expert / gb:.1f} GB other weights + {self.reserve / gb:.1f} GB reserve; "
            f"at most {self.max_batch_per_rank} sequences per rank"
        )


def memory_per_gpu(
    model: ModelSpec, gpu: GpuSpec, ep_size: int, num_physical_experts: int, options: CostOptions
) -> MemoryBreakdown:
    """Weights, redundant-slot cost and KV space per GPU.

    Every redundant slot costs one expert's weights in every MoE layer (DeepSeek-V3: 44 MB x 58 =
    2.55 GB per GPU per extra slot). MLA's latent KV is replicated over ``attn_tp`` ranks; GQA's splits.
    """
    if num_physical_experts % ep_size:
        raise ValueError(f"{num_physical_experts} physical experts do not divide over ep_size={ep_size}")
    spg = num_physical_experts // ep_size
    per_slot = model.expert_bytes * model.num_moe_layers
    expert = spg * per_slot
    base_slots = math.ceil(model.num_logical_experts / ep_size)
    redundant = max(spg - base_slots, 0) * per_slot
    t = options.attn_tp
    non_expert = model.non_expert_bytes(t)
    reserve = options.reserve_fraction * gpu.hbm_bytes
    kv_free = gpu.hbm_bytes - non_expert - expert - reserve
    kv_token = model.kv_bytes_per_token * (
        1.0 if model.attention == "mla" else 1.0 / min(t, model.num_kv_heads)
    )
    seqs_per_gpu = options.batch_per_rank * (t if model.attention == "mla" else 1)
    if options.phase == "decode":
        kv_needed = seqs_per_gpu * options.context_len * kv_token
        kv_seq = options.context_len * kv_token * (t if model.attention == "mla" else 1)
    else:
        kv_needed = seqs_per_gpu * kv_token
        kv_seq = kv_token * (t if model.attention == "mla" else 1)
    return MemoryBreakdown(gpu.hbm_bytes, non_expert, expert, redundant, reserve, kv_free, kv_needed, kv_seq)


def _attention_time(model: ModelSpec, cluster: ClusterSpec, b: float, options: CostOptions) -> float:
    """One attention block for ``b`` tokens on one GPU (see module docstring)."""
    gpu, t, c = cluster.gpu, options.attn_tp, float(options.context_len)
    H = model.num_attention_heads
    proj_flops = 2.0 * model.attention_params * b
    w_bytes = model.attention_params * model.weight_bytes / t
    if model.attention == "mla":
        qk, v = model.qk_nope_head_dim + model.qk_rope_head_dim, model.v_head_dim
        decode_core = (
            2.0 * H * (2 * model.kv_lora_rank + model.qk_rope_head_dim)
        )  # absorbed, per cached token
    else:
        qk = v = model.head_dim
        decode_core = 2.0 * H * 2 * model.head_dim
    if options.phase == "decode":
        core = decode_core * c * b
        kv_read = b * c * model.kv_bytes_per_token_layer * (t if model.attention == "mla" else 1)
    else:
        core = 2.0 * H * (qk + v) * (c / 2) * b  # causal: half the prompt on average
        kv_read = b * model.kv_bytes_per_token_layer
    proj = float(gemm_time(gpu, proj_flops, w_bytes + b * model.hidden_size * 4, model.weight_bytes))
    time = proj + max(
        core / (gpu.flops_bf16 * gpu.eta_attention), kv_read / (gpu.hbm_bandwidth * gpu.eta_memory)
    )
    time += gpu.gemm_overhead
    if t > 1:  # one all-reduce of the attention output inside the TP group
        time += (
            cluster.intra.latency
            + 2.0 * (t - 1) / t * b * t * model.hidden_size * 2 / cluster.intra.bandwidth
        )
    return float(time)


def _mlp_time(model: ModelSpec, gpu: GpuSpec, tokens: float, inter: int, split: int = 1) -> float:
    if inter <= 0:
        return 0.0
    d = model.hidden_size
    w = 3.0 * d * inter * model.weight_bytes / split
    return float(gemm_time(gpu, 6.0 * d * inter * tokens / split, w + tokens * 4 * d, model.weight_bytes))


def _moe_parts(
    model: ModelSpec, cluster: ClusterSpec, wl: Workload, scale: float, num_nodes: int, ep_size: int
):
    """Per-step, per-layer ``(dispatch, compute max over g, combine, compute mean)`` arrays ``[S, L]``."""
    gpu = cluster.gpu
    d, f = model.hidden_size, model.moe_intermediate_size
    n = wl.gpu_tokens(scale)  # [S, L, G]
    A = wl.active_experts(scale)  # [S, L, G]
    act_bytes = n * (model.dispatch_bytes_per_token + 2 * d + 4 * f)
    comp = gemm_time(
        gpu, 6.0 * d * f * n, A * model.expert_bytes + act_bytes, model.weight_bytes
    )  # [S, L, G]
    disp = a2a_time(
        cluster,
        wl.nvl_units * scale * model.dispatch_bytes_per_token,
        wl.rdma_units * scale * model.dispatch_bytes_per_token,
        num_nodes,
        ep_size,
    ).max(axis=2)
    comb = a2a_time(
        cluster,
        wl.nvl_units * scale * model.combine_bytes_per_token,
        wl.rdma_units * scale * model.combine_bytes_per_token,
        num_nodes,
        ep_size,
    ).max(axis=2)
    return disp, comp.max(axis=2), comb, comp.mean(axis=2), A.max(axis=2), n


@dataclass(frozen=True)
class StepCost:
    """One forward step on one GPU.

    ``step_time`` seconds; ``tokens_per_s_per_gpu = batch_per_rank / step_time``.
    """

    step_time: float
    tokens_per_s_per_gpu: float
    layer: LayerCost
    moe_layers_time: float
    dense_layers_time: float
    lm_head_time: float
    bottleneck: str
    workload_how: str


def step_cost(
    model: ModelSpec, cluster: ClusterSpec, placement, workload: Workload, options: CostOptions
) -> StepCost:
    """Step time of one attention-DP rank (all ranks run in lockstep through the all-to-alls).

    Args:
        placement: the :class:`Placement` the workload was computed for (its topology gives G and N).
        workload: from :func:`analytic_workload` or :func:`trace_workload`.
    """
    t = placement.topology
    G, N = t.ep_size, t.num_nodes
    gpu = cluster.gpu
    b = float(options.batch_per_rank)
    shared_f = model.shared_intermediate_size

    def parts(scale):
        bb = b * scale
        attn = _attention_time(model, cluster, bb, options)
        shared = _mlp_time(model, gpu, bb, shared_f)
        disp, comp, comb, comp_mean, amax, n = _moe_parts(model, cluster, workload, scale, N, G)
        return attn, shared, disp, comp, comb, comp_mean, amax, n

    attn, shared, disp, comp, comb, comp_mean, amax, n = parts(1.0)
    no = attn + shared + disp + comp + comb  # [S, L]
    a2, s2, d2, c2, k2, _, _, _ = parts(0.5)
    tbo = 2.0 * np.maximum(a2 + s2 + c2, d2 + k2)
    if options.overlap == "off":
        used, on = no, False
    elif options.overlap == "on":
        used, on = tbo, True
    else:
        on = bool(tbo.mean() < no.mean())
        used = tbo if on else no
    # The workload has L rows; the model may have more MoE layers (a trace of some layers): scale the mean.
    moe_time = float(used.mean() * model.num_moe_layers)
    dense_attn = _attention_time(model, cluster, b, options)
    dense_time = model.num_dense_layers * (
        dense_attn + _mlp_time(model, gpu, b, model.dense_intermediate_size, options.attn_tp)
    )
    head_tokens = b if options.phase == "decode" else max(1.0, b / options.context_len)
    lm = float(
        gemm_time(
            gpu,
            2.0 * model.vocab_size * model.hidden_size * head_tokens,
            model.vocab_size * model.hidden_size * 2.0 / options.attn_tp,
            2.0,
        )
    )
    step = moe_time + dense_time + lm
    tokens_per_expert = float(n.sum(axis=2).mean() / max(model.num_logical_experts, 1))
    knee = gpu.knee_tokens_per_expert(model.weight_bytes)
    layer = LayerCost(
        attention=float(np.mean(attn)),
        shared=float(np.mean(shared)),
        dispatch=float(disp.mean()),
        compute=float(comp.mean()),
        combine=float(comb.mean()),
        no_overlap=float(no.mean()),
        overlapped=float(tbo.mean()),
        used=float(used.mean()),
        overlap_used=on,
        compute_mean=float(comp_mean.mean()),
        active_experts_max=float(amax.mean()),
        tokens_per_expert=tokens_per_expert,
        memory_bound=bool(tokens_per_expert < knee),
    )
    comm = layer.dispatch + layer.combine
    compute = layer.attention + layer.shared + layer.compute
    bottleneck = (
        "communication"
        if comm > compute
        else ("attention" if layer.attention > layer.compute + layer.shared else "experts")
    )
    return StepCost(step, b / step, layer, moe_time, float(dense_time), lm, bottleneck, workload.how)


def with_overrides(spec, **kw):
    """``dataclasses.replace`` that names the valid fields on a typo."""
    names = {f.name for f in fields(spec)}
    bad = set(kw) - names
    if bad:
        raise ValueError(f"{type(spec).__name__} has no fields {sorted(bad)}; valid: {sorted(names)}")
    return replace(spec, **kw)
