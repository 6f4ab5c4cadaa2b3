"""``awa-fast bench``: a tiny run of every scenario still works end to end.

No timing is asserted (these machines are shared and noisy): each scenario
must run, print one JSON object with the documented keys, and report
positive numbers. The whole module stays well under a minute.
"""

from __future__ import annotations

import pytest

from awa_fast.cli import main
from tests.integration.bench_helpers import run_bench

pytestmark = pytest.mark.integration

KEYS = ("scenario", "jobs", "seconds", "jobs_per_s", "enqueue_jobs_per_s", "pickup_ms", "e2e_ms",
        "dead_tuples", "impl", "postgres_version", "loadavg", "settings")

SMALL = ["--jobs", "300", "--seconds", "1.5", "--rate", "50", "--producers", "2", "--stripes", "1",
         "--concurrency", "8", "--batch", "64"]


def _run(capsys: pytest.CaptureFixture[str], pg_dsn: str, scenario: str, *extra: str) -> dict:
    data = run_bench(capsys, pg_dsn, scenario, *SMALL, *extra)
    for key in KEYS:
        assert key in data, key
    assert data["scenario"] == scenario
    assert data["jobs"] > 0 and data["seconds"] > 0 and data["jobs_per_s"] > 0
    assert data["enqueue_jobs_per_s"] > 0
    assert data["dead_tuples"] >= 0
    assert data["impl"] in ("c", "python")
    assert len(data["loadavg"]) == 3
    return data


def _positive_pct(p: dict | None) -> None:
    assert p is not None
    assert set(p) == {"p50", "p95", "p99"}
    assert 0 < p["p50"] <= p["p95"] <= p["p99"]


def test_drain(capsys, pg_dsn):
    data = _run(capsys, pg_dsn, "drain")
    assert data["jobs"] == 300 and data["completed"] == 300
    assert data["pickup_ms"] is None and data["e2e_ms"] is None


def test_bulk_enqueue(capsys, pg_dsn):
    data = _run(capsys, pg_dsn, "bulk-enqueue")
    assert data["jobs"] == 300


def test_concurrent_insert(capsys, pg_dsn):
    data = _run(capsys, pg_dsn, "concurrent-insert")
    assert len(data["per_producer"]) == 2 and all(n > 0 for n in data["per_producer"])


def test_latency(capsys, pg_dsn):
    data = _run(capsys, pg_dsn, "latency")
    assert data["untraced"] == 0
    _positive_pct(data["pickup_ms"])
    _positive_pct(data["e2e_ms"])
    assert data["e2e_ms"]["p50"] >= data["pickup_ms"]["p50"]


def test_pinned_reader(capsys, pg_dsn):
    data = _run(capsys, pg_dsn, "pinned-reader")
    _positive_pct(data["e2e_ms"])
    assert data["dead_tuples_series"] and data["phases"]["pinned"]["jobs"] > 0
    assert data["dead_tuples_max_pinned"] is not None


def test_refuses_a_non_bench_schema(capsys, pg_dsn):
    code = main(["bench", "bulk-enqueue", "--dsn", pg_dsn, "--schema", "awa_fast", "--jobs", "10"])
    assert code == 2
    assert "does not start with 'bench'" in capsys.readouterr().err
