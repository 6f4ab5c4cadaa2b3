"""Batched heartbeats and progress for held attempts, on their own thread.

Every ``interval`` seconds the heartbeat thread sends one batch covering
each attempt the claimer holds longer than the interval (claimed and not
yet durably completed) plus every attempt whose progress changed. The
answers flag cancel requests (``job.is_cancelled()``) and stale attempts.
A wake-up much later than scheduled means something held the GIL: it is
logged and counted, since it can let heartbeats lapse.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import psycopg

from awa_fast.errors import DatabaseUnavailable
from awa_fast.jobs import Job
from awa_fast.storage import RawJson, Storage, connect

log = logging.getLogger("awa_fast.heartbeat")


@dataclass(frozen=True, slots=True)
class HeartbeatConfig:
    """Heartbeat settings."""

    dsn: str = field(repr=False)  # a DSN may carry a password
    schema: str
    interval: float = 5.0
    gil_warning_s: float = 2.0
    application_name: str = "awa_fast:heartbeat"


class Heartbeat:
    """The heartbeat thread of one claimer."""

    def __init__(self, config: HeartbeatConfig, held: dict[tuple[int, int], Job],
                 claimed_at: dict[tuple[int, int], float], stateful: set[tuple[int, int]],
                 on_gil_stall: Callable[[float], None] | None = None) -> None:
        self.config = config
        self.storage = Storage(config.schema)
        self._held = held
        self._claimed_at = claimed_at
        self._stateful = stateful
        self._dirty: dict[tuple[int, int], Job] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._kick = threading.Event()
        self._on_gil_stall = on_gil_stall
        self._conn: psycopg.Connection | None = None
        self._thread = threading.Thread(target=self._run, name="awa-heartbeat", daemon=True)
        self.watchdog: Callable[[], None] | None = None  # run every tick (claimer's hang detection)
        self.sent = 0
        self.stale = 0
        self.gil_stalls = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None = 5.0) -> None:
        self._stop.set()
        self._kick.set()
        self._thread.join(timeout)
        if self._conn is not None and not self._conn.closed:
            self._conn.close()

    def progress_changed(self, job: Job) -> None:
        """Mark a job's progress for the next heartbeat batch."""
        with self._lock:
            self._dirty[(job.id, job.run_lease)] = job

    def run_once(self) -> int:
        """Send one heartbeat batch now; returns how many attempts it covered."""
        now = time.monotonic()
        due: dict[tuple[int, int], Job] = {}
        for key, started in list(self._claimed_at.items()):
            if now - started >= self.config.interval:
                job = self._held.get(key)
                if job is not None and not job.lease_backed:
                    due[key] = job
        with self._lock:
            dirty, self._dirty = self._dirty, {}
        due.update(dirty)
        if not due:
            return 0
        jobs = list(due.values())
        progress = []
        import orjson

        for job in jobs:
            p = job._progress  # noqa: SLF001 - the runtime owns this field
            progress.append(RawJson(orjson.dumps(p)) if p is not None else None)
        try:
            if self._conn is None or self._conn.closed:
                self._conn = connect(self.config.dsn, application_name=self.config.application_name)
            results = self.storage.attempt_heartbeat(self._conn, [j.snapshot for j in jobs], progress)
        except (psycopg.Error, DatabaseUnavailable) as exc:
            log.warning("heartbeat of %d attempts failed: %s", len(jobs), exc, extra={"action": "heartbeat_error"})
            if self._conn is not None:
                self._conn.close()
                self._conn = None
            with self._lock:
                for key, job in dirty.items():
                    self._dirty.setdefault(key, job)
            return 0
        by_key = {(j.id, j.run_lease): j for j in jobs}
        for r in results:  # results come back in lock order, not input order
            key = (r.job_id, r.run_lease)
            job = by_key[key]
            if r.status == "stale":
                self.stale += 1
            else:
                self._stateful.add(key)
                if r.status == "cancel":
                    job._cancelled = True  # noqa: SLF001
        self.sent += len(jobs)
        log.debug("heartbeat covered %d attempts", len(jobs), extra={"action": "heartbeat"})
        return len(jobs)

    def _run(self) -> None:
        interval = max(self.config.interval / 2, 0.05)
        while not self._stop.is_set():
            planned = time.monotonic() + interval
            self._kick.wait(interval)
            self._kick.clear()
            late = time.monotonic() - planned
            if late > self.config.gil_warning_s:
                self.gil_stalls += 1
                log.warning("heartbeat thread woke %.1fs late: a handler may be holding the GIL",
                            late, extra={"action": "gil_stall"})
                if self._on_gil_stall is not None:
                    self._on_gil_stall(late)
            if self._stop.is_set():
                break
            if self.watchdog is not None:
                self.watchdog()
            self.run_once()
