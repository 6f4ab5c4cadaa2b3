"""The application the chaos scenarios supervise: ``tests.chaos.chaos_app:app``.

Every handler appends one line to the execution log named by
``$CHAOS_EXEC_LOG`` when an attempt starts and one when its handler
returns: ``start|end job_id run_lease attempt pid``. The line is written with
a single ``write`` on an ``O_APPEND`` descriptor, so lines of concurrent
threads and processes never interleave. The log is how a scenario knows
which process holds which attempt (to kill or freeze it) and how many times
a job really ran (stale attempts, re-execution).

Handler behaviour comes from the job args:
``{"sleep": s}`` sleeps s seconds (default 0);
``{"hold": path}`` blocks until the file ``path`` exists (a gate the test
opens once it has seen what it waits for; at most 120 s, so a test that
fails before opening it cannot hang a worker);
``{"mode": "raise_nul"}`` raises an error whose text carries NUL bytes and
a lone surrogate; ``"raise_big"`` raises with a 5 MB message;
``"terminal_nul"`` raises ``TerminalError`` with NUL bytes;
``"garbage"`` returns a value that cannot be stored as a result, and
``"garbage_int"`` an int too wide for JSON (a returned value completes the
job with it as the result, so both must close as a retry with a clear
error, here to the DLQ); ``"raise_unprintable"`` raises an
exception whose ``__str__`` itself fails.
"""

from __future__ import annotations

import asyncio
import os
import time

from awa_fast.app import App
from awa_fast.errors import TerminalError

app = App(dsn=None, schema="awa_fast", default_queue="q")

_fd: int | None = None


def _log(what: str, job) -> None:  # noqa: ANN001 - awa_fast.jobs.Job
    global _fd
    path = os.environ.get("CHAOS_EXEC_LOG")
    if not path:
        return
    if _fd is None:
        _fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(_fd, f"{what} {job.id} {job.run_lease} {job.attempt} {os.getpid()}\n".encode())


class _Unprintable(Exception):
    def __str__(self) -> str:  # pragma: no cover - exercised in a child process
        raise RuntimeError("__str__ of this exception fails")


def _behave(job):  # noqa: ANN001, ANN202
    args = job.args if isinstance(job.args, dict) else {}
    mode = args.get("mode")
    if mode == "raise_nul":
        raise ValueError("bad \x00 byte \x00 and a lone surrogate \ud800 in the error")
    if mode == "raise_big":
        raise RuntimeError("x" * (5 * 1024 * 1024))
    if mode == "terminal_nul":
        raise TerminalError("terminal \x00 with NUL")
    if mode == "raise_unprintable":
        raise _Unprintable()
    if mode == "garbage":
        return object()
    if mode == "garbage_int":
        return 2**70
    return None


@app.job("chaos.work", queue="q", max_attempts=25)
def work(job):  # noqa: ANN001, ANN201
    _log("start", job)
    try:
        args = job.args if isinstance(job.args, dict) else {}
        delay = float(args.get("sleep", 0) or 0)
        if delay:
            time.sleep(delay)
        if args.get("hold"):
            _hold(str(args["hold"]))
        return _behave(job)
    finally:
        _log("end", job)


def _hold(path: str, limit: float = 120.0) -> None:
    end = time.monotonic() + limit
    while not os.path.exists(path) and time.monotonic() < end:
        time.sleep(0.01)


@app.job("chaos.async", queue="q", max_attempts=25)
async def work_async(job):  # noqa: ANN001, ANN201
    _log("start", job)
    try:
        args = job.args if isinstance(job.args, dict) else {}
        delay = float(args.get("sleep", 0) or 0)
        if delay:
            await asyncio.sleep(delay)
        return _behave(job)
    finally:
        _log("end", job)
