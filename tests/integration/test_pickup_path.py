"""The pickup path without thread hops: NOTIFYs read on the claim thread, fast handlers run there when idle.

``Listener.wait`` is the claim loop's sleep: one ``select`` on the LISTEN
socket and the claim loop's ``Wakeup``. Its LISTEN connection is opened on a
helper thread and handed over; the waiting thread pings it without blocking
and replaces it when it breaks or stops answering (a stopped backend stands
in for a half-open peer). An idle claimer runs the first job of a claim on
its own thread when the kind's handler has measured fast, and a kind timeout
still closes such an attempt.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from typing import Any

import psycopg

from awa_fast.app import App
from awa_fast.runtime.claimer import Claimer, ClaimerConfig
from awa_fast.runtime.executor import INLINE_MAX_S
from awa_fast.runtime.listener import Listener, ListenerConfig, Wakeup
from awa_fast.storage import Storage
from tests.fixtures.waiting import wait_for
from tests.integration.runtime_helpers import enqueue_one


def _listen_backends(conn: psycopg.Connection, queue: str) -> dict[int, str]:
    """pid -> last statement of the sessions of this queue's LISTEN connections."""
    rows = conn.execute("SELECT pid, query FROM pg_stat_activity WHERE application_name = %s",
                        (f"awa_fast:listen:{queue}",)).fetchall()
    return {int(pid): str(query) for pid, query in rows}


def _notify(conn: psycopg.Connection, storage: Storage, payload: str) -> None:
    conn.execute("SELECT pg_notify(%s, %s)", (storage.channel, payload))


def _take_over(listener: Listener, wake: Wakeup, old: int | None) -> int:
    """Wait until the claim side holds a LISTEN connection other than ``old``; then drain pending wake-ups."""
    deadline = time.monotonic() + 15.0
    while (pid := listener.backend_pid) is None or pid == old:
        assert time.monotonic() < deadline, "no new LISTEN connection was taken over"
        listener.wait(wake, 0.1)
    wake.clear()  # the helper set it at the hand-over (the claim loop clears it at the top of each round)
    while listener.wait(wake, 0.1):
        pass
    return pid


def _listener(pg_dsn: str, schema: str, io_timeout: float = 10.0) -> tuple[Listener, Wakeup, threading.Event, str]:
    queue = "lq" + uuid.uuid4().hex[:8]
    stopping = threading.Event()
    wake = Wakeup()
    listener = Listener(ListenerConfig(pg_dsn, schema, queue, io_timeout), stopping)
    listener.start(wake)
    assert listener.wait(wake, 10.0), "the first LISTEN connection is handed over (and reported once)"
    assert listener.backend_pid is not None
    wake.clear()
    return listener, wake, stopping, queue


def test_a_notify_for_the_queue_wakes_the_waiting_thread_itself(pg_dsn, schema, storage, conn):
    listener, wake, stopping, queue = _listener(pg_dsn, schema)
    try:
        assert not listener.wait(wake, 0.2)  # nothing yet: the timeout
        _notify(conn, storage, "some-other-queue")
        t0 = time.monotonic()
        assert not listener.wait(wake, 0.3), "a NOTIFY for another queue does not count"
        assert time.monotonic() - t0 >= 0.25
        _notify(conn, storage, queue)
        t0 = time.monotonic()
        assert listener.wait(wake, 10.0)
        assert time.monotonic() - t0 < 2.0
        # a wake-up from another thread ends the wait too, and is not a NOTIFY
        threading.Timer(0.05, wake.set).start()
        t0 = time.monotonic()
        assert not listener.wait(wake, 10.0)
        assert time.monotonic() - t0 < 2.0 and wake.is_set()
        wake.clear()
        assert not wake.is_set() and not wake.wait(0.0)
    finally:
        stopping.set()
        listener.close()
    wait_for(lambda: not _listen_backends(conn, queue), 10, "the LISTEN connection closed by close()")


def test_a_terminated_listen_connection_is_replaced_and_wakeups_resume(pg_dsn, schema, storage, conn):
    listener, wake, stopping, queue = _listener(pg_dsn, schema)
    try:
        [first] = _listen_backends(conn, queue)
        assert listener.backend_pid == first
        conn.execute("SELECT pg_terminate_backend(%s)", (first,))
        # the loss is reported as a possible missed wake-up, then the new connection once more
        assert listener.wait(wake, 10.0)
        second = _take_over(listener, wake, first)
        assert second in _listen_backends(conn, queue)
        _notify(conn, storage, queue)
        assert listener.wait(wake, 10.0)
    finally:
        stopping.set()
        listener.close()


def test_the_idle_listen_connection_is_pinged_and_a_silent_one_replaced_without_blocking(
        pg_dsn, schema, storage, conn):
    listener, wake, stopping, queue = _listener(pg_dsn, schema, io_timeout=1.0)
    stopped = None
    try:
        [(first, query)] = _listen_backends(conn, queue).items()
        assert query.startswith("LISTEN"), query
        t0 = time.monotonic()
        while time.monotonic() - t0 < 1.2:
            assert not listener.wait(wake, 0.1)
        # the last statement of the LISTEN backend is now the ping (an empty query), answered
        assert _listen_backends(conn, queue) == {first: ""}
        # A backend that stops answering (SIGSTOP: the socket stays open, nothing comes back) is
        # a half-open peer: no wait blocks beyond its timeout, and a new connection replaces it.
        stopped = first
        os.kill(stopped, signal.SIGSTOP)
        longest = 0.0
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            t = time.monotonic()
            listener.wait(wake, 0.1)
            longest = max(longest, time.monotonic() - t)
            if [pid for pid in _listen_backends(conn, queue) if pid != stopped]:
                break
        else:
            raise AssertionError("the silent LISTEN connection was not replaced")
        assert longest < 0.6, longest
        _take_over(listener, wake, stopped)
        _notify(conn, storage, queue)
        assert listener.wait(wake, 10.0)
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        stopping.set()
        listener.close()


# -- handlers on the claim thread ---------------------------------------------------------------

_CLAIM_THREAD = "test-claim-loop"


def _claimer_app(pg_dsn: str, schema: str, ran: list[tuple[str, int, str]]) -> App:
    app = App(dsn=pg_dsn, schema=schema)

    def record(job: Any) -> None:
        ran.append((job.kind, job.id, threading.current_thread().name))
        if (job.args or {}).get("sleep"):
            time.sleep(float(job.args["sleep"]))

    def slow(job: Any) -> None:
        record(job)
        time.sleep(0.01)

    app.job("fast", queue="pq", timeout=0.5)(record)
    app.job("slow", queue="pq")(slow)
    return app


def _run_claimer(pg_dsn: str, schema: str, app: App) -> tuple[Claimer, threading.Thread]:
    cfg = ClaimerConfig(pg_dsn, schema, "pq", concurrency=4, claim_batch=16, poll_interval=0.2,
                        heartbeat_interval=0.2, drain_timeout=5.0)
    claimer = Claimer(cfg, app.registry, watch_parent=False)
    thread = threading.Thread(target=claimer.run, name=_CLAIM_THREAD, daemon=True)
    thread.start()
    return claimer, thread


def _one_by_one(pg_dsn: str, schema: str, storage: Storage, conn: psycopg.Connection, kind: str, n: int,
                ran: list[tuple[str, int, str]], claimer: Claimer) -> list[str]:
    """Enqueue ``n`` jobs of ``kind``, each once the one before is done and released; the thread each ran on."""
    threads = []
    for _ in range(n):
        wait_for(lambda: claimer.outstanding == 0, 20, "the claimer idle")
        job_id = enqueue_one(pg_dsn, schema, kind, {}, queue="pq")
        wait_for(lambda j=job_id: (storage.job_load(conn, j) or {}).get("state") == "completed", 20,
                 f"{kind} job {job_id} completed")
        threads.append(next(t for k, j, t in ran if j == job_id))
    return threads


def test_an_idle_claimer_runs_a_measured_fast_handler_on_its_claim_thread(pg_dsn, schema, storage, conn):
    ran: list[tuple[str, int, str]] = []
    claimer, thread = _run_claimer(pg_dsn, schema, _claimer_app(pg_dsn, schema, ran))
    try:
        fast = _one_by_one(pg_dsn, schema, storage, conn, "fast", 6, ran, claimer)
        # not measured yet: a worker; once measured fast, the idle claim thread runs it itself
        assert fast[0].startswith("awa-worker-"), fast
        assert fast[2:] == [_CLAIM_THREAD] * 4, fast
        # a handler slower than the bound always goes to a worker thread
        slow = _one_by_one(pg_dsn, schema, storage, conn, "slow", 4, ran, claimer)
        assert all(t.startswith("awa-worker-") for t in slow), slow
        assert INLINE_MAX_S < 0.01
        # a kind timeout still closes an attempt whose handler runs on the claim thread
        job_id = enqueue_one(pg_dsn, schema, "fast", {"sleep": 1.5}, queue="pq", max_attempts=1)
        job = wait_for(lambda: (j := storage.job_load(conn, job_id)) and j["state"] not in ("available", "running")
                       and j, 20, "the timed-out job closed")
        assert job["state"] == "dlq", job
        [entry] = storage.dlq_list(conn, "pq")
        assert entry["job_id"] == job_id and entry["reason"].startswith("timed out after 0.5 s"), entry
        assert next(t for k, j, t in ran if j == job_id) == _CLAIM_THREAD
        # and the claimer goes on: the next fast job completes (after the sleeper returned)
        assert _one_by_one(pg_dsn, schema, storage, conn, "fast", 1, ran, claimer)
    finally:
        claimer.stop()
        thread.join(20)
    assert not thread.is_alive()
    # the sleeper's own late return was discarded (the timeout's retry had closed the attempt)
    assert claimer.stats["stale"] == 1 and claimer.batcher.dropped == 0
