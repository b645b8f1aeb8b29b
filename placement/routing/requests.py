"""What the request router sees of a request, and the expert signature it routes by.

Shapes: L layers, E logical experts, k top-k, n signature tokens, N nodes.

A :class:`Request` is one request as it arrives at the router: an id, the prompt tokens it brings
(KV), its prompt as a chain of cacheable segments (what prefix caching can reuse), and its expert
signature. The signature is the share of the request's expert picks per (layer, expert) over its
first tokens' routing (:func:`signature_of`): a decode request in a prefill/decode-disaggregated
deployment has it from its prefill (as ELDR routes decode requests by their prefill activations);
an aggregated deployment would predict it. Where each rank's node holds those experts
(:func:`node_holdings`) gives the share of its picks that stay on the node (:func:`local_share`).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

from placement.model import Placement

__all__ = ["DEFAULT_SIGNATURE_TOKENS", "Request", "local_share", "node_holdings", "signature_of"]

# Tokens of a request whose routing makes its signature: the prompt's first tokens (enough to tell a
# domain apart from a few picks per layer; the chat template's first tokens are shared by all).
DEFAULT_SIGNATURE_TOKENS = 32


@dataclass(frozen=True, eq=False)
class Request:
    """One request as the router sees it.

    Attributes:
        request_id: any hashable id, unique among the requests in flight.
        prompt_tokens: tokens of its prompt (the KV it brings; prefix hits are counted against it).
        signature: float ``[L, E]`` share of its expert picks per layer and expert (rows summing to 1),
            or None when unknown (the affinity rule then routes it by load).
        prefix: its prompt as a chain of cacheable segments ``((key, tokens), ...)``: a segment is
            reusable on a rank that holds every segment before it (a radix cache's path). ``()``:
            nothing cacheable.
        conversation: the conversation it belongs to (informational), or None.
    """

    request_id: Hashable
    prompt_tokens: int = 0
    signature: np.ndarray | None = None
    prefix: tuple[tuple[Hashable, int], ...] = ()
    conversation: Hashable | None = None


def signature_of(topk_ids: np.ndarray, num_logical_experts: int) -> np.ndarray:
    """A request's expert signature from the routing of its first tokens.

    Args:
        topk_ids: int ``[n, L, k]`` logical ids (-1: none).

    Returns:
        float64 ``[L, E]``: per layer, the share of the tokens' picks that went to each expert (a row of
        zeros for a layer with no pick). All zeros when ``n`` is 0.
    """
    ids = np.asarray(topk_ids)
    if ids.ndim != 3:
        raise ValueError(f"topk_ids must be [tokens, layers, top_k], got shape {ids.shape}")
    n, L, k = ids.shape
    E = int(num_logical_experts)
    out = np.zeros((L, E))
    ok = ids >= 0
    if ids.size and ids.max() >= E:
        raise ValueError(f"topk_ids hold id {int(ids.max())} but there are only {E} experts")
    layer = np.broadcast_to(np.arange(L)[None, :, None], ids.shape)
    np.add.at(out, (layer[ok], ids[ok].astype(np.int64)), 1.0)
    tot = out.sum(axis=1, keepdims=True)
    return np.divide(out, tot, out=np.zeros_like(out), where=tot > 0)


def node_holdings(placement: Placement) -> np.ndarray:
    """bool ``[N, L, E]``: node ``n`` holds a replica of expert ``e`` in layer ``l``."""
    t = placement.topology
    p2l = placement.physical_to_logical_map  # [L, P]
    L, E = placement.num_layers, placement.num_logical_experts
    out = np.zeros((t.num_nodes, L, E), dtype=bool)
    node = np.broadcast_to(t.node_of_slot[None, :], p2l.shape)  # [L, P]
    layer = np.broadcast_to(np.arange(L)[:, None], p2l.shape)
    out[node, layer, p2l] = True
    return out


def local_share(signature: np.ndarray, holdings: np.ndarray) -> np.ndarray:
    """float64 ``[N]``: the share of a request's picks whose expert its rank's node holds (under a
    local-first dispatch those picks stay on the node), mean over the layers the signature covers.

    Args:
        signature: ``[L, E]`` (:func:`signature_of`); holdings: bool ``[N, L, E]`` (:func:`node_holdings`).
    """
    sig = np.asarray(signature, dtype=np.float64)
    if sig.shape != holdings.shape[1:]:
        raise ValueError(
            f"the signature is {sig.shape} (layers, experts) but the placement holds "
            f"{holdings.shape[1]} layers x {holdings.shape[2]} experts"
        )
    covered = sig.sum(axis=1) > 0  # [L]
    if not covered.any():
        return np.zeros(holdings.shape[0])
    per_layer = np.einsum("le,nle->nl", sig, holdings.astype(np.float64))  # [N, L]
    return per_layer[:, covered].mean(axis=1)
