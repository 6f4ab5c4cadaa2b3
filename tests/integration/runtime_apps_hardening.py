"""Apps for tests/integration/test_runtime_hardening.py (``awa-fast supervise <this module>:app``).

Handlers that raise every kind of ``BaseException``, set bad progress, wait
to be told that their attempt was rescued or cancelled, or break the
claimer's own threads. They log through :func:`runtime_apps.record` (one
JSON line per event under ``$AWA_TEST_RUNLOG``), so the test sees what each
process ran.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import awa_fast
from awa_fast.app import App
from tests.integration.runtime_apps import QUEUE, record

CANCEL_QUEUE = "qc"  # no deadline: cancel requests only


class HandlerBaseError(BaseException):
    """A BaseException subclass of the user's own (not an Exception)."""


def _exception(name: str) -> BaseException:
    return {
        "exit0": SystemExit(0),
        "exit3": SystemExit(3),
        "kbd": KeyboardInterrupt(),
        "custom": HandlerBaseError("custom base"),
        "cancelled": asyncio.CancelledError(),
        "genexit": GeneratorExit(),
    }[name]


app = App(schema="awa_fast_rt_placeholder", default_queue=QUEUE)


@app.on_flush
def record_flush(closed: list[awa_fast.AttemptClosed]) -> None:
    for c in closed:
        record(_Closed(c), "flush", outcome=c.outcome)


class _Closed:
    """What record() needs of a job, from an AttemptClosed."""

    def __init__(self, c: awa_fast.AttemptClosed) -> None:
        self.id, self.run_lease, self.kind, self.attempt = c.job_id, c.run_lease, c.kind, 0


# -- item 1: BaseException from a handler ---------------------------------------------


@app.job("hx.raise", queue=QUEUE)
def sync_raise(job: Any) -> None:
    record(job, "raise", exc=job.args["exc"])
    raise _exception(job.args["exc"])


@app.job("hx.araise", queue=QUEUE)
async def async_raise(job: Any) -> None:
    record(job, "raise", exc=job.args["exc"])
    if job.args["exc"] == "selfcancel":
        # The task is cancelled (not a CancelledError raised by the handler itself).
        asyncio.current_task().cancel()  # type: ignore[union-attr]
        await asyncio.sleep(30)
    await asyncio.sleep(0)
    raise _exception(job.args["exc"])


@app.job("hx.ok", queue=QUEUE)
def sync_ok(job: Any) -> None:
    time.sleep(float(job.args.get("ms", 0)) / 1000.0)
    record(job)


@app.job("hx.aok", queue=QUEUE)
async def async_ok(job: Any) -> None:
    await asyncio.sleep(float(job.args.get("ms", 0)) / 1000.0)
    record(job)


# -- item 1: a worker or loop thread that dies anyway ---------------------------------


@app.job("hx.kill_worker", queue=QUEUE)
def kill_worker(job: Any) -> None:
    """Attempt 1 breaks the worker thread itself: the executor's error_text raises SystemExit once."""
    if job.attempt >= 2:
        record(job)
        return
    from awa_fast.runtime import executor

    real = executor.error_text

    def broken(exc: Any) -> str:
        executor.error_text = real
        raise SystemExit("error_text broke (test)")

    executor.error_text = broken
    record(job, "start")
    raise ValueError("fails, and formatting the failure kills the worker")


@app.job("hx.stop_loop", queue=QUEUE)
async def stop_loop(job: Any) -> None:
    """Attempt 1 stops the claimer's event loop under everyone's feet."""
    if job.attempt >= 2:
        record(job)
        return
    record(job, "start")
    asyncio.get_running_loop().stop()
    await asyncio.sleep(30)


# -- item 2: progress -------------------------------------------------------------------


def _bad_value(name: str) -> Any:
    return {"nul": {"text": "a\x00b"}, "complex": {"z": 1j}, "big": {"blob": "x" * (5 * 1024 * 1024)}}[name]


@app.job("hx.bad_progress", queue=QUEUE)
def bad_progress(job: Any) -> None:
    record(job, "start")
    job.set_progress({"step": 1})
    try:
        job.set_progress(_bad_value(job.args["bad"]))
    except awa_fast.PayloadError as exc:
        record(job, "progress_rejected", error=str(exc))
    except Exception as exc:  # noqa: BLE001 - any other error is what the test must see
        record(job, "progress_error", error=f"{type(exc).__name__}: {exc}")
    else:
        record(job, "progress_accepted")
    time.sleep(float(job.args.get("ms", 1500)) / 1000.0)  # the bad value would ride on heartbeats meanwhile
    record(job)


@app.job("hx.innocent", queue=QUEUE)
def innocent(job: Any) -> None:
    """A long job that reports progress: must run once and complete."""
    record(job, "start")
    end = time.monotonic() + float(job.args.get("ms", 5000)) / 1000.0
    step = 0
    while time.monotonic() < end:
        step += 1
        job.set_progress({"step": step})
        time.sleep(0.2)
    record(job)


# -- item 3: telling a rescued or cancelled handler ---------------------------------------


@app.job("hx.sync_told", queue=QUEUE)
def sync_told(job: Any) -> Any:
    """Waits to be told (job.is_cancelled()); then lingers ``linger_ms``, abandoned, and returns."""
    if job.attempt >= 2:
        record(job)
        return None
    record(job, "start")
    end = time.monotonic() + 20.0
    while not job.is_cancelled() and time.monotonic() < end:
        time.sleep(0.02)
    record(job, "told" if job.is_cancelled() else "never_told", abandoned=job.is_abandoned())
    time.sleep(float(job.args.get("linger_ms", 0)) / 1000.0)
    record(job, "returned")
    return awa_fast.Cancel("stopping as told") if job.args.get("cancel") else None


@app.job("hx.async_told", queue=QUEUE)
async def async_told(job: Any) -> None:
    """Sleeps 20 s unless its task is cancelled (rescued, or a cancel request)."""
    if job.attempt >= 2:
        record(job)
        return
    record(job, "start")
    try:
        await asyncio.sleep(20.0)
    except asyncio.CancelledError:
        record(job, "task_cancelled", cancelled=job.is_cancelled())
        raise
    record(job, "never_told")


@app.job("hx.sync_cancel", queue=CANCEL_QUEUE)
def sync_cancel(job: Any) -> Any:
    return sync_told(job)


@app.job("hx.async_cancel", queue=CANCEL_QUEUE)
async def async_cancel(job: Any) -> None:
    await async_told(job)


# -- item 12: a kind the workers learn later -------------------------------------------------


old_app = App(schema="awa_fast_rt_placeholder", default_queue=QUEUE)  # the workers before the deploy


@old_app.job("hx.ok", queue=QUEUE)
def old_ok(job: Any) -> None:
    record(job)


new_app = App(schema="awa_fast_rt_placeholder", default_queue=QUEUE)  # after: they know hx.new_kind


@new_app.job("hx.new_kind", queue=QUEUE)
def new_kind(job: Any) -> None:
    record(job)
