"""The claimer: claim path, handler execution, hand-off to the completion batcher.

One claimer serves one stripe of one queue. Its main loop claims through
the one claim function (``Storage.lane_claim``) whenever local capacity is
free, and otherwise sleeps until a NOTIFY for its queue, a handler freeing
capacity, or the poll interval. Handlers run on a bounded thread pool (sync)
or an event loop thread (``async def``); an outcome goes to the completion
batcher and the capacity is free at once. Heartbeats run on their own
thread. No transaction is held while a handler runs.

Whatever a handler raises, ``BaseException`` included (``SystemExit``,
``KeyboardInterrupt``, ``asyncio.CancelledError``, ``GeneratorExit``), its
attempt closes as a retry naming the exception, and outcomes a worker had
already produced are always handed on. A worker thread or the event loop
thread that dies anyway stops the claimer loudly (exit code 1): the
supervisor restarts it and its open attempts are rescued. A handler's
exception is logged and stored with the tail of its traceback; args that do
not decode into the kind's ``args_type`` fail the job at once. A kind with a
``timeout`` has its running attempts watched on the heartbeat tick: past it,
the attempt closes as a retry and the handler's later outcome is dropped. See
``docs/handlers.md``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import psycopg

from awa_fast import hooks as _hooks
from awa_fast.errors import DatabaseUnavailable, TerminalError
from awa_fast.jobs import AttemptClosed, Cancel, ClaimSnapshot, Job, JobSpec, RetryAfter, Snooze, WaitForCallback
from awa_fast.jobs import MAX_PROGRESS_BYTES
from awa_fast.limits import LimitWatch
from awa_fast.runtime.batcher import RELEASE, STALE, BatcherConfig, CompletionBatcher, FlushReport, Outcome
from awa_fast.runtime.heartbeat import Heartbeat, HeartbeatConfig
from awa_fast.storage import (
    CLOSE_CANCEL,
    CLOSE_FAIL,
    CLOSE_RETRY,
    CLOSE_SNOOZE,
    Storage,
    clean_text,
    close_quietly,
    connect,
    use_raw_jsonb,
)

log = logging.getLogger("awa_fast.claimer")

_MAX_ERROR = 8192
_MAX_TRACEBACK = 4096  # the tail of a handler's traceback stored with its error (within _MAX_ERROR)

_OUTCOME_NAMES = {CLOSE_RETRY: "retried", CLOSE_SNOOZE: "snoozed", CLOSE_CANCEL: "cancelled", CLOSE_FAIL: "failed"}

# A short claim of fewer rows than this may wait for a NOTIFY. Producers
# skip the NOTIFY while a lane has 64+ rows not covered by committed
# receipts, so rows of claims still committing count as backlog: it takes
# 8 such claims in flight at once to hide a new row until the poll.
_SHORT_CLAIM_SLEEPS = 8

# Pauses between claims that found every lane with work busy (another
# claimer holds the lane head for the length of its claim, a few ms).
_BUSY_PAUSE_FIRST = 0.002
_BUSY_PAUSE_MAX = 0.02


def next_busy_pause(pause: float) -> float:
    """The pause after ``pause`` when the lane is still busy: doubling, at most 20 ms.

    Two stripes draining one lane take turns on its head. A pause that kept
    doubling towards the poll interval (1 s) let one stripe sleep while the
    other drained alone: 100k-job drains came out either ~96k or ~65k jobs/s.
    At the cap a holder stuck for good costs 50 empty claims a second.
    """
    return min(pause * 2.0, _BUSY_PAUSE_MAX)


@dataclass(frozen=True, slots=True)
class ClaimerConfig:
    """Settings of one claimer (one stripe of one queue)."""

    dsn: str = field(repr=False)  # a DSN may carry a password
    schema: str
    queue: str
    stripe: int = 0
    stripes: int = 1
    concurrency: int = 64
    claim_batch: int = 1024
    poll_interval: float = 1.0
    flush_max: int = 2048
    heartbeat_interval: float = 5.0
    drain_timeout: float = 30.0
    listen: bool = True
    # A claim, a completion flush or a LISTEN ping that gets no answer for this
    # long is taken as a half-open connection: its socket is shut down, which
    # turns the hang into an error the loops already recover from.
    io_timeout: float = 10.0  # the LISTEN connection is pinged every io_timeout / 2
    max_progress_bytes: int = MAX_PROGRESS_BYTES  # encoded size limit of one job.set_progress() value


def error_text(exc: BaseException | str) -> str:
    """Error text safe to store: no NUL, no lone surrogates, at most 8 KiB.

    Names the exception's type always (``SystemExit: 3``, ``KeyboardInterrupt``),
    even when its ``__str__`` is empty or itself raises.
    """
    if isinstance(exc, str):
        text = exc
    else:
        name = type(exc).__name__
        try:
            detail = str(exc)
            text = f"{name}: {detail}" if detail else name
        except BaseException:  # noqa: BLE001 - an exception whose __str__ fails (or raises SystemExit)
            text = name
    return clean_text(text, _MAX_ERROR) or ""


def failure_text(exc: BaseException) -> str:
    """A handler's exception as stored with its attempt: ``error_text(exc)``, then the last
    4 KiB of its traceback, at most 8 KiB in all (the first line stays the ``Name: detail``)."""
    head = error_text(exc)
    try:
        tb = "".join(traceback.format_exception(exc))
    except BaseException:  # noqa: BLE001 - a traceback that cannot be formatted: the summary alone
        return head
    if len(tb) > _MAX_TRACEBACK:
        tb = "..." + tb[-_MAX_TRACEBACK:]
    return clean_text(f"{head[:_MAX_ERROR - _MAX_TRACEBACK - 8]}\n{tb.rstrip()}", _MAX_ERROR) or head


def _one_line(text: str, limit: int = 1000) -> str:
    first = text.split("\n", 1)[0]
    return first if len(first) <= limit else first[:limit] + "..."


def timeout_text(timeout: float) -> str:
    return f"timed out after {timeout:g} s"


def _unknown_kind_text(kind: str) -> str:
    return f"no handler registered for kind {kind!r} in this worker"


class Claimer:
    """Claims, runs and completes jobs of one queue stripe."""

    def __init__(self, config: ClaimerConfig, registry: dict[str, JobSpec], shm_record: Any = None,
                 flush_listeners: Sequence[Callable[[list[AttemptClosed]], None]] = (), *,
                 on_short_claim: Callable[[bool], None] | None = None, watch_parent: bool = True) -> None:
        # on_short_claim(lane_busy): called on the claim thread after every claim that returned
        # fewer jobs than asked (the in-process worker's until_empty check). watch_parent=False:
        # do not drain when the parent process changes (in-process workers have no supervisor).
        self._on_short_claim = on_short_claim
        self._watch_parent = watch_parent
        self.config = config
        self.registry = registry
        self.flush_listeners = list(flush_listeners)
        self.storage = Storage(config.schema)
        self.limits = LimitWatch(self.storage, config.queue)  # plain claim unless the queue has a limit
        self.shm = shm_record
        self.held: dict[tuple[int, int], Job] = {}
        self.claimed_at: dict[tuple[int, int], float] = {}
        self.stateful: set[tuple[int, int]] = set()
        self.batcher = CompletionBatcher(
            BatcherConfig(config.dsn, config.schema, flush_max=config.flush_max,
                          application_name=f"awa_fast:batcher:{config.queue}#{config.stripe}"),
            self._flushed, self.stateful)
        self.heartbeat = Heartbeat(
            HeartbeatConfig(config.dsn, config.schema, config.heartbeat_interval,
                            application_name=f"awa_fast:heartbeat:{config.queue}#{config.stripe}"),
            self.held, self.claimed_at, self.stateful)
        self._stopping = threading.Event()
        self._wake = threading.Event()
        # False after a claim came back short (the queue looked empty to it):
        # finished handlers then do not wake the claim loop, only a NOTIFY or
        # the poll does. True while a backlog may remain behind a full claim.
        self._backlog_maybe = True
        self.batcher._on_death = self._batcher_died
        self.heartbeat.watchdog = self._watchdog
        self.heartbeat.on_lost = self._attempts_lost
        self.heartbeat.on_cancel = self._attempts_cancel_requested
        self.heartbeat.on_death = lambda exc: self._thread_died("the heartbeat thread", exc)
        self.max_progress_bytes = config.max_progress_bytes  # read by Job.set_progress
        self._died: str | None = None  # a worker, loop or heartbeat thread that died: exit non-zero
        # Sync attempts found stale while their handler still runs (a thread cannot be stopped).
        self._abandoned: set[tuple[int, int]] = set()
        self._abandoned_lock = threading.Lock()
        self._unknown_logged: set[str] = set()
        # Attempts of kinds with a timeout whose handler runs: key -> [deadline (monotonic), job,
        # timeout, fired]. Only those kinds ever enter it, so others pay nothing for timeouts. The
        # heartbeat thread's watchdog fires expired ones; an entry stays (fired) until its handler
        # returns, so the handler's late outcome is dropped: one outcome per claimed attempt.
        self._timed: dict[tuple[int, int], list[Any]] = {}
        self._timed_lock = threading.Lock()
        self._timeouts_closed = False  # set (under the lock) before the drain stops the batcher
        self._timed_out_sync = 0  # fired sync attempts whose handler still runs (in the abandoned gauge)
        self._claim_started: float | None = None
        self._ping_started: float | None = None
        self._work: queue.SimpleQueue[list[Job] | None] = queue.SimpleQueue()
        self._outstanding = 0  # claimed and not yet finished (buffered + running)
        self._count_lock = threading.Lock()
        self._avg_handler_s: float | None = None  # EWMA of sync handler time, sizes dispatch chunks
        self._async_slots: asyncio.Semaphore | None = None  # bounds async handlers to `concurrency`
        self._parent = os.getppid()
        self._threads: list[threading.Thread] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._listen_conn: psycopg.Connection | None = None
        self._claim_conn: psycopg.Connection | None = None
        self._clock_offset = 0.0  # database clock - local wall clock (latency metrics only)
        self._clock_measured = 0.0
        self.stats = {"claimed": 0, "completed": 0, "retried": 0, "failed": 0, "cancelled": 0,
                      "snoozed": 0, "stale": 0, "claim_calls": 0, "empty_claims": 0, "batches": 0}
        self._pickup: list[float] = []
        self._e2e: list[float] = []
        self._stats_lock = threading.Lock()  # claim loop and batcher thread both count

    # -- lifecycle --------------------------------------------------------------------

    @property
    def outstanding(self) -> int:
        """Jobs claimed here and not yet handed to the batcher (buffered + running)."""
        return self._outstanding

    def stop(self) -> None:
        """Begin a graceful drain (safe from a signal handler)."""
        self._stopping.set()
        self._wake.set()

    def run(self) -> int:
        """Claim and run jobs until :meth:`stop`; then drain. Returns an exit code (0 = clean)."""
        cfg = self.config
        self._set_state("starting")
        self._publish_abandoned()  # a restarted claimer abandons nothing yet
        self.batcher.start()
        self.heartbeat.start()
        for i in range(cfg.concurrency if self._has_sync() else 0):
            t = threading.Thread(target=self._worker, name=f"awa-worker-{i}", daemon=True)
            t.start()
            self._threads.append(t)
        if self._has_async():
            self._loop = asyncio.new_event_loop()
            self._loop_thread = threading.Thread(target=self._run_loop, name="awa-async", daemon=True)
            self._loop_thread.start()
        if cfg.listen:
            threading.Thread(target=self._listen, name="awa-listen", daemon=True).start()
        self._set_state("running")
        log.info("claimer %s#%d running (concurrency %d, batch %d)", cfg.queue, cfg.stripe, cfg.concurrency,
                 cfg.claim_batch, extra={"action": "claimer_start"})
        try:
            self._claim_loop()
        finally:
            code = self._drain()
        return code

    def _has_sync(self) -> bool:
        return any(not s.is_async for s in self.registry.values()) or not self.registry

    def _has_async(self) -> bool:
        return any(s.is_async for s in self.registry.values())

    def _set_state(self, state: str) -> None:
        if self.shm is not None:
            self.shm.set_state(state)

    # -- the claim path -----------------------------------------------------------------

    def _claim_connection(self) -> psycopg.Connection:
        if self._claim_conn is None or self._claim_conn.closed:
            self._claim_conn = connect(self.config.dsn,
                                       application_name=f"awa_fast:claimer:{self.config.queue}#{self.config.stripe}",
                                       connect_timeout=int(self.config.io_timeout + 0.999))
            use_raw_jsonb(self._claim_conn)
            self._measure_clock_offset()
            # Claims commit durably (synchronous_commit stays on). A claim lost
            # in a crash would be issued again under the same run_lease, and the
            # first holder's late completion would then close the new attempt:
            # the fence (job_id, run_lease) only works if every issued lease is
            # on disk before its handler starts.
        return self._claim_conn

    def _measure_clock_offset(self) -> None:
        """Measure the database clock minus this process's wall clock.

        Only the latency metrics need it: they subtract the database's
        created_at from local times, so a worker whose clock is off would
        otherwise report its clock error as pickup and end-to-end latency.
        """
        assert self._claim_conn is not None
        t0 = time.time()
        row = self._claim_conn.execute("SELECT extract(epoch FROM clock_timestamp())::float8").fetchone()
        t1 = time.time()
        if row is not None:
            self._clock_offset = float(row[0]) - (t0 + t1) / 2
            self._clock_measured = time.monotonic()

    def _claim_loop(self) -> None:
        cfg = self.config
        backoff = 0.05
        # Running handlers plus up to one claim batch buffered locally.
        target = cfg.concurrency + cfg.claim_batch
        busy_pause = _BUSY_PAUSE_FIRST
        while not self._stopping.is_set():
            self._wake.clear()
            free = target - self._outstanding
            if free >= min(cfg.claim_batch, 32) or (free > 0 and self._outstanding < cfg.concurrency):
                try:
                    conn = self._claim_connection()
                    if time.monotonic() - self._clock_measured > 300.0:
                        self._measure_clock_offset()
                    self._claim_started = time.monotonic()
                    want = min(free, cfg.claim_batch)
                    self._backlog_maybe = True
                    try:
                        snaps, lane_busy = self.limits.claim_call(conn)(conn, cfg.queue, want, cfg.stripe,
                                                                         cfg.stripes)
                    finally:
                        self._claim_started = None
                    backoff = 0.05
                except (psycopg.OperationalError, DatabaseUnavailable) as exc:
                    log.warning("claim on %s failed: %s; reconnecting in %.2fs", cfg.queue,
                                str(exc).strip().splitlines()[0] if str(exc) else exc, backoff,
                                extra={"action": "claim_error"})
                    self._close_claim_conn()
                    self._stopping.wait(backoff)
                    backoff = min(backoff * 2, 5.0)
                    continue
                self._count("claim_calls", 1)
                if self._on_short_claim is not None and len(snaps) < want:
                    self._on_short_claim(lane_busy)
                if len(snaps) < want and not lane_busy and len(snaps) < _SHORT_CLAIM_SLEEPS:
                    # Drained for now: wait for a NOTIFY. A producer that
                    # reserved before this claim's end made it return the
                    # backlog marker (lane_busy); one that reserves later
                    # notifies unless the lane's backlog is 64+, and that
                    # backlog counts this claim's rows only until it commits,
                    # which is why only a claim of a few rows may sleep. A
                    # NOTIFY that arrived during the claim has set _wake.
                    self._backlog_maybe = False
                elif lane_busy and not snaps:
                    # Another claimer holds that lane head right now: retry
                    # with a growing pause (a stuck holder costs no spin).
                    self._count("empty_claims", 1)
                    self._wake.wait(busy_pause)
                    busy_pause = min(next_busy_pause(busy_pause), cfg.poll_interval)
                    continue
                busy_pause = _BUSY_PAUSE_FIRST
                if snaps:
                    self._dispatch(snaps)
                    if self._backlog_maybe:
                        continue
                else:
                    self._count("empty_claims", 1)
            self._publish()
            if self._watch_parent and os.getppid() != self._parent:
                log.error("supervisor %d is gone; draining", self._parent, extra={"action": "orphaned"})
                self._stopping.set()
                break
            self._wake.wait(cfg.poll_interval)

    def _close_claim_conn(self) -> None:
        close_quietly(self._claim_conn)
        self._claim_conn = None

    def _dispatch(self, snaps: Sequence[ClaimSnapshot]) -> None:
        now = time.monotonic()
        self.batcher.register_receipts(snaps)
        jobs = []
        for s in snaps:
            spec = self.registry.get(s.kind)
            job = Job(s, spec.args_type if spec else None, self)
            key = (s.job_id, s.run_lease)
            self.held[key] = job
            self.claimed_at[key] = now
            jobs.append(job)
        n = len(jobs)
        self._count("claimed", n)
        with self._count_lock:
            self._outstanding += n
        unknown = [j for j in jobs if j.kind not in self.registry]
        if unknown:
            self._unknown_kinds(unknown)
            jobs = [j for j in jobs if j.kind in self.registry]
        if self._loop is None:
            sync_jobs, async_jobs = jobs, []
        else:
            sync_jobs = [j for j in jobs if not self._is_async(j)]
            async_jobs = [j for j in jobs if self._is_async(j)]
        if sync_jobs:
            per = self._chunk_size(len(sync_jobs))
            for i in range(0, len(sync_jobs), per):
                self._work.put(sync_jobs[i:i + per])
        if async_jobs and self._loop is not None:
            self._loop.call_soon_threadsafe(self._spawn_async, async_jobs)

    def _unknown_kinds(self, jobs: list[Job]) -> None:
        """No handler here: retry with backoff (DLQ only when attempts run out).

        During a rolling deploy producers may know a kind before this worker
        does; a worker that has it may claim the retry. Logged once per kind.
        """
        for kind in sorted({j.kind for j in jobs} - self._unknown_logged):
            self._unknown_logged.add(kind)
            log.warning("no handler for kind %r in this worker: its jobs are retried with backoff "
                        "(the DLQ takes them when their attempts run out)", kind, extra={"action": "unknown_kind"})
        self._finish([(j, (CLOSE_RETRY, None, _unknown_kind_text(j.kind))) for j in jobs])

    def _chunk_size(self, n: int) -> int:
        """Jobs per worker hand-off: spread over all workers, but ~2 ms of work at least.

        Slow handlers get one job per worker (full concurrency); tiny ones run
        in large chunks so threads are not woken per job.
        """
        spread = -(-n // max(1, len(self._threads)))
        avg = self._avg_handler_s
        if avg is None:
            return spread
        return max(spread, min(n, int(0.002 / max(avg, 1e-7))))

    def _is_async(self, job: Job) -> bool:
        spec = self.registry.get(job.kind)
        return spec is not None and spec.is_async

    # -- handler execution --------------------------------------------------------------

    def _worker(self) -> None:
        try:
            self._work_loop()
        except BaseException as exc:  # noqa: BLE001 - a bug: _run_sync catches everything a handler raises
            self._thread_died(f"worker thread {threading.current_thread().name}", exc)

    def _work_loop(self) -> None:
        perf = time.perf_counter
        stopping = self._stopping
        while True:
            chunk = self._work.get()
            if chunk is None:
                return
            done: list[tuple[Job, Outcome | object]] = []
            t0 = perf()
            try:
                for i, job in enumerate(chunk):
                    if stopping.is_set():
                        # Draining: hand back what has not started (no attempt consumed).
                        done.extend((j, _HAND_BACK) for j in chunk[i:])
                        break
                    done.append((job, self._run_sync(job)))
            finally:
                if len(done) < len(chunk):
                    # Something escaped _run_sync: the job it ran stays held (rescued
                    # after this claimer exits), the ones after it were never started.
                    done.extend((j, _HAND_BACK) for j in chunk[len(done) + 1:])
                self._finish(done)  # outcomes already produced are always handed on
            ran = sum(1 for _, o in done if o is not _HAND_BACK)
            if ran:
                per_job = (perf() - t0) / ran
                avg = self._avg_handler_s
                self._avg_handler_s = per_job if avg is None else 0.8 * avg + 0.2 * per_job

    def _run_sync(self, job: Job) -> Outcome:
        spec = self.registry.get(job.kind)
        if spec is None:
            return (CLOSE_RETRY, None, _unknown_kind_text(job.kind))
        job.started_at = time.time()
        if spec.timeout is not None:
            self._arm_timeout(job, spec.timeout)
        try:
            scope = _hooks.around  # tracing / log context (awa_fast/hooks.py): None unless enabled
            if scope is None:
                return self._outcome(job, spec.handler(job))
            with scope(job):
                result = spec.handler(job)
            return self._outcome(job, result)
        except BaseException as exc:  # noqa: BLE001 - SystemExit, KeyboardInterrupt, ... retry like any failure
            return self._failed(job, spec, exc)

    def _run_loop(self) -> None:
        """The event loop thread: a loop that stops or dies while the claimer runs stops the claimer."""
        assert self._loop is not None
        try:
            self._loop.run_forever()
        except BaseException as exc:  # noqa: BLE001 - _run_async catches everything a handler raises
            self._thread_died("the event loop thread", exc)
            return
        if not self._stopping.is_set():
            self._thread_died("the event loop thread",
                              RuntimeError("the event loop stopped while the claimer runs (loop.stop() in a handler?)"))

    def _spawn_async(self, jobs: list[Job]) -> None:
        if self._async_slots is None:
            self._async_slots = asyncio.Semaphore(self.config.concurrency)
        for job in jobs:
            job._task = asyncio.ensure_future(self._run_async(job))  # noqa: SLF001 - cancelled when stale

    async def _run_async(self, job: Job) -> None:
        assert self._async_slots is not None
        outcome: Outcome | object = _HAND_BACK
        try:
            async with self._async_slots:
                if self._stopping.is_set():
                    return  # draining: hand back (no attempt consumed)
                outcome = await self._run_async_handler(job)
        except BaseException as exc:  # noqa: BLE001 - cancelled while waiting for a slot
            outcome = self._interrupted(job, exc)
        finally:
            self._finish([(job, outcome)])

    async def _run_async_handler(self, job: Job) -> Outcome | object:
        spec = self.registry[job.kind]
        job.started_at = time.time()
        if spec.timeout is not None:
            self._arm_timeout(job, spec.timeout)
        try:
            scope = _hooks.around  # tracing / log context (awa_fast/hooks.py): None unless enabled
            if scope is None:
                return self._outcome(job, await spec.handler(job))
            with scope(job):
                result = await spec.handler(job)
            return self._outcome(job, result)
        except BaseException as exc:  # noqa: BLE001 - SystemExit, KeyboardInterrupt, CancelledError, ...
            if isinstance(exc, asyncio.CancelledError) and job._cancelled:  # noqa: SLF001 - we cancelled it
                return self._interrupted(job, exc)
            return self._failed(job, spec, exc)

    def _failed(self, job: Job, spec: JobSpec, exc: BaseException) -> Outcome:
        """The outcome of a handler that raised ``exc``, logged (WARNING, the traceback at DEBUG).

        ``TerminalError`` fails the job (DLQ); so does job args that do not decode into the
        kind's ``args_type`` (retrying cannot fix them). Anything else retries. The stored
        error carries the tail of the traceback.
        """
        code = CLOSE_RETRY
        text = None
        if isinstance(exc, TerminalError):
            code = CLOSE_FAIL
        elif isinstance(exc, msgspec.ValidationError) and spec.args_type is not None and self._bad_args(job):
            code = CLOSE_FAIL
            text = error_text(f"job args do not match args_type {getattr(spec.args_type, '__name__', spec.args_type)}"
                              f": {error_text(exc)}")
        if text is None:
            text = failure_text(exc)
        if not job.is_abandoned():  # a rescued or timed-out attempt's failure is written by no one
            log.warning("job %d (kind %r, attempt %d) %s: %s", job.id, job.kind, job.attempt,
                        "failed for good" if code == CLOSE_FAIL else "failed", _one_line(text),
                        extra={"action": "handler_error"})
            if log.isEnabledFor(logging.DEBUG):
                log.debug("traceback of job %d (attempt %d)", job.id, job.attempt, exc_info=exc,
                          extra={"action": "handler_traceback"})
        return (code, None, text)

    @staticmethod
    def _bad_args(job: Job) -> bool:
        """True if the job's args do not decode into its kind's args_type (the failure path only)."""
        try:
            job.args  # noqa: B018 - decodes again: a failed decode is not cached
        except msgspec.ValidationError:
            return True
        except Exception:  # noqa: BLE001
            return False
        return False

    def _interrupted(self, job: Job, exc: BaseException) -> Outcome | object:
        """The outcome of an attempt whose handler raised ``exc`` (anything but TerminalError).

        A CancelledError after this claimer cancelled the task is no failure:
        a stale attempt (rescued, closed elsewhere) writes nothing, an attempt
        with a cancel request ends as cancelled. Anything else retries.
        """
        if isinstance(exc, asyncio.CancelledError):
            if job.is_abandoned():
                return STALE
            if job._cancelled:  # noqa: SLF001
                return (CLOSE_CANCEL, None, "cancelled while running (cancel requested)")
        return (CLOSE_RETRY, None, failure_text(exc))

    def _outcome(self, job: Job, result: object) -> Outcome:
        if result is None:
            return None
        if isinstance(result, RetryAfter):
            return (CLOSE_RETRY, _seconds(result.seconds), error_text(result.reason or "retry requested"))
        if isinstance(result, Snooze):
            return (CLOSE_SNOOZE, _seconds(result.seconds), None)
        if isinstance(result, Cancel):
            return (CLOSE_CANCEL, None, error_text(result.reason))
        if isinstance(result, WaitForCallback):
            if not job.lease_backed:
                try:
                    job.register_callback(_seconds(result.timeout))
                except Exception as exc:  # noqa: BLE001 - registration failed: retry the job
                    return (CLOSE_RETRY, None, error_text(exc))
            return _PARKED
        # Any other value is the job's result: it completes the attempt and is
        # stored (checked like enqueue args); one that cannot be stored retries.
        from awa_fast.runtime.batcher import result_outcome

        return result_outcome(result)

    def _finish(self, done: list[tuple[Job, Outcome | object]]) -> None:
        """Hand finished attempts to the batcher and free their local capacity."""
        for i, (job, outcome) in enumerate(done):
            if outcome is _HAND_BACK:
                done[i] = (job, (CLOSE_SNOOZE, 0.0, None))
            elif outcome is _PARKED:
                key = (job.id, job.run_lease)
                self.held.pop(key, None)
                self.claimed_at.pop(key, None)
                done[i] = (job, RELEASE)
        n = len(done)
        if self._timed:
            done = self._disarm(done)
        if self._abandoned:
            self._abandoned_returned(done)
        if done:
            self.batcher.submit_many(done)  # type: ignore[arg-type]
        with self._count_lock:
            self._outstanding -= n  # a timed-out attempt's capacity is freed here, once, when its handler ends
        if self._backlog_maybe and not self._wake.is_set() and self._outstanding <= self.config.concurrency:
            self._wake.set()

    # -- handler timeouts ----------------------------------------------------------------

    def _arm_timeout(self, job: Job, timeout: float) -> None:
        with self._timed_lock:
            self._timed[(job.id, job.run_lease)] = [time.monotonic() + timeout, job, timeout, False]

    def _disarm(self, done: list[tuple[Job, Outcome | object]]) -> list[tuple[Job, Outcome | object]]:
        """Take finished attempts out of the timeout watch; drop the outcome of one already timed out.

        Under the lock, so an attempt's outcome is either its handler's (the watchdog has not
        fired: its entry is gone before it looks) or the timeout's retry (submitted when it fired):
        never both, never neither.
        """
        keep = []
        late_sync = 0
        with self._timed_lock:
            for item in done:
                job = item[0]
                entry = self._timed.pop((job.id, job.run_lease), None)
                if entry is not None and entry[3]:
                    if not self._is_async(job):
                        late_sync += 1
                    continue
                keep.append(item)
            self._timed_out_sync -= late_sync
        dropped = len(done) - len(keep)
        if dropped:
            self._count("stale", dropped)
            if late_sync:
                log.info("%d timed-out sync handler(s) returned late: outcome discarded", late_sync,
                         extra={"action": "timeout_late_return"})
                self._publish_abandoned()
        return keep

    def _check_timeouts(self) -> None:
        """Close attempts past their kind's timeout (on the heartbeat thread, every tick).

        Looks only at attempts of kinds with a timeout. Each expired one is marked fired under
        the lock (its handler's outcome will be dropped), told (``job.is_cancelled()``), closed
        as a retry through the batcher, and an async handler's task is cancelled; a sync handler
        runs on until it returns, counted as abandoned.
        """
        now = time.monotonic()
        fired = []
        with self._timed_lock:
            if self._timeouts_closed:  # draining, the batcher stops: rescue takes what is left
                return
            for entry in self._timed.values():
                if not entry[3] and now >= entry[0]:
                    job = entry[1]
                    if job.is_abandoned():  # rescued or closed elsewhere first: its outcome is stale anyway
                        continue
                    entry[3] = True
                    fired.append(entry)
                    if not self._is_async(job):
                        self._timed_out_sync += 1
            if not fired:
                return
            for _, job, _, _ in fired:
                job._stale = True  # noqa: SLF001 - whatever the handler returns now is discarded
                job._cancelled = True  # noqa: SLF001
            out = [(job, (CLOSE_RETRY, None, timeout_text(timeout))) for _, job, timeout, _ in fired]
            # submitted under the lock: the drain cannot stop the batcher between fire and submit
            self.batcher.submit_many(out)  # type: ignore[arg-type]
        for _, job, timeout, _ in fired:
            kind = "async" if self._is_async(job) else "sync"
            log.warning("job %d (kind %r, attempt %d) timed out after %g s: closed as a retry; its %s handler %s",
                        job.id, job.kind, job.attempt, timeout, kind,
                        "is cancelled" if kind == "async" else "cannot be stopped and is abandoned",
                        extra={"action": "handler_timeout"})
        for job, _ in out:
            if self._is_async(job):
                self._cancel_task(job)
        self._publish_abandoned()

    # -- attempts closed elsewhere while running -------------------------------------

    def _attempts_lost(self, jobs: list[Job]) -> None:
        """The heartbeat found these attempts stale: rescued (deadline, heartbeat timeout) or closed elsewhere.

        ``job.is_cancelled()`` is already True. An async handler's task is
        cancelled (its outcome then writes nothing); a sync handler cannot be
        stopped: it is counted as abandoned until it returns, and what it
        returns is discarded.
        """
        abandoned = []
        for job in jobs:
            key = (job.id, job.run_lease)
            if self._is_async(job):
                log.warning("attempt of job %d (run_lease %d) was rescued or closed elsewhere: cancelling its "
                            "async handler", job.id, job.run_lease, extra={"action": "attempt_lost"})
                self._cancel_task(job)
            else:
                log.warning("attempt of job %d (run_lease %d) was rescued or closed elsewhere: its sync handler "
                            "cannot be stopped and is abandoned (job.is_cancelled() is now True)", job.id,
                            job.run_lease, extra={"action": "attempt_lost"})
                abandoned.append(key)
        if abandoned:
            with self._abandoned_lock:
                self._abandoned.update(k for k in abandoned if k in self.held)
            self._publish_abandoned()

    def _attempts_cancel_requested(self, jobs: list[Job]) -> None:
        """An operator asked to cancel these running attempts: cancel the async ones' tasks."""
        for job in jobs:
            if self._is_async(job):
                log.info("cancel requested for job %d (run_lease %d): cancelling its async handler", job.id,
                         job.run_lease, extra={"action": "attempt_cancel"})
                self._cancel_task(job)

    def _cancel_task(self, job: Job) -> None:
        loop = self._loop
        if loop is None:
            return

        def cancel() -> None:
            task = getattr(job, "_task", None)
            if task is not None and not task.done():
                task.cancel()
        try:
            loop.call_soon_threadsafe(cancel)
        except RuntimeError:  # the loop is closed: nothing runs there any more
            pass

    def _abandoned_returned(self, done: list[tuple[Job, Outcome | object]]) -> None:
        """Abandoned sync handlers that returned: nothing to write, and no longer counted."""
        changed = False
        with self._abandoned_lock:
            for i, (job, _) in enumerate(done):
                key = (job.id, job.run_lease)
                if key in self._abandoned:
                    self._abandoned.discard(key)
                    done[i] = (job, STALE)
                    changed = True
        if changed:
            self._publish_abandoned()

    def _publish_abandoned(self) -> None:
        if self.shm is not None:
            self.shm.set_abandoned(len(self._abandoned) + self._timed_out_sync)

    def _thread_died(self, what: str, exc: BaseException) -> None:
        """A thread the claimer cannot run without died: stop claiming and exit non-zero."""
        if self._died is None:
            self._died = what
        self.stop()  # first: nothing below may keep the claimer from stopping
        try:
            detail = error_text(exc)
        except BaseException:  # noqa: BLE001
            detail = type(exc).__name__
        log.error("%s died (%s); stopping this claimer so the supervisor restarts it "
                  "(its open attempts will be rescued)", what, detail, exc_info=exc,
                  extra={"action": "thread_died"})

    # -- the runtime interface used by Job -------------------------------------------

    def progress_changed(self, job: Job) -> None:
        self.heartbeat.progress_changed(job)

    def register_callback(self, job: Job, timeout: float) -> str:
        conn = connect(self.config.dsn, application_name="awa_fast:callback")
        try:
            token = self.storage.attempt_register_callback(conn, job.snapshot, timeout)
        finally:
            conn.close()
        if token is None:
            raise RuntimeError(f"attempt of job {job.id} (run_lease {job.run_lease}) is no longer live")
        return str(token)

    # -- after a flush --------------------------------------------------------------------

    def _count(self, key: str, n: int) -> None:
        with self._stats_lock:
            self.stats[key] += n

    def _flushed(self, report: FlushReport) -> None:
        if self._abandoned:  # found stale after its handler had returned: its outcome is flushed now
            with self._abandoned_lock:
                self._abandoned.difference_update((j.id, j.run_lease) for j, _ in report.jobs)
            self._publish_abandoned()
        st = dict.fromkeys(self.stats, 0)
        st["batches"] = 1
        e2e: list[float] = []
        pickup: list[float] = []
        closed: list[AttemptClosed] | None = [] if self.flush_listeners else None
        for job, outcome in report.jobs:
            key = (job.id, job.run_lease)
            self.held.pop(key, None)
            self.claimed_at.pop(key, None)
            self.stateful.discard(key)
            if outcome is RELEASE:
                continue
            if key in report.stale:
                what = "stale"
            elif outcome is None:
                what = "completed"
            else:
                what = _OUTCOME_NAMES.get(outcome[0], "completed")
            st[what] += 1
            if closed is not None:
                closed.append(AttemptClosed(job.id, job.run_lease, job.kind, what, job.started_at or 0.0,
                                            report.committed_at))
            if what == "stale":
                continue
            created = job.snapshot.created_at.timestamp() - self._clock_offset  # on this process's clock
            e2e.append(report.committed_at - created)
            if job.started_at:
                pickup.append(job.started_at - created)
        with self._stats_lock:
            for k, v in st.items():
                self.stats[k] += v
            self._e2e.extend(e2e)
            self._pickup.extend(pickup)
        if closed:
            for listener in self.flush_listeners:
                try:
                    listener(closed)
                except Exception:  # noqa: BLE001 - a listener never breaks the queue
                    log.exception("flush listener %r failed", listener, extra={"action": "flush_listener_error"})
        if report.stale:
            log.info("%d stale outcomes rejected (attempt rescued or closed elsewhere)", len(report.stale),
                     extra={"action": "stale_outcomes"})
        self._publish()

    def _publish(self) -> None:
        if self.shm is None:
            return
        with self._stats_lock:
            st, self.stats = self.stats, dict.fromkeys(self.stats, 0)
            pickup, self._pickup = self._pickup, []
            e2e, self._e2e = self._e2e, []
        self.shm.add(**st)
        if pickup:
            self.shm.observe_latency("pickup", pickup)
        if e2e:
            self.shm.observe_latency("e2e", e2e)
        self.shm.set_in_flight(self._outstanding)
        self.shm.heartbeat()

    # -- LISTEN/NOTIFY -------------------------------------------------------------------

    def _listen(self) -> None:
        backoff = 0.1
        while not self._stopping.is_set():
            try:
                conn = connect(self.config.dsn, application_name=f"awa_fast:listen:{self.config.queue}",
                               connect_timeout=int(self.config.io_timeout + 0.999))
                self._listen_conn = conn
                conn.execute(f'LISTEN "{self.storage.channel}"')
                backoff = 0.1
                self._backlog_maybe = True
                self._wake.set()  # poll once after every (re)LISTEN: wakeups may have been missed
                last_ping = time.monotonic()
                while not self._stopping.is_set():
                    for note in conn.notifies(timeout=1.0):
                        if note.payload == self.config.queue:
                            self._backlog_maybe = True
                            self._wake.set()
                    if time.monotonic() - last_ping >= max(0.5, self.config.io_timeout / 2):
                        # a half-open socket delivers no notification and no
                        # error: only an answer proves the connection alive
                        self._ping_started = time.monotonic()
                        try:
                            conn.execute("SELECT 1")
                        finally:
                            self._ping_started = None
                        last_ping = time.monotonic()
            except (psycopg.Error, DatabaseUnavailable) as exc:
                if self._stopping.is_set():
                    return
                log.warning("LISTEN connection lost (%s); reconnecting in %.1fs", exc, backoff,
                            extra={"action": "listen_error"})
                self._stopping.wait(backoff)
                backoff = min(backoff * 2, 5.0)
            finally:
                close_quietly(self._listen_conn)
                self._listen_conn = None

    # -- hang detection and batcher death ------------------------------------------------

    def _watchdog(self) -> None:
        """Shut down the socket of a claim, flush or LISTEN ping that hangs (half-open peer);
        close attempts past their kind's timeout."""
        if self._timed:
            self._check_timeouts()
        now = time.monotonic()
        limit = self.config.io_timeout
        checks = [(self._claim_started, self._claim_conn, "claim", limit),
                  (self.batcher.flush_started, self.batcher.connection(), "completion flush", limit),
                  (self._ping_started, self._listen_conn, "LISTEN ping", limit)]
        for started, conn, what, allowed in checks:
            if started is not None and conn is not None and now - started > allowed:
                log.error("%s has had no answer for %.0fs: closing its connection", what, now - started,
                          extra={"action": "io_timeout"})
                _shutdown_socket(conn)

    def _batcher_died(self) -> None:
        self.stop()

    # -- drain ---------------------------------------------------------------------------------

    def _drain(self) -> int:
        cfg = self.config
        self._set_state("draining")
        log.info("claimer %s#%d draining", cfg.queue, cfg.stripe, extra={"action": "drain_start"})
        # Hand back claimed jobs that never started: no attempt consumed.
        handed_back = 0
        while True:
            try:
                chunk = self._work.get_nowait()
            except queue.Empty:
                break
            if chunk is None:
                continue
            self.batcher.submit_many([(job, (CLOSE_SNOOZE, 0.0, None)) for job in chunk])
            with self._count_lock:
                self._outstanding -= len(chunk)
            handed_back += len(chunk)
        for _ in self._threads:
            self._work.put(None)
        deadline = time.monotonic() + cfg.drain_timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        clean = not any(t.is_alive() for t in self._threads)
        if self._loop is not None:
            alive = self._loop_thread is not None and self._loop_thread.is_alive()
            while alive and self._outstanding > 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            clean = clean and self._outstanding == 0
            self._loop.call_soon_threadsafe(self._loop.stop)
        with self._timed_lock:
            self._timeouts_closed = True
        flushed = self.batcher.stop(max(1.0, deadline - time.monotonic()))
        self.heartbeat.stop()
        self._close_claim_conn()
        self._publish()
        self._set_state("stopped")
        log.info("claimer %s#%d drained (handed back %d unstarted jobs, clean=%s)", cfg.queue, cfg.stripe,
                 handed_back, clean and flushed, extra={"action": "drain_done"})
        if self.batcher.died:
            log.error("the completion batcher died; exiting so the attempts are rescued",
                      extra={"action": "batcher_died"})
            return 1
        if self._died is not None:
            log.error("exiting with code 1: %s died", self._died, extra={"action": "thread_died"})
            return 1
        if self.batcher.dropped:
            log.error("%d outcomes could not be written; their attempts will be rescued",
                      self.batcher.dropped, extra={"action": "drain_dropped"})
        return 0 if clean and flushed and not self.batcher.dropped else 1


def _shutdown_socket(conn: psycopg.Connection) -> None:
    import socket

    try:
        dup = socket.fromfd(conn.fileno(), socket.AF_UNIX if conn.info.host.startswith("/") else socket.AF_INET,
                            socket.SOCK_STREAM)
    except (OSError, psycopg.Error):
        return
    try:
        dup.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        dup.close()


def _seconds(value: object) -> float:
    try:
        v = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return 0.0
    if v != v or v < 0:
        return 0.0
    return min(v, 10 * 365 * 86400.0)


# A handler parked its attempt for a callback: nothing to write.
_PARKED = object()
# Claimed but never started when the drain began: given back without consuming an attempt.
_HAND_BACK = object()


def die_with_parent() -> None:
    """Ask Linux to send SIGTERM (a drain) to this child when the supervisor dies."""
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the claim loop's getppid check still applies
        pass


def claimer_main(app_ref: str, config: ClaimerConfig, shm_name: str | None, shm_index: int) -> None:
    """Entry point of a claimer process (forked by the supervisor)."""
    import signal

    from awa_fast.runtime.loader import load_app

    die_with_parent()
    app = load_app(app_ref)
    record = None
    ring = None
    if shm_name:
        from awa_fast.runtime.shm import ShmRing

        ring = ShmRing.attach(shm_name)
        record = ring.claimer(shm_index)
    claimer = Claimer(config, app.registry, record, getattr(app, "flush_listeners", ()))
    signal.signal(signal.SIGTERM, lambda *_: claimer.stop())
    signal.signal(signal.SIGINT, lambda *_: claimer.stop())
    code = claimer.run()
    if ring is not None:
        ring.close()
    os._exit(code)
