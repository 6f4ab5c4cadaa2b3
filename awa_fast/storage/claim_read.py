"""The claim's rows as one binary COPY, read without psycopg's per-row machinery.

A claim of many rows spends most of its client CPU on psycopg building one
Python object per field (18 a row: a C loader each, a Python call for the raw
jsonb) and libpq building the result set those come from. The ``*_copy``
named queries send the same claim as ``COPY (SELECT ... FROM claim_batch_v3(...))
TO STDOUT (FORMAT binary)``; :func:`claim_copy` collects the stream's messages
and the codec decodes it straight into :class:`~awa_fast.jobs.ClaimSnapshot`
objects (``_impl.decode_copy_snapshots``): the same snapshots as the row path.

COPY takes no bind parameters: the queue name (user text) is bound as a
literal quoted by psycopg for this connection (``psycopg.sql.Literal``), the
integers are formatted from ``operator.index`` values. The named query holds
one ``{}`` per argument, in order.

How the stream is read. ``Copy.read()`` waits for the next message the way
every psycopg call waits (so the watchdog's socket shutdown and server errors
surface as the usual psycopg errors), but costs ~0.9 us a row. So once a
message is in, the ones libpq already holds are taken with the non-blocking
``PGconn.get_copy_data(1)``; only when libpq has nothing buffered does the
loop go back to ``Copy.read()`` to wait. PostgreSQL sends a binary COPY as
the header with the first row, one message per row, and the trailer alone
(header and trailer together when there is no row): after the trailer the
loop stops taking messages itself and lets ``Copy.read()`` read the end of
the COPY (its command status, or the error of a failed commit), so psycopg
sees the COPY finish as it always does. Rows are decoded only after that:
a claim whose commit failed returns nothing.
"""

from __future__ import annotations

import select
from operator import index

import psycopg
import psycopg.errors
import psycopg.sql
from psycopg.pq import ExecStatus

from awa_fast import _impl
from awa_fast.jobs import ClaimSnapshot

_TRAILER = b"\xff\xff"
# a binary COPY of no rows, sent as one message: signature, flags 0, no header extension, trailer
_EMPTY_STREAM = b"PGCOPY\n\xff\r\n\x00" + bytes(8) + _TRAILER

__all__ = ["CLAIM_COPY_MIN_ROWS", "claim_copy", "claim_read", "claim_rows", "copy_out"]

# A claim asking for at least this many rows reads them as one binary COPY (claim_copy); a smaller
# one fetches rows on a binary cursor (claim_rows). Both give the same snapshots. Why 256: the COPY
# saves ~0.3 us of client CPU per row, but it is a simple-protocol statement (no prepared plan for
# the outer COPY: parsed and planned each call), which cost an idle one-job claim ~50 us more
# server time and round trip (perf/claim_copy_ab.py, docs/performance-log.md, copy-claim). At
# about 250 rows the two cancel out. The adaptive claim starts at max(16, concurrency), 64 by
# default, so an idle queue's claims (and its pickup latency) stay on the row path; a drain's
# claims double to 1,024 and take the COPY from their third claim.
CLAIM_COPY_MIN_ROWS = 256


def claim_read(conn: psycopg.Connection, rows_query: str, copy_query: str, queue: str, limit: int, stripe: int,
               stripes: int) -> tuple[list[ClaimSnapshot], bool]:
    """One claim call: ``(snapshots, backlog marker seen)``, by COPY or by rows as ``limit`` decides."""
    if limit >= CLAIM_COPY_MIN_ROWS:
        return claim_copy(conn, copy_query, queue, limit, stripe, stripes)
    return claim_rows(conn, rows_query, queue, limit, stripe, stripes)


def claim_rows(conn: psycopg.Connection, query: str, queue: str, limit: int, stripe: int,
               stripes: int) -> tuple[list[ClaimSnapshot], bool]:
    """A claim query's rows on a binary cursor (C loaders for ints and timestamps, raw jsonb): (snapshots, marker)."""
    cur = conn.cursor(binary=True)
    cur.execute(query, (queue, limit, stripe, stripes))
    rows = cur.fetchall()
    marker = bool(rows) and rows[-1][0] is None
    if marker:
        rows.pop()
    return _impl.decode_snapshots(rows), marker


def claim_statement(conn: psycopg.Connection, query: str, queue: str, limit: int, stripe: int,
                    stripes: int) -> bytes:
    """The claim COPY ``query`` with its four ``{}`` bound as literals (queue, limit, stripe, stripes)."""
    parts = query.split("{}")
    if len(parts) != 5:
        raise ValueError(f"a claim COPY query needs 4 placeholders, found {len(parts) - 1}")
    if not isinstance(queue, str):
        raise TypeError(f"queue must be a str, not {type(queue).__name__}")
    ints = [str(index(v)).encode() for v in (limit, stripe, stripes)]
    return b"".join((parts[0].encode(), psycopg.sql.Literal(queue).as_bytes(conn), parts[1].encode(), ints[0],
                     parts[2].encode(), ints[1], parts[3].encode(), ints[2], parts[4].encode()))


def claim_copy(conn: psycopg.Connection, query: str, queue: str, limit: int, stripe: int,
               stripes: int) -> tuple[list[ClaimSnapshot], bool]:
    """Run the claim COPY ``query`` and decode it: ``(snapshots, backlog marker seen)``.

    The same result as fetching the claim's rows on a binary cursor with the
    raw-jsonb loader and decoding them; a server error raises the same
    psycopg error and leaves the connection usable.
    """
    return _impl.decode_copy_snapshots(copy_out(conn, claim_statement(conn, query, queue, limit, stripe, stripes)))


def copy_out(conn: psycopg.Connection, statement: bytes) -> bytes:
    """The whole stream of a binary ``COPY ... TO STDOUT``, once the COPY has ended without error."""
    get = conn.pgconn.get_copy_data
    chunks: list[bytes | bytearray | memoryview] = []
    ended = False
    with conn.cursor() as cur, cur.copy(statement) as cp:
        data: bytes | bytearray | memoryview = cp.read()  # waits; raises what the statement raised
        while data:
            chunks.append(data)
            if (len(data) == 2 and data == _TRAILER) or (len(chunks) == 1 and data == _EMPTY_STREAM):
                break  # the trailer: Copy.read() reads the end
            n, data = get(1)
            if n == 0:  # nothing buffered: wait the psycopg way
                data = cp.read()
            elif n < 0:  # the COPY ended (an error, or no trailer of its own) in this loop's hands
                _copy_end(conn)
                ended = True
                break
        if not ended:
            while cp.read():  # the end of the COPY: its status, or the error it ended with
                pass
    return b"".join(chunks)


def _copy_end(conn: psycopg.Connection) -> None:
    """Read a COPY's final results after ``get_copy_data`` returned -1; raise its error, if any.

    What psycopg does after the end of a COPY it reads itself, on the public
    libpq wrapper: wait for the socket (a watchdog's shutdown ends the wait
    with an error), then take every result.
    """
    pgconn = conn.pgconn
    error: psycopg.Error | None = None
    while True:
        while pgconn.is_busy():
            select.select([pgconn.socket], [], [])
            pgconn.consume_input()
        result = pgconn.get_result()
        if result is None:
            break
        if result.status != ExecStatus.COMMAND_OK and error is None:
            error = psycopg.errors.error_from_result(result, encoding=conn.info.encoding)
    if error is not None:
        raise error
