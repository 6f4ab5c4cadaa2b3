"""``perf/quiet_calls.py`` (the quiet queue's claim and completion calls, arm by arm) still runs.

No timing is asserted: a few jobs on the test server, every arm of both calls
must report its calls, and the jobs of the arms that complete must be completed.
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
SCRIPT = REPO / "perf" / "quiet_calls.py"


def test_every_arm_reports_its_calls(pg_dsn):
    schema = f"bench_qc_{uuid.uuid4().hex[:8]}"
    jobs = 200  # every arm gets more calls than the warm-up drops
    out = subprocess.run([sys.executable, str(SCRIPT), "--dsn", pg_dsn, "--schema", schema, "--jobs", str(jobs),
                          "--json"], capture_output=True, text=True, timeout=300, cwd=REPO, check=False)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert set(doc["calls"]) == {"complete", "claim"}
    assert set(doc["calls"]["claim"]) == {"cursor", "direct", "reused", "libpq"}
    assert set(doc["calls"]["complete"]) == {"lists", "literals", "libpq", "empty"}
    for arms in doc["calls"].values():
        for r in arms.values():
            assert r["n"] > 0 and r["wall_p50_ms"] > 0 and r["client_cpu_us"] > 0
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        done = c.execute(f'SELECT count(*) FROM "{schema}".done_entries WHERE state = 1').fetchone()[0]
        c.execute(f'DROP SCHEMA "{schema}" CASCADE')
    libpq = ("cursor", "direct", "reused", "libpq").index("libpq")  # the claim arms take turns, job by job
    assert done == jobs - len(range(libpq, jobs, 4))  # every job but those the undecoded libpq claim took
