"""The attempt-state sweep probes each state's own receipt; a lane reservation needs a count (0033).

``attempt_state_sweep`` runs on the maintenance leader once a second and deletes the
``attempt_state`` rows (heartbeats, progress, cancel flags) of attempts that ended. These tests
count the rows one sweep's DELETE handles, from its plan as ``auto_explain`` reports it, and
check which rows it keeps: those of attempts still open, whether they were written by a
heartbeat, by a cancel, or before 0033 without the receipt they run under, and which receipt
each row names.
"""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest

from tests.fixtures.database import connect, scalar, sqlx
from tests.integration.storage_helpers import claim, enqueue, explained
from tests.integration.test_completion_probes import Q, _slot0_reltuples, _slot0_with_empty_statistics

pytestmark = pytest.mark.integration

OPEN = 40
ENDED = 60


def _backdate(conn: psycopg.Connection, schema: str) -> None:
    """Every attempt_state row is older than the sweep's five seconds."""
    sqlx(conn, schema, "UPDATE __SCHEMA__.attempt_state SET updated_at = now() - interval '1 minute'")


def _keys(conn: psycopg.Connection, schema: str) -> dict[int, tuple[int | None, int | None]]:
    """job_id -> the (claim_slot, claim_id) its attempt_state row names, for every row."""
    rows = sqlx(conn, schema, "SELECT job_id, claim_slot, claim_id FROM __SCHEMA__.attempt_state").fetchall()
    return {int(j): (slot, cid) for j, slot, cid in rows}


def _rows_handled(node: dict[str, Any]) -> int:
    """Rows a plan node and the nodes under it handled: each node's rows times its loops, plus the
    rows its filters removed (a nested loop's inner side rescanned per outer row counts each time)."""
    own = (node.get("Actual Rows", 0) * node.get("Actual Loops", 1) + node.get("Rows Removed by Filter", 0)
           + node.get("Rows Removed by Join Filter", 0))
    return int(own) + sum(_rows_handled(child) for child in node.get("Plans", []))


def _sweep_explained(storage, conn: psycopg.Connection) -> tuple[int, int]:  # noqa: ANN001
    """One sweep on ``conn`` with auto_explain on: (rows deleted, rows its DELETE handled)."""
    deleted, notices = explained(conn, lambda: storage.attempt_state_sweep(conn), analyze=True, json_format=True)
    plans = [json.loads(text[text.index("{"):]) for text in notices if "{" in text]
    [delete] = [p for p in plans if "DELETE FROM" in p["Query Text"]]
    return deleted, _rows_handled(delete["Plan"])


def test_a_sweep_handles_a_few_rows_per_state_not_the_ring_per_state(pg_dsn, schema, storage, conn):
    """The leader plans the sweep while claim slot 0 has an empty table's statistics; with OPEN
    running attempts and ENDED orphaned heartbeat rows its DELETE must handle a few rows per state,
    not every receipt of the ring for each one (before 0033: about 19,000 rows here, 9,000 of them the
    receipts rescanned once per state)."""
    _slot0_with_empty_statistics(conn, schema)
    with connect(pg_dsn, schema, tag="leader") as leader:
        assert storage.attempt_state_sweep(leader) == 0  # the leader's generic plan is made now
        for _ in range(OPEN + ENDED):
            enqueue(schema, conn, Q)
        snaps = [claim(storage, conn, Q, 1)[0] for _ in range(OPEN + ENDED)]
        assert {r.status for r in storage.attempt_heartbeat(conn, snaps)} == {"ok"}
        ended, running = snaps[:ENDED], snaps[ENDED:]
        for snap in ended:  # completed without naming their state: orphans the sweep must delete
            assert storage.receipt_complete_rows(conn, [snap]) == []
        _backdate(conn, schema)
        assert _slot0_reltuples(conn, schema) == 0.0  # still the empty slot's statistics
        deleted, handled = _sweep_explained(storage, leader)
    assert deleted == ENDED
    assert _keys(conn, schema) == {s.job_id: (s.claim_slot, s.claim_id) for s in running}
    assert handled <= 20 * (OPEN + ENDED), handled


def test_the_sweep_keeps_every_open_attempt_s_state_however_it_was_written(schema, storage, conn):
    """Each job in a receipt of its own. Rows written by a heartbeat, by a cancel, by a cancel on top
    of a heartbeat, before 0033 (no receipt named), half of a key: those of open attempts stay,
    those of ended attempts go, and each row names the receipt that holds its attempt."""
    ids = [enqueue(schema, conn, Q) for _ in range(9)]
    snaps = {}
    for _ in ids:
        snap = claim(storage, conn, Q, 1)[0]
        snaps[snap.job_id] = snap
    assert sorted(snaps) == sorted(ids) and len({s.claim_id for s in snaps.values()}) == len(ids)
    (beat_open, beat_ended, cancel_open, cancel_ended, beat_then_cancel, legacy_open, legacy_ended,
     legacy_then_cancel, half_open) = ids
    beats = [snaps[j] for j in (beat_open, beat_ended, beat_then_cancel, half_open)]
    assert {r.status for r in storage.attempt_heartbeat(conn, beats)} == {"ok"}
    for job_id in (cancel_open, cancel_ended, legacy_open, legacy_ended, legacy_then_cancel):
        assert storage.job_cancel(conn, job_id) == "cancel_requested"
    # rows as they were written before 0033: no receipt named; and one with half of a key
    sqlx(conn, schema, "UPDATE __SCHEMA__.attempt_state SET claim_slot = NULL, claim_id = NULL "
                       "WHERE job_id = ANY(%s)", ([legacy_open, legacy_ended, legacy_then_cancel],))
    sqlx(conn, schema, "UPDATE __SCHEMA__.attempt_state SET claim_slot = NULL WHERE job_id = %s", (half_open,))
    for job_id in (beat_then_cancel, legacy_then_cancel):  # a cancel on top of an existing row
        assert storage.job_cancel(conn, job_id) == "cancel_requested"

    def key(job_id: int) -> tuple[int, int]:
        return (snaps[job_id].claim_slot, snaps[job_id].claim_id)

    assert _keys(conn, schema) == {
        **{j: key(j) for j in (beat_open, beat_ended, cancel_open, cancel_ended, beat_then_cancel,
                               legacy_then_cancel)},
        legacy_open: (None, None), legacy_ended: (None, None), half_open: (None, key(half_open)[1])}
    for job_id in (beat_ended, cancel_ended, legacy_ended):  # ended without naming their state
        assert storage.receipt_complete_rows(conn, [snaps[job_id]]) == []
    recent = _keys(conn, schema)
    assert storage.attempt_state_sweep(conn) == 0  # no row is five seconds old yet
    assert _keys(conn, schema) == recent
    _backdate(conn, schema)
    assert storage.attempt_state_sweep(conn) == 3
    assert sorted(_keys(conn, schema)) == sorted(
        [beat_open, cancel_open, beat_then_cancel, legacy_open, legacy_then_cancel, half_open])
    # the open attempts still see their flags
    assert {r.job_id: r.status for r in storage.attempt_heartbeat(conn, [
        snaps[j] for j in (beat_open, cancel_open, beat_then_cancel, legacy_open, legacy_then_cancel, half_open)])} == {
        beat_open: "ok", cancel_open: "cancel", beat_then_cancel: "cancel", legacy_open: "cancel",
        legacy_then_cancel: "cancel", half_open: "ok"}


def test_a_lane_reservation_of_no_number_is_refused_before_anything_is_written(schema, conn):
    enqueue(schema, conn, Q)
    before = scalar(conn, schema, "SELECT count(*) FROM __SCHEMA__.ready_segments")
    for count in (0, -1):
        with pytest.raises(psycopg.errors.InvalidParameterValue, match="count of at least 1"):
            sqlx(conn, schema, "SELECT * FROM __SCHEMA__.lane_reserve(%s, 2, %s, 0)", (Q, count))
    assert scalar(conn, schema, "SELECT count(*) FROM __SCHEMA__.ready_segments") == before
    first = sqlx(conn, schema, "SELECT first_seq FROM __SCHEMA__.lane_reserve(%s, 2, 1, 0)", (Q,)).fetchone()
    assert first is not None and first[0] >= 1
