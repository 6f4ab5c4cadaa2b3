"""Named queries about sessions rather than jobs: clock, ping, LISTEN, leader lock, schema teardown.

Mixed into :class:`awa_fast.storage.Storage`, so the runtime (claimer,
listener, maintenance), the demo and ``awa_fast.testing`` run no SQL of
their own. The query texts are in ``queries.sql`` under the same names.
"""

from __future__ import annotations

import psycopg
import psycopg.sql


class SessionQueries:
    """Session-level queries of one schema (a mixin of ``Storage``: needs ``q``, ``schema``, ``channel``)."""

    __slots__ = ()

    q: dict[str, str]
    schema: str
    channel: str

    def session_clock(self, conn: psycopg.Connection) -> float:
        """The database's wall clock, in epoch seconds (``clock_timestamp()``, not the transaction's ``now()``)."""
        row = conn.execute(self.q["session_clock"]).fetchone()
        assert row is not None
        return float(row[0])

    def session_utc(self, conn: psycopg.Connection) -> None:
        """Make ``conn`` report timestamptz values in UTC (the same instants, the cheapest ``datetime`` to build)."""
        conn.execute(self.q["session_utc"])

    def session_read_committed(self, conn: psycopg.Connection) -> None:
        """Make ``conn``'s transactions READ COMMITTED, whatever the server's default: every runtime session.

        Claims, cancels and prune's cursor advance must see receipts committed until they lock a lane's
        claim head; at another level ``lane_cursor_advance`` raises (migration 0028). Sets nothing where
        read committed is the session's default already.
        """
        conn.execute(self.q["session_read_committed"])

    def session_index_probes(self, conn: psycopg.Connection) -> None:
        """Plan ``conn``'s statements without sequential scans: the batcher's and the heartbeat's session.

        Their generic plans are made once, and a ring slot truncated a moment before looks empty to
        the planner: a scan of that slot, cheap then, would be kept while the slot fills
        (``queries.sql``). The claim session keeps sequential scans (migration 0026 says why).
        """
        conn.execute(self.q["session_index_probes"])

    def session_ping(self, conn: psycopg.Connection) -> None:
        """One round trip on ``conn``: raises if the connection is gone (a half-open one hangs: see the watchdog)."""
        conn.execute(self.q["session_ping"])

    def channel_name(self, conn: psycopg.Connection) -> str:
        """The NOTIFY channel as the database's enqueue functions spell it (``notify_channel()``).

        ``Storage.channel`` is the same name computed locally; a test keeps the two equal.
        """
        row = conn.execute(self.q["channel_name"]).fetchone()
        assert row is not None
        return str(row[0])

    def channel_listen(self, conn: psycopg.Connection) -> None:
        """``LISTEN`` on this schema's channel (``conn`` must be in autocommit mode to receive notifies)."""
        conn.execute(psycopg.sql.SQL("LISTEN {}").format(psycopg.sql.Identifier(self.channel)))

    def leader_lock_try(self, conn: psycopg.Connection) -> bool:
        """Try the maintenance leader lock (a session lock: it goes with ``conn``); True if taken."""
        row = conn.execute(self.q["leader_lock_try"]).fetchone()
        return bool(row and row[0])

    def schema_backends_terminate(self, conn: psycopg.Connection) -> int:
        """End every other session whose ``application_name`` contains this schema's name; returns how many."""
        row = conn.execute(self.q["schema_backends_terminate"], (f"%{self.schema}%",)).fetchone()
        return int(row[0]) if row else 0

    def schema_drop(self, conn: psycopg.Connection) -> None:
        """Drop this schema and everything in it, if it exists (demo reset, test teardown; owner only)."""
        conn.execute(self.q["schema_drop"])
