"""Dispatch and combine of expert picks over ``all_to_all_single`` (uneven splits; gloo or NCCL).

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
    slots_per_rank: int,
    compute: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    group=None,
) -> torch.Tensor:
    """Send every pick to the rank of its slot, run ``compute`` there, bring the outputs back.

    Args:
        x: ``[T, H]`` this rank's tokens.
        slots: int64 ``[T*K]`` physical slot of each pick (pick ``i`` belongs to token ``i // K``);
            -1 = no pick (its output row is 0).
        slots_per_rank: ``S``; slot ``p`` lives on rank ``p // S`` as local slot ``p % S``.
        compute: ``(x [m, H], local_slot int64 [m]) -> [m, H]``, run on the receiving rank.
        group: process group (default group when None).

    Returns:
        ``[T*K, H]`` expert output of every pick, in pick order (unweighted).
    """
    import torch.distributed as dist

    G = dist.get_world_size(group)
    T, H = x.shape
    K = slots.numel() // max(T, 1)
    pick = torch.nonzero(slots >= 0).squeeze(1)  # [n] valid picks
    dest = slots[pick] // slots_per_rank  # [n] destination rank
    order = torch.argsort(dest, stable=True)
    pick, dest = pick[order], dest[order]  # picks grouped by destination rank
    send_counts = torch.bincount(dest, minlength=G)  # [G]
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)  # split sizes
    send_split, recv_split = send_counts.tolist(), recv_counts.tolist()
    m = sum(recv_split)
    send_x = x.index_select(0, pick // K).contiguous()  # [n, H] token row of each pick
    send_slot = (slots[pick] % slots_per_rank).contiguous()  # [n] local slot on the destination
    recv_x = x.new_empty((m, H))
    recv_slot = torch.empty(m, dtype=torch.int64, device=x.device)
    dist.all_to_all_single(recv_x, send_x, recv_split, send_split, group=group)  # dispatch
    dist.all_to_all_single(recv_slot, send_slot, recv_split, send_split, group=group)
    y_recv = compute(recv_x, recv_slot).contiguous()  # [m, H]
    y_back = x.new_empty((pick.numel(), H))
    dist.all_to_all_single(y_back, y_recv, send_split, recv_split, group=group)  # combine
    out = x.new_zeros((slots.numel(), H))  # [T*K, H]
    out[pick] = y_back  # back in pick order
    return out
