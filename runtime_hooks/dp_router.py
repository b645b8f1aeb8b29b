"""A small router process in front of an engine: picks each request's attention-DP rank with a routing
rule (:mod:`placement.routing`) and forwards it with the field or header the engine reads.

What each engine accepts (SGLang 0.5.23, vLLM 0.33.0, read from their code; :data:`ENGINE_PINS`):

- SGLang: the body key ``routed_dp_rank`` on ``/generate`` and on the OpenAI routes
  (``/v1/completions``, ``/v1/chat/completions``, ``/v1/responses``); the OpenAI routes also read the
  header ``X-Data-Parallel-Rank``, which overrides the body. Checked against ``[0, dp ranks)`` and the
  active workers; honoured under every ``--load-balance-method``.
- vLLM: only the header ``X-data-parallel-rank`` (OpenAI routes and ``/inference/v1/generate``; no
  body key), and only under internal or hybrid data-parallel load balancing (with hybrid the rank is
  the node-local index). With external load balancing (``--data-parallel-external-lb``, one API
  server per rank) there is no such field: the rank is chosen by choosing the server, so give one
  upstream URL per rank and no header is set.

:func:`rank_pin` is the library call (the headers and body keys to set); :func:`serve` runs the
process (``moe-placement route --serve``): stdlib ``http.server`` and ``urllib`` only, requests
forwarded as they come (each on its own thread, the router's state under one lock), the answer
streamed back; the request counts against its rank until the answer is read to the end.

Nothing here imports numpy at import time, nor ortools, networkx or torch.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from itertools import count
from urllib.parse import urlsplit

__all__ = ["ENGINE_PINS", "EnginePin", "RouterServer", "prefix_chain", "rank_pin", "serve"]

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 << 20  # a request body larger than this is refused (413)
CHARS_PER_TOKEN = 4  # prompt text -> tokens estimate for the prefix cache (about English text in BPE)
BLOCK_TOKENS = 64  # a prompt's token ids (or text) are cached in blocks of this many tokens


@dataclass(frozen=True)
class EnginePin:
    """How one engine takes a request's attention-DP rank.

    Attributes:
        body_key: the JSON body key (``""``: none); body_paths: the routes that read it.
        header: the HTTP header (``""``: none); header_paths: the routes that read it.
        version: the engine version this was read from; note: when the pin is honoured.
    """

    body_key: str
    body_paths: tuple[str, ...]
    header: str
    header_paths: tuple[str, ...]
    version: str
    note: str


_OPENAI = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
ENGINE_PINS: dict[str, EnginePin] = {
    "sglang": EnginePin(
        "routed_dp_rank",
        ("/generate", *_OPENAI),
        "X-Data-Parallel-Rank",
        _OPENAI,
        "0.5.23",
        "checked against [0, dp ranks) and the active workers; honoured under every load-balance method",
    ),
    "vllm": EnginePin(
        "",
        (),
        "X-data-parallel-rank",
        (*_OPENAI, "/inference/v1/generate"),
        "0.33.0",
        "honoured with internal or hybrid DP load balancing only (hybrid: the node-local index); with "
        "external load balancing there is no field: give one upstream URL per rank",
    ),
}


def rank_pin(engine: str, rank: int, path: str) -> tuple[dict[str, str], dict[str, int]]:
    """``(headers, body keys)`` that pin a request to attention-DP rank ``rank`` on ``engine`` for the
    route ``path``; both empty where the engine reads neither on that route."""
    if engine not in ENGINE_PINS:
        raise ValueError(f"unknown engine {engine!r}; the router knows {', '.join(ENGINE_PINS)}")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"rank must be a whole number >= 0, got {rank!r}")
    pin, route = ENGINE_PINS[engine], urlsplit(path).path.rstrip("/") or "/"
    headers = {pin.header: str(rank)} if pin.header and route in pin.header_paths else {}
    body = {pin.body_key: rank} if pin.body_key and route in pin.body_paths else {}
    return headers, body


def _segments(key: str, text_or_ids, per_block: int, unit: str) -> list[tuple[str, int]]:
    """A prompt's cacheable blocks: each block's content hash chained on the previous one."""
    out, parent = [], key
    for i in range(0, len(text_or_ids), per_block):
        block = text_or_ids[i : i + per_block]
        digest = hashlib.sha256((parent + repr(block)).encode()).hexdigest()[:24]
        tokens = len(block) if unit == "ids" else max(1, len(block) // CHARS_PER_TOKEN)
        out.append((digest, tokens))
        parent = digest
    return out


def prefix_chain(body: Mapping) -> list[tuple[str, int]]:
    """The prompt of a request body as a chain of cacheable segments ``[(key, tokens), ...]``:
    chat ``messages`` one segment per message; ``input_ids`` blocks of :data:`BLOCK_TOKENS` ids; a
    ``prompt`` or ``text`` string blocks of that many tokens at :data:`CHARS_PER_TOKEN` characters each
    (an estimate). ``[]`` when the body holds no prompt the router can read."""
    msgs = body.get("messages")
    if isinstance(msgs, list):
        chain, parent = [], "chat"
        for m in msgs:
            text = json.dumps(m, sort_keys=True, default=str)
            parent = hashlib.sha256((parent + text).encode()).hexdigest()[:24]
            chain.append((parent, max(1, len(text) // CHARS_PER_TOKEN)))
        return chain
    ids = body.get("input_ids")
    if isinstance(ids, list) and all(isinstance(x, int) for x in ids):
        return _segments("ids", ids, BLOCK_TOKENS, "ids")
    for key in ("prompt", "text"):
        if isinstance(body.get(key), str):
            return _segments("text", body[key], BLOCK_TOKENS * CHARS_PER_TOKEN, "text")
    return []


# ---------------------------------------------------------------------------------------------
# the process
# ---------------------------------------------------------------------------------------------
_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection"}


class RouterServer(ThreadingHTTPServer):
    """The router process's HTTP server: each request on its own thread, the router under one lock.

    Args:
        address: ``(host, port)`` to listen on (port 0: any free port; :attr:`server_address` says which).
        router: a :class:`placement.routing.Router` whose ranks are the engine's attention-DP ranks.
        engine: a key of :data:`ENGINE_PINS`.
        upstreams: one engine URL (the rank goes in the field or header), or one URL per rank (the rank
            is the URL: vLLM's external load balancing; no field is set).
        max_requests: stop after this many routed requests (None: serve until stopped).
        timeout: seconds to wait for the engine's answer.
    """

    daemon_threads = True

    def __init__(
        self, address, router, engine: str, upstreams: Sequence[str], max_requests=None, timeout=600.0
    ):
        if engine not in ENGINE_PINS:
            raise ValueError(f"unknown engine {engine!r}; the router knows {', '.join(ENGINE_PINS)}")
        ups = [u.rstrip("/") for u in upstreams]
        if not ups or any(urlsplit(u).scheme not in ("http", "https") or not urlsplit(u).netloc for u in ups):
            raise ValueError(f"upstream URLs must be http(s)://host:port, got {list(upstreams)[:4]}")
        if len(ups) not in (1, router.num_ranks):
            raise ValueError(
                f"give one upstream URL (the rank goes in the request) or one per rank ({router.num_ranks}), "
                f"got {len(ups)}"
            )
        self.router, self.engine, self.upstreams = router, engine, ups
        self.max_requests, self.timeout_s = max_requests, float(timeout)
        self.lock, self.ids, self.routed = threading.Lock(), count(), 0
        super().__init__(address, _Handler)

    def pick(self, body: Mapping) -> tuple[object, int]:
        """Route one request body: ``(request id, rank)``."""
        from placement.routing import Request

        chain = tuple(prefix_chain(body))
        with self.lock:
            rid = next(self.ids)
            rank = self.router.route(Request(rid, sum(n for _, n in chain), None, chain))
        return rid, rank

    def done(self, rid) -> None:
        with self.lock:
            self.router.finish(rid)
            self.routed += 1
            stop = self.max_requests is not None and self.routed >= self.max_requests
        if stop:
            threading.Thread(target=self.shutdown, daemon=True).start()


class _Handler(BaseHTTPRequestHandler):
    server: RouterServer

    def log_message(self, format, *args) -> None:  # noqa: A002 (the base class's name)
        log.info("%s %s", self.address_string(), format % args)

    def _reply(self, status: int, message: str) -> None:
        data = json.dumps({"error": message}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> dict | None:
        try:
            n = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            n = -1
        if not 0 <= n <= MAX_BODY_BYTES:
            self._reply(
                413 if n > MAX_BODY_BYTES else 400, f"Content-Length must be 0..{MAX_BODY_BYTES} bytes"
            )
            return None
        try:
            body = json.loads(self.rfile.read(n) or b"{}")
        except (ValueError, RecursionError):
            self._reply(400, "the body is not JSON")
            return None
        if not isinstance(body, dict):
            self._reply(400, "the body must be a JSON object")
            return None
        return body

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = self._body()
        if body is None:
            return
        s = self.server
        try:
            rid, rank = s.pick(body)
        except ValueError as exc:  # no rank serving, or a request the router refuses
            self._reply(503, str(exc))
            return
        finished = False

        def finish() -> None:  # once: when the engine's answer has ended, before its last bytes go out
            nonlocal finished
            if not finished:
                finished = True
                s.done(rid)

        try:
            headers, fields = rank_pin(s.engine, rank, self.path) if len(s.upstreams) == 1 else ({}, {})
            url = s.upstreams[0 if len(s.upstreams) == 1 else rank] + self.path
            self._forward(url, {**body, **fields}, headers, rank, finish)
        finally:
            finish()

    def do_GET(self) -> None:  # noqa: N802
        self._forward(self.server.upstreams[0] + self.path, None, {}, None)

    def _forward(self, url: str, body: dict | None, headers: dict, rank: int | None, on_end=None) -> None:
        """Send to the engine and stream its answer back (its status, its headers but hop-by-hop ones).
        ``on_end()`` runs once the engine's answer has ended and before its last chunk is written: a
        client that sends its next request on receiving the answer finds this one already finished."""
        data = None if body is None else json.dumps(body).encode()
        extra = {k: v for k, v in self.headers.items() if k.lower() in ("authorization", "accept")}
        req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST")
        for k, v in {**extra, "Content-Type": "application/json", **headers}.items():
            req.add_header(k, v)
        try:
            resp = urllib.request.urlopen(req, timeout=self.server.timeout_s)  # noqa: S310 (http(s) checked)
        except urllib.error.HTTPError as err:
            resp = err  # the engine's own error status and body, passed on
        except (urllib.error.URLError, OSError) as exc:
            self._reply(502, f"engine {url} unreachable: {exc}")
            return
        with resp:
            self.send_response(resp.status if hasattr(resp, "status") else resp.code)
            for k, v in resp.headers.items():
                if k.lower() not in _HOP:
                    self.send_header(k, v)
            if rank is not None:
                self.send_header("X-Routed-DP-Rank", str(rank))
            self.end_headers()
            chunk = resp.read(1 << 14)
            while chunk:
                following = resp.read(1 << 14)
                if not following and on_end is not None:
                    on_end()
                self.wfile.write(chunk)
                self.wfile.flush()
                chunk = following


def serve(
    engine: str,
    upstreams: Sequence[str],
    num_ranks: int,
    rule: str,
    options=None,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    max_requests: int | None = None,
) -> RouterServer:
    """A :class:`RouterServer` (bound, not yet serving: call ``serve_forever``) routing by ``rule`` over
    ``num_ranks`` ranks (``options``: :class:`placement.routing.RouterOptions`).

    A rule that needs each request's expert signature (``affinity``) is refused: an HTTP request does
    not carry one; route by affinity from a component that has the request's prefill routing, through
    the library's :class:`placement.routing.Router`."""
    from placement.routing import Router, get_rule

    r = get_rule(rule)
    if r.needs_placement:
        raise ValueError(
            f"the {r.name} rule routes by each request's expert signature, which an HTTP request does not carry; "
            "serve with round-robin, least-loaded, prefix or combined, or call placement.routing.Router from a "
            "component that has the request's prefill routing"
        )
    return RouterServer((host, int(port)), Router(r, num_ranks, options), engine, upstreams, max_requests)
