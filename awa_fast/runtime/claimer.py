"""The claimer core: the claim loop of one queue stripe, its wiring, and its drain.

One claimer serves one stripe of one queue. Its claim loop (the process's
main thread) claims through the one claim function (``Storage.lane_claim``)
whenever local capacity is free, and otherwise sleeps until a NOTIFY for its
queue, a handler freeing capacity, or the poll interval. No transaction is
held while a handler runs. The other roles live in their own modules, each
with one owner per piece of state (``docs/architecture.md``):

- :mod:`awa_fast.runtime.executor`: worker threads and the async loop,
  handler result to outcome, handler timeouts, abandoned attempts;
- :mod:`awa_fast.runtime.batcher`: durable outcomes, many per transaction;
- :mod:`awa_fast.runtime.heartbeat`: heartbeats and progress of held attempts;
- :mod:`awa_fast.runtime.listener`: LISTEN/NOTIFY wake-ups;
- :mod:`awa_fast.runtime.watchdog`: hung I/O and the handler-timeout tick;
- :mod:`awa_fast.runtime.attempts`: the held attempts (``held``,
  ``claimed_at``, ``stateful``) behind one lock;
- :mod:`awa_fast.runtime.entry`: the claimer process's entry point.

Handlers' errors, results and timeouts are described in ``docs/handlers.md``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg

from awa_fast._impl import claim_summary, flush_tally, new_jobs
from awa_fast.errors import DatabaseUnavailable
from awa_fast.jobs import MAX_PROGRESS_BYTES, AttemptClosed, ClaimSnapshot, Job, JobSpec
from awa_fast.limits import LimitWatch
from awa_fast.runtime.attempts import AttemptTable, Key
from awa_fast.runtime.batcher import BatcherConfig, CompletionBatcher, FlushReport
from awa_fast.runtime.entry import claimer_main, die_with_parent
from awa_fast.runtime.executor import Executor
from awa_fast.runtime.handler_outcome import error_text, failure_text, timeout_text
from awa_fast.runtime.heartbeat import Heartbeat, HeartbeatConfig
from awa_fast.runtime.listener import Listener, ListenerConfig, Wakeup
from awa_fast.runtime.stopflag import StopFlag
from awa_fast.runtime.watchdog import IoGuard, Watchdog, WatchdogConfig
from awa_fast.storage import Storage, close_quietly, connect, use_raw_jsonb
from awa_fast.storage.connection import PoolConnection

__all__ = ["LOCAL_WORK_S", "Claimer", "ClaimerConfig", "claim_ahead", "next_claim_size", "claimer_main",
           "die_with_parent",
           "error_text", "failure_text", "next_busy_pause", "timeout_text"]

log = logging.getLogger("awa_fast.claimer")
# A short claim of fewer rows than this may wait for a NOTIFY. Producers
# skip the NOTIFY while a lane has 64+ rows not covered by committed
# receipts, so rows of claims still committing count as backlog: it takes
# 8 such claims in flight at once to hide a new row until the poll.
_SHORT_CLAIM_SLEEPS = 8

# Pauses between claims that found every lane with work busy (another
# claimer holds the lane head for the length of its claim, a few ms).
_BUSY_PAUSE_FIRST = 0.002
_BUSY_PAUSE_MAX = 0.02


_WAITING_EVERY_S = 0.1
#: A failing flush listener's traceback is logged at most this often (seconds); the rest are counted.
LISTENER_LOG_EVERY_S = 60.0


def let_woken_workers_run() -> None:
    """Release the GIL once, so a thread waiting for it runs now (``time.sleep(0)`` drops and retakes it).

    The claim thread calls it after handing a quiet queue's short claim to an
    idle pool, on its way to sleep: the woken worker starts the handler ~0.1 ms
    sooner than when it waits for the claim thread's bookkeeping
    (docs/performance-log.md, 2026-12-07 hand-off).
    """
    time.sleep(0)


def _no_samples() -> dict[str, list[float]]:
    return {"pickup": [], "e2e": [], "handler": [], "flush_jobs": [], "flush_seconds": [], "claim_jobs": [],
            "claim_seconds": []}


def next_busy_pause(pause: float) -> float:
    """The pause after ``pause`` when the lane is still busy: doubling, at most 20 ms.

    Two stripes draining one lane take turns on its head. A pause that kept
    doubling towards the poll interval (1 s) let one stripe sleep while the
    other drained alone: 100k-job drains came out either ~96k or ~65k jobs/s.
    At the cap a holder stuck for good costs 50 empty claims a second.
    """
    return min(pause * 2.0, _BUSY_PAUSE_MAX)


#: Work an adaptive claimer may hold locally beyond its running handlers, in seconds of
#: handler time at the measured rate: enough to keep fast handlers fed between claims,
#: too little for slow ones to hoard jobs another claimer could run.
LOCAL_WORK_S = 0.1


def next_claim_size(size: int, got: int, asked: int, floor: int, ceiling: int,
                    avg_handler_s: float | None, concurrency: int, starving: bool = False) -> int:
    """The next claim size of an adaptive claimer, from what the last claim returned.

    A full claim (``got == asked``) doubles it, up to ``ceiling`` and to the jobs
    ``concurrency`` handlers finish in :data:`LOCAL_WORK_S` at the measured
    handler time; with no measure yet (async handlers) it grows only when the
    handlers were ``starving`` (fewer jobs held than ``concurrency`` when the
    claim was made). A claim that came back less than half full halves it, down
    to ``floor``. An idle queue so claims what its NOTIFYs bring at the floor
    size, and a deep backlog of fast handlers reaches ``ceiling`` in a few claims.
    """
    if got >= asked > 0:
        if avg_handler_s is None:
            return min(size * 2, ceiling) if starving else size
        cap = max(floor, int(concurrency * LOCAL_WORK_S / max(avg_handler_s, 1e-9)))
        return max(floor, min(size * 2, ceiling, cap))
    if got * 2 < asked:
        return max(floor, size // 2)
    return size


def claim_ahead(size: int, adaptive: bool, avg_handler_s: float | None = None, concurrency: int = 1) -> int:
    """How many claimed jobs may wait here for a worker, beside the ``concurrency`` running.

    A fixed batch (``batch=N``) buffers one claim: the next is asked for when
    the workers reach the last of it. An adaptive claimer buffers up to two, so the
    next claim (a round trip, a durable commit, and a wait when another
    claimer holds the lane head) is in flight while a whole claim's jobs are
    still queued: in a 200k drain the claim otherwise came when ~64 jobs, a
    millisecond of work, were left. The second claim is held only as far as
    two claims stay within ``2 x`` :data:`LOCAL_WORK_S` of measured handler
    work: the size is clamped up to its floor (16 or ``concurrency``) for
    slow handlers, and jobs held here count against ``max_running`` and the
    queue's deadline and are out of other claimers' reach. Unmeasured
    handlers (async ones, or before the first measure) buffer two claims.
    """
    if not adaptive:
        return size
    if avg_handler_s is None:
        return 2 * size
    budget = int(2 * concurrency * LOCAL_WORK_S / max(avg_handler_s, 1e-9))  # jobs in 2 x LOCAL_WORK_S
    return size + max(0, min(size, budget - size))


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
    # A claim, a completion flush or a LISTEN statement that gets no answer for
    # this long is taken as a half-open connection: its socket is shut down, which
    # turns the hang into an error the loops already recover from. The idle LISTEN
    # connection is pinged every io_timeout / 2 (without blocking, by the claim
    # thread) and replaced when a ping has no answer for io_timeout.
    io_timeout: float = 10.0
    max_progress_bytes: int = MAX_PROGRESS_BYTES  # encoded size limit of one job.set_progress() value
    # True: claim_batch is a ceiling; claims start at max(16, concurrency) and grow while they
    # come back full (see next_claim_size). False: every claim asks for up to claim_batch.
    adaptive_batch: bool = False



class Claimer:
    """Claims, runs and completes jobs of one queue stripe.

    Owns the claim connection, the capacity count (``outstanding``), the
    counters and the wiring of its roles; it is the batcher's
    :class:`~awa_fast.runtime.batcher.FlushSink` and the executor's
    :class:`~awa_fast.runtime.executor.ExecutorHooks`, and the ``runtime`` a
    :class:`~awa_fast.jobs.Job` talks to.
    """

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
        self.max_progress_bytes = config.max_progress_bytes  # read by Job.set_progress
        self._stopping = StopFlag()  # set by stop(), which a signal handler calls (see StopFlag)
        # Set by stop(), by handlers freeing capacity and by the listener's helper thread; the claim
        # loop sleeps on it and on the LISTEN socket at once (Listener.wait).
        self._wake = Wakeup()
        # False after a claim came back short (the queue looked empty to it):
        # finished handlers then do not wake the claim loop, only a NOTIFY or
        # the poll does. True while a backlog may remain behind a full claim.
        self._backlog_maybe = True
        self._died: str | None = None  # a worker, loop, heartbeat or watchdog thread that died: exit non-zero
        self.attempts = AttemptTable()
        tag = f"{config.queue}#{config.stripe}"
        self.batcher = CompletionBatcher(
            BatcherConfig(config.dsn, config.schema, flush_max=config.flush_max,
                          application_name=f"awa_fast:batcher:{tag}"), self)
        self.executor = Executor(registry, config.concurrency, self.batcher, self.attempts, self, self._stopping,
                                 shm_record)
        self.heartbeat = Heartbeat(
            HeartbeatConfig(config.dsn, config.schema, config.heartbeat_interval,
                            application_name=f"awa_fast:heartbeat:{tag}"),
            self.attempts, on_lost=self.executor.attempts_lost, on_cancel=self.executor.cancel_requested,
            on_death=lambda exc: self.thread_died("the heartbeat thread", exc))
        self.listener = (Listener(ListenerConfig(config.dsn, config.schema, config.queue, config.io_timeout),
                                  self._stopping) if config.listen else None)
        self._claim_guard = IoGuard("claim")
        guards = [self._claim_guard, self.batcher.guard] + ([self.listener.guard] if self.listener else [])
        self.watchdog = Watchdog(WatchdogConfig(max(config.heartbeat_interval / 2, 0.05), config.io_timeout),
                                 guards, on_tick=[self.executor.check_timeouts],
                                 on_death=lambda exc: self.thread_died("the watchdog thread", exc))
        self._outstanding = 0  # claimed and not yet finished (buffered + running)
        self._claim_at = config.concurrency  # held jobs at or below which a freed slot wakes the claim loop
        self._count_lock = threading.Lock()
        self._parent = os.getppid()
        self._claim_conn: psycopg.Connection | None = None
        self._clock_offset = 0.0  # database clock - local wall clock (latency metrics only)
        self._clock_measured = 0.0
        self.stats = {"claimed": 0, "completed": 0, "retried": 0, "failed": 0, "cancelled": 0,
                      "snoozed": 0, "stale": 0, "claim_calls": 0, "empty_claims": 0, "batches": 0}
        self._samples = _no_samples()  # histogram samples until the next publish (see runtime.shm.HISTOGRAMS)
        self._heartbeat_failures_published = 0
        self._waiting = 0  # the waiting gauge as last computed, and when (monotonic)
        self._waiting_at = -1e9
        self._listener_quiet: dict[int, tuple[float, int]] = {}  # listener index -> (logged at, failures since)
        self._stats_lock = threading.Lock()  # claim loop and batcher thread both count

    # -- lifecycle --------------------------------------------------------------------

    @property
    def outstanding(self) -> int:
        """Jobs claimed here and not yet handed to the batcher (buffered + running)."""
        return self._outstanding

    def stop(self) -> None:
        """Begin a graceful drain; safe from a signal handler at any point and from any thread.

        Both flags take no lock: the handler runs on the claim thread, which
        may be inside a wait on either of them when the signal lands (a
        ``threading.Event`` here blocked the handler on a lock its own
        thread held: the claimer never drained and was SIGKILLed). The
        supervisor sends SIGTERM twice; a second call changes nothing.
        ``_stopping`` first: the claim loop clears ``_wake`` before it looks
        at ``_stopping``.
        """
        self._stopping.set()
        self._wake.set()

    def run(self) -> int:
        """Claim and run jobs until :meth:`stop`; then drain. Returns an exit code (0 = clean)."""
        cfg = self.config
        self._set_state("starting")
        self.executor.publish_abandoned()  # a restarted claimer abandons nothing yet
        self.batcher.start()
        self.heartbeat.start()
        self.watchdog.start()
        self.executor.start()
        if self.listener is not None:
            self.listener.start(self._wake)
        self._set_state("running")
        log.info("claimer %s#%d running (concurrency %d, batch %s%d)", cfg.queue, cfg.stripe, cfg.concurrency,
                 "adaptive up to " if cfg.adaptive_batch else "", cfg.claim_batch, extra={"action": "claimer_start"})
        try:
            self._claim_loop()
        finally:
            code = self._drain()
        return code

    def close(self) -> None:
        """Release what a drained claimer still holds in-process (its async loop); a process just exits."""
        self.executor.close_loop()

    def _set_state(self, state: str) -> None:
        if self.shm is not None:
            self.shm.set_state(state)

    # -- the claim path -----------------------------------------------------------------

    def _claim_connection(self) -> psycopg.Connection:
        if self._claim_conn is None or self._claim_conn.closed:
            # a PoolConnection: the claim thread alone holds it, so the plain claim can run as a
            # statement prepared once on libpq (Storage.lane_claim_result)
            self._claim_conn = connect(self.config.dsn,
                                       application_name=f"awa_fast:claimer:{self.config.queue}#{self.config.stripe}",
                                       connect_timeout=int(self.config.io_timeout + 0.999),
                                       connection_class=PoolConnection)
            use_raw_jsonb(self._claim_conn)  # the claim's jsonb values as raw JSON bytes, cut by the codec
            # Snapshots' created_at in UTC: psycopg's loader skips the zone conversion it does
            # for a named zone ('Etc/UTC', 'Europe/Paris', ...), ~0.45 us of every claimed job.
            self.storage.session_utc(self._claim_conn)
            self.storage.session_read_committed(self._claim_conn)  # claims see receipts committed until they lock
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
        db_now = self.storage.session_clock(self._claim_conn)
        t1 = time.time()
        self._clock_offset = db_now - (t0 + t1) / 2
        self._clock_measured = time.monotonic()

    def _claim_loop(self) -> None:
        cfg = self.config
        backoff = 0.05
        floor = min(cfg.claim_batch, max(16, cfg.concurrency))
        size = floor if cfg.adaptive_batch else cfg.claim_batch  # the most the next claim asks for
        busy_pause = _BUSY_PAUSE_FIRST
        while not self._stopping.is_set():
            self._wake.clear()
            # Running handlers plus what is buffered locally: one claim, or for an adaptive
            # claimer two, so that the next claim is asked for while a whole claim's jobs
            # are still queued here (see claim_ahead).
            ahead = claim_ahead(size, cfg.adaptive_batch, self.executor.avg_handler_s, cfg.concurrency)
            self._claim_at = cfg.concurrency + ahead - size  # released() wakes the loop at this many held
            free = cfg.concurrency + ahead - self._outstanding
            if free >= size or (free > 0 and self._outstanding < cfg.concurrency):
                try:
                    conn = self._claim_connection()
                    if time.monotonic() - self._clock_measured > 300.0:
                        self._measure_clock_offset()
                    want = min(free, size)
                    held_before = self._outstanding
                    self._backlog_maybe = True
                    self._claim_guard.begin(conn)
                    claim_t0 = time.monotonic()
                    try:
                        snaps, lane_busy = self.limits.claim_call(conn)(conn, cfg.queue, want, cfg.stripe,
                                                                         cfg.stripes)
                    finally:
                        self._claim_guard.end()
                    backoff = 0.05
                except (psycopg.OperationalError, DatabaseUnavailable) as exc:
                    log.warning("claim on %s failed: %s; reconnecting in %.2fs", cfg.queue,
                                str(exc).strip().splitlines()[0] if str(exc) else exc, backoff,
                                extra={"action": "claim_error"})
                    self._close_claim_conn()
                    self._stopping.wait(backoff)
                    backoff = min(backoff * 2, 5.0)
                    continue
                self._claim_observed(time.monotonic() - claim_t0, len(snaps))
                if cfg.adaptive_batch and not (lane_busy and len(snaps) < want):
                    # (a short claim that met another claimer on the lane head, or a producer
                    # mid-reserve, says nothing about the backlog: keep the size)
                    size = next_claim_size(size, len(snaps), want, floor, cfg.claim_batch,
                                           self.executor.avg_handler_s, cfg.concurrency,
                                           starving=held_before < cfg.concurrency)
                if self._on_short_claim is not None and len(snaps) < want:
                    self._on_short_claim(lane_busy)
                if len(snaps) < want and not lane_busy and len(snaps) < _SHORT_CLAIM_SLEEPS:
                    # Drained for now: wait for a NOTIFY. A producer that
                    # reserved before this claim's end made it return the
                    # backlog marker (lane_busy); one that reserves later
                    # notifies unless the lane's backlog is 64+, and that
                    # backlog counts this claim's rows only until it commits,
                    # which is why only a claim of a few rows may sleep. A
                    # NOTIFY that arrived during the claim is read by the
                    # next _sleep, which then returns at once.
                    self._backlog_maybe = False
                elif lane_busy and not snaps:
                    # Another claimer holds that lane head right now: retry
                    # with a growing pause (a stuck holder costs no spin).
                    self.count("empty_claims", 1)
                    self._sleep(busy_pause)
                    busy_pause = min(next_busy_pause(busy_pause), cfg.poll_interval)
                    continue
                busy_pause = _BUSY_PAUSE_FIRST
                if snaps:
                    self._dispatch(snaps)
                    if self._backlog_maybe:
                        continue
                    if held_before == 0:
                        # A quiet queue's claim, and this loop sleeps next: let the worker the
                        # dispatch woke take the GIL now, not after this thread's publish and
                        # LISTEN poll. Never on the way to another claim, nor while other jobs
                        # run: the GIL would go to a busy worker and the claim loop wait for it.
                        let_woken_workers_run()
                else:
                    self.count("empty_claims", 1)
            self._publish()
            if self._watch_parent and os.getppid() != self._parent:
                log.error("supervisor %d is gone; draining", self._parent, extra={"action": "orphaned"})
                self.stop()
                break
            self._sleep(cfg.poll_interval)

    def _sleep(self, timeout: float) -> None:
        """Wait for a wake-up, a NOTIFY for this queue (read on this thread), or ``timeout`` seconds."""
        if self.listener is None:
            self._wake.wait(timeout)
        elif self.listener.wait(self._wake, timeout):
            self._notified()

    def _close_claim_conn(self) -> None:
        close_quietly(self._claim_conn)
        self._claim_conn = None

    def _dispatch(self, snaps: Sequence[ClaimSnapshot]) -> None:
        now = time.monotonic()
        receipts, kinds = claim_summary(snaps)  # one C pass: jobs per receipt, and the claim's kinds
        self.batcher.register_receipts(receipts)
        types = {kind: spec.args_type for kind, spec in self.registry.items()}  # a few kinds, per claim
        jobs = new_jobs(snaps, types, self)  # Job(s, types.get(s.kind), self) each, built in C
        self.attempts.claimed(jobs, now)
        n = len(jobs)
        self.count("claimed", n)
        with self._count_lock:
            self._outstanding += n
        self.executor.dispatch(jobs, kinds)

    def _notified(self) -> None:
        """A NOTIFY for this queue, or a fresh LISTEN (wake-ups may have been missed): there may be a backlog."""
        self._backlog_maybe = True

    # -- the executor's side (ExecutorHooks) --------------------------------------------

    def released(self, n: int) -> None:
        """``n`` attempts were handed to the batcher: their capacity is free."""
        with self._count_lock:
            self._outstanding -= n
        if self._backlog_maybe and not self._wake.is_set() and self._outstanding <= self._claim_at:
            self._wake.set()

    def _claim_observed(self, seconds: float, jobs: int) -> None:
        with self._stats_lock:
            self.stats["claim_calls"] += 1
            self._samples["claim_seconds"].append(seconds)
            self._samples["claim_jobs"].append(jobs)

    def count(self, key: str, n: int) -> None:
        """Add ``n`` to the counter ``key`` (any thread)."""
        with self._stats_lock:
            self.stats[key] += n

    def thread_died(self, what: str, exc: BaseException) -> None:
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

    def progress_changed(self, job: Job[Any]) -> None:
        self.heartbeat.progress_changed(job)

    def register_callback(self, job: Job[Any], timeout: float) -> str:
        conn = connect(self.config.dsn, application_name="awa_fast:callback")
        try:
            token = self.storage.attempt_register_callback(conn, job.snapshot, timeout)
        finally:
            conn.close()
        if token is None:
            raise RuntimeError(f"attempt of job {job.id} (run_lease {job.run_lease}) is no longer live")
        return str(token)

    # -- the batcher's side (FlushSink) --------------------------------------------------

    def stateful_among(self, keys: Iterable[Key]) -> set[Key]:
        return self.attempts.stateful_among(keys)

    def batcher_died(self) -> None:
        self.stop()

    def flushed(self, report: FlushReport) -> None:
        """After a flush (on the batcher thread): the attempts leave the table; counters, latencies, listeners.

        One pass over the flush (the codec's ``flush_tally``). The common
        outcome (the shared ``COMPLETED``, not stale) is counted without a
        lookup; jobs enqueued together share their ``created_at``, so its
        conversion to this process's clock is made once per run of equal
        values, not once per job.
        """
        pairs = report.jobs
        closed: list[AttemptClosed] | None = [] if self.flush_listeners else None
        # the one pass over the jobs, in the codec (C: ~the bytecode of a loop per job less)
        keys, completed, other, e2e, pickup, handler = flush_tally(pairs, report.stale, self._clock_offset,
                                                                   report.committed_at, closed)
        self.attempts.closed(keys)
        self.executor.forget_flushed(keys)
        with self._stats_lock:
            stats = self.stats
            stats["batches"] += 1
            stats["completed"] += completed
            for k, v in other.items():
                stats[k] += v
            samples = self._samples
            samples["e2e"].extend(e2e)
            samples["pickup"].extend(pickup)
            samples["handler"].extend(handler)
            samples["flush_jobs"].append(len(pairs))
            samples["flush_seconds"].append(report.seconds)
        if closed:
            for i, listener in enumerate(self.flush_listeners):
                try:
                    listener(closed)
                except Exception:  # noqa: BLE001 - a listener never breaks the queue
                    self._listener_failed(i, listener)
        if report.stale:
            log.info("%d stale outcomes rejected (attempt rescued or closed elsewhere)", len(report.stale),
                     extra={"action": "stale_outcomes"})
        self._publish()

    def _listener_failed(self, i: int, listener: Callable[..., Any]) -> None:
        """Log a flush listener's failure (in its except block): with its traceback at most once a minute.

        A listener that always fails would otherwise write a traceback per
        flush, several a second, and bury every other line of the log; the
        failures in between are counted in the next one logged.
        """
        now = time.monotonic()
        logged_at, quiet = self._listener_quiet.get(i, (-LISTENER_LOG_EVERY_S, 0))
        if now - logged_at < LISTENER_LOG_EVERY_S:
            self._listener_quiet[i] = (logged_at, quiet + 1)
            return
        self._listener_quiet[i] = (now, 0)
        log.exception("flush listener %r failed%s", listener,
                      f" (and {quiet} times since the last one logged)" if quiet else "",
                      extra={"action": "flush_listener_error"})

    def _publish(self) -> None:
        if self.shm is None:
            # an in-process worker: its counters stay here (its summary reads them), samples are not kept
            with self._stats_lock:
                self._samples = _no_samples()
            return
        with self._stats_lock:
            st, self.stats = self.stats, dict.fromkeys(self.stats, 0)
            samples, self._samples = self._samples, _no_samples()
            hb_failures = self.heartbeat.failures
            st["heartbeat_failures"] = hb_failures - self._heartbeat_failures_published
            self._heartbeat_failures_published = hb_failures
        now = time.monotonic()
        outstanding = self._outstanding
        if outstanding == 0:  # nothing held: exact without a scan (and never a stale count once idle)
            self._waiting, self._waiting_at = 0, now
        elif now - self._waiting_at >= _WAITING_EVERY_S:  # a scan of the held attempts: at most 10 a second
            self._waiting, self._waiting_at = self.attempts.not_started(), now
        self._waiting = min(self._waiting, outstanding)
        # one seqlock write; 'waiting': held here, handler not started (every worker slot busy)
        self.shm.publish(st, samples, in_flight=outstanding, waiting=self._waiting)

    # -- drain ---------------------------------------------------------------------------------

    def _drain(self) -> int:
        cfg = self.config
        self._set_state("draining")
        log.info("claimer %s#%d draining", cfg.queue, cfg.stripe, extra={"action": "drain_start"})
        if self.listener is not None:
            self.listener.close()  # no more claims: no more wake-ups
        # Hand back claimed jobs that never started: no attempt consumed.
        handed_back = self.executor.hand_back_unstarted()
        with self._count_lock:
            self._outstanding -= handed_back
        deadline = time.monotonic() + cfg.drain_timeout
        clean = self.executor.stop(deadline, lambda: self._outstanding)
        self.executor.close_timeouts()
        flushed = self.batcher.stop(max(1.0, deadline - time.monotonic()))
        self.watchdog.stop()  # after the batcher: its last flush is still watched
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
