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

from awa_fast.storage import use_raw_jsonb
from awa_fast.storage.connection import PoolConnection
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


@pytest.mark.parametrize("direct", [False, True], ids=["cursor", "libpq"])
def test_a_quiet_completion_records_the_snapshots_queue_and_kind(pg_dsn, schema, storage, conn, direct):
    """On a PoolConnection (a batcher's) the call runs through libpq; elsewhere through a cursor: same rows."""
    queue, kind = 'q,"NULL"', "kind\\{x}"  # names only SQL can give (the client refuses them)
    jobs = [sqlx(conn, schema, "SELECT __SCHEMA__.job_enqueue_v2(%s, 2, %s, '{}', NULL, 3, NULL)",
                 (queue, kind)).fetchone()[0] for _ in range(3)]
    snaps = claim(storage, conn, queue, 10)
    assert [(s.job_id, s.queue, s.kind) for s in snaps] == [(j, queue, kind) for j in jobs]
    cls = PoolConnection if direct else psycopg.Connection
    with cls.connect(pg_dsn, autocommit=True) as c:
        use_raw_jsonb(c)
        assert storage.receipt_complete_rows(c, snaps[:2]) == []
        # a repeat is stale and writes nothing, the third still completes
        assert storage.receipt_complete_rows(c, snaps) == sorted((s.job_id, s.run_lease) for s in snaps[:2])
        prepared = c.execute("SELECT count(*) FROM pg_prepared_statements WHERE name LIKE 'awa_fast_%'").fetchone()
    assert prepared == ((1,) if direct else (0,))
    assert sqlx(conn, schema, "SELECT job_id, queue, kind, state FROM __SCHEMA__.done_entries ORDER BY job_id"
                ).fetchall() == [(j, queue, kind, 1) for j in jobs]
