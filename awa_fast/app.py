"""The application object users write against: handlers, enqueue, callbacks."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, TypeVar

import psycopg

from awa_fast.client import (
    PRIORITY_DEFAULT,
    Client,
    encode_payload,
    validate_max_attempts,
    validate_name,
    validate_priority,
)
from awa_fast.errors import ConfigError
from awa_fast.jobs import AttemptClosed, JobSpec
from awa_fast.storage import connect
from awa_fast.unique import Unique

F = TypeVar("F", bound=Callable[..., Any])


class App(Client):
    """An awa-fast application: a handler registry plus enqueue and callback APIs.

    ``App(dsn=None)`` uses the embedded PostgreSQL server (started on first
    use under ``$AWA_FAST_HOME``). Register handlers with :meth:`job`, run
    them with ``awa-fast supervise module:app``.
    """

    def __init__(self, dsn: str | None = None, schema: str = "awa_fast", *, default_queue: str = "default",
                 max_payload_bytes: int = 1 << 20) -> None:
        super().__init__(dsn, schema, default_queue=default_queue, max_payload_bytes=max_payload_bytes)
        self.registry: dict[str, JobSpec] = {}
        self.flush_listeners: list[Callable[[list[AttemptClosed]], None]] = []

    # -- handlers ---------------------------------------------------------------

    def job(self, kind: str, *, queue: str | None = None, priority: int = PRIORITY_DEFAULT,
            max_attempts: int = 25, args_type: type | None = None, unique: Unique | bool | None = None) -> Callable[[F], F]:
        """Register ``def handler(job)`` or ``async def handler(job)`` for ``kind``.

        ``args_type`` (a ``msgspec.Struct``) makes ``job.args`` a typed object.
        ``unique=awa_fast.Unique(...)`` makes every enqueue of the kind unique by default.
        """
        validate_name("kind", kind)
        q = validate_name("queue", queue if queue is not None else self.default_queue)
        validate_priority(priority)
        validate_max_attempts(max_attempts)
        self._unique_default(kind, unique)

        def register(fn: F) -> F:
            if kind in self.registry:
                raise ConfigError(f"kind {kind!r} is registered twice; each kind has one handler")
            self.registry[kind] = JobSpec(kind, fn, q, priority, max_attempts,
                                          inspect.iscoroutinefunction(fn), args_type)
            return fn

        return register

    def on_flush(self, fn: Callable[[list[AttemptClosed]], None]) -> Callable[[list[AttemptClosed]], None]:
        """Register ``fn(closed)``, called in each claimer process after every completion flush commits.

        ``closed`` lists the flush's attempts as :class:`AttemptClosed`. It
        runs on the batcher's thread, so keep it short; an exception it
        raises is logged and never affects the queue. Register at import
        time of the app module (claimer processes load the app themselves).
        """
        self.flush_listeners.append(fn)
        return fn

    def queues(self) -> list[str]:
        """Queues that registered handlers use."""
        return sorted({spec.queue for spec in self.registry.values()})

    # -- enqueue (registry defaults) --------------------------------------------

    def _defaults(self, kind: str, queue: str | None, priority: int | None,
                  max_attempts: int | None) -> tuple[str | None, int | None, int | None]:
        spec = self.registry.get(kind)
        if spec is None:
            return queue, priority, max_attempts
        return (queue if queue is not None else spec.queue,
                priority if priority is not None else spec.priority,
                max_attempts if max_attempts is not None else spec.max_attempts)

    def enqueue(self, kind: str, args: Any = None, *, queue: str | None = None, priority: int | None = None,
                max_attempts: int | None = None, metadata: Any = None, run_at: Any = None,
                delay: float | None = None, conn: psycopg.Connection | None = None, unique: Unique | bool | None = None) -> int:
        """Enqueue one job (defaults from the kind's registration); returns its id."""
        queue, priority, max_attempts = self._defaults(kind, queue, priority, max_attempts)
        return super().enqueue(kind, args, queue=queue, priority=priority, max_attempts=max_attempts,
                               metadata=metadata, run_at=run_at, delay=delay, conn=conn,
                               unique=self._unique_for(kind, unique))

    async def enqueue_async(self, kind: str, args: Any = None, *, conn: psycopg.AsyncConnection,
                            queue: str | None = None, priority: int | None = None,
                            max_attempts: int | None = None, metadata: Any = None, run_at: Any = None,
                            delay: float | None = None, unique: Unique | bool | None = None) -> int:
        """Enqueue one job on an async connection, inside its transaction."""
        queue, priority, max_attempts = self._defaults(kind, queue, priority, max_attempts)
        return await super().enqueue_async(kind, args, conn=conn, queue=queue, priority=priority,
                                           max_attempts=max_attempts, metadata=metadata, run_at=run_at,
                                           delay=delay, unique=self._unique_for(kind, unique))

    def enqueue_many(self, kind: str, args_list: Any, *, queue: str | None = None, priority: int | None = None,
                     max_attempts: int | None = None, metadata: Any = None,
                     conn: psycopg.Connection | None = None, chunk: int = 50_000, progress: Any = None,
                     unique: Unique | bool | None = None) -> int:
        """Bulk-enqueue by binary COPY (defaults from the kind's registration)."""
        queue, priority, max_attempts = self._defaults(kind, queue, priority, max_attempts)
        return super().enqueue_many(kind, args_list, queue=queue, priority=priority, max_attempts=max_attempts,
                                    metadata=metadata, conn=conn, chunk=chunk, progress=progress,
                                    unique=self._unique_for(kind, unique))

    async def enqueue_many_async(self, kind: str, args_list: Any, *, conn: psycopg.AsyncConnection,
                                 queue: str | None = None, priority: int | None = None,
                                 max_attempts: int | None = None, metadata: Any = None, chunk: int = 50_000,
                                 progress: Any = None, unique: Unique | bool | None = None) -> int:
        """Async bulk enqueue by binary COPY (defaults from the kind's registration)."""
        queue, priority, max_attempts = self._defaults(kind, queue, priority, max_attempts)
        return await super().enqueue_many_async(kind, args_list, conn=conn, queue=queue, priority=priority,
                                                max_attempts=max_attempts, metadata=metadata, chunk=chunk,
                                                progress=progress, unique=self._unique_for(kind, unique))

    # -- callbacks ----------------------------------------------------------------

    def complete_callback(self, token: str, *, conn: psycopg.Connection | None = None) -> bool:
        """Complete a job parked with ``WaitForCallback``; False if the token is unknown or resolved."""
        return self._resolve(token, "complete", None, None, conn)

    def fail_callback(self, token: str, error: str = "failed by callback", *,
                      conn: psycopg.Connection | None = None) -> bool:
        """Fail a parked job terminally (to the DLQ when the queue has one)."""
        return self._resolve(token, "fail", None, error, conn)

    def retry_callback(self, token: str, error: str = "retried by callback", *,
                       conn: psycopg.Connection | None = None) -> bool:
        """Retry a parked job with backoff (consumes the attempt)."""
        return self._resolve(token, "retry", None, error, conn)

    def resume_callback(self, token: str, result: Any = None, *, conn: psycopg.Connection | None = None) -> bool:
        """Run a parked job again with ``job.callback_result = result`` (no attempt consumed)."""
        return self._resolve(token, "resume", encode_payload(result, "callback result"), None, conn)

    def _resolve(self, token: str, action: str, payload: Any, error: str | None,
                 conn: psycopg.Connection | None) -> bool:
        target = conn if conn is not None else self._own_conn()
        return self.storage.callback_resolve(target, token, action, payload, error) == "ok"

    # -- connections ----------------------------------------------------------------

    def resolve_dsn(self) -> str:
        """The DSN in use; starts the embedded server when none was given."""
        if self.dsn is None:
            from awa_fast.embedded import ensure_embedded

            self.dsn = ensure_embedded()
        return self.dsn

    def _own_conn(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed:
            self._conn = connect(self.resolve_dsn(), application_name="awa_fast:client")
        return self._conn

    def migrate(self) -> None:
        """Install or upgrade the schema (idempotent)."""
        from awa_fast.storage.migrate import migrate

        migrate(self.resolve_dsn(), self.storage.schema)

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
            self._add_schedule(_periodic.declare(name_or_cron, cron, kind, args, **opts))  # type: ignore[arg-type]
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
            self._add_schedule(_periodic.declare(name or kinds[0], expr, kinds[0], args, **opts))  # type: ignore[arg-type]
            return fn

        return decorate

    def _add_schedule(self, schedule: Any) -> None:
        if schedule.name in self.schedules:
            raise ConfigError(f"schedule {schedule.name!r} is declared twice; names are unique")
        self.schedules[schedule.name] = schedule
