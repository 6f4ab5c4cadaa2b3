"""Completions and claims read a few index entries, however full the claim slot is (0022, 0023).

receipt_complete_rows_v2 tests each attempt for staleness with three EXISTS probes
(its closure, a whole-receipt closure, its receipt). Planned as hashed subplans, those
probes read every closure and every receipt of the claim slot once per call, so a
completion's cost grew with everything claimed since the ring rotated into the slot.
These tests fill a claim slot, let the planner see it (VACUUM ANALYZE, a new backend),
complete one more job and count the rows and index entries the call read in the claim ring.
The claim's lookup of a lane's receipts past its cursor (lane_cursor_advance) had the
same shape: a sequential scan of the current claim slot once its statistics showed one lane.
The worker connections here are set up as the runtime's are (the batcher's without sequential
scans, ``session_index_probes``; the claimer's cursor lookup the same way, migration 0026): a
plan made while a slot's statistics are those of an empty table scans it whole once it fills
(the last tests), which also made the checks above fail now and then. A limited queue's claim
lists its open receipts by key the same way (``limit_open_receipts``, migration 0027).
"""

from __future__ import annotations

import msgspec
import psycopg
import pytest

from tests.fixtures.database import connect, scalar, sqlx
from tests.integration.storage_helpers import claim, counts, enqueue

pytestmark = pytest.mark.integration

Q = "q"
FILL = 300


def _claim_ring_reads(conn: psycopg.Connection, schema: str) -> dict[str, int]:
    """Rows and index entries this transaction's scans read in the claim ring's children.

    Per relation: a table's count is the rows its sequential scans returned, an index's the
    entries its scans returned (pg_stat_get_xact_tuples_returned).
    """
    rows = sqlx(conn, schema, """
        SELECT r.relname, pg_stat_get_xact_tuples_returned(r.oid)
        FROM pg_class r JOIN pg_namespace n ON n.oid = r.relnamespace
        LEFT JOIN pg_index x ON x.indexrelid = r.oid
        JOIN pg_class t ON t.oid = COALESCE(x.indrelid, r.oid)
        WHERE n.nspname = %s AND t.relkind = 'r'
          AND t.relname ~ '^(lease_claims|lease_claim_closures|lease_claim_closure_batches)_[0-9]+$'""",
                (schema,)).fetchall()
    return {name: int(n) for name, n in rows if n}


def _runtime_session(pg_dsn: str, schema: str, storage, tag: str) -> psycopg.Connection:  # noqa: ANN001
    """A connection set up as the runtime's session ``tag`` is, in a transaction.

    The batcher's turns sequential scans off (``session_index_probes``); the claimer's keeps them,
    and its one claim-ring lookup runs without them (``lane_cursor_advance``, migration 0026).
    Without either, a plan made while a slot's statistics are small scans the slot (the last tests).
    """
    c = connect(pg_dsn, schema, autocommit=False, tag=tag)
    if tag != "claimer":
        storage.session_index_probes(c)
        c.commit()
    return c


def _filled_slot(pg_dsn: str, schema: str, storage, conn) -> list:  # noqa: ANN001
    """FILL receipts of one job each, all completed, in claim slot 0; one more claimed and open."""
    for _ in range(FILL + 1):
        enqueue(schema, conn, Q)
    snaps = [claim(storage, conn, Q, 1)[0] for _ in range(FILL + 1)]
    assert {s.claim_slot for s in snaps} == {0} and len({s.claim_id for s in snaps}) == FILL + 1
    for s in snaps[:FILL]:
        assert storage.receipt_complete_rows(conn, [s]) == []
    with connect(pg_dsn, schema) as admin:  # the planner of the next backend sees a full slot
        sqlx(admin, schema, "VACUUM ANALYZE __SCHEMA__.lease_claims_0, __SCHEMA__.lease_claim_closures_0, "
                            "__SCHEMA__.lease_claim_closure_batches_0")
    return snaps


@pytest.mark.parametrize("several_slots", [False, True], ids=["one slot (v2)", "across slots (v1)"])
def test_a_completion_reads_a_few_entries_not_the_whole_slot(pg_dsn, schema, storage, conn, several_slots):
    snaps = _filled_slot(pg_dsn, schema, storage, conn)
    last = snaps[-1]
    batch = [last]
    if several_slots:
        # a batch across a claim-ring rotation goes the version-1 way
        assert storage.ring_rotate(conn, "claim") == 1
        enqueue(schema, conn, Q)
        [other] = claim(storage, conn, Q, 1)
        assert other.claim_slot == 1
        batch = [last, other]
    with _runtime_session(pg_dsn, schema, storage, "batcher") as b:
        assert storage.receipt_complete_rows(b, batch) == []
        reads = _claim_ring_reads(b, schema)
        b.commit()
    # a probe per attempt and test: a handful of entries, not the FILL closures and receipts of slot 0
    assert sum(reads.values()) <= 4 * len(batch), reads
    assert counts(storage, conn, Q) == {"completed": FILL + len(batch)}


def _copy_whole(storage, b, snap):  # noqa: ANN001, ANN202
    return storage.receipt_complete(b, [snap], {(snap.claim_slot, snap.claim_id)}, ())


def _copy_part(storage, b, snap):  # noqa: ANN001, ANN202
    return storage.receipt_complete(b, [snap], set(), ())


def _with_result(storage, b, snap):  # noqa: ANN001, ANN202
    return storage.receipt_complete_results(b, [(snap, False, b'{"ok": 1}')], set())


@pytest.mark.parametrize("path", [_copy_whole, _copy_part, _with_result],
                         ids=["COPY, whole receipt", "COPY, part of a receipt", "with a result"])
def test_the_copy_completions_guard_probes_per_receipt(pg_dsn, schema, storage, conn, path):
    """receipt_guard (the COPY completion's receipt test) and receipt_complete_results' gone test."""
    snaps = _filled_slot(pg_dsn, schema, storage, conn)
    with _runtime_session(pg_dsn, schema, storage, "batcher") as b:
        assert path(storage, b, snaps[-1]) == []
        reads = _claim_ring_reads(b, schema)
        b.commit()
    assert sum(reads.values()) <= 4, reads
    assert counts(storage, conn, Q) == {"completed": FILL + 1}


def test_a_stale_attempt_is_still_found_by_the_probes(pg_dsn, schema, storage, conn):
    snaps = _filled_slot(pg_dsn, schema, storage, conn)
    done, last = snaps[0], snaps[-1]
    # already closed (its closure), and a receipt that is not there: both stale; the open one completes
    ghost = msgspec.structs.replace(last, claim_id=10 ** 12)
    with connect(pg_dsn, schema) as b:
        assert storage.receipt_complete_rows(b, [done, last, ghost]) == sorted(
            [(done.job_id, done.run_lease), (ghost.job_id, ghost.run_lease)])
    with connect(pg_dsn, schema, autocommit=False) as b:
        assert sorted(storage.receipt_complete(b, [done, ghost], set(), ())) == sorted(
            [(done.job_id, done.run_lease), (ghost.job_id, ghost.run_lease)])
        b.commit()
    assert counts(storage, conn, Q) == {"completed": FILL + 1}


def test_a_claim_reads_the_receipts_past_its_cursor_not_the_whole_slot(pg_dsn, schema, storage, conn):
    snaps = _filled_slot(pg_dsn, schema, storage, conn)
    assert storage.receipt_complete_rows(conn, [snaps[-1]]) == []
    job = enqueue(schema, conn, Q)
    with _runtime_session(pg_dsn, schema, storage, "claimer") as b:
        [snap] = storage.lane_claim(b, Q, 64)
        reads = _claim_ring_reads(b, schema)
        b.commit()
    assert snap.job_id == job
    # the lane's receipts past its cursor (none) in each partition's (lane_id, last_seq) index,
    # not the FILL receipts of slot 0
    assert sum(reads.values()) <= 4, reads


def _ring_reads(conn: psycopg.Connection, schema: str) -> dict[str, int]:
    """As :func:`_claim_ring_reads`, over every ring child: the ready ring's as well."""
    rows = sqlx(conn, schema, """
        SELECT r.relname, pg_stat_get_xact_tuples_returned(r.oid)
        FROM pg_class r JOIN pg_namespace n ON n.oid = r.relnamespace
        LEFT JOIN pg_index x ON x.indexrelid = r.oid
        JOIN pg_class t ON t.oid = COALESCE(x.indrelid, r.oid)
        WHERE n.nspname = %s AND t.relkind = 'r' AND t.relname ~ '_[0-9]+$'""", (schema,)).fetchall()
    return {name: int(n) for name, n in rows if n}


def _one_producer_per_shard(pg_dsn: str, schema: str, shards: int) -> list[psycopg.Connection]:
    """``shards`` connections whose backends prefer distinct enqueue shards (backend pid modulo ``shards``).

    Connections opened one after another usually get consecutive pids, not always (a worker the server
    starts in between takes one): the others are closed.
    """
    by_shard: dict[int, psycopg.Connection] = {}
    spare: list[psycopg.Connection] = []
    try:
        for _ in range(16 * shards):
            if len(by_shard) == shards:
                return list(by_shard.values())
            c = connect(pg_dsn, schema, tag=f"producer{len(by_shard)}")
            shard = c.info.backend_pid % shards
            if shard in by_shard:
                spare.append(c)
            else:
                by_shard[shard] = c
        raise AssertionError(f"no backend for some of {shards} shards in {16 * shards} connections")
    finally:
        for c in spare:
            c.close()


def test_a_claim_from_a_deep_lane_reads_the_rows_it_takes(pg_dsn, schema, storage, conn):
    """Four lanes, 150 jobs each done, then a backlog of 100 per lane, all analyzed (0024)."""
    storage.queue_configure(conn, Q, enqueue_shards=4)
    producers = _one_producer_per_shard(pg_dsn, schema, 4)
    try:
        for _ in range(150):
            for p in producers:
                enqueue(schema, p, Q)
        while snaps := claim(storage, conn, Q, 3):
            assert storage.receipt_complete_rows(conn, snaps) == []
        for _ in range(100):
            for p in producers:
                enqueue(schema, p, Q)
    finally:
        for p in producers:
            p.close()
    assert len({lane for (lane,) in sqlx(conn, schema, "SELECT DISTINCT lane_id FROM __SCHEMA__.ready_entries")}) == 4
    with connect(pg_dsn, schema) as admin:
        sqlx(admin, schema, "ANALYZE")
    with _runtime_session(pg_dsn, schema, storage, "claimer") as b:
        taken = storage.lane_claim(b, Q, 8)
        claim_reads = _ring_reads(b, schema)
        b.commit()
    assert len(taken) == 8
    with _runtime_session(pg_dsn, schema, storage, "batcher") as b:
        assert storage.receipt_complete(b, taken, set(), ()) == []
        complete_reads = _ring_reads(b, schema)
        b.commit()
    # the rows it takes (twice: the receipt, then the rows themselves) and a few index probes; not a
    # lane's 100 backlog rows, nor the 600 receipts and closures of the claim slot
    assert sum(claim_reads.values()) <= 3 * len(taken) + 16, claim_reads
    assert sum(complete_reads.values()) <= 4 * len(taken), complete_reads
    assert counts(storage, conn, Q) == {"completed": 600 + 8, "available": 400 - 8}


_CLAIM_RING_SLOT0 = ("lease_claims_0", "lease_claim_closures_0", "lease_claim_closure_batches_0")


def _slot0_with_empty_statistics(conn: psycopg.Connection, schema: str) -> None:
    """Claim slot 0 keeps an empty table's statistics: taken now, autovacuum off so no ANALYZE replaces them."""
    for table in _CLAIM_RING_SLOT0:
        sqlx(conn, schema, f"ALTER TABLE __SCHEMA__.{table} SET (autovacuum_enabled = false)")
        sqlx(conn, schema, f"ANALYZE __SCHEMA__.{table}")  # empty: 0 rows, 0 pages


def _slot0_reltuples(conn: psycopg.Connection, schema: str) -> float:
    return float(scalar(conn, schema,
                        "SELECT reltuples FROM pg_class WHERE oid = '__SCHEMA__.lease_claims_0'::regclass"))


def completed_receipts(storage, schema: str, conn: psycopg.Connection, n: int = FILL) -> list:  # noqa: ANN001
    """``n`` receipts of one job each in the queue's lane, all completed; their snapshots."""
    for _ in range(n):
        enqueue(schema, conn, Q)
    snaps = [claim(storage, conn, Q, 1)[0] for _ in range(n)]
    for snap in snaps:
        assert storage.receipt_complete_rows(conn, [snap]) == []
    return snaps


def _complete_quiet(storage, b, snap):  # noqa: ANN001, ANN202
    return storage.receipt_complete_rows(b, [snap])


_COMPLETIONS = {"COPY, whole receipt": _copy_whole, "COPY, part of a receipt": _copy_part,
                "with a result": _with_result, "quiet": _complete_quiet}


def _enqueue_in_two_lanes(pg_dsn: str, schema: str) -> None:
    """One job in each of two lanes: the second producer finds the first one's lane locked."""
    with connect(pg_dsn, schema, autocommit=False, tag="p1") as p1, connect(pg_dsn, schema, tag="p2") as p2:
        enqueue(schema, p1, Q)
        enqueue(schema, p2, Q)  # its preferred lane may be p1's, held until p1 commits: another shard
        p1.commit()


@pytest.mark.parametrize("path", [*_COMPLETIONS, "claim", "claim, two lanes"])
def test_a_backend_that_planned_on_an_empty_ring_still_probes_by_key(pg_dsn, schema, storage, conn, path):
    """A batcher or claimer plans its generic plans once, when a ring slot may be freshly truncated
    (statistics of an empty table): those plans must still read a few index entries once the slot is
    full. Autovacuum is off on slot 0 here, so no ANALYZE replans them in between. With two lanes
    the claim also orders the lanes by their receipts past the cursor (claim_batch_v4)."""
    _slot0_with_empty_statistics(conn, schema)
    claiming = path.startswith("claim")
    lanes = 2 if path == "claim, two lanes" else 1
    with _runtime_session(pg_dsn, schema, storage, "claimer" if claiming else "batcher") as b:

        def step() -> dict[str, int]:
            if lanes == 2:
                _enqueue_in_two_lanes(pg_dsn, schema)
            else:
                enqueue(schema, conn, Q)
            if claiming:
                before = _claim_ring_reads(b, schema)
                snaps = storage.lane_claim(b, Q, 64)
                assert len({s.lane_id for s in snaps}) == len(snaps) == lanes
            else:
                snaps = claim(storage, conn, Q, 1)
                before = _claim_ring_reads(b, schema)
                assert _COMPLETIONS[path](storage, b, snaps[0]) == []
            after = _claim_ring_reads(b, schema)
            b.commit()
            if claiming:
                assert storage.receipt_complete_rows(conn, snaps) == []
            return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}

        step()  # plans every statement of the path while slot 0 is empty
        completed_receipts(storage, schema, conn)  # in slot 0, none analyzed
        assert _slot0_reltuples(conn, schema) == 0.0  # still the empty slot's statistics
        reads = step()
    assert sum(reads.values()) <= 4 * lanes, reads
    assert counts(storage, conn, Q) == {"completed": FILL + 2 * lanes}


def test_the_runtime_plans_its_batcher_and_heartbeat_sessions_without_sequential_scans(pg_dsn, schema):
    from awa_fast.runtime.claimer import Claimer, ClaimerConfig

    claimer = Claimer(ClaimerConfig(pg_dsn, schema, Q), {}, watch_parent=False)
    try:
        assert claimer.heartbeat._send([], []) == []  # opens the heartbeat's connection
        sessions = {"claim": claimer._claim_connection(), "batcher": claimer.batcher._connection(),
                    "heartbeat": claimer.heartbeat._conn}
        # the claim session keeps them: its tombstone join would become a probe per claimed row (0026)
        assert {name: c.execute("SHOW enable_seqscan").fetchone() for name, c in sessions.items()} == {
            "claim": ("on",), "batcher": ("off",), "heartbeat": ("off",)}
    finally:
        for c in (claimer._claim_conn, claimer.batcher._conn, claimer.heartbeat._conn):
            if c is not None:
                c.close()


def _claim_one_limited(storage, conn) -> None:  # noqa: ANN001
    snaps, _ = storage.lane_claim_limited_result(conn, Q, 64)
    assert len(snaps) == 1 and storage.receipt_complete_rows(conn, snaps) == []


def test_a_limited_claim_at_its_allowance_planned_on_an_empty_ring_still_probes_by_key(pg_dsn, schema, storage,
                                                                                         conn):
    """A claim through the queue's limits (lane_claim_limited) reads its open receipts and, when the
    limit cuts it short, looks for unclaimed rows past each lane's receipts: both by key, also when
    the claimer planned them while slot 0 had an empty table's statistics."""
    _slot0_with_empty_statistics(conn, schema)
    storage.queue_limits_set(conn, Q, max_running=1)
    with _runtime_session(pg_dsn, schema, storage, "claimer") as b:

        def step() -> dict[str, int]:
            enqueue(schema, conn, Q)
            enqueue(schema, conn, Q)
            before = _claim_ring_reads(b, schema)
            snaps, more = storage.lane_claim_limited_result(b, Q, 64)
            after = _claim_ring_reads(b, schema)
            b.commit()
            assert len(snaps) == 1 and more  # cut short by max_running with a job left: the backlog marker
            assert storage.receipt_complete_rows(conn, snaps) == []
            _claim_one_limited(storage, conn)  # the job the limit left
            return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}

        step()  # plans the limited claim while slot 0 is empty
        for _ in range(FILL):  # every claim of the queue goes through its limits, as the runtime's do
            enqueue(schema, conn, Q)
            _claim_one_limited(storage, conn)
        assert _slot0_reltuples(conn, schema) == 0.0
        reads = step()
    assert sum(reads.values()) <= 8, reads
    assert counts(storage, conn, Q) == {"completed": FILL + 4}
