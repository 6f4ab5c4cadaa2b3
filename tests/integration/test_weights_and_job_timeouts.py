"""Weighted concurrency (``@app.job(..., weight=N)``) and per-job timeouts (``enqueue(..., timeout=)``).

Real claimers (the in-process worker: the same Claimer, executor and batcher
``awa-fast supervise`` runs) against the session's PostgreSQL. Handlers
record how many weight units run at once; a handler waits on an event that
is set only when the expected number run together, so a limit that did not
hold would show as a higher peak, and one that held too tightly as a
worker that never reaches the expected overlap.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import psycopg
import pytest

from awa_fast.app import App
from awa_fast.errors import ConfigError, OutOfRange
from awa_fast.jobs import TIMEOUT_KEY

pytestmark = pytest.mark.integration

Q = "wq"


class Meter:
    """Weight units running now, the peak, and an event set once ``target`` units ran together."""

    def __init__(self, target: int) -> None:
        self.lock = threading.Lock()
        self.now = 0
        self.peak = 0
        self.target = target
        self.reached = threading.Event()
        self.order: list[str] = []

    def enter(self, w: int, kind: str) -> None:
        with self.lock:
            self.now += w
            self.peak = max(self.peak, self.now)
            self.order.append(kind)
            if self.now >= self.target:
                self.reached.set()

    def leave(self, w: int) -> None:
        with self.lock:
            self.now -= w


def test_weight_is_validated() -> None:
    app = App(schema="awa_fast_unused")
    for bad in (0, -1, 4097):
        with pytest.raises(OutOfRange):
            app.job(f"k{bad}", weight=bad)
    for bad in (1.5, "2", True):
        with pytest.raises(ConfigError):
            app.job("kbad", weight=bad)  # type: ignore[arg-type]
    app.job("heavy", weight=4)(lambda job: None)
    app.job("light")(lambda job: None)
    assert app.registry["heavy"].weight == 4 and app.registry["light"].weight == 1


def test_weight_above_concurrency_is_refused_at_start(pg_dsn: str, schema: str) -> None:
    app = App(pg_dsn, schema)
    app.job("big", queue=Q, weight=8)(lambda job: None)
    with pytest.raises(ConfigError, match=r"weight=8 .* concurrency is 4"):
        app.run_worker({Q: {"concurrency": 4}}, until_empty=True, install_signal_handlers=False,
                       maintenance=False)
    app.close()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_weight_4_jobs_on_8_slots_run_two_at_a_time(pg_dsn: str, schema: str, mode: str) -> None:
    app = App(pg_dsn, schema)
    meter = Meter(target=8)

    if mode == "sync":
        @app.job("heavy", queue=Q, weight=4)
        def heavy(job: Any) -> None:
            meter.enter(4, "heavy")
            try:
                meter.reached.wait(10)  # two together fill the 8 slots; a third never joins them
            finally:
                meter.leave(4)
    else:
        @app.job("heavy", queue=Q, weight=4)
        async def aheavy(job: Any) -> None:
            meter.enter(4, "heavy")
            try:
                deadline = time.monotonic() + 10
                while not meter.reached.is_set() and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
            finally:
                meter.leave(4)

    app.enqueue_many("heavy", [{"i": i} for i in range(8)])
    summary = app.run_worker({Q: {"concurrency": 8}}, until_empty=True, install_signal_handlers=False,
                             maintenance=False)
    assert summary.completed == 8 and summary.clean
    assert meter.reached.is_set() and meter.peak == 8, meter.peak
    app.close()


def test_mixed_weights_never_exceed_concurrency_and_light_jobs_are_not_starved(pg_dsn: str, schema: str) -> None:
    app = App(pg_dsn, schema)
    meter = Meter(target=8)
    gate = threading.Event()

    @app.job("heavy", queue=Q, weight=4)
    def heavy(job: Any) -> None:
        meter.enter(4, "heavy")
        try:
            gate.wait(0.05)
        finally:
            meter.leave(4)

    @app.job("light", queue=Q)
    def light(job: Any) -> None:
        meter.enter(1, "light")
        try:
            gate.wait(0.01)
        finally:
            meter.leave(1)

    # one claim's worth of heavy jobs first, then light ones behind them
    app.enqueue_many("heavy", [{"i": i} for i in range(12)])
    app.enqueue_many("light", [{"i": i} for i in range(60)])
    summary = app.run_worker({Q: {"concurrency": 8}}, until_empty=True, install_signal_handlers=False,
                             maintenance=False)
    assert summary.completed == 72 and summary.clean
    assert meter.peak <= 8, meter.peak
    # first come, first served: light jobs start while heavy ones are still queued (not all 12 heavy first)
    first_light = meter.order.index("light")
    assert first_light < 12 + 8, meter.order[:30]
    assert meter.order.count("heavy") == 12
    app.close()


def test_enqueue_timeout_is_validated_before_anything_is_written(pg_dsn: str, schema: str) -> None:
    app = App(pg_dsn, schema)
    app.job("k", queue=Q)(lambda job: None)
    for bad in (0, -1, float("nan"), "3"):
        with pytest.raises(OutOfRange):
            app.enqueue("k", {}, timeout=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="metadata"):
        app.enqueue("k", {}, metadata=[1, 2], timeout=1.0)
    assert app.list_jobs(queue=Q) == []
    job_id = app.enqueue("k", {}, metadata={"trace": "x"}, timeout=2.5)
    with psycopg.connect(pg_dsn) as c:
        meta = c.execute(f'SELECT metadata FROM "{schema}".ready_entries WHERE job_id = %s', (job_id,)).fetchone()
    assert meta is not None and meta[0] == {"trace": "x", TIMEOUT_KEY: 2.5}
    app.close()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_enqueue_timeout_closes_the_attempt_as_retry(pg_dsn: str, schema: str, mode: str) -> None:
    app = App(pg_dsn, schema)
    seen: dict[str, Any] = {}
    done = threading.Event()

    if mode == "sync":
        @app.job("slow", queue=Q)  # no kind timeout: the job's own applies
        def slow(job: Any) -> None:
            if job.args.get("quick"):
                return
            t0 = time.monotonic()
            while not job.is_cancelled() and time.monotonic() - t0 < 20:
                time.sleep(0.01)
            seen["cancelled"] = job.is_cancelled()
            done.set()
    else:
        @app.job("slow", queue=Q, timeout=60)  # the job's timeout overrides the kind's
        async def aslow(job: Any) -> None:
            if job.args.get("quick"):
                return
            try:
                await asyncio.sleep(20)
            except asyncio.CancelledError:
                seen["cancelled"] = True
                done.set()
                raise

    timed = app.enqueue("slow", {}, timeout=0.5)
    plain = app.enqueue("slow", {"quick": True})
    t0 = time.monotonic()
    summary = app.run_worker({Q: {"concurrency": 2}}, until_empty=True, install_signal_handlers=False,
                             maintenance=False)
    assert done.wait(10) and seen["cancelled"] is True
    info = app.get_job(timed)
    assert info is not None and info.state == "retryable" and info.attempt == 1, info
    assert info.errors[-1]["error"] == "timed out after 0.5 s", info.errors
    assert time.monotonic() - t0 < 15
    other = app.get_job(plain)
    assert other is not None and other.state == "completed"
    assert summary.completed == 1
    app.close()


def test_a_deep_backlog_is_claimed_in_growing_claims_by_default(pg_dsn: str, schema: str) -> None:
    """Without ``batch=``, claims grow while they come back full: 20,000 no-op jobs at
    concurrency 16 take a few dozen claims, not the 1,250 a fixed claim of 16 would."""
    app = App(pg_dsn, schema)
    app.job("noop", queue=Q)(lambda job: None)
    n = 20_000
    app.enqueue_many("noop", ({"i": i} for i in range(n)))
    summary = app.run_worker({Q: {"concurrency": 16}}, until_empty=True, install_signal_handlers=False,
                             maintenance=False)
    assert summary.completed == n
    assert summary.claim_calls <= n // 200, summary
    app.enqueue_many("noop", ({"i": i} for i in range(2_000)))
    fixed = app.run_worker({Q: {"concurrency": 16, "batch": 16}}, until_empty=True, install_signal_handlers=False,
                           maintenance=False)
    assert fixed.completed == 2_000 and fixed.claim_calls >= 2_000 // 16, fixed
    app.close()
