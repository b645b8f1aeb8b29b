"""The one dispatch/combine of expert picks over ``all_to_all_single`` (uneven splits; gloo or NCCL).

Both runtimes send their picks through :func:`exchange`: the EP layer
(:meth:`runtime_hooks.ep_layer.EPMoELayer.forward`) and Hugging Face models
(:func:`runtime_hooks.hf.placed_experts_forward`). Each routes its picks to physical slots first
(:func:`runtime_hooks.ep_layer.route_slots`) and passes its own expert compute.

Shapes: T = this rank's tokens, K = top-k, H = hidden, G = ranks, S = slots per rank,
n = valid picks sent by this rank, m = picks received by this rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["exchange"]


def exchange(
    x: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    slots_per_rank: int,
    compute: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    group=None,
) -> torch.Tensor:
    """Send every pick to the rank of its slot, run ``compute`` there, bring the outputs back weighted.

    Collective over ``group``: every rank calls it, a rank without tokens with ``T = 0``.

    Args:
        x: ``[T, H]`` this rank's tokens.
        slots: int64 ``[T, K]`` physical slot of each pick; -1 = no pick (it adds nothing).
        weights: ``[T, K]`` router weight of each pick.
        slots_per_rank: ``S``; slot ``p`` lives on rank ``p // S`` as local slot ``p % S``.
        compute: ``(x [m, H], local_slot int64 [m]) -> [m, H]``, run on the receiving rank.
        group: process group (default group when None).

    Returns:
        ``[T, H]``: the weighted sum over ``K`` of every pick's expert output (``[T, K, H].sum(1)``).
    """
    import torch.distributed as dist

    G = dist.get_world_size(group)
    T, H = x.shape
    K = slots.shape[1]
    flat = slots.reshape(-1)  # [T*K] pick i belongs to token i // K
    pick = torch.nonzero(flat >= 0).squeeze(1)  # [n] valid picks
    dest = flat[pick] // slots_per_rank  # [n] destination rank
    order = torch.argsort(dest, stable=True)
    pick, dest = pick[order], dest[order]  # picks grouped by destination rank
    send_counts = torch.bincount(dest, minlength=G)  # [G]
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)  # split sizes
    send_split, recv_split = send_counts.tolist(), recv_counts.tolist()
    m = sum(recv_split)
    send_x = x.index_select(0, pick // K).contiguous()  # [n, H] token row of each pick
    send_slot = (flat[pick] % slots_per_rank).contiguous()  # [n] local slot on the destination
    recv_x = x.new_empty((m, H))
    recv_slot = torch.empty(m, dtype=torch.int64, device=x.device)
    dist.all_to_all_single(recv_x, send_x, recv_split, send_split, group=group)  # dispatch
    dist.all_to_all_single(recv_slot, send_slot, recv_split, send_split, group=group)
    y_recv = compute(recv_x, recv_slot).contiguous()  # [m, H]
    y_back = x.new_empty((pick.numel(), H))
    dist.all_to_all_single(y_back, y_recv, send_split, recv_split, group=group)  # combine
    out = x.new_zeros((T * K, H))
    out[pick] = y_back  # [T*K, H] back in pick order, 0 where no pick
    weighted = out.view(T, K, H) * weights.to(device=out.device, dtype=out.dtype).unsqueeze(-1)  # [T, K, H]
    return weighted.sum(dim=1)  # [T, H]
