"""Issue 36: an engine map and its sidecar are written as a pair and read only as a pair.

The sidecar records the map's SHA-256; the reader refuses a sidecar of another write. Real
subprocesses are killed (SIGTERM, SIGKILL) while a write is under way, and two writers race.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from moe_placement.base.fileio import InputFileError, atomic_write_files, clean_stale_temps
from moe_placement.cli.main import main
from placement.formats import read_placement, sidecar_path, write_placement
from placement.model import Placement
from placement.topology import Topology

ROOT = Path(__file__).resolve().parents[1]


def _placement(G: int) -> Placement:
    """8 experts on ``G`` GPUs (8 slots), one layer; the map differs with ``G``."""
    return Placement(
        np.roll(np.arange(8), G)[None], 8, Topology(ep_size=G, num_physical_experts=8, num_nodes=1)
    )


def _temps(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.endswith(".tmp"))


def test_sidecar_of_another_write_is_refused_naming_both(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    write_placement(_placement(8), a, "sglang")
    write_placement(_placement(4), b, "sglang")
    assert read_placement(a).topology.ep_size == 8
    a.write_bytes(b.read_bytes() + b"\n")  # the map of another write next to a's sidecar
    with pytest.raises(InputFileError, match=r"a\.json\.meta\.json describes another version of a\.json"):
        read_placement(a)
    os.replace(b, a)  # the other write's map, its bytes exactly
    with pytest.raises(InputFileError, match="file_sha256"):
        read_placement(a)


def test_sidecar_without_a_digest_is_read_as_before(tmp_path):
    import json

    a = tmp_path / "a.json"
    write_placement(_placement(8), a, "sglang")
    side = json.loads(sidecar_path(a).read_text())
    del side["file_sha256"]
    sidecar_path(a).write_text(json.dumps(side))
    assert read_placement(a).topology.ep_size == 8


def test_evaluate_refuses_a_mixed_pair_in_one_line(tmp_path, capsys):
    from profiling.readers import write_trace
    from profiling.synthetic import synthetic_trace

    write_trace(
        synthetic_trace(num_tokens=200, num_layers=1, num_logical_experts=8, top_k=2), tmp_path / "t.npz"
    )
    x, y = tmp_path / "x.json", tmp_path / "y.json"
    write_placement(_placement(8), x, "sglang")
    write_placement(_placement(4), y, "sglang")
    os.replace(y, x)  # killed between the two renames: the map of one run, the sidecar of the other
    assert main(["evaluate", str(x), str(tmp_path / "t.npz")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "describes another version" in err


_SLOW_WRITER = """
import sys, time
sys.path.insert(0, {root!r})
import moe_placement.base.fileio as f
real = f._publish
def slow(pairs):
    print("temps written", flush=True)
    time.sleep(60)
    real(pairs)
f._publish = slow
from moe_placement.cli.main import main
sys.exit(main(["solve", "--trace", {trace!r}, "--ep-size", "4", "--format", "sglang", "-o", {out!r}]))
"""


@pytest.fixture()
def old_pair(tmp_path):
    from profiling.readers import write_trace
    from profiling.synthetic import synthetic_trace

    write_trace(
        synthetic_trace(num_tokens=200, num_layers=1, num_logical_experts=8, top_k=2), tmp_path / "t.npz"
    )
    out = tmp_path / "m.json"
    write_placement(_placement(8), out, "sglang")
    return out, out.read_bytes(), sidecar_path(out).read_bytes()


def _start_slow_writer(out: Path) -> subprocess.Popen:
    code = _SLOW_WRITER.format(root=str(ROOT), trace=str(out.parent / "t.npz"), out=str(out))
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    line = proc.stdout.readline()
    assert line.strip() == "temps written", (line, proc.stderr.read() if proc.poll() is not None else "")
    assert len(_temps(out.parent)) == 2  # the map's and the sidecar's temporary files
    return proc


def test_sigterm_mid_write_leaves_the_old_pair_and_no_temporary_file(old_pair):
    out, old_map, old_side = old_pair
    proc = _start_slow_writer(out)
    try:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = proc.stderr.read()
    assert rc == 143, err
    assert [line for line in err.splitlines() if line.strip()] == [
        "moe-placement: terminated (SIGTERM); nothing half-written is left"
    ]
    assert _temps(out.parent) == []
    assert out.read_bytes() == old_map and sidecar_path(out).read_bytes() == old_side


def test_sigkill_leftovers_are_cleaned_by_the_next_write(old_pair):
    out, old_map, old_side = old_pair
    proc = _start_slow_writer(out)
    proc.kill()
    proc.wait(timeout=30)
    left = _temps(out.parent)
    assert len(left) == 2 and all(name.startswith(f".{out.name}.") for name in left)
    assert out.read_bytes() == old_map and sidecar_path(out).read_bytes() == old_side
    host = left[0].split(".")[-3].rsplit("-", 1)[0]  # .m.json.<host>-<pid>.XXXX.tmp
    keep = [f".{out.name}.otherhost-1.x.tmp", f".{out.name}.{host}-{os.getpid()}.y.tmp"]  # not stale
    for name in keep:
        (out.parent / name).write_text("another host's writer, or a live one")
    write_placement(_placement(4), out, "sglang")  # the next write removes the dead writer's files
    assert read_placement(out).topology.ep_size == 4
    assert _temps(out.parent) == sorted(keep)
    assert clean_stale_temps(out) == []


_RACER = """
import sys
sys.path.insert(0, {root!r})
import numpy as np
from placement.formats import write_placement
from placement.model import Placement
from placement.topology import Topology
pl = Placement(np.roll(np.arange(8), {G})[None], 8, Topology(ep_size={G}, num_physical_experts=8, num_nodes=1))
for _ in range(40):
    write_placement(pl, {out!r}, "sglang")
"""


def test_two_writers_at_once_leave_a_pair_of_one_of_them(tmp_path):
    out = tmp_path / "m.json"
    procs = [
        subprocess.Popen([sys.executable, "-c", _RACER.format(root=str(ROOT), G=G, out=str(out))])
        for G in (8, 4)
    ]
    seen = set()
    deadline = time.monotonic() + 60
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        try:
            pl = read_placement(out)  # never a mixed pair read as valid
            assert np.array_equal(pl.physical_to_logical_map[0], np.roll(np.arange(8), pl.topology.ep_size))
            seen.add(pl.topology.ep_size)
        except InputFileError as exc:  # between renames of one writer: refused, never misread
            assert "describes another version" in str(exc) or "no such file" in str(exc)
        time.sleep(0.005)
    assert [p.wait(timeout=60) for p in procs] == [0, 0]
    assert read_placement(out).topology.ep_size in (8, 4)
    assert seen <= {8, 4} and _temps(tmp_path) == []


def test_atomic_write_files_writes_nothing_when_one_folder_is_missing(tmp_path):
    a = tmp_path / "a.txt"
    a.write_text("old")
    with pytest.raises(InputFileError, match="does not exist"):
        atomic_write_files([(a, b"new"), (tmp_path / "nodir" / "b.txt", b"new")])
    assert a.read_text() == "old" and _temps(tmp_path) == []


@pytest.mark.parametrize(
    "make, fragment",
    [
        (lambda side: side.mkdir(), "is a folder"),
        (lambda side: os.mkfifo(side), "is a FIFO"),
        (lambda side: os.symlink(side.parent / "gone.json", side), "no such file"),
        (lambda side: side.write_text('{"schema": "x"}'), "not a placement sidecar"),
    ],
)
def test_a_sidecar_that_is_no_file_is_named_not_taken_for_none(tmp_path, make, fragment):
    a = tmp_path / "a.json"
    write_placement(_placement(8), a, "sglang")
    sidecar_path(a).unlink()
    make(sidecar_path(a))
    with pytest.raises(InputFileError, match=fragment):
        read_placement(a, ep_size=8)


def test_a_digest_that_is_not_a_sha256_is_refused(tmp_path):
    import json

    a = tmp_path / "a.json"
    write_placement(_placement(8), a, "sglang")
    side = json.loads(sidecar_path(a).read_text())
    sidecar_path(a).write_text(json.dumps({**side, "file_sha256": 5}))
    with pytest.raises(InputFileError, match="'file_sha256' must be 64 hex digits, got 5"):
        read_placement(a)
