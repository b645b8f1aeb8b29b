"""The KV-cache hand-off of prefill/decode disaggregation: bytes, link rate and the time it adds.

The one place the project prices moving a request's KV cache from the prefill instance that computed
it to the decode instance that continues it (``moe-placement plan``; docs/plan.md):

- **bytes** of a prompt of ``n`` tokens: ``kv_bytes_per_token_layer x num_layers x n``
  (:attr:`placement.cost.modelspec.ModelSpec.kv_bytes_per_token_layer`: GQA ``2 x kv_heads x head_dim x
  cache bytes``, MLA ``(kv_lora_rank + rope dim) x cache bytes``). 32 layers x 8 KV heads x head dim 128
  x BF16 x 8192 tokens: ``2 * 8 * 128 * 2 = 4096`` bytes per token and layer, ``x 32 x 8192 =
  1,073,741,824`` bytes (1 GiB).
- **rate** in bytes/s. Link speeds are quoted in bit/s: :func:`bytes_per_s_from_bits_per_s` divides by 8
  (200 Gbit/s = 25 GB/s); :func:`parse_rate` reads ``"200Gbit/s"`` or ``"25GB/s"`` and says which.
- **time**: the transfer ``T_x = bytes / (rate x links)`` (``links``: GPUs of the request's
  attention group sending their part at once) plus a fixed cost per transfer
  (:data:`placement.cost.hardware.KV_HANDOFF_FIXED_S`: handshake, block tables, completion notice).
  Streamed in ``k`` pieces (``k`` = layers when sent layer by layer, prefill chunks when sent per
  chunk, 1 when sent after the prefill), piece ``i`` leaves once its compute ends, so of a prefill that
  computes for ``T_p`` only ``max(T_x / k, T_x - T_p (k - 1) / k)`` is left after the last compute:

      exposed = fixed + max(T_x / k, T_x - T_p (k - 1) / k)

  (a pipeline of ``k`` equal stages; ``k = 1``: ``fixed + T_x``). 1 GiB at 25 GB/s is
  ``T_x = 42.9 ms``; streamed over 32 layers behind a 200 ms prefill, 1.3 ms of it is left.

Engines differ in how they stream (SGLang 0.5.23 sends the KV of each prefill chunk after the chunk's
forward pass; vLLM 0.33.0's NIXL connector pulls whole blocks after the prefill): :data:`STREAMING`
names the three choices, and the layer-wise figure is the lower bound of the three.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

from moe_placement.base.options import refuse_unknown_keywords
from placement.cost.hardware import KV_HANDOFF_FIXED_S, LinkSpec
from placement.cost.modelspec import ModelSpec

__all__ = [
    "BITS_PER_BYTE",
    "WEAK_LINK_BITS_PER_S",
    "STREAMING",
    "HandoffSpec",
    "HandoffTime",
    "bytes_per_s_from_bits_per_s",
    "handoff_time",
    "kv_handoff_bytes",
    "link_with_rate",
    "parse_rate",
]

BITS_PER_BYTE = 8
# A hand-off link slower than 200 Gbit/s (25 GB/s, the effective rate of the example) is what
# the serving rule of thumb calls a weak interconnect for prefill/decode disaggregation.
WEAK_LINK_BITS_PER_S = 200e9
# How a prefill instance sends a request's KV: after each layer's compute, after each prefill chunk,
# or once after the whole prefill.
STREAMING = ("layer", "chunk", "none")

# Rate units accepted by parse_rate -> bytes/s per unit (decimal prefixes, as link speeds are quoted;
# GiB/s binary).
_UNITS = {
    "bit/s": 1 / BITS_PER_BYTE,
    "b/s": 1 / BITS_PER_BYTE,
    "bps": 1 / BITS_PER_BYTE,
    "B/s": 1.0,
    "iB/s": 1.0,
}
_PREFIX = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
_BINARY = {"": 1.0, "K": 2.0**10, "M": 2.0**20, "G": 2.0**30, "T": 2.0**40}
_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([kKMGT]?)(bit/s|b/s|bps|B/s|iB/s)\s*$")


def bytes_per_s_from_bits_per_s(bits_per_s: float) -> float:
    """A link speed quoted in bit/s as bytes/s (``/ 8``): 200 Gbit/s -> 25e9 bytes/s."""
    value = float(bits_per_s)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"a link speed must be a positive number of bit/s, got {bits_per_s!r}")
    return value / BITS_PER_BYTE


def parse_rate(text: str) -> float:
    """Bytes/s of a rate written with its unit: ``200Gbit/s``, ``200Gb/s``, ``200Gbps`` (bits, divided
    by 8), ``25GB/s`` (bytes), ``1GiB/s`` (binary bytes). A bare number is refused: bits or bytes must
    be said."""
    m = _RATE.match(str(text))
    if not m:
        raise ValueError(
            f"link rate {text!r}: write a number with its unit, e.g. 200Gbit/s (bits per second) or "
            f"25GB/s (bytes per second)"
        )
    number, prefix, unit = float(m.group(1)), m.group(2), m.group(3)
    scale = _BINARY[prefix.upper()] if unit == "iB/s" else _PREFIX[prefix]
    rate = number * scale * _UNITS[unit]
    if not math.isfinite(rate) or rate <= 0:
        raise ValueError(f"link rate {text!r} must be positive")
    return rate


def link_with_rate(like: LinkSpec, bytes_per_s: float, name: str) -> LinkSpec:
    """``like`` (its latencies) with every bandwidth set to ``bytes_per_s``: a link given by its speed."""
    return replace(
        like,
        name=name,
        bandwidth=bytes_per_s,
        nominal_bandwidth=bytes_per_s,
        normal_bandwidth=None,
        band=(bytes_per_s, bytes_per_s),
        source=f"given rate {bytes_per_s / 1e9:g} GB/s; latencies of the {like.name} preset",
    )


def kv_handoff_bytes(model: ModelSpec, prompt_tokens: float) -> float:
    """KV-cache bytes of a prompt: ``kv_bytes_per_token_layer x num_layers x prompt_tokens`` (any
    shape of ``prompt_tokens`` broadcasts when it is an array)."""
    return model.kv_bytes_per_token_layer * model.num_layers * prompt_tokens


@refuse_unknown_keywords
@dataclass(frozen=True)
class HandoffSpec:
    """How one hand-off is priced.

    Attributes:
        link_bytes_per_s: effective bytes/s of one GPU's link (a bulk copy's bandwidth).
        fixed_s: fixed cost per transfer, seconds.
        links: GPUs sending one request's KV at once (its attention-TP group).
        streaming: ``layer``, ``chunk`` or ``none`` (:data:`STREAMING`).
        link: the link's name, for messages.
    """

    link_bytes_per_s: float
    fixed_s: float = KV_HANDOFF_FIXED_S[1]
    links: int = 1
    streaming: str = "layer"
    link: str = ""

    def __post_init__(self) -> None:
        rate, fixed = self.link_bytes_per_s, self.fixed_s
        if (
            isinstance(rate, bool)
            or not isinstance(rate, (int, float))
            or not math.isfinite(rate)
            or rate <= 0
        ):
            raise ValueError(
                f"HandoffSpec.link_bytes_per_s must be a positive number of bytes/s, got {rate!r}"
            )
        if isinstance(fixed, bool) or not isinstance(fixed, (int, float)) or not 0 <= fixed <= 60:
            raise ValueError(f"HandoffSpec.fixed_s must be seconds in [0, 60], got {fixed!r}")
        if isinstance(self.links, bool) or not isinstance(self.links, int) or self.links < 1:
            raise ValueError(f"HandoffSpec.links must be a whole number >= 1, got {self.links!r}")
        if self.streaming not in STREAMING:
            raise ValueError(
                f"HandoffSpec.streaming must be one of {', '.join(STREAMING)}, got {self.streaming!r}"
            )

    @classmethod
    def from_link(
        cls, link: LinkSpec, links: int = 1, streaming: str = "layer", fixed_s: float | None = None
    ) -> HandoffSpec:
        """The spec over a link preset: its bulk-copy (normal kernel) bandwidth."""
        bw, _ = link.kernel("normal")
        fixed = KV_HANDOFF_FIXED_S[1] if fixed_s is None else fixed_s
        return cls(float(bw), float(fixed), int(links), streaming, link.name)


@dataclass(frozen=True)
class HandoffTime:
    """One hand-off: ``bytes``; ``transfer_s`` the bytes over the links; ``exposed_s`` what it adds
    after the prefill's last compute (fixed cost included)."""

    bytes: float
    transfer_s: float
    exposed_s: float


def handoff_time(spec: HandoffSpec, kv_bytes: float, prefill_s: float = 0.0, pieces: int = 1) -> HandoffTime:
    """Price a hand-off of ``kv_bytes`` behind a prefill computing for ``prefill_s`` seconds, streamed
    in ``pieces`` pieces (layers, chunks, or 1; module docstring)."""
    if pieces < 1:
        raise ValueError(f"pieces must be >= 1, got {pieces}")
    transfer = float(kv_bytes) / (spec.link_bytes_per_s * spec.links)
    k = int(pieces)
    left = transfer if k == 1 else max(transfer / k, transfer - float(prefill_s) * (k - 1) / k)
    return HandoffTime(float(kv_bytes), transfer, spec.fixed_s + left)
