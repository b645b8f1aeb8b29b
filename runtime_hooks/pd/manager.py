"""The request manager of a disaggregated run (on the prefill pool's first rank): it queues requests,
picks a prefill rank and a decode rank for each attempt, follows each hand-off to its verdict and each
request to its end, and fails or retries a request whose hand-off aborted or whose decode rank was lost.

What it reads from the launcher's key-value store: each hand-off's verdict
(:func:`runtime_hooks.pd.handoff.read_verdict`), ``pd/r/<hid>/done`` (a decode rank finished the
attempt: its tokens, kept as the request's output) and ``pd/decode/lost`` (the decode ranks the decode pool lost). It writes ``pd/stop`` once every
request has ended.

The rule on a failure (``on_handoff_failure``): ``fail`` ends the request as failed; ``retry`` queues
it again from its prompt (a new attempt: a new prefill, a new hand-off; whatever the failed attempt
produced is dropped, never continued), up to ``max_attempts`` attempts, then fails it.

A decode rank is chosen among the live ones, least loaded first (requests handed to it and not ended),
and receives one hand-off at a time: the next goes to it once the previous one's verdict is in. So a
decode rank that dies costs the hand-off in flight to it and the requests it was decoding, never a
request sent to it after it died and before its loss was known (the verdict of the hand-off in flight
comes at its deadline, after the decode pool has found the loss).
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass, field

from runtime_hooks.pd.handoff import read_verdict

__all__ = ["ON_FAILURE", "Manager", "RequestState"]

ON_FAILURE = ("fail", "retry")


@dataclass
class RequestState:
    """One request as the manager follows it; ``attempts[i]``: ``{hid, src, dst, state, reason}``."""

    id: int
    status: str = "queued"  # queued | handoff | decoding | completed | failed
    attempts: list = field(default_factory=list)
    reason: str = ""
    output: dict | None = None  # what the decode rank delivered: {hid, tokens, t_commit, t_done}

    @property
    def current(self) -> dict:
        return self.attempts[-1]


class Manager:
    """Plans each prefill step (see the module docstring); all calls on the prefill pool's first rank."""

    def __init__(
        self, store, requests: int, prefill: list[int], decode: list[int], on_failure: str, max_attempts: int
    ):
        if on_failure not in ON_FAILURE:
            raise ValueError(f"on_handoff_failure must be one of {ON_FAILURE}, got {on_failure!r}")
        self.store, self.prefill, self.decode = store, list(prefill), list(decode)
        self.on_failure, self.max_attempts = on_failure, int(max_attempts)
        self.reqs = [RequestState(i) for i in range(int(requests))]
        self.queue: deque[int] = deque(range(int(requests)))
        self.lost: list[int] = []

    def done(self) -> bool:
        return all(r.status in ("completed", "failed") for r in self.reqs)

    def plan(self) -> tuple[list[tuple[int, int, int] | None], bool]:
        """This step's work per prefill rank (``(request, attempt, decode rank)`` or None) and whether
        the run is over (``pd/stop`` is then set)."""
        self._poll()
        jobs = [self._assign(src) for src in self.prefill]
        if self.done():
            self.store.set("pd/stop", "1")
            return jobs, True
        return jobs, False

    def _poll(self) -> None:
        """Verdicts, finished attempts and lost decode ranks since the last step."""
        if self.store.check(["pd/decode/lost"]):
            self.lost = json.loads(self.store.get("pd/decode/lost"))
        for r in self.reqs:
            if r.status == "handoff":
                verdict = read_verdict(self.store, r.current["hid"])
                if verdict is None:
                    continue
                r.current["state"] = verdict["state"]
                if verdict["state"] == "committed":
                    r.status = "decoding"
                else:
                    self._failed(r, verdict["reason"])
            if r.status == "decoding":
                key = f"pd/r/{r.current['hid']}/done"
                if self.store.check([key]):
                    r.status, r.output = "completed", json.loads(self.store.get(key))
                elif r.current["dst"] in self.lost:
                    self._failed(r, f"decode rank {r.current['dst']} was lost with the request on it")

    def _failed(self, r: RequestState, reason: str) -> None:
        r.current["reason"] = reason
        r.reason = reason
        if self.on_failure == "retry" and len(r.attempts) < self.max_attempts:
            r.status = "queued"
            self.queue.append(r.id)
        else:
            r.status = "failed"

    def _receiving(self, dst: int) -> bool:
        """A hand-off to decode rank ``dst`` is waiting for its verdict."""
        return any(r.status == "handoff" and r.current["dst"] == dst for r in self.reqs)

    def _assign(self, src: int) -> tuple[int, int, int] | None:
        """The next queued request for prefill rank ``src`` and its decode rank (None: nothing to do)."""
        live = [d for d in self.decode if d not in self.lost]
        if not self.queue:
            return None
        if not live:
            for rid in list(self.queue):
                self.reqs[rid].status, self.reqs[rid].reason = "failed", "no decode rank is left"
            self.queue.clear()
            return None
        load = {d: 0 for d in live}
        for r in self.reqs:
            if r.status in ("handoff", "decoding") and r.current["dst"] in load:
                load[r.current["dst"]] += 1
        free = [d for d in live if not self._receiving(d)]
        if not free:
            return None
        dst = min(free, key=lambda d: (load[d], d))
        r = self.reqs[self.queue.popleft()]
        attempt = len(r.attempts)
        r.attempts.append(
            {"hid": f"{r.id}.{attempt}", "src": src, "dst": dst, "state": "requested", "reason": ""}
        )
        r.status = "handoff"
        return r.id, attempt, dst

    def to_list(self) -> list[dict]:
        return [
            {"id": r.id, "status": r.status, "reason": r.reason, "attempts": r.attempts, "output": r.output}
            for r in self.reqs
        ]
