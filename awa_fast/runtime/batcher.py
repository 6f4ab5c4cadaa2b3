"""The completion batcher: durable outcomes, many per transaction.

Handlers hand their outcome to :meth:`CompletionBatcher.submit` and return
at once (local capacity is released when the handler ends). A dedicated
thread with its own connection drains whatever has accumulated, up to
``flush_max`` outcomes, and writes them in one transaction: completions by
binary COPY from the claim snapshots (``Storage.receipt_complete``), every
other outcome through ``Storage.attempt_close``. When idle it flushes the
first outcome at once; under load batches grow by themselves.

A batch lost with the process is recovered by rescue, not by a replay log.
Connection failures retry the same batch: the ``(job_id, run_lease)``
guard makes a replay of a batch whose COMMIT did land change nothing.

What it consumes is one :class:`~awa_fast.outcomes.Outcome` record per
attempt (or an :class:`~awa_fast.outcomes.Unwritten` marker: parked for a
callback, or known stale), handed on with :meth:`CompletionBatcher.submit_many`.
The only calls back to its owner are the three of :class:`FlushSink`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import psycopg

from awa_fast.errors import DatabaseUnavailable
from awa_fast.jobs import ClaimSnapshot, Job
from awa_fast.outcomes import COMPLETED, CloseCode, Outcome, Unwritten
from awa_fast.runtime.watchdog import IoGuard
from awa_fast.storage import RawJson, Storage, close_quietly, connect
from awa_fast.storage.connection import PoolConnection

log = logging.getLogger("awa_fast.batcher")

Closed = tuple[Job[Any], Outcome | Unwritten]  # one finished attempt, as the executor hands it on


# -- messages on the batcher's queue (one type each; the batcher thread tells them apart by type) --


class _Receipts:
    """How many outcomes each receipt (claim_id) of a claim will produce."""

    __slots__ = ("counts",)

    def __init__(self, counts: dict[int, int]) -> None:
        self.counts = counts


class _Outcomes:
    """Finished attempts handed on together (one hand-off of a worker, the executor or the drain)."""

    __slots__ = ("items",)

    def __init__(self, items: list[Closed]) -> None:
        self.items = items


class _Stop:
    """Flush what came before, then end the thread."""

    __slots__ = ()


_STOP = _Stop()


@dataclass(frozen=True, slots=True)
class BatcherConfig:
    """Completion batcher settings."""

    dsn: str = field(repr=False)  # a DSN may carry a password
    schema: str
    flush_max: int = 2048
    # Flushes of at most this many completions (and nothing else) use the
    # one-statement path; larger ones use binary COPY.
    small_flush: int = 32
    application_name: str = "awa_fast:batcher"
    retry_backoff_max: float = 5.0


@dataclass(slots=True)
class FlushReport:
    """What one flush wrote: the jobs and how each ended (``ok``/``stale``)."""

    jobs: list[Closed]
    stale: set[tuple[int, int]]
    seconds: float
    committed_at: float


class FlushSink(Protocol):
    """The batcher's one interface to its owner (the claimer): all it may ever call back.

    Every method is called on the batcher thread and must not block on the
    claimer's other threads.
    """

    def stateful_among(self, keys: Iterable[tuple[int, int]]) -> set[tuple[int, int]]:
        """Of these attempts, those that may have an ``attempt_state`` row (their completion deletes it)."""

    def flushed(self, report: FlushReport) -> None:
        """A flush committed (or dropped outcomes): ``report`` says which attempts and how each ended."""

    def batcher_died(self) -> None:
        """The batcher thread died: nothing more will be written."""


class CompletionBatcher:
    """Collects handler outcomes and writes them in batched transactions."""

    def __init__(self, config: BatcherConfig, sink: FlushSink) -> None:
        self.config = config
        self.storage = Storage(config.schema)
        self._q: queue.SimpleQueue[_Receipts | _Outcomes | _Stop] = queue.SimpleQueue()
        self._sink = sink
        self._remaining: dict[int, int] = {}  # claim_id -> outcomes still expected
        self._thread = threading.Thread(target=self._run, name="awa-batcher", daemon=True)
        self._conn: psycopg.Connection | None = None
        self.flushes = 0
        self.dropped = 0  # outcomes that could not be written (their attempts get rescued)
        self.died = False
        self.guard = IoGuard("completion flush")  # the flush in flight, for the claimer's watchdog

    # -- producer side (claimer and handler threads) ----------------------------

    def register_receipts(self, counts: dict[int, int]) -> None:
        """Tell the batcher how many outcomes each receipt (claim_id) of a claim will produce.

        ``counts``: the codec's ``claim_summary`` of the claim's snapshots (one C pass, which
        also gives the executor the claim's kinds).
        """
        self._q.put(_Receipts(counts))

    def submit(self, job: Job[Any], outcome: Outcome | Unwritten) -> None:
        """Queue one attempt's outcome for the next flush."""
        self._q.put(_Outcomes([(job, outcome)]))

    def submit_many(self, outcomes: list[Closed]) -> None:
        """Queue several attempts' outcomes (one hand-off) for the next flush."""
        self._q.put(_Outcomes(outcomes))

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None = None) -> bool:
        """Flush everything submitted so far, then stop; True if the thread ended."""
        self._q.put(_STOP)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # -- the batcher thread ----------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException:
            # Without its batcher a claimer must not keep claiming: it exits
            # and its open attempts are rescued.
            log.exception("completion batcher died", extra={"action": "batcher_died"})
            self.died = True
            self._sink.batcher_died()

    def _loop(self) -> None:
        stopping = False
        while not stopping:
            item = self._q.get()
            batch: list[Closed] = []
            while True:
                if type(item) is _Outcomes:
                    batch.extend(item.items)
                elif type(item) is _Receipts:
                    for cid, n in item.counts.items():
                        self._remaining[cid] = self._remaining.get(cid, 0) + n
                else:
                    stopping = True
                if len(batch) >= self.config.flush_max:
                    break
                try:
                    item = self._q.get_nowait()
                except queue.Empty:
                    break
            if batch:
                self._flush_with_retry(batch)
        if self._conn is not None:
            self._conn.close()

    def _connection(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed:
            # PoolConnection: this thread alone uses it, so the quiet completion may run
            # through libpq itself (Storage.receipt_complete_rows)
            self._conn = connect(self.config.dsn, application_name=self.config.application_name,
                                 connection_class=PoolConnection)
            self.storage.session_index_probes(self._conn)  # plans that stay index probes as slots fill
            self.storage.session_read_committed(self._conn)
        return self._conn

    def _flush_with_retry(self, batch: list[Closed]) -> None:
        delay = 0.05
        replay = False
        while True:
            try:
                self._flush(batch, replay)
                return
            except (psycopg.OperationalError, DatabaseUnavailable) as exc:
                # The COMMIT may have landed with only its acknowledgement lost:
                # the next try is a replay and may find its own work done.
                replay = True
                log.warning("completion flush of %d outcomes failed (%s); retrying in %.2fs",
                            len(batch), str(exc).strip().splitlines()[0] if str(exc) else exc, delay,
                            extra={"action": "batcher_retry"})
                close_quietly(self._conn)
                self._conn = None
                time.sleep(delay)
                delay = min(delay * 2, self.config.retry_backoff_max)
            except psycopg.Error as exc:
                # Not a connection problem: write the batch one outcome at a
                # time so one bad item cannot hold back the rest. An item
                # that still fails stays open and is rescued later.
                log.error("completion flush failed (%s); retrying outcomes one by one", exc,
                          extra={"action": "batcher_split"})
                if len(batch) == 1:
                    log.error("dropping outcome of job %s: %s (its attempt will be rescued)",
                              batch[0][0].id, exc, extra={"action": "batcher_drop"})
                    self.dropped += 1
                    self._forget(batch)
                    return
                for one in batch:
                    self._flush_with_retry([one])
                return

    def _forget(self, batch: list[Closed]) -> None:
        for job, _ in batch:
            cid = job.snapshot.claim_id
            left = self._remaining.get(cid, 1) - 1
            if left <= 0:
                self._remaining.pop(cid, None)
            else:
                self._remaining[cid] = left
        self._sink.flushed(FlushReport(batch, {j.key for j, _ in batch}, 0.0, time.time()))

    def _flush(self, batch: list[Closed], replay: bool = False) -> None:
        t0 = time.perf_counter()
        conn = self._connection()
        self.guard.begin(conn)
        try:
            self._flush_on(conn, batch, t0, replay)
        finally:
            self.guard.end()

    def _flush_on(self, conn: psycopg.Connection, batch: list[Closed], t0: float,
                  replay: bool = False) -> None:
        completes = []
        others: list[tuple[ClaimSnapshot, int, float | None, str | None]] = []
        results: list[tuple[Job[Any], RawJson]] = []
        per_receipt: dict[int, list[int]] = {}  # claim_id -> [completions, all]
        known_stale: list[tuple[int, int]] = []
        slots: dict[int, int] = {}  # claim_id -> claim_slot, from its first job in the batch
        last_cid = None
        counts = [0, 0]
        for job, outcome in batch:
            s = job.snapshot
            cid = s.claim_id
            if cid != last_cid:  # a receipt's jobs come in runs: one lookup per run, no list per job
                last_cid = cid
                got = per_receipt.get(cid)
                if got is None:
                    got = per_receipt[cid] = [0, 0]
                    slots[cid] = s.claim_slot
                counts = got
            counts[1] += 1
            if outcome is COMPLETED:  # the common case first: a plain completion
                if not job.lease_backed:
                    completes.append(s)
                    counts[0] += 1
                else:
                    others.append((s, CloseCode.COMPLETE, None, None))
            elif outcome is Unwritten.STALE:  # two identity tests instead of type(): mypy narrows these
                known_stale.append((s.job_id, s.run_lease))
            elif outcome is Unwritten.PARKED:
                pass
            elif outcome.result is not None:
                r = outcome.result  # encode_payload's RawJson already (sent as jsonb, not bytea)
                results.append((job, r if type(r) is RawJson else RawJson(r)))
            elif outcome.code is CloseCode.COMPLETE and not job.lease_backed:
                completes.append(s)
                counts[0] += 1
            else:
                others.append((s, outcome.code, outcome.delay, outcome.error))
        whole = []
        for cid, (n_complete, n_all) in per_receipt.items():
            if n_complete == n_all and self._remaining.get(cid) == n_all:
                whole.append((slots[cid], cid))
        stateful = self._sink.stateful_among(j.key for j, _ in batch)  # lazy: usually none
        with_state = [s for s in completes if (s.job_id, s.run_lease) in stateful] if stateful else []
        if results:
            self._flush_with_results(conn, batch, completes, others, results, whole, with_state, stateful,
                                     per_receipt, t0, replay)
            return
        stale: set[tuple[int, int]] = set()
        if not others and len(completes) <= self.config.small_flush:
            # Low-latency path: one statement, one round trip, one commit.
            stale.update(self.storage.receipt_complete_rows(conn, completes, stateful))
        else:
            with conn.transaction():
                if others:
                    # lock every receipt of the flush up front, ascending: one lock order
                    self.storage.receipt_lock(conn, [s.claim_id for s in completes] + [o[0].claim_id for o in others])
                if completes:
                    stale.update(self.storage.receipt_complete(conn, completes, whole, with_state))
                if others:
                    for res in self.storage.attempt_close(conn, others):
                        if res.status == "stale":
                            stale.add((res.job_id, res.run_lease))
        if replay and stale:
            stale -= self._own_completions(conn, stale, completes)
        stale.update(known_stale)
        self._after_flush(batch, per_receipt, stale, t0)

    def _flush_with_results(self, conn: psycopg.Connection, batch: list[Closed],
                            completes: list[ClaimSnapshot], others: list[tuple[ClaimSnapshot, int, float | None,
                                                                               str | None]],
                            results: list[tuple[Job[Any], RawJson]], whole: list[tuple[int, int]],
                            with_state: list[ClaimSnapshot], stateful: set[tuple[int, int]],
                            per_receipt: dict[int, list[int]], t0: float, replay: bool) -> None:
        """A flush with result-carrying completions in it (the plain path above never comes here).

        Results go through their own binary COPY (``Storage.receipt_complete_results``:
        receipt guard, done rows with the result column, a closure per
        attempt); plain completions keep theirs. Alone, the results are one
        transaction of their own; mixed with other outcomes everything runs
        in one transaction after locking every receipt of the flush up
        front, ascending (the one lock order).
        """
        items = [(j.snapshot, j.lease_backed, r) for j, r in results]
        stale: set[tuple[int, int]] = set()
        if not completes and not others:
            stale.update(self.storage.receipt_complete_results(conn, items, stateful))
        else:
            with conn.transaction():
                self.storage.receipt_lock(conn, [s.claim_id for s in completes] + [o[0].claim_id for o in others]
                                          + [it[0].claim_id for it in items])
                if completes:
                    stale.update(self.storage.receipt_complete(conn, completes, whole, with_state))
                stale.update(self.storage.receipt_complete_results(conn, items, stateful))
                if others:
                    for r in self.storage.attempt_close(conn, others):
                        if r.status == "stale":
                            stale.add((r.job_id, r.run_lease))
        if replay and stale:
            stale -= self._own_completions(conn, stale, [*completes, *(it[0] for it in items)])
        self._after_flush(batch, per_receipt, stale, t0)

    def _own_completions(self, conn: psycopg.Connection, stale: set[tuple[int, int]],
                         completes: Sequence[ClaimSnapshot]) -> set[tuple[int, int]]:
        """Of a replayed flush's stale completions, those this batcher's lost-ack COMMIT did write.

        A completed row under the attempt's own run_lease can only come from
        the holder of that attempt, which is this batcher; rescue moves a job
        on under a new run_lease. Outcomes other than completion still count
        as stale on a replay.
        """
        mine = [s for s in completes if (s.job_id, s.run_lease) in stale]
        if not mine:
            return set()
        own = self.storage.attempts_completed(conn, mine)
        if own:
            log.info("replayed flush: %d completions were already committed by this batcher "
                     "(the acknowledgement of their COMMIT was lost)", len(own),
                     extra={"action": "replayed_completions"})
        return own

    def _after_flush(self, batch: list[Closed], per_receipt: dict[int, list[int]],
                     stale: set[tuple[int, int]], t0: float) -> None:
        committed = time.time()
        for cid, (_, n_all) in per_receipt.items():
            left = self._remaining.get(cid, n_all) - n_all
            if left <= 0:
                self._remaining.pop(cid, None)
            else:
                self._remaining[cid] = left
        self.flushes += 1
        self._sink.flushed(FlushReport(batch, stale, time.perf_counter() - t0, committed))
