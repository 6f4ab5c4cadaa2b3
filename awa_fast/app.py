"""The application object users write against: handlers, enqueue, workers; jobs, queues, the DLQ and
callbacks through :class:`awa_fast.admin.AdminMixin`.

Every method that touches the database takes ``conn=`` to run inside the
caller's own transaction (it commits or rolls back with the caller's
data); without it the app uses an autocommit connection from its own pool
(``psycopg_pool``), so each call commits at once in one round trip (calls of
several statements run in one transaction). Each has an ``_async`` twin for
``psycopg.AsyncConnection`` (without ``conn=`` it uses the app's async pool,
opened on first use in the running event loop).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import inspect
import logging
import math
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeVar, overload

import psycopg

from awa_fast.admin import AdminMixin
from awa_fast.client import (
    MAX_DELAY_S,
    PRIORITY_DEFAULT,
    Client,
    to_plain,
    validate_max_attempts,
    validate_name,
    validate_priority,
)
from awa_fast.errors import ConfigError, DatabaseUnavailable, OutOfRange
from awa_fast.jobs import TIMEOUT_KEY, AttemptClosed, JobSpec
from awa_fast.limits import KEEP, check_concurrency_key
from awa_fast.records import int_in
from awa_fast.storage import RawJson, connect, redact_dsn
from awa_fast.storage.connection import AsyncPoolConnection, PoolConnection
from awa_fast.unique import Unique

F = TypeVar("F", bound=Callable[..., Any])
log = logging.getLogger("awa_fast.app")

DEFAULT_SCHEMA = "awa_fast"

# KEEP: a configure_queue argument left as it is (one object, shared with awa_fast.limits and
# awa_fast.admin), re-exported here.


# -- the one DSN and schema rule (the CLI and supervise use these too) ------------------


def dsn_from_environment(explicit: str | None = None) -> tuple[str | None, str]:
    """The configured DSN and where it came from, without starting anything.

    The rule everywhere: an explicit DSN (``--dsn``, ``App(dsn=...)``), then
    ``AWA_FAST_DSN``, then ``DATABASE_URL``; ``(None, "embedded")`` when none is
    set. A DSN that cannot be parsed raises :class:`ConfigError`.
    """
    for value, source in ((explicit, "argument"), (os.environ.get("AWA_FAST_DSN"), "AWA_FAST_DSN"),
                          (os.environ.get("DATABASE_URL"), "DATABASE_URL")):
        if value:
            check_dsn(value)
            return value, source
    return None, "embedded"


def resolve_dsn(explicit: str | None = None, home: Any = None) -> tuple[str, str]:
    """:func:`dsn_from_environment`, else the embedded server under ``home`` (started if needed)."""
    dsn, source = dsn_from_environment(explicit)
    if dsn is not None:
        return dsn, source
    from awa_fast.embedded import ensure_embedded

    return ensure_embedded(home), "embedded"


def check_dsn(dsn: str) -> None:
    """Raise :class:`ConfigError` (without echoing the DSN) if ``dsn`` cannot be parsed."""
    from psycopg.conninfo import conninfo_to_dict

    try:
        conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        raise ConfigError("invalid DSN: it could not be parsed; use 'postgresql://user@host:port/dbname' "
                          "or 'host=... dbname=...'") from None


def resolve_schema(explicit: str | None = None) -> str:
    """The schema: explicit (``--schema``, ``App(schema=...)``), then ``AWA_FAST_SCHEMA``, then ``awa_fast``."""
    return explicit or os.environ.get("AWA_FAST_SCHEMA") or DEFAULT_SCHEMA


def _validate_weight(value: object) -> int:
    """A handler weight: an int from 1 to 4096 (the most concurrency a queue spec accepts)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"weight={value!r}: use an int from 1 to 4096 (worker slots one attempt takes)")
    if not 1 <= value <= 4096:
        raise OutOfRange("weight", value, "1", "4096")
    return value


def _with_timeout(metadata: Any, timeout: float | None) -> Any:
    """``metadata`` carrying a per-job timeout under :data:`TIMEOUT_KEY` (checked first; a new dict)."""
    t = _validate_timeout(timeout)
    if t is None:
        return metadata
    if metadata is None:
        return {TIMEOUT_KEY: t}
    plain = metadata if isinstance(metadata, dict) else to_plain(metadata)
    if not isinstance(plain, dict):
        raise ConfigError(f"timeout= needs metadata that is a mapping, got {type(metadata).__name__}: "
                          "pass metadata as a dict (the timeout is stored in it)")
    return {**plain, TIMEOUT_KEY: t}


def _validate_timeout(value: object) -> float | None:
    """A handler timeout: None, or finite seconds > 0 and at most ten years."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0 < value <= MAX_DELAY_S:
        raise OutOfRange("timeout", value, "more than 0", f"{int(MAX_DELAY_S)} seconds (or None: no timeout)")
    return float(value)



def _unreachable(dsn: str) -> DatabaseUnavailable:
    """The error for a server the probe or the pool could not reach (the DSN's password masked)."""
    return DatabaseUnavailable(f"cannot connect to PostgreSQL at {redact_dsn(dsn)}; "
                               "check the DSN and that the server runs")


class App(AdminMixin, Client):
    """An awa-fast application: a handler registry plus the whole public API.

    ``dsn=None`` follows the rule of the CLI: ``AWA_FAST_DSN``, then
    ``DATABASE_URL``, else the embedded server (started on first use under
    ``$AWA_FAST_HOME``); the server in use is logged once. ``schema=None``
    means ``AWA_FAST_SCHEMA``, else ``awa_fast``. Enqueue of a kind no
    handler registers needs ``queue=`` (or ``default_queue=`` here, the
    explicit opt-in). Use it as a context manager to close its pools; it is
    safe to share across threads. Run handlers with ``awa-fast supervise
    module:app``.
    """

    def __init__(self, dsn: str | None = None, schema: str | None = None, *, default_queue: str | None = None,
                 max_payload_bytes: int = 1 << 20, pool_size: int = 4) -> None:
        self._dsn: str | None = None
        self._resolved: tuple[str, str] | None = None
        self._lock = threading.RLock()
        self._pool_obj: Any = None
        self._apool_obj: Any = None
        super().__init__(dsn, resolve_schema(schema), default_queue=default_queue or "default",
                         max_payload_bytes=max_payload_bytes)
        self.fallback_queue = None if default_queue is None else validate_name("queue", default_queue)
        self.pool_size = int_in("pool_size", pool_size, 1, 1000)
        self.registry: dict[str, JobSpec] = {}
        self.flush_listeners: list[Callable[[list[AttemptClosed]], None]] = []

    # -- lifecycle --------------------------------------------------------------------

    @property
    def dsn(self) -> str | None:
        """The DSN given explicitly (None: resolved from the environment or the embedded server)."""
        return self._dsn

    @dsn.setter
    def dsn(self, value: str | None) -> None:
        if self._pool_obj is not None or self._apool_obj is not None:
            raise ConfigError("set App.dsn before the app's first database call (its pools are open)")
        self._dsn = value
        self._resolved = None

    def __enter__(self) -> App:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> App:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def close(self) -> None:
        """Close the app's own connections (never the ones passed in as ``conn=``)."""
        with self._lock:
            pool, self._pool_obj = self._pool_obj, None
        if pool is not None:
            pool.close()
        super().close()

    async def aclose(self) -> None:
        """Close the async pool (and the sync one)."""
        with self._lock:
            apool, self._apool_obj = self._apool_obj, None
        if apool is not None:
            await apool.close()
        self.close()

    def resolve_dsn(self) -> str:
        """The DSN in use (see the class docstring); starts the embedded server when none is configured."""
        with self._lock:
            if self._resolved is None:
                self._resolved = resolve_dsn(self._dsn)
                dsn, source = self._resolved
                log.info("awa-fast app (schema %s) uses PostgreSQL at %s (from %s)", self.storage.schema,
                         redact_dsn(dsn), "the embedded server" if source == "embedded" else source,
                         extra={"action": "dsn"})
            return self._resolved[0]

    def _application_name(self) -> str:
        return f"awa_fast:app:{self.storage.schema}"

    def _own_conn(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed:
            self._conn = connect(self.resolve_dsn(), application_name=self._application_name())
        return self._conn

    def _pool(self) -> Any:
        with self._lock:
            if self._pool_obj is None:
                from psycopg_pool import ConnectionPool

                dsn = self.resolve_dsn()
                probe = connect(dsn, application_name=self._application_name())
                try:
                    self.storage.schema_check(probe)
                finally:
                    probe.close()
                pool = ConnectionPool(dsn, connection_class=PoolConnection, min_size=1, max_size=self.pool_size,
                                      open=False, name=f"awa_fast:{self.storage.schema}",
                                      kwargs={"application_name": self._application_name(),
                                              "autocommit": True})
                # Wait for the first connection before the first caller asks: a caller
                # that finds the pool still filling makes it grow, and the pool then
                # hands out its connections in turn, so one thread enqueuing alone
                # would use two backends and spread its jobs over two lanes, which
                # makes every claim take the several-lanes path (docs/performance-log.md,
                # "p-regress").
                self._open_pool(pool, dsn)
                self._pool_obj = pool
            return self._pool_obj

    @staticmethod
    def _open_pool(pool: Any, dsn: str) -> None:
        from psycopg_pool import PoolTimeout

        try:
            pool.open(wait=True, timeout=30.0)
        except PoolTimeout:
            pool.close()
            raise _unreachable(dsn) from None

    async def _apool(self) -> Any:
        if self._apool_obj is None:
            from psycopg_pool import AsyncConnectionPool, PoolTimeout

            dsn = self.resolve_dsn()
            try:
                probe = await psycopg.AsyncConnection.connect(dsn, autocommit=True, connect_timeout=10,
                                                              application_name=self._application_name())
            except psycopg.OperationalError:
                raise _unreachable(dsn) from None
            try:
                await self.storage.schema_check_async(probe)
            finally:
                await probe.close()
            pool = AsyncConnectionPool(dsn, connection_class=AsyncPoolConnection, min_size=1,
                                       max_size=self.pool_size, open=False,
                                       name=f"awa_fast:{self.storage.schema}:async",
                                       kwargs={"application_name": self._application_name(), "autocommit": True})
            # opened with its first connection (see _pool) before it is published
            try:
                await pool.open(wait=True, timeout=30.0)
            except PoolTimeout:
                await pool.close()
                raise _unreachable(dsn) from None
            with self._lock:
                extra = pool if self._apool_obj is not None else None
                if extra is None:
                    self._apool_obj = pool
            if extra is not None:
                await extra.close()
        return self._apool_obj

    def _conn_scope(self, conn: psycopg.Connection | None) -> contextlib.AbstractContextManager[psycopg.Connection]:
        if conn is not None:
            return contextlib.nullcontext(conn)
        return _Lent(self._pool())

    def _enqueue_single(self, target: psycopg.Connection, own: bool, queue: str, priority: int, kind: str,
                        args: RawJson, metadata: RawJson | None, max_attempts: int, run_at: _dt.datetime | None,
                        delay: float | None) -> int:
        # the pool's connection is this thread's alone until the call returns: a job to run now
        # goes through one prepared statement on libpq itself, a scheduled one reuses the cursor
        if own and isinstance(target, PoolConnection):
            if run_at is None and delay is None:
                return self.storage.job_enqueue_direct(target, queue, priority, kind, args, metadata, max_attempts)
            return self.storage.job_enqueue(target.enqueue_cursor(), queue, priority, kind, args, metadata,
                                            max_attempts, run_at, delay)
        return super()._enqueue_single(target, own, queue, priority, kind, args, metadata, max_attempts, run_at,
                                       delay)

    def _aconn_scope(self, conn: psycopg.AsyncConnection | None
                     ) -> contextlib.AbstractAsyncContextManager[psycopg.AsyncConnection]:
        if conn is not None:
            return contextlib.nullcontext(conn)
        return _ALent(self)

    async def _enqueue_single_async(self, target: psycopg.AsyncConnection, own: bool, queue: str, priority: int,
                                    kind: str, args: RawJson, metadata: RawJson | None, max_attempts: int,
                                    run_at: _dt.datetime | None, delay: float | None) -> int:
        # as _enqueue_single: a job to run now on the pool's connection, which this task alone
        # holds, goes through one prepared statement on libpq's asynchronous calls
        if own and run_at is None and delay is None and isinstance(target, AsyncPoolConnection):
            return await self.storage.job_enqueue_direct_async(target, queue, priority, kind, args, metadata,
                                                               max_attempts)
        return await super()._enqueue_single_async(target, own, queue, priority, kind, args, metadata,
                                                   max_attempts, run_at, delay)

    def migrate(self) -> None:
        """Install or upgrade the schema (idempotent)."""
        from awa_fast.storage.migrate import migrate

        migrate(self.resolve_dsn(), self.storage.schema)

    # -- handlers ---------------------------------------------------------------------

    def job(self, kind: str, *, queue: str | None = None, priority: int = PRIORITY_DEFAULT,
            max_attempts: int = 25, args_type: type | None = None,
            unique: Unique | bool | None = None, timeout: float | None = None,
            weight: int = 1,
            concurrency_key: Callable[[Any], str | None] | str | None = None) -> Callable[[F], F]:
        """Register ``def handler(job)`` or ``async def handler(job)`` for ``kind``.

        ``queue`` defaults to the app's ``default_queue`` (else ``default``).
        ``args_type`` (a ``msgspec.Struct`` or dataclass) makes ``job.args``
        a typed object; type the handler as ``awa_fast.Job[ArgsType]``.
        ``unique=awa_fast.Unique(...)`` makes every enqueue of the kind unique by default.
        ``timeout`` (seconds, finite, > 0, at most 10 years; None: none) bounds one attempt,
        counted from the handler's start: when it passes the attempt closes as a retry
        ("timed out after N s"), see ``docs/handlers.md``; ``enqueue(..., timeout=)`` overrides it per job.
        ``weight`` (1 to 4096): how many of a claimer's ``concurrency`` slots one running attempt takes.
        ``concurrency_key`` (a str, or ``lambda args: ...`` called with the args at each enqueue):
        the kind's default key; with the queue's ``key_max_running`` at most that many jobs of one
        key run at once (docs/flow-control.md).
        """
        validate_name("kind", kind)
        timeout = _validate_timeout(timeout)
        weight = _validate_weight(weight)
        if concurrency_key is not None and not callable(concurrency_key):
            check_concurrency_key(concurrency_key)
        q = validate_name("queue", queue if queue is not None else self.default_queue)
        validate_priority(priority)
        validate_max_attempts(max_attempts)
        self._unique_default(kind, unique)

        def register(fn: F) -> F:
            if kind in self.registry:
                raise ConfigError(f"kind {kind!r} is registered twice; each kind has one handler")
            self.registry[kind] = JobSpec(kind, fn, q, priority, max_attempts,
                                          inspect.iscoroutinefunction(fn), args_type, timeout, weight)
            if concurrency_key is not None:
                self.__dict__.setdefault("_key_defaults", {})[kind] = concurrency_key
            return fn

        return register

    def on_flush(self, fn: Callable[[list[AttemptClosed]], None]) -> Callable[[list[AttemptClosed]], None]:
        """Register ``fn(closed)``, called in each claimer process after every completion flush commits.

        ``closed`` lists the flush's attempts as :class:`AttemptClosed`. It
        runs on the batcher's thread, so keep it short; an exception it
        raises never affects the queue and is logged with its traceback at
        most once a minute per listener (the next such line counts the
        failures in between). Register at import
        time of the app module (claimer processes load the app themselves).
        """
        self.flush_listeners.append(fn)
        return fn

    def queues(self) -> list[str]:
        """Queues that registered handlers use."""
        return sorted({spec.queue for spec in self.registry.values()})

    # -- enqueue (registry defaults) ----------------------------------------------------

    def _defaults(self, kind: str, queue: str | None, priority: int | None,
                  max_attempts: int | None) -> tuple[str | None, int | None, int | None]:
        spec = self.registry.get(kind)
        if spec is None:
            if queue is None:
                queue = self.fallback_queue
            if queue is None:
                validate_name("kind", kind)
                raise ConfigError(
                    f"no handler is registered for kind {kind!r} and no queue= was given, so no worker "
                    f"would ever run it: register it with @app.job({kind!r}, queue=...) in this process, "
                    "pass queue= to enqueue, or create the App with default_queue=... to send unregistered "
                    "kinds there")
            return queue, priority, max_attempts
        return (queue if queue is not None else spec.queue,
                priority if priority is not None else spec.priority,
                max_attempts if max_attempts is not None else spec.max_attempts)

    def enqueue(self, kind: str, args: Any = None, *, queue: str | None = None, priority: int | None = None,
                max_attempts: int | None = None, metadata: Any = None, run_at: Any = None,
                delay: float | None = None, conn: psycopg.Connection | None = None,
                unique: Unique | bool | None = None, timeout: float | None = None,
                concurrency_key: str | None = None) -> int:
        """Enqueue one job (defaults from the kind's registration); returns its id.

        ``args`` may be a dict, a ``msgspec.Struct``, a dataclass (datetime,
        UUID and Decimal fields encode as JSON strings); ``run_at`` (aware
        datetime) or ``delay`` (seconds) schedules it. ``timeout`` (seconds) bounds each
        attempt of this job, overriding the kind's ``timeout=``. ``concurrency_key``
        (default: the kind's, see :meth:`job`) limits how many jobs of one key run
        at once on a queue with ``key_max_running``.
        """
        queue, priority, max_attempts = self._defaults(kind, queue, priority, max_attempts)
        metadata = _with_timeout(metadata, timeout)
        return super().enqueue(kind, args, queue=queue, priority=priority, max_attempts=max_attempts,
                               metadata=metadata, run_at=run_at, delay=delay, conn=conn,
                               unique=self._unique_for(kind, unique),
                               concurrency_key=self._key_for(kind, args, concurrency_key))

    async def enqueue_async(self, kind: str, args: Any = None, *, conn: psycopg.AsyncConnection | None = None,
                            queue: str | None = None, priority: int | None = None,
                            max_attempts: int | None = None, metadata: Any = None, run_at: Any = None,
                            delay: float | None = None, unique: Unique | bool | None = None,
                            timeout: float | None = None, concurrency_key: str | None = None) -> int:
        """Async twin of :meth:`enqueue`."""
        queue, priority, max_attempts = self._defaults(kind, queue, priority, max_attempts)
        metadata = _with_timeout(metadata, timeout)
        key = self._key_for(kind, args, concurrency_key)
        return await super().enqueue_async(kind, args, conn=conn, queue=queue, priority=priority,
                                           max_attempts=max_attempts, metadata=metadata, run_at=run_at, delay=delay,
                                           unique=self._unique_for(kind, unique), concurrency_key=key)

    @overload
    def enqueue_many(self, kind: str, args_list: Any, *, queue: str | None = ..., priority: int | None = ...,
                     max_attempts: int | None = ..., metadata: Any = ..., conn: psycopg.Connection | None = ...,
                     chunk: int = ..., progress: Any = ..., return_ids: Literal[False] = ...,
                     unique: Unique | bool | None = ..., timeout: float | None = ...,
                     concurrency_key: str | Sequence[str | None] | None = ...) -> int: ...

    @overload
    def enqueue_many(self, kind: str, args_list: Any, *, queue: str | None = ..., priority: int | None = ...,
                     max_attempts: int | None = ..., metadata: Any = ..., conn: psycopg.Connection | None = ...,
                     chunk: int = ..., progress: Any = ..., return_ids: Literal[True],
                     unique: Unique | bool | None = ..., timeout: float | None = ...,
                     concurrency_key: str | Sequence[str | None] | None = ...) -> list[int]: ...

    @overload
    def enqueue_many(self, kind: str, args_list: Any, *, queue: str | None = ..., priority: int | None = ...,
                     max_attempts: int | None = ..., metadata: Any = ..., conn: psycopg.Connection | None = ...,
                     chunk: int = ..., progress: Any = ..., return_ids: bool = ...,
                     unique: Unique | bool | None = ..., timeout: float | None = ...,
                     concurrency_key: str | Sequence[str | None] | None = ...) -> int | list[int]: ...

    def enqueue_many(self, kind: str, args_list: Any, *, queue: str | None = None, priority: int | None = None,
                     max_attempts: int | None = None, metadata: Any = None,
                     conn: psycopg.Connection | None = None, chunk: int = 50_000, progress: Any = None,
                     return_ids: bool = False, unique: Unique | bool | None = None,
                     timeout: float | None = None,
                     concurrency_key: str | Sequence[str | None] | None = None) -> int | list[int]:
        """Bulk-enqueue by binary COPY (defaults from the kind's registration).

        Returns how many, or their ids in order with ``return_ids=True``. The
        ``chunk``-row COPYs of one call go to successive enqueue shards (lanes) of
        the queue, so stripes claim them side by side. With
        ``unique=`` (or the kind's default) duplicates are skipped and the result
        is a :class:`awa_fast.unique.UniqueManyResult`. ``timeout`` applies to every job.
        ``concurrency_key``: one str for all, or one key (or None) per job; default: the kind's, per job.
        """
        queue, priority, max_attempts = self._defaults(kind, queue, priority, max_attempts)
        metadata = _with_timeout(metadata, timeout)
        args_list, keys = self._keys_for_many(kind, args_list, concurrency_key)
        return super().enqueue_many(kind, args_list, queue=queue, priority=priority, max_attempts=max_attempts,
                                    metadata=metadata, conn=conn, chunk=chunk, progress=progress,
                                    return_ids=return_ids, unique=self._unique_for(kind, unique),
                                    concurrency_key=keys)

    async def enqueue_many_async(self, kind: str, args_list: Any, *, conn: psycopg.AsyncConnection | None = None,
                                 queue: str | None = None, priority: int | None = None,
                                 max_attempts: int | None = None, metadata: Any = None, chunk: int = 50_000,
                                 progress: Any = None, return_ids: bool = False,
                                 unique: Unique | bool | None = None, timeout: float | None = None,
                                 concurrency_key: str | Sequence[str | None] | None = None) -> Any:
        """Async twin of :meth:`enqueue_many`."""
        queue, priority, max_attempts = self._defaults(kind, queue, priority, max_attempts)
        metadata = _with_timeout(metadata, timeout)
        args_list, keys = self._keys_for_many(kind, args_list, concurrency_key)
        async with self._aconn_scope(conn) as c:
            return await super().enqueue_many_async(kind, args_list, conn=c, queue=queue, priority=priority,
                                                    max_attempts=max_attempts, metadata=metadata, chunk=chunk,
                                                    progress=progress, return_ids=return_ids,
                                                    unique=self._unique_for(kind, unique), concurrency_key=keys)

    def _key_for(self, kind: str, args: Any, key: str | None) -> str | None:
        # an explicit key wins; else the kind's (a str, or a callable of the args); no default: one dict probe
        if key is not None:
            return key
        d = self.__dict__.get("_key_defaults")
        default = d.get(kind) if d else None
        if default is None:
            return None
        return _call_key(kind, default, args)

    def _keys_for_many(self, kind: str, args_list: Any,
                       key: str | Sequence[str | None] | None) -> tuple[Any, str | Sequence[str | None] | None]:
        d = self.__dict__.get("_key_defaults")
        default = d.get(kind) if d else None
        if key is not None or default is None:
            return args_list, key
        if not callable(default):
            return args_list, default
        rows = list(args_list)
        return rows, [_call_key(kind, default, a) for a in rows]

    # -- in-process worker --------------------------------------------------------------
    # Thin entry points; the worker lives in awa_fast/worker.py.

    def run_worker(self, queues: QueuesArg = None, *, maintenance: bool = True, until_empty: bool = False,
                   install_signal_handlers: bool = True, drain_timeout: float = 30.0,
                   poll_interval: float = 1.0, listen: bool = True) -> WorkerSummary:
        """Run the handlers in this process until stopped; blocks and returns a :class:`WorkerSummary`.

        ``queues``: ``{"email": {"concurrency": 8, "stripes": 1, "batch": 0}}``,
        a list of names, or None for the queues of the registered handlers.
        One claimer thread per stripe (the claimer, batcher and heartbeat of
        ``awa-fast supervise``); ``maintenance=True`` joins the leader
        election. SIGINT/SIGTERM (handlers installed only on the main thread:
        elsewhere pass ``install_signal_handlers=False``) or
        :meth:`stop_worker` from another thread drain cleanly.
        ``until_empty=True`` returns once no job of these queues is available
        or running (jobs scheduled for later do not count).
        """
        from awa_fast.worker import run_worker

        return run_worker(self, queues, maintenance=maintenance, until_empty=until_empty,
                          install_signal_handlers=install_signal_handlers, drain_timeout=drain_timeout,
                          poll_interval=poll_interval, listen=listen)

    async def run_worker_async(self, queues: QueuesArg = None, *, maintenance: bool = True,
                               until_empty: bool = False, drain_timeout: float = 30.0,
                               poll_interval: float = 1.0, listen: bool = True) -> WorkerSummary:
        """Run the handlers inside the running event loop; cancelling the task drains cleanly.

        The claimers run on their own threads (no blocking call on the loop);
        the coroutine only awaits their end. Installs no signal handlers: the
        host (e.g. uvicorn) owns them, so cancel the task from its shutdown.
        """
        from awa_fast.worker import run_worker_async

        return await run_worker_async(self, queues, maintenance=maintenance, until_empty=until_empty,
                                      drain_timeout=drain_timeout, poll_interval=poll_interval, listen=listen)

    def stop_worker(self) -> int:
        """Ask this app's running in-process workers to drain (any thread); returns how many."""
        from awa_fast.worker import stop_worker

        return stop_worker(self)

    # -- periodic and unique jobs (issue 13; logic in awa_fast/periodic.py and awa_fast/unique.py) --------

    @property
    def unique_defaults(self) -> dict[str, Any]:
        """Kind -> its default :class:`awa_fast.Unique` (from ``@app.job(unique=...)``)."""
        d = self.__dict__.get("_unique_defaults")
        if d is None:
            d = self.__dict__["_unique_defaults"] = {}
        return d

    @property
    def schedules(self) -> dict[str, Any]:
        """Schedule name -> :class:`awa_fast.periodic.Schedule` declared with :meth:`periodic`."""
        d = self.__dict__.get("_schedules")
        if d is None:
            d = self.__dict__["_schedules"] = {}
        return d

    def _unique_default(self, kind: str, unique: Any) -> None:
        if unique is not None and unique is not False:
            from awa_fast.unique import _check

            self.unique_defaults[kind] = _check(unique)

    def _unique_for(self, kind: str, unique: Any) -> Any:
        # None: the kind's default (usually none: one dict lookup); False: not unique for this call.
        if unique is None:
            d = self.__dict__.get("_unique_defaults")
            return d.get(kind) if d else None
        return unique

    def periodic(self, name_or_cron: str, cron: str | None = None, kind: str | None = None, args: Any = None, *,
                 name: str | None = None, timezone: str = "UTC", queue: str | None = None,
                 priority: int | None = None, missed: str = "coalesce", catch_up_cap: int = 100,
                 metadata: Any = None, max_attempts: int | None = None, unique: Unique | bool | None = None) -> Any:
        """Declare a periodic job, or (with only a cron) decorate a handler registered with :meth:`job`.

        ``app.periodic("report", "*/5 * * * *", "report.build", {"full": True})`` declares one;
        ``@app.periodic("*/5 * * * *", name="report")`` stacked on ``@app.job(...)`` fires the
        decorated handler's kind. Cron: five fields, six with seconds first, or ``@hourly`` etc.,
        in ``timezone`` (IANA). ``missed``: ``coalesce`` fires once for a run of missed ticks,
        ``catch_up`` each (at most ``catch_up_cap``). Schedules reach the database when a
        supervisor or worker starts.
        """
        from awa_fast import periodic as _periodic

        opts = {"timezone": timezone, "queue": queue, "priority": priority, "missed": missed,
                "catch_up_cap": catch_up_cap, "metadata": metadata, "max_attempts": max_attempts,
                "unique": unique}
        if kind is not None:
            if cron is None or name is not None:
                raise ConfigError("app.periodic(name, cron, kind, args=None, ...): give the name once")
            self._add_schedule(_periodic.declare(name_or_cron, cron, kind, args, **opts))
            return self.schedules[name_or_cron]
        if cron is not None:
            raise ConfigError("app.periodic(name, cron, kind, ...) needs the kind; as a decorator use "
                              "@app.periodic(cron, name=...)")
        expr = name_or_cron
        _periodic.normalize_cron(expr)

        def decorate(fn: F) -> F:
            kinds = [k for k, spec in self.registry.items() if spec.handler is fn]
            if len(kinds) != 1:
                raise ConfigError("@app.periodic(...) goes above @app.job(...) on the same function")
            self._add_schedule(_periodic.declare(name or kinds[0], expr, kinds[0], args, **opts))
            return fn

        return decorate

    def _add_schedule(self, schedule: Any) -> None:
        if schedule.name in self.schedules:
            raise ConfigError(f"schedule {schedule.name!r} is declared twice; names are unique")
        self.schedules[schedule.name] = schedule


__all__ = ["App", "KEEP", "check_dsn", "dsn_from_environment", "resolve_dsn", "resolve_schema"]


class _Lent:
    """One of the App pool's connections, lent for one call: ``getconn`` on enter, ``putconn`` on exit.

    ``pool.connection()`` also runs the connection's own ``with`` block, whose exit commits: a
    no-op on these autocommit connections that still cost ~15-20 µs of client CPU per call
    after a statement (caches gone cold while the call waited on the server; ``App.enqueue``
    spent ~105 µs of client CPU before, ~90 after; performance-log, 2026-12-07 pool). The
    App's calls leave no transaction open on these connections (their transactions are
    ``conn.transaction()`` blocks); ``putconn`` rolls back one left open anyway, with a
    warning, and replaces a broken connection.
    """

    __slots__ = ("_conn", "_pool")

    def __init__(self, pool: Any) -> None:
        self._pool = pool

    def __enter__(self) -> psycopg.Connection:
        self._conn = conn = self._pool.getconn()
        return conn  # type: ignore[no-any-return]

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self._pool.putconn(self._conn)


class _ALent:
    """:class:`_Lent` for the async pool: ``await getconn()`` on enter, ``await putconn()`` on exit.

    Created before the pool exists: the App's ``_apool()`` opens it on the first enter.
    """

    __slots__ = ("_app", "_conn", "_pool")

    def __init__(self, app: App) -> None:
        self._app = app

    async def __aenter__(self) -> psycopg.AsyncConnection:
        self._pool = pool = await self._app._apool()
        self._conn = conn = await pool.getconn()
        return conn  # type: ignore[no-any-return]

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        await self._pool.putconn(self._conn)


# Names used only in the in-process worker's annotations above (kept at the end of the file).
from typing import TYPE_CHECKING  # noqa: E402

if TYPE_CHECKING:
    from awa_fast.worker import QueuesArg, WorkerSummary


def _call_key(kind: str, default: str | Callable[[Any], str | None] | None, args: Any) -> str | None:
    """The kind's default concurrency key for ``args`` (a str as it is, a callable called)."""
    if not callable(default):
        return default
    try:
        return default(args)
    except Exception as exc:
        raise ConfigError(f"the concurrency_key function of kind {kind!r} raised {type(exc).__name__}: {exc}; "
                          "it is called with the job's args at enqueue and must return a str or None") from exc
