"""Batched heartbeats and progress for held attempts, on their own thread.

Every ``interval`` seconds the heartbeat thread sends one batch covering
each attempt the claimer holds longer than the interval (claimed and not
yet durably completed) plus every attempt whose progress changed. The
answers flag cancel requests and stale attempts (rescued or closed
elsewhere): both turn ``job.is_cancelled()`` True, and the claimer is told
(``on_lost``/``on_cancel``) so it can cancel an async handler's task.
A wake-up much later than scheduled means something held the GIL: it is
logged and counted (``gil_stalls``), since it can let heartbeats lapse.
Which attempts are held, and since when, is read from the claimer's
:class:`~awa_fast.runtime.attempts.AttemptTable`; this thread runs nothing
but heartbeats (hung I/O is the watchdog's).

One bad entry never stops the batch: progress is encoded inside the guard,
a batch that fails with a data error (not a lost connection) is sent again
without progress and each progress value is then tried alone, so only the
value the database refuses is dropped (logged once). An attempt that ended
leaves the dirty set; nothing about it is sent again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
import psycopg

from awa_fast.errors import DatabaseUnavailable
from awa_fast.jobs import Job
from awa_fast.runtime.attempts import AttemptTable, Key
from awa_fast.storage import AttemptResult, RawJson, Storage, close_quietly, connect

log = logging.getLogger("awa_fast.heartbeat")


@dataclass(frozen=True, slots=True)
class HeartbeatConfig:
    """Heartbeat settings."""

    dsn: str = field(repr=False)  # a DSN may carry a password
    schema: str
    interval: float = 5.0
    gil_warning_s: float = 2.0
    application_name: str = "awa_fast:heartbeat"


class _BatchFailed(Exception):
    """The batch could not be sent (connection lost, or refused as a whole): it is retried next tick."""


class Heartbeat:
    """The heartbeat thread of one claimer."""

    def __init__(self, config: HeartbeatConfig, attempts: AttemptTable, *,
                 on_lost: Callable[[list[Job[Any]]], None] | None = None,
                 on_cancel: Callable[[list[Job[Any]]], None] | None = None,
                 on_death: Callable[[BaseException], None] | None = None) -> None:
        self.config = config
        self.storage = Storage(config.schema)
        self._attempts = attempts
        self._dirty: dict[Key, Job[Any]] = {}
        self._lock = threading.Lock()  # guards _dirty (handler threads add, this thread takes)
        self._stop = threading.Event()
        self._kick = threading.Event()
        self._conn: psycopg.Connection | None = None
        self._thread = threading.Thread(target=self._run, name="awa-heartbeat", daemon=True)
        # Told once per attempt, from this thread: attempts found stale, attempts with a cancel request.
        self.on_lost = on_lost
        self.on_cancel = on_cancel
        # Called if this thread dies anyway (a bug): the claimer must not run on without heartbeats.
        self.on_death = on_death
        self.dropped_progress = 0
        # Stale answers not yet acted on: key -> (job, when). Our own completion, committed
        # while this batch ran, also reads stale; it leaves the table within milliseconds, so
        # an attempt still held one tick later was really rescued or closed elsewhere.
        self._suspect: dict[Key, tuple[Job[Any], float]] = {}
        self.sent = 0
        self.stale = 0
        self.gil_stalls = 0
        self.failures = 0  # heartbeat batches that failed (written by the heartbeat thread only)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None = 5.0) -> None:
        self._stop.set()
        self._kick.set()
        if self._thread.ident is not None:  # started (tests may drive run_once alone)
            self._thread.join(timeout)
        if self._conn is not None and not self._conn.closed:
            self._conn.close()

    def progress_changed(self, job: Job[Any]) -> None:
        """Mark a job's progress for the next heartbeat batch."""
        with self._lock:
            self._dirty[(job.id, job.run_lease)] = job

    def run_once(self) -> int:
        """Send one heartbeat batch now; returns how many attempts it covered."""
        now = time.monotonic()
        if self._suspect:
            self._confirm_lost(now)
        due = self._attempts.due(now, self.config.interval)
        with self._lock:
            dirty, self._dirty = self._dirty, {}
        held = self._attempts.held_among(dirty) if dirty else set()
        for key, job in dirty.items():
            if key in held and key not in self._suspect and not job.is_abandoned():  # ended: leaves the dirty set
                due[key] = job
        if not due:
            return 0
        jobs = list(due.values())
        progress = [self._encoded(job) for job in jobs]
        try:
            try:
                results = self._send(jobs, progress)
            except psycopg.Error as exc:
                if self._connection_lost(exc):
                    raise _BatchFailed(str(exc)) from exc
                results = self._send_around_bad_progress(jobs, progress, exc)
        except (_BatchFailed, DatabaseUnavailable) as exc:
            self.failures += 1
            log.warning("heartbeat of %d attempts failed: %s", len(jobs), exc, extra={"action": "heartbeat_error"})
            close_quietly(self._conn)
            self._conn = None
            held = self._attempts.held_among(dirty) if dirty else set()
            with self._lock:
                for key, job in dirty.items():
                    if key in held:
                        self._dirty.setdefault(key, job)
            return 0
        self._apply(results, jobs)
        self.sent += len(jobs)
        log.debug("heartbeat covered %d attempts", len(jobs), extra={"action": "heartbeat"})
        return len(jobs)

    def _confirm_lost(self, now: float) -> None:
        """Stale attempts still held a tick later were rescued or closed elsewhere: tell them."""
        grace = min(self.config.interval / 4, 0.5)
        lost: list[Job[Any]] = []
        held = self._attempts.held_among(self._suspect)
        for key, (job, seen) in list(self._suspect.items()):
            if key not in held:
                del self._suspect[key]  # completed here and flushed: nothing to tell
            elif now - seen >= grace:
                del self._suspect[key]
                job._stale = True  # noqa: SLF001
                job._cancelled = True  # noqa: SLF001
                lost.append(job)
        if lost and self.on_lost is not None:
            self.on_lost(lost)

    def _encoded(self, job: Job[Any]) -> RawJson | None:
        """The job's progress as JSON bytes (``set_progress`` encodes it already); None if unusable."""
        p = job._progress  # noqa: SLF001 - the runtime owns this field
        if p is None or type(p) is RawJson:
            return p
        try:
            return RawJson(orjson.dumps(p))
        except Exception as exc:  # noqa: BLE001 - a value set behind set_progress's back
            self._drop_progress(job, exc)
            return None

    def _drop_progress(self, job: Job[Any], exc: BaseException) -> None:
        job._progress = None  # noqa: SLF001 - dropped: never sent again
        self.dropped_progress += 1
        log.error("progress of job %d (run_lease %d) cannot be stored and was dropped: %s", job.id,
                  job.run_lease, str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__,
                  extra={"action": "progress_dropped"})

    def _send(self, jobs: Sequence[Job[Any]], progress: Sequence[RawJson | None]) -> list[AttemptResult]:
        if self._conn is None or self._conn.closed:
            self._conn = connect(self.config.dsn, application_name=self.config.application_name)
            self.storage.session_index_probes(self._conn)  # plans that stay index probes as slots fill
            self.storage.session_read_committed(self._conn)
        return self.storage.attempt_heartbeat(self._conn, [j.snapshot for j in jobs], progress)

    def _connection_lost(self, exc: psycopg.Error) -> bool:
        """True when ``exc`` means the connection is gone, not that the batch's data was refused."""
        conn = self._conn
        return conn is None or conn.closed or conn.broken or isinstance(exc, psycopg.InterfaceError)

    def _send_around_bad_progress(self, jobs: list[Job[Any]], progress: list[RawJson | None],
                                  first: psycopg.Error) -> list[AttemptResult]:
        """The batch failed on its data: heartbeat it without progress, then try each progress alone.

        A value the database still refuses on its own is dropped (logged once);
        the others are recorded. An error without any progress in the batch is
        not about progress: it propagates like any other failure.
        """
        if all(p is None for p in progress):
            log.error("heartbeat of %d attempts failed: %s", len(jobs), first, extra={"action": "heartbeat_error"})
            raise _BatchFailed(str(first)) from first
        results = self._send(jobs, [None] * len(jobs))
        for job, p in zip(jobs, progress, strict=True):
            if p is None:
                continue
            try:
                self._send([job], [p])
            except psycopg.Error as exc:
                if self._connection_lost(exc):
                    raise _BatchFailed(str(exc)) from exc
                self._drop_progress(job, exc)
        return results

    def _apply(self, results: list[AttemptResult], jobs: list[Job[Any]]) -> None:
        by_key = {(j.id, j.run_lease): j for j in jobs}
        cancel: list[Job[Any]] = []
        stale: list[Key] = []
        live: list[Key] = []
        for r in results:  # results come back in lock order, not input order
            key = (r.job_id, r.run_lease)
            job = by_key[key]
            if r.status == "stale":
                self.stale += 1
                # Nothing more to heartbeat: the attempt is closed (rescued, closed elsewhere, or
                # completed by this claimer a moment ago); the next tick tells which.
                stale.append(key)
                if not job.is_abandoned():
                    self._suspect.setdefault(key, (job, time.monotonic()))
            else:
                live.append(key)
                if r.status == "cancel" and not job._cancelled:  # noqa: SLF001
                    job._cancelled = True  # noqa: SLF001
                    cancel.append(job)
        self._attempts.answered(stale, live)
        if cancel and self.on_cancel is not None:
            self.on_cancel(cancel)

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - a bug: the claimer must not run on without heartbeats
            log.critical("heartbeat thread died", exc_info=exc, extra={"action": "heartbeat_died"})
            if self.on_death is not None:
                self.on_death(exc)

    def _loop(self) -> None:
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
            if self._stop.is_set():
                break
            try:
                self.run_once()
            except Exception:  # noqa: BLE001
                self.failures += 1
                log.exception("heartbeat batch failed", extra={"action": "heartbeat_error"})
                close_quietly(self._conn)
                self._conn = None
