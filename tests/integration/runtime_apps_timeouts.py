"""Apps for tests/integration/test_handler_timeouts.py (``awa-fast supervise <this module>:app``).

Kinds with a ``timeout=`` (sync and async) that outlive it on their first
attempt and finish at once on the next, a handler that fails deep in its own
call stack, and a kind with an ``args_type`` that enqueued args do not match.
Every event goes to the run log (:func:`runtime_apps.record`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec

import awa_fast
from awa_fast.app import App
from tests.integration.runtime_apps import QUEUE, record

app = App(schema="awa_fast_rt_placeholder", default_queue=QUEUE)


@app.on_flush
def record_flush(closed: list[awa_fast.AttemptClosed]) -> None:
    for c in closed:
        record(_Closed(c), "flush", outcome=c.outcome)


class _Closed:
    def __init__(self, c: awa_fast.AttemptClosed) -> None:
        self.id, self.run_lease, self.kind, self.attempt = c.job_id, c.run_lease, c.kind, 0


@app.job("to.sync", queue=QUEUE, timeout=1.0)
def sync_slow(job: Any) -> None:
    """Attempt 1 sleeps past its 1 s timeout (a thread cannot be stopped), then returns."""
    record(job, "start")
    if job.attempt == 1:
        deadline = time.monotonic() + float(job.args.get("sleep", 4.0))
        while time.monotonic() < deadline:
            time.sleep(0.05)
        record(job, "returned", cancelled=job.is_cancelled(), abandoned=job.is_abandoned())
        return None
    record(job, "returned", cancelled=job.is_cancelled(), abandoned=job.is_abandoned())
    return None


@app.job("to.async", queue=QUEUE, timeout=1.0)
async def async_slow(job: Any) -> None:
    """Attempt 1 awaits far past its 1 s timeout: its task is cancelled."""
    record(job, "start")
    if job.attempt == 1:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            record(job, "cancelled", cancelled=job.is_cancelled())
            raise
    record(job, "returned")


@app.job("to.ok", queue=QUEUE)
def sync_ok(job: Any) -> None:
    time.sleep(float(job.args.get("ms", 0)) / 1000.0)
    record(job)


@app.job("to.aok", queue=QUEUE)
async def async_ok(job: Any) -> None:
    await asyncio.sleep(float(job.args.get("ms", 0)) / 1000.0)
    record(job)


def _deep_helper_that_fails(n: int) -> None:
    if n <= 0:
        raise ValueError("broken deep inside")
    _deep_helper_that_fails(n - 1)


@app.job("to.fail", queue=QUEUE)
def sync_fail(job: Any) -> None:
    record(job)
    _deep_helper_that_fails(2)


class Order(msgspec.Struct):
    order_id: int
    amount: float


@app.job("to.typed", queue=QUEUE, args_type=Order)
def typed(job: awa_fast.Job[Order]) -> None:
    record(job, "start")
    record(job, "decoded", order_id=job.args.order_id)


@app.job("to.own_validation", queue=QUEUE, args_type=Order)
def own_validation(job: awa_fast.Job[Order]) -> None:
    """Args match; a ValidationError of the handler's own (another payload) still retries."""
    record(job, "start", order_id=job.args.order_id)
    msgspec.json.decode(b'{"order_id": "x", "amount": 1}', type=Order)
