"""A request-level, discrete-event simulator of an MoE deployment (seeded through its requests;
deterministic: the same inputs give the same times).

What it models (docs/plan.md):

- **pools and engines**: a deployment is one pool serving both phases (co-located, or replicas), or a
  prefill pool and a decode pool (disaggregated). A pool runs ``engines`` independent instances; an
  instance has ``ranks_per_engine`` attention-DP ranks that step in lockstep (the MoE all-to-all joins
  them every layer), so one step takes the cost model's time at the largest per-rank sizes of the step.
- **routing**: each request is sent to a rank of the pool (``route(request, view) -> rank``; default
  round-robin over the ranks): at arrival (both-phase or prefill pool) and when its prefill ends (decode
  pool). The rules are the one registry's (:data:`placement.routing.ROUTING_RULES`, through
  :class:`moe_placement.apps.deploy.routes.RuleRoute`); any callable of that signature plugs in.
- **continuous batching under a KV budget**: a rank admits a waiting request (first come, first
  served) when the KV tokens it would hold at the end (prompt + output; a prefill pool: the prompt until
  it is handed off) fit beside what the rank has reserved, and it has fewer than ``max_seqs`` sequences.
  A request larger than a rank's whole budget is rejected (it never meets the targets).
- **chunked prefill**: each step a rank spends ``step_tokens`` tokens: one per running sequence, the
  rest on the prompts it is prefilling (first come first served; a both-phase pool mixes them into the
  decode step, a prefill pool runs prefill steps only). A prompt's last chunk gives its first token.
- **decode**: every running sequence gains one token per step; between events (an arrival that can be
  admitted, a finish) the steps are priced in one vector (:meth:`StepTable.decode_run`).
- **hand-off** (disaggregated): when a prompt is done the decode pool's rank is chosen, a sequence
  slot and the KV reserved there (as SGLang's decode server pre-allocates before the transfer; else the
  request waits for room, holding its KV in the prefill rank), and the KV sent
  (:func:`placement.cost.handoff.handoff_time`; streamed when the decode side was ready at once,
  otherwise sent whole). Each prefill rank's link sends one request at a time; the first token reaches
  the user when the hand-off ends.

Times per request (float64 ``[n]``, seconds): arrival, start (its first step), prefill end, first
token, finish. TTFT = first token - arrival; TPOT = (finish - first token) / (output - 1).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from moe_placement.apps.deploy.tables import StepTable
from moe_placement.apps.deploy.workloads import Requests
from placement.cost.handoff import HandoffSpec, handoff_time
from placement.model import Placement
from placement.routing.rules import ROUND_ROBIN

__all__ = [
    "PHASE_BOTH",
    "DeploymentSim",
    "PoolSim",
    "PoolView",
    "RouteRequest",
    "SimResult",
    "Stop",
    "simulate",
    "zero_load",
]

PHASE_BOTH = "both"  # a pool that serves prefill and decode (co-located, replicas)
_INF = math.inf


@dataclass(frozen=True, eq=False)
class PoolSim:
    """One pool as the simulator sees it.

    Attributes:
        phase: ``both``, ``prefill`` or ``decode``.
        engines: independent instances; ranks_per_engine: attention-DP ranks of one instance.
        kv_tokens: KV-cache tokens one rank holds.
        step_tokens: tokens per rank per step (prefill chunk, or the mixed step's budget).
        max_seqs: sequences a rank runs at once (its decode cap).
        table: the pool's step times.
        placement: the pool's expert placement (one instance's; None: not known), for routes that read
            which experts each node holds; attn_tp: GPUs of one attention-DP rank (rank ``r`` of an
            instance dispatches from its EP rank ``r x attn_tp``).
    """

    phase: str
    engines: int
    ranks_per_engine: int
    kv_tokens: int
    step_tokens: int
    max_seqs: int
    table: StepTable
    placement: Placement | None = None
    attn_tp: int = 1

    @property
    def ranks(self) -> int:
        return self.engines * self.ranks_per_engine


@dataclass(frozen=True, eq=False)
class DeploymentSim:
    """What is simulated: one ``both`` pool, or ``(prefill, decode)`` pools with the hand-off between
    them (``handoff``; ``kv_bytes_per_token``: all layers; ``layers``: pieces of a layer-wise stream)."""

    pools: tuple[PoolSim, ...]
    handoff: HandoffSpec | None = None
    kv_bytes_per_token: float = 0.0
    layers: int = 1

    def __post_init__(self) -> None:
        phases = tuple(p.phase for p in self.pools)
        if phases not in ((PHASE_BOTH,), ("prefill", "decode")):
            raise ValueError(f"pools must be (both,) or (prefill, decode), got {phases}")
        if (phases[0] == "prefill") != (self.handoff is not None):
            raise ValueError("a disaggregated deployment needs a hand-off; a co-located one has none")


class RouteRequest(NamedTuple):
    """What a route sees of a request: its index, arrival time (s), prompt and output tokens."""

    index: int
    arrival_s: float
    prompt_len: int
    output_len: int


class PoolView:
    """What a route sees of a pool (read only; updated as the simulation runs).

    Attributes:
        phase: ``both``, ``prefill`` or ``decode``; ranks_per_engine: ranks of one instance (rank ``r`` is
            in instance ``r // ranks_per_engine``); num_ranks; kv_tokens: one rank's KV budget; now: the
            simulated time, seconds; counter and state (a dict): free for a route's own state (0 and
            empty at the start of each simulation); placement: the pool's (:class:`PoolSim`).
        reserved, waiting, running, in_flight: float64 / int64 ``[num_ranks]`` arrays built when read: KV
            tokens each rank has reserved, requests queued at each rank, sequences each rank decodes, and
            every request the rank has taken and not finished (queued, prefilling and decoding; a decode
            rank: those handed off or waiting for room there too).
        rank_nodes: int ``[num_ranks]``: the node of the placement's topology each rank dispatches from
            (its instance's node), or None without a placement.
    """

    def __init__(self, pool: PoolSim, engines: list, room: list | None = None):
        self.phase, self.ranks_per_engine, self.kv_tokens = pool.phase, pool.ranks_per_engine, pool.kv_tokens
        self.num_ranks = pool.ranks
        self.placement = pool.placement
        self.now = 0.0
        self.counter = 0
        self.state: dict = {}
        self._engines, self._room, self._attn_tp = engines, room, pool.attn_tp

    def _cat(self, attr: str, dtype) -> np.ndarray:
        return np.array([x for e in self._engines for x in getattr(e, attr)], dtype=dtype)

    @property
    def reserved(self) -> np.ndarray:
        return self._cat("reserved", np.float64)

    @property
    def waiting(self) -> np.ndarray:
        return np.array([len(q) for e in self._engines for q in e.waiting], dtype=np.int64)

    @property
    def running(self) -> np.ndarray:
        return self._cat("n", np.float64)

    @property
    def in_flight(self) -> np.ndarray:
        if self.phase == "decode":
            held = self._cat("held", np.int64)
            return held + np.array([len(q) for q in self._room], dtype=np.int64) if self._room else held
        return np.array(
            [len(w) + len(p) + n for e in self._engines for w, p, n in zip(e.waiting, e.pre, e.n)],
            dtype=np.int64,
        )

    @property
    def rank_nodes(self) -> np.ndarray | None:
        if self.placement is None:
            return None
        local = np.arange(self.ranks_per_engine) * self._attn_tp // self.placement.topology.gpus_per_node
        return np.tile(local, self.num_ranks // self.ranks_per_engine)


Route = Callable[[RouteRequest, PoolView], int]


@dataclass(frozen=True, eq=False)
class SimResult:
    """One simulation at ``rate`` requests/s: per-request times float64 ``[n]`` (seconds; ``inf`` for a
    rejected request, or one not simulated when the run ``stopped`` early) and the lengths."""

    rate: float
    arrival: np.ndarray
    start: np.ndarray
    prefill_end: np.ndarray
    first_token: np.ndarray
    finish: np.ndarray
    prompt: np.ndarray
    output: np.ndarray
    stopped: bool = False

    def tail(self, first: int) -> SimResult:
        """The requests from ``first`` on (the measured ones, after the warm-up)."""
        if first <= 0:
            return self
        cut = [x[first:] for x in (self.arrival, self.start, self.prefill_end, self.first_token, self.finish)]
        return SimResult(self.rate, *cut, self.prompt[first:], self.output[first:], self.stopped)

    @property
    def ttft(self) -> np.ndarray:
        return self.first_token - self.arrival

    @property
    def tpot(self) -> np.ndarray:
        """``[n]`` seconds per output token after the first (0 for one-token outputs)."""
        steps = np.maximum(self.output - 1, 1)
        with np.errstate(invalid="ignore"):
            return np.where(self.output > 1, (self.finish - self.first_token) / steps, 0.0)

    def attainment(self, ttft_s: float, tpot_s: float) -> float:
        """Share of requests meeting both targets."""
        ok = (self.ttft <= ttft_s) & (self.tpot <= tpot_s)
        return float(ok.mean())

    @property
    def served(self) -> np.ndarray:
        return np.isfinite(self.finish)

    def throughput(self) -> tuple[float, float]:
        """``(requests/s, output tokens/s)`` served over the span from the first arrival to the last finish."""
        ok = self.served
        if not ok.any():
            return 0.0, 0.0
        span = float(self.finish[ok].max() - self.arrival.min())
        span = span if span > 0 else 1.0
        return float(ok.sum()) / span, float(self.output[ok].sum()) / span


class _Engine:
    """One instance: its ranks' queues, running sequences and the run of steps in progress (per-rank
    state in lists: ``n`` running sequences, ``kv`` their cached tokens, ``reserved`` KV tokens)."""

    def __init__(self, sim: _Sim, pool: PoolSim, pi: int, index: int):
        dp = pool.ranks_per_engine
        self.sim, self.pool, self.pi, self.off, self.dp = sim, pool, pi, index * dp, dp
        self.reserved = [0.0] * dp
        self.n = [0] * dp
        self.kv = [0.0] * dp
        self.waiting = [deque() for _ in range(dp)]
        self.wranks: set[int] = set()
        self.pre = [deque() for _ in range(dp)]  # [request, prompt tokens done]
        self.npre = 0
        self.heap: list = []  # (finish step, request, rank)
        self.step = 0
        self.version = 0
        self.busy = False
        self.ends: np.ndarray | None = None  # end times of the run's steps
        self.run_len = 0
        self.pieces: list | None = None  # a prefill/mixed step: [(rank, entry, tokens)]
        self.duration = 0.0
        self.need = sim.need[pi]
        self.cap, self.max_seqs = pool.kv_tokens, pool.max_seqs
        self.held = [0] * dp  # a decode rank's sequences: running, or handed off to it and not yet running

    # ---- arrivals and wake-ups --------------------------------------------------------------
    def enqueue(self, req: int, r: int, t: float) -> None:
        self.waiting[r].append(req)
        self.wranks.add(r)
        if self._admissible(req, r):
            self.poke(t)

    def _admissible(self, req: int, r: int) -> bool:
        if self.n[r] + len(self.pre[r]) >= self.max_seqs:
            return False
        need = self.need[req]
        return need == 0 or self.reserved[r] + need <= self.cap

    def poke(self, t: float) -> None:
        """Something may be admitted: start now when idle, else end a decode run at the next step."""
        if not self.busy:
            self.compose(t)
        elif self.pieces is None and self.ends is not None:
            i = int(np.searchsorted(self.ends, t))
            if i < self.run_len - 1:
                self.run_len = i + 1
                self.version += 1
                self.sim.push(float(self.ends[i]), 0, self, self.version)

    # ---- step boundaries ----------------------------------------------------------------------
    def boundary(self, t: float) -> None:
        """The run (or one step) ended at ``t``: account for it, finish and join, start the next."""
        done = self._apply_pieces() if self.pieces is not None else []
        k = self.run_len
        self.step += k
        self.kv = [kv + n * k for kv, n in zip(self.kv, self.n)]
        self.busy, self.ends, self.pieces = False, None, None
        heap, sim = self.heap, self.sim
        while heap and heap[0][0] <= self.step:
            _, req, r = heapq.heappop(heap)
            sim.finish_seq(self, req, r, t)
        for r, req in done:
            sim.prompt_done(self, req, r, t)
        self.compose(t)

    def _apply_pieces(self) -> list[tuple[int, int]]:
        s, dur = self.sim, self.duration
        prompt, pre_s, chunks = s.prompt, s.prefill_s, s.chunks
        done = []
        for r, entry, take in self.pieces:
            req = entry[0]
            entry[1] += take
            pre_s[req] += dur
            chunks[req] += 1
            if entry[1] >= prompt[req]:
                self.pre[r].remove(entry)
                self.npre -= 1
                done.append((r, req))
        return done

    def join(self, req: int, r: int) -> None:
        """``req`` starts decoding on rank ``r`` at the next step."""
        s = self.sim
        self.n[r] += 1
        self.kv[r] += s.prompt[req]
        heapq.heappush(self.heap, (self.step + s.output[req] - 1, req, r))

    def leave(self, req: int, r: int) -> None:
        s = self.sim
        self.n[r] -= 1
        self.kv[r] -= s.prompt[req] + s.output[req] - 1

    # ---- composing the next step ----------------------------------------------------------------
    def compose(self, t: float) -> None:
        if self.wranks:
            self._admit(t)
        if self.npre:
            self._prefill_step(t)
        elif self.heap:
            self._decode_run(t)

    def _admit(self, t: float) -> None:
        s, need_of, decode = self.sim, self.need, self.pool.phase == "decode"
        for r in sorted(self.wranks):
            q = self.waiting[r]
            while q:
                req = q[0]
                if not self._admissible(req, r):
                    break
                q.popleft()
                self.reserved[r] += need_of[req]
                if decode:
                    self.join(req, r)
                    continue
                if s.start[req] == _INF:
                    s.start[req] = t
                self.pre[r].append([req, 0])
                self.npre += 1
            if not q:
                self.wranks.discard(r)

    def _prefill_step(self, t: float) -> None:
        """One step with prompt chunks (beside the running sequences in a both-phase pool)."""
        pool, prompt = self.pool, self.sim.prompt
        both = pool.phase == PHASE_BOTH
        pieces, best, best_ctx = [], 0, 1.0
        for r, q in enumerate(self.pre):
            if not q:
                continue
            budget = pool.step_tokens - (self.n[r] if both else 0)
            used, span = 0, 0.0
            for entry in q:
                if budget <= 0:
                    break
                take = min(prompt[entry[0]] - entry[1], budget)
                pieces.append((r, entry, take))
                span += (2.0 * entry[1] + take) * take
                used += take
                budget -= take
            if used > best:
                best, best_ctx = used, span / used
        if best == 0:  # every rank's budget went to decode tokens
            self._decode_run(t)
            return
        table = pool.table
        dur = (
            table.mixed(best, best_ctx, max(self.n), max(self.kv)) if both else table.prefill(best, best_ctx)
        )
        self.pieces, self.duration, self.run_len, self.busy = pieces, dur, 1, True
        self.version += 1
        self.sim.push(t + dur, 0, self, self.version)

    def _decode_run(self, t: float) -> None:
        """Decode steps until the first finish (cut short by :meth:`poke`)."""
        if not self.heap:
            return
        steps = max(1, self.heap[0][0] - self.step)
        times = self.pool.table.decode_run(float(max(self.n)), float(max(self.kv)), steps)
        self.ends = t + np.cumsum(times)
        self.run_len, self.busy, self.pieces = steps, True, None
        self.version += 1
        self.sim.push(float(self.ends[-1]), 0, self, self.version)


def _admission_need(phase: str, prompt: list, total: list) -> list:
    """KV tokens a rank reserves at admission (a decode rank reserved them before the hand-off)."""
    if phase == "prefill":
        return prompt
    return total if phase == PHASE_BOTH else [0] * len(total)


class _Sim:
    """The event loop and the hand-off between pools (module docstring). Per-request values are lists."""

    def __init__(self, dep: DeploymentSim, req: Requests, rate: float, route: Route | None):
        n = req.n
        self.dep, self.route = dep, route
        self.fast_rr = route is None or getattr(route, "rule", None) is ROUND_ROBIN  # ranks in turn
        self.arrival = req.unit_arrival_s / rate
        self.prompt, self.output = req.prompt.tolist(), req.output.tolist()
        self.start, self.prefill_end, self.first, self.finish = ([_INF] * n for _ in range(4))
        self.prefill_s = [0.0] * n
        self.chunks = [0] * n
        total = [p + o for p, o in zip(self.prompt, self.output)]
        self.need = [_admission_need(p.phase, self.prompt, total) for p in dep.pools]
        self.engines = []
        self.views = []
        self.dwait: list = []
        if dep.handoff is not None:
            self.link_free = [0.0] * dep.pools[0].ranks
            self.dwait = [deque() for _ in range(dep.pools[1].ranks)]
            self.dneed = total
            self.prank = [0] * n
        for pi, p in enumerate(dep.pools):
            engines: list[_Engine] = []
            self.views.append(PoolView(p, engines, self.dwait if p.phase == "decode" else None))
            engines += [_Engine(self, p, pi, e) for e in range(p.engines)]
            self.engines.append(engines)
        self.heap: list = []
        self.seq = 0

    def push(self, t: float, kind: int, a, b) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, a, b))

    def _pick(self, pi: int, req: int, t: float) -> tuple[_Engine, int]:
        view, pool = self.views[pi], self.dep.pools[pi]
        if self.fast_rr:
            g = view.counter % view.num_ranks
            view.counter += 1
        else:
            view.now = t
            rq = RouteRequest(req, float(self.arrival[req]), self.prompt[req], self.output[req])
            g = self.route(rq, view)
            if isinstance(g, bool) or not isinstance(g, (int, np.integer)) or not 0 <= g < pool.ranks:
                raise ValueError(f"route returned {g!r} for a {pool.phase} pool of {pool.ranks} ranks")
            g = int(g)
        return self.engines[pi][g // pool.ranks_per_engine], g % pool.ranks_per_engine

    def arrive(self, req: int, t: float) -> None:
        pools = self.dep.pools
        if self.need[0][req] > pools[0].kv_tokens or (
            len(pools) > 1 and self.dneed[req] > pools[1].kv_tokens
        ):
            return  # never fits a rank: rejected (times stay inf)
        eng, r = self._pick(0, req, t)
        if self.dep.handoff is not None:
            self.prank[req] = eng.off + r
        eng.enqueue(req, r, t)

    def finish_seq(self, eng: _Engine, req: int, r: int, t: float) -> None:
        self.finish[req] = t
        eng.leave(req, r)
        if eng.pool.phase == "decode":
            eng.reserved[r] -= self.dneed[req]
            eng.held[r] -= 1
            self._decode_room(eng.off + r, t)
        else:
            eng.reserved[r] -= eng.need[req]

    def prompt_done(self, eng: _Engine, req: int, r: int, t: float) -> None:
        self.prefill_end[req] = t
        if eng.pool.phase == PHASE_BOTH:
            self.first[req] = t
            if self.output[req] > 1:
                eng.join(req, r)
            else:
                self.finish[req] = t
                eng.reserved[r] -= eng.need[req]
            return
        deng, dr = self._pick(1, req, t)
        if deng.held[dr] < deng.max_seqs and deng.reserved[dr] + self.dneed[req] <= deng.cap:
            deng.reserved[dr] += self.dneed[req]
            deng.held[dr] += 1
            self._send(req, deng.off + dr, t, streamed=True)
        else:
            self.dwait[deng.off + dr].append(req)

    def _send(self, req: int, g: int, t: float, streamed: bool) -> None:
        """Start the hand-off of ``req`` to decode rank ``g`` at ``t`` (its prefill rank's link queued)."""
        dep, spec = self.dep, self.dep.handoff
        pieces = 1
        if streamed and spec.streaming != "none":
            pieces = dep.layers if spec.streaming == "layer" else self.chunks[req]
        h = handoff_time(spec, dep.kv_bytes_per_token * self.prompt[req], self.prefill_s[req], max(1, pieces))
        p = self.prank[req]
        done = max(t + h.exposed_s, self.link_free[p] + h.transfer_s + spec.fixed_s)
        self.link_free[p] = done
        self.push(done, 1, req, g)

    def handed_off(self, req: int, g: int, t: float) -> None:
        self.first[req] = t
        p = self.prank[req]
        ppool, dpool = self.dep.pools
        peng = self.engines[0][p // ppool.ranks_per_engine]
        peng.reserved[p % ppool.ranks_per_engine] -= self.prompt[req]
        peng.poke(t)
        deng, dr = self.engines[1][g // dpool.ranks_per_engine], g % dpool.ranks_per_engine
        if self.output[req] > 1:
            deng.enqueue(req, dr, t)
        else:
            self.finish[req] = t
            deng.reserved[dr] -= self.dneed[req]
            deng.held[dr] -= 1
            self._decode_room(g, t)

    def _decode_room(self, g: int, t: float) -> None:
        """Decode rank ``g`` freed a sequence and its KV: start the hand-offs waiting for room there (sent
        whole)."""
        q = self.dwait[g]
        if not q:
            return
        dpool = self.dep.pools[1]
        eng, r = self.engines[1][g // dpool.ranks_per_engine], g % dpool.ranks_per_engine
        while q and eng.held[r] < eng.max_seqs and eng.reserved[r] + self.dneed[q[0]] <= eng.cap:
            req = q.popleft()
            eng.reserved[r] += self.dneed[req]
            eng.held[r] += 1
            self._send(req, g, t, streamed=False)

    def run(self, stop: Stop | None = None) -> bool:
        """The event loop; with ``stop``, it ends as soon as more measured requests than allowed have
        certainly missed the TTFT target (no first token ``ttft_s`` after they arrived). True when it
        stopped so (the requests left stay inf: missed)."""
        arrival, heap, first = self.arrival.tolist(), self.heap, self.first
        n, i = len(arrival), 0
        check = 0
        if stop is not None:
            late = (
                stop.first_measured
            )  # requests below ``late`` arrived over ttft_s ago: the first token is due
            misses = 0
        while True:
            ta = arrival[i] if i < n else _INF
            if heap and heap[0][0] <= ta:
                t, _, kind, a, b = heapq.heappop(heap)
                if kind == 0:
                    if b == a.version:
                        a.boundary(t)
                else:
                    self.handed_off(a, b, t)
            elif i < n:
                self.arrive(i, ta)
                i += 1
                check += 1
                if stop is not None and check >= _CHECK_EVERY:
                    check = 0
                    while late < i and arrival[late] + stop.ttft_s < ta:
                        misses += first[late] - arrival[late] > stop.ttft_s
                        late += 1
                    if misses > stop.allowed_misses:
                        return True
            else:
                return False


_CHECK_EVERY = 64  # arrivals between two checks of the early stop


class Stop(NamedTuple):
    """End a simulation early once more than ``allowed_misses`` requests from ``first_measured`` on
    have certainly missed ``ttft_s``."""

    ttft_s: float
    allowed_misses: int
    first_measured: int


def simulate(
    dep: DeploymentSim, requests: Requests, rate: float, route: Route | None = None, stop: Stop | None = None
) -> SimResult:
    """Simulate ``requests`` arriving at ``rate`` requests/s (their unit arrival times / ``rate``).

    Args:
        route: ``route(request: RouteRequest, view: PoolView) -> rank`` choosing the rank (global over
            the pool's instances) of each request in each pool (a rule of the one registry:
            :func:`moe_placement.apps.deploy.routes.rule_route`); None: round-robin, each rank in turn. It is
            called with the both-phase or prefill pool's view at arrival and with the decode pool's
            view when the request's prefill ends (``view.phase`` says which); a fresh view per call of
            :func:`simulate`, so a route that keeps state in ``view.counter`` or ``view.state`` starts
            afresh.
        stop: end early once the TTFT target is certainly missed by too many (:class:`Stop`); the
            requests not simulated then have inf times.
    """
    if not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0):
        raise ValueError(f"rate must be a positive number of requests/s, got {rate!r}")
    sim = _Sim(dep, requests, float(rate), route)
    stopped = sim.run(stop)
    times = (np.asarray(x, dtype=np.float64) for x in (sim.start, sim.prefill_end, sim.first, sim.finish))
    return SimResult(float(rate), sim.arrival, *times, requests.prompt, requests.output, stopped)


@dataclass(frozen=True)
class ZeroLoad:
    """One request alone on the deployment: prefill, hand-off (exposed; its bytes) and the mean decode
    step, seconds."""

    prefill_s: float
    handoff_s: float
    handoff_bytes: float
    decode_step_s: float


def zero_load(dep: DeploymentSim, prompt: int, output: int) -> ZeroLoad:
    """What one request of ``prompt`` and ``output`` tokens takes alone: the simulator's own steps
    (chunks of ``step_tokens``, the hand-off streamed behind them, ``output - 1`` decode steps)."""
    first = dep.pools[0]
    pre, done, chunks = 0.0, 0, 0
    while done < prompt:
        take = min(prompt - done, first.step_tokens)
        ctx = 2.0 * done + take
        pre += (
            first.table.mixed(take, ctx, 0.0, 0.0)
            if first.phase == PHASE_BOTH
            else first.table.prefill(take, ctx)
        )
        done += take
        chunks += 1
    hand, nbytes = 0.0, 0.0
    if dep.handoff is not None:
        nbytes = dep.kv_bytes_per_token * prompt
        spec = dep.handoff
        pieces = dep.layers if spec.streaming == "layer" else (chunks if spec.streaming == "chunk" else 1)
        hand = handoff_time(spec, nbytes, pre, pieces).exposed_s
    last = dep.pools[-1]
    dec = float(last.table.decode_run(1.0, float(prompt), output - 1).mean()) if output > 1 else 0.0
    return ZeroLoad(pre, hand, nbytes, dec)
