"""History retention as a queue setting (issue 11, item 5).

A terminal job stays visible (``job_load``) for at least its queue's
``history_retention`` after it finished, and is gone once the ready slot
holding it has been quiet for that long: the maintenance leader keeps
quiet sealed slots (``ring_prune_v2`` answers ``retained``) and rotates the
shared ring every max(retention) / (slots - 1). The tests drive a real
leader's ``rotate_once``/``prune_once`` on the database clock and poll with
deadlines.
"""

from __future__ import annotations

import time

import psycopg
import pytest

from awa_fast.runtime.maintenance import Maintenance, MaintenanceConfig
from tests.integration import storage_helpers as sh

pytestmark = pytest.mark.integration

RETAIN = 4.0


@pytest.fixture
def leader(pg_dsn, schema):
    m = Maintenance(MaintenanceConfig(pg_dsn, schema, prune_interval=0.2))
    assert m.try_lead()
    yield m
    m.resign()


def _visible(storage, conn, job_id):  # noqa: ANN001, ANN202
    job = storage.job_load(conn, job_id)
    return job is not None and job["state"] == "completed"


def test_history_retention_is_a_queue_setting(schema, storage, conn):
    storage.queue_ensure(conn, "h1")
    [row] = [q for q in storage.queue_list(conn) if q["queue"] == "h1"]
    assert row["history_retention_s"] == 3600.0
    storage.queue_configure(conn, "h1", history_retention=RETAIN)
    storage.queue_configure(conn, "h1", deadline=10.0)  # other settings leave it alone
    [row] = [q for q in storage.queue_list(conn) if q["queue"] == "h1"]
    assert row["history_retention_s"] == RETAIN
    with pytest.raises(psycopg.errors.CheckViolation):
        storage.queue_configure(conn, "h1", history_retention=-1.0)


def test_the_shared_ring_follows_the_longest_retention(pg_dsn, schema, storage, conn, leader):
    storage.queue_configure(conn, "h1", history_retention=RETAIN)
    slots = int(storage.ring_state(conn)["ready"]["slots"])
    assert leader.ready_timing() == (RETAIN, max(1.0, RETAIN / (slots - 1)))  # at least 1 s
    storage.queue_configure(conn, "h2", history_retention=150.0)
    leader._ready_timing = None  # noqa: SLF001 - skip the prune-interval cache
    assert leader.ready_timing() == (150.0, 150.0 / (slots - 1))
    # an explicit ready interval (tests, benchmarks) rotates at that pace and keeps no history
    fixed = Maintenance(MaintenanceConfig(pg_dsn, schema, rotate_intervals={"claim": 1.0, "ready": 2.0}))
    assert fixed.ready_timing() == (None, 2.0)


def test_completed_job_is_visible_for_the_retention_then_gone(schema, storage, conn, leader):
    storage.queue_configure(conn, "h1", history_retention=RETAIN)
    early = sh.enqueue(schema, conn, "h1", {"n": 1})
    late = sh.enqueue(schema, conn, "h1", {"n": 2})
    a, b = sh.claim(storage, conn, "h1", 10)
    assert sh.complete(storage, conn, [a]) == []
    t_early_done = time.monotonic()
    sealed = sh.ring_current(storage, conn, "ready")
    assert leader.rotate_once("ready") is not None  # seals the slot holding both jobs
    # `late` is still running: the slot cannot go, whatever its age; keep it open past the retention
    deadline = time.monotonic() + RETAIN + 1.0
    while time.monotonic() < deadline:
        assert leader.prune_once("ready").get("open_claims") == 1
        assert _visible(storage, conn, early)
        time.sleep(0.2)  # the prune cadence of a leader
    assert time.monotonic() - t_early_done > RETAIN
    assert sh.complete(storage, conn, [b]) == []
    t_late_done = time.monotonic()
    # quiet now: retained for RETAIN seconds from here, then truncated
    words: list[tuple[float, str]] = []
    gone_at = None
    deadline = time.monotonic() + RETAIN + 10.0
    while time.monotonic() < deadline:
        t = time.monotonic()
        word_by = leader.prune_once("ready")
        words.append((t, "pruned" if word_by.get("pruned") else "retained" if word_by.get("retained") else
                      str(word_by)))
        if word_by.get("pruned"):
            gone_at = time.monotonic()
            break
        assert _visible(storage, conn, late) and _visible(storage, conn, early), words
        time.sleep(0.2)
    assert gone_at is not None, f"slot {sealed} never pruned: {words}"
    assert words[0][1] == "retained", words
    assert gone_at - t_late_done >= RETAIN, (gone_at - t_late_done, words)
    assert gone_at - t_late_done < RETAIN + 3.0, (gone_at - t_late_done, words)
    assert storage.job_load(conn, early) is None and storage.job_load(conn, late) is None
    # the counts survive the TRUNCATE (rolled up)
    assert storage.queue_terminal_counts(conn)["h1"]["completed"] == 2


def test_run_once_rotates_and_prunes_on_the_retention(schema, storage, conn, leader):
    storage.queue_configure(conn, "h1", history_retention=RETAIN)
    job = sh.enqueue(schema, conn, "h1", {})
    assert sh.complete(storage, conn, sh.claim(storage, conn, "h1")) == []
    t_done = time.monotonic()
    first = sh.ring_current(storage, conn, "ready")
    seen_visible_until = t_done
    deadline = time.monotonic() + RETAIN + 10.0
    while time.monotonic() < deadline and storage.job_load(conn, job) is not None:
        seen_visible_until = time.monotonic()
        leader.run_once()
        time.sleep(0.05)  # the leader's tick
    assert storage.job_load(conn, job) is None, "never pruned"
    assert sh.ring_current(storage, conn, "ready") != first  # rotated by run_once
    assert seen_visible_until - t_done >= RETAIN - 0.2  # visible (polled) until about the retention


def test_explicit_ready_interval_prunes_at_once(pg_dsn, schema, storage, conn):
    m = Maintenance(MaintenanceConfig(pg_dsn, schema, rotate_intervals={"claim": 1.0, "ready": 30.0}))
    assert m.try_lead()
    try:
        job = sh.enqueue(schema, conn, "h1", {})
        assert sh.complete(storage, conn, sh.claim(storage, conn, "h1")) == []
        assert m.rotate_once("ready") is not None
        assert m.prune_once("ready").get("pruned") == 1
        assert storage.job_load(conn, job) is None
    finally:
        m.resign()
