"""Compact done rows (migration 0015): one ``done_receipts`` row per receipt and flush.

A plain completion through the COPY path writes one row naming the attempts
of one receipt that it completes, instead of a ``done_entries`` row per job.
Every reader must see those jobs as completed, exactly once: ``job_load``,
``job_cancel``, the counts, prune's rollups, a replayed flush's check, the
job list, unique-key release and the per-key admission gate. A stale writer
(a rescued attempt) writes no row of either shape.
"""

from __future__ import annotations

import pytest

from awa_fast.client import PRIORITY_DEFAULT, Client
from awa_fast.outcomes import CloseCode
from tests.fixtures.database import scalar, sqlx
from tests.fixtures.supervisor import SupervisorProc
from tests.fixtures.waiting import wait_for
from tests.integration import runtime_helpers as rt
from tests.integration.storage_helpers import (
    KIND,
    claim,
    close,
    complete,
    counts,
    enqueue,
    load,
    raw,
)

pytestmark = pytest.mark.integration

Q = "q"


def n_rows(conn, schema, table: str) -> int:  # noqa: ANN001
    return int(scalar(conn, schema, f"SELECT count(*) FROM __SCHEMA__.{table}"))


def compact_rows(conn, schema) -> list[tuple[int, list[int], list[int]]]:  # noqa: ANN001
    return [(int(c), list(j), list(rl)) for c, j, rl in sqlx(
        conn, schema, "SELECT claim_id, job_ids, run_leases FROM __SCHEMA__.done_receipts "
                      "ORDER BY claim_id, finished_at, job_ids").fetchall()]


def pairs(snaps) -> list[tuple[int, int]]:  # noqa: ANN001
    return sorted((s.job_id, s.run_lease) for s in snaps)


def test_whole_receipt_is_one_compact_row_that_every_reader_sees(schema, storage, conn):
    jobs = [enqueue(schema, conn, Q, {"i": i}) for i in range(5)]
    snaps = claim(storage, conn, Q, 10)
    assert [s.job_id for s in snaps] == jobs
    assert complete(storage, conn, snaps, whole=True) == []
    assert n_rows(conn, schema, "done_entries") == 0
    assert compact_rows(conn, schema) == [(snaps[0].claim_id, jobs, [1] * 5)]
    assert n_rows(conn, schema, "lease_claim_closure_batches") == 1
    assert n_rows(conn, schema, "lease_claim_closures") == 0
    assert counts(storage, conn, Q) == {"completed": 5}
    assert storage.queue_terminal_counts(conn)[Q] == {"completed": 5}
    for i, j in enumerate(jobs):
        got = load(storage, conn, j)
        assert got is not None
        assert (got["state"], got["job_id"], got["queue"], got["kind"]) == ("completed", j, Q, KIND)
        assert (got["attempt"], got["run_lease"], got["result"], got["progress"]) == (1, 1, None, None)
        assert got["args"] == {"i": i}
        assert got["finished_at"] is not None
        assert storage.job_cancel(conn, j) == "terminal"
    assert [j["job_id"] for j in storage.job_list(conn, state="completed")] == sorted(jobs, reverse=True)
    # the same flush again (a stale writer, or the replay of a lost acknowledgement) changes nothing,
    # and the replay check finds the attempts completed under their own run_lease
    assert complete(storage, conn, snaps, whole=True) == pairs(snaps)
    assert len(compact_rows(conn, schema)) == 1
    with conn.transaction():
        assert storage.attempts_completed(conn, snaps) == set(pairs(snaps))
    assert counts(storage, conn, Q) == {"completed": 5}


def test_receipt_completed_over_several_flushes_gets_a_row_per_flush(schema, storage, conn):
    jobs = [enqueue(schema, conn, Q, {"i": i}) for i in range(6)]
    snaps = claim(storage, conn, Q, 10)
    assert complete(storage, conn, snaps[:2]) == []
    assert complete(storage, conn, snaps[2:3]) == []
    assert counts(storage, conn, Q) == {"completed": 3, "running": 3}
    assert close(storage, conn, snaps[3], CloseCode.CANCEL) == "ok"  # a per-job terminal row
    assert complete(storage, conn, snaps[4:]) == []
    cid = snaps[0].claim_id
    assert compact_rows(conn, schema) == [(cid, jobs[:2], [1, 1]), (cid, jobs[2:3], [1]), (cid, jobs[4:], [1, 1])]
    assert [int(r[0]) for r in sqlx(conn, schema, "SELECT job_id FROM __SCHEMA__.done_entries").fetchall()] \
        == [jobs[3]]
    assert n_rows(conn, schema, "lease_claim_closures") == 6
    assert counts(storage, conn, Q) == {"completed": 5, "cancelled": 1}
    assert [load(storage, conn, j)["state"] for j in jobs] == ["completed"] * 3 + ["cancelled"] + ["completed"] * 2
    with conn.transaction():
        assert storage.attempts_completed(conn, snaps) == set(pairs(snaps[:3] + snaps[4:]))


def test_rescued_attempts_write_no_compact_row_and_the_rerun_does(schema, storage, conn):
    storage.queue_configure(conn, Q, heartbeat_timeout=0)
    jobs = [enqueue(schema, conn, Q, {"i": i}, max_attempts=3) for i in range(3)]
    old = claim(storage, conn, Q, 10)
    assert storage.receipt_rescue_stale(conn) == 3
    assert complete(storage, conn, old, whole=True) == pairs(old)  # stale: nothing written
    assert n_rows(conn, schema, "done_receipts") == n_rows(conn, schema, "done_entries") == 0
    assert n_rows(conn, schema, "lease_claim_closure_batches") == 0
    new = claim(storage, conn, Q, 10)
    assert [(s.job_id, s.run_lease) for s in new] == [(j, 2) for j in jobs]
    assert complete(storage, conn, new, whole=True) == []
    assert compact_rows(conn, schema) == [(new[0].claim_id, jobs, [2, 2, 2])]
    assert [(g["state"], g["attempt"], g["run_lease"]) for g in (load(storage, conn, j) for j in jobs)] \
        == [("completed", 2, 2)] * 3
    assert complete(storage, conn, old) == pairs(old)  # still stale
    with conn.transaction():
        assert storage.attempts_completed(conn, old) == set()
    assert counts(storage, conn, Q) == {"completed": 3}


def test_prune_folds_compact_rows_into_the_rollups_and_truncates_them(schema, storage, conn):
    jobs = [enqueue(schema, conn, Q, {"i": i}) for i in range(4)]
    snaps = claim(storage, conn, Q, 10)
    assert {s.ready_slot for s in snaps} == {0}
    assert complete(storage, conn, snaps[:1]) == []
    assert complete(storage, conn, snaps[1:]) == []
    assert storage.ring_rotate(conn, "ready") == 1
    assert storage.ring_prune(conn, "ready", 0) == "pruned"
    assert n_rows(conn, schema, "done_receipts_0") == 0
    assert counts(storage, conn, Q) == {"completed": 4}
    assert storage.queue_terminal_counts(conn)[Q] == {"completed": 4}
    assert load(storage, conn, jobs[0]) is None  # history pruned with its slot


def test_unique_keys_follow_compact_completions(schema, storage, conn):
    def enq(key: bytes, states: int) -> tuple[int, bool]:
        return storage.job_enqueue_unique(conn, key, None, states, Q, PRIORITY_DEFAULT, KIND, raw({}), None, 3)

    released, held, swept = enq(b"released", 63), enq(b"held", 63 | 64), enq(b"swept", 63)
    assert all(inserted for _, inserted in (released, held, swept))
    assert enq(b"released", 63) == (released[0], False)  # available: held
    snaps = claim(storage, conn, Q, 10)
    assert complete(storage, conn, snaps, whole=True) == []
    assert n_rows(conn, schema, "done_entries") == 0
    # a completed job releases a key that does not hold completed jobs, keeps one that does
    again, inserted = enq(b"released", 63)
    assert inserted and again != released[0]
    assert enq(b"held", 63 | 64) == (held[0], False)
    # the sweep drops the key of the completed job, never the one that holds completed jobs
    storage.unique_sweep(conn, None, 100)
    assert storage.unique_key_holder(conn, b"swept") is None
    assert storage.unique_key_holder(conn, b"held") == held[0]
    assert storage.unique_key_holder(conn, b"released") == again


def test_compact_completion_frees_the_key_slot_of_a_keyed_queue(pg_dsn, schema, storage, conn):
    kq = "keyed"
    storage.queue_key_limit_set(conn, kq, 1)
    client = Client(pg_dsn, schema)
    a = [client.enqueue("k.work", {"i": i}, queue=kq, concurrency_key="A") for i in range(3)]
    client.close()
    got, _ = storage.lane_claim_keyed_result(conn, kq, 100, 0, 1)
    assert [s.job_id for s in got] == [a[0]]
    assert complete(storage, conn, got, whole=True) == []
    assert n_rows(conn, schema, "done_receipts") == 1
    got2, _ = storage.lane_claim_keyed_result(conn, kq, 100, 0, 1)
    assert [s.job_id for s in got2] == [a[1]]


def test_the_batcher_completes_plain_jobs_with_compact_rows(pg_dsn, schema, storage, conn, tmp_path):
    n = 3000
    with SupervisorProc(pg_dsn, schema, tmp_path, queues=[f"{rt.QUEUE}:stripes=1,concurrency=16"]) as sup:
        sup.wait_running(1)
        ids = rt.enqueue_bulk(pg_dsn, schema, "rt.sync", ({"i": i} for i in range(n)))
        wait_for(lambda: rt.counts(storage, conn).get("completed", 0) >= n, 120, f"{n} completions",
                 interval=0.2, on_timeout=lambda: f"{rt.counts(storage, conn)}\n{sup.tail()}")
        assert sup.stop(60) == 0, sup.tail()
    assert rt.counts(storage, conn) == {"completed": n}
    compact = int(scalar(conn, schema, "SELECT COALESCE(sum(cardinality(job_ids)), 0) FROM __SCHEMA__.done_receipts"))
    per_job = n_rows(conn, schema, "done_entries")  # flushes of at most small_flush take the one-statement path
    assert compact > n // 2 and compact + per_job + sum(rt.rollups(conn, schema).values()) == n
    assert n_rows(conn, schema, "done_receipts") < compact  # many attempts per row
    states = [j["state"] if j is not None else None for j in storage.job_load_many(conn, ids)]
    assert states.count("completed") == compact + per_job  # the rest (if any) pruned into the rollups


def test_the_bench_completion_probe_reads_both_row_shapes(schema, storage, conn):
    """``probes.completion_at_by_job`` (bench latency's end-to-end clock) names each job once,
    whether its done row is compact or per job, with either time source."""
    from awa_fast.storage import probes

    whole = [enqueue(schema, conn, Q, {"i": i}) for i in range(3)]
    complete(storage, conn, claim(storage, conn, Q, 10), whole=True)  # one done_receipts row
    single = enqueue(schema, conn, Q, {"single": 1})
    storage.receipt_complete_rows(conn, claim(storage, conn, Q, 10))  # a done_entries row
    conn.commit()
    assert n_rows(conn, schema, "done_entries") == 1 and len(compact_rows(conn, schema)) == 1
    at = probes.completion_at_by_job(conn, schema, [*whole, single], commit_timestamp=False)
    assert sorted(at) == sorted([*whole, single]) and all(t > 0 for t in at.values())
    # the commit-timestamp form must at least plan on both tables (xmin qualified); with the
    # setting off the server cannot answer it, so it is asked for no job here
    assert probes.completion_at_by_job(conn, schema, [], commit_timestamp=True) == {}


def test_a_whole_receipt_takes_the_receipt_arrays_without_the_per_attempt_statement(schema, storage, conn):
    """A flush holding every attempt of a receipt writes its done row from the receipt's own arrays
    (``receipt_done_whole``): in the receipt's order whatever the flush's order, and the statement that
    builds done rows from per-attempt arrays is not issued at all (here it would fail if it were)."""
    from awa_fast.storage import Storage

    jobs = [enqueue(schema, conn, Q, {"i": i}) for i in range(6)]
    snaps = claim(storage, conn, Q, 10)
    spy = Storage(schema)
    spy.q = {**storage.q, "receipt_done_compact": "SELECT 1 / 0"}
    shuffled = [snaps[i] for i in (3, 0, 5, 1, 4, 2)]
    assert complete(spy, conn, shuffled, whole=True) == []
    assert compact_rows(conn, schema) == [(snaps[0].claim_id, jobs, [1] * 6)]
    assert n_rows(conn, schema, "lease_claim_closure_batches") == 1
    assert counts(storage, conn, Q) == {"completed": 6}
    assert complete(spy, conn, shuffled, whole=True) == pairs(snaps)  # stale now: nothing more written
    assert len(compact_rows(conn, schema)) == 1


def test_the_rest_of_a_receipt_named_whole_completes_only_the_attempts_held(schema, storage, conn):
    """The batcher names a receipt whole when a flush holds all its attempts still open, also after an
    earlier flush completed a part of it: the done row of that flush names only the attempts it holds
    (never the receipt's whole arrays again), and the receipt is closed as a whole."""
    jobs = [enqueue(schema, conn, Q, {"i": i}) for i in range(5)]
    snaps = claim(storage, conn, Q, 10)
    cid = snaps[0].claim_id
    assert complete(storage, conn, snaps[:2]) == []
    assert complete(storage, conn, snaps[2:], whole=True) == []
    assert compact_rows(conn, schema) == [(cid, jobs[:2], [1, 1]), (cid, jobs[2:], [1, 1, 1])]
    assert n_rows(conn, schema, "lease_claim_closure_batches") == 1
    assert counts(storage, conn, Q) == {"completed": 5}
    assert [load(storage, conn, j)["state"] for j in jobs] == ["completed"] * 5


def test_whole_and_partial_receipts_in_one_flush(schema, storage, conn):
    """Two receipts in one flush, one held whole and one in part: one done row each, each naming
    exactly the attempts completed (the whole one from the receipt, the other from its attempts)."""
    first = [enqueue(schema, conn, Q, {"i": i}) for i in range(3)]
    a = claim(storage, conn, Q, 10)
    second = [enqueue(schema, conn, Q, {"i": i}) for i in range(3, 7)]
    b = claim(storage, conn, Q, 10)
    assert a[0].claim_id != b[0].claim_id
    with conn.transaction():
        assert storage.receipt_complete(conn, a + b[:2], {(a[0].claim_slot, a[0].claim_id)}) == []
    assert compact_rows(conn, schema) == [(a[0].claim_id, first, [1] * 3), (b[0].claim_id, second[:2], [1, 1])]
    assert counts(storage, conn, Q) == {"completed": 5, "running": 2}
