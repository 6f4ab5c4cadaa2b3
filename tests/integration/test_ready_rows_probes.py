"""A job found by id reads a few ready-ring pages, however full its slot is (migration 0030).

``ready_rows_of`` finds a lane-born job's row at its birth position, whose slot the id does not
carry. Searched without the slot, each ready child's primary key (ready_slot, lane_id, lane_seq)
lacks its leading column: PostgreSQL 18 skips through it, PostgreSQL 15-17 (the suite's server
where the machine has one) read it whole. These tests fill one ready slot and count the buffers
that loading and cancelling one job fetch from the ready ring's children and their indexes.
"""

from __future__ import annotations

import psycopg
import pytest

from tests.fixtures.database import connect, sqlx
from tests.integration.storage_helpers import client, counted, ring_child_blocks

pytestmark = pytest.mark.integration

Q = "q"
FILL = 60_000  # one slot's primary key: ~200 leaf pages, so a whole read is far above the bound
BOUND = 40  # per call: a probe per slot (4 slots) on each of its two index paths, and the row
# A call that plans reads index pages besides (the first call, and any call after autovacuum
# touched a table of the plan, which invalidates it: seen in CI as [46, 17, 17, 45, 17, ...]).
# A slot read whole is ~200 leaf pages, far above this.
PLANNING_BOUND = 2 * BOUND


def _assert_probed(fetched: list[int]) -> None:
    """Each call probes by key; the steady state stays under BOUND, a re-plan under PLANNING_BOUND."""
    assert max(fetched) <= PLANNING_BOUND, fetched
    later = sorted(fetched[1:])
    assert later[len(later) // 2] <= BOUND, fetched


def _blocks(a: psycopg.Connection, schema: str, call):  # noqa: ANN001, ANN202
    result, fetched = counted(a, lambda c: ring_child_blocks(c, schema, '^ready_entries_[0-9]+$'), call)
    return result, sum(fetched.values())


@pytest.fixture
def full_slot(schema: str, conn: psycopg.Connection) -> list[int]:
    """FILL lane-born jobs in the current ready slot, analyzed as autovacuum would; their ids."""
    ids = client(schema).enqueue_many("k", ({"i": i} for i in range(FILL)), queue=Q, conn=conn, return_ids=True)
    assert isinstance(ids, list) and len(ids) == FILL
    assert all(j >= 1 << 40 for j in ids)  # born in a lane: the id is its position
    sqlx(conn, schema, "ANALYZE __SCHEMA__.ready_entries")
    return ids


def test_loading_a_job_born_in_a_full_slot_probes_each_slot_by_key(pg_dsn, schema, storage, full_slot):
    target = full_slot[len(full_slot) // 2]
    with connect(pg_dsn, schema, tag="app") as a:
        fetched = []
        for _ in range(8):  # the custom plans, then the session's generic plan
            row, n = _blocks(a, schema, lambda: storage.job_load(a, target))
            assert row is not None and row["state"] == "available" and row["job_id"] == target
            fetched.append(n)
    _assert_probed(fetched)


def test_cancelling_a_job_born_in_a_full_slot_probes_each_slot_by_key(pg_dsn, schema, storage, full_slot):
    targets = full_slot[1000:1008]
    with connect(pg_dsn, schema, tag="app") as a:
        fetched = []
        for job_id in targets:  # the custom plans, then the session's generic plan
            outcome, n = _blocks(a, schema, lambda j=job_id: storage.job_cancel(a, j))
            assert outcome == "cancelled"
            fetched.append(n)
        assert {storage.job_load(a, j)["state"] for j in targets} == {"cancelled"}
        assert storage.job_load(a, full_slot[999])["state"] == "available"  # its neighbours are untouched
    _assert_probed(fetched)
