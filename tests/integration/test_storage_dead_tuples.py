"""Dead-tuple contract (promise 4): nothing that grows with traffic is
UPDATEd or DELETEd row by row on the hot path; history is reclaimed by ring
rotation and TRUNCATE. With autovacuum off on every table, 100,000 jobs
enqueued (COPY), claimed and completed leave a small, bounded number of dead
tuples (exact counts from pgstattuple) that does not grow with the number of
jobs.
"""

from __future__ import annotations

import time

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
    hot = ("ready_entries", "ready_segments", "done_entries", "lease_claims", "lease_claim_closures",
           "lease_claim_closure_batches", "queue_claim_heads", "queue_enqueue_heads")
    assert not [t for t in measured[100_000] if t.rstrip("_0123456789") in hot], detail
    # sanity: pgstattuple sees every table of the schema
    assert len(leaf_tables(conn, schema)) > 30
    assert int(scalar(conn, schema, "SELECT count(*) FROM __SCHEMA__.queue_terminal_rollups")) == 1
    assert counts(storage, conn, Q) == {"completed": 100_000}
