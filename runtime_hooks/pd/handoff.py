"""The KV hand-off from a prefill rank to a decode rank: states, a deadline, checksums, metadata checked
on arrival, one verdict both sides follow, and the request's KV freed on both sides when it aborts.

States of one hand-off (one attempt of one request):

1. ``requested``: the prefill rank posts the metadata (:class:`HandoffMeta`: request, attempt,
   position = tokens cached, the KV layout and dtype, the model identity and the decode pool's
   placement identity it was planned against, the deadline) in the decode rank's queue for this pair of
   ranks (the launcher's key-value store), then runs the prompt.
2. ``transferring``: the decode rank's receiver (one thread per prefill rank) reads the metadata,
   checks it against its own model, layout, dtype and placement (a mismatch aborts at once, before
   anything is allocated), allocates the receive buffers and posts a receive for every layer. The
   prefill rank sends layer ``l``'s keys and values (packed in one buffer, with its checksum) from a
   forward hook as soon as layer ``l`` has computed, while layer ``l+1`` computes (the sends progress in
   gloo's own threads), and the first generated token last. Each layer is checked against its checksum
   as it arrives.
3. ``committed`` or ``aborted``: one verdict per hand-off, written with ``compare_set`` (the first
   wins; the other side follows it): the receiver commits when every layer arrived whole before the
   deadline, and aborts on a metadata mismatch, a checksum mismatch, a receive that fails or times out;
   the prefill rank aborts when no verdict came by the deadline plus a grace (a decode rank that died).
   On ``aborted`` both sides drop the request's buffers (sent and received alike) and the pair's channel
   (a 2-rank gloo group made per generation: gloo gives up a pair after a timeout, and an unanswered send
   keeps its buffer), so nothing of it stays in memory; the request manager then fails or retries the
   request from its prompt. A half-transferred KV is never used.

Fault injection (tests, :class:`HandoffFault` on one request's first attempt): ``decode-dies`` (the
decode rank exits after half the layers arrived), ``slow-transfer`` (the sender stalls after half the
layers, past the deadline), ``metadata-mismatch`` (the sender names a stale decode placement),
``corrupt-chunk`` (one layer's buffer changes after its checksum was taken, as if corrupted on the
wire).

Shapes: L decoder layers; one layer's chunk is ``[k_elems + v_elems]`` (keys then values, flattened).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import queue
import threading
import time
from dataclasses import asdict, dataclass, field

import torch

from runtime_hooks.migration_core import checksum
from runtime_hooks.pd.kv import KVLayout, RequestKV, track

__all__ = [
    "FAULTS",
    "STATES",
    "Arrival",
    "HandoffFault",
    "HandoffMeta",
    "Receiver",
    "Sender",
    "decide",
    "model_identity",
    "placement_identity",
]

log = logging.getLogger(__name__)

STATES = ("requested", "transferring", "committed", "aborted")
FAULTS = ("decode-dies", "slow-transfer", "metadata-mismatch", "corrupt-chunk")
GRACE_S = 1.0  # the prefill side's own abort waits this long past the deadline for the receiver's verdict


@dataclass(frozen=True)
class HandoffFault:
    """Inject ``kind`` (one of :data:`FAULTS`) into the first hand-off of request ``request``."""

    kind: str
    request: int

    def __post_init__(self) -> None:
        if self.kind not in FAULTS:
            raise ValueError(f"hand-off fault {self.kind!r} is not one of {', '.join(FAULTS)}")
        if int(self.request) < 0:
            raise ValueError(f"hand-off fault on request {self.request}: request ids are >= 0")


@dataclass(frozen=True)
class HandoffMeta:
    """What the decode rank checks before it accepts a hand-off (see the module docstring)."""

    hid: str
    request: int
    attempt: int
    src: int
    dst: int
    seq: int
    gen: int
    position: int
    layout: dict
    model_id: str
    placement_id: str
    deadline: float
    fault: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | str) -> HandoffMeta:
        return cls(**json.loads(raw))

    @property
    def kv_layout(self) -> KVLayout:
        d = self.layout
        return KVLayout(
            int(d["num_layers"]), tuple(d["k_heads_dim"]), tuple(d["v_heads_dim"]), str(d["dtype"])
        )


def model_identity(model: torch.nn.Module, seed: int, dtype: str) -> str:
    """A short hash of the model class, its config, the weight seed and the dtype."""
    text = f"{type(model).__name__}|{model.config.to_json_string(use_diff=False)}|{seed}|{dtype}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def placement_identity(rows) -> str:
    """A short hash of a placement's map ``[L, P]`` and topology."""
    m = rows.physical_to_logical_map
    text = f"{rows.topology}|{m.shape}|{m.tobytes().hex()}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def verdict_key(hid: str) -> str:
    return f"pd/h/{hid}/verdict"


def decide(store, hid: str, doc: dict) -> dict:
    """Propose a verdict (``{"state": "committed"|"aborted", ...}``); the one that won (first written)."""
    won = store.compare_set(verdict_key(hid), "", json.dumps(doc))
    return json.loads(won)


def read_verdict(store, hid: str) -> dict | None:
    key = verdict_key(hid)
    return json.loads(store.get(key)) if store.check([key]) else None


def _queue_key(src: int, dst: int, seq: int) -> str:
    return f"pd/ch/{src}-{dst}/q/{seq}"


def _open_channel(store, src: int, dst: int, gen: int, sender: bool, timeout: float):
    """The pair's 2-rank gloo group of generation ``gen`` (blocks until the other side opens it)."""
    import torch.distributed as dist

    prefix = dist.PrefixStore(f"pd/ch/{src}-{dst}/g{gen}/", store)
    return dist.ProcessGroupGloo(prefix, 0 if sender else 1, 2, datetime.timedelta(seconds=max(timeout, 0.5)))


def _tag(seq: int, layers: int, index: int) -> int:
    """Tag of message ``index`` of transfer ``seq``: ``2 l`` / ``2 l + 1`` a layer's chunk / checksum,
    ``2 L`` / ``2 L + 1`` the tail and its checksum."""
    return (seq % 4096) * (2 * layers + 2) + index


# ---------------------------------------------------------------------------------------------------
# The prefill side
# ---------------------------------------------------------------------------------------------------
@dataclass
class Outgoing:
    """One hand-off in flight on the prefill rank: the buffers it sends (held until the verdict)."""

    meta: HandoffMeta
    pg: object
    works: list = field(default_factory=list)
    buffers: list = field(default_factory=list)
    layer_bytes: list = field(default_factory=list)
    t_first: float = 0.0
    t_compute_end: float = 0.0
    stalled: bool = False
    freed_bytes: int = 0

    def held_bytes(self) -> int:
        return int(sum(b.numel() * b.element_size() for b in self.buffers))


class Sender:
    """The hand-offs of one prefill rank (``me``, a global rank); all calls from its main thread."""

    def __init__(self, store, me: int, timeout: float):
        self.store, self.me, self.timeout = store, me, float(timeout)
        self.channels: dict[int, tuple[int, object]] = {}  # dst -> (gen, group or None)
        self.gen: dict[int, int] = {}
        self.seq: dict[int, int] = {}
        self.out: dict[str, Outgoing] = {}

    def begin(self, meta_fields: dict, dst: int) -> Outgoing:
        """``requested``: post the metadata, open the pair's channel; the hooks then stream the layers."""
        gen, seq = self.gen.get(dst, 0), self.seq.get(dst, 0)
        self.seq[dst] = seq + 1
        meta = HandoffMeta(src=self.me, dst=dst, seq=seq, gen=gen, **meta_fields)
        self.store.set(_queue_key(self.me, dst, seq), meta.to_json())
        have = self.channels.get(dst)
        pg = have[1] if have is not None and have[0] == gen else None
        if pg is None:
            try:
                pg = _open_channel(self.store, self.me, dst, gen, True, self.timeout)
            except RuntimeError as exc:
                log.warning("hand-off %s: channel to rank %d not opened: %s", meta.hid, dst, exc)
            self.channels[dst] = (gen, pg)
        out = Outgoing(meta, pg)
        self.out[meta.hid] = out
        return out

    def send_layer(self, out: Outgoing, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Post layer ``layer``'s chunk and checksum (keys/values ``[1, h, T, d]``); returns at once."""
        chunk = track(torch.cat([keys.reshape(-1), values.reshape(-1)]))  # [k_elems + v_elems]
        cks = checksum(chunk)
        fault, L = out.meta.fault, out.meta.layout["num_layers"]
        if fault == "corrupt-chunk" and layer == L // 2:
            chunk = track(chunk.clone())
            chunk[0] += 1  # changed after its checksum was taken: as if corrupted on the wire
        out.layer_bytes.append(int(chunk.numel() * chunk.element_size()))
        out.buffers += [chunk, cks]
        if fault == "slow-transfer" and layer >= L // 2:
            out.stalled = True  # the link stalls past the deadline: the rest never goes out
            return
        if out.pg is None:
            return
        out.t_first = out.t_first or time.time()
        self._post(out, [(chunk, 2 * layer), (cks, 2 * layer + 1)])

    def _post(self, out: Outgoing, messages: list) -> None:
        """Post sends ``(tensor, message index)``; a channel the receiver already closed (it aborted, or
        died) stops the sending: the verdict says what happened."""
        L, seq = out.meta.layout["num_layers"], out.meta.seq
        try:
            for t, i in messages:
                out.works.append(out.pg.send([t], 1, _tag(seq, L, i)))
        except RuntimeError as exc:
            log.info("hand-off %s: channel to rank %d closed: %s", out.meta.hid, out.meta.dst, exc)
            out.pg = None

    def send_tail(self, out: Outgoing, first_token: int) -> None:
        """After the prompt ran: the first generated token, position and layer count, with a checksum."""
        out.t_compute_end = out.t_compute_end or time.time()
        if out.stalled or out.pg is None:
            return
        L = out.meta.layout["num_layers"]
        tail = torch.tensor([first_token, out.meta.position, L], dtype=torch.int64)
        cks = checksum(tail)
        out.buffers += [tail, cks]
        self._post(out, [(tail, 2 * L), (cks, 2 * L + 1)])

    def poll(self) -> list[tuple[Outgoing, dict]]:
        """Hand-offs that ended since the last call, with their verdict; their buffers are freed (and the
        pair's channel dropped on an abort). A hand-off past its deadline plus :data:`GRACE_S` with no
        verdict is aborted from this side."""
        done = []
        for hid, out in list(self.out.items()):
            verdict = read_verdict(self.store, hid)
            if verdict is None and time.time() > out.meta.deadline + GRACE_S:
                why = f"no verdict from decode rank {out.meta.dst} by the deadline"
                verdict = decide(
                    self.store, hid, {"state": "aborted", "by": "prefill", "reason": why, "t": time.time()}
                )
            if verdict is None:
                continue
            out.freed_bytes = out.held_bytes()
            self._finish(out, verdict["state"] == "committed")
            del self.out[hid]
            done.append((out, verdict))
        return done

    def _finish(self, out: Outgoing, committed: bool) -> None:
        """Free the hand-off's buffers; on an abort also drop the pair's channel (next generation)."""
        dst = out.meta.dst
        if committed:
            for w in out.works:
                w.wait()  # already complete: the receiver has every message
        else:
            self.gen[dst] = out.meta.gen + 1
            self.channels.pop(dst, None)
        out.works.clear()
        out.buffers.clear()
        out.pg = None

    def close(self) -> None:
        self.channels.clear()


# ---------------------------------------------------------------------------------------------------
# The decode side
# ---------------------------------------------------------------------------------------------------
@dataclass
class Arrival:
    """A committed hand-off, handed to the decode loop: the request's cache and its first token."""

    meta: HandoffMeta
    kv: RequestKV
    first_token: int
    t_commit: float


class Receiver:
    """The receiving side of one decode rank: a thread per prefill rank, committed requests in ``ready``.

    ``expect(meta)`` returns why the metadata does not fit this rank ("" when it does); ``die`` is set
    by the ``decode-dies`` fault (the decode loop then exits the process).
    """

    def __init__(self, store, me: int, sources: list[int], expect, timeout: float):
        self.me, self.expect, self.timeout = me, expect, float(timeout)
        self.ready: queue.Queue = queue.Queue()
        self.stop = threading.Event()
        self.die = threading.Event()
        self.aborted: list[tuple[str, str, int]] = []  # (hid, reason, bytes freed)
        self._store, self._lock, self._waiting = store, threading.Lock(), {}  # src -> queue key waited on
        self.threads = [
            threading.Thread(
                target=self._serve, args=(store.clone(), src), daemon=True, name=f"kv-recv-{src}"
            )
            for src in sources
        ]
        for t in self.threads:
            t.start()

    def close(self) -> None:
        """Stop the threads: each is woken by a ``stop`` written under the key it waits on (no request
        comes after the run's end)."""
        with self._lock:
            self.stop.set()
            for key in self._waiting.values():
                self._store.set(key, "stop")
        for t in self.threads:
            t.join(timeout=5.0)

    def _serve(self, store, src: int) -> None:
        """One prefill rank's queue, in order; a new channel generation after every abort."""
        pg, gen, seq = None, -1, 0
        while True:
            key = _queue_key(src, self.me, seq)
            with self._lock:
                if self.stop.is_set():
                    return
                self._waiting[src] = key
            store.wait([key], datetime.timedelta(days=1))  # a request, or close()'s stop
            raw = store.get(key)
            store.delete_key(key)
            if raw == b"stop":
                return
            meta = HandoffMeta.from_json(raw)
            seq += 1
            if meta.gen != gen:
                pg, gen = None, meta.gen
            try:
                if pg is None:  # the pair's transport, whatever this request's metadata says
                    pg = _open_channel(store, src, self.me, gen, False, max(meta.deadline - time.time(), 0.5))
                ok = self._receive(store, pg, meta)
            except Exception as exc:  # noqa: BLE001 - any failure aborts this hand-off, never the rank
                ok = self._abort(store, meta, f"{type(exc).__name__}: {_gloo_reason(exc)}", [])
            if not ok:
                pg, gen = None, -1

    def _receive(self, store, pg, meta: HandoffMeta) -> bool:
        """Check, allocate, receive every layer, verify, decide; True when committed."""
        why = self.expect(meta)
        if why:
            return self._abort(store, meta, f"metadata mismatch: {why}", [])
        lay, L = meta.kv_layout, meta.layout["num_layers"]
        dtype = getattr(torch, lay.dtype)
        k_n, v_n = lay.layer_elems(meta.position)
        chunks = [track(torch.empty(k_n + v_n, dtype=dtype)) for _ in range(L)]
        sums = [torch.empty(2, dtype=torch.int64) for _ in range(L + 1)]
        tail = torch.empty(3, dtype=torch.int64)
        works = []
        for l in range(L):
            works.append(pg.recv([chunks[l]], 0, _tag(meta.seq, L, 2 * l)))
            works.append(pg.recv([sums[l]], 0, _tag(meta.seq, L, 2 * l + 1)))
        works.append(pg.recv([tail], 0, _tag(meta.seq, L, 2 * L)))
        works.append(pg.recv([sums[L]], 0, _tag(meta.seq, L, 2 * L + 1)))
        for i, (data, cks) in enumerate(zip([*chunks, tail], sums)):
            what = f"layer {i}" if i < L else "the tail"
            try:
                for w in works[2 * i : 2 * i + 2]:
                    w.wait(datetime.timedelta(seconds=max(meta.deadline - time.time(), 0.001)))
            except RuntimeError as exc:  # timed out, or the sender's side closed
                works.clear()
                return self._abort(store, meta, f"{what} not received: {_gloo_reason(exc)}", chunks)
            if meta.fault == "decode-dies" and i == L // 2:
                self.die.set()  # this rank exits now, half the layers received
                time.sleep(3600)
            if not torch.equal(checksum(data), cks):
                return self._abort(store, meta, f"checksum mismatch on {what}", chunks)
        if int(tail[1]) != meta.position or int(tail[2]) != L:
            return self._abort(store, meta, f"tail {tail.tolist()} does not match the metadata", chunks)
        now = time.time()
        won = decide(store, meta.hid, {"state": "committed", "by": "decode", "reason": "", "t": now})
        if won["state"] != "committed":
            return self._abort(store, meta, won["reason"], chunks)
        kv = RequestKV([_split(c, lay, meta.position) for c in chunks])
        self.ready.put(Arrival(meta, kv, int(tail[0]), now))
        return True

    def _abort(self, store, meta: HandoffMeta, reason: str, chunks: list) -> bool:
        """Abort (unless the other side's verdict came first) and free the KV received: False."""
        freed = int(sum(b.numel() * b.element_size() for b in chunks))
        chunks.clear()
        decide(store, meta.hid, {"state": "aborted", "by": "decode", "reason": reason, "t": time.time()})
        self.aborted.append((meta.hid, reason, freed))
        log.warning("hand-off %s aborted on decode rank %d: %s", meta.hid, self.me, reason)
        return False


def _gloo_reason(exc: Exception) -> str:
    """A gloo error in a few words: its message without the source location in brackets."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    text = text.split("] ", 1)[-1] if text.startswith("[") else text
    return text.split(". This is typically", 1)[0][:160]


def _split(chunk: torch.Tensor, lay: KVLayout, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One received chunk back into keys ``[1, h, T, d]`` and values (views of the chunk)."""
    k_n, _ = lay.layer_elems(tokens)
    (hk, dk), (hv, dv) = lay.k_heads_dim, lay.v_heads_dim
    return chunk[:k_n].view(1, hk, tokens, dk), chunk[k_n:].view(1, hv, tokens, dv)
