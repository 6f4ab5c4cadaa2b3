"""``awa-fast bench --payload-bytes`` and ``--rss-every`` (used by ``perf/scaling.py``) work end to end.

Tiny runs, no timing asserted: the JSON must record the settings, every job
must be done, and every claimer must have positive RSS samples.
"""

from __future__ import annotations

import pytest

from awa_fast.bench import RssSampler
from awa_fast.cli import main
from tests.integration.bench_helpers import run_bench

pytestmark = pytest.mark.integration

SMALL = ["--jobs", "200", "--seconds", "1.5", "--rate", "50", "--stripes", "1", "--concurrency", "8",
         "--batch", "64"]


def _run(capsys: pytest.CaptureFixture[str], pg_dsn: str, scenario: str, *extra: str) -> dict:
    return run_bench(capsys, pg_dsn, scenario, *SMALL, *extra)


def test_drain_default_records_no_padding(capsys, pg_dsn):
    data = _run(capsys, pg_dsn, "drain")
    assert data["settings"]["payload_bytes"] is None and data["settings"]["rss_every"] == 0
    assert "args_bytes" not in data and "claimer_rss_kb" not in data
    assert data["completed"] == 200


def test_drain_with_payload_bytes(capsys, pg_dsn):
    data = _run(capsys, pg_dsn, "drain", "--payload-bytes", "4096")
    assert data["settings"]["payload_bytes"] == 4096
    assert data["jobs"] == 200 and data["completed"] == 200
    assert 4000 <= data["args_bytes"] <= 4096
    assert data["supervisor_exit"] == 0


def test_bulk_enqueue_with_payload_bytes(capsys, pg_dsn):
    data = _run(capsys, pg_dsn, "bulk-enqueue", "--payload-bytes", "1000")
    assert data["settings"]["payload_bytes"] == 1000
    assert data["jobs"] == 200 and 950 <= data["args_bytes"] <= 1000


def test_latency_samples_every_claimer_rss(capsys, pg_dsn):
    data = _run(capsys, pg_dsn, "latency", "--rss-every", "0.25", "--stripes", "2")
    assert data["settings"]["rss_every"] == 0.25
    assert data["untraced"] == 0
    rss = data["claimer_rss_kb"]
    per = rss["per_claimer"]
    assert len(per) == 2  # one per stripe
    assert sorted(c["claimer"] for c in per.values()) == ["bench#0", "bench#1"]
    assert len(rss["samples"]) >= 4
    times = [t for t, _ in rss["samples"]]
    assert times == sorted(times) and times[0] >= 0
    for _, by_pid in rss["samples"]:
        assert set(by_pid) == set(per)
        assert all(kb > 0 for kb in by_pid.values())
    for c in per.values():
        assert 0 < c["min"] <= c["first"] <= c["max"] and c["min"] <= c["last"] <= c["max"]
        assert c["growth"] == c["last"] - c["quarter"]


@pytest.mark.parametrize(("scenario", "flag", "value"), [
    ("latency", "--payload-bytes", "100"),
    ("drain", "--rss-every", "1"),
    ("drain", "--payload-bytes", str(2 << 20)),
])
def test_refuses_a_setting_the_scenario_does_not_use(capsys, pg_dsn, scenario, flag, value):
    code = main(["bench", scenario, "--dsn", pg_dsn, "--schema", "bench_t_refused", "--jobs", "10", flag, value])
    assert code == 2
    assert flag in capsys.readouterr().err


def test_rss_growth_counts_from_a_quarter_of_the_run():
    sampler = RssSampler(sup=None, every=1.0)  # type: ignore[arg-type]  # summary() reads no supervisor
    sampler.claimers = {"7": "q#0"}
    sampler.samples = [(float(t), {"7": kb}) for t, kb in enumerate([100, 500, 520, 520, 530, 540, 540, 540, 550])]
    c = sampler.summary()["per_claimer"]["7"]
    assert (c["first"], c["quarter"], c["last"], c["max"]) == (100, 520, 550, 550)
    assert c["quarter_t"] == 2.0 and c["growth"] == 30 and c["slope_kb_per_min"] > 0
