"""The executor of one claimer: worker threads, the async loop, handler result to outcome, timeouts.

Sync handlers run on ``concurrency`` worker threads fed by one work queue in
chunks (one job per thread for slow handlers, large chunks for tiny ones);
``async def`` handlers run on one event loop thread, at most
``concurrency`` at a time. Whatever a handler raises, ``BaseException``
included, its attempt closes as a retry naming the exception, and outcomes
a worker had already produced are always handed on. A worker thread or the
event loop thread that dies anyway is reported (``on_thread_died``) and
the claimer stops loudly.

The executor owns the handler timeouts (``_timed``, under ``_timed_lock``)
and the abandoned attempts (``_abandoned``, under ``_abandoned_lock``):
sync attempts found stale while their handler still runs. The watchdog
thread calls :meth:`Executor.check_timeouts`; the heartbeat thread calls
:meth:`Executor.attempts_lost` and :meth:`Executor.cancel_requested`.
Finished attempts go to the batcher with one ``submit_many`` per hand-off,
and :meth:`ExecutorHooks.released` frees their capacity in the claim loop.
What a handler's result or exception becomes is in
:mod:`awa_fast.runtime.handler_outcome`.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import msgspec

from awa_fast import hooks as _attempt_hooks
from awa_fast.errors import ConfigError, TerminalError
from awa_fast.jobs import Job, JobSpec, attempt_timeout
from awa_fast.outcomes import CloseCode, Outcome, Unwritten
from awa_fast.runtime.attempts import AttemptTable, Key
from awa_fast.runtime.batcher import CompletionBatcher
from awa_fast.runtime.handler_outcome import (
    error_text,
    failure_text,
    one_line,
    returned_outcome,
    timeout_text,
    unknown_kind_text,
)
from awa_fast.runtime.stopflag import StopFlag

log = logging.getLogger("awa_fast.claimer")

# Claimed but never started when the drain began: given back without consuming an attempt
# (one shared record, told apart by identity from a handler's own Snooze).
_HAND_BACK = Outcome(CloseCode.SNOOZE, 0.0)


class ExecutorHooks(Protocol):
    """What the executor tells its claimer (the claim loop's side of the boundary)."""

    def released(self, n: int) -> None:
        """``n`` claimed attempts have ended here (handed to the batcher): their capacity is free."""

    def count(self, key: str, n: int) -> None:
        """Add ``n`` to the claimer counter ``key``."""

    def thread_died(self, what: str, exc: BaseException) -> None:
        """A thread the claimer cannot run without died."""


def check_weights(registry: dict[str, JobSpec], concurrency: int) -> None:
    """Refuse a kind whose ``weight`` exceeds the claimer's ``concurrency``: it could never start."""
    for spec in registry.values():
        if spec.weight > concurrency:
            raise ConfigError(f"kind {spec.kind!r} has weight={spec.weight} but this claimer's concurrency is "
                              f"{concurrency}: one attempt could never start; raise the queue's concurrency "
                              f"(--queue {spec.queue}:concurrency={spec.weight}) or lower the weight")


class WeightSlots:
    """The sync worker slots of one claimer, taken ``weight`` at a time, first come first served.

    An attempt of weight 4 takes 4 of ``concurrency`` slots. Waiters are served in arrival
    order: a light job that arrives after a heavy one waits until the heavy one has its slots
    (at most until enough running handlers end), so a heavy kind is never starved by a stream
    of light ones, and a light one never waits behind more than the heavy jobs queued before it.
    """

    __slots__ = ("_free", "_cond", "_next", "_serving")

    def __init__(self, concurrency: int) -> None:
        self._free = concurrency
        self._cond = threading.Condition()
        self._next = 0  # ticket of the next arrival
        self._serving = 0  # ticket allowed to take slots now

    def acquire(self, weight: int) -> None:
        with self._cond:
            ticket = self._next
            self._next += 1
            while ticket != self._serving or self._free < weight:
                self._cond.wait()
            self._free -= weight
            self._serving += 1
            self._cond.notify_all()

    def release(self, weight: int) -> None:
        with self._cond:
            self._free += weight
            self._cond.notify_all()


class Executor:
    """Runs the handlers of one claimer and turns what they return or raise into outcomes."""

    def __init__(self, registry: dict[str, JobSpec], concurrency: int, batcher: CompletionBatcher,
                 attempts: AttemptTable, hooks: ExecutorHooks, stopping: StopFlag,
                 shm_record: Any = None) -> None:
        self.registry = registry
        self.concurrency = concurrency
        self._batcher = batcher
        self._attempts = attempts
        self._hooks = hooks
        self._stopping = stopping
        self._shm = shm_record
        self._work: queue.SimpleQueue[list[Job[Any]] | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._async_slots: asyncio.Semaphore | None = None  # bounds async handlers to `concurrency`
        self._async_weight_gate: asyncio.Lock | None = None
        check_weights(registry, concurrency)
        # Only a registry with a kind of weight > 1 counts slots for sync attempts: others pay nothing.
        self._slots = (WeightSlots(concurrency) if any(s.weight > 1 and not s.is_async for s in registry.values())
                       else None)
        self._avg_handler_s: float | None = None  # EWMA of sync handler time, sizes dispatch chunks
        self._unknown_logged: set[str] = set()
        # Sync attempts found stale while their handler still runs (a thread cannot be stopped).
        self._abandoned: set[Key] = set()
        self._abandoned_lock = threading.Lock()
        # Attempts of kinds with a timeout whose handler runs: key -> [deadline (monotonic), job,
        # timeout, fired]. Only those kinds ever enter it, so others pay nothing for timeouts. The
        # watchdog thread fires expired ones; an entry stays (fired) until its handler returns, so
        # the handler's late outcome is dropped: one outcome per claimed attempt.
        self._timed: dict[Key, list[Any]] = {}
        self._timed_lock = threading.Lock()
        self._timeouts_closed = False  # set (under the lock) before the drain stops the batcher
        self._timed_out_sync = 0  # fired sync attempts whose handler still runs (in the abandoned gauge)

    # -- lifecycle --------------------------------------------------------------------

    def has_sync(self) -> bool:
        return any(not s.is_async for s in self.registry.values()) or not self.registry

    def has_async(self) -> bool:
        return any(s.is_async for s in self.registry.values())

    def start(self) -> None:
        """Start the worker threads (if any kind is sync) and the event loop thread (if any is async)."""
        for i in range(self.concurrency if self.has_sync() else 0):
            t = threading.Thread(target=self._worker, name=f"awa-worker-{i}", daemon=True)
            t.start()
            self._threads.append(t)
        if self.has_async():
            self._loop = asyncio.new_event_loop()
            self._loop_thread = threading.Thread(target=self._run_loop, name="awa-async", daemon=True)
            self._loop_thread.start()

    def hand_back_unstarted(self) -> int:
        """Draining: give back the jobs still waiting for a worker (no attempt consumed); returns how many."""
        n = 0
        while True:
            try:
                chunk = self._work.get_nowait()
            except queue.Empty:
                return n
            if chunk is None:
                continue
            self._batcher.submit_many([(job, _HAND_BACK) for job in chunk])
            n += len(chunk)

    def stop(self, deadline: float, outstanding: Callable[[], int]) -> bool:
        """Let running handlers end until ``deadline`` (monotonic); True if every one did.

        ``outstanding()``: the claimer's count of attempts not yet handed on
        (async handlers still running, once the worker threads are gone).
        """
        for _ in self._threads:
            self._work.put(None)
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        clean = not any(t.is_alive() for t in self._threads)
        if self._loop is not None:
            alive = self._loop_thread is not None and self._loop_thread.is_alive()
            while alive and outstanding() > 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            clean = clean and outstanding() == 0
            self._loop.call_soon_threadsafe(self._loop.stop)
        return clean

    def close_timeouts(self) -> None:
        """The batcher is about to stop: fire no more timeouts (rescue takes what is left)."""
        with self._timed_lock:
            self._timeouts_closed = True

    def close_loop(self) -> None:
        """Close the async-handler loop once the drain stopped it (in-process workers; a process just exits)."""
        loop, thread = self._loop, self._loop_thread
        if loop is None:
            return
        if thread is not None:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(5.0)
            if thread.is_alive():
                return
        if not loop.is_closed():
            loop.close()

    # -- dispatch ---------------------------------------------------------------------

    def dispatch(self, jobs: list[Job[Any]], kinds: set[str] | None = None) -> None:
        """Run freshly claimed jobs (the claim loop's thread); ``kinds``: theirs, if the caller has them."""
        registry = self.registry
        # one claim holds a few kinds: decide per kind, not per job (the caller's set is not changed)
        if kinds is None:
            kinds = {j.snapshot.kind for j in jobs}
        if not kinds.issubset(registry):
            self._unknown_kinds([j for j in jobs if j.snapshot.kind not in registry])
            jobs = [j for j in jobs if j.snapshot.kind in registry]
            kinds = kinds & registry.keys()
        async_kinds = {k for k in kinds if registry[k].is_async} if self._loop is not None else set()
        if not async_kinds:
            sync_jobs, async_jobs = jobs, []
        elif async_kinds == kinds:
            sync_jobs, async_jobs = [], jobs
        else:
            sync_jobs = [j for j in jobs if j.snapshot.kind not in async_kinds]
            async_jobs = [j for j in jobs if j.snapshot.kind in async_kinds]
        if sync_jobs:
            per = self._chunk_size(len(sync_jobs))
            for i in range(0, len(sync_jobs), per):
                self._work.put(sync_jobs[i:i + per])
        if async_jobs and self._loop is not None:
            self._loop.call_soon_threadsafe(self._spawn_async, async_jobs)

    def _unknown_kinds(self, jobs: list[Job[Any]]) -> None:
        """No handler here: retry with backoff (DLQ only when attempts run out).

        During a rolling deploy producers may know a kind before this worker
        does; a worker that has it may claim the retry. Logged once per kind.
        """
        for kind in sorted({j.kind for j in jobs} - self._unknown_logged):
            self._unknown_logged.add(kind)
            log.warning("no handler for kind %r in this worker: its jobs are retried with backoff "
                        "(the DLQ takes them when their attempts run out)", kind, extra={"action": "unknown_kind"})
        self._finish([(j, Outcome(CloseCode.RETRY, error=unknown_kind_text(j.kind))) for j in jobs])

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

    @property
    def avg_handler_s(self) -> float | None:
        """The running average time of one sync handler call (None until measured; async: None)."""
        return self._avg_handler_s

    def is_async(self, job: Job[Any]) -> bool:
        spec = self.registry.get(job.kind)
        return spec is not None and spec.is_async

    # -- sync handlers ----------------------------------------------------------------

    def _worker(self) -> None:
        try:
            self._work_loop()
        except BaseException as exc:  # noqa: BLE001 - a bug: _run_sync catches everything a handler raises
            self._hooks.thread_died(f"worker thread {threading.current_thread().name}", exc)

    def _work_loop(self) -> None:
        perf = time.perf_counter
        stopping = self._stopping
        run = self._run_sync
        while True:
            chunk = self._work.get()
            if chunk is None:
                return
            done: list[tuple[Job[Any], Outcome | Unwritten]] = []
            t0 = perf()
            try:
                for i, job in enumerate(chunk):
                    if stopping.is_set():
                        # Draining: hand back what has not started (no attempt consumed).
                        done.extend((j, _HAND_BACK) for j in chunk[i:])
                        break
                    done.append((job, run(job)))
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

    def _run_sync(self, job: Job[Any]) -> Outcome | Unwritten:
        """Run one sync attempt on this worker thread: its slots, its start stamp and timeout, the handler.

        One frame per attempt: the weight slots (only when a weighted kind is
        registered), the start stamp, the timeout watch (a job without
        metadata is not decoded for it), the per-attempt hook (None unless
        tracing or the log context is on) and the handler duration stamp are
        all inline. Split over three calls, they cost ~80-100 ns of every
        attempt of a drain that uses none of them (docs/performance-log.md,
        feature-cost).
        """
        spec = self.registry.get(job.kind)
        if spec is None:
            return Outcome(CloseCode.RETRY, error=unknown_kind_text(job.kind))
        slots = self._slots
        if slots is not None:
            slots.acquire(spec.weight)  # weighted kinds registered: every sync attempt takes its slots
        try:
            job.started_at = time.time()
            timeout = spec.timeout if job.snapshot.metadata is None else attempt_timeout(job, spec)
            if timeout is not None:
                self._arm_timeout(job, timeout)
            try:
                scope = _attempt_hooks.around  # tracing / log context (awa_fast/hooks.py): None unless enabled
                if scope is None:
                    return returned_outcome(job, spec.handler(job))
                with scope(job):
                    result = spec.handler(job)
                return returned_outcome(job, result)
            except BaseException as exc:  # noqa: BLE001 - SystemExit, KeyboardInterrupt, ... retry like any failure
                return self._failed(job, spec, exc)
            finally:
                job.finished_at = time.time()  # the handler duration metric
        finally:
            if slots is not None:
                slots.release(spec.weight)

    # -- async handlers ---------------------------------------------------------------

    def _run_loop(self) -> None:
        """The event loop thread: a loop that stops or dies while the claimer runs stops the claimer."""
        assert self._loop is not None
        try:
            self._loop.run_forever()
        except BaseException as exc:  # noqa: BLE001 - _run_async catches everything a handler raises
            self._hooks.thread_died("the event loop thread", exc)
            return
        if not self._stopping.is_set():
            self._hooks.thread_died("the event loop thread", RuntimeError(
                "the event loop stopped while the claimer runs (loop.stop() in a handler?)"))

    def _spawn_async(self, jobs: list[Job[Any]]) -> None:
        if self._async_slots is None:
            self._async_slots = asyncio.Semaphore(self.concurrency)
            self._async_weight_gate = asyncio.Lock()  # one weighted task gathers its slots at a time
        for job in jobs:
            job._task = asyncio.ensure_future(self._run_async(job))  # noqa: SLF001 - cancelled when stale

    async def _run_async(self, job: Job[Any]) -> None:
        assert self._async_slots is not None and self._async_weight_gate is not None
        outcome: Outcome | Unwritten = _HAND_BACK
        slots = self._async_slots
        weight = self.registry[job.kind].weight
        taken = 0
        try:
            if weight == 1:
                await slots.acquire()
                taken = 1
            else:
                # A weighted task gathers all its slots under the gate, so two of them never
                # each hold part of what the other needs (no deadlock), in arrival order.
                async with self._async_weight_gate:
                    for _ in range(weight):
                        await slots.acquire()
                        taken += 1
            if self._stopping.is_set():
                return  # draining: hand back (no attempt consumed)
            outcome = await self._run_async_handler(job)
        except BaseException as exc:  # noqa: BLE001 - cancelled while waiting for a slot
            outcome = self._interrupted(job, exc)
        finally:
            for _ in range(taken):
                slots.release()
            self._finish([(job, outcome)])

    async def _run_async_handler(self, job: Job[Any]) -> Outcome | Unwritten:
        spec = self.registry[job.kind]
        self._attempt_started(job, spec)
        try:
            scope = _attempt_hooks.around  # tracing / log context (awa_fast/hooks.py): None unless enabled
            if scope is None:
                return returned_outcome(job, await spec.handler(job))
            with scope(job):
                result = await spec.handler(job)
            return returned_outcome(job, result)
        except BaseException as exc:  # noqa: BLE001 - SystemExit, KeyboardInterrupt, CancelledError, ...
            if isinstance(exc, asyncio.CancelledError) and job._cancelled:  # noqa: SLF001 - we cancelled it
                return self._interrupted(job, exc)
            return self._failed(job, spec, exc)
        finally:
            job.finished_at = time.time()  # the handler duration metric

    # -- handler result to outcome ----------------------------------------------------

    def _failed(self, job: Job[Any], spec: JobSpec, exc: BaseException) -> Outcome:
        """The outcome of a handler that raised ``exc``, logged (WARNING, the traceback at DEBUG).

        ``TerminalError`` fails the job (DLQ); so does job args that do not decode into the
        kind's ``args_type`` (retrying cannot fix them). Anything else retries. The stored
        error carries the tail of the traceback.
        """
        code = CloseCode.RETRY
        text = None
        if isinstance(exc, TerminalError):
            code = CloseCode.FAIL
        elif isinstance(exc, msgspec.ValidationError) and spec.args_type is not None and self._bad_args(job):
            code = CloseCode.FAIL
            text = error_text(f"job args do not match args_type {getattr(spec.args_type, '__name__', spec.args_type)}"
                              f": {error_text(exc)}")
        if text is None:
            text = failure_text(exc)
        if not job.is_abandoned():  # a rescued or timed-out attempt's failure is written by no one
            log.warning("job %d (kind %r, attempt %d) %s: %s", job.id, job.kind, job.attempt,
                        "failed for good" if code == CloseCode.FAIL else "failed", one_line(text),
                        extra={"action": "handler_error"})
            if log.isEnabledFor(logging.DEBUG):
                log.debug("traceback of job %d (attempt %d)", job.id, job.attempt, exc_info=exc,
                          extra={"action": "handler_traceback"})
        return Outcome(code, error=text)

    @staticmethod
    def _bad_args(job: Job[Any]) -> bool:
        """True if the job's args do not decode into its kind's args_type (the failure path only)."""
        try:
            job.args  # noqa: B018 - decodes again: a failed decode is not cached
        except msgspec.ValidationError:
            return True
        except Exception:  # noqa: BLE001
            return False
        return False

    def _interrupted(self, job: Job[Any], exc: BaseException) -> Outcome | Unwritten:
        """The outcome of an attempt whose handler raised ``exc`` (anything but TerminalError).

        A CancelledError after this claimer cancelled the task is no failure:
        a stale attempt (rescued, closed elsewhere) writes nothing, an attempt
        with a cancel request ends as cancelled. Anything else retries.
        """
        if isinstance(exc, asyncio.CancelledError):
            if job.is_abandoned():
                return Unwritten.STALE
            if job._cancelled:  # noqa: SLF001
                return Outcome(CloseCode.CANCEL, error="cancelled while running (cancel requested)")
        return Outcome(CloseCode.RETRY, error=failure_text(exc))

    def _finish(self, done: list[tuple[Job[Any], Outcome | Unwritten]]) -> None:
        """Hand finished attempts to the batcher and free their local capacity."""
        parked = [job for job, outcome in done if outcome is Unwritten.PARKED]
        if parked:
            self._attempts.parked(parked)
        n = len(done)
        if self._timed:
            done = self._disarm(done)
        if self._abandoned:
            self._abandoned_returned(done)
        if done:
            self._batcher.submit_many(done)
        self._hooks.released(n)  # a timed-out attempt's capacity is freed here, once, when its handler ends

    # -- handler timeouts -------------------------------------------------------------

    def _attempt_started(self, job: Job[Any], spec: JobSpec) -> None:
        """A handler is about to run: stamp its start and watch its timeout (the job's own, else its kind's).

        (The async path's; ``_run_sync`` does the same inline.) A job without
        metadata has no timeout of its own: its kind's is read without a call
        to ``attempt_timeout``.
        """
        job.started_at = time.time()
        timeout = spec.timeout if job.snapshot.metadata is None else attempt_timeout(job, spec)
        if timeout is not None:
            self._arm_timeout(job, timeout)

    def _arm_timeout(self, job: Job[Any], timeout: float) -> None:
        with self._timed_lock:
            self._timed[job.key] = [time.monotonic() + timeout, job, timeout, False]

    def _disarm(self, done: list[tuple[Job[Any], Outcome | Unwritten]]) -> list[tuple[Job[Any], Outcome | Unwritten]]:
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
                entry = self._timed.pop(job.key, None)
                if entry is not None and entry[3]:
                    if not self.is_async(job):
                        late_sync += 1
                    continue
                keep.append(item)
            self._timed_out_sync -= late_sync
        dropped = len(done) - len(keep)
        if dropped:
            self._hooks.count("stale", dropped)
            if late_sync:
                log.info("%d timed-out sync handler(s) returned late: outcome discarded", late_sync,
                         extra={"action": "timeout_late_return"})
                self.publish_abandoned()
        return keep

    def check_timeouts(self) -> None:
        """Close attempts past their kind's timeout (on the watchdog thread, every tick).

        Looks only at attempts of kinds with a timeout. Each expired one is marked fired under
        the lock (its handler's outcome will be dropped), told (``job.is_cancelled()``), closed
        as a retry through the batcher, and an async handler's task is cancelled; a sync handler
        runs on until it returns, counted as abandoned.
        """
        if not self._timed:
            return
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
                    if not self.is_async(job):
                        self._timed_out_sync += 1
            if not fired:
                return
            for _, job, _, _ in fired:
                job._stale = True  # noqa: SLF001 - whatever the handler returns now is discarded
                job._cancelled = True  # noqa: SLF001
            out: list[tuple[Job[Any], Outcome | Unwritten]] = [
                (job, Outcome(CloseCode.RETRY, error=timeout_text(timeout))) for _, job, timeout, _ in fired]
            # submitted under the lock: the drain cannot stop the batcher between fire and submit
            self._batcher.submit_many(out)
        for _, job, timeout, _ in fired:
            kind = "async" if self.is_async(job) else "sync"
            log.warning("job %d (kind %r, attempt %d) timed out after %g s: closed as a retry; its %s handler %s",
                        job.id, job.kind, job.attempt, timeout, kind,
                        "is cancelled" if kind == "async" else "cannot be stopped and is abandoned",
                        extra={"action": "handler_timeout"})
        for job, _ in out:
            if self.is_async(job):
                self._cancel_task(job)
        self.publish_abandoned()

    # -- attempts closed elsewhere while running --------------------------------------

    def attempts_lost(self, jobs: list[Job[Any]]) -> None:
        """The heartbeat found these attempts stale: rescued (deadline, heartbeat timeout) or closed elsewhere.

        ``job.is_cancelled()`` is already True. An async handler's task is
        cancelled (its outcome then writes nothing); a sync handler cannot be
        stopped: it is counted as abandoned until it returns, and what it
        returns is discarded.
        """
        abandoned = []
        for job in jobs:
            key = (job.id, job.run_lease)
            if self.is_async(job):
                log.warning("attempt of job %d (run_lease %d) was rescued or closed elsewhere: cancelling its "
                            "async handler", job.id, job.run_lease, extra={"action": "attempt_lost"})
                self._cancel_task(job)
            else:
                log.warning("attempt of job %d (run_lease %d) was rescued or closed elsewhere: its sync handler "
                            "cannot be stopped and is abandoned (job.is_cancelled() is now True)", job.id,
                            job.run_lease, extra={"action": "attempt_lost"})
                abandoned.append(key)
        if abandoned:
            # Lock order: _abandoned_lock, then the attempt table's. A flush closes its attempts in
            # the table first and forgets them here after, so a key added here is never left behind.
            with self._abandoned_lock:
                self._abandoned.update(self._attempts.held_among(abandoned))
            self.publish_abandoned()

    def cancel_requested(self, jobs: list[Job[Any]]) -> None:
        """An operator asked to cancel these running attempts: cancel the async ones' tasks."""
        for job in jobs:
            if self.is_async(job):
                log.info("cancel requested for job %d (run_lease %d): cancelling its async handler", job.id,
                         job.run_lease, extra={"action": "attempt_cancel"})
                self._cancel_task(job)

    def _cancel_task(self, job: Job[Any]) -> None:
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

    def _abandoned_returned(self, done: list[tuple[Job[Any], Outcome | Unwritten]]) -> None:
        """Abandoned sync handlers that returned: nothing to write, and no longer counted."""
        changed = False
        with self._abandoned_lock:
            for i, (job, _) in enumerate(done):
                key = job.key
                if key in self._abandoned:
                    self._abandoned.discard(key)
                    done[i] = (job, Unwritten.STALE)
                    changed = True
        if changed:
            self.publish_abandoned()

    def forget_flushed(self, keys: Sequence[Key]) -> None:
        """Attempts a flush closed: an abandoned one found stale after its handler returned is done."""
        if self._abandoned:
            with self._abandoned_lock:
                self._abandoned.difference_update(keys)
            self.publish_abandoned()

    def publish_abandoned(self) -> None:
        """Publish the abandoned gauge (sync handlers still running for a closed attempt)."""
        if self._shm is not None:
            self._shm.set_abandoned(len(self._abandoned) + self._timed_out_sync)
