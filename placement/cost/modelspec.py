"""What the cost model knows about an MoE model: :class:`ModelSpec`, built-in presets, HF ``config.json``.

Sizes are elements or bytes; ``d`` hidden size, ``f`` one routed expert's intermediate size, ``E``
routed experts, ``k`` experts per token. :func:`load_model` reads a built-in name, a model-description
JSON or a HF ``config.json`` (:func:`model_from_hf_config`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["BUILTIN_MODELS", "ModelSpec", "load_model", "model_from_hf_config"]

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
    moe = _hf_moe_layers(c, mt, L)
    n_shared, shared_f = _hf_shared_experts(c, f)
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
        **_hf_attention(c, d),
        vocab_size=int(c.get("vocab_size") or 32000),
        num_groups=int(c["n_group"]) if c.get("n_group") else None,
        topk_group=int(c["topk_group"]) if c.get("topk_group") else None,
        source=f"HF config.json, model_type={mt}",
    )


def _hf_moe_layers(c: Mapping[str, Any], mt: str, L: int) -> list[int]:
    """Indices of the MoE layers among ``L`` decoder layers (DeepSeek dense-first, Qwen sparse step)."""
    if "first_k_dense_replace" in c or mt.startswith("deepseek"):
        first = int(c.get("first_k_dense_replace") or 0)
        freq = int(c.get("moe_layer_freq") or 1)
        return [i for i in range(L) if i >= first and i % freq == 0]
    if "decoder_sparse_step" in c or "mlp_only_layers" in c:
        step = int(c.get("decoder_sparse_step") or 1)
        only = set(int(i) for i in (c.get("mlp_only_layers") or []))
        return [i for i in range(L) if i not in only and (i + 1) % step == 0]
    return list(range(L))


def _hf_shared_experts(c: Mapping[str, Any], f: int) -> tuple[int, int]:
    """``(num_shared_experts, total shared intermediate size)``."""
    n_shared = int(c.get("n_shared_experts") or 0)
    shared_f = n_shared * f
    if c.get("shared_expert_intermediate_size"):
        shared_f = int(c["shared_expert_intermediate_size"])
        n_shared = max(n_shared, 1)
    return n_shared, shared_f


def _hf_attention(c: Mapping[str, Any], d: int) -> dict[str, Any]:
    """The attention fields of :class:`ModelSpec` (MLA when ``kv_lora_rank`` is set, else GQA)."""
    H = int(c.get("num_attention_heads") or 32)
    mla = bool(c.get("kv_lora_rank"))
    head_dim = int(c.get("head_dim") or (c.get("v_head_dim") if mla else 0) or (d // H))
    return {
        "attention": "mla" if mla else "gqa",
        "num_attention_heads": H,
        "num_kv_heads": int(c.get("num_key_value_heads") or H),
        "head_dim": head_dim,
        "kv_lora_rank": int(c.get("kv_lora_rank") or 0),
        "q_lora_rank": int(c.get("q_lora_rank") or 0),
        "qk_rope_head_dim": int(c.get("qk_rope_head_dim") or 0),
        "qk_nope_head_dim": int(c.get("qk_nope_head_dim") or 0),
        "v_head_dim": int(c.get("v_head_dim") or 0),
    }


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
