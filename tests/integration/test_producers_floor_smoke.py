"""``perf/producers_floor.py`` (the 10-producer scenario's floor) still runs: every arm once, tiny.

No timing is asserted. Two producer processes per arm for half a second on
the test server; the JSON must hold each arm's counts, the producers' and
their backends' CPU from ``/proc``, and the rows the arms wrote must be in
the database (the plain table's and the queue's).
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import uuid

import psycopg
import pytest

pytestmark = pytest.mark.integration

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO / "perf" / "producers_floor.py"


def test_every_arm_runs_and_reports_its_counts(pg_dsn):
    schema = f"bench_pf_{uuid.uuid4().hex[:8]}"
    out = subprocess.run([sys.executable, str(SCRIPT), "--dsn", pg_dsn, "--schema", schema, "--processes", "2",
                          "--seconds", "0.5", "--arms", "plain,v2,v3,app", "--json"],
                         capture_output=True, text=True, timeout=300, cwd=REPO, check=False)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    runs = {r["arm"]: r for r in doc["runs"]}
    assert set(runs) == {"plain", "v2", "v3", "app"}
    for r in runs.values():
        assert r["processes"] == 2 and len(r["per_producer"]) == 2
        assert all(n > 0 for n in r["per_producer"]) and r["calls"] == sum(r["per_producer"])
        assert r["client_cpu_us_per_call"] > 0 and r["backend_cpu_us_per_call"] >= 0
        assert r["box_capacity_cpu_s"] > 0 and sum(r["backend_states"].values()) == pytest.approx(1.0, abs=0.01)
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        plain = c.execute(f'SELECT count(*) FROM "{schema}_floor".commits').fetchone()[0]  # type: ignore[index]
        queued = c.execute(f'SELECT count(*) FROM "{schema}".ready_entries').fetchone()[0]  # type: ignore[index]
        c.execute(f'DROP SCHEMA "{schema}_floor" CASCADE')
        c.execute(f'DROP SCHEMA "{schema}" CASCADE')
    # every call inside the window, plus the warm-up calls before it (50 per producer)
    assert plain == runs["plain"]["calls"] + 2 * 50
    assert queued == runs["v2"]["calls"] + runs["v3"]["calls"] + runs["app"]["calls"] + 3 * 2 * 50


def test_refuses_a_schema_outside_the_bench_prefix(pg_dsn):
    out = subprocess.run([sys.executable, str(SCRIPT), "--dsn", pg_dsn, "--schema", "awa_fast", "--arms", "plain"],
                         capture_output=True, text=True, timeout=60, cwd=REPO, check=False)
    assert out.returncode == 2
    assert "--schema must start with 'bench'" in out.stderr
