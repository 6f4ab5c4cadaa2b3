"""The plain claim reads the current claim and ready slots itself (migration 0036).

claim_batch_v4 called ring_current('claim') and ring_current('ready') for a quiet queue's claim:
two nested PL/pgSQL calls per claim. It now runs their queries in its own body. These tests
count the function calls one claim makes (``track_functions = 'pl'``) and check that a claim
after each ring's rotation writes its receipt in the new claim slot and finds its rows in the
new ready slot.
"""

from __future__ import annotations

import pytest

from tests.integration.storage_helpers import claim, counted, enqueue, function_calls, ring_current

pytestmark = pytest.mark.integration

Q = "q"


def test_a_quiet_claim_calls_no_ring_lookup_and_follows_both_rings(schema, storage, conn):
    conn.execute("SET track_functions = 'pl'")
    for rotate in (None, "claim", "ready", "claim"):
        if rotate:
            storage.ring_rotate(conn, rotate)
        job_id = enqueue(schema, conn, Q)
        snaps, calls = counted(conn, lambda c: function_calls(c, schema), lambda: claim(storage, conn, Q, 10))
        assert [s.job_id for s in snaps] == [job_id]
        assert calls.get("claim_batch_v4") == 1, calls
        assert "ring_current" not in calls, calls
        snap = snaps[0]
        assert snap.claim_slot == ring_current(storage, conn, "claim"), rotate
        assert snap.ready_slot == ring_current(storage, conn, "ready"), rotate
        storage.receipt_complete_rows(conn, snaps)
