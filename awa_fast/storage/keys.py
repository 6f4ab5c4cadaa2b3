"""Per-key concurrency: the named queries of ``sql/0012_key_limits.sql`` (docs/flow-control.md).

:class:`KeyLimitQueries` is mixed into :class:`awa_fast.storage.Storage`:

- enqueue with a key: ``job_enqueue_keyed`` (one job), ``job_enqueue_keyed_many``
  (many, a key per row);
- the claim of a key-limited queue: ``lane_claim_keyed_result``;
- settings and status: ``queue_limits_read`` (every limit of a queue),
  ``queue_key_limit_set``, ``queue_key_status``.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import psycopg

from awa_fast.storage.types import as_jsonb

if TYPE_CHECKING:
    from awa_fast.jobs import ClaimSnapshot
    from awa_fast.limits import QueueLimits
    from awa_fast.storage.types import RawJson


class KeyLimitQueries:
    """Storage methods of per-key concurrency (``self.q`` holds the rendered named queries)."""

    __slots__ = ()
    q: dict[str, str]
    if TYPE_CHECKING:  # Storage's
        def _claim_rows(self, conn: psycopg.Connection, name: str, queue: str, limit: int, stripe: int,
                        stripes: int) -> tuple[list[ClaimSnapshot], bool]: ...

    # -- enqueue ----------------------------------------------------------------------

    def _keyed_one(self, queue: str, priority: int, kind: str, args: RawJson, metadata: RawJson | None,
                   max_attempts: int, run_at: _dt.datetime | None, delay: float | None,
                   key: str) -> tuple[str, tuple[Any, ...]]:
        if delay is not None and delay > 0:
            return "job_enqueue_keyed_in", (queue, priority, kind, args, metadata, max_attempts, delay, key)
        return "job_enqueue_keyed", (queue, priority, kind, args, metadata, max_attempts, run_at, key)

    def job_enqueue_keyed(self, conn: psycopg.Connection, queue: str, priority: int, kind: str, args: RawJson,
                          metadata: RawJson | None, max_attempts: int, run_at: _dt.datetime | None,
                          delay: float | None, key: str) -> int:
        """Enqueue one job with concurrency key ``key`` on ``conn`` (its transaction); returns the job id.

        On a queue with ``key_max_running`` the job waits in ``key_waiting``
        until its key has room; on any other queue it is enqueued as without a key.
        """
        name, params = self._keyed_one(queue, priority, kind, args, metadata, max_attempts, run_at, delay, key)
        row = conn.execute(self.q[name], params).fetchone()
        assert row is not None
        return int(row[0])

    async def job_enqueue_keyed_async(self, conn: psycopg.AsyncConnection, queue: str, priority: int, kind: str,
                                      args: RawJson, metadata: RawJson | None, max_attempts: int,
                                      run_at: _dt.datetime | None, delay: float | None, key: str) -> int:
        """Async twin of :meth:`job_enqueue_keyed`."""
        name, params = self._keyed_one(queue, priority, kind, args, metadata, max_attempts, run_at, delay, key)
        cur = await conn.execute(self.q[name], params)
        row = await cur.fetchone()
        assert row is not None
        return int(row[0])

    def job_enqueue_keyed_many(self, conn: psycopg.Connection, queue: str, priority: int, kind: str,
                               args: Sequence[bytes], metadata: RawJson | None, max_attempts: int,
                               keys: Sequence[str | None]) -> list[int]:
        """Enqueue many jobs of one kind in one statement, ``keys[i]`` the key of ``args[i]`` (None: no key).

        ``args`` are encoded JSON (plain ``bytes`` or :class:`RawJson`); all go as jsonb.

        Returns the job ids in order.
        """
        if not args:
            return []
        rows = conn.execute(self.q["job_enqueue_keyed_many"],
                            (queue, priority, kind, as_jsonb(args), metadata, max_attempts, list(keys))).fetchall()
        return [int(r[0]) for r in rows]

    async def job_enqueue_keyed_many_async(self, conn: psycopg.AsyncConnection, queue: str, priority: int,
                                           kind: str, args: Sequence[bytes], metadata: RawJson | None,
                                           max_attempts: int, keys: Sequence[str | None]) -> list[int]:
        """Async twin of :meth:`job_enqueue_keyed_many`."""
        if not args:
            return []
        cur = await conn.execute(self.q["job_enqueue_keyed_many"],
                                 (queue, priority, kind, as_jsonb(args), metadata, max_attempts, list(keys)))
        return [int(r[0]) for r in await cur.fetchall()]

    # -- claim --------------------------------------------------------------------------

    def lane_claim_keyed_result(self, conn: psycopg.Connection, queue: str, limit: int, stripe: int = 0,
                                stripes: int = 1) -> tuple[list[ClaimSnapshot], bool]:
        """The claim of a queue with ``key_max_running`` (``lane_claim_keyed``).

        Admits waiting jobs whose key has room, then claims like
        ``lane_claim_limited_result``; the second value is also True when the
        claim came back short while due jobs still wait on a key.
        """
        return self._claim_rows(conn, "lane_claim_keyed", queue, limit, stripe, stripes)

    # -- settings and status ----------------------------------------------------------

    def queue_limits_read(self, conn: psycopg.Connection, queue: str) -> QueueLimits | None:
        """Every flow-control setting of ``queue`` (``key_max_running`` too), or None without a row."""
        return _limits(queue, conn.execute(self.q["queue_limits_read"], (queue,)).fetchone())

    async def queue_limits_read_async(self, conn: psycopg.AsyncConnection, queue: str) -> QueueLimits | None:
        """Async twin of :meth:`queue_limits_read`."""
        cur = await conn.execute(self.q["queue_limits_read"], (queue,))
        return _limits(queue, await cur.fetchone())

    def queue_key_limit_set(self, conn: psycopg.Connection, queue: str, key_max_running: int | None) -> int:
        """Set ``key_max_running`` of ``queue`` (None removes it and releases its waiting jobs).

        Returns how many waiting jobs a removal appended to the lane. Claimers
        pick the change up within ``awa_fast.limits.LIMIT_REFRESH_S``.
        """
        from awa_fast.limits import check_key_max_running

        row = conn.execute(self.q["queue_key_limit_set"],
                           (queue, check_key_max_running(key_max_running))).fetchone()
        return int(row[0]) if row else 0

    async def queue_key_limit_set_async(self, conn: psycopg.AsyncConnection, queue: str,
                                        key_max_running: int | None) -> int:
        """Async twin of :meth:`queue_key_limit_set`."""
        from awa_fast.limits import check_key_max_running

        cur = await conn.execute(self.q["queue_key_limit_set"], (queue, check_key_max_running(key_max_running)))
        row = await cur.fetchone()
        return int(row[0]) if row else 0

    def queue_key_status(self, conn: psycopg.Connection) -> dict[str, dict[str, Any]]:
        """Per key-limited queue: ``key_max_running``, ``waiting`` (jobs waiting on a key),
        ``keys_waiting`` (distinct keys) and ``admitted`` (in the lane or running)."""
        return _key_status(conn.execute(self.q["queue_key_status"]).fetchall())

    async def queue_key_status_async(self, conn: psycopg.AsyncConnection) -> dict[str, dict[str, Any]]:
        """Async twin of :meth:`queue_key_status`."""
        cur = await conn.execute(self.q["queue_key_status"])
        return _key_status(await cur.fetchall())


def _limits(queue: str, row: Any) -> QueueLimits | None:
    from awa_fast.limits import QueueLimits, Rate

    if row is None:
        return None
    max_running, count, per, burst, key_max = row
    rate = Rate(float(count), per=float(per), burst=float(burst)) if count is not None else None
    return QueueLimits(queue, None if max_running is None else int(max_running), rate,
                       None if key_max is None else int(key_max))


def _key_status(rows: Sequence[Any]) -> dict[str, dict[str, Any]]:
    return {queue: {"key_max_running": kmax, "waiting": int(waiting), "keys_waiting": int(keys),
                    "admitted": int(admitted)}
            for queue, kmax, waiting, keys, admitted in rows}
