"""Per-request KV caches of a Hugging Face model: prefill, continuous-batching decode, accounting.

Each request owns its cache as one ``(keys, values)`` pair per decoder layer, ``[1, h, T, d]`` (the
layout of transformers' ``DynamicLayer``; ``h``/``d`` may differ between keys and values), so requests
join and leave a decode batch at any step: a step left-pads every running request's cache to the
longest, masks the padding (``attention_mask``) and gives each row its own position
(``position_ids``), then cuts each request's grown cache back out. Greedy tokens are those of the
request decoded alone (the padding is masked out; fp32).

Every cache tensor a request owns is registered (:func:`track`); :func:`live_kv_bytes` sums those
still referenced anywhere in the process, so a freed request that something still holds shows up.

A rank of an expert-parallel pool with nothing to run still joins every experts call of a step
(:func:`idle_step`: an empty batch through each MoE layer, in order).

Shapes: B requests in a step, T tokens cached (per request ``T_r``), L decoder layers, H hidden.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = [
    "KVLayout",
    "RequestKV",
    "decode_step",
    "decoder_layers",
    "idle_step",
    "kv_layout",
    "live_kv_bytes",
    "make_prompts",
    "prefill",
    "reference_tokens",
    "track",
]

_LIVE: weakref.WeakSet = weakref.WeakSet()


def track(t: torch.Tensor) -> torch.Tensor:
    """Register a KV tensor a request owns (counted by :func:`live_kv_bytes` while referenced)."""
    _LIVE.add(t)
    return t


def live_kv_bytes() -> int:
    """Bytes of registered KV tensors still referenced anywhere (Python or C++) in this process."""
    gc.collect()
    return int(sum(t.numel() * t.element_size() for t in list(_LIVE)))


@dataclass(frozen=True)
class KVLayout:
    """How one request's cache is laid out: ``num_layers`` pairs of keys ``[1, *k_heads_dim[0], T,
    k_heads_dim[1]]`` and values alike, of ``dtype``, contiguous, keys then values per layer."""

    num_layers: int
    k_heads_dim: tuple[int, int]
    v_heads_dim: tuple[int, int]
    dtype: str

    def layer_elems(self, tokens: int) -> tuple[int, int]:
        """Elements of the keys and of the values of one layer for ``tokens`` cached tokens."""
        return (
            self.k_heads_dim[0] * self.k_heads_dim[1] * int(tokens),
            self.v_heads_dim[0] * self.v_heads_dim[1] * int(tokens),
        )

    def bytes_per_token_layer(self) -> int:
        k, v = self.layer_elems(1)
        return (k + v) * torch.empty(0, dtype=getattr(torch, self.dtype)).element_size()

    def to_dict(self) -> dict:
        return {
            "num_layers": self.num_layers,
            "k_heads_dim": list(self.k_heads_dim),
            "v_heads_dim": list(self.v_heads_dim),
            "dtype": self.dtype,
        }


@dataclass
class RequestKV:
    """One request's cache: ``layers[l] = (keys [1, h, T, d], values [1, h', T, d'])``."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]

    @property
    def length(self) -> int:
        return int(self.layers[0][0].shape[2])

    @property
    def nbytes(self) -> int:
        return int(sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.layers))

    def free(self) -> int:
        """Drop every tensor; the bytes it held."""
        n = self.nbytes
        self.layers = []
        return n


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's decoder layers (the ``ModuleList`` named ``...layers`` of the text config's length)."""
    n = int(model.config.get_text_config().num_hidden_layers)
    for name, module in model.named_modules():
        if name.endswith("layers") and isinstance(module, torch.nn.ModuleList) and len(module) == n:
            return module
    raise ValueError(f"{type(model).__name__}: no ModuleList of its {n} decoder layers found")


def kv_layout(model: torch.nn.Module, kv: RequestKV) -> KVLayout:
    """The layout of a cache this model produced."""
    k, v = kv.layers[0]
    return KVLayout(
        len(kv.layers), (k.shape[1], k.shape[3]), (v.shape[1], v.shape[3]), str(k.dtype).split(".")[1]
    )


def _check_cache(cache) -> None:
    """ValueError unless every layer of the cache is a plain (full-attention) ``DynamicLayer``."""
    kinds = {type(layer).__name__ for layer in cache.layers}
    if kinds != {"DynamicLayer"}:
        raise ValueError(
            f"the KV hand-off streams full-attention caches (DynamicLayer); this model's cache has {sorted(kinds)}"
        )


def _own(t: torch.Tensor) -> torch.Tensor:
    """A registered copy with its own storage (a slice of a batch would keep the whole batch alive)."""
    return track(t.detach().clone())


def prefill(
    model: torch.nn.Module,
    prompts: list[torch.Tensor],
    on_layer: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None,
    keep: bool = True,
) -> tuple[list[RequestKV], list[int]]:
    """Run prompts (int64 ``[T_r]`` each) in one left-padded batch: each request's cache and first token.

    ``on_layer(l, keys [B, h, T, d], values)`` runs as soon as decoder layer ``l`` has cached the batch
    (a forward hook), while later layers still compute: the layer-wise KV streaming of a prefill rank.
    ``keep=False``: no cache is kept (``[]``), the caller took what it needed in ``on_layer``.
    """
    from transformers import DynamicCache

    lens = [int(p.numel()) for p in prompts]
    T = max(lens)
    ids = torch.stack([F.pad(p, (T - n, 0)) for p, n in zip(prompts, lens)])  # [B, T]
    mask = torch.stack([torch.arange(T) >= T - n for n in lens]).long()  # [B, T]
    pos = (torch.arange(T)[None] - torch.tensor([T - n for n in lens])[:, None]).clamp(min=0)  # [B, T]
    cache = DynamicCache()
    hooks = []
    if on_layer is not None:
        for l, layer in enumerate(decoder_layers(model)):
            hooks.append(
                layer.register_forward_hook(
                    lambda _m, _a, _o, l=l: on_layer(l, cache.layers[l].keys, cache.layers[l].values)
                )
            )
    try:
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True)
    finally:
        for h in hooks:
            h.remove()
    _check_cache(cache)
    first = out.logits[:, -1].argmax(-1).tolist()  # [B]
    if not keep:
        return [], [int(t) for t in first]
    kvs = [
        RequestKV(
            [
                (_own(c.keys[b : b + 1, :, T - n :]), _own(c.values[b : b + 1, :, T - n :]))
                for c in cache.layers
            ]
        )
        for b, n in enumerate(lens)
    ]
    return kvs, [int(t) for t in first]


def decode_step(model: torch.nn.Module, kvs: list[RequestKV], last: list[int]) -> list[int]:
    """One greedy step of ``B`` running requests: their next tokens; each ``kvs[b]`` grows by one token."""
    from transformers import DynamicCache

    lens = [kv.length for kv in kvs]
    T = max(lens)
    cache = DynamicCache()
    for l in range(len(kvs[0].layers)):
        keys = torch.cat([F.pad(kv.layers[l][0], (0, 0, T - n, 0)) for kv, n in zip(kvs, lens)])
        values = torch.cat([F.pad(kv.layers[l][1], (0, 0, T - n, 0)) for kv, n in zip(kvs, lens)])
        cache.update(keys, values, l)  # [B, h, T, d]
    mask = torch.stack([torch.arange(T + 1) >= T - n for n in lens]).long()  # [B, T + 1]
    pos = torch.tensor(lens, dtype=torch.int64)[:, None]  # [B, 1]
    ids = torch.tensor(last, dtype=torch.int64)[:, None]  # [B, 1]
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True)
    for b, (kv, n) in enumerate(zip(kvs, lens)):
        kv.layers = [
            (_own(c.keys[b : b + 1, :, T - n :]), _own(c.values[b : b + 1, :, T - n :])) for c in cache.layers
        ]
    return [int(t) for t in out.logits[:, -1].argmax(-1).tolist()]


def idle_step(model: torch.nn.Module) -> None:
    """This rank's part of a step it has no request for: an empty batch through every MoE layer's
    experts call, in model order (the calls are collective over the pool)."""
    from runtime_hooks.hf import moe_experts, placed_experts_forward

    for module in moe_experts(model).values():
        H = module.down_proj.shape[1] if not module.is_transposed else module.down_proj.shape[2]
        K = _top_k(model)
        x = torch.empty((0, H), dtype=module.down_proj.dtype, device=module.down_proj.device)
        ids = torch.empty((0, K), dtype=torch.int64, device=x.device)
        placed_experts_forward(module, x, ids, torch.empty((0, K), dtype=x.dtype, device=x.device))


def _top_k(model: torch.nn.Module) -> int:
    cfg = model.config.get_text_config()
    for key in ("num_experts_per_tok", "moe_topk", "top_k"):
        if getattr(cfg, key, None):
            return int(getattr(cfg, key))
    raise ValueError(f"{type(model).__name__}: no top-k in its config")


def make_prompts(seed: int, lens: list[int], vocab: int) -> list[torch.Tensor]:
    """int64 ``[T_i]`` seeded prompts of the given lengths, the same in every process."""
    g = torch.Generator().manual_seed(int(seed) + 29)
    return [torch.randint(0, int(vocab), (int(t),), generator=g) for t in lens]


def reference_tokens(model: torch.nn.Module, prompts: list[torch.Tensor], new_tokens: int) -> list[list[int]]:
    """The single-process model's greedy tokens of each prompt decoded alone (no placement): ``[N][n]``."""
    from runtime_hooks.hf_serve import greedy_decode

    return [greedy_decode(model, p[None], int(new_tokens))[0].tolist() for p in prompts]
