"""The in-process worker (awa_fast/worker.py): run_worker, run_worker_async, stop_worker, until_empty."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading

import psycopg
import pytest

import awa_fast
from awa_fast.app import App
from awa_fast.runtime.maintenance import Maintenance, MaintenanceConfig
from awa_fast.storage import Storage
from awa_fast.worker import queue_specs
from tests.fixtures.waiting import wait_for
from tests.integration.runtime_helpers import REPO_ROOT, counts
from tests.integration.worker_apps import build


def _expected(n: int) -> dict[str, int]:
    retried = sum(1 for i in range(n) if i % 100 == 0)
    cancelled = sum(1 for i in range(n) if i % 100 != 0 and i % 250 == 1)
    failed = sum(1 for i in range(n) if i % 100 != 0 and i % 250 != 1 and i % 500 == 2)
    return {"retried": retried, "cancelled": cancelled, "failed": failed,
            "completed": n - retried - cancelled - failed}


def test_until_empty_drains_10000_jobs_and_counts_every_outcome(pg_dsn, schema, storage, conn, monkeypatch):
    checks = []
    real_check = Storage.queue_work_exists

    def counted(self, c, queues):  # noqa: ANN001, ANN202
        checks.append(queues)
        return real_check(self, c, queues)

    monkeypatch.setattr(Storage, "queue_work_exists", counted)
    app = build(pg_dsn, schema)
    n = 10_000
    app.enqueue_many("mixed", ({"i": i} for i in range(n)))
    app.enqueue_many("mixed_async", ({"i": i} for i in range(50)))
    later = app.enqueue("mixed", {"i": 7}, delay=3600)  # scheduled for later: does not keep the worker busy
    summary = app.run_worker({"w": {"concurrency": 16, "stripes": 2}}, until_empty=True,
                             install_signal_handlers=False)
    want = _expected(n)
    assert summary.empty and summary.clean
    assert (summary.completed, summary.retried, summary.failed, summary.cancelled) == (
        want["completed"] + 50, want["retried"], want["failed"], want["cancelled"])
    assert summary.stale == 0 and summary.claimed == n + 50
    c = counts(storage, conn, "w")
    assert c.get("available", 0) == 0 and c.get("running", 0) == 0
    assert c["completed"] == want["completed"] + 50 and c["retryable"] == want["retried"]
    assert c["scheduled"] == 1 and storage.job_load(conn, later)["state"] == "scheduled"
    # the database is asked only once the claims came back short with nothing outstanding: not per batch
    assert 1 <= len(checks) <= 10 + 2 * summary.seconds and checks[-1] == ["w"], (len(checks), summary.seconds)
    app.close()


def test_a_schema_not_migrated_is_reported_before_anything_starts(pg_dsn):
    app = build(pg_dsn, "t_never_migrated")
    with pytest.raises(awa_fast.SchemaNotMigrated, match="awa-fast migrate"):
        app.run_worker(["w"], install_signal_handlers=False)
    with pytest.raises(awa_fast.SchemaNotMigrated):
        asyncio.run(app.run_worker_async(["w"]))
    assert app.stop_worker() == 0
    assert not [t for t in threading.enumerate() if t.name.startswith(("awa-claimer", "awa-worker"))]


def test_until_empty_returns_at_once_on_an_empty_queue_and_after_a_rolled_back_enqueue(pg_dsn, schema):
    app = build(pg_dsn, schema)
    with psycopg.connect(pg_dsn) as tx:  # one connection: the same lane, a gap at its tail
        app.enqueue("mixed", {"i": 3}, conn=tx)
        tx.commit()
        app.enqueue("mixed", {"i": 4}, conn=tx)
        tx.rollback()
    summary = app.run_worker(["w"], until_empty=True, install_signal_handlers=False, maintenance=False)
    assert summary.empty and summary.completed == 1 and summary.claimed == 1
    summary = app.run_worker(["w"], until_empty=True, install_signal_handlers=False, maintenance=False)
    assert summary.empty and summary.claimed == 0
    app.close()


def test_stop_worker_from_another_thread_drains_the_running_job(pg_dsn, schema, storage, conn, tmp_path):
    app = build(pg_dsn, schema, tmp_path)
    first = app.enqueue("hold", {})
    result: dict[str, object] = {}

    def run() -> None:
        result["summary"] = app.run_worker({"slow": {"concurrency": 1, "batch": 1}}, install_signal_handlers=False,
                                           maintenance=False)

    t = threading.Thread(target=run)
    t.start()
    wait_for(lambda: (tmp_path / f"started-{first}").exists(), what="the job to start")
    assert app.stop_worker() == 1
    app.release.set()  # the running handler finishes during the drain
    t.join(30)
    assert not t.is_alive()
    summary = result["summary"]
    assert summary.clean and not summary.empty and summary.completed == 1
    assert storage.job_load(conn, first)["state"] == "completed"
    assert app.stop_worker() == 0  # nothing running any more
    app.close()


def test_signal_handlers_need_the_main_thread(pg_dsn, schema):
    app = build(pg_dsn, schema)
    err: list[BaseException] = []

    def run() -> None:
        try:
            app.run_worker(["w"])
        except awa_fast.ConfigError as exc:
            err.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join(30)
    assert err and "install_signal_handlers=False" in str(err[0])


def test_sigterm_drains_a_worker_on_the_main_thread(pg_dsn, schema, storage, conn, tmp_path):
    app = App(pg_dsn, schema)
    job = app.enqueue("hold", {}, queue="slow")
    proc = subprocess.Popen([sys.executable, "-m", "tests.integration.worker_apps", pg_dsn, schema, str(tmp_path)],
                            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: (tmp_path / f"started-{job}").exists() or proc.poll() is not None, what="the job to start")
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["completed"] == 1 and summary["clean"] and not summary["empty"]
    assert storage.job_load(conn, job)["state"] == "completed"
    app.close()


def test_cancelling_run_worker_async_drains_cleanly(pg_dsn, schema, storage, conn):
    app = build(pg_dsn, schema)
    done = threading.Event()
    app.on_flush(lambda closed: done.set())

    async def main() -> None:
        task = asyncio.create_task(app.run_worker_async({"w": {"concurrency": 4}}))
        jid = await app_enqueue_async()
        assert await asyncio.to_thread(done.wait, 30)
        ticks = 0

        async def ticker() -> None:  # the loop stays free while the worker runs
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        tick_task = asyncio.create_task(ticker())
        await asyncio.sleep(0.05)
        tick_task.cancel()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert ticks > 10
        assert storage.job_load(conn, jid)["state"] == "completed"

    async def app_enqueue_async() -> int:
        async with await psycopg.AsyncConnection.connect(pg_dsn) as aconn:
            jid = await app.enqueue_async("mixed_async", {"i": 1}, conn=aconn)
            await aconn.commit()
        return jid

    asyncio.run(main())
    assert not [t for t in threading.enumerate() if t.name.startswith("awa-claimer")]
    app.close()


def test_in_process_maintenance_takes_part_in_the_one_leader_election(pg_dsn, schema, storage, conn):
    app = build(pg_dsn, schema)
    other = Maintenance(MaintenanceConfig(pg_dsn, schema))
    worker_thread = threading.Thread(target=lambda: app.run_worker(["w"], install_signal_handlers=False))
    worker_thread.start()
    try:
        wait_for(lambda: storage.leader_info(conn), what="a leader")
        assert not other.try_lead()  # the in-process worker holds the same advisory lock
    finally:
        app.stop_worker()
        worker_thread.join(30)
    assert wait_for(other.try_lead, what="the standby to take over")
    other.resign()
    app.close()


def test_parent_exit_does_not_drain_an_in_process_worker(pg_dsn, schema, storage, conn, tmp_path):
    """A claimer in a supervisor's child drains when its parent goes; in-process it must not."""
    app = App(pg_dsn, schema)
    first = app.enqueue("hold", {}, queue="slow")
    marker = tmp_path / f"started-{first}"
    script = (  # the parent leaves only once the worker's claimers run
        "import os, subprocess, sys, time\n"
        f"p = subprocess.Popen([sys.executable, '-m', 'tests.integration.worker_apps', {pg_dsn!r}, {schema!r}, "
        f"{str(tmp_path)!r}], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        "deadline = time.monotonic() + 30\n"
        f"while not os.path.exists({str(marker)!r}) and time.monotonic() < deadline:\n"
        "    time.sleep(0.01)\n"
        "print(p.pid, flush=True)\n"
    )
    starter = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True,
                             timeout=30)
    pid = int(starter.stdout.strip())  # its parent has exited: it was reparented
    try:
        assert marker.exists()
        second = app.enqueue("hold", {}, queue="slow")
        wait_for(lambda: storage.job_load(conn, second)["state"] == "completed", what="a job after the parent left")
        # An orphan check would have fired on the claim of the second job and drained the worker.
        third = app.enqueue("hold", {}, queue="slow")
        wait_for(lambda: storage.job_load(conn, third)["state"] == "completed", timeout=15,
                 what="a job after the orphan check had its chance")
        assert not _zombie(pid)
    finally:
        os.kill(pid, signal.SIGTERM)
        wait_for(lambda: not os.path.exists(f"/proc/{pid}") or _zombie(pid), what="the worker to exit")
    app.close()


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_queue_options_are_checked_like_supervise_queue():
    app = App("postgresql://unused", "t_unused")
    assert queue_specs(app, {"email": {"concurrency": 8}})[0].concurrency == 8
    assert [s.name for s in queue_specs(app, ["a", "b"])] == ["a", "b"]
    with pytest.raises(awa_fast.ConfigError, match="unknown option 'workers'"):
        queue_specs(app, {"email": {"workers": 8}})
    with pytest.raises(awa_fast.ConfigError, match="out of range"):
        queue_specs(app, {"email": {"concurrency": 0}})
    with pytest.raises(awa_fast.ConfigError, match="must be an int"):
        queue_specs(app, {"email": {"stripes": True}})
    with pytest.raises(awa_fast.ConfigError, match="register a handler"):
        queue_specs(app, None)
