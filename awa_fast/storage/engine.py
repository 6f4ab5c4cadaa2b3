"""The storage engine's table of contents: class :class:`Storage`, every named query.

It reads like a table of contents of the storage engine (ADR-019/023):
enqueue (``job_enqueue``, ``job_enqueue_many``, ``job_enqueue_copy``), the
claim path (``lane_claim``), completion (``receipt_complete``), attempt
transitions (``attempt_close``, ``attempt_heartbeat``,
``attempt_register_callback``, ``callback_resolve``, ``job_cancel``),
maintenance (``deferred_promote``, ``receipt_rescue_stale``,
``lease_rescue_expired``, ``ring_rotate``, ``ring_prune``,
``dlq_retention_prune``) and reads (``queue_depth_fast``,
``queue_counts_exact``, ``job_load``, ``dlq_list``).

Every method takes the psycopg connection to run on, so enqueue joins the
caller's own transaction. Names follow the named queries in
``awa_fast/sql/queries.sql``.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import itertools
import re
import struct
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import psycopg

from awa_fast import _impl
from awa_fast.errors import ConfigError, SchemaNotMigrated, SchemaTooNew
from awa_fast.jobs import ClaimSnapshot
from awa_fast.limits import KEEP as _LIMIT_KEEP
from awa_fast.storage.connection import AsyncPoolConnection, PoolConnection, clean_text
from awa_fast.storage.copy_rows import COPY_LANES, encode_done_result_rows
from awa_fast.storage.copy_rows import copy_blocks as _copy_blocks
from awa_fast.storage.keys import KeyLimitQueries
from awa_fast.storage.schema import latest_version, named_queries, render, validate_schema
from awa_fast.storage.sessions import SessionQueries
from awa_fast.storage.types import AttemptResult, LaneRange, RawJson, as_jsonb

R = TypeVar("R")

if TYPE_CHECKING:
    from awa_fast.limits import QueueLimits



# Longest per-attempt deadline queue_configure accepts (ten years, like delays).
_MAX_DEADLINE_S = 10 * 365 * 86400.0
DEFAULT_DEADLINE_S = 3600.0  # queue_meta.deadline default (sql/0005_runtime_hardening.sql)

_READY_COPY = ("COPY __SCHEMA__.ready_entries_{slot} (ready_slot, lane_id, lane_seq, job_id, kind, args, metadata,"
               " attempt, max_attempts, lease_base) FROM STDIN (FORMAT binary)")
_DONE_RESULT_COPY = ("COPY __SCHEMA__.done_entries (ready_slot, job_id, lane_id, lane_seq, run_lease, attempt, state,"
                     " queue, kind, result) FROM STDIN (FORMAT binary)")
_CLOSURE_COPY = ("COPY __SCHEMA__.lease_claim_closures (claim_slot, claim_id, job_id, run_lease, outcome)"
                 " FROM STDIN (FORMAT binary)")


_INT4 = struct.Struct("!i")
_INT8 = struct.Struct("!q")


def _direct_statement(query: str) -> tuple[bytes, bytes]:
    """A named query for :meth:`PoolConnection.run_prepared`: its ``%s`` become ``$1..$n``; its name."""
    n = itertools.count(1)
    sql = re.sub(r"%s", lambda _m: f"${next(n)}", query).encode()
    return b"awa_fast_" + hashlib.blake2b(sql, digest_size=8).hexdigest().encode(), sql


def _enqueue_direct_params(queue: str, priority: int, kind: str, args: RawJson, metadata: RawJson | None,
                           max_attempts: int) -> tuple[bytes | None, ...]:
    """``job_enqueue_v3``'s parameters in binary for a job to run now (jsonb: version byte 1, then the text)."""
    return (queue.encode(), _INT4.pack(priority), kind.encode(), b"\x01" + args,
            None if metadata is None else b"\x01" + metadata, _INT4.pack(max_attempts), None)


def _job_id(res: psycopg.pq.abc.PGresult) -> int:
    """The bigint job id in the first cell of ``job_enqueue_v3``'s binary result."""
    value = res.get_value(0, 0)
    if value is None:  # pragma: no cover - job_enqueue_v3 never returns NULL
        raise AssertionError("job_enqueue_v3 returned NULL")
    return int(_INT8.unpack(value)[0])


def _idle_autocommit(conn: psycopg.Connection | psycopg.AsyncConnection) -> bool:
    """Whether a call on ``conn`` would be its own transaction: autocommit, and none open."""
    return conn.autocommit and conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE


class Storage(KeyLimitQueries, SessionQueries):
    """All SQL of one awa-fast schema. Stateless apart from its rendered queries."""

    __slots__ = ("schema", "q", "channel", "_closure_copy", "_done_result_copy", "_enqueue_direct",
                 "_complete_rows_direct", "_claims_direct")

    def __init__(self, schema: str = "awa_fast") -> None:
        self.schema = validate_schema(schema)
        self.q = named_queries(schema)
        self.channel = f"awa_fast_{schema}"
        self._closure_copy = render(_CLOSURE_COPY, schema)
        self._done_result_copy = render(_DONE_RESULT_COPY, schema)
        self._enqueue_direct = _direct_statement(self.q["job_enqueue"])
        self._complete_rows_direct = _direct_statement(self.q["receipt_complete_rows"])
        self._claims_direct = {name: _direct_statement(self.q[name])
                               for name in ("lane_claim", "lane_claim_limited", "lane_claim_keyed")}

    def __repr__(self) -> str:
        return f"Storage(schema={self.schema!r})"

    # -- schema ---------------------------------------------------------------

    def schema_check(self, conn: psycopg.Connection) -> None:
        """Raise :class:`SchemaNotMigrated` or :class:`SchemaTooNew` unless the schema matches."""
        from awa_fast.storage.migrate import schema_version

        found = schema_version(conn, self.schema)
        expected = latest_version()
        if found < expected:
            raise SchemaNotMigrated(self.schema, expected, found or None)
        if found > expected:
            from awa_fast.storage.compat import check_newer

            check_newer(conn, self.schema, expected, found)  # raises SchemaTooNew unless declared compatible

    # -- enqueue --------------------------------------------------------------

    def job_enqueue(self, conn: psycopg.Connection | psycopg.Cursor[Any], queue: str, priority: int, kind: str,
                    args: RawJson, metadata: RawJson | None, max_attempts: int, run_at: _dt.datetime | None = None,
                    delay: float | None = None) -> int:
        """Enqueue one job on ``conn`` (in its current transaction); returns the job id.

        Calls ``job_enqueue_v3`` (migration 0025): one SQL function frame for the lane lock, the
        rows and the NOTIFY decision, which reads the lane's receipts in the claim ring only where
        its claim cursor and receipt mark (two sequences) cannot settle it. ``job_enqueue_v2`` and
        ``job_enqueue`` stay in the schema for the previous runtimes.
        ``conn`` may be a cursor its caller holds alone (the App's pool connections keep one): a
        new cursor per call costs ~14 µs of client CPU, a fifth of the call (performance-log,
        2026-12-02 producers).
        """
        if delay is not None and delay > 0:
            row = conn.execute(self.q["job_enqueue_in"],
                               (queue, priority, kind, args, metadata, max_attempts, delay)).fetchone()
        else:
            row = conn.execute(self.q["job_enqueue"],
                               (queue, priority, kind, args, metadata, max_attempts, run_at)).fetchone()
        assert row is not None
        return int(row[0])

    def job_enqueue_direct(self, conn: PoolConnection, queue: str, priority: int, kind: str, args: RawJson,
                           metadata: RawJson | None, max_attempts: int) -> int:
        """:meth:`job_enqueue` of a job to run now, as its own transaction on an idle pool connection.

        The same ``job_enqueue_v3`` call, run as a prepared statement through libpq with its
        parameters encoded here in binary (:meth:`PoolConnection.run_prepared`): ~40 µs less
        client CPU per call than the cursor path, in a scenario bound by client and server CPU
        together (performance-log, 2026-12-05 producers).
        """
        name, sql = self._enqueue_direct
        return _job_id(conn.run_prepared(name, sql, _enqueue_direct_params(
            queue, priority, kind, args, metadata, max_attempts)))

    async def job_enqueue_direct_async(self, conn: AsyncPoolConnection, queue: str, priority: int, kind: str,
                                       args: RawJson, metadata: RawJson | None, max_attempts: int) -> int:
        """Async twin of :meth:`job_enqueue_direct` (:meth:`AsyncPoolConnection.run_prepared`)."""
        name, sql = self._enqueue_direct
        return _job_id(await conn.run_prepared(name, sql, _enqueue_direct_params(
            queue, priority, kind, args, metadata, max_attempts)))

    async def job_enqueue_async(self, conn: psycopg.AsyncConnection, queue: str, priority: int, kind: str,
                                args: RawJson, metadata: RawJson | None, max_attempts: int,
                                run_at: _dt.datetime | None = None, delay: float | None = None) -> int:
        """Async twin of :meth:`job_enqueue`."""
        if delay is not None and delay > 0:
            cur = await conn.execute(self.q["job_enqueue_in"],
                                     (queue, priority, kind, args, metadata, max_attempts, delay))
        else:
            cur = await conn.execute(self.q["job_enqueue"],
                                     (queue, priority, kind, args, metadata, max_attempts, run_at))
        row = await cur.fetchone()
        assert row is not None
        return int(row[0])

    def job_enqueue_many(self, conn: psycopg.Connection, queue: str, priority: int, kind: str,
                         args: Sequence[RawJson], metadata: RawJson | None, max_attempts: int) -> list[int]:
        """Enqueue many jobs of one kind in one statement; returns their ids in order."""
        if not args:
            return []
        rows = conn.execute(self.q["job_enqueue_many"],
                            (queue, priority, kind, [a if isinstance(a, RawJson) else RawJson(a) for a in args],
                             metadata, max_attempts)).fetchall()
        return [int(r[0]) for r in rows]

    def job_enqueue_copy(self, conn: psycopg.Connection, queue: str, priority: int, kind: str,
                         args: Sequence[Any], metadata: bytes | None, max_attempts: int,
                         encode: Callable[[Sequence[Any]], Sequence[bytes]] | None = None,
                         spread: int = 0) -> LaneRange:
        """Bulk-enqueue by binary COPY: reserve one lane range, then stream encoded rows.

        Without ``encode``, ``args`` are the encoded payloads (``bytes`` of
        JSON) and one buffer is sent. With it, ``args`` are the callers' items
        and ``encode(block)`` turns each block of ``copy_rows.COPY_BLOCK`` of them
        into payloads while the previous blocks are on their way, so
        PostgreSQL parses and indexes rows while the next ones are checked
        and encoded. An error ``encode`` raises aborts the COPY (PostgreSQL
        keeps nothing of it; the transaction is then failed: run this inside
        :meth:`enqueue_scope`). The rows are encoded by the accelerated
        ``encode_ready_rows``. Job ids are ``(lane_id << 40) | lane_seq``
        over the returned range. ``spread``, the chunk's number in its call,
        moves the shard tried first by ``spread`` modulo the lanes one call may
        fill (``COPY_LANES``, and at most half the queue's shards; the
        ``lane_reserve`` query), so a call's chunks fill several lanes (the
        stripes draining them claim side by side).
        """
        row = conn.execute(self.q["lane_reserve"], (queue, priority, len(args), spread, COPY_LANES, queue)).fetchone()
        assert row is not None
        rng = LaneRange(int(row[0]), int(row[1]), int(row[2]))
        blocks = _copy_blocks(rng, kind, args, metadata, max_attempts, encode)
        with conn.cursor().copy(render(_READY_COPY.format(slot=int(rng.ready_slot)), self.schema)) as cp:
            for block in blocks:
                cp.write(block)
        return rng

    async def job_enqueue_copy_async(self, conn: psycopg.AsyncConnection, queue: str, priority: int, kind: str,
                                     args: Sequence[Any], metadata: bytes | None, max_attempts: int,
                                     encode: Callable[[Sequence[Any]], Sequence[bytes]] | None = None,
                                     spread: int = 0) -> LaneRange:
        """Async twin of :meth:`job_enqueue_copy`."""
        cur = await conn.execute(self.q["lane_reserve"], (queue, priority, len(args), spread, COPY_LANES, queue))
        row = await cur.fetchone()
        assert row is not None
        rng = LaneRange(int(row[0]), int(row[1]), int(row[2]))
        blocks = _copy_blocks(rng, kind, args, metadata, max_attempts, encode)
        async with conn.cursor().copy(render(_READY_COPY.format(slot=int(rng.ready_slot)), self.schema)) as cp:
            for block in blocks:
                await cp.write(block)
        return rng

    @contextlib.contextmanager
    def enqueue_scope(self, conn: psycopg.Connection, *, savepoint: bool = True) -> Iterator[None]:
        """The transaction a bulk enqueue writes in, so that an error leaves nothing of it.

        On an autocommit connection, a transaction of its own (committed at the
        end, rolled back on an error). Inside the caller's transaction, a
        savepoint: on an error everything since it is rolled back (the lane
        numbers it reserved stay unused, as after any rolled-back enqueue) and
        the caller's transaction stays usable, with its own earlier work.
        ``savepoint=False`` (every payload was checked before the first row is
        written) joins the caller's transaction as it is: two round trips fewer.
        """
        if conn.autocommit:
            with conn.transaction():
                yield
            return
        if not savepoint:
            yield
            return
        conn.execute(self.q["enqueue_savepoint"])
        try:
            yield
        except BaseException:
            # a broken connection cannot roll back: the error that broke it says more
            with contextlib.suppress(psycopg.Error):
                conn.execute(self.q["enqueue_savepoint_rollback"])
                conn.execute(self.q["enqueue_savepoint_release"])
            raise
        conn.execute(self.q["enqueue_savepoint_release"])

    @contextlib.asynccontextmanager
    async def enqueue_scope_async(self, conn: psycopg.AsyncConnection, *,
                                  savepoint: bool = True) -> AsyncIterator[None]:
        """Async twin of :meth:`enqueue_scope`."""
        if conn.autocommit:
            async with conn.transaction():
                yield
            return
        if not savepoint:
            yield
            return
        await conn.execute(self.q["enqueue_savepoint"])
        try:
            yield
        except BaseException:
            with contextlib.suppress(psycopg.Error):
                await conn.execute(self.q["enqueue_savepoint_rollback"])
                await conn.execute(self.q["enqueue_savepoint_release"])
            raise
        await conn.execute(self.q["enqueue_savepoint_release"])

    # -- claim ----------------------------------------------------------------

    def lane_claim(self, conn: psycopg.Connection, queue: str, limit: int, stripe: int = 0,
                   stripes: int = 1) -> list[ClaimSnapshot]:
        """Claim up to ``limit`` jobs of ``queue`` through the one claim function.

        ``conn`` must return jsonb as raw bytes (see :func:`use_raw_jsonb`).
        Commit (or run in autocommit) for the claim to count.
        """
        return self.lane_claim_result(conn, queue, limit, stripe, stripes)[0]

    def lane_claim_result(self, conn: psycopg.Connection, queue: str, limit: int, stripe: int = 0,
                          stripes: int = 1) -> tuple[list[ClaimSnapshot], bool]:
        """Like :meth:`lane_claim`, plus whether a busy lane may hold more.

        The second value is True when the claim came back short of ``limit``
        only because another claimer held a lane head that has work: claim
        again soon rather than wait for a NOTIFY.
        """
        return self._claim_rows(conn, "lane_claim", queue, limit, stripe, stripes)

    def _claim_rows(self, conn: psycopg.Connection, name: str, queue: str, limit: int, stripe: int,
                    stripes: int) -> tuple[list[ClaimSnapshot], bool]:
        """Run the claim statement ``name``; its snapshots, and whether its last row was the backlog marker."""
        if isinstance(conn, PoolConnection) and conn.idle_autocommit:
            # a claimer's own connection: the statement prepared once, run through libpq, its
            # binary rows loaded by the connection's kept Transformer (no cursor per claim)
            stmt, sql = self._claims_direct[name]
            res = conn.run_prepared(stmt, sql, (queue.encode(), _INT4.pack(limit), _INT4.pack(stripe),
                                                _INT4.pack(stripes)))
            rows = conn.load_tuples(res)
        else:
            cur = conn.cursor(binary=True)  # binary results: C loaders for ints and timestamps
            cur.execute(self.q[name], (queue, limit, stripe, stripes))
            rows = cur.fetchall()
        marker = bool(rows) and rows[-1][0] is None
        if marker:
            rows.pop()
        return _impl.decode_snapshots(rows), marker

    # -- completion -----------------------------------------------------------

    def receipt_complete(self, conn: psycopg.Connection, snapshots: Sequence[ClaimSnapshot],
                         whole_receipts: Iterable[tuple[int, int]] = (),
                         with_state: Sequence[ClaimSnapshot] = ()) -> list[tuple[int, int]]:
        """Complete receipt-backed attempts in the current transaction; returns the stale ones.

        Locks the receipts, drops attempts that are no longer open (counted
        by the caller as stale), then writes one compact done row per receipt
        of the batch naming the attempts of it that complete here
        (``done_receipts``, migration 0015: no per-job done row or index
        entry; for a receipt whose every attempt is in this batch the row
        is copied from the receipt's own arrays, migration 0020) and closes
        them: one compact closure row for each receipt in
        ``whole_receipts`` (every one of its jobs is in this batch), one
        closure row per attempt otherwise. ``with_state`` lists attempts that
        may have an ``attempt_state`` row to delete.
        """
        if not snapshots:
            return []
        receipts = {(s.claim_slot, s.claim_id) for s in snapshots}
        closed = conn.execute(self.q["receipt_guard"], (
            [r[0] for r in receipts], [r[1] for r in receipts])).fetchall()
        live: Sequence[ClaimSnapshot] = snapshots
        stale_set: set[tuple[int, int]] = set()
        if closed:
            gone = {int(cid) for cid, j, _ in closed if j is None}
            closed_attempts = {(int(j), int(lease)) for _, j, lease in closed if j is not None}
            stale_set = {(s.job_id, s.run_lease) for s in snapshots
                         if s.claim_id in gone or (s.job_id, s.run_lease) in closed_attempts}
            live = [s for s in snapshots if (s.job_id, s.run_lease) not in stale_set]
        if live:
            cur = conn.cursor()
            whole = {w for w in whole_receipts}
            if stale_set:
                stale_claims = {s.claim_id for s in snapshots if (s.job_id, s.run_lease) in stale_set}
                whole = {w for w in whole if w[1] not in stale_claims}
            per_attempt = [s for s in live if (s.claim_slot, s.claim_id) not in whole] if whole else live
            per_row: Sequence[ClaimSnapshot] = live  # the attempts whose done rows are built from their own ids
            if whole:
                # A receipt of which this flush holds every attempt (not only the rest of one that an
                # earlier flush completed a part of): its done row takes the receipt's own attempt arrays
                # (receipt_done_whole), so no per-attempt array is sent, parsed or regrouped. The query
                # writes a row only where the receipt has exactly as many attempts as are held here (all
                # held ones are its open attempts, receipt_guard); the others go the per-attempt way.
                held: dict[tuple[int, int], int] = {}
                for s in live:
                    key = (s.claim_slot, s.claim_id)
                    if key in whole:
                        held[key] = held.get(key, 0) + 1
                ordered = sorted(held, key=lambda w: w[1])
                rows = cur.execute(self.q["receipt_done_whole"], (
                    [w[0] for w in ordered], [w[1] for w in ordered], [held[w] for w in ordered])).fetchall() \
                    if ordered else []
                copied = {int(cid) for cid, in rows}
                if copied:
                    per_row = [s for s in live if s.claim_id not in copied]  # claim ids are unique
            if per_row:
                done = cur.execute(self.q["receipt_done_compact"], (
                    _int_array([s.claim_slot for s in per_row]), _int_array([s.claim_id for s in per_row]),
                    _int_array([s.job_id for s in per_row]),
                    _int_array([s.run_lease for s in per_row]))).fetchall()
                if sum(int(n) for n, in done) != len(per_row):
                    # every live receipt is locked and open (receipt_guard): a missing one is a bug, never a skip
                    raise RuntimeError(f"compact done rows cover {sum(int(n) for n, in done)} of "
                                       f"{len(per_row)} attempts")
            if whole:
                conn.execute(self.q["receipt_close_batches"], ([w[0] for w in whole], [w[1] for w in whole]))
            if per_attempt:
                with cur.copy(self._closure_copy) as cp:
                    cp.write(_impl.encode_closure_rows(per_attempt, 1))
            if with_state:
                keep = [s for s in with_state if (s.job_id, s.run_lease) not in stale_set]
                if keep:
                    conn.execute(self.q["attempt_state_delete"],
                                 ([s.job_id for s in keep], [s.run_lease for s in keep]))
        return sorted(stale_set)

    def attempts_completed(self, conn: psycopg.Connection,
                           attempts: Iterable[ClaimSnapshot]) -> set[tuple[int, int]]:
        """Of these attempts, the ``(job_id, run_lease)`` pairs completed under that run_lease.

        Per-job ``done_entries`` rows and compact ``done_receipts`` rows both count.
        """
        snaps = {(s.job_id, s.run_lease): s for s in attempts}
        if not snaps:
            return set()
        ss = list(snaps.values())
        rows = conn.execute(self.q["attempts_completed"], {
            "jobs": [s.job_id for s in ss], "leases": [s.run_lease for s in ss],
            "slots": [s.ready_slot for s in ss], "lanes": [s.lane_id for s in ss],
            "seqs": [s.lane_seq for s in ss]}).fetchall()
        return {(int(j), int(lease)) for j, lease in rows} & set(snaps)

    def receipt_lock(self, conn: psycopg.Connection, claim_ids: Iterable[int]) -> None:
        """Take the receipts' advisory locks in ascending order (within the current transaction).

        Every path that writes about several attempts locks in this order, so
        batches, rescue and heartbeats never deadlock on each other.
        """
        conn.execute(self.q["receipt_lock"], (sorted(set(claim_ids)),))

    def receipt_complete_rows(self, conn: psycopg.Connection, snapshots: Sequence[ClaimSnapshot],
                              with_state: set[tuple[int, int]] | None = None) -> list[tuple[int, int]]:
        """Complete a small batch in one statement; returns the stale attempts.

        The low-latency twin of :meth:`receipt_complete`: on an autocommit
        connection it is one round trip and one commit. Same guard; it writes
        per-job ``done_entries`` rows (the compact ``done_receipts`` row is the COPY path's).
        """
        if not snapshots:
            return []
        ws = with_state or set()
        # array literals, not lists: psycopg's list dumpers cost ~80 µs of the ~340 µs this call
        # takes for one job (performance-log, 2026-12-05 e2e), on the path of every quiet completion
        params = (
            _int_array([s.claim_slot for s in snapshots]), _int_array([s.claim_id for s in snapshots]),
            _int_array([s.job_id for s in snapshots]), _int_array([s.run_lease for s in snapshots]),
            _int_array([s.ready_slot for s in snapshots]), _int_array([s.lane_id for s in snapshots]),
            _int_array([s.lane_seq for s in snapshots]), _int_array([s.attempt for s in snapshots]),
            _text_array([s.queue for s in snapshots]), _text_array([s.kind for s in snapshots]),
            _bool_array([(s.job_id, s.run_lease) in ws for s in snapshots]))
        if isinstance(conn, PoolConnection) and conn.idle_autocommit:
            # the batcher's own connection: one prepared statement through libpq, ~50 µs less
            # client CPU and wall time per call than the cursor (performance-log, 2026-12-05 e2e);
            # its rows are (job_id bigint, run_lease int), never NULL, in binary
            name, sql = self._complete_rows_direct
            res = conn.run_prepared(name, sql, [p.encode() for p in params], text=True)
            return sorted((_INT8.unpack(res.get_value(i, 0))[0], _INT4.unpack(res.get_value(i, 1))[0])  # type: ignore[arg-type]
                          for i in range(res.ntuples))
        rows = conn.execute(self.q["receipt_complete_rows"], params).fetchall()
        return sorted((int(j), int(lease)) for j, lease in rows)

    # -- results, progress, history retention (migration 0005) ------------------

    def receipt_complete_results(self, conn: psycopg.Connection,
                                 items: Sequence[tuple[ClaimSnapshot, bool, RawJson]],
                                 with_state: set[tuple[int, int]] | None = None) -> list[tuple[int, int]]:
        """Complete attempts whose handler returned a value: ``(snapshot, lease_backed, result JSON)`` each.

        Receipt-backed attempts take the completion path of
        :meth:`receipt_complete` (receipt locks and guard, then binary COPY)
        into ``done_entries`` with its ``result`` column, and a closure row
        per attempt; lease-backed ones (rare: parked for a callback, then
        returned a value) go through ``receipt_complete_results``.
        ``with_state``: the attempts that may have an ``attempt_state`` row
        (None: any of them). Runs in the current transaction, or in its own
        when the connection is idle. Returns the stale attempts (nothing
        written for them).
        """
        if not items:
            return []
        own = conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        with conn.transaction() if own else contextlib.nullcontext():
            stale: list[tuple[int, int]] = []
            leased = [it for it in items if it[1]]
            if leased:
                snaps = [it[0] for it in leased]
                stale += [(int(j), int(lease)) for j, lease in conn.execute(self.q["receipt_complete_results"], (
                    [s.claim_slot for s in snaps], [s.claim_id for s in snaps],
                    [s.job_id for s in snaps], [s.run_lease for s in snaps],
                    [s.ready_slot for s in snaps], [s.lane_id for s in snaps],
                    [s.lane_seq for s in snaps], [s.attempt for s in snaps],
                    [s.queue for s in snaps], [s.kind for s in snaps],
                    [True] * len(snaps), [it[2] for it in leased])).fetchall()]
            plain = [it for it in items if not it[1]]
            if plain:
                stale += self._results_copy(conn, plain, with_state)
        return sorted(stale)

    def _results_copy(self, conn: psycopg.Connection, items: Sequence[tuple[ClaimSnapshot, bool, RawJson]],
                      with_state: set[tuple[int, int]] | None) -> list[tuple[int, int]]:
        receipts = {(it[0].claim_slot, it[0].claim_id) for it in items}
        closed = conn.execute(self.q["receipt_guard"], (
            [r[0] for r in receipts], [r[1] for r in receipts])).fetchall()
        live = items
        stale: set[tuple[int, int]] = set()
        if closed:
            gone = {int(cid) for cid, j, _ in closed if j is None}
            closed_attempts = {(int(j), int(lease)) for _, j, lease in closed if j is not None}
            stale = {(s.job_id, s.run_lease) for s, _, _ in items
                     if s.claim_id in gone or (s.job_id, s.run_lease) in closed_attempts}
            live = [it for it in items if (it[0].job_id, it[0].run_lease) not in stale]
        if live:
            snaps = [it[0] for it in live]
            cur = conn.cursor()
            with cur.copy(self._done_result_copy) as cp:
                cp.write(encode_done_result_rows(live))
            with cur.copy(self._closure_copy) as cp:
                cp.write(_impl.encode_closure_rows(snaps, 1))
            keep = snaps if with_state is None else [s for s in snaps if (s.job_id, s.run_lease) in with_state]
            if keep:
                conn.execute(self.q["attempt_state_delete"], ([s.job_id for s in keep], [s.run_lease for s in keep]))
        return sorted(stale)

    def ring_prune_retained(self, conn: psycopg.Connection, ring: str, slot: int, retain_s: float,
                            lock_timeout_ms: int = 50) -> str:
        """:meth:`ring_prune` that keeps a quiet ready slot for ``retain_s`` seconds first.

        Answers ``retained`` while it keeps the slot; ``retain_s`` 0 is ring_prune.
        """
        row = conn.execute(self.q["ring_prune_retained"],
                           (ring, slot, f"{int(lock_timeout_ms)}ms", max(0.0, float(retain_s)))).fetchone()
        assert row is not None
        return str(row[0])

    def ready_retention(self, conn: psycopg.Connection) -> float:
        """History retention of the shared ready ring, seconds: the longest over the queues (1 h default)."""
        row = conn.execute(self.q["ready_retention"]).fetchone()
        return float(row[0]) if row and row[0] is not None else 3600.0

    def attempt_close(self, conn: psycopg.Connection, items: Sequence[tuple[ClaimSnapshot, int, float | None,
                      str | None]]) -> list[AttemptResult]:
        """Close attempts with explicit outcomes: ``(snapshot, outcome, delay_s, error)`` each.

        Outcomes are the ``CLOSE_*`` codes. Returns one result per item
        (ordered by receipt, the lock order); ``stale`` means the attempt was no longer live and nothing
        was written for it.
        """
        if not items:
            return []
        items = sorted(items, key=lambda it: it[0].claim_id)  # lock order
        rows = conn.execute(self.q["attempt_close"], (
            [s.job_id for s, _, _, _ in items], [s.run_lease for s, _, _, _ in items],
            [s.claim_slot for s, _, _, _ in items], [s.claim_id for s, _, _, _ in items],
            [o for _, o, _, _ in items], [d for _, _, d, _ in items],
            [clean_text(e) for _, _, _, e in items])).fetchall()
        return [AttemptResult(int(j), int(lease), st) for j, lease, st in rows]

    def attempt_heartbeat(self, conn: psycopg.Connection, snapshots: Sequence[ClaimSnapshot],
                          progress: Sequence[RawJson | None] | None = None) -> list[AttemptResult]:
        """Heartbeat (and optionally record progress for) a batch of attempts."""
        if not snapshots:
            return []
        if progress is None:
            progress = [None] * len(snapshots)
        order = sorted(range(len(snapshots)), key=lambda i: snapshots[i].claim_id)  # lock order
        snapshots = [snapshots[i] for i in order]
        progress = [progress[i] for i in order]
        rows = conn.execute(self.q["attempt_heartbeat"], (
            [s.job_id for s in snapshots], [s.run_lease for s in snapshots],
            [s.claim_slot for s in snapshots], [s.claim_id for s in snapshots], list(progress))).fetchall()
        return [AttemptResult(int(j), int(lease), st) for j, lease, st in rows]

    def attempt_register_callback(self, conn: psycopg.Connection, snapshot: ClaimSnapshot,
                                  timeout: float) -> uuid.UUID | None:
        """Park an attempt for an external callback; returns its token, or None if stale."""
        row = conn.execute(self.q["attempt_register_callback"], (
            snapshot.job_id, snapshot.run_lease, snapshot.claim_slot, snapshot.claim_id, timeout)).fetchone()
        return row[0] if row else None

    def callback_resolve(self, conn: psycopg.Connection, token: uuid.UUID | str, action: str,
                         payload: RawJson | None = None, error: str | None = None) -> str:
        """Resolve a parked callback; returns ``ok`` or ``unknown``."""
        row = conn.execute(self.q["callback_resolve"], (str(token), action, payload, clean_text(error))).fetchone()
        assert row is not None
        return str(row[0])

    def job_cancel(self, conn: psycopg.Connection, job_id: int) -> str:
        """Cancel a job: ``cancelled``, ``cancel_requested``, ``terminal`` or ``unknown``.

        On an idle autocommit connection the cancel is its own READ COMMITTED transaction, whatever
        the session's default; inside the caller's transaction that must be READ COMMITTED
        (``lane_cursor_advance`` refuses other levels with ``FeatureNotSupported``, migration 0028).
        """
        if _idle_autocommit(conn):
            with conn.transaction():
                conn.execute(self.q["transaction_read_committed"])
                row = conn.execute(self.q["job_cancel"], (job_id,)).fetchone()
        else:
            row = conn.execute(self.q["job_cancel"], (job_id,)).fetchone()
        assert row is not None
        return str(row[0])

    # -- maintenance ----------------------------------------------------------

    def deferred_promote(self, conn: psycopg.Connection, limit: int = 1000) -> int:
        """Promote due deferred jobs into ready; returns how many."""
        return self._scalar_int(conn, "deferred_promote", (limit,))

    def receipt_rescue_stale(self, conn: psycopg.Connection, limit: int = 1000) -> int:
        """Rescue receipt-backed attempts past deadline or heartbeat timeout; returns how many."""
        return self._scalar_int(conn, "receipt_rescue_stale", (limit,))

    def lease_rescue_expired(self, conn: psycopg.Connection, limit: int = 1000) -> int:
        """Rescue lease-backed attempts whose callback timed out; returns how many."""
        return self._scalar_int(conn, "lease_rescue_expired", (limit,))

    def attempt_state_sweep(self, conn: psycopg.Connection) -> int:
        """Delete attempt_state rows of attempts that ended; returns how many."""
        return self._scalar_int(conn, "attempt_state_sweep", ())

    def ring_rotate(self, conn: psycopg.Connection, ring: str, lock_timeout_ms: int = 50) -> int | None:
        """Rotate ``ring`` (ready, claim or lease); the new slot, or None if the next is not free.

        The rotation ledger is trimmed by TRUNCATE of a span child, waiting
        at most ``lock_timeout_ms`` for readers of it (skipped when busy).
        """
        row = conn.execute(self.q["ring_rotate"], (ring, f"{int(lock_timeout_ms)}ms")).fetchone()
        return None if row is None or row[0] is None else int(row[0])

    def ring_slot_empty(self, conn: psycopg.Connection, ring: str, slot: int) -> bool:
        """True when the slot's children hold no live rows."""
        row = conn.execute(self.q["ring_slot_empty"], (ring, slot)).fetchone()
        return bool(row and row[0])

    def ring_prune(self, conn: psycopg.Connection, ring: str, slot: int, lock_timeout_ms: int = 50) -> str:
        """Prune one sealed slot by TRUNCATE behind its gates; returns the outcome word."""
        row = conn.execute(self.q["ring_prune"], (ring, slot, f"{int(lock_timeout_ms)}ms")).fetchone()
        assert row is not None
        return str(row[0])

    def ring_state(self, conn: psycopg.Connection) -> dict[str, dict[str, Any]]:
        """Current slot, generation and slot count of each ring."""
        return {r[0]: {"slot": r[1], "generation": r[2], "slots": r[3], "rotated_at": r[4]}
                for r in conn.execute(self.q["ring_state"]).fetchall()}

    def dlq_retention_prune(self, conn: psycopg.Connection, limit: int = 1000) -> int:
        """Delete DLQ entries past retention; returns how many."""
        return self._scalar_int(conn, "dlq_retention_prune", (limit,))

    # -- admin and reads ------------------------------------------------------

    def job_load(self, conn: psycopg.Connection, job_id: int) -> dict[str, Any] | None:
        """The job wherever it lives, as a dict with a ``state`` key; None if unknown.

        An unknown answer is asked once more: a job read mid-claim can look unknown
        (the comment above ``_job_load_many`` says why).
        """
        row = conn.execute(self.q["job_load"], (job_id,)).fetchone()
        if row is None or row[0] is None:  # maybe read mid-claim: a second statement, a new snapshot
            row = conn.execute(self.q["job_load"], (job_id,)).fetchone()
        if row is None or row[0] is None:
            return None
        value = row[0]
        if isinstance(value, (bytes, bytearray)):
            import orjson

            value = orjson.loads(value)
        return dict(value)

    def queue_depth_fast(self, conn: psycopg.Connection) -> dict[str, int]:
        """Per-queue depth from the lane heads (no scan; may over-count)."""
        return {q: int(d) for q, d in conn.execute(self.q["queue_depth_fast"]).fetchall()}

    def queue_counts_exact(self, conn: psycopg.Connection) -> dict[str, dict[str, int]]:
        """Exact counts per queue and state (available, running, waiting, scheduled, ...)."""
        out: dict[str, dict[str, int]] = {}
        for queue, state, count in conn.execute(self.q["queue_counts_exact"]).fetchall():
            out.setdefault(queue, {})[state] = int(count)
        return out

    def queue_terminal_counts(self, conn: psycopg.Connection) -> dict[str, dict[str, int]]:
        """Completed, failed and cancelled per queue (live history plus pruned rollups); no ring scan."""
        names = {1: "completed", 2: "failed", 3: "cancelled"}
        out: dict[str, dict[str, int]] = {}
        for queue, state, count in conn.execute(self.q["queue_terminal_counts"]).fetchall():
            out.setdefault(queue, {})[names[int(state)]] = int(count)
        return out

    def queue_ensure(self, conn: psycopg.Connection, queue: str) -> None:
        """Register a queue (idempotent)."""
        conn.execute(self.q["queue_ensure"], (queue,))

    def queue_pause(self, conn: psycopg.Connection, queue: str, paused: bool = True) -> bool:
        """Pause (or resume) claims on a queue; False if the queue is unknown."""
        return conn.execute(self.q["queue_pause"], (paused, queue)).rowcount > 0

    def queue_configure(self, conn: psycopg.Connection, queue: str, *, stripes: int | None = None,
                        enqueue_shards: int | None = None, dlq_enabled: bool | None = None,
                        deadline: float | None | bool = False, heartbeat_timeout: float | None = None,
                        aging_interval: float | None = None, dlq_retention: float | None = None,
                        history_retention: float | None = None) -> None:
        """Change queue settings; ``None`` keeps a setting, except ``deadline``.

        ``deadline`` is seconds from claim to rescue of an attempt (a new
        queue has 3600); ``0`` or ``None`` means no deadline, ``False`` (the
        default) keeps the current one. A negative or non-finite deadline
        raises :class:`~awa_fast.errors.OutOfRange`. ``history_retention``
        (seconds): how long this queue's terminal jobs stay visible at least
        (the ready ring is shared: it keeps history for the longest
        retention of any queue).
        """
        if deadline is not False and deadline is not None:
            if isinstance(deadline, bool) or not isinstance(deadline, (int, float)) \
                    or not 0 <= deadline <= _MAX_DEADLINE_S:
                from awa_fast.errors import OutOfRange

                raise OutOfRange("deadline", deadline, 0, _MAX_DEADLINE_S)
            deadline = float(deadline) or None  # 0: no deadline
        self.queue_ensure(conn, queue)
        conn.execute(self.q["queue_configure"], {
            "queue": queue, "stripes": stripes, "enqueue_shards": enqueue_shards, "dlq_enabled": dlq_enabled,
            "deadline_set": deadline is not False, "deadline": None if deadline is False else deadline,
            "heartbeat_timeout": heartbeat_timeout, "aging_interval": aging_interval,
            "dlq_retention": dlq_retention, "history_retention": history_retention})

    def queue_list(self, conn: psycopg.Connection) -> list[dict[str, Any]]:
        """Settings of every known queue; ``deadline_s`` is None when the queue has no deadline."""
        keys = ("queue", "paused", "stripes", "enqueue_shards", "dlq_enabled", "deadline_s", "heartbeat_timeout_s",
                "history_retention_s")
        return [dict(zip(keys, r, strict=False)) for r in conn.execute(self.q["queue_list"]).fetchall()]

    def dlq_list(self, conn: psycopg.Connection, queue: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        """DLQ entries, newest first."""
        keys = ("job_id", "queue", "kind", "attempt", "max_attempts", "reason", "failed_at", "args")
        rows = conn.execute(self.q["dlq_list"], {"queue": queue, "limit": limit})
        return [dict(zip(keys, r, strict=False)) for r in rows]

    def dlq_retry(self, conn: psycopg.Connection, job_ids: Sequence[int] | None = None,
                  queue: str | None = None) -> list[int]:
        """Move DLQ entries (by id, or a whole queue) back to ready; returns the ids moved."""
        if job_ids is not None:
            rows = conn.execute(self.q["dlq_retry"], (list(job_ids),)).fetchall()
        else:
            rows = conn.execute(self.q["dlq_retry_queue"], (queue,)).fetchall()
        return [int(r[0]) for r in rows]

    def dlq_purge(self, conn: psycopg.Connection, job_ids: Sequence[int] | None = None,
                  queue: str | None = None) -> int:
        """Delete DLQ entries (by id, or a whole queue); returns how many."""
        if job_ids is not None:
            return conn.execute(self.q["dlq_purge"], (list(job_ids),)).rowcount
        return conn.execute(self.q["dlq_purge_queue"], (queue,)).rowcount

    def deferred_run_now(self, conn: psycopg.Connection, job_id: int) -> bool:
        """Make a deferred job due now (the leader promotes it); False if it is not deferred."""
        return conn.execute(self.q["deferred_run_now"], (job_id,)).rowcount > 0

    def leader_info(self, conn: psycopg.Connection) -> dict[str, Any] | None:
        """The backend holding the maintenance leader lock (pid, application, client, since)."""
        row = conn.execute(self.q["leader_info"]).fetchone()
        if row is None:
            return None
        return {"pid": row[0], "application_name": row[1], "client_addr": row[2], "since": row[3]}

    def runtime_grant(self, conn: psycopg.Connection, role: str) -> None:
        """Grant ``role`` what enqueue, supervise and admin need (no DDL, no TRUNCATE).

        Only ``role`` may then execute the schema's functions (none is executable
        by PUBLIC); ``PUBLIC`` and PostgreSQL's predefined ``pg_*`` roles are refused.
        """
        if not isinstance(role, str) or not role or role.lower() == "public" or role.lower().startswith("pg_"):
            raise ConfigError(f"runtime role {role!r}: name one login role of your own, "
                              "not PUBLIC or a predefined pg_* role")
        conn.execute(self.q["runtime_grant"], (role,))

    def dead_tuples(self, conn: psycopg.Connection) -> int:
        """Dead tuples summed over the schema's tables (statistics may lag ~0.5 s)."""
        return self._scalar_int(conn, "dead_tuples", (self.schema,))

    # -- observability ------------------------------------------------------------

    def dlq_depth(self, conn: psycopg.Connection) -> dict[str, int]:
        """DLQ entries per queue (a small, cold table)."""
        return {q: int(n) for q, n in conn.execute(self.q["dlq_depth"]).fetchall()}

    def ring_slot_stats(self, conn: psycopg.Connection) -> list[dict[str, Any]]:
        """Per ring slot: estimated live/dead rows (statistics, no scan) and when it last became current."""
        return [{"ring": r[0], "slot": r[1], "live": int(r[2]), "dead": int(r[3]), "became_current": r[4]}
                for r in conn.execute(self.q["ring_slot_stats"], {"schema": self.schema}).fetchall()]

    def runtime_sessions(self, conn: psycopg.Connection) -> list[dict[str, Any]]:
        """awa-fast's open connections by role, application name and client host."""
        return [{"role": r[0], "application_name": r[1], "host": r[2], "connections": r[3], "since": r[4]}
                for r in conn.execute(self.q["runtime_sessions"]).fetchall()]

    def _scalar_int(self, conn: psycopg.Connection, name: str, params: tuple[Any, ...]) -> int:
        row = conn.execute(self.q[name], params).fetchone()
        return int(row[0]) if row and row[0] is not None else 0

    # -- in-process worker and awa_fast.testing ----------------------------------

    def queue_work_exists(self, conn: psycopg.Connection, queues: Sequence[str]) -> bool:
        """True while a job of ``queues`` is available (ready, or deferred and due) or running.

        Deferred jobs due later and attempts parked for a callback do not
        count. Cheap when the queues are drained: lane heads first.
        """
        row = conn.execute(self.q["queue_work_exists"], {"queues": list(queues)}).fetchone()
        return bool(row and row[0])

    def job_pending_list(self, conn: psycopg.Connection, kind: str | None = None,
                         queue: str | None = None) -> list[dict[str, Any]]:
        """Jobs waiting to run (``state``: available, scheduled, retryable, snoozed), by job id.

        Reads what ``conn`` sees, so a caller's own uncommitted enqueues
        count on its own connection. For tests and admin, not hot paths.
        """
        import orjson

        keys = ("job_id", "queue", "kind", "priority", "args", "metadata", "state", "run_at")
        out = []
        for r in conn.execute(self.q["job_pending_list"], {"kind": kind, "queue": queue}).fetchall():
            d = dict(zip(keys, r, strict=False))
            for k in ("args", "metadata"):
                if isinstance(d[k], (bytes, bytearray, memoryview)):
                    d[k] = orjson.loads(bytes(d[k]))
                elif isinstance(d[k], str):  # a connection that loads jsonb as text (e.g. Django's)
                    d[k] = orjson.loads(d[k])
            out.append(d)
        return out

    def server_wal_level(self, conn: psycopg.Connection) -> str:
        """The server's ``wal_level`` setting."""
        row = conn.execute(self.q["server_wal_level"]).fetchone()
        return str(row[0]) if row else ""


    # -- the public API's reads and admin writes (awa_fast.App, the CLI) ----------
    # Each has a sync and an ``_async`` twin built from one statement
    # description, so the two can never disagree. Jsonb comes back decoded
    # whether or not the connection uses :func:`use_raw_jsonb`.

    def _run(self, conn: psycopg.Connection, stmts: Sequence[_Stmt[Any]]) -> Any:
        """Run ``stmts`` in order (each one shaped); the shaped result of the last one."""
        *head, last = stmts
        for st in head:
            self._run_one(conn, st)
        return self._run_one(conn, last)

    def _run_one(self, conn: psycopg.Connection, st: _Stmt[R]) -> R:
        cur = conn.execute(self.q[st.name], st.params)
        rows = cur.fetchall() if cur.description is not None else []
        return st.shape(rows, cur.rowcount)

    async def _run_async(self, conn: psycopg.AsyncConnection, stmts: Sequence[_Stmt[Any]]) -> Any:
        *head, last = stmts
        for st in head:
            await self._run_one_async(conn, st)
        return await self._run_one_async(conn, last)

    async def _run_one_async(self, conn: psycopg.AsyncConnection, st: _Stmt[R]) -> R:
        cur = await conn.execute(self.q[st.name], st.params)
        rows = await cur.fetchall() if cur.description is not None else []
        return st.shape(rows, cur.rowcount)

    def job_load_many(self, conn: psycopg.Connection, job_ids: Sequence[int]) -> list[dict[str, Any] | None]:
        """Each job (``job_load``'s dict plus ``progress``) in the order given; None where unknown.

        Unknown answers are asked once more, as in :meth:`job_load`.
        """
        jobs = self._run_one(conn, _job_load_many(job_ids))
        again = [i for i, job in enumerate(jobs) if job is None]
        if again:
            _fill_unknown(jobs, again, self._run_one(conn, _job_load_many([job_ids[i] for i in again])))
        return jobs

    async def job_load_many_async(self, conn: psycopg.AsyncConnection,
                                  job_ids: Sequence[int]) -> list[dict[str, Any] | None]:
        """Async twin of :meth:`job_load_many`."""
        jobs = await self._run_one_async(conn, _job_load_many(job_ids))
        again = [i for i, job in enumerate(jobs) if job is None]
        if again:
            _fill_unknown(jobs, again, await self._run_one_async(conn, _job_load_many([job_ids[i] for i in again])))
        return jobs

    def job_list(self, conn: psycopg.Connection, *, queue: str | None = None, kind: str | None = None,
                 state: str | None = None, limit: int = 100, before_id: int | None = None) -> list[dict[str, Any]]:
        """Jobs newest id first (below ``before_id``), filtered; each as :meth:`job_load_many` gives it."""
        out: list[dict[str, Any]] = []
        cursor = before_id
        while len(out) < limit:
            page = max(limit, 100)
            ids = self._run_one(conn, _job_list_ids(queue, kind, state, page, cursor))
            if not ids:
                break
            out.extend(_keep_state(self._run_one(conn, _job_load_many(ids)), state))
            if len(ids) < page:
                break
            cursor = ids[-1]
        return out[:limit]

    async def job_list_async(self, conn: psycopg.AsyncConnection, *, queue: str | None = None,
                             kind: str | None = None, state: str | None = None, limit: int = 100,
                             before_id: int | None = None) -> list[dict[str, Any]]:
        """Async twin of :meth:`job_list`."""
        out: list[dict[str, Any]] = []
        cursor = before_id
        while len(out) < limit:
            page = max(limit, 100)
            ids = await self._run_one_async(conn, _job_list_ids(queue, kind, state, page, cursor))
            if not ids:
                break
            out.extend(_keep_state(await self._run_one_async(conn, _job_load_many(ids)), state))
            if len(ids) < page:
                break
            cursor = ids[-1]
        return out[:limit]

    def job_retry(self, conn: psycopg.Connection, job_id: int) -> str | None:
        """Retry one job now: ``retried`` (from the DLQ), ``due_now`` (deferred), or None."""
        return self._run_one(conn, _job_retry(job_id))

    async def job_retry_async(self, conn: psycopg.AsyncConnection, job_id: int) -> str | None:
        """Async twin of :meth:`job_retry`."""
        return await self._run_one_async(conn, _job_retry(job_id))

    async def job_cancel_async(self, conn: psycopg.AsyncConnection, job_id: int) -> str:
        """Async twin of :meth:`job_cancel`."""
        if _idle_autocommit(conn):
            async with conn.transaction():
                await conn.execute(self.q["transaction_read_committed"])
                return await self._run_one_async(conn, _Stmt("job_cancel", (job_id,), _first_text))
        return await self._run_one_async(conn, _Stmt("job_cancel", (job_id,), _first_text))

    async def callback_resolve_async(self, conn: psycopg.AsyncConnection, token: uuid.UUID | str, action: str,
                                     payload: RawJson | None = None, error: str | None = None) -> str:
        """Async twin of :meth:`callback_resolve`."""
        return await self._run_one_async(conn, _Stmt("callback_resolve", (str(token), action, payload,
                                                                       clean_text(error)), _first_text))

    def queue_settings(self, conn: psycopg.Connection, queue: str | None = None) -> list[dict[str, Any]]:
        """Every setting of ``queue`` (or of every queue); durations in seconds."""
        return self._run_one(conn, _queue_settings(queue))

    async def queue_settings_async(self, conn: psycopg.AsyncConnection,
                                   queue: str | None = None) -> list[dict[str, Any]]:
        """Async twin of :meth:`queue_settings`."""
        return await self._run_one_async(conn, _queue_settings(queue))

    async def queue_configure_async(self, conn: psycopg.AsyncConnection, queue: str, *,
                                    stripes: int | None = None, enqueue_shards: int | None = None,
                                    dlq_enabled: bool | None = None, deadline: float | None | bool = False,
                                    heartbeat_timeout: float | None = None, aging_interval: float | None = None,
                                    dlq_retention: float | None = None,
                                    history_retention: float | None = None) -> None:
        """Async twin of :meth:`queue_configure`."""
        await self._run_async(conn, [_Stmt("queue_ensure", (queue,), _nothing), _Stmt("queue_configure", {
            "queue": queue, "stripes": stripes, "enqueue_shards": enqueue_shards, "dlq_enabled": dlq_enabled,
            "deadline_set": deadline is not False, "deadline": None if deadline is False else deadline,
            "heartbeat_timeout": heartbeat_timeout, "aging_interval": aging_interval,
            "dlq_retention": dlq_retention, "history_retention": history_retention}, _nothing)])

    async def queue_pause_async(self, conn: psycopg.AsyncConnection, queue: str, paused: bool = True) -> bool:
        """Async twin of :meth:`queue_pause`."""
        return await self._run_one_async(conn, _Stmt("queue_pause", (paused, queue), lambda _r, n: n > 0))

    async def queue_counts_exact_async(self, conn: psycopg.AsyncConnection) -> dict[str, dict[str, int]]:
        """Async twin of :meth:`queue_counts_exact`."""
        return await self._run_one_async(conn, _Stmt("queue_counts_exact", (), _counts))

    def dlq_select(self, conn: psycopg.Connection, job_ids: Sequence[int] | None = None,
                   queue: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        """DLQ entries matching ``job_ids`` and/or ``queue`` (both when both are given), newest first."""
        return self._run_one(conn, _dlq_select(job_ids, queue, limit))

    async def dlq_select_async(self, conn: psycopg.AsyncConnection, job_ids: Sequence[int] | None = None,
                               queue: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        """Async twin of :meth:`dlq_select`."""
        return await self._run_one_async(conn, _dlq_select(job_ids, queue, limit))

    def dlq_retry_where(self, conn: psycopg.Connection, job_ids: Sequence[int] | None = None,
                        queue: str | None = None) -> list[int]:
        """Move DLQ entries matching ``job_ids`` and/or ``queue`` back to ready; returns their ids."""
        return self._run_one(conn, _dlq_where("dlq_retry_where", job_ids, queue))

    async def dlq_retry_where_async(self, conn: psycopg.AsyncConnection, job_ids: Sequence[int] | None = None,
                                    queue: str | None = None) -> list[int]:
        """Async twin of :meth:`dlq_retry_where`."""
        return await self._run_one_async(conn, _dlq_where("dlq_retry_where", job_ids, queue))

    def dlq_purge_where(self, conn: psycopg.Connection, job_ids: Sequence[int] | None = None,
                        queue: str | None = None) -> list[int]:
        """Delete DLQ entries matching ``job_ids`` and/or ``queue``; returns their ids."""
        return self._run_one(conn, _dlq_where("dlq_purge_where", job_ids, queue))

    async def dlq_purge_where_async(self, conn: psycopg.AsyncConnection, job_ids: Sequence[int] | None = None,
                                    queue: str | None = None) -> list[int]:
        """Async twin of :meth:`dlq_purge_where`."""
        return await self._run_one_async(conn, _dlq_where("dlq_purge_where", job_ids, queue))

    async def schema_check_async(self, conn: psycopg.AsyncConnection) -> None:
        """Async twin of :meth:`schema_check`."""
        cur = await conn.execute("SELECT to_regclass(%s) IS NOT NULL", (f'"{self.schema}".schema_migrations',))
        row = await cur.fetchone()
        found = 0
        if row and row[0]:
            cur = await conn.execute(render("SELECT max(version) FROM __SCHEMA__.schema_migrations", self.schema))
            row = await cur.fetchone()
            found = int(row[0] or 0) if row else 0
        expected = latest_version()
        if found < expected:
            raise SchemaNotMigrated(self.schema, expected, found or None)
        if found > expected:
            raise SchemaTooNew(self.schema, expected, found)

    # -- flow control (sql/0010_flow_control.sql, docs/flow-control.md) ------------------

    def lane_claim_limited_result(self, conn: psycopg.Connection, queue: str, limit: int, stripe: int = 0,
                                  stripes: int = 1) -> tuple[list[ClaimSnapshot], bool]:
        """:meth:`lane_claim_result` through the queue's limits (``lane_claim_limited``).

        Returns at most what fits under ``max_running`` and the token bucket;
        the second value is also True when a limit (not the lack of work) made
        the claim short, so the claimer comes back after its busy pause.
        """
        return self._claim_rows(conn, "lane_claim_limited", queue, limit, stripe, stripes)

    def queue_limits_get(self, conn: psycopg.Connection, queue: str) -> QueueLimits | None:
        """The queue's flow-control settings, or None when it has none (one primary-key probe)."""
        return _limits_from_row(queue, conn.execute(self.q["queue_limits_get"], (queue,)).fetchone())

    async def queue_limits_get_async(self, conn: psycopg.AsyncConnection, queue: str) -> QueueLimits | None:
        """Async twin of :meth:`queue_limits_get`."""
        cur = await conn.execute(self.q["queue_limits_get"], (queue,))
        return _limits_from_row(queue, await cur.fetchone())

    def queue_limits_set(self, conn: psycopg.Connection, queue: str, *, max_running: Any = _LIMIT_KEEP,
                         max_rate: Any = _LIMIT_KEEP) -> QueueLimits | None:
        """Set a queue's limits; left out (``awa_fast.limits.KEEP``) keeps one as it is, None removes it.

        ``max_running``: int >= 0 or None. ``max_rate``: :class:`awa_fast.limits.Rate` or None.
        Claimers pick the change up within ``awa_fast.limits.LIMIT_REFRESH_S``.
        """
        params = _limits_params(queue, max_running, max_rate)
        self.queue_ensure(conn, queue)
        conn.execute(self.q["queue_limits_set"], params)
        return self.queue_limits_get(conn, queue)

    async def queue_limits_set_async(self, conn: psycopg.AsyncConnection, queue: str, *,
                                     max_running: Any = _LIMIT_KEEP,
                                     max_rate: Any = _LIMIT_KEEP) -> QueueLimits | None:
        """Async twin of :meth:`queue_limits_set`."""
        params = _limits_params(queue, max_running, max_rate)
        await conn.execute(self.q["queue_ensure"], (queue,))
        await conn.execute(self.q["queue_limits_set"], params)
        return await self.queue_limits_get_async(conn, queue)

    def queue_limit_status(self, conn: psycopg.Connection) -> dict[str, dict[str, Any]]:
        """Per limited queue: ``max_running``, ``rate`` (count, per, burst), ``running`` now, ``tokens`` left now.

        Running is derived as the claim derives it (open receipt attempts plus
        callback waits), without writing anything.
        """
        return _limit_status(conn.execute(self.q["queue_limit_status"]).fetchall())

    async def queue_limit_status_async(self, conn: psycopg.AsyncConnection) -> dict[str, dict[str, Any]]:
        """Async twin of :meth:`queue_limit_status`."""
        cur = await conn.execute(self.q["queue_limit_status"])
        return _limit_status(await cur.fetchall())
    # -- periodic and unique jobs (migration 0005; awa_fast/periodic.py, awa_fast/unique.py) --

    def job_enqueue_unique(self, conn: psycopg.Connection, key: bytes, period: float | None, states: int,
                           queue: str, priority: int, kind: str, args: RawJson, metadata: RawJson | None,
                           max_attempts: int, run_at: _dt.datetime | None = None,
                           delay: float | None = None) -> tuple[int, bool]:
        """Enqueue one unique job: ``(job_id, True)``, or ``(holder_id, False)`` with nothing written."""
        row = conn.execute(self.q["job_enqueue_unique"], (key, period, states, queue, priority, kind, args,
                                                          metadata, max_attempts, run_at, delay)).fetchone()
        assert row is not None
        return int(row[0]), bool(row[1])

    async def job_enqueue_unique_async(self, conn: psycopg.AsyncConnection, key: bytes, period: float | None,
                                       states: int, queue: str, priority: int, kind: str, args: RawJson,
                                       metadata: RawJson | None, max_attempts: int,
                                       run_at: _dt.datetime | None = None,
                                       delay: float | None = None) -> tuple[int, bool]:
        """Async twin of :meth:`job_enqueue_unique`."""
        cur = await conn.execute(self.q["job_enqueue_unique"], (key, period, states, queue, priority, kind, args,
                                                                metadata, max_attempts, run_at, delay))
        row = await cur.fetchone()
        assert row is not None
        return int(row[0]), bool(row[1])

    def job_enqueue_unique_many(self, conn: psycopg.Connection, keys: Sequence[bytes], period: float | None,
                                states: int, queue: str, priority: int, kind: str, args: Sequence[bytes],
                                metadata: RawJson | None, max_attempts: int) -> list[tuple[int, bool]]:
        """Enqueue unique jobs with distinct keys in one statement: ``(job_id, inserted)`` per row."""
        if not keys:
            return []
        rows = conn.execute(self.q["job_enqueue_unique_many"], (
            list(keys), period, states, queue, priority, kind, as_jsonb(args), metadata, max_attempts)).fetchall()
        return [(int(j), bool(i)) for j, i in rows]

    async def job_enqueue_unique_many_async(self, conn: psycopg.AsyncConnection, keys: Sequence[bytes],
                                            period: float | None, states: int, queue: str, priority: int,
                                            kind: str, args: Sequence[bytes], metadata: RawJson | None,
                                            max_attempts: int) -> list[tuple[int, bool]]:
        """Async twin of :meth:`job_enqueue_unique_many`."""
        if not keys:
            return []
        cur = await conn.execute(self.q["job_enqueue_unique_many"], (
            list(keys), period, states, queue, priority, kind, as_jsonb(args), metadata, max_attempts))
        return [(int(j), bool(i)) for j, i in await cur.fetchall()]

    def unique_sweep(self, conn: psycopg.Connection, after: tuple[bytes, int] | None,
                     limit: int = 1000) -> tuple[int, int, tuple[bytes, int] | None]:
        """One batch of the stale unique-key sweep: ``(swept, scanned, next position or None at the end)``."""
        row = conn.execute(self.q["unique_sweep"], (after[0] if after else None, after[1] if after else None,
                                                    limit)).fetchone()
        assert row is not None
        pos = (bytes(row[2]), int(row[3])) if row[2] is not None else None
        return int(row[0] or 0), int(row[1] or 0), pos

    def unique_key_holder(self, conn: psycopg.Connection, key: bytes) -> int | None:
        """The job recorded as holding ``key`` (newest bucket), whatever its state; None if no row."""
        row = conn.execute(self.q["unique_key_holder"], (key,)).fetchone()
        return None if row is None else int(row[0])

    def schedule_upsert(self, conn: psycopg.Connection, row: dict[str, Any]) -> str:
        """Insert or update a declared schedule: ``created``, ``updated`` or ``unchanged``."""
        got = conn.execute(self.q["schedule_upsert"], row).fetchone()
        if got is None:
            return "unchanged"
        return "created" if got[0] else "updated"

    def schedule_disable_missing(self, conn: psycopg.Connection, source: str, names: Sequence[str]) -> list[str]:
        """Disable the schedules of ``source`` not in ``names``; returns the names disabled."""
        return [str(r[0]) for r in conn.execute(self.q["schedule_disable_missing"], (source, list(names)))]

    def schedule_due_list(self, conn: psycopg.Connection) -> tuple[_dt.datetime | None, list[tuple[Any, ...]]]:
        """The database clock and ``(name, cron, timezone, missed, cap, anchor_at, last_tick)`` per active schedule."""
        rows = conn.execute(self.q["schedule_due_list"]).fetchall()
        if not rows:
            return None, []
        return rows[0][0], [tuple(r[1:]) for r in rows]

    def db_now(self, conn: psycopg.Connection) -> _dt.datetime:
        """The database clock."""
        row = conn.execute(self.q["db_now"]).fetchone()
        assert row is not None
        now: _dt.datetime = row[0]
        return now

    def schedule_fire(self, conn: psycopg.Connection, name: str, tick: _dt.datetime | None,
                      prev: _dt.datetime | None, coalesced: int, cron: str, timezone: str,
                      manual: bool = False) -> tuple[str, int | None]:
        """Fire one tick of a schedule in the current transaction: ``(outcome, job_id)``."""
        row = conn.execute(self.q["schedule_fire"], (name, tick, prev, coalesced, cron, timezone,
                                                     manual)).fetchone()
        assert row is not None
        return str(row[0]), None if row[1] is None else int(row[1])

    def schedule_list(self, conn: psycopg.Connection) -> tuple[_dt.datetime | None, list[dict[str, Any]]]:
        """The database clock and every schedule with its newest fire."""
        keys = ("name", "cron", "timezone", "kind", "queue", "missed", "enabled", "paused", "source",
                "anchor_at", "last_tick", "last_fired_at")
        rows = conn.execute(self.q["schedule_list"]).fetchall()
        if not rows:
            return self.db_now(conn), []
        return rows[0][0], [dict(zip(keys, r[1:], strict=False)) for r in rows]

    def schedule_pause(self, conn: psycopg.Connection, name: str, paused: bool = True) -> bool:
        """Pause (or resume) a schedule; False if it is unknown."""
        return conn.execute(self.q["schedule_pause"], {"name": name, "paused": paused}).rowcount > 0

    def schedule_fires_list(self, conn: psycopg.Connection, name: str) -> list[dict[str, Any]]:
        """The fire ledger of one schedule, oldest first."""
        keys = ("tick", "prev_tick", "coalesced", "manual", "job_id", "held_by", "fired_at")
        return [dict(zip(keys, r, strict=False)) for r in conn.execute(self.q["schedule_fires_list"], (name,))]

    def schedule_fires_prune(self, conn: psycopg.Connection, keep_s: float, limit: int = 1000) -> int:
        """Delete fires older than ``keep_s`` seconds (one batch); returns how many."""
        return self._scalar_int(conn, "schedule_fires_prune", (keep_s, limit))


# -- statement descriptions of the public API's block (see Storage._run) -------------


@dataclass(frozen=True, slots=True)
class _Stmt(Generic[R]):
    name: str
    params: Any
    shape: Callable[[list[tuple[Any, ...]], int], R]  # (rows, rowcount) -> result


def _int_array(values: list[int]) -> str:
    """A PostgreSQL array literal of ints (the query casts it): one join in C instead of a dump per element."""
    return "{" + ",".join(map(str, values)) + "}"


def _text_array(values: list[str]) -> str:
    """A PostgreSQL array literal of strings (the query casts it), every element quoted.

    Quoted, an element is taken as it is (``NULL``, commas, braces and spaces included) once its
    backslashes and double quotes are escaped. Strings never hold NUL (the database refuses it).
    """
    return "{" + ",".join(['"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"' for v in values]) + "}"


def _bool_array(values: list[bool]) -> str:
    """A PostgreSQL array literal of booleans (the query casts it)."""
    return "{" + ",".join(["t" if v else "f" for v in values]) + "}"


# Where a job in each state may live ("waiting": key_waiting, a keyed job held until its key has room,
# which job_load_keyed reports as available, or scheduled while its run_at is ahead).
_STATE_PLANES = {
    "available": {"ready", "waiting"}, "running": {"ready"}, "cancelled": {"ready", "done"},
    # a job completed by a compact done row (0015) is found through its ready row
    "completed": {"done", "ready"}, "failed": {"done"}, "dlq": {"dlq"},
    "scheduled": {"deferred", "waiting"}, "retryable": {"deferred"}, "snoozed": {"deferred"},
    "waiting_external": {"leases"},
}
_PLANES = ("ready", "done", "deferred", "dlq", "leases", "waiting")


def _json_value(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray, memoryview)):
        import msgspec

        return msgspec.json.decode(bytes(value))
    return value


# Why an unknown job is looked up twice (``job_load``, ``job_load_many``). The lookup's
# claimed-or-not test reads the lane's claim cursor, a sequence, which is not in the
# statement's snapshot: a claim that committed its receipt after the snapshot was taken,
# followed by the next claim moving the cursor past it, made a job that was being claimed
# look claimed, closed and without a record, so unknown (seen as None from a poll of a
# job in flight). A second statement has a new snapshot (READ COMMITTED) in which that
# receipt is visible; a job that is really unknown costs one more lookup. Inside a
# REPEATABLE READ transaction the second statement reuses the snapshot and may still
# answer unknown for a job in flight.


def _fill_unknown(jobs: list[dict[str, Any] | None], again: list[int],
                  retry: list[dict[str, Any] | None]) -> None:
    """Put the second lookup's answers (``retry``, for positions ``again``) into ``jobs``."""
    for i, job in zip(again, retry, strict=True):
        jobs[i] = job


def _job_load_many(job_ids: Sequence[int]) -> _Stmt[list[dict[str, Any] | None]]:
    def shape(rows: list[tuple[Any, ...]], _n: int) -> list[dict[str, Any] | None]:
        out: list[dict[str, Any] | None] = []
        for _job_id, value, progress in rows:
            if value is None:
                out.append(None)
                continue
            job = dict(_json_value(value))
            job["progress"] = _json_value(progress)
            out.append(job)
        return out

    return _Stmt("job_load_many", ([int(j) for j in job_ids],), shape)


def _job_list_ids(queue: str | None, kind: str | None, state: str | None, limit: int,
                  before: int | None) -> _Stmt[list[int]]:
    planes = _STATE_PLANES[state] if state is not None else set(_PLANES)
    params: dict[str, Any] = {p: p in planes for p in _PLANES}
    params.update(queue=queue, kind=kind, limit=limit, before=before)
    return _Stmt("job_list_ids", params, lambda rows, _n: [int(r[0]) for r in rows])


def _keep_state(jobs: list[dict[str, Any] | None], state: str | None) -> list[dict[str, Any]]:
    return [j for j in jobs if j is not None and (state is None or j.get("state") == state)]


def _job_retry(job_id: int) -> _Stmt[str | None]:
    def shape(rows: list[tuple[Any, ...]], _n: int) -> str | None:
        value = rows[0][0] if rows else None
        return None if value is None else str(value)

    return _Stmt("job_retry", {"job_id": job_id}, shape)


_QUEUE_SETTING_KEYS = ("queue", "paused", "stripes", "enqueue_shards", "dlq_enabled", "deadline_s",
                       "heartbeat_timeout_s", "aging_interval_s", "dlq_retention_s", "created_at",
                       "history_retention_s", "key_max_running")


def _queue_settings(queue: str | None) -> _Stmt[list[dict[str, Any]]]:
    return _Stmt("queue_settings", {"queue": queue},
                 lambda rows, _n: [dict(zip(_QUEUE_SETTING_KEYS, r, strict=False)) for r in rows])


_DLQ_KEYS = ("job_id", "queue", "kind", "attempt", "max_attempts", "reason", "failed_at", "args")


def _dlq_select(job_ids: Sequence[int] | None, queue: str | None, limit: int) -> _Stmt[list[dict[str, Any]]]:
    def shape(rows: list[tuple[Any, ...]], _n: int) -> list[dict[str, Any]]:
        out = [dict(zip(_DLQ_KEYS, r, strict=False)) for r in rows]
        for row in out:
            row["args"] = _json_value(row["args"])
        return out

    ids = None if job_ids is None else [int(j) for j in job_ids]
    return _Stmt("dlq_select", {"ids": ids, "queue": queue, "limit": limit}, shape)


def _dlq_where(name: str, job_ids: Sequence[int] | None, queue: str | None) -> _Stmt[list[int]]:
    ids = None if job_ids is None else [int(j) for j in job_ids]
    return _Stmt(name, {"ids": ids, "queue": queue}, lambda rows, _n: sorted(int(r[0]) for r in rows))


def _first_text(rows: list[tuple[Any, ...]], _n: int) -> str:
    return str(rows[0][0])


def _nothing(_rows: list[tuple[Any, ...]], _n: int) -> None:
    return None


def _counts(rows: list[tuple[Any, ...]], _n: int) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for queue, state, count in rows:
        out.setdefault(queue, {})[state] = int(count)
    return out



def _limits_from_row(queue: str, row: Any) -> QueueLimits | None:
    from awa_fast.limits import QueueLimits, Rate

    if row is None:
        return None
    max_running, count, per, burst = row
    rate = Rate(float(count), per=float(per), burst=float(burst)) if count is not None else None
    return QueueLimits(queue, None if max_running is None else int(max_running), rate)


def _limits_params(queue: str, max_running: Any, max_rate: Any) -> dict[str, Any]:
    from awa_fast.limits import Rate, check_max_running

    keep_running = max_running is _LIMIT_KEEP
    keep_rate = max_rate is _LIMIT_KEEP
    running = None if keep_running else check_max_running(max_running)
    rate = None if keep_rate else max_rate
    if rate is not None and not isinstance(rate, Rate):
        raise ConfigError(f"max_rate={rate!r}: use awa_fast.Rate(count, per=seconds, burst=n) or None")
    return {"queue": queue, "max_running": running, "keep_running": keep_running, "keep_rate": keep_rate,
            "rate_count": rate.count if rate else None, "rate_per": rate.per if rate else None,
            "rate_burst": rate.burst if rate else None}


def _limit_status(rows: Sequence[Any]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for queue, max_running, count, per, burst, running, tokens in rows:
        out[queue] = {"max_running": max_running,
                      "rate": None if count is None else {"count": count, "per": per, "burst": burst},
                      "running": int(running), "tokens": None if tokens is None else float(tokens)}
    return out
