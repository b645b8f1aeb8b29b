"""Decode steps of routed requests: which trace token each attention-DP rank decodes in each step.

Shapes: Q requests, T trace tokens, L layers, k top-k, G ranks, N decoded tokens, S steps.

The model (continuous batching, one token per request in flight per step, no batch cap):

- requests arrive at their step (a first turn) or ``think`` steps after the request they follow
  finishes (a conversation's next turn); each is routed on arrival (:meth:`Router.route`) and decodes
  from that step on, one token per step on its rank, until its ``decode`` tokens are out; then the
  router is told (:meth:`Router.finish`) and the rank's prefix cache gets the turn's prompt and answer;
- a request's decode tokens walk the trace's tokens ``seq_start + (offset + j) mod seq_len``: their
  routing is real routing, the sequence a request's text came from;
- each step the router is given each rank's KV tokens (prompt plus tokens decoded so far).

:func:`stream_from_trace` builds the requests from a trace's sequences (Poisson arrivals sized so that
``step_tokens`` requests are in flight per rank on average, by Little's law); sessions come from
:mod:`placement.routing.sessions`. Every rule is run on the same stream (same arrivals, same tokens).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from moe_placement.base.limits import check_whole
from placement.routing.requests import Request, signature_of
from placement.routing.router import Router
from profiling.trace import RoutingTrace

__all__ = ["MAX_SIM_TOKENS", "RequestStream", "RoutedRun", "simulate", "stream_from_trace"]

MAX_SIM_TOKENS = 1 << 26  # decoded tokens one simulation may emit (int64 arrays of about 1.5 GiB)


@dataclass(frozen=True, eq=False)
class RequestStream:
    """Requests to route and decode (arrays int64 ``[Q]``).

    Attributes:
        requests: what the router sees of each (ids unique).
        arrival: its arrival step (-1 for a request that follows another).
        follows: the request whose finish it waits for (-1: none; it must come earlier in the stream).
        think: steps between that finish and this arrival.
        seq_start, seq_len: the trace tokens its decode walks (cyclically); offset: where it starts.
        decode: tokens it decodes (0: it is routed and finishes at once).
        output: per request, the segments its answer adds to its rank's cache (``()``: none).
        notes: how the stream was made.
    """

    requests: tuple[Request, ...]
    arrival: np.ndarray
    follows: np.ndarray
    think: np.ndarray
    seq_start: np.ndarray
    seq_len: np.ndarray
    offset: np.ndarray
    decode: np.ndarray
    output: tuple[tuple[tuple[Hashable, int], ...], ...]
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        Q = len(self.requests)
        for name in ("arrival", "follows", "think", "seq_start", "seq_len", "offset", "decode"):
            a = np.asarray(getattr(self, name))
            if a.shape != (Q,) or (Q and a.dtype.kind not in "iu"):
                raise ValueError(
                    f"RequestStream.{name} must be {Q} integers (one per request), got {a.dtype} {a.shape}"
                )
            object.__setattr__(self, name, a.astype(np.int64))
        if len(self.output) != Q:
            raise ValueError(f"RequestStream.output must hold {Q} segment chains, got {len(self.output)}")
        f = self.follows
        if Q and ((f >= np.arange(Q)) | (f < -1)).any():
            raise ValueError("RequestStream.follows must name an earlier request (or -1)")
        if Q and ((f < 0) & (self.arrival < 0)).any():
            raise ValueError("a request that follows none needs an arrival step >= 0")
        if Q and ((self.seq_len < 1) | (self.decode < 0) | (self.think < 0)).any():
            raise ValueError("RequestStream: seq_len must be >= 1, decode and think >= 0")
        if int(self.decode.sum()) > MAX_SIM_TOKENS:
            raise ValueError(
                f"the stream decodes {int(self.decode.sum())} tokens, over the {MAX_SIM_TOKENS} a simulation "
                f"may emit; route fewer requests"
            )

    @property
    def num_requests(self) -> int:
        return len(self.requests)


@dataclass(frozen=True, eq=False)
class RoutedRun:
    """What one rule did with a stream (arrays int64).

    Attributes:
        token, step, rank: ``[N]`` each decoded token's trace index, step and rank.
        num_steps: ``S``; per_rank: ``[S, G]`` tokens each rank decoded in each step.
        rank_of, arrived, finished, hit: ``[Q]`` each request's rank, arrival and finish steps, and its
            prompt tokens found in that rank's prefix cache.
        fallbacks: ``{reason: requests}`` the rule routed by load instead.
        last_arrival: the step the last request that follows none (a first turn) arrived.
    """

    token: np.ndarray
    step: np.ndarray
    rank: np.ndarray
    num_steps: int
    per_rank: np.ndarray
    rank_of: np.ndarray
    arrived: np.ndarray
    finished: np.ndarray
    hit: np.ndarray
    fallbacks: dict
    last_arrival: int


class _Clock:
    """Arrivals due at each step: first turns in arrival order, then follow-ups as they are scheduled."""

    def __init__(self, stream: RequestStream):
        self.firsts = [int(q) for q in np.argsort(stream.arrival, kind="stable") if stream.arrival[q] >= 0]
        self.next_first = 0
        self.later: dict[int, list[int]] = defaultdict(list)
        self.followers: dict[int, list[int]] = defaultdict(list)
        for q in np.flatnonzero(stream.follows >= 0):
            self.followers[int(stream.follows[q])].append(int(q))
        self.arrival = stream.arrival

    def due(self, s: int) -> list[int]:
        out = []
        while self.next_first < len(self.firsts) and self.arrival[self.firsts[self.next_first]] <= s:
            out.append(self.firsts[self.next_first])
            self.next_first += 1
        return out + self.later.pop(s, [])

    def idle(self) -> bool:
        return self.next_first >= len(self.firsts) and not self.later


def simulate(stream: RequestStream, router: Router) -> RoutedRun:
    """Route and decode every request of ``stream`` with ``router`` (module docstring)."""
    Q, G = stream.num_requests, router.num_ranks
    rank_of, arrived, finished = (np.full(Q, -1, dtype=np.int64) for _ in range(3))
    hit, pos = np.zeros(Q, dtype=np.int64), np.zeros(Q, dtype=np.int64)
    clock, running = _Clock(stream), []
    out_tok, out_step, out_rank, per_rank, fallbacks = [], [], [], [], defaultdict(int)
    s = 0
    while running or not clock.idle():
        for q in clock.due(s):
            rank_of[q], arrived[q] = router.route(stream.requests[q]), s
            hit[q] = router.last.hit_tokens
            if router.last.fallback:
                fallbacks[router.last.fallback] += 1
            running.append(q)
        run = np.asarray(running, dtype=np.int64)
        live = run[pos[run] < stream.decode[run]]  # decode 0: finished at once
        tok = stream.seq_start[live] + (stream.offset[live] + pos[live]) % stream.seq_len[live]
        out_tok.append(tok)
        out_step.append(np.full(live.size, s, dtype=np.int64))
        out_rank.append(rank_of[live])
        per_rank.append(np.bincount(rank_of[live], minlength=G))
        pos[live] += 1
        running = _finish_done(stream, router, run, pos, finished, clock, s)
        _report_kv(stream, router, running, rank_of, pos)
        s += 1
    return RoutedRun(
        token=_cat(out_tok),
        step=_cat(out_step),
        rank=_cat(out_rank),
        num_steps=s,
        per_rank=np.stack(per_rank) if per_rank else np.zeros((0, G), dtype=np.int64),
        rank_of=rank_of,
        arrived=arrived,
        finished=finished,
        hit=hit,
        fallbacks=dict(fallbacks),
        last_arrival=int(arrived[stream.follows < 0].max()) if Q else 0,
    )


def _cat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _finish_done(stream, router, run, pos, finished, clock: _Clock, s: int) -> list[int]:
    """Finish the requests of ``run`` whose decode is out; schedule their follow-ups; the rest."""
    keep = []
    for q in run.tolist():
        if pos[q] < stream.decode[q]:
            keep.append(q)
            continue
        finished[q] = s
        rank = router.finish(stream.requests[q].request_id)
        router.cache(rank, tuple(stream.requests[q].prefix) + tuple(stream.output[q]))
        for f in clock.followers.get(q, ()):
            clock.later[s + 1 + int(stream.think[f])].append(f)
    return keep


def _report_kv(stream, router: Router, running: list[int], rank_of, pos) -> None:
    """Each rank's KV tokens now: prompts plus decoded tokens of its requests in flight."""
    if not running:
        router.report_kv(np.zeros(router.num_ranks, dtype=np.int64))
        return
    run = np.asarray(running, dtype=np.int64)
    prompt = np.fromiter((stream.requests[q].prompt_tokens for q in running), dtype=np.int64, count=run.size)
    router.report_kv(np.bincount(rank_of[run], weights=prompt + pos[run], minlength=router.num_ranks))


def stream_from_trace(
    trace: RoutingTrace,
    sequences: Sequence[int],
    ep_size: int,
    step_tokens: int,
    *,
    signature_tokens: int,
    seed: int = 0,
) -> RequestStream:
    """One request per sequence of ``trace`` (``seq_offsets``), arriving as a Poisson process.

    A request's first ``n = min(signature_tokens, length - 1)`` tokens (at least one) are its prompt and
    make its signature; the rest are its decode tokens. Arrivals: exponential gaps with mean
    ``mean decode / (ep_size x step_tokens)`` steps, so that ``step_tokens`` requests per rank are in
    flight on average once warm (Little's law). No prefix is shared (each prompt is its own segment).
    """
    if trace.seq_offsets is None or not trace.has_tokens:
        raise ValueError("routing requests needs a per-token trace with request boundaries (seq_offsets)")
    check_whole("signature_tokens", signature_tokens, 1, 1 << 20)
    seqs = np.asarray(sequences, dtype=np.int64)
    off = trace.seq_offsets
    start, length = off[seqs], off[seqs + 1] - off[seqs]
    n = np.clip(np.minimum(signature_tokens, length - 1), 1, None)
    decode = np.maximum(length - n, 0)
    assert trace.topk_ids is not None
    reqs = tuple(
        Request(
            request_id=int(q),
            prompt_tokens=int(n[i]),
            signature=signature_of(trace.topk_ids[start[i] : start[i] + n[i]], trace.num_logical_experts),
            prefix=((("prompt", int(q)), int(n[i])),),
        )
        for i, q in enumerate(seqs.tolist())
    )
    mean = max(float(decode.mean()) if decode.size else 1.0, 1.0)
    gaps = np.random.default_rng(seed).exponential(mean / (ep_size * step_tokens), size=seqs.size)
    arrival = np.floor(np.cumsum(gaps) - gaps[0]).astype(np.int64) if seqs.size else np.zeros(0, np.int64)
    Q = seqs.size
    notes = (
        f"{Q} requests from the trace's sequences: the first {signature_tokens} tokens (at most all but one) "
        f"are the prompt and the signature, the rest decoded",
        f"Poisson arrivals sized for {step_tokens} requests in flight per rank on {ep_size} ranks (mean decode "
        f"{mean:.1f} tokens)",
    )
    return RequestStream(
        requests=reqs,
        arrival=arrival,
        follows=np.full(Q, -1, dtype=np.int64),
        think=np.zeros(Q, dtype=np.int64),
        seq_start=start + n,
        seq_len=np.maximum(decode, 1),
        offset=np.zeros(Q, dtype=np.int64),
        decode=decode,
        output=((),) * Q,
        notes=notes,
    )
