"""Multi-turn sessions: the workload format with conversation ids and turns, a generator, and the
request stream a routing run decodes (:class:`placement.routing.simulate.RequestStream`).

The format (a JSON object; docs/formats.md)::

    {"schema": "moe-placement/sessions", "version": 1,
     "system_prompts": {"sys0": 400},                # optional: shared prompt prefixes, in tokens
     "conversations": [
       {"id": "c0", "start_step": 0, "system": "sys0",   # system optional
        "turns": [{"input_tokens": 95, "output_tokens": 350},
                  {"input_tokens": 60, "output_tokens": 200, "think_steps": 120}]}]}

Times are decode steps: a conversation's first turn arrives at ``start_step``; each later turn
``think_steps`` (default 0) after the previous turn's answer is out. Turn ``t``'s prompt is the
system prompt, every earlier turn's input and answer, then its own input: a chain of segments that a
rank's prefix cache can hold (:mod:`placement.routing.prefix`).

The generator (:func:`generate_sessions`) draws conversations shaped like two public chat datasets,
from the statistics Table 1 of Zheng et al., "LMSYS-Chat-1M: A Large-Scale Real-World LLM Conversation
Dataset" (ICLR 2024, arXiv:2309.11998) reports for them (:data:`PROFILES`): mean turns per conversation,
mean tokens per user prompt and per response. Turns are geometric with that mean; token counts
lognormal with those means (the sigmas are ours); conversations start as a Poisson process; think
times are exponential (mean ours).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from moe_placement.base.errors import InputFileError
from moe_placement.base.fileio import load_json
from moe_placement.base.limits import check_whole
from moe_placement.base.options import refuse_unknown_keywords
from placement.routing.requests import Request, signature_of
from placement.routing.simulate import RequestStream
from profiling.trace import RoutingTrace

__all__ = [
    "PROFILES",
    "SESSIONS_SCHEMA",
    "SessionSpec",
    "generate_sessions",
    "read_sessions",
    "stream_from_sessions",
    "validate_sessions",
]

SESSIONS_SCHEMA = "moe-placement/sessions"
MAX_TURNS = 1 << 22  # turns one workload may hold
MAX_TOKENS = 1 << 24  # tokens of one turn's input or answer

# name -> (mean turns per conversation, mean tokens per user prompt, mean tokens per response):
# Table 1 of Zheng et al. 2023 (arXiv:2309.11998), the LMSYS-Chat-1M paper.
PROFILES = {
    "sharegpt": (3.51, 94.46, 348.45),
    "lmsys": (2.0, 69.5, 214.5),
}


@refuse_unknown_keywords
@dataclass(frozen=True)
class SessionSpec:
    """The generator's knobs (each a ValueError when out of range).

    Attributes:
        profile: a name in :data:`PROFILES`.
        conversations: how many.
        concurrency: conversations started per step are sized so that about this many turns are in
            flight at once (Little's law on the mean answer length and think time).
        think_steps: mean steps between an answer and the next turn (exponential).
        system_prompts: shared system prompts (0: none); each conversation takes one at random.
        system_tokens: tokens of each system prompt.
        sigma: lognormal sigma of the prompt and answer lengths.
        seed: makes the workload reproducible.
    """

    profile: str = "sharegpt"
    conversations: int = 500
    concurrency: int = 256
    think_steps: float = 200.0
    system_prompts: int = 0
    system_tokens: int = 400
    sigma: float = 0.8
    seed: int = 0

    def __post_init__(self) -> None:
        if self.profile not in PROFILES:
            raise ValueError(f"unknown session profile {self.profile!r}; choose from {', '.join(PROFILES)}")
        check_whole("conversations", self.conversations, 1, MAX_TURNS)
        check_whole("concurrency", self.concurrency, 1, 1 << 24)
        check_whole("system_prompts", self.system_prompts, 0, 1 << 16)
        check_whole("system_tokens", self.system_tokens, 1, MAX_TOKENS)
        check_whole("seed", self.seed, 0, 2**32 - 1)
        for name, hi in (("think_steps", 1e7), ("sigma", 5.0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.number)) or not (0 <= v <= hi):
                raise ValueError(f"{name} must be a number in [0, {hi:g}], got {v!r}")


def _lognormal(rng, mean: float, sigma: float, size: int) -> np.ndarray:
    mu = math.log(mean) - sigma**2 / 2
    return np.clip(np.round(rng.lognormal(mu, sigma, size=size)), 1, MAX_TOKENS).astype(np.int64)


def generate_sessions(spec: SessionSpec | None = None) -> dict:
    """A workload document (the module's format) drawn from ``spec`` (default ``SessionSpec()``)."""
    s = spec if spec is not None else SessionSpec()
    rng = np.random.default_rng(s.seed)
    turns_mean, prompt_mean, answer_mean = PROFILES[s.profile]
    C = int(s.conversations)
    turns = rng.geometric(1.0 / turns_mean, size=C)
    if int(turns.sum()) > MAX_TURNS:
        raise ValueError(
            f"{int(turns.sum())} turns drawn, over the {MAX_TURNS} a workload may hold; fewer conversations"
        )
    # turns in flight = conversations started per step x turns each x steps each turn decodes (Little)
    gaps = rng.exponential(turns_mean * answer_mean / s.concurrency, size=C)
    start = np.floor(np.cumsum(gaps) - gaps[0]).astype(np.int64)
    systems = {f"sys{i}": int(s.system_tokens) for i in range(int(s.system_prompts))}
    convs = []
    for c in range(C):
        n = int(turns[c])
        inp, out = _lognormal(rng, prompt_mean, s.sigma, n), _lognormal(rng, answer_mean, s.sigma, n)
        think = (
            np.round(rng.exponential(s.think_steps, size=n)).astype(np.int64)
            if s.think_steps
            else np.zeros(n, int)
        )
        conv = {"id": f"c{c}", "start_step": int(start[c]), "turns": []}
        if systems:
            conv["system"] = f"sys{int(rng.integers(0, len(systems)))}"
        for t in range(n):
            turn = {"input_tokens": int(inp[t]), "output_tokens": int(out[t])}
            if t:
                turn["think_steps"] = int(think[t])
            conv["turns"].append(turn)
        convs.append(conv)
    return {
        "schema": SESSIONS_SCHEMA,
        "version": 1,
        "generator": {
            "profile": s.profile,
            "source": "Zheng et al. 2023, arXiv:2309.11998, Table 1",
            "conversations": C,
            "concurrency": int(s.concurrency),
            "think_steps": float(s.think_steps),
            "system_prompts": int(s.system_prompts),
            "sigma": float(s.sigma),
            "seed": int(s.seed),
        },
        "system_prompts": systems,
        "conversations": convs,
    }


# ---------------------------------------------------------------------------------------------
# reading and checking
# ---------------------------------------------------------------------------------------------
def _whole(doc_where: str, value, lo: int, hi: int) -> int:
    ok = isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi
    if not ok:
        raise InputFileError(f"{doc_where} must be a whole number in {lo}..{hi}, got {value!r}")
    return int(value)


def _check_turns(where: str, turns, budget: list[int]) -> None:
    if not isinstance(turns, list) or not turns:
        raise InputFileError(f"{where}.turns must be a non-empty list of turns")
    budget[0] += len(turns)
    if budget[0] > MAX_TURNS:
        raise InputFileError(f"the workload holds more than {MAX_TURNS} turns; split it")
    for t, turn in enumerate(turns):
        w = f"{where}.turns[{t}]"
        if not isinstance(turn, Mapping):
            raise InputFileError(f"{w} must be an object with input_tokens and output_tokens")
        extra = sorted(set(turn) - {"input_tokens", "output_tokens", "think_steps"})
        if extra:
            raise InputFileError(
                f"{w} has unknown key(s) {extra}; keys are input_tokens, output_tokens, think_steps"
            )
        _whole(f"{w}.input_tokens", turn.get("input_tokens"), 0, MAX_TOKENS)
        _whole(f"{w}.output_tokens", turn.get("output_tokens"), 0, MAX_TOKENS)
        _whole(f"{w}.think_steps", turn.get("think_steps", 0), 0, 1 << 40)


def validate_sessions(doc, where: str = "workload") -> dict:
    """``doc`` when it is a valid workload (the module's format), else an InputFileError (a ValueError)
    naming the field and the expected form."""
    if not isinstance(doc, Mapping) or doc.get("schema") != SESSIONS_SCHEMA:
        raise InputFileError(f'{where}: not a sessions workload (needs "schema": "{SESSIONS_SCHEMA}")')
    if doc.get("version") != 1:
        raise InputFileError(f"{where}: version {doc.get('version')!r} is not supported (1 is)")
    systems = doc.get("system_prompts", {})
    if not isinstance(systems, Mapping):
        raise InputFileError(f"{where}.system_prompts must be an object: name -> tokens")
    for name, tokens in systems.items():
        _whole(f"{where}.system_prompts[{name!r}]", tokens, 1, MAX_TOKENS)
    convs = doc.get("conversations")
    if not isinstance(convs, list) or not convs:
        raise InputFileError(f"{where}.conversations must be a non-empty list")
    seen, budget = set(), [0]
    for c, conv in enumerate(convs):
        w = f"{where}.conversations[{c}]"
        if not isinstance(conv, Mapping) or not isinstance(conv.get("id"), str) or not conv.get("id"):
            raise InputFileError(f"{w} must be an object with a non-empty string id")
        if conv["id"] in seen:
            raise InputFileError(f"{w}: conversation id {conv['id']!r} appears twice")
        seen.add(conv["id"])
        _whole(f"{w}.start_step", conv.get("start_step"), 0, 1 << 40)
        if "system" in conv and conv["system"] not in systems:
            raise InputFileError(
                f"{w}.system {conv['system']!r} is not in system_prompts ({sorted(systems)[:4]})"
            )
        _check_turns(w, conv.get("turns"), budget)
    return dict(doc)


def read_sessions(path: str) -> dict:
    """A workload file, checked (:func:`validate_sessions`); JSON read with the size and depth limits."""
    return validate_sessions(load_json(path, max_bytes=1 << 30), str(path))


# ---------------------------------------------------------------------------------------------
# the request stream
# ---------------------------------------------------------------------------------------------
def stream_from_sessions(
    doc: Mapping, trace: RoutingTrace, sequences: Sequence[int], signature_tokens: int
) -> RequestStream:
    """Every turn of the workload ``doc`` as a request whose routing comes from ``trace``.

    Conversation ``c`` (in file order) takes the trace sequence ``sequences[c mod len]``: its signature
    is that sequence's first ``signature_tokens`` tokens (the conversation's topic, every turn), and its
    turns' answers walk that sequence's tokens from where the previous answer stopped (cyclically).
    """
    validate_sessions(doc)
    if trace.seq_offsets is None or not trace.has_tokens:
        raise ValueError("session routing needs a per-token trace with request boundaries (seq_offsets)")
    check_whole("signature_tokens", signature_tokens, 1, 1 << 20)
    seqs = np.asarray(sequences, dtype=np.int64)
    if not seqs.size:
        raise ValueError("no trace sequence to take the conversations' routing from")
    off, systems = trace.seq_offsets, doc.get("system_prompts", {})
    cols: dict[str, list] = {k: [] for k in ("req", "arr", "fol", "thk", "start", "len", "off", "dec", "out")}
    for c, conv in enumerate(doc["conversations"]):
        q = int(seqs[c % seqs.size])
        a, b = int(off[q]), int(off[q + 1])
        assert trace.topk_ids is not None
        sig = signature_of(trace.topk_ids[a : min(b, a + signature_tokens)], trace.num_logical_experts)
        _conversation(conv, systems, sig, (a, b), cols)
    Q = len(cols["req"])
    arr = lambda k: np.asarray(cols[k], dtype=np.int64)  # noqa: E731
    return RequestStream(
        requests=tuple(cols["req"]),
        arrival=arr("arr"),
        follows=arr("fol"),
        think=arr("thk"),
        seq_start=arr("start"),
        seq_len=arr("len"),
        offset=arr("off"),
        decode=arr("dec"),
        output=tuple(cols["out"]),
        notes=(
            f"{len(doc['conversations'])} conversations, {Q} turns from the sessions workload; each conversation's "
            f"routing is one trace sequence (its signature from the first {signature_tokens} tokens)",
        ),
    )


def _conversation(
    conv: Mapping, systems: Mapping, sig: np.ndarray, span: tuple[int, int], cols: dict
) -> None:
    """Append one conversation's turns to the stream's columns ``cols``."""
    cid, (a, b) = conv["id"], span
    chain: list = [(("system", conv["system"]), int(systems[conv["system"]]))] if "system" in conv else []
    walked = 0
    for t, turn in enumerate(conv["turns"]):
        chain = chain + [((cid, t, "in"), int(turn["input_tokens"]))]
        prompt = sum(n for _, n in chain)
        cols["req"].append(Request((cid, t), prompt, sig, tuple(chain), cid))
        cols["arr"].append(int(conv["start_step"]) if t == 0 else -1)
        cols["fol"].append(-1 if t == 0 else len(cols["req"]) - 2)
        cols["thk"].append(int(turn.get("think_steps", 0)))
        cols["start"].append(a)
        cols["len"].append(max(b - a, 1))
        cols["off"].append(walked)
        cols["dec"].append(int(turn["output_tokens"]))
        answer = ((cid, t, "out"), int(turn["output_tokens"]))
        cols["out"].append((answer,))
        chain = chain + [answer]
        walked += int(turn["output_tokens"])
