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
            max_attempts: int = 25, args_type: type | None = None) -> Callable[[F], F]:
        """Register ``def handler(job)`` or ``async def handler(job)`` for ``kind``.

        ``args_type`` (a ``msgspec.Struct``) makes ``job.args`` a typed object.
        """
        validate_name("kind", kind)
        q = validate_name("queue", queue if queue is not None else self.default_queue)
        validate_priority(priority)
        validate_max_attempts(max_attempts)

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
                delay: float | None = None, conn: psycopg.Connection | None = None) -> int:
        """Enqueue one job (defaults from the kind's registration); returns its id."""
        queue, priority, max_attempts = self._defaults(kind, queue, priority, max_attempts)
        return super().enqueue(kind, args, queue=queue, priority=priority, max_attempts=max_attempts,
                               metadata=metadata, run_at=run_at, delay=delay, conn=conn)

    async def enqueue_async(self, kind: str, args: Any = None, *, conn: psycopg.AsyncConnection,
                            queue: str | None = None, priority: int | None = None,
                            max_attempts: int | None = None, metadata: Any = None, run_at: Any = None,
                            delay: float | None = None) -> int:
        """Enqueue one job on an async connection, inside its transaction."""
        queue, priority, max_attempts = self._defaults(kind, queue, priority, max_attempts)
        return await super().enqueue_async(kind, args, conn=conn, queue=queue, priority=priority,
                                           max_attempts=max_attempts, metadata=metadata, run_at=run_at,
                                           delay=delay)

    def enqueue_many(self, kind: str, args_list: Any, *, queue: str | None = None, priority: int | None = None,
                     max_attempts: int | None = None, metadata: Any = None,
                     conn: psycopg.Connection | None = None, chunk: int = 50_000, progress: Any = None) -> int:
        """Bulk-enqueue by binary COPY (defaults from the kind's registration)."""
        queue, priority, max_attempts = self._defaults(kind, queue, priority, max_attempts)
        return super().enqueue_many(kind, args_list, queue=queue, priority=priority, max_attempts=max_attempts,
                                    metadata=metadata, conn=conn, chunk=chunk, progress=progress)

    async def enqueue_many_async(self, kind: str, args_list: Any, *, conn: psycopg.AsyncConnection,
                                 queue: str | None = None, priority: int | None = None,
                                 max_attempts: int | None = None, metadata: Any = None, chunk: int = 50_000,
                                 progress: Any = None) -> int:
        """Async bulk enqueue by binary COPY (defaults from the kind's registration)."""
        queue, priority, max_attempts = self._defaults(kind, queue, priority, max_attempts)
        return await super().enqueue_many_async(kind, args_list, conn=conn, queue=queue, priority=priority,
                                                max_attempts=max_attempts, metadata=metadata, chunk=chunk,
                                                progress=progress)

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


# Names used only in the in-process worker's annotations above (kept at the end of the file).
from typing import TYPE_CHECKING  # noqa: E402

if TYPE_CHECKING:
    from awa_fast.worker import QueuesArg, WorkerSummary
