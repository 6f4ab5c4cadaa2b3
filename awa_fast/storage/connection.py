"""Opening and closing connections, the App pool's connection class, DSN redaction and storable text."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import generators, pq
from psycopg.adapt import Transformer

from awa_fast.errors import ConfigError, DatabaseUnavailable


class _DirectStatements:
    """What both pool connection classes keep for ``run_prepared``: the statements it prepared."""

    _prepared_direct: set[bytes] | None = None  # statements run_prepared prepared on this session
    if TYPE_CHECKING:  # both connection classes' own
        pgconn: pq.abc.PGconn
        autocommit: bool

    @property
    def idle_autocommit(self) -> bool:
        """Whether a call here is its own transaction: autocommit and no transaction open (``run_prepared``)."""
        return self.autocommit and self.pgconn.transaction_status == pq.TransactionStatus.IDLE

    def _direct_prepared(self) -> set[bytes]:
        """The names ``run_prepared`` prepared on this session; refuses a call that would join a transaction."""
        if not self.idle_autocommit:
            raise psycopg.ProgrammingError("run_prepared needs an idle autocommit connection")
        prepared = self._prepared_direct
        if prepared is None:
            prepared = self._prepared_direct = set()
        return prepared


class PoolConnection(_DirectStatements, psycopg.Connection[Any]):
    """A connection one thread holds at a time: an App's pool's, a completion batcher's.

    It keeps one cursor for single enqueues. The pool hands a connection to one
    thread at a time (from ``getconn`` to ``putconn``), so that cursor is never
    shared. A new cursor per call
    (``conn.execute``) builds a new psycopg Transformer: ~14 µs of client CPU,
    a fifth of an ``App.enqueue`` (docs/performance-log.md, 2026-12-02 producers).
    A caller's own connection may be shared by threads: it never gets one.

    :meth:`run_prepared` goes one step further for the App's single enqueue and the
    batcher's quiet completion: one server-side prepared statement run through libpq itself.
    """

    _enqueue_cur: psycopg.Cursor[Any] | None = None
    _result_tx: psycopg.abc.Transformer | None = None  # load_tuples' own

    def enqueue_cursor(self) -> psycopg.Cursor[Any]:
        """The connection's single-enqueue cursor, created on first use."""
        cur = self._enqueue_cur
        if cur is None or cur.closed:
            cur = self._enqueue_cur = self.cursor()
        return cur

    def run_prepared(self, name: bytes, sql: bytes, params: Sequence[bytes | None], *,
                     text: bool = False) -> pq.abc.PGresult:
        """Run ``sql`` (``$n`` placeholders) as the prepared statement ``name``; its result, binary.

        The parameters come already encoded by the caller: in binary format, or with
        ``text`` in text format (no NUL inside, as PostgreSQL never stores one). For an
        autocommit connection held by one thread (a pool's between ``getconn`` and
        ``putconn``, a batcher's own): the call is its own transaction, committed before
        it returns. psycopg's cursor layer costs ~40-50 µs of client CPU per call on top
        of libpq's ~33 µs (perf/producers_floor.py; performance-log, 2026-12-05). The
        statement is prepared on first use and again if the session lost it
        (``DISCARD ALL``, ``DEALLOCATE``). A server error raises the psycopg exception the
        cursor would have raised; a lost session :class:`psycopg.OperationalError`.
        """
        prepared = self._direct_prepared()
        with self.lock:
            pg = self.pgconn
            formats = None if text else [1] * len(params)
            for attempt in (0, 1):
                if name not in prepared:
                    _check_prepared(self, pg.prepare(name, sql))
                    prepared.add(name)
                res = pg.exec_prepared(name, params, formats, 1)  # type: ignore[arg-type]  # None is NULL
                if attempt == 0 and _lost_statement(res):
                    prepared.discard(name)  # the session lost it: prepare it again, once
                    continue
                self._check(res, pq.ExecStatus.TUPLES_OK)
                return res
        raise AssertionError("unreachable")  # pragma: no cover

    def load_tuples(self, res: pq.abc.PGresult) -> list[tuple[Any, ...]]:
        """The rows of a binary ``run_prepared`` result as tuples, by this connection's loaders.

        One Transformer is kept for the connection (a new one costs ~14 µs, see the class
        docstring); only the thread holding the connection calls this.
        """
        tx = self._result_tx
        if tx is None:
            tx = self._result_tx = Transformer(self)
        tx.set_pgresult(res, set_loaders=True, format=pq.Format.BINARY)
        try:
            return tx.load_rows(0, res.ntuples, tuple)
        finally:
            tx.set_pgresult(None)

    def _check(self, res: pq.abc.PGresult, ok: pq.ExecStatus) -> None:
        _check_result(self, res, ok)


def _check_result(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any], res: pq.abc.PGresult,
                  ok: pq.ExecStatus) -> None:
    """Raise what psycopg's cursor would have raised unless ``res`` has status ``ok``."""
    if res.status == ok:
        return
    if conn.pgconn.status == pq.ConnStatus.BAD:  # as psycopg's cursor reports a lost session
        raise psycopg.OperationalError(pq.error_message(res, encoding=conn.info.encoding))
    raise psycopg.errors.error_from_result(res, encoding=conn.info.encoding)


def _check_prepared(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any], res: pq.abc.PGresult) -> None:
    """Raise unless ``res`` says the statement is prepared on the session.

    "Already exists" (42P05) counts as prepared: a statement's name is a hash of its
    text, and a call interrupted after the server prepared it, before the connection
    noted it (a task cancelled, a KeyboardInterrupt), leaves exactly that.
    """
    if not _failed_with(res, b"42P05"):
        _check_result(conn, res, pq.ExecStatus.COMMAND_OK)


def _last(results: list[pq.abc.PGresult]) -> pq.abc.PGresult:
    """The last result of one statement sent (an error ends the list, after any rows)."""
    if not results:
        raise psycopg.InternalError("the server sent no result for the statement")
    return results[-1]


def _failed_with(res: pq.abc.PGresult, sqlstate: bytes) -> bool:
    """Whether ``res`` is an error with ``sqlstate``."""
    return res.status == pq.ExecStatus.FATAL_ERROR and res.error_field(pq.DiagnosticField.SQLSTATE) == sqlstate


def _lost_statement(res: pq.abc.PGresult) -> bool:
    """Whether ``res`` says the session no longer has the prepared statement (``DISCARD ALL``, ``DEALLOCATE``)."""
    return _failed_with(res, b"26000")


class AsyncPoolConnection(_DirectStatements, psycopg.AsyncConnection[Any]):
    """The async App pool's connection: :meth:`run_prepared` for the single enqueue, awaited.

    The twin of :class:`PoolConnection`'s, for one task at a time (between the pool's
    ``getconn`` and ``putconn``). A prepared statement run through libpq's asynchronous
    calls and the connection's own wait: ~17% less client CPU per ``App.enqueue_async``
    than psycopg's cursor (performance-log, 2026-12-07 async enqueue). A task cancelled
    while it waits leaves the statement to psycopg's handling of an interrupted wait, as a
    cursor's would: the query is cancelled on the server and the connection comes back
    idle, or, if the server does not end it, psycopg closes the connection and the pool
    replaces it. One cancelled after the server prepared the statement but before this
    connection noted it finds it there next time ("already exists" counts as prepared).
    """

    async def run_prepared(self, name: bytes, sql: bytes, params: Sequence[bytes | None]) -> pq.abc.PGresult:
        """Run ``sql`` as the prepared statement ``name`` with binary ``params``; its binary result.

        As :meth:`PoolConnection.run_prepared` (binary parameters only), awaited.
        """
        prepared = self._direct_prepared()
        async with self.lock:
            pg = self.pgconn
            formats = [1] * len(params)
            for attempt in (0, 1):
                if name not in prepared:
                    pg.send_prepare(name, sql)
                    _check_prepared(self, _last(await self.wait(generators.execute(pg))))
                    prepared.add(name)
                pg.send_query_prepared(name, params, formats, 1)  # None is NULL
                res = _last(await self.wait(generators.execute(pg)))
                if attempt == 0 and _lost_statement(res):
                    prepared.discard(name)  # the session lost it: prepare it again, once
                    continue
                _check_result(self, res, pq.ExecStatus.TUPLES_OK)
                return res
        raise AssertionError("unreachable")  # pragma: no cover


def close_quietly(conn: psycopg.Connection | None) -> None:
    """Close a connection that may already be broken; errors while closing are moot."""
    if conn is None:
        return
    try:
        conn.close()
    except Exception:  # noqa: BLE001 - closing a broken connection
        pass


def clean_text(text: str | None, limit: int = 8192) -> str | None:
    """Text PostgreSQL will store: NUL escaped, lone surrogates escaped, at most ``limit`` characters."""
    if text is None:
        return None
    if "\x00" in text:
        text = text.replace("\x00", "\\x00")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text[:limit]


def connect(dsn: str, *, application_name: str = "awa_fast", autocommit: bool = True,
            connect_timeout: int = 10, connection_class: type[psycopg.Connection[Any]] = psycopg.Connection,
            **kwargs: Any) -> psycopg.Connection:
    """Open a connection, mapping connection failures to :class:`DatabaseUnavailable`.

    ``connect_timeout`` (seconds, at least 2) bounds a connection attempt to a
    silent peer. ``connection_class``: :class:`PoolConnection` for a connection one
    thread holds at a time. The message never contains the password of the DSN: a DSN
    libpq cannot parse raises :class:`ConfigError` without libpq's text, which
    quotes the part it choked on (a password, or the whole URI).
    """
    try:
        return connection_class.connect(dsn, autocommit=autocommit, application_name=application_name,
                                        connect_timeout=max(2, int(connect_timeout)), **kwargs)
    except psycopg.ProgrammingError:
        raise ConfigError(_DSN_UNPARSEABLE) from None
    except psycopg.OperationalError as exc:
        raise DatabaseUnavailable(f"cannot connect to PostgreSQL at {redact_dsn(dsn)}: "
                                  f"{_scrub_password(_first_line(exc), dsn)}; "
                                  "check the DSN and that the server runs") from None


_DSN_UNPARSEABLE = ("invalid DSN: it could not be parsed; use 'postgresql://user@host:port/dbname' "
                    "or 'host=... dbname=...' (keep the password in ~/.pgpass or PGPASSWORD)")


def _scrub_password(text: str, dsn: str) -> str:
    """``text`` with the DSN's password (if any) replaced by ``***``: libpq quotes values it rejects."""
    try:
        from psycopg.conninfo import conninfo_to_dict

        password = conninfo_to_dict(dsn).get("password")
    except psycopg.ProgrammingError:
        return text
    return text.replace(str(password), "***") if password else text


def redact_dsn(dsn: str) -> str:
    """The DSN with any password replaced by ``***`` (for logs, errors and status)."""
    try:
        from psycopg.conninfo import conninfo_to_dict, make_conninfo

        params = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return "<unparseable DSN>"
    if "password" in params:
        params["password"] = "***"
    return make_conninfo("", **{k: v for k, v in params.items() if v is not None})


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else exc.__class__.__name__
