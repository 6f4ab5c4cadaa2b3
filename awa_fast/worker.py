"""The in-process worker: the supervisor's children as threads of the calling process.

``app.run_worker(...)`` and ``await app.run_worker_async(...)`` run the same
:class:`~awa_fast.runtime.claimer.Claimer` as ``awa-fast supervise`` (one per
queue stripe, each on its own thread, with its own completion batcher and
heartbeat threads) and, with ``maintenance=True``, the same leader-elected
:class:`~awa_fast.runtime.maintenance.Maintenance` on a thread. The election
is the same advisory lock, so one of all workers and supervisors sharing the
schema leads. Nothing is forked and no shared-memory segment is created:
``awa-fast status`` shows the queues and the leader, not in-process claimers.

``until_empty=True`` returns once no job of the worker's queues is available
or running. The check costs nothing while work flows: it runs only when
every stripe has had a claim come back short, nothing is outstanding
locally (claimed and not yet handed to the batcher), and then asks the
database (``Storage.queue_work_exists``), which stays the authority: an
outcome not yet flushed still holds its receipt open, a claim not yet
committed still leaves its rows ready. Deferred jobs due later and attempts
parked for a callback do not count; due deferred jobs do (the maintenance
leader promotes them: with ``maintenance=False`` another process must lead).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
import threading
import time
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import psycopg

from awa_fast.errors import AwaFastError, ConfigError
from awa_fast.jobs import AttemptClosed
from awa_fast.periodic import sync_app_schedules
from awa_fast.runtime.claimer import Claimer, ClaimerConfig
from awa_fast.runtime.listener import Wakeup
from awa_fast.runtime.maintenance import Maintenance, MaintenanceConfig
from awa_fast.runtime.stopflag import StopFlag
from awa_fast.runtime.supervisor import QueueSpec, parse_queue_spec, resolve_stripes
from awa_fast.storage import Storage, close_quietly, connect

if TYPE_CHECKING:
    from awa_fast.app import App

log = logging.getLogger("awa_fast.worker")

#: ``{"email": {"concurrency": 8, "stripes": 1, "batch": 0}}``, a list of queue names, or one name.
QueuesArg = Mapping[str, Mapping[str, int] | None] | Iterable[str] | str | None

_QUEUE_KEYS = ("stripes", "concurrency", "batch")
_CHECK_PAUSE_FIRST = 0.01


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """Settings of one in-process worker (the supervisor's, minus processes)."""

    dsn: str
    schema: str
    queues: tuple[QueueSpec, ...]
    maintenance: bool = True
    until_empty: bool = False
    drain_timeout: float = 30.0
    poll_interval: float = 1.0
    heartbeat_interval: float = 5.0
    listen: bool = True
    io_timeout: float = 10.0
    maintenance_config: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class WorkerSummary:
    """What a worker wrote, counted from its completion flushes (durable outcomes only).

    Counts are what the handlers' outcomes wrote, as in
    :class:`~awa_fast.AttemptClosed`: a retry of the last allowed attempt is
    ``retried`` although the database moved the job to the DLQ. ``stale``
    outcomes changed nothing (the attempt was rescued or closed elsewhere).
    ``empty`` is True when ``until_empty`` ended the run; ``clean`` is False
    when a claimer did not drain within the drain timeout or an outcome
    could not be written (its attempt is rescued later).
    """

    completed: int
    retried: int
    failed: int
    cancelled: int
    snoozed: int
    stale: int
    claimed: int
    empty: bool
    clean: bool
    seconds: float
    claim_calls: int = 0  # claim function calls made (a deep backlog takes few, large claims)


def queue_specs(app: App, queues: QueuesArg) -> tuple[QueueSpec, ...]:
    """Validate ``queues`` (same options and ranges as ``supervise --queue``); None: the app's queues."""
    if queues is None:
        names = app.queues()
        if not names:
            raise ConfigError("no queues to work: register a handler with @app.job(...) "
                              "or pass queues={'name': {'concurrency': N}}")
        return tuple(QueueSpec(n) for n in names)
    if isinstance(queues, str):
        queues = [queues]
    items = list(queues.items()) if isinstance(queues, Mapping) else [(q, None) for q in queues]
    specs = []
    for name, opts in items:
        parts = []
        for key, value in (opts or {}).items():
            if key not in _QUEUE_KEYS:
                raise ConfigError(f"unknown option {key!r} for queue {name!r}: use {', '.join(_QUEUE_KEYS)}")
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"queue {name!r}: {key} must be an int, not {value!r}")
            parts.append(f"{key}={value}")
        specs.append(parse_queue_spec(f"{name}:{','.join(parts)}" if parts else str(name)))
    if not specs:
        raise ConfigError("queues is empty: name at least one queue")
    if len({s.name for s in specs}) != len(specs):
        raise ConfigError("a queue is named twice in queues")
    return tuple(specs)


class Worker:
    """Claimers (one thread per stripe) and optional maintenance, run inside this process."""

    def __init__(self, app: App, config: WorkerConfig) -> None:
        self.app = app
        self.config = config
        self.storage = Storage(config.schema)
        self.claimers: list[Claimer] = []
        self.maintenance: Maintenance | None = None
        self._threads: list[threading.Thread] = []
        self._maintenance_thread: threading.Thread | None = None
        # Both set by stop(), which a signal handler calls on the thread that may be waiting on _kick in
        # wait(): neither takes a lock (a threading.Event's set can block on a lock its own thread holds).
        self._stopping = StopFlag()
        self._kick = Wakeup()  # cleared and waited on by wait() only
        self._short_seen: set[int] = set()
        self._seen_empty = False  # a claim came back short with no busy lane since the last check
        self._errors: list[BaseException] = []
        self._codes: dict[int, int] = {}
        self._empty = False
        self._check_conn: psycopg.Connection | None = None
        self._started = 0.0

    # -- control -------------------------------------------------------------------

    def stop(self) -> None:
        """Begin a graceful drain; safe from a signal handler at any point and from any thread.

        Every flag it sets takes no lock, so a call that lands inside another
        (a second signal) is harmless. Not once-only: start() calls it again
        to reach the claimers created after an early stop.
        """
        self._stopping.set()
        for c in self.claimers:
            c.stop()
        if self.maintenance is not None:
            self.maintenance.stop()
        self._kick.set()

    def start(self) -> None:
        """Check the schema, then start every claimer thread and maintenance (returns at once)."""
        self._prepare_database()
        cfg = self.config  # stripe counts resolved against the stored settings
        self._started = time.monotonic()
        listeners = [*getattr(self.app, "flush_listeners", ()), self._on_flush]
        for q in cfg.queues:
            for stripe in range(q.stripes):
                ccfg = ClaimerConfig(cfg.dsn, cfg.schema, q.name, stripe, q.stripes, q.concurrency, q.claim_batch,
                                     cfg.poll_interval, heartbeat_interval=cfg.heartbeat_interval,
                                     drain_timeout=cfg.drain_timeout, listen=cfg.listen, io_timeout=cfg.io_timeout,
                                     adaptive_batch=q.adaptive_batch)
                index = len(self.claimers)
                self.claimers.append(Claimer(ccfg, self.app.registry, None, listeners,
                                             on_short_claim=functools.partial(self._on_short_claim, index),
                                             watch_parent=False))
        if cfg.maintenance:
            self.maintenance = Maintenance(MaintenanceConfig(cfg.dsn, cfg.schema, **dict(cfg.maintenance_config)))
            self._maintenance_thread = threading.Thread(target=self.maintenance.run, name="awa-maintenance",
                                                        daemon=True)
            self._maintenance_thread.start()
        for i, c in enumerate(self.claimers):
            t = threading.Thread(target=self._run_claimer, args=(i, c), daemon=True,
                                 name=f"awa-claimer-{c.config.queue}#{c.config.stripe}")
            self._threads.append(t)
            t.start()
        if self._stopping.is_set():  # stop() raced with start()
            self.stop()
        log.info("in-process worker running %d claimers on %s%s", len(self.claimers),
                 ", ".join(q.name for q in cfg.queues), " with maintenance" if cfg.maintenance else "",
                 extra={"action": "worker_start"})

    def wait(self) -> WorkerSummary:
        """Block until every claimer has drained (after :meth:`stop`, a failure, or ``until_empty``)."""
        next_check = 0.0
        pause = _CHECK_PAUSE_FIRST
        try:
            while any(t.is_alive() for t in self._threads):
                timeout = self.config.poll_interval
                if self.config.until_empty and next_check:
                    timeout = max(0.001, min(timeout, next_check - time.monotonic()))
                self._kick.wait(timeout)
                self._kick.clear()
                if not self.config.until_empty or self._stopping.is_set():
                    continue
                if self._seen_empty:
                    # A claimer saw nothing to claim: check as soon as nothing is outstanding.
                    self._seen_empty = False
                    pause, next_check = _CHECK_PAUSE_FIRST, 0.0
                if not self._locally_idle() or time.monotonic() < next_check:
                    continue
                if self._queues_empty():
                    self._empty = True
                    log.info("queues %s are empty; draining", ", ".join(q.name for q in self.config.queues),
                             extra={"action": "worker_empty"})
                    self.stop()
                else:
                    next_check = time.monotonic() + pause
                    pause = min(pause * 2, self.config.poll_interval)
            for t in self._threads:
                t.join()
        finally:
            if self.maintenance is not None:
                self.maintenance.stop()
            if self._maintenance_thread is not None:
                self._maintenance_thread.join(self.config.drain_timeout)
            close_quietly(self._check_conn)
            self._check_conn = None
            _forget(self)
        if self._errors:
            raise self._errors[0]
        if any(code != 0 for code in self._codes.values()) and not self._stopping_by_request:
            raise AwaFastError("a claimer of the in-process worker stopped on its own (its completion batcher "
                               "died); its open attempts will be rescued: see the awa_fast.claimer log")
        return self.summary()

    _stopping_by_request = True  # set False when a claimer ended before anyone asked

    def summary(self) -> WorkerSummary:
        """Totals over every claimer so far."""
        total = dict.fromkeys(("completed", "retried", "failed", "cancelled", "snoozed", "stale", "claimed"), 0)
        for c in self.claimers:
            for k in total:
                total[k] += c.stats.get(k, 0)
        clean = all(code == 0 for code in self._codes.values())
        calls = sum(c.stats.get("claim_calls", 0) for c in self.claimers)
        return WorkerSummary(**total, empty=self._empty, clean=clean,
                             seconds=time.monotonic() - self._started if self._started else 0.0,
                             claim_calls=calls)

    # -- threads ------------------------------------------------------------------------

    def _run_claimer(self, index: int, claimer: Claimer) -> None:
        code = 1
        try:
            code = claimer.run()
        except BaseException as exc:  # noqa: BLE001 - reported by wait() after the others drained
            log.exception("claimer %s#%d failed", claimer.config.queue, claimer.config.stripe,
                          extra={"action": "worker_claimer_failed"})
            self._errors.append(exc)
        finally:
            _close_event_loop(claimer)
            self._codes[index] = code
            if not self._stopping.is_set():
                # A claimer ended by itself: drain the rest rather than run half a worker.
                self._stopping_by_request = False
                self.stop()
            self._kick.set()

    def _on_short_claim(self, index: int, lane_busy: bool) -> None:
        # A short claim with a busy lane may be contention (another stripe holds the lane head) or
        # a lane whose tail is a rolled-back reservation: it counts, but the checks it allows back
        # off to the poll interval. One with no busy lane saw nothing claimable.
        self._short_seen.add(index)
        if not lane_busy:
            self._seen_empty = True
        self._kick.set()

    def _on_flush(self, closed: list[AttemptClosed]) -> None:
        self._kick.set()  # outstanding work may just have reached zero

    # -- until_empty ----------------------------------------------------------------------

    def _locally_idle(self) -> bool:
        return len(self._short_seen) == len(self.claimers) and all(c.outstanding == 0 for c in self.claimers)

    def _queues_empty(self) -> bool:
        try:
            if self._check_conn is None or self._check_conn.closed:
                self._check_conn = connect(self.config.dsn, application_name="awa_fast:worker")
            return not self.storage.queue_work_exists(self._check_conn, [q.name for q in self.config.queues])
        except (psycopg.Error, AwaFastError) as exc:
            log.warning("emptiness check failed (%s); trying again", exc, extra={"action": "worker_check_error"})
            close_quietly(self._check_conn)
            self._check_conn = None
            return False

    def _prepare_database(self) -> None:
        conn = connect(self.config.dsn, application_name="awa_fast:worker")
        try:
            self.storage.schema_check(conn)
            if self.storage.server_wal_level(conn) == "minimal":
                raise ConfigError("wal_level=minimal can rewind a new lane's cursor sequence after a crash "
                                  "(jobs stranded or enqueued twice): set wal_level=replica and restart PostgreSQL")
            for q in self.config.queues:
                self.storage.queue_ensure(conn, q.name)
            self.config = replace(self.config, queues=resolve_stripes(self.storage, conn, self.config.queues))
            sync_app_schedules(conn, self.storage, self.app)  # declared periodic jobs -> schedules
        finally:
            conn.close()


def _close_event_loop(claimer: Claimer) -> None:
    """Close the claimer's async-handler loop once its drain stopped it.

    A claimer process exits after its drain; in-process the loop and its
    self-pipe would otherwise leak until garbage collection.
    """
    claimer.close()


# -- running workers of each app (for App.stop_worker) -------------------------------------

_running: weakref.WeakKeyDictionary[Any, set[Worker]] = weakref.WeakKeyDictionary()
_running_lock = threading.Lock()


def _remember(worker: Worker) -> None:
    with _running_lock:
        _running.setdefault(worker.app, set()).add(worker)


def _forget(worker: Worker) -> None:
    with _running_lock:
        _running.get(worker.app, set()).discard(worker)


def stop_worker(app: App) -> int:
    """Ask every running in-process worker of ``app`` to drain; returns how many were asked."""
    with _running_lock:
        workers = list(_running.get(app, ()))
    for w in workers:
        w.stop()
    return len(workers)


def build_worker(app: App, queues: QueuesArg, *, maintenance: bool, until_empty: bool,
                 drain_timeout: float, poll_interval: float, listen: bool) -> Worker:
    """A worker for ``app`` (not started), registered for :func:`stop_worker`."""
    if drain_timeout <= 0 or poll_interval <= 0:
        raise ConfigError("drain_timeout and poll_interval must be positive (seconds)")
    config = WorkerConfig(app.resolve_dsn(), app.storage.schema, queue_specs(app, queues), maintenance=maintenance,
                          until_empty=until_empty, drain_timeout=drain_timeout, poll_interval=poll_interval,
                          listen=listen)
    worker = Worker(app, config)
    _remember(worker)
    return worker


def run_worker(app: App, queues: QueuesArg = None, *, maintenance: bool = True, until_empty: bool = False,
               install_signal_handlers: bool = True, drain_timeout: float = 30.0, poll_interval: float = 1.0,
               listen: bool = True) -> WorkerSummary:
    """Run an in-process worker until stopped (or until empty); see :meth:`awa_fast.App.run_worker`."""
    if install_signal_handlers and threading.current_thread() is not threading.main_thread():
        raise ConfigError("run_worker can install SIGINT/SIGTERM handlers only on the main thread: pass "
                          "install_signal_handlers=False and call app.stop_worker() to drain it")
    worker = build_worker(app, queues, maintenance=maintenance, until_empty=until_empty,
                          drain_timeout=drain_timeout, poll_interval=poll_interval, listen=listen)
    previous: dict[signal.Signals, Any] = {}
    try:
        if install_signal_handlers:
            for sig in (signal.SIGINT, signal.SIGTERM):
                previous[sig] = signal.signal(sig, lambda *_: worker.stop())
        worker.start()
        try:
            return worker.wait()
        except BaseException:
            # KeyboardInterrupt without our handlers, or an error: drain before it propagates.
            worker.stop()
            if any(t.is_alive() for t in worker._threads):  # noqa: SLF001
                worker.wait()
            raise
    finally:
        _forget(worker)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


async def run_worker_async(app: App, queues: QueuesArg = None, *, maintenance: bool = True,
                           until_empty: bool = False, drain_timeout: float = 30.0, poll_interval: float = 1.0,
                           listen: bool = True) -> WorkerSummary:
    """Run an in-process worker from a coroutine; see :meth:`awa_fast.App.run_worker_async`."""
    worker = build_worker(app, queues, maintenance=maintenance, until_empty=until_empty,
                          drain_timeout=drain_timeout, poll_interval=poll_interval, listen=listen)
    loop = asyncio.get_running_loop()
    done: asyncio.Future[WorkerSummary] = loop.create_future()

    def settle(result: WorkerSummary | None, exc: BaseException | None) -> None:
        if done.done():
            return
        if exc is not None:
            done.set_exception(exc)
        else:
            done.set_result(result)  # type: ignore[arg-type]

    def body() -> None:
        result: WorkerSummary | None = None
        error: BaseException | None = None
        try:
            worker.start()
            result = worker.wait()
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            error = exc
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the event loop is gone; nobody is waiting any more
            pass

    thread = threading.Thread(target=body, name="awa-worker", daemon=True)
    thread.start()
    try:
        return await asyncio.shield(done)
    except asyncio.CancelledError:
        worker.stop()
        while not done.done():  # the drain is bounded by drain_timeout
            try:
                await asyncio.shield(done)
            except asyncio.CancelledError:
                continue
            except BaseException:  # noqa: BLE001 - the cancellation is what the caller sees
                break
        if not done.cancelled() and done.exception() is not None:
            log.warning("in-process worker failed while draining after cancellation: %s", done.exception(),
                        extra={"action": "worker_drain_error"})
        raise
    finally:
        _forget(worker)
        if done.done():
            # The thread settled the future as its last step: it ends within microseconds. Joining it
            # here means a caller never sees a worker thread outlive run_worker_async.
            thread.join(1.0)
