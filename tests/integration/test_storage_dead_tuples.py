"""Dead-tuple contract (promise 4): nothing that grows with traffic is
UPDATEd or DELETEd row by row on the hot path; history is reclaimed by ring
rotation and TRUNCATE. With autovacuum off on every table, 100,000 jobs
enqueued (COPY), claimed and completed leave a small, bounded number of dead
tuples (exact counts from pgstattuple) that does not grow with the number of
jobs.
"""

from __future__ import annotations

import time

import psycopg

from awa_fast.client import Client
from tests.fixtures.database import scalar
from tests.integration.storage_helpers import (
    counts,
    dead_tuples_exact,
    disable_autovacuum,
    ensure_pgstattuple,
    leaf_tables,
    rotate_and_prune,
)

Q = "q"


def test_dead_tuples_stay_bounded_and_do_not_grow_with_jobs(pg_dsn, schema, storage, conn):
    ensure_pgstattuple(conn)
    disable_autovacuum(conn, schema)
    off = conn.execute(
        "SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = %s AND c.relkind = 'r' AND NOT ('autovacuum_enabled=false' = ANY (c.reloptions))",
        (schema,)).fetchone()
    assert off == (0,), "autovacuum is still enabled on some table"
    cli = Client(None, schema)
    per_round, batch, rounds = 20_000, 500, 5
    measured: dict[int, dict[str, int]] = {}
    prune_outcomes: dict[str, list[str]] = {"claim": [], "ready": []}
    done = 0
    batches = 0
    t0 = time.monotonic()
    for r in range(rounds):
        assert cli.enqueue_many("dt.job", ({"n": r * per_round + i} for i in range(per_round)), queue=Q,
                                conn=conn) == per_round
        while True:
            snaps = storage.lane_claim(conn, Q, batch)
            if not snaps:
                break
            with conn.transaction():
                assert storage.receipt_complete(conn, snaps, {(s.claim_slot, s.claim_id) for s in snaps}) == []
            done += len(snaps)
            batches += 1
            if batches % 4 == 0:  # the claim ring rotates fast
                new, outcomes = rotate_and_prune(storage, conn, "claim")
                assert new is not None, "claim ring full: sealed slots were not pruned"
                prune_outcomes["claim"].extend(outcomes.values())
        # the ready ring rotates every 20k jobs
        new, outcomes = rotate_and_prune(storage, conn, "ready")
        assert new is not None, "ready ring full: sealed slots were not pruned"
        prune_outcomes["ready"].extend(outcomes.values())
        _, outcomes = rotate_and_prune(storage, conn, "claim")
        prune_outcomes["claim"].extend(outcomes.values())
        assert done == (r + 1) * per_round
        if done in (20_000, 100_000):
            measured[done] = dead_tuples_exact(conn, schema)
    elapsed = time.monotonic() - t0

    assert storage.queue_counts_exact(conn) == {Q: {"completed": 100_000}}
    assert "pruned" in prune_outcomes["ready"] and "pruned" in prune_outcomes["claim"]
    at20, at100 = sum(measured[20_000].values()), sum(measured[100_000].values())
    detail = f"dead tuples at 20k: {measured[20_000]}; at 100k: {measured[100_000]}; took {elapsed:.1f}s"
    assert at100 <= 500, detail
    # does not grow with the number of jobs: five times the jobs, at most a small constant more
    assert at100 <= at20 + 100, detail
    # the hot-path tables themselves hold no dead tuples at all
    hot = ("ready_entries", "ready_segments", "done_entries", "done_receipts", "lease_claims",
           "lease_claim_closures", "lease_claim_closure_batches", "queue_claim_heads", "queue_enqueue_heads")
    assert not [t for t in measured[100_000] if t.rstrip("_0123456789") in hot], detail
    # sanity: pgstattuple sees every table of the schema
    assert len(leaf_tables(conn, schema)) > 30
    assert int(scalar(conn, schema, "SELECT count(*) FROM __SCHEMA__.queue_terminal_rollups")) == 1
    assert counts(storage, conn, Q) == {"completed": 100_000}


SPAN = 256  # generations per ledger child (sql/0013_rotation_ledger_truncate.sql)


def _ledger(conn, schema: str, ring: str) -> dict[str, int]:
    """Rows per leaf of one ring's rotation ledger."""
    out = {}
    for b in (0, 1):
        leaf = f"ring_rotations_{ring}_{b}"
        out[leaf] = int(scalar(conn, schema, f"SELECT count(*) FROM __SCHEMA__.{leaf}"))
    return out


def test_rotation_ledger_is_reclaimed_by_truncate_under_a_pinned_reader(pg_dsn, schema, storage, conn):
    """Promise 4 under a pinned xmin: rotating a ring leaves no dead tuple in its ledger.

    The ledger used to DELETE the generation two cycles back at each rotation:
    one dead tuple per rotation that a reader idle in transaction kept from
    vacuum. Now the older span's child is truncated, and every slot's latest
    generation (read by retention and the slot stats) survives the trim.
    """
    ensure_pgstattuple(conn)
    disable_autovacuum(conn, schema)
    reader = psycopg.connect(pg_dsn, autocommit=False)
    try:
        # a reader that pins the xmin horizon but reads nothing of the ledger
        reader.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        reader.execute(f'SELECT count(*) FROM "{schema}".queue_meta').fetchone()
        assert reader.execute("SELECT backend_xmin IS NOT NULL FROM pg_stat_activity "
                              "WHERE pid = pg_backend_pid()").fetchone() == (True,)
        count = int(storage.ring_state(conn)["claim"]["slots"])
        rotations = 2 * SPAN + count + 10
        for g in range(1, rotations + 1):
            assert storage.ring_rotate(conn, "claim") == g % count
        state = storage.ring_state(conn)["claim"]
        assert (state["generation"], state["slot"]) == (rotations, rotations % count)
        dead = {t: n for t, n in dead_tuples_exact(conn, schema).items() if t.startswith("ring_rotations")}
        assert dead == {}, dead
        rows = _ledger(conn, schema, "claim")
        # the older span was truncated: only the current span (and at most a cycle before it) is kept
        assert sum(rows.values()) <= SPAN + count, rows
        assert min(rows.values()) == 0, rows
        # every slot's latest generation is still there (ring_prune_v2's quiet mark, ring_slot_stats)
        latest = dict(conn.execute(f'SELECT slot, max(generation) FROM "{schema}".ring_rotations '
                                   "WHERE ring = 'claim' GROUP BY slot").fetchall())
        assert latest == {s: rotations - ((rotations - s) % count) for s in range(count)}
        assert reader.execute("SELECT 1").fetchone() == (1,)  # the reader was never disturbed
    finally:
        reader.close()


def test_rotation_waits_for_a_ledger_reader_only_at_a_span_boundary(pg_dsn, schema, storage, conn):
    """A transaction that read the ring state holds the ledger children: a trim skips it
    (quickly, under the lock timeout) and the rotation goes on, until entering the next
    span needs that child emptied; then the ring reports full (None) until the reader ends."""
    count = int(storage.ring_state(conn)["claim"]["slots"])
    for g in range(1, SPAN):
        assert storage.ring_rotate(conn, "claim") == g % count
    holder = psycopg.connect(pg_dsn, autocommit=False)
    try:
        holder.execute(f"""SELECT "{schema}".ring_current('claim')""").fetchone()  # ACCESS SHARE on both children
        t0 = time.monotonic()
        got = [storage.ring_rotate(conn, "claim", lock_timeout_ms=20) for _ in range(SPAN + 1)]
        took = time.monotonic() - t0
        # generations SPAN .. 2*SPAN-1 go in (the first span's child is trimmed nowhere: still read),
        # then generation 2*SPAN needs the first child empty and the reader holds it
        assert got[:SPAN] == [g % count for g in range(SPAN, 2 * SPAN)], got
        assert got[SPAN] is None, got[SPAN:]
        assert storage.ring_state(conn)["claim"]["generation"] == 2 * SPAN - 1
        assert took < 30, took
        holder.rollback()
        assert storage.ring_rotate(conn, "claim") == (2 * SPAN) % count
        rows = _ledger(conn, schema, "claim")
        assert rows == {"ring_rotations_claim_0": 1, "ring_rotations_claim_1": SPAN}, rows
    finally:
        holder.close()
