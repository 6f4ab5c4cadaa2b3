"""``supervise --metrics`` and ``awa-fast health`` against real supervisors.

The scrape's counters must add up to the jobs the database completed and
the histograms' counts to the latency samples; every metric the Grafana
dashboard queries must exist in a real scrape; health must turn unhealthy
within one heartbeat timeout after a claimer is stopped and after the
database goes away.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import socket
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("prometheus_client", reason="the [metrics] extra is not installed")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from awa_fast.embedded import private_server  # noqa: E402
from awa_fast.storage.migrate import RingSizes, migrate  # noqa: E402
from tests.fixtures.database import connect  # noqa: E402
from tests.fixtures.supervisor import SupervisorProc, pid_alive  # noqa: E402
from tests.fixtures.waiting import wait_for  # noqa: E402
from tests.integration.runtime_helpers import QUEUE, RunLog, cli, counts, enqueue_bulk, enqueue_one  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[2]
DEFAULT_HEARTBEAT_TIMEOUT_S = 30.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:  # noqa: S310 - loopback
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:
        return 0, ""


def _families(text: str) -> dict[str, list]:
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def _total(fams: dict[str, list], name: str, suffix: str = "") -> float:
    return sum(s.value for s in fams.get(name, []) if s.name == name + suffix)


def test_a_scrape_during_a_drain_adds_up_and_serves_every_dashboard_metric(pg_dsn, schema, storage, tmp_path):
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    bulk = 3000
    delayed = 20  # scheduled a moment ahead: the maintenance leader promotes each of them
    n = bulk + delayed
    with SupervisorProc(pg_dsn, schema, tmp_path, extra=["--metrics", f"127.0.0.1:{port}"]) as sup, \
            connect(pg_dsn, schema) as conn:
        sup.wait_running()
        wait_for(lambda: _get(base + "/healthz")[0] == 200, 30, "the metrics address", on_timeout=sup.tail)
        for _ in range(delayed):
            enqueue_one(pg_dsn, schema, "rt.sync", delay=1.0)
        enqueue_bulk(pg_dsn, schema, "rt.sleep", [{"ms": 1}] * bulk)
        status, during = _get(base + "/metrics")  # while work flows
        assert status == 200 and "awa_fast_jobs_completed_total" in during
        wait_for(lambda: counts(storage, conn).get("completed", 0) == n, 120, "the drain", on_timeout=sup.tail)
        # claimers publish after each flush, the maintenance leader at the end of each pass (its
        # promotions can trail the claimers that already ran the promoted jobs): the scrape catches
        # up with the database
        fams = wait_for(lambda: (lambda f: f if _total(f, "awa_fast_jobs_completed", "_total") == n
                                 and _total(f, "awa_fast_promotions", "_total") == delayed else None)(
            _families(_get(base + "/metrics")[1])), 30,
            "the completed and promoted counters to reach the database's counts")
        assert _total(fams, "awa_fast_jobs_claimed", "_total") == n
        assert _total(fams, "awa_fast_jobs_stale", "_total") == 0
        # one pickup and one end-to-end sample per completed job, on every claimer together
        assert _total(fams, "awa_fast_pickup_latency_seconds", "_count") == n
        assert _total(fams, "awa_fast_end_to_end_latency_seconds", "_count") == n
        inf = [s for s in fams["awa_fast_pickup_latency_seconds"] if s.name.endswith("_bucket")
               and s.labels["le"] == "+Inf"]
        assert sum(s.value for s in inf) == n
        # one handler-duration sample per job run; flushes wrote every outcome; claim calls returned every job
        assert _total(fams, "awa_fast_handler_duration_seconds", "_count") == n
        assert _total(fams, "awa_fast_completion_flush_jobs", "_sum") == n
        flushes = _total(fams, "awa_fast_completion_flushes", "_total")
        assert flushes > 0
        assert _total(fams, "awa_fast_completion_flush_jobs", "_count") == flushes
        assert _total(fams, "awa_fast_completion_flush_duration_seconds", "_count") == flushes
        calls = _total(fams, "awa_fast_claim_calls", "_total")
        assert _total(fams, "awa_fast_claim_batch_jobs", "_sum") == n
        assert _total(fams, "awa_fast_claim_batch_jobs", "_count") == calls == \
            _total(fams, "awa_fast_claim_duration_seconds", "_count")
        size_le = {s.labels["le"] for s in fams["awa_fast_claim_batch_jobs"] if s.name.endswith("_bucket")}
        assert {"0.0", "1.0", "2.0", "4.0", "8192.0", "+Inf"} <= size_le  # the shm size buckets, not re-sampled
        assert _total(fams, "awa_fast_heartbeat_failures", "_total") == 0
        assert _total(fams, "awa_fast_promotions", "_total") == delayed
        rescues = {s.labels["kind"]: s.value for s in fams["awa_fast_rescues"] if s.name.endswith("_total")}
        assert rescues == {"receipt": 0.0, "lease": 0.0}
        prunes = [s for s in fams["awa_fast_prunes"] if s.name.endswith("_total")]
        assert {s.labels["ring"] for s in prunes} == {"claim", "ready", "lease"} and sum(s.value for s in prunes) > 0
        assert _total(fams, "awa_fast_maintenance_leader") == 1
        assert {s.labels["stripe"] for s in fams["awa_fast_claimer_up"]} == {"0", "1"}

        # every metric a Grafana panel queries exists in this scrape
        board = json.loads((REPO / "docs/grafana/awa-fast.json").read_text())
        wanted = set()
        for panel in board["panels"]:
            for target in panel["targets"]:
                wanted |= set(re.findall(r"awa_fast_[a-z_]+", target["expr"]))
        exported = set()
        for name, samples in fams.items():
            exported |= {s.name for s in samples} | {name}
        missing = sorted(m for m in wanted if m not in exported)
        assert not missing, f"dashboard metrics missing from a real scrape: {missing}"

        status, body = _get(base + "/readyz")
        assert status == 200 and json.loads(body)["healthy"] is True, body
        assert _get(base + "/nope")[0] == 404
        assert sup.stop() == 0, sup.tail()


def test_heartbeat_failures_and_rescues_reach_the_scrape(pg_dsn, schema, storage, conn, tmp_path):
    storage.queue_configure(conn, QUEUE, heartbeat_timeout=2.0)
    runlog = RunLog(tmp_path / "runlog")
    port = _free_port()
    base = f"http://127.0.0.1:{port}"

    def scrape() -> dict[str, list]:
        return _families(_get(base + "/metrics")[1])

    with SupervisorProc(pg_dsn, schema, tmp_path, runlog=runlog, queues=[f"{QUEUE}:stripes=1,concurrency=2"],
                        extra=["--metrics", f"127.0.0.1:{port}"]) as sup:
        victim = sup.wait_running(1)[(QUEUE, 0)]
        wait_for(lambda: _get(base + "/healthz")[0] == 200, 30, "the metrics address", on_timeout=sup.tail)
        # A job held past the heartbeat interval: its heartbeat connection is cut under it.
        first = enqueue_bulk(pg_dsn, schema, "rt.sleep", [{"ms": 3000}])[0]
        wait_for(lambda: any(e["job"] == first for e in runlog.entries("start")), 30, "the first job to start")

        def cut_heartbeat() -> bool:
            rows = conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                "WHERE application_name LIKE 'awa_fast:heartbeat:%'").fetchall()
            return bool(rows) and all(r[0] for r in rows)
        wait_for(cut_heartbeat, 10, "a heartbeat connection to cut")
        wait_for(lambda: _total(scrape(), "awa_fast_heartbeat_failures", "_total") >= 1, 20,
                 "the heartbeat failure in the scrape", on_timeout=sup.tail)
        wait_for(lambda: counts(storage, conn).get("completed", 0) == 1, 30, "the first job to complete")
        # A claimer killed while it runs a job: the leader rescues its receipt after the heartbeat timeout.
        second = enqueue_bulk(pg_dsn, schema, "rt.sleep", [{"ms": 4000}])[0]
        wait_for(lambda: any(e["job"] == second for e in runlog.entries("start")), 30, "the second job to start")
        assert _total(scrape(), "awa_fast_rescues", "_total") == 0
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: not pid_alive(victim), 10, "the claimer to die")
        fams = wait_for(lambda: (lambda f: f if _total(f, "awa_fast_rescues", "_total") >= 1 else None)(scrape()),
                        30, "the rescue in the scrape", on_timeout=sup.tail)
        rescues = {s.labels["kind"]: s.value for s in fams["awa_fast_rescues"] if s.name.endswith("_total")}
        assert rescues == {"receipt": 1.0, "lease": 0.0}
        wait_for(lambda: counts(storage, conn).get("completed", 0) == 2, 60, "the rescued job to complete",
                 on_timeout=sup.tail)
        # the restarted claimer continues the record: the failure counted before the kill is still there
        assert _total(scrape(), "awa_fast_heartbeat_failures", "_total") >= 1
        assert sup.stop() == 0, sup.tail()


def _health(dsn: str, schema: str, home: pathlib.Path, *extra: str) -> tuple[int, dict]:
    res = cli("health", "--json", "--dsn", dsn, "--schema", schema, "--home", str(home), *extra)
    try:
        report = json.loads(res.stdout)
    except json.JSONDecodeError:
        report = {"stdout": res.stdout, "stderr": res.stderr}
    return res.returncode, report


def test_health_fails_within_a_heartbeat_timeout_of_a_stopped_claimer(pg_dsn, schema, tmp_path):
    home = tmp_path / "home"
    with SupervisorProc(pg_dsn, schema, tmp_path, home=home) as sup:
        pids = sup.wait_running()
        wait_for(lambda: _health(pg_dsn, schema, home, "--require-local")[0] == 0, 30, "a healthy start",
                 on_timeout=lambda: str(_health(pg_dsn, schema, home)[1]))
        victim = next(iter(pids.values()))
        os.kill(victim, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            code, report = wait_for(
                lambda: (lambda r: r if r[0] != 0 else None)(_health(pg_dsn, schema, home, "--stale-after", "3")),
                DEFAULT_HEARTBEAT_TIMEOUT_S, "health to fail")
            assert time.monotonic() - stopped < DEFAULT_HEARTBEAT_TIMEOUT_S
            assert code == 1 and not report["checks"]["claimers"]["ok"]
            assert f"pid {victim}" in report["checks"]["claimers"]["detail"]
        finally:
            os.kill(victim, signal.SIGCONT)
        wait_for(lambda: _health(pg_dsn, schema, home, "--stale-after", "3")[0] == 0, 30, "health to recover")
        assert sup.stop() == 0, sup.tail()
    # no supervisor left: no leader either
    code, report = _health(pg_dsn, schema, home)
    assert code == 1 and report["checks"]["leader"]["ok"] is False


def test_health_fails_when_the_database_stops(tmp_path):
    home = tmp_path / "home"
    with private_server(tmp_path / "pg") as cluster:
        migrate(cluster.dsn, "awa_fast", RingSizes(4, 4, 4))
        with SupervisorProc(cluster.dsn, "awa_fast", tmp_path, home=home) as sup:
            sup.wait_running()
            wait_for(lambda: _health(cluster.dsn, "awa_fast", home)[0] == 0, 30, "a healthy start",
                     on_timeout=lambda: str(_health(cluster.dsn, "awa_fast", home)[1]))
            cluster.stop("immediate")
            stopped = time.monotonic()
            code, report = _health(cluster.dsn, "awa_fast", home)
            assert code == 1 and report["checks"]["database"]["ok"] is False, report
            assert time.monotonic() - stopped < DEFAULT_HEARTBEAT_TIMEOUT_S
            sup.close()
