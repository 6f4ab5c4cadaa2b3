"""The array literals the storage layer sends instead of lists reach PostgreSQL as the values given.

``receipt_complete_rows`` (every quiet completion) sends its eleven arrays as
literals: psycopg's list dumpers cost ~80 µs of a one-job call
(docs/performance-log.md, 2026-12-05 e2e). A literal that PostgreSQL parses
differently from the list (an unquoted ``NULL``, a comma or brace in a
name, a backslash) would complete a job under the wrong queue or kind, so
each helper is checked against the database's own array parser.
"""

from __future__ import annotations

import psycopg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from awa_fast.storage.engine import _bool_array, _int_array, _text_array
from tests.fixtures.database import sqlx
from tests.integration.storage_helpers import claim

AWKWARD = ["NULL", "null", "", " ", "a,b", "{x}", 'say "hi"', "back\\slash", "\\", '"', "é\u2603", "tab\there",
           "new\nline", "  padded  ", "{", "}"]


def test_text_literal_round_trips_awkward_strings(conn):
    assert conn.execute("SELECT %s::text[]", (_text_array(AWKWARD),)).fetchone() == (AWKWARD,)
    assert conn.execute("SELECT %s::text[]", (_text_array([]),)).fetchone() == ([],)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(alphabet=st.characters(blacklist_characters="\x00", blacklist_categories=["Cs"]))))
def test_text_literal_round_trips_any_string(pg_dsn, values):
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        assert c.execute("SELECT %s::text[]", (_text_array(values),)).fetchone() == (values,)


@pytest.mark.parametrize("values", [[], [0], [-1, 2**40, -(2**63), 2**63 - 1]])
def test_int_and_bool_literals_round_trip(conn, values):
    bools = [v % 2 == 0 for v in values]
    assert conn.execute("SELECT %s::bigint[], %s::boolean[]",
                        (_int_array(values), _bool_array(bools))).fetchone() == (values, bools)


def test_a_quiet_completion_records_the_snapshots_queue_and_kind(schema, storage, conn):
    queue, kind = 'q,"NULL"', "kind\\{x}"  # names only SQL can give (the client refuses them)
    job = sqlx(conn, schema, "SELECT __SCHEMA__.job_enqueue_v2(%s, 2, %s, '{}', NULL, 3, NULL)",
               (queue, kind)).fetchone()[0]
    [snap] = claim(storage, conn, queue, 10)
    assert (snap.job_id, snap.queue, snap.kind) == (job, queue, kind)
    assert storage.receipt_complete_rows(conn, [snap]) == []
    assert sqlx(conn, schema, "SELECT queue, kind, state FROM __SCHEMA__.done_entries WHERE job_id = %s",
                (job,)).fetchall() == [(queue, kind, 1)]
