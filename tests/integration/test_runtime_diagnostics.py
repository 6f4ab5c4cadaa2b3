"""What a claimer tells an operator when something is wrong, without burying the rest of the log.

- A flush listener that always raises is logged with its traceback once a
  minute, the failures between counted, however many flushes there are.
- ``kill -USR1`` of a supervisor's child writes every thread's stack to the
  log, and a child the supervisor SIGKILLs for not draining in time leaves
  its stacks there first: the next hang is diagnosed from the log alone.
"""

from __future__ import annotations

import logging
import os
import threading

import pytest

from awa_fast.client import Client
from awa_fast.jobs import JobSpec
from awa_fast.runtime import claimer as claimer_mod
from awa_fast.runtime.claimer import Claimer, ClaimerConfig
from awa_fast.runtime.supervisor import STACKS_SIGNAL
from tests.fixtures.supervisor import SupervisorProc
from tests.fixtures.waiting import wait_for
from tests.integration.runtime_helpers import QUEUE, RunLog, enqueue_bulk

pytestmark = pytest.mark.integration


def _run_flushes(pg_dsn: str, schema: str, flushes: int) -> int:
    """A claimer with a listener that always raises, driven through ``flushes`` separate flushes.

    Returns how many times the listener was called. One job is enqueued at a
    time and awaited, so every job is its own flush.
    """
    calls = 0

    def broken(closed: list[object]) -> None:
        nonlocal calls
        calls += 1
        raise RuntimeError("broken listener, on purpose")

    cfg = ClaimerConfig(pg_dsn, schema, "fl", concurrency=2, poll_interval=0.05)
    claimer = Claimer(cfg, {"fl.work": JobSpec("fl.work", lambda job: None, "fl", 2, 3, False, None)},
                      flush_listeners=(broken,), watch_parent=False)
    t = threading.Thread(target=claimer.run, daemon=True)
    t.start()
    client = Client(pg_dsn, schema)
    try:
        for i in range(flushes):
            client.enqueue("fl.work", {"i": i}, queue="fl")
            wait_for(lambda n=i + 1: calls >= n, 20, f"flush {i + 1}")
    finally:
        client.close()
        claimer.stop()
        t.join(30)
    return calls


def _listener_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "action", None) == "flush_listener_error"]


def test_a_listener_that_always_fails_is_logged_once_a_minute(pg_dsn, schema, caplog):  # noqa: ANN001
    caplog.set_level(logging.ERROR, logger="awa_fast.claimer")
    calls = _run_flushes(pg_dsn, schema, 6)
    assert calls >= 6
    lines = _listener_lines(caplog)
    assert len(lines) == 1, [r.getMessage() for r in lines]
    assert lines[0].exc_info is not None and "broken listener, on purpose" in str(lines[0].exc_info[1])


def test_the_failures_between_are_counted_in_the_next_line(pg_dsn, schema, caplog, monkeypatch):  # noqa: ANN001
    # every failure is "a minute later" than the last one logged: each is logged, the first alone bare
    monkeypatch.setattr(claimer_mod, "LISTENER_LOG_EVERY_S", 0.0)
    caplog.set_level(logging.ERROR, logger="awa_fast.claimer")
    calls = _run_flushes(pg_dsn, schema, 3)
    lines = _listener_lines(caplog)
    assert len(lines) == calls
    assert all("times since" not in r.getMessage() for r in lines)
    # now a window that never ends: the second failure on is counted, and logged with the count
    # once the window is opened again
    caplog.clear()
    monkeypatch.setattr(claimer_mod, "LISTENER_LOG_EVERY_S", 3600.0)
    cfg = ClaimerConfig(pg_dsn, schema, "fl2", concurrency=1, listen=False)
    claimer = Claimer(cfg, {}, watch_parent=False)

    def fail_once() -> None:
        try:
            raise RuntimeError("x")
        except RuntimeError:
            claimer._listener_failed(0, fail_once)  # noqa: SLF001 - the except-block logger

    for _ in range(4):
        fail_once()
    monkeypatch.setattr(claimer_mod, "LISTENER_LOG_EVERY_S", 0.0)
    fail_once()
    msgs = [r.getMessage() for r in _listener_lines(caplog)]
    assert len(msgs) == 2 and "times since" not in msgs[0] and "(and 3 times since the last one logged)" in msgs[1]


def test_stacks_signal_writes_every_thread_of_a_claimer_to_the_log(pg_dsn, schema, tmp_path):  # noqa: ANN001
    with SupervisorProc(pg_dsn, schema, tmp_path, queues=[f"{QUEUE}:stripes=1,concurrency=4"]) as sup:
        pids = sup.wait_running(1)
        pid = pids[(QUEUE, 0)]
        # a claimer publishes "running" just before its claim thread enters the claim loop: a dump
        # taken in between shows no claim loop, so signal again (every dump is harmless) until one does
        wait_for(lambda: os.kill(pid, STACKS_SIGNAL) or "_claim_loop" in sup.output(), 10,
                 "the claimer's stacks in the log", interval=0.25)
        out = sup.output()
        # the claim thread and its helper threads, by the functions they run
        assert "(most recent call first)" in out
        for frame in ("_claim_loop", "claimer_main"):
            assert frame in out, frame
        assert sup.proc.poll() is None and pid in sup.children(), "the signal must not end the claimer"
        assert sup.stop() == 0, sup.tail()


def test_a_child_killed_for_not_draining_leaves_its_stacks(pg_dsn, schema, tmp_path):  # noqa: ANN001
    # a claimer whose claim thread is blocked (on a lock a handler holds): its drain never ends, so
    # the supervisor SIGKILLs it once the drain timeout and its margin have passed
    runlog = RunLog(tmp_path / "runlog")
    with SupervisorProc(pg_dsn, schema, tmp_path, runlog=runlog, queues=[f"{QUEUE}:stripes=1,concurrency=2"],
                        drain_timeout=1.0) as sup:
        sup.wait_running(1)
        enqueue_bulk(pg_dsn, schema, "rt.wedge", [{"s": 120}])
        wait_for(lambda: runlog.entries("start"), 20, "the wedging job started", on_timeout=sup.tail)
        code = sup.stop(30)
        out = sup.output()
    assert code == 1, out[-3000:]
    _, sep, after = out.partition("claimer q#0 did not drain within the timeout; its threads' stacks follow; SIGKILL")
    assert sep, out[-3000:]
    assert "(most recent call first)" in after, after[:3000]
    # the handler holding the lock, and the claim thread waiting for it (in its claim loop or its
    # drain, whichever needed the lock first)
    assert "in wedge_claimer" in after and "in claimer_main" in after, after[:3000]
    assert "claimer q#0 exited with code -9" in after
