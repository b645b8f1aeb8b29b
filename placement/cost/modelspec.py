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

from moe_placement.base.limits import MAX_EXPERTS, MAX_HIDDEN_SIZE, MAX_INTERMEDIATE_SIZE, MAX_LAYERS
from moe_placement.base.options import refuse_unknown_keywords
from placement.cost.fields import Range, check_fields, check_value, show

__all__ = ["BUILTIN_MODELS", "ModelSpec", "check_hf_config_fits", "load_model", "model_from_hf_config"]

_MODELS_DIR = Path(__file__).with_name("models")
BUILTIN_MODELS = {
    "deepseek-v3": "deepseek_v3.json",
    "deepseek-r1": "deepseek_v3.json",
    "deepseek-v2-lite": "deepseek_v2_lite.json",
    "mixtral-8x7b": "mixtral_8x7b.json",
    "qwen3-30b-a3b": "qwen3_30b_a3b.json",
    "olmoe-1b-7b": "olmoe_1b_7b.json",
    "olmoe": "olmoe_1b_7b.json",
    "qwen1.5-moe-a2.7b": "qwen15_moe_a2_7b.json",
    "qwen1.5-moe": "qwen15_moe_a2_7b.json",
}


# Accepted range of each numeric field of ModelSpec (fields not listed: their kind's default range,
# placement.cost.fields). Sizes are bounded so that no description makes a command allocate more than
# the machine holds (a layer count of 1e9 would build a 1e9-row map).
_DIM = Range(0, 1 << 16)  # head counts, head dims, MLA ranks
_RANGES = {
    "hidden_size": Range(1, MAX_HIDDEN_SIZE),
    "moe_intermediate_size": Range(1, MAX_INTERMEDIATE_SIZE),
    "num_logical_experts": Range(1, MAX_EXPERTS),
    "top_k": Range(1, MAX_EXPERTS),
    "num_layers": Range(1, MAX_LAYERS),
    "moe_layer_ids": Range(0, MAX_LAYERS - 1),
    "num_shared_experts": Range(0, MAX_EXPERTS),
    "shared_intermediate_size": Range(0, MAX_INTERMEDIATE_SIZE),
    "dense_intermediate_size": Range(0, MAX_INTERMEDIATE_SIZE),
    "weight_bytes": Range(0.125, 8.0),  # one bit .. FP64
    "kv_cache_bytes": Range(0.125, 8.0),
    "num_attention_heads": Range(1, 1 << 16),
    "num_kv_heads": Range(1, 1 << 16),
    "head_dim": Range(1, 1 << 16),
    "kv_lora_rank": _DIM,
    "q_lora_rank": _DIM,
    "qk_rope_head_dim": _DIM,
    "qk_nope_head_dim": _DIM,
    "v_head_dim": _DIM,
    "vocab_size": Range(1, 1 << 24),
    "num_groups": Range(1, MAX_EXPERTS),
    "topk_group": Range(1, MAX_EXPERTS),
    "max_context_len": Range(1, 1 << 24),
}


def _as_tuple(ids: Any) -> Any:
    """A list of layer ids as a tuple (anything else is left for the field check to refuse)."""
    return tuple(ids) if isinstance(ids, list) else ids


def _check_shape(m: ModelSpec, where: str) -> None:
    """What a single field's range cannot say: top-k within the experts, the MoE layers among the
    layers, groups dividing the experts, MLA's ranks, GQA's heads dividing over the KV heads."""
    if m.top_k > m.num_logical_experts:
        raise ValueError(f"{where}: top_k={m.top_k} exceeds the {m.num_logical_experts} experts")
    ids = m.moe_layer_ids
    if not ids or max(ids) >= m.num_layers or len(set(ids)) != len(ids):
        raise ValueError(
            f"{where}: moe_layer_ids must be distinct indices in [0, {m.num_layers}), got {_short(ids)}"
        )
    if m.attention not in ("mla", "gqa"):
        raise ValueError(f"{where}: attention must be 'mla' or 'gqa', got {m.attention!r}")
    if m.attention == "mla" and not (m.kv_lora_rank and m.qk_rope_head_dim):
        raise ValueError(f"{where}: MLA needs kv_lora_rank and qk_rope_head_dim (both > 0)")
    if m.attention == "gqa" and m.num_attention_heads % m.num_kv_heads:
        raise ValueError(
            f"{where}: num_attention_heads={m.num_attention_heads} is not a multiple of num_kv_heads="
            f"{m.num_kv_heads} (grouped-query attention shares each KV head among whole query groups)"
        )
    if m.num_groups is not None and m.num_logical_experts % m.num_groups:
        raise ValueError(
            f"{where}: num_groups={m.num_groups} does not divide the {m.num_logical_experts} experts"
        )
    if m.topk_group is not None and m.topk_group > (m.num_groups or 0):
        raise ValueError(f"{where}: topk_group={m.topk_group} needs num_groups >= it, got {m.num_groups}")


def _short(ids: tuple[int, ...]) -> str:
    return str(ids) if len(ids) <= 8 else f"({', '.join(map(str, ids[:8]))}, ... {len(ids)} ids)"


# ---------------------------------------------------------------------------------------------
# Model description
# ---------------------------------------------------------------------------------------------
@refuse_unknown_keywords
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
        max_context_len: the longest sequence (prompt + output tokens) the model serves (HF
            ``max_position_embeddings``); None: unknown (nothing is checked against it).
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
    max_context_len: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "moe_layer_ids", _as_tuple(self.moe_layer_ids))
        where = f"model {show(self.name)}" if isinstance(self.name, str) else "model"
        check_fields(self, _RANGES, where)
        object.__setattr__(self, "moe_layer_ids", tuple(int(i) for i in self.moe_layer_ids))
        _check_shape(self, where)

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
        if not isinstance(d, Mapping):
            raise ValueError(f"{where}: a model description is a JSON object, got {type(d).__name__}")
        d = dict(d)
        if "moe_layer_ids" not in d and "first_moe_layer" in d:
            # the layer count is checked before the range of ids is built from it
            check_value("num_layers", d.get("num_layers"), "int", _RANGES["num_layers"], where)
            check_value("first_moe_layer", d["first_moe_layer"], "int", Range(0, d["num_layers"] - 1), where)
            d["moe_layer_ids"] = tuple(range(d.pop("first_moe_layer"), d["num_layers"]))
        d.pop("first_moe_layer", None)
        d.pop("notes", None)
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)}; known: {sorted(known)}")
        missing = [k for k in _REQUIRED if k not in d]
        if missing:
            raise ValueError(f"{where}: missing keys {missing}")
        try:
            return cls(**d)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None


_REQUIRED = (
    "name",
    "hidden_size",
    "moe_intermediate_size",
    "num_logical_experts",
    "top_k",
    "num_layers",
    "moe_layer_ids",
)


def _dtype_bytes(cfg: Mapping[str, Any]) -> float:
    q = cfg.get("quantization_config") or {}
    if isinstance(q, Mapping) and str(q.get("quant_method", "")).lower() == "fp8":
        return 1.0
    dt = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").lower()
    return 4.0 if "32" in dt else 1.0 if "8" in dt else 2.0


def model_from_hf_config(
    cfg: Mapping[str, Any], name: str | None = None, where: str | None = None
) -> ModelSpec:
    """Map a HF ``config.json`` dict of a DeepSeek-V2/V3, Mixtral, Qwen2/3-MoE or OLMoE model.

    Fields read: ``n_routed_experts | num_local_experts | num_experts``, ``moe_intermediate_size``
    (else ``intermediate_size``), ``num_experts_per_tok``, ``first_k_dense_replace`` and
    ``moe_layer_freq`` (DeepSeek), ``decoder_sparse_step`` and ``mlp_only_layers`` (Qwen),
    ``n_shared_experts`` / ``shared_expert_intermediate_size``, MLA's ``kv_lora_rank``,
    ``qk_rope_head_dim`` etc., ``quantization_config.quant_method == "fp8"`` for FP8 weights.
    Each integer is checked (type and range) before it is used; ``where`` (the file) starts the messages.
    """
    if not isinstance(cfg, Mapping):
        raise ValueError(f"{where or 'config.json'}: a HF config is a JSON object, got {type(cfg).__name__}")
    c = dict(cfg)
    mt = str(c.get("model_type", "")).lower()
    where = f"{where or 'config.json'} ({mt or 'unknown model_type'})"

    def need(rule: Range, *keys: str) -> int:
        v = _hf_int(c, where, rule, *keys)
        if v is None:
            raise ValueError(f"{where}: none of {keys} is present; is this an MoE model config?")
        return v

    E = need(_RANGES["num_logical_experts"], "n_routed_experts", "num_local_experts", "num_experts")
    L = need(_RANGES["num_layers"], "num_hidden_layers")
    d = need(_RANGES["hidden_size"], "hidden_size")
    k = need(_RANGES["top_k"], "num_experts_per_tok", "moe_topk", "top_k")
    dense_f = _hf_int(c, where, _RANGES["dense_intermediate_size"], "intermediate_size") or 0
    f = _hf_int(c, where, _RANGES["moe_intermediate_size"], "moe_intermediate_size") or dense_f
    if f <= 0:
        raise ValueError(f"{where}: no moe_intermediate_size or intermediate_size")
    moe = _hf_moe_layers(c, mt, L, where)
    n_shared, shared_f = _hf_shared_experts(c, f, where)
    attention = _hf_attention(c, d, where)
    vocab = _hf_int(c, where, _RANGES["vocab_size"], "vocab_size", zero=False) or 32000
    groups = _hf_int(c, where, _RANGES["num_groups"], "n_group") or None
    context = _hf_int(c, where, _RANGES["max_context_len"], "max_position_embeddings", zero=False)
    topk_group = _hf_int(c, where, _RANGES["topk_group"], "topk_group") or None
    try:
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
            **attention,
            vocab_size=vocab,
            num_groups=groups,
            topk_group=topk_group,
            source=f"HF config.json, model_type={mt}",
            max_context_len=context,
        )
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def _hf_int(c: Mapping[str, Any], where: str, rule: Range, *keys: str, zero: bool = True) -> int | None:
    """The first of ``keys`` present (not null) as an int checked against ``rule`` (with ``zero``, 0 is
    let through for the caller's "absent" reading), else None."""
    for k in keys:
        v = c.get(k)
        if v is not None:
            check_value(k, v, "int", Range(0, rule.hi) if zero and _is_zero(v) else rule, where)
            return int(v)
    return None


def _is_zero(v: Any) -> bool:
    return type(v) is int and v == 0


def _hf_moe_layers(c: Mapping[str, Any], mt: str, L: int, where: str) -> list[int]:
    """Indices of the MoE layers among ``L`` decoder layers (DeepSeek dense-first, Qwen sparse step)."""
    if "first_k_dense_replace" in c or mt.startswith("deepseek"):
        first = _hf_int(c, where, Range(0, MAX_LAYERS), "first_k_dense_replace") or 0
        freq = _hf_int(c, where, Range(1, MAX_LAYERS), "moe_layer_freq", zero=False) or 1
        return [i for i in range(L) if i >= first and i % freq == 0]
    if "decoder_sparse_step" in c or "mlp_only_layers" in c:
        step = _hf_int(c, where, Range(1, MAX_LAYERS), "decoder_sparse_step", zero=False) or 1
        only = c.get("mlp_only_layers") or []
        check_value("mlp_only_layers", only, "tuple[int, ...]", Range(0, MAX_LAYERS), where)
        dense = set(only)
        return [i for i in range(L) if i not in dense and (i + 1) % step == 0]
    return list(range(L))


def _hf_shared_experts(c: Mapping[str, Any], f: int, where: str) -> tuple[int, int]:
    """``(num_shared_experts, total shared intermediate size)``."""
    n_shared = _hf_int(c, where, _RANGES["num_shared_experts"], "n_shared_experts") or 0
    shared_f = n_shared * f
    size = _hf_int(c, where, _RANGES["shared_intermediate_size"], "shared_expert_intermediate_size")
    if size:
        shared_f = size
        n_shared = max(n_shared, 1)
    return n_shared, shared_f


def _hf_attention(c: Mapping[str, Any], d: int, where: str) -> dict[str, Any]:
    """The attention fields of :class:`ModelSpec` (MLA when ``kv_lora_rank`` is set, else GQA)."""

    def get(key: str) -> int:
        return _hf_int(c, where, _RANGES.get(key, _DIM), key) or 0

    H = _hf_int(c, where, _RANGES["num_attention_heads"], "num_attention_heads", zero=False) or 32
    mla = bool(get("kv_lora_rank"))
    head_dim = get("head_dim") or (get("v_head_dim") if mla else 0) or max(d // H, 1)
    return {
        "attention": "mla" if mla else "gqa",
        "num_attention_heads": H,
        "num_kv_heads": _hf_int(c, where, _RANGES["num_kv_heads"], "num_key_value_heads", zero=False) or H,
        "head_dim": head_dim,
        "kv_lora_rank": get("kv_lora_rank"),
        "q_lora_rank": get("q_lora_rank"),
        "qk_rope_head_dim": get("qk_rope_head_dim"),
        "qk_nope_head_dim": get("qk_nope_head_dim"),
        "v_head_dim": get("v_head_dim"),
    }


# sizes a HF config may state, checked before a model is built from it (check_hf_config_fits)
_HF_SIZES = {
    "num_hidden_layers": MAX_LAYERS,
    "hidden_size": MAX_HIDDEN_SIZE,
    "intermediate_size": MAX_INTERMEDIATE_SIZE,
    "moe_intermediate_size": MAX_INTERMEDIATE_SIZE,
    "vocab_size": 1 << 24,
    "num_attention_heads": 1 << 16,
    "num_key_value_heads": 1 << 16,
    "head_dim": 1 << 16,
    "num_local_experts": MAX_EXPERTS,
    "num_experts": MAX_EXPERTS,
    "n_routed_experts": MAX_EXPERTS,
    "num_experts_per_tok": MAX_EXPERTS,
    "max_position_embeddings": 1 << 24,
}
_EXPERT_KEYS = ("n_routed_experts", "num_local_experts", "num_experts")


def check_hf_config_fits(cfg: Mapping[str, Any], where: str, bytes_per_weight: float = 4.0) -> None:
    """A ValueError before anything is built from a HF ``config.json`` dict whose sizes are out of range
    or whose weights (``bytes_per_weight`` each: 4 for float32, what random and default-loaded weights
    take) need more than 80% of the memory available now. Layouts the cost model does not map (no
    routed-expert count) are bounded by their sizes only."""
    from moe_placement.base.limits import check_memory

    for key, hi in _HF_SIZES.items():
        if cfg.get(key) is not None:
            check_value(key, cfg[key], "int", Range(1, hi), where)
    if not any(cfg.get(k) is not None for k in _EXPERT_KEYS):
        return
    m = model_from_hf_config(cfg, where=where)
    weights = (
        m.non_expert_bytes() + m.expert_bytes * m.num_logical_experts * m.num_moe_layers
    ) / m.weight_bytes
    check_memory(
        bytes_per_weight * weights,
        f"{where}: the model ({weights:,.0f} weights of {bytes_per_weight:g} bytes)",
        "use a smaller config (fewer layers or experts, a smaller hidden size)",
    )


def load_model(name_or_path: str | Path) -> ModelSpec:
    """A built-in model (``deepseek-v3``, ``deepseek-r1``, ``deepseek-v2-lite``, ``mixtral-8x7b``,
    ``qwen3-30b-a3b``, ``olmoe-1b-7b``, ``qwen1.5-moe-a2.7b``), a model-description JSON, or a HF
    ``config.json`` (or a folder holding one)."""
    from moe_placement.base.fileio import load_json

    if not isinstance(name_or_path, (str, Path)):
        raise ValueError(
            f"model must be a built-in name ({sorted(BUILTIN_MODELS)}) or a path, got {type(name_or_path).__name__}"
        )
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
    return model_from_hf_config(d, name=p.parent.name if p.name == "config.json" else p.stem, where=str(p))
