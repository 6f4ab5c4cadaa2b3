"""The maintenance leader asks only the slots that may hold rows (``Maintenance.prune_once``).

A ring slot found empty or pruned stays clean until it has been current
again. An idle ring then costs one ``ring_state`` read per pass, not one
``ring_prune`` call per slot (29 calls every half second with the default
rings). A write into a sealed slot after its prune (a claim or a producer
that read the current slot just before a rotation) is found when a rotation
finds that slot holding rows, and by the full pass every
``prune_recheck_interval`` seconds. The tests drive a real leader against a
real server; the leader's ``Storage`` records the slot of each ``ring_prune``
call before making it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from awa_fast.runtime.maintenance import Maintenance, MaintenanceConfig
from awa_fast.storage import Storage
from tests.integration import storage_helpers as sh

pytestmark = pytest.mark.integration

CLAIM = "claim"


class _Asked(Storage):
    """The leader's storage, recording the slot of every ``ring_prune`` call before making it."""

    __slots__ = ("calls", "retained_calls")

    def __init__(self, leader: Maintenance) -> None:
        super().__init__(leader.storage.schema)
        self.calls: list[int] = []
        self.retained_calls: list[int] = []
        leader.storage = self

    def ring_prune(self, conn: psycopg.Connection, ring: str, slot: int, lock_timeout_ms: int = 50) -> str:
        self.calls.append(slot)
        return super().ring_prune(conn, ring, slot, lock_timeout_ms)

    def ring_prune_retained(self, conn: psycopg.Connection, ring: str, slot: int, retain_s: float,
                            lock_timeout_ms: int = 50) -> str:
        self.retained_calls.append(slot)
        return super().ring_prune_retained(conn, ring, slot, retain_s, lock_timeout_ms)

    def take_retained(self) -> list[int]:
        slots = list(self.retained_calls)
        self.retained_calls.clear()
        return slots

    def take(self) -> list[int]:
        slots = list(self.calls)
        self.calls.clear()
        return slots


def _leader(pg_dsn: str, schema: str, **kw: Any) -> Iterator[Maintenance]:
    m = Maintenance(MaintenanceConfig(pg_dsn, schema, **kw))
    assert m.try_lead()
    yield m
    m.resign()


@pytest.fixture
def leader(pg_dsn: str, schema: str) -> Iterator[Maintenance]:
    yield from _leader(pg_dsn, schema)


def _run_one_job(storage: Any, conn: Any, schema: str, queue: str = "pc") -> None:
    """Enqueue, claim and complete one job: its receipt and closure land in the current claim slot."""
    sh.enqueue(schema, conn, queue)
    snaps = sh.claim(storage, conn, queue)
    assert len(snaps) == 1
    sh.complete(storage, conn, snaps)


def _late_receipt(conn: Any, schema: str, slot: int) -> None:
    """A receipt written into ``slot`` after it was sealed, as a claim that read the slot before a
    rotation leaves it (no attempt in it, so the prune's gates let it go)."""
    conn.execute(f"INSERT INTO {schema}.lease_claims (claim_slot, claim_id, lane_id, ready_slot, first_seq,"
                 " last_seq, job_ids, run_leases, lane_seqs) VALUES (%s, -1, 0, 0, 0, 0, '{}', '{}', '{}')",
                 (slot,))


def test_an_idle_ring_is_not_asked_slot_by_slot(schema, storage, conn, leader):
    asked = _Asked(leader)
    count = int(storage.ring_state(conn)[CLAIM]["slots"])
    _run_one_job(storage, conn, schema)
    assert leader.rotate_once(CLAIM) is not None
    first = leader.prune_once(CLAIM)
    assert first == {"pruned": 1, "empty": count - 2}
    assert sorted(asked.take()) == sorted(s for s in range(count) if s != sh.ring_current(storage, conn, CLAIM))
    # nothing was current since: no slot is asked, and the pass still reports every sealed slot
    assert leader.prune_once(CLAIM) == {"empty": count - 1}
    assert asked.take() == []


def test_the_slot_rotated_out_is_asked_again(schema, storage, conn, leader):
    asked = _Asked(leader)
    leader.prune_once(CLAIM)
    asked.take()
    _run_one_job(storage, conn, schema)
    was_current = sh.ring_current(storage, conn, CLAIM)
    assert leader.rotate_once(CLAIM) is not None
    assert leader.prune_once(CLAIM).get("pruned") == 1
    assert asked.take() == [was_current]
    assert storage.ring_slot_empty(conn, CLAIM, was_current)


def test_a_late_write_is_found_when_the_rotation_meets_it(schema, storage, conn, leader):
    asked = _Asked(leader)
    leader.prune_once(CLAIM)
    count = int(storage.ring_state(conn)[CLAIM]["slots"])
    nxt = (sh.ring_current(storage, conn, CLAIM) + 1) % count
    _late_receipt(conn, schema, nxt)
    asked.take()
    leader.prune_once(CLAIM)
    assert asked.take() == []  # clean as far as the leader knows
    _run_one_job(storage, conn, schema)
    assert leader.rotate_once(CLAIM) is None  # the next slot holds the late receipt
    assert leader.prune_once(CLAIM) == {"pruned": 1, "empty": count - 2}
    assert asked.take() == [nxt]
    assert leader.rotate_once(CLAIM) == nxt  # and the ring moves on


def test_every_slot_is_asked_again_after_the_recheck_interval(pg_dsn, schema, storage, conn):
    for leader in _leader(pg_dsn, schema, prune_recheck_interval=0.0):
        asked = _Asked(leader)
        count = int(storage.ring_state(conn)[CLAIM]["slots"])
        leader.prune_once(CLAIM)
        assert len(asked.take()) == count - 1
        late = (sh.ring_current(storage, conn, CLAIM) + 3) % count
        _late_receipt(conn, schema, late)
        assert leader.prune_once(CLAIM) == {"pruned": 1, "empty": count - 2}
        assert len(asked.take()) == count - 1
        assert storage.ring_slot_empty(conn, CLAIM, late)


def test_a_new_leadership_asks_every_slot(pg_dsn, schema, storage, conn):
    count = int(storage.ring_state(conn)[CLAIM]["slots"])
    for leader in _leader(pg_dsn, schema):
        asked = _Asked(leader)
        leader.prune_once(CLAIM)
        leader.prune_once(CLAIM)
        assert len(asked.take()) == count - 1
        leader.resign()
        late = (sh.ring_current(storage, conn, CLAIM) + 2) % count
        _late_receipt(conn, schema, late)
        assert leader.try_lead()
        assert leader.prune_once(CLAIM) == {"pruned": 1, "empty": count - 2}
        assert len(asked.take()) == count - 1


def test_a_retained_slot_is_asked_again_after_a_tenth_of_the_retention(schema, storage, conn, leader):
    retain = 2.0
    storage.queue_configure(conn, "pc", history_retention=retain)
    asked = _Asked(leader)
    _run_one_job(storage, conn, schema)
    sealed = sh.ring_current(storage, conn, "ready")
    assert leader.rotate_once("ready") is not None
    t0 = time.monotonic()
    assert leader.prune_once("ready").get("retained") == 1
    assert sealed in asked.take_retained()
    # right away: reported retained, not asked
    assert leader.prune_once("ready").get("retained") == 1
    assert asked.take_retained() == [] and time.monotonic() - t0 < retain / 10
    # asked again once a tenth of the retention has passed (polled at the leader's cadence)
    deadline = t0 + retain
    while time.monotonic() < deadline and not asked.retained_calls:
        time.sleep(0.02)
        assert leader.prune_once("ready").get("retained") == 1
    assert asked.take_retained() == [sealed]
    assert retain / 10 <= time.monotonic() - t0 < retain
