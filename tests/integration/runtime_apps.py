"""Test apps for the runtime tests: ``awa-fast supervise tests.integration.runtime_apps:app``.

Every handler appends one JSON line per run to ``$AWA_TEST_RUNLOG/<pid>.log``
(when that variable is set) *before* it returns its outcome, so the test can
see what each process ran: job id, run_lease, attempt, kind, pid, plus
whatever the handler wants to tell (a callback token, a callback result).
A write is one ``os.write`` on an ``O_APPEND`` descriptor: lines never
interleave and survive a ``kill -9`` right after.

The App's own schema is a placeholder: the tests always pass ``--schema``.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Any

import orjson

import awa_fast
from awa_fast.app import App

QUEUE = "q"

_fd_lock = threading.Lock()
_fd: tuple[int, int] | None = None  # (pid, fd): re-opened after a fork


def _log_fd() -> int | None:
    global _fd
    directory = os.environ.get("AWA_TEST_RUNLOG")
    if not directory:
        return None
    pid = os.getpid()
    cur = _fd
    if cur is not None and cur[0] == pid:
        return cur[1]
    with _fd_lock:
        if _fd is None or _fd[0] != pid:
            fd = os.open(os.path.join(directory, f"{pid}.log"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            _fd = (pid, fd)
        return _fd[1]


def record(job: Any, event: str = "run", **extra: Any) -> None:
    """Append one line about this run of ``job`` to the run log."""
    fd = _log_fd()
    if fd is None:
        return
    line = {"ev": event, "job": job.id, "lease": job.run_lease, "attempt": job.attempt, "kind": job.kind,
            "pid": os.getpid(), "t": time.time(), **extra}
    os.write(fd, orjson.dumps(line) + b"\n")


app = App(schema="awa_fast_rt_placeholder", default_queue=QUEUE)


@app.on_flush
def record_flush(closed: list[awa_fast.AttemptClosed]) -> None:
    """Log every attempt a completion flush wrote (``ev: flush``), with its outcome and times."""
    fd = _log_fd()
    if fd is None:
        return
    os.write(fd, b"".join(orjson.dumps({
        "ev": "flush", "job": c.job_id, "lease": c.run_lease, "kind": c.kind, "outcome": c.outcome,
        "started_at": c.started_at, "committed_at": c.committed_at, "pid": os.getpid(), "t": c.committed_at,
    }) + b"\n" for c in closed))


@app.on_flush
def broken_listener(closed: list[awa_fast.AttemptClosed]) -> None:
    """A listener that always raises: the queue must not notice."""
    raise RuntimeError("this flush listener is broken on purpose")


@app.job("rt.sync", queue=QUEUE)
def sync_noop(job: Any) -> None:
    record(job)


@app.job("rt.async", queue=QUEUE)
async def async_noop(job: Any) -> None:
    record(job)


@app.job("rt.wedge", queue=QUEUE)
def wedge_claimer(job: Any) -> None:
    """Wedges its claimer on purpose: holds the claim loop's counter lock for ``args["s"]`` seconds.

    The claim thread then blocks on its next count, never drains, and the
    supervisor has to SIGKILL the process (the diagnostics tests).
    """
    record(job, "start")
    with job._runtime._stats_lock:  # noqa: SLF001 - reaching into the claimer is the point
        time.sleep(float(job.args.get("s", 60)))


@app.job("rt.sleep", queue=QUEUE)
def sync_sleep(job: Any) -> None:
    """Sleeps ``args["ms"]`` (default 5) milliseconds; logs start and end.

    With ``args["until"]`` (a path) it first waits, at most 60 s, for that file to exist: the test
    that creates it decides when the handler goes on, whatever the machine's speed.
    """
    record(job, "start")
    gate = job.args.get("until")
    deadline = time.monotonic() + 60.0
    while gate and not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.01)  # another process creates the file: nothing here to wait on but its appearance
    time.sleep(float(job.args.get("ms", 5)) / 1000.0)
    record(job)


@app.job("rt.async_sleep", queue=QUEUE)
async def async_sleep(job: Any) -> None:
    record(job, "start")
    await asyncio.sleep(float(job.args.get("ms", 5)) / 1000.0)
    record(job)


@app.job("rt.retry3", queue=QUEUE)
def retry_until_third(job: Any) -> Any:
    """RetryAfter (consumes the attempt) until attempt 3, then completes."""
    record(job)
    if job.attempt < 3:
        return awa_fast.RetryAfter(0.01, f"not yet (attempt {job.attempt})")
    return None


@app.job("rt.snooze", queue=QUEUE)
def snooze_twice(job: Any) -> Any:
    """Snooze (gives the attempt back) until the third claim, then completes."""
    record(job)
    if job.run_lease < 3:
        return awa_fast.Snooze(0.01)
    return None


@app.job("rt.cancel", queue=QUEUE)
def cancel_me(job: Any) -> Any:
    record(job)
    return awa_fast.Cancel("handler says no")


@app.job("rt.terminal", queue=QUEUE)
def terminal(job: Any) -> None:
    record(job)
    raise awa_fast.TerminalError("bad input, never retry")


@app.job("rt.fail", queue=QUEUE)
def always_fail(job: Any) -> None:
    record(job)
    raise ValueError(f"boom on attempt {job.attempt}")


@app.job("rt.callback", queue=QUEUE)
def callback(job: Any) -> Any:
    """Park for a callback unless resumed (``job.callback_result``) or past ``args["park_attempts"]``."""
    result = job.callback_result
    if result is not None:
        record(job, "resumed", result=result)
        return None
    if job.attempt > int(job.args.get("park_attempts", 1)):
        record(job, "done")
        return None
    token = job.register_callback(float(job.args.get("timeout", 120)))
    record(job, "parked", token=token)
    return awa_fast.WaitForCallback(float(job.args.get("timeout", 120)))


# An app with async handlers only: no sync worker threads in its claimers.
async_only_app = App(schema="awa_fast_rt_placeholder", default_queue=QUEUE)


@async_only_app.job("rt.async", queue=QUEUE)
async def async_only_noop(job: Any) -> None:
    record(job)
