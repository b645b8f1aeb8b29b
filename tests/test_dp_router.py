"""The router process in front of an engine (issue 43): the field or header each engine reads, forwarded
to a fake engine on 127.0.0.1, end to end; the process stops by itself after ``max_requests``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from runtime_hooks.dp_router import ENGINE_PINS, prefix_chain, rank_pin, serve


class FakeEngine(ThreadingHTTPServer):
    """Records every request (path, headers, JSON body) and answers ``{"ok": port}``."""

    daemon_threads = True

    def __init__(self):
        self.seen: list[tuple[str, dict, dict]] = []
        super().__init__(("127.0.0.1", 0), _Engine)
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


class _Engine(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_POST(self):  # noqa: N802
        n = int(self.headers.get("Content-Length", "0"))
        body = json.loads(self.rfile.read(n) or b"{}")
        self.server.seen.append((self.path, {k.lower(): v for k, v in self.headers.items()}, body))
        data = json.dumps({"ok": self.server.server_address[1]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def post(url: str, body: dict, timeout: float = 10.0) -> tuple[int, dict, dict]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), json.loads(err.read())


@pytest.fixture
def engine():
    e = FakeEngine()
    yield e
    e.stop()


def _router(engine_name: str, upstreams, ranks: int, rule: str = "round-robin", n: int = 4):
    server = serve(engine_name, upstreams, ranks, rule, max_requests=n)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return server, thread, f"http://127.0.0.1:{server.server_address[1]}"


def test_rank_pin_names_each_engines_field_and_header():
    assert rank_pin("sglang", 3, "/generate") == ({}, {"routed_dp_rank": 3})
    assert rank_pin("sglang", 1, "/v1/chat/completions") == (
        {"X-Data-Parallel-Rank": "1"},
        {"routed_dp_rank": 1},
    )
    assert rank_pin("vllm", 2, "/v1/completions") == ({"X-data-parallel-rank": "2"}, {})
    assert rank_pin("vllm", 2, "/generate") == ({}, {})  # vLLM reads no rank on that route
    with pytest.raises(ValueError, match="unknown engine"):
        rank_pin("trtllm", 0, "/generate")
    assert set(ENGINE_PINS) == {"sglang", "vllm"}


def test_sglang_requests_carry_routed_dp_rank_round_robin_and_the_router_stops_by_itself(engine):
    server, thread, url = _router("sglang", [engine.url], 3, n=4)
    answers = [post(url + "/generate", {"text": f"hello {i}"}) for i in range(3)]
    status, headers, _ = post(url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    thread.join(timeout=10)
    assert not thread.is_alive()  # stopped after max_requests
    server.server_close()
    assert [a[0] for a in answers] == [200, 200, 200] and status == 200
    assert [b["routed_dp_rank"] for _, _, b in engine.seen] == [0, 1, 2, 0]
    assert engine.seen[3][1]["x-data-parallel-rank"] == "0" and engine.seen[0][2]["text"] == "hello 0"
    assert [a[1]["X-Routed-DP-Rank"] for a in answers] == ["0", "1", "2"]


def test_vllm_requests_carry_the_header_only(engine):
    server, thread, url = _router("vllm", [engine.url], 2, n=2)
    for _ in range(2):
        post(url + "/v1/completions", {"prompt": "x" * 300, "max_tokens": 1})
    thread.join(timeout=10)
    server.server_close()
    assert [h["x-data-parallel-rank"] for _, h, _ in engine.seen] == ["0", "1"]
    assert all("routed_dp_rank" not in b for _, _, b in engine.seen)


def test_one_upstream_per_rank_picks_the_server_and_sets_no_field():
    engines = [FakeEngine(), FakeEngine()]
    try:
        server, thread, url = _router("vllm", [e.url for e in engines], 2, rule="round-robin", n=2)
        got = [post(url + "/v1/completions", {"prompt": "a"})[2]["ok"] for _ in range(2)]
        thread.join(timeout=10)
        server.server_close()
        assert sorted(got) == sorted(e.server_address[1] for e in engines)
        assert all("x-data-parallel-rank" not in h for e in engines for _, h, _ in e.seen)
    finally:
        for e in engines:
            e.stop()


def test_prefix_routing_sends_a_repeated_conversation_back_to_its_rank(engine):
    server, thread, url = _router("sglang", [engine.url], 4, rule="prefix", n=6)
    first = [{"role": "user", "content": f"conversation {c} " * 40} for c in range(3)]
    ranks = [post(url + "/v1/chat/completions", {"messages": [m]})[1]["X-Routed-DP-Rank"] for m in first]
    again = [
        post(url + "/v1/chat/completions", {"messages": [m, {"role": "assistant", "content": "ok"}]})[1][
            "X-Routed-DP-Rank"
        ]
        for m in first
    ]
    thread.join(timeout=10)
    server.server_close()
    assert again == ranks


def test_bad_requests_get_an_error_answer_and_the_router_keeps_serving(engine):
    server, thread, url = _router("sglang", [engine.url], 2, n=1)
    req = urllib.request.Request(
        url + "/generate", data=b"{not json", headers={"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    assert err.value.code == 400
    assert post(url + "/generate", [1, 2])[0] == 400  # not an object: refused, not counted
    status, _, body = post(url + "/generate", {"text": "fine"})
    thread.join(timeout=10)
    server.server_close()
    assert status == 200 and engine.seen[0][2]["routed_dp_rank"] == 0


def test_the_router_refuses_affinity_and_bad_upstreams():
    with pytest.raises(ValueError, match="expert signature"):
        serve("sglang", ["http://127.0.0.1:1"], 2, "affinity")
    with pytest.raises(ValueError, match="one per rank"):
        serve("sglang", ["http://127.0.0.1:1"] * 3, 2, "round-robin")
    with pytest.raises(ValueError, match="http"):
        serve("sglang", ["ftp://x"], 2, "round-robin")


def test_an_unreachable_engine_is_a_502_not_a_crash():
    server, thread, url = _router("sglang", ["http://127.0.0.1:9"], 1, n=1)
    status, _, body = post(url + "/generate", {"text": "x"})
    thread.join(timeout=10)
    server.server_close()
    assert status == 502 and "unreachable" in body["error"]


def test_prefix_chain_reads_messages_ids_and_text():
    chat = prefix_chain(
        {"messages": [{"role": "user", "content": "a" * 40}, {"role": "assistant", "content": "b"}]}
    )
    assert len(chat) == 2 and chat[0][1] >= 10
    assert prefix_chain({"messages": [{"role": "user", "content": "a" * 40}]})[0] == chat[0]
    ids = prefix_chain({"input_ids": list(range(130))})
    assert [n for _, n in ids] == [64, 64, 2]
    assert prefix_chain({"max_tokens": 3}) == []


def test_route_serve_command_end_to_end(engine):
    """``moe-placement route --serve``: started as a process, two requests through it, then it exits 0."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [
        sys.executable,
        "-m",
        "moe_placement",
        "route",
        "--serve",
        "--engine",
        "sglang",
        "--upstream",
        engine.url,
    ]
    cmd += ["--ep-size", "2", "--policies", "round-robin", "--port", str(port), "--max-requests", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert "listening on http://127.0.0.1:" in line, proc.stderr.read()
        for i in range(2):
            assert post(f"http://127.0.0.1:{port}/generate", {"text": str(i)})[0] == 200
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert sorted(b["routed_dp_rank"] for _, _, b in engine.seen) == [0, 1]


def _engines_site_packages():
    """The side environment's site-packages (the engines' own code), or skip."""
    from pathlib import Path

    given = os.environ.get("MOE_ENGINES_PYTHON")
    python = (
        Path(given) if given else Path(__file__).resolve().parents[1] / ".engines-venv" / "bin" / "python"
    )
    if not python.exists():
        pytest.skip(
            "no engines environment: set MOE_ENGINES_PYTHON to a Python with vLLM's and SGLang's code"
        )
    out = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return Path(out.stdout.strip())


def test_the_fields_and_headers_are_the_ones_the_engines_code_reads():
    """Read from the pinned engines' source: SGLang's body key and header, vLLM's header and no body key."""
    import re

    sp = _engines_site_packages()
    for engine, dist in (("sglang", "sglang"), ("vllm", "vllm")):
        assert (sp / f"{dist}-{ENGINE_PINS[engine].version}.dist-info").is_dir()
    sgl = sp / "sglang" / "srt"
    io_struct = (sgl / "managers" / "io_struct.py").read_text()
    gen = io_struct[io_struct.index("class GenerateReqInput") :][:20000]
    assert re.search(r"\n\s+routed_dp_rank: Optional\[int\]", gen)
    protocol = (sgl / "entrypoints" / "openai" / "protocol.py").read_text()
    fields = protocol[protocol.index("class PDRoutingFields") :][:2000]
    assert "routed_dp_rank" in fields and "class ChatCompletionRequest(PDRoutingFields" in protocol
    base = (sgl / "entrypoints" / "openai" / "serving_base.py").read_text()
    assert f'headers.get("{ENGINE_PINS["sglang"].header.lower()}")' in base
    vbase = (sp / "vllm" / "entrypoints" / "generate" / "base" / "serving.py").read_text()
    assert f'headers.get("{ENGINE_PINS["vllm"].header}")' in vbase
    protocols = (sp / "vllm" / "entrypoints").rglob("protocol.py")
    assert not any("data_parallel_rank" in p.read_text() for p in protocols)  # no body key in vLLM
