"""Step shapes: which tokens of a trace form one forward step on each attention-DP (= EP) rank.

Every per-step figure (``step_par``, the per-step dispatch models' splits, the step fit) is measured
on steps built here, for one phase (docs/metrics.md, ``step_par``):

- ``decode``: continuous batching. Each of the ``G`` ranks holds ``b = step_tokens`` sequences in
  flight; each step takes the next token of each; a finished sequence is replaced by the rank's next
  waiting one. Sequences are dealt to ranks round robin (by the trace's ``source_rank`` when it has
  one). Measured in steady state: each slot starts in a length-weighted draw of its rank's sequences
  (a slot is more often in a long sequence) at a uniformly drawn position, so the slots do not step
  through the chat template together (a cold start, every slot at position 0, gives even-split step
  PAR 2.31 instead of 1.12 on DeepSeek-V2-Lite chat); finished slots take the rank's sequences in
  trace order, the queue wrapping around. There are ``T // (G * b)`` steps (as many stepped tokens as
  the trace holds); the notes say how many tokens were stepped twice or not at all. A trace with
  fewer sequences than ``G * b`` slots cycles through them; a trace with no sequence boundaries is
  taken as ``G * b`` contiguous pieces, one per slot, walked from their first token.
- ``prefill``: chunked prefill. Each rank takes chunks of ``b`` consecutive tokens of its queued
  prompts: without ``source_rank``, chunk ``c`` of the trace goes to step ``c // G``, rank ``c % G``;
  with it, each rank's own tokens in trace order are chunked. A trailing partial step is dropped.
- ``engine``: a trace that records the engine's own forward batches (``step_offsets``; the readers
  drop start-up rows) is stepped by them, whatever phase is asked: each batch is one rank's batch,
  dealt ``G`` to a step (with ``source_rank``: each batch is one step, its tokens on their ranks).
  ``step_tokens`` is then a cap: a larger batch is split into chunks of at most that many tokens.

Shapes: T tokens, L layers, E logical experts, G ranks, b tokens per rank per step, N stepped tokens,
S steps.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from moe_placement.base.limits import check_whole
from profiling.trace import RoutingTrace

__all__ = [
    "DEFAULT_STEP_TOKENS",
    "MAX_STEP_CELLS",
    "PHASES",
    "SIZING_STEP_TOKENS",
    "Steps",
    "check_steps_of",
    "make_steps",
    "priced_phase",
    "step_counts",
]

PHASES = ("decode", "prefill")  # the one definition: every other module imports it
DEFAULT_STEP_TOKENS = {"decode": 64, "prefill": 256}  # the ONE place per-phase defaults live
# The load a deployment is SIZED at, not a step shape step PAR is measured on: tokens per GPU per
# step of a full serving batch, per phase (decode: DeepEP's low-latency benchmark size, 128 tokens per
# GPU; prefill: 8192-token chunks, DeepEP's normal-kernel size). The layout planner's throughput and
# memory check and the exact solver's decode cost default to it.
SIZING_STEP_TOKENS = {"decode": 128, "prefill": 8192}
ENGINE = "engine"
MAX_STEP_CELLS = 1 << 28  # largest [S, L, G, E] count array step_counts allocates (2 GiB of int64)


def priced_phase(phase: str) -> str:
    """The phase whose kernels price a step of ``phase``: recorded engine batches are priced as decode
    (the one place this is decided)."""
    if phase not in PHASES + (ENGINE,):
        raise ValueError(f"unknown phase {phase!r}; use one of {', '.join(PHASES + (ENGINE,))}")
    return "decode" if phase == ENGINE else phase


@dataclass(frozen=True, eq=False)
class Steps:
    """The stepped tokens of a trace (arrays int64 ``[N]``, read-only).

    Attributes:
        phase: ``"decode"``, ``"prefill"`` or ``"engine"`` (stepped by the trace's recorded batches).
        step_tokens: tokens per rank per step (the cap for ``"engine"``).
        ep_size: attention-DP ranks = EP ranks.
        token: trace token index of each stepped token (a token may be stepped twice in decode).
        step: its step, ``0 .. num_steps - 1``.
        rank: the attention-DP rank holding it.
        row: its row in that rank's batch this step (what ``vllm-hash`` hashes).
        num_steps: ``S``.
        notes: every assumption made.
        trace_shape: ``(T, L, k)`` of the trace the steps were made from (:func:`check_steps_of`
            refuses steps of another trace before ``token`` indexes it).
    """

    phase: str
    step_tokens: int
    ep_size: int
    token: np.ndarray
    step: np.ndarray
    rank: np.ndarray
    row: np.ndarray
    num_steps: int
    notes: tuple[str, ...] = ()
    trace_shape: tuple[int, ...] = ()

    def describe(self) -> str:
        """One line naming the phase, tokens per rank, steps and notes."""
        what = "at most" if self.phase == ENGINE else ""
        line = f"{self.phase} steps, {what + ' ' if what else ''}{self.step_tokens} tokens per rank"
        line += f" on {self.ep_size} ranks, {self.num_steps} steps"
        return line + ("; " + "; ".join(self.notes) if self.notes else "")


def _check_step_tokens(step_tokens, phase: str) -> int:
    if step_tokens is None:
        return DEFAULT_STEP_TOKENS[phase]
    if isinstance(step_tokens, bool) or not isinstance(step_tokens, (int, np.integer)) or step_tokens < 1:
        raise ValueError(
            f"step_tokens must be a positive integer (tokens per rank per step), got {step_tokens!r}"
        )
    return int(step_tokens)


def make_steps(
    trace: RoutingTrace,
    ep_size: int,
    phase: str,
    step_tokens: int | None = None,
    *,
    seed: int = 0,
    max_steps: int | None = None,
) -> Steps:
    """The steps of ``trace`` on ``ep_size`` ranks in ``phase`` (module docstring).

    Args:
        phase: ``"decode"`` or ``"prefill"`` (a trace with ``step_offsets`` is stepped by them:
            ``"engine"``, which may also be asked for by name).
        step_tokens: tokens per rank per step; None: :data:`DEFAULT_STEP_TOKENS` of the phase (for
            ``"engine"``, no cap).
        seed: seeds decode's steady-state start. max_steps: keep at most this many steps (the first).

    Raises:
        ValueError: an unknown phase, a bad ``step_tokens``, a counts-only trace, or a step larger
            than the trace (naming both numbers).
    """
    if phase not in PHASES + (ENGINE,):
        raise ValueError(f"unknown phase {phase!r}; use one of {', '.join(PHASES)}")
    if not isinstance(trace, RoutingTrace):
        raise ValueError(
            f"trace must be a profiling.trace.RoutingTrace (read_trace), got {type(trace).__name__}"
        )
    if not trace.has_tokens:
        raise ValueError("steps need a per-token trace (topk_ids); this trace has window counts only")
    if isinstance(ep_size, bool) or not isinstance(ep_size, (int, np.integer)) or ep_size < 1:
        raise ValueError(f"ep_size must be a positive integer, got {ep_size!r}")
    if max_steps is not None:
        check_whole("max_steps", max_steps, 1, fix="or None for every step")
    check_whole("seed", seed, 0, fix="e.g. 0")
    G = int(ep_size)
    if trace.step_offsets is not None:
        cap = None if step_tokens is None else _check_step_tokens(step_tokens, PHASES[0])
        out = _engine_steps(trace, G, cap, asked=phase)
    elif phase == ENGINE:
        raise ValueError(
            "phase 'engine' needs a trace that records the engine's batches (step_offsets); this trace "
            f"has none: use one of {', '.join(PHASES)}"
        )
    else:
        b = _check_step_tokens(step_tokens, phase)
        _check_fits(trace.num_tokens, G, b, phase)
        out = (
            _decode_steps(trace, G, b, seed, max_steps) if phase == "decode" else _prefill_steps(trace, G, b)
        )
    return replace(_truncate(out, max_steps), trace_shape=tuple(int(n) for n in trace.topk_ids.shape))


def check_steps_of(steps: Steps, trace: RoutingTrace, what: str = "steps") -> None:
    """A ValueError unless ``steps`` are a :class:`Steps` made from ``trace`` (its token count, layers
    and top-k; every stepped token inside it): steps of another trace would index tokens it does not
    have, or silently price other tokens."""
    if not isinstance(steps, Steps):
        raise ValueError(f"{what} must be a placement.steps.Steps (make_steps), got {type(steps).__name__}")
    shape = tuple(int(n) for n in trace.topk_ids.shape) if trace.topk_ids is not None else ()
    inside = not steps.token.size or 0 <= int(steps.token.min()) <= int(steps.token.max()) < trace.num_tokens
    if steps.trace_shape != shape or not inside:
        made = "x".join(map(str, steps.trace_shape)) or "an unknown shape"
        raise ValueError(
            f"the {what} were made from a trace of {made} (tokens x layers x top-k), this trace is "
            f"{'x'.join(map(str, shape)) or 'counts only'}; build them from this trace: make_steps(trace, "
            f"{steps.ep_size}, {steps.phase!r}, {steps.step_tokens})"
        )


def _check_fits(T: int, G: int, b: int, phase: str) -> None:
    if b * G > T:
        raise ValueError(
            f"one {phase} step of {b} tokens per rank on {G} ranks takes {b * G} tokens but the trace has "
            f"only {T}; lower --step-tokens to at most {max(T // G, 1)} or give a longer trace"
        )


def _frozen(phase, b, G, token_step_rank_row, S, notes) -> Steps:
    """A :class:`Steps` of read-only int64 copies of ``(token, step, rank, row)``, each ``[N]``."""
    arrays = [np.ascontiguousarray(a, dtype=np.int64) for a in token_step_rank_row]
    for a in arrays:
        a.setflags(write=False)
    return Steps(phase, int(b), int(G), *arrays, num_steps=int(S), notes=tuple(notes))


def _truncate(steps: Steps, max_steps: int | None) -> Steps:
    if max_steps is None or steps.num_steps <= max_steps:
        return steps
    keep = steps.step < max_steps
    notes = steps.notes + (f"first {max_steps} of {steps.num_steps} steps kept (max_steps)",)
    return _frozen(
        steps.phase,
        steps.step_tokens,
        steps.ep_size,
        (steps.token[keep], steps.step[keep], steps.rank[keep], steps.row[keep]),
        max_steps,
        notes,
    )


# ---------------------------------------------------------------------------------------------
# prefill
# ---------------------------------------------------------------------------------------------
def _prefill_steps(trace: RoutingTrace, G: int, b: int) -> Steps:
    """Chunks of ``b`` consecutive tokens: dealt round robin (no source ranks) or per recorded rank."""
    T = trace.num_tokens
    if trace.source_rank is None:
        S = T // (b * G)
        tok = np.arange(S * b * G)  # [N]
        chunk = tok // b
        notes = ["chunks of consecutive tokens dealt round robin to ranks"]
        return _frozen("prefill", b, G, (tok, chunk // G, chunk % G, tok % b), S, notes)
    src = trace.source_rank.astype(np.int64) % G  # [T]
    order = np.argsort(src, kind="stable")  # tokens by rank, trace order inside
    per_rank = np.bincount(src, minlength=G)  # [G]
    pos = np.arange(T) - np.repeat(np.cumsum(per_rank) - per_rank, per_rank)  # position in its rank
    S = int(per_rank.max()) // b
    keep = pos < S * b
    tok, rk, p = order[keep], src[order][keep], pos[keep]
    notes = ["each rank's recorded tokens chunked in trace order"]
    if S == 0:
        raise ValueError(
            f"one prefill step of {b} tokens per rank needs {b} tokens on a rank but the busiest rank has "
            f"{int(per_rank.max())}; lower --step-tokens to at most {int(per_rank.max())}"
        )
    if per_rank.min() < S * b:
        notes.append(f"ranks with fewer than {S * b} tokens run short or empty batches in the last steps")
    return _frozen("prefill", b, G, (tok, p // b, rk, p % b), S, notes)


# ---------------------------------------------------------------------------------------------
# decode
# ---------------------------------------------------------------------------------------------
def _sequences(trace: RoutingTrace, G: int, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str]]:
    """Sequences to decode: start and length int64 ``[Q]``, their rank ``[Q]``, and notes.

    Without boundaries: ``G * b`` contiguous pieces, piece ``i`` on rank ``i % G``. With fewer
    sequences than ``G * b`` (round robin only): the deal is cycled until every slot has one.
    """
    T = trace.num_tokens
    if trace.seq_offsets is None:
        edges = np.linspace(0, T, G * b + 1).round().astype(np.int64)
        starts, lengths = edges[:-1], np.diff(edges)
        note = (
            f"the trace has no sequence boundaries: assumed each of the {G} x {b} slots decodes one "
            f"contiguous piece of about {T // (G * b)} tokens"
        )
        return starts, lengths, np.arange(G * b) % G, [note]
    off = trace.seq_offsets
    starts, lengths = off[:-1].astype(np.int64), np.diff(off).astype(np.int64)
    starts, lengths = starts[lengths > 0], lengths[lengths > 0]
    Q = starts.size
    notes = [f"{Q} sequences of the trace's prompt tokens decoded as if generated (steady state)"]
    if trace.source_rank is not None:
        rank = trace.source_rank[starts].astype(np.int64) % G
        notes.append("sequences on their recorded ranks")
    else:
        rank = np.arange(Q, dtype=np.int64) % G
        notes.append("sequences dealt round robin to ranks")
    if Q < G * b:
        notes.append(f"{Q} sequences for {G} x {b} = {G * b} slots: cycled through them")
    return starts, lengths, rank, notes


def _queues(rank: np.ndarray, lengths: np.ndarray, G: int, b: int, rng, weighted: bool):
    """Each rank's queue and its slots' first sequences.

    Returns ``order`` int64 ``[Q]`` (sequences grouped by rank, trace order inside), ``qstart``,
    ``qlen`` ``[G]``, ``first`` int64 ``[G*b]`` (each slot's first position in its rank's queue) and
    ``nxt`` int64 ``[G]`` (the next position the wrapping queue hands out). When ``weighted`` each
    slot's first sequence is a length-weighted draw (with replacement: a rank rarely holds enough
    long sequences for the steady-state mix without repeats) and the queue then hands out every
    sequence in trace order from the start: the slots hold the steady-state mix (length-biased) and
    the replacements the unbiased one, so each step sees the same mix (a renewal process started in
    its stationary state). Otherwise slot ``j`` starts with the ``j``-th sequence.
    """
    order = np.argsort(rank, kind="stable")  # [Q] sequences grouped by rank
    qlen = np.bincount(rank, minlength=G)  # [G]
    qstart = np.cumsum(qlen) - qlen
    first = np.tile(np.arange(b), G)  # [G*b]
    if not weighted:
        return order, qstart, qlen, first, np.full(G, b, dtype=np.int64)
    for g in np.flatnonzero(qlen):
        w = lengths[order[qstart[g] : qstart[g] + qlen[g]]].astype(np.float64)
        first[g * b : (g + 1) * b] = rng.choice(w.size, size=b, p=w / w.sum())
    return order, qstart, qlen, first, np.zeros(G, dtype=np.int64)


def _decode_steps(trace: RoutingTrace, G: int, b: int, seed: int, max_steps: int | None = None) -> Steps:
    """Continuous batching over the trace's sequences in steady state (module docstring); the
    simulation stops after ``max_steps`` steps."""
    T = trace.num_tokens
    starts, lengths, rank, notes = _sequences(trace, G, b)
    rng = np.random.default_rng(seed)
    bounded = trace.seq_offsets is not None
    order, qstart, qlen, qpos, nxt = _queues(rank, lengths, G, b, rng, weighted=bounded)
    live = qlen > 0  # [G] ranks with sequences
    slot_rank = np.repeat(np.arange(G), b)  # [G*b]
    ql = np.maximum(qlen, 1)[slot_rank]

    active = live[slot_rank]  # [G*b] slots of ranks that hold sequences

    def seq_of(qp):  # [G*b] sequence of each slot (an empty rank's slots point at sequence 0, unused)
        return order[np.where(active, qstart[slot_rank] + qp % ql, 0)]

    seq = seq_of(qpos)
    pos = (rng.random(G * b) * lengths[seq]).astype(np.int64) if bounded else np.zeros(G * b, np.int64)
    S = T // (G * b)
    if max_steps is not None and S > max_steps:
        notes.append(f"first {max_steps} of {S} steps kept (max_steps)")
        S = int(max_steps)
    out_tok, out_step = [], []
    for s in range(S):
        out_tok.append(starts[seq] + pos)
        out_step.append(s)
        pos = pos + 1
        done = (pos >= lengths[seq]) & active  # [G*b] finished: take the rank's next waiting one
        fin = done.reshape(G, b)
        hand = (np.cumsum(fin, axis=1) - 1 + nxt[:, None]).ravel()  # [G*b] queue position handed out
        qpos = np.where(done, hand, qpos)
        nxt = nxt + fin.sum(axis=1)
        seq = seq_of(qpos)
        pos = np.where(done, 0, pos)
    tok = np.stack(out_tok) if S else np.zeros((0, G * b), np.int64)  # [S, G*b]
    keep = np.broadcast_to(active, tok.shape)
    step = np.broadcast_to(np.arange(S)[:, None], tok.shape)
    rk = np.broadcast_to(slot_rank, tok.shape)
    row = np.broadcast_to(np.tile(np.arange(b), G), tok.shape)
    notes += _coverage_notes(tok[keep], T, live, whole=S == T // (G * b))
    return _frozen("decode", b, G, (tok[keep], step[keep], rk[keep], row[keep]), S, notes)


def _coverage_notes(tok: np.ndarray, T: int, live: np.ndarray, whole: bool) -> list[str]:
    """Ranks that hold no sequence, and (``whole``: every step was run) what share of the trace the
    steps cover."""
    seen = np.bincount(tok, minlength=T)
    notes = []
    if (~live).any():
        notes.append(f"{int((~live).sum())} rank(s) hold no sequence and run empty batches")
    if not whole:
        return notes
    twice, never = int((seen > 1).sum()), int((seen == 0).sum())
    if twice or never:
        notes.append(
            f"queues wrap around: {100 * twice / T:.1f}% of tokens stepped more than once, "
            f"{100 * never / T:.1f}% not stepped"
        )
    return notes


# ---------------------------------------------------------------------------------------------
# engine batches
# ---------------------------------------------------------------------------------------------
def _engine_steps(trace: RoutingTrace, G: int, cap: int | None, asked: str) -> Steps:
    """Stepped by the recorded batches (``step_offsets``), each split into chunks of at most ``cap``."""
    T = trace.num_tokens
    off = trace.step_offsets
    assert off is not None
    batch = np.repeat(np.arange(off.size - 1), np.diff(off))  # [T] recorded batch of each token
    has_rank = trace.source_rank is not None
    rank = trace.source_rank.astype(np.int64) % G if has_rank else np.zeros(T, np.int64)
    key = batch * G + rank  # one (batch, rank) group per rank's batch
    order = np.argsort(key, kind="stable")
    ks = key[order]
    pos = np.empty(T, np.int64)
    pos[order] = np.arange(T) - np.searchsorted(ks, ks, side="left")  # row within its (batch, rank)
    biggest = int(pos.max()) + 1 if T else 1
    b = biggest if cap is None else min(cap, biggest)
    chunk = pos // b  # [T] chunk of its (batch, rank) batch
    per_batch = np.zeros(off.size - 1, np.int64)
    np.maximum.at(per_batch, batch, chunk + 1)  # chunks of each recorded batch
    first = np.cumsum(per_batch) - per_batch  # [B] its first sub-batch
    sub = first[batch] + chunk  # [T] sub-batch index
    notes = [f"stepped by the trace's {off.size - 1} recorded engine batches (asked: {asked})"]
    if cap is not None and biggest > cap:
        notes.append(f"batches over {cap} tokens per rank split into chunks of {cap}")
    if has_rank:
        step, row = sub, pos % b
        notes.append("tokens on their recorded ranks")
    else:
        step, rank, row = sub // G, sub % G, pos % b
        notes.append(f"each recorded batch is one rank's batch, {G} batches per step")
    S = int(step.max()) + 1 if T else 0
    return _frozen(ENGINE, b, G, (np.arange(T), step, rank, row), S, notes)


# ---------------------------------------------------------------------------------------------
# counts
# ---------------------------------------------------------------------------------------------
def step_counts(trace: RoutingTrace, steps: Steps) -> np.ndarray:
    """Tokens per (step, layer, rank, expert): int64 ``[S, L, G, E]`` (-1 ids count nowhere).

    Raises ValueError when the array would exceed :data:`MAX_STEP_CELLS` cells (use ``max_steps``).
    """
    if not isinstance(trace, RoutingTrace) or not isinstance(steps, Steps):
        got = type(trace if not isinstance(trace, RoutingTrace) else steps).__name__
        raise ValueError(
            f"step_counts needs a RoutingTrace and the Steps make_steps built from it, got {got}"
        )
    if not trace.has_tokens:
        raise ValueError("step counts need a per-token trace (topk_ids)")
    check_steps_of(steps, trace)
    S, G, E, L = steps.num_steps, steps.ep_size, trace.num_logical_experts, trace.num_layers
    cells = S * L * G * E
    if cells > MAX_STEP_CELLS:
        raise ValueError(
            f"step counts of {S} steps x {L} layers x {G} ranks x {E} experts = {cells} cells exceed the "
            f"{MAX_STEP_CELLS} allowed; pass max_steps={max(1, MAX_STEP_CELLS // (L * G * E))} or fewer"
        )
    ids = trace.topk_ids
    assert ids is not None
    out = np.zeros((S, L, G * E), dtype=np.int64)
    where = (steps.step * G + steps.rank)[:, None] * E  # [N, 1] cell of (step, rank, expert 0)
    for l in range(L):
        sel = ids[steps.token, l, :].astype(np.int64)  # [N, k]
        ok = sel >= 0
        out[:, l] = np.bincount((where + sel)[ok], minlength=S * G * E).reshape(S, G * E)
    return out.reshape(S, L, G, E)
