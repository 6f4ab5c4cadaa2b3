"""Under its lock, a claim-ring prune reads its gates again only when the slot's receipts changed (migration 0037).

A prune checks a sealed slot's gates, takes ACCESS EXCLUSIVE on the slot's children (every claim
waits behind it), then checks them again. For the claim ring the second check now compares the
slot's receipt count with the one taken before the first: the same count means the same
receipts (they are only ever inserted), whose gates passed. These tests count the gate calls a
prune makes (``track_functions = 'pl'``) and make a receipt commit while the prune waits for
its lock, which must be gated under the lock as before.
"""

from __future__ import annotations

import threading

import psycopg
import pytest

from tests.fixtures.database import connect, scalar
from tests.fixtures.waiting import wait_for
from tests.integration.storage_helpers import claim, complete, counted, counts, enqueue, function_calls

pytestmark = pytest.mark.integration

Q = "q"
GATES = ("claim_prune_gate", "lanes_cursor_advance")


def _gate_calls(conn: psycopg.Connection, schema: str) -> dict[str, int]:
    """Calls this transaction made of the claim ring's gate functions."""
    return {name: n for name, n in function_calls(conn, schema).items() if name in GATES}


def _receipts(conn: psycopg.Connection, schema: str, slot: int) -> int:
    return int(scalar(conn, schema, f"SELECT count(*) FROM __SCHEMA__.lease_claims_{slot}"))


def test_an_unchanged_slot_is_gated_once_and_pruned(schema, storage, conn):
    for i in range(3):
        enqueue(schema, conn, Q, {"i": i})
    for _ in range(3):
        assert complete(storage, conn, claim(storage, conn, Q, 1)) == []  # three closed receipts in slot 0
    assert storage.ring_rotate(conn, "claim") == 1
    conn.execute("SET track_functions = 'pl'")
    word, calls = counted(conn, lambda c: _gate_calls(c, schema), lambda: storage.ring_prune(conn, "claim", 0))
    assert word == "pruned"
    # pass 1 only: under the lock the count (3) was the one pass 1 gated
    assert calls == {"claim_prune_gate": 1, "lanes_cursor_advance": 1}, calls
    assert _receipts(conn, schema, 0) == 0
    assert counts(storage, conn, Q) == {"completed": 3}


def test_a_receipt_committed_while_the_prune_waits_for_its_lock_is_gated_under_the_lock(pg_dsn, schema, storage,
                                                                                         conn):
    jobs = [enqueue(schema, conn, Q, {"i": i}) for i in range(2)]
    assert complete(storage, conn, claim(storage, conn, Q, 1)) == []  # a closed receipt in slot 0
    pruner = connect(pg_dsn, schema, autocommit=True, tag="pruner")
    pruner.execute("SET track_functions = 'pl'")
    result: dict[str, object] = {}
    with connect(pg_dsn, schema, autocommit=False, tag="claimer") as claimer:
        # a claim that read slot 0 as current just before the rotation: its receipt lands in the
        # sealed slot, uncommitted, so the prune's first gates neither see it nor wait for it
        [late] = storage.lane_claim(claimer, Q, 1)
        assert late.claim_slot == 0 and late.job_id == jobs[1]
        assert storage.ring_rotate(conn, "claim") == 1

        def prune() -> None:
            result["word"], result["calls"] = counted(
                pruner, lambda c: _gate_calls(c, schema),
                lambda: storage.ring_prune(pruner, "claim", 0, lock_timeout_ms=5000))

        thread = threading.Thread(target=prune)
        thread.start()
        try:
            # the first gates passed (the one committed receipt is closed); the prune now waits
            # for the claimer's lock on the slot's children
            pid = pruner.info.backend_pid
            wait_for(lambda: conn.execute("SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = %s",
                                          (pid,)).fetchone() == (True,), what="the prune to wait for its lock")
            claimer.commit()
        finally:
            thread.join(10)
    assert not thread.is_alive()
    pruner.close()
    # the count under the lock (2) was not pass 1's (1): the gates were read again, and the late
    # receipt, open, kept the slot
    assert result["word"] == "open_claims"
    assert result["calls"] == {"claim_prune_gate": 2, "lanes_cursor_advance": 2}, result["calls"]
    assert _receipts(conn, schema, 0) == 2
    assert counts(storage, conn, Q) == {"running": 1, "completed": 1}
    assert complete(storage, conn, [late]) == []  # its receipt still guards the attempt
    assert storage.ring_prune(conn, "claim", 0) == "pruned"
    assert counts(storage, conn, Q) == {"completed": 2}
