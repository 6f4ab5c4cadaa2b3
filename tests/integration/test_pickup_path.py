"""The pickup path with one thread hop fewer: NOTIFYs are read on the claim thread itself.

``Listener.wait`` is the claim loop's sleep: one ``poll`` on the LISTEN
socket and the claim loop's ``Wakeup``. Its LISTEN connection is opened on a
helper thread and handed over; the waiting thread pings it without blocking
and replaces it when it breaks or stops answering (a stopped backend stands
in for a half-open peer).
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid

import psycopg

from awa_fast.runtime.listener import Listener, ListenerConfig, Wakeup
from awa_fast.storage import Storage
from tests.fixtures.waiting import wait_for


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
