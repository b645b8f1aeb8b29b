"""``benchmarks/reliability_timings.py`` with tiny flags: every row is measured and holds its bound, so
the script stays runnable and a regression of a time wall or of the signal handling fails here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEYS = {"row", "measured_s", "limit_s", "ratio", "greedy_s", "measured_over_greedy"}
TINY = [
    "--signal-after",
    "1",
    "--migration-layers",
    "1000",
    "--migration-limit",
    "0.5",
    "--locality-layers",
    "16",
    "--locality-limit",
    "0.5",
]


def test_reliability_timings_rows_hold_their_bounds(tmp_path):
    out = tmp_path / "rows.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "reliability_timings.py"), *TINY, "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {r["row"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["sigterm", "sigint", "migration-wall", "locality-budget"]
    for name, r in rows.items():
        assert KEYS <= set(r), (name, sorted(r))
        assert r["greedy_s"] > 0 and r["measured_s"] > 0, r
        assert f"| {name} |" in done.stdout  # the printed table has the row
    for name, code in (("sigterm", 143), ("sigint", 130)):
        r = rows[name]
        assert r["running_at_signal"], r  # the signal came during the search, not after it
        assert r["exit_code"] == code == r["expected_exit_code"], r
        assert r["left_files"] == [], r  # no output, no temporary file
        assert r["measured_s"] < 5.0, r  # not the 60 s limit (48.7 s before the fix)
    assert rows["migration-wall"]["cut"], rows["migration-wall"]  # the limit bound the call
    assert rows["migration-wall"]["placed_layers"] == 1000
    assert rows["locality-budget"]["placed_layers"] == 16
    for name in ("migration-wall", "locality-budget"):
        assert rows[name]["ratio"] < 3.0, rows[name]  # the wall holds (3x-10x before)
