"""Job, queue, DLQ and callback administration: the methods of :class:`awa_fast.App` that act on jobs already enqueued.

:class:`AdminMixin` is one of ``App``'s bases; it holds no state of its own
and reaches the database through the app's ``storage`` and connection
scopes. As everywhere on ``App``, each method takes ``conn=`` to run in the
caller's transaction (without it: the app's pool, committed at once) and has
an ``_async`` twin for ``psycopg.AsyncConnection``.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import psycopg

from awa_fast.client import encode_payload, validate_name
from awa_fast.errors import ConfigError, JobNotCompleted, OutOfRange, UnknownJob
from awa_fast.limits import KEEP, Rate, check_key_max_running
from awa_fast.records import JOB_STATES, DlqEntry, JobInfo, QueueSettings, flag, int_in, seconds

if TYPE_CHECKING:
    from awa_fast.storage import Storage

JOB_ID_MAX = 2**63 - 1
LIST_LIMIT_MAX = 10_000


def _job_id(value: object, what: str = "job_id") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= JOB_ID_MAX:
        raise OutOfRange(what, value, 1, JOB_ID_MAX)
    return value


def _ids(job_ids: Iterable[int] | None) -> list[int] | None:
    return None if job_ids is None else [_job_id(j) for j in job_ids]


def _token(token: object) -> uuid.UUID | None:
    if isinstance(token, uuid.UUID):
        return token
    try:
        return uuid.UUID(str(token))
    except ValueError:
        return None

class AdminMixin:
    """Jobs (get, list, cancel, retry, wait, result), queues (configure, settings, pause, resume, counts),
    the DLQ (list, retry, purge) and callbacks (complete, fail, retry, resume by token)."""

    if TYPE_CHECKING:  # provided by awa_fast.App
        storage: Storage

        def _conn_scope(
            self, conn: psycopg.Connection | None
        ) -> contextlib.AbstractContextManager[psycopg.Connection]: ...

        def _aconn_scope(
            self, conn: psycopg.AsyncConnection | None
        ) -> contextlib.AbstractAsyncContextManager[psycopg.AsyncConnection]: ...

    # -- jobs -----------------------------------------------------------------------------

    def get_job(self, job_id: int, *, conn: psycopg.Connection | None = None) -> JobInfo | None:
        """The job wherever it lives now, or None if it never existed (or its history was pruned)."""
        jid = _job_id(job_id)
        with self._conn_scope(conn) as c:
            row = self.storage.job_load_many(c, [jid])[0]
        return None if row is None else JobInfo.from_row(row)

    async def get_job_async(self, job_id: int, *, conn: psycopg.AsyncConnection | None = None) -> JobInfo | None:
        """Async twin of :meth:`get_job`."""
        jid = _job_id(job_id)
        async with self._aconn_scope(conn) as c:
            row = (await self.storage.job_load_many_async(c, [jid]))[0]
        return None if row is None else JobInfo.from_row(row)

    @staticmethod
    def _list_args(queue: str | None, kind: str | None, state: str | None, limit: int,
                   before_id: int | None) -> dict[str, Any]:
        if queue is not None:
            validate_name("queue", queue)
        if kind is not None:
            validate_name("kind", kind)
        if state is not None and state not in JOB_STATES:
            raise ConfigError(f"state={state!r} is not a job state; use one of: {', '.join(JOB_STATES)}")
        return {"queue": queue, "kind": kind, "state": state, "limit": int_in("limit", limit, 1, LIST_LIMIT_MAX),
                "before_id": None if before_id is None else _job_id(before_id, "before_id")}

    def list_jobs(self, queue: str | None = None, kind: str | None = None, state: str | None = None,
                  limit: int = 100, before_id: int | None = None, *,
                  conn: psycopg.Connection | None = None) -> list[JobInfo]:
        """Jobs newest id first, optionally of one queue, kind and state (one of :data:`JOB_STATES`).

        Page with ``before_id=`` the last id of the previous page. Ids order
        jobs within a lane; across lanes and for scheduled jobs they are not
        a strict time order. Terminal jobs are listed while their history lives.
        """
        kw = self._list_args(queue, kind, state, limit, before_id)
        with self._conn_scope(conn) as c:
            return [JobInfo.from_row(r) for r in self.storage.job_list(c, **kw)]

    async def list_jobs_async(self, queue: str | None = None, kind: str | None = None, state: str | None = None,
                              limit: int = 100, before_id: int | None = None, *,
                              conn: psycopg.AsyncConnection | None = None) -> list[JobInfo]:
        """Async twin of :meth:`list_jobs`."""
        kw = self._list_args(queue, kind, state, limit, before_id)
        async with self._aconn_scope(conn) as c:
            return [JobInfo.from_row(r) for r in await self.storage.job_list_async(c, **kw)]

    def cancel(self, job_id: int, *, conn: psycopg.Connection | None = None) -> bool:
        """Cancel a job: True when it was cancelled, or (running) its handler was asked to stop.

        False when it is already terminal or unknown.
        """
        jid = _job_id(job_id)
        with self._conn_scope(conn) as c:
            return self.storage.job_cancel(c, jid) in ("cancelled", "cancel_requested")

    async def cancel_async(self, job_id: int, *, conn: psycopg.AsyncConnection | None = None) -> bool:
        """Async twin of :meth:`cancel`."""
        jid = _job_id(job_id)
        async with self._aconn_scope(conn) as c:
            return await self.storage.job_cancel_async(c, jid) in ("cancelled", "cancel_requested")

    def retry(self, job_id: int, *, conn: psycopg.Connection | None = None) -> bool:
        """Run a job again now: a DLQ job goes back to ready with fresh attempts, a scheduled,
        retryable or snoozed one becomes due. False for any other state (or an unknown job)."""
        jid = _job_id(job_id)
        with self._conn_scope(conn) as c:
            return self.storage.job_retry(c, jid) is not None

    async def retry_async(self, job_id: int, *, conn: psycopg.AsyncConnection | None = None) -> bool:
        """Async twin of :meth:`retry`."""
        jid = _job_id(job_id)
        async with self._aconn_scope(conn) as c:
            return await self.storage.job_retry_async(c, jid) is not None

    @staticmethod
    def _wait_timeout(timeout: float | None) -> float | None:
        return None if timeout is None else seconds("timeout", timeout, low=0.0)

    @staticmethod
    def _timed_out(job_id: int, info: JobInfo, timeout: float | None) -> TimeoutError:
        return TimeoutError(f"job {job_id} is still {info.state} (attempt {info.attempt}) after {timeout} s; "
                            "wait longer, or check that a worker serves its queue "
                            f"{info.queue!r} (`awa-fast status`)")

    def wait(self, job_id: int, timeout: float | None = None, *, conn: psycopg.Connection | None = None,
             poll_interval: float = 0.5) -> JobInfo:
        """Block until the job is terminal (completed, failed, cancelled, dlq) and return it.

        Polls with a backoff from 10 ms up to ``poll_interval``. Raises
        :class:`TimeoutError` after ``timeout`` seconds and
        :class:`UnknownJob` if the job does not exist (an enqueue not yet
        committed is not visible to other connections). With ``conn=``, each
        poll runs on that connection: under READ COMMITTED it sees every new
        commit, inside a REPEATABLE READ transaction it never would.
        """
        jid = _job_id(job_id)
        limit = self._wait_timeout(timeout)
        deadline = None if limit is None else time.monotonic() + limit
        delay = 0.01
        while True:
            info = self.get_job(jid, conn=conn)
            if info is None:
                raise UnknownJob(jid)
            if info.terminal:
                return info
            if deadline is not None and time.monotonic() >= deadline:
                raise self._timed_out(jid, info, timeout)
            pause = delay if deadline is None else min(delay, max(deadline - time.monotonic(), 0.0))
            time.sleep(pause)
            delay = min(delay * 2, poll_interval)

    async def wait_async(self, job_id: int, timeout: float | None = None, *,
                         conn: psycopg.AsyncConnection | None = None, poll_interval: float = 0.5) -> JobInfo:
        """Async twin of :meth:`wait`."""
        jid = _job_id(job_id)
        limit = self._wait_timeout(timeout)
        loop = asyncio.get_running_loop()
        deadline = None if limit is None else loop.time() + limit
        delay = 0.01
        while True:
            info = await self.get_job_async(jid, conn=conn)
            if info is None:
                raise UnknownJob(jid)
            if info.terminal:
                return info
            if deadline is not None and loop.time() >= deadline:
                raise self._timed_out(jid, info, timeout)
            pause = delay if deadline is None else min(delay, max(deadline - loop.time(), 0.0))
            await asyncio.sleep(pause)
            delay = min(delay * 2, poll_interval)

    @staticmethod
    def _result_of(job_id: int, info: JobInfo | None) -> Any:
        if info is None:
            raise UnknownJob(job_id)
        if info.state != "completed":
            raise JobNotCompleted(job_id, info.state, info.error)
        return info.result

    def result(self, job_id: int, *, conn: psycopg.Connection | None = None) -> Any:
        """The completed job's stored result.

        Raises :class:`JobNotCompleted` (with its state) for a job that has
        not completed and :class:`UnknownJob` for an unknown one (or one whose
        history passed its queue's ``history_retention``). A handler that
        returned None leaves None.
        """
        jid = _job_id(job_id)
        return self._result_of(jid, self.get_job(jid, conn=conn))

    async def result_async(self, job_id: int, *, conn: psycopg.AsyncConnection | None = None) -> Any:
        """Async twin of :meth:`result`."""
        jid = _job_id(job_id)
        return self._result_of(jid, await self.get_job_async(jid, conn=conn))

    # -- queues -------------------------------------------------------------------------

    def _settings_args(self, name: str, deadline: Any, heartbeat_timeout: Any, dlq: Any, dlq_retention: Any,
                       aging_interval: Any, enqueue_shards: Any, history_retention: Any) -> dict[str, Any]:
        validate_name("queue", name)
        kw: dict[str, Any] = {
            "deadline": (False if deadline is KEEP
                         else None if deadline in (None, 0) else seconds("deadline", deadline)),
            "heartbeat_timeout": None if heartbeat_timeout is None else seconds("heartbeat_timeout", heartbeat_timeout),
            "dlq_enabled": None if dlq is None else flag("dlq", dlq),
            "dlq_retention": None if dlq_retention is None else seconds("dlq_retention", dlq_retention),
            "aging_interval": None if aging_interval is None else seconds("aging_interval", aging_interval),
            "enqueue_shards": None if enqueue_shards is None else int_in("enqueue_shards", enqueue_shards, 1, 64),
        }
        if history_retention is not None:
            kw["history_retention"] = seconds("history_retention", history_retention, low=1.0)
        return kw

    def configure_queue(self, name: str, *, deadline: float | None = KEEP, heartbeat_timeout: float | None = None,
                        dlq: bool | None = None, dlq_retention: float | None = None,
                        aging_interval: float | None = None, enqueue_shards: int | None = None,
                        history_retention: float | None = None, max_running: int | None = KEEP,
                        max_rate: Rate | None = KEEP, key_max_running: int | None = KEEP,
                        conn: psycopg.Connection | None = None) -> QueueSettings:
        """Create or change a queue's settings; returns them as stored.

        Durations are seconds. An argument left out keeps its value;
        ``deadline=None`` (or 0) removes the per-attempt deadline.
        ``history_retention`` (seconds) is how long the queue's terminal jobs
        stay visible to :meth:`get_job` at least; the ready ring rotates so
        that the longest retention of any queue holds (see docs/storage.md
        for the disk cost). ``max_running`` (jobs running at once over every
        worker) and ``max_rate`` (:class:`awa_fast.Rate`) are enforced in the
        claim, fleet-wide; None removes a limit (docs/flow-control.md).
        ``key_max_running``: at most this many jobs of one ``concurrency_key`` run at once
        (None removes it and lets the jobs waiting on a key run).
        """
        kw = self._settings_args(name, deadline, heartbeat_timeout, dlq, dlq_retention, aging_interval,
                                 enqueue_shards, history_retention)
        if key_max_running is not KEEP:
            check_key_max_running(key_max_running)
        with self._conn_scope(conn) as c, (c.transaction() if c.autocommit else contextlib.nullcontext()):
            self.storage.queue_configure(c, name, **kw)
            if max_running is not KEEP or max_rate is not KEEP:
                self.storage.queue_limits_set(c, name, max_running=max_running, max_rate=max_rate)
            if key_max_running is not KEEP:
                self.storage.queue_key_limit_set(c, name, key_max_running)
            return QueueSettings.from_row(self.storage.queue_settings(c, name)[0])

    async def configure_queue_async(self, name: str, *, deadline: float | None = KEEP,
                                    heartbeat_timeout: float | None = None, dlq: bool | None = None,
                                    dlq_retention: float | None = None, aging_interval: float | None = None,
                                    enqueue_shards: int | None = None, history_retention: float | None = None,
                                    max_running: int | None = KEEP, max_rate: Rate | None = KEEP,
                                    key_max_running: int | None = KEEP,
                                    conn: psycopg.AsyncConnection | None = None) -> QueueSettings:
        """Async twin of :meth:`configure_queue`."""
        kw = self._settings_args(name, deadline, heartbeat_timeout, dlq, dlq_retention, aging_interval,
                                 enqueue_shards, history_retention)
        if key_max_running is not KEEP:
            check_key_max_running(key_max_running)
        async with self._aconn_scope(conn) as c, (c.transaction() if c.autocommit else contextlib.nullcontext()):
            await self.storage.queue_configure_async(c, name, **kw)
            if max_running is not KEEP or max_rate is not KEEP:
                await self.storage.queue_limits_set_async(c, name, max_running=max_running, max_rate=max_rate)
            if key_max_running is not KEEP:
                await self.storage.queue_key_limit_set_async(c, name, key_max_running)
            return QueueSettings.from_row((await self.storage.queue_settings_async(c, name))[0])

    @staticmethod
    def _one_queue(name: str, rows: list[dict[str, Any]]) -> QueueSettings:
        if not rows:
            raise ConfigError(f"no queue {name!r}: it is created by its first enqueue or by app.configure_queue")
        return QueueSettings.from_row(rows[0])

    def queue_settings(self, name: str, *, conn: psycopg.Connection | None = None) -> QueueSettings:
        """A queue's settings; :class:`ConfigError` if the queue does not exist."""
        validate_name("queue", name)
        with self._conn_scope(conn) as c:
            return self._one_queue(name, self.storage.queue_settings(c, name))

    async def queue_settings_async(self, name: str, *,
                                   conn: psycopg.AsyncConnection | None = None) -> QueueSettings:
        """Async twin of :meth:`queue_settings`."""
        validate_name("queue", name)
        async with self._aconn_scope(conn) as c:
            return self._one_queue(name, await self.storage.queue_settings_async(c, name))

    def list_queues(self, *, conn: psycopg.Connection | None = None) -> list[QueueSettings]:
        """Settings of every queue, by name."""
        with self._conn_scope(conn) as c:
            return [QueueSettings.from_row(r) for r in self.storage.queue_settings(c, None)]

    async def list_queues_async(self, *, conn: psycopg.AsyncConnection | None = None) -> list[QueueSettings]:
        """Async twin of :meth:`list_queues`."""
        async with self._aconn_scope(conn) as c:
            return [QueueSettings.from_row(r) for r in await self.storage.queue_settings_async(c, None)]

    def pause(self, name: str, *, conn: psycopg.Connection | None = None) -> bool:
        """Stop claims on a queue (running jobs finish); False if there is no such queue."""
        validate_name("queue", name)
        with self._conn_scope(conn) as c:
            return self.storage.queue_pause(c, name, True)

    async def pause_async(self, name: str, *, conn: psycopg.AsyncConnection | None = None) -> bool:
        """Async twin of :meth:`pause`."""
        validate_name("queue", name)
        async with self._aconn_scope(conn) as c:
            return await self.storage.queue_pause_async(c, name, True)

    def resume(self, name: str, *, conn: psycopg.Connection | None = None) -> bool:
        """Let claims on a paused queue start again; False if there is no such queue."""
        validate_name("queue", name)
        with self._conn_scope(conn) as c:
            return self.storage.queue_pause(c, name, False)

    async def resume_async(self, name: str, *, conn: psycopg.AsyncConnection | None = None) -> bool:
        """Async twin of :meth:`resume`."""
        validate_name("queue", name)
        async with self._aconn_scope(conn) as c:
            return await self.storage.queue_pause_async(c, name, False)

    @staticmethod
    def _counts_of(queue: str | None, counts: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
        states = ("available", "running", "waiting", "scheduled", "retryable", "snoozed", "completed",
                  "failed", "cancelled", "dlq")
        picked = counts if queue is None else {queue: counts.get(queue, {})}
        return {q: {s: by_state.get(s, 0) for s in states} for q, by_state in sorted(picked.items())}

    def counts(self, queue: str | None = None, *, conn: psycopg.Connection | None = None) -> dict[str, dict[str, int]]:
        """Exact job counts per queue and state (every state present, zeros included).

        ``waiting`` counts jobs parked for a callback. It scans the live
        rings: an admin read, not something to call in a hot loop.
        """
        if queue is not None:
            validate_name("queue", queue)
        with self._conn_scope(conn) as c:
            return self._counts_of(queue, self.storage.queue_counts_exact(c))

    async def counts_async(self, queue: str | None = None, *,
                           conn: psycopg.AsyncConnection | None = None) -> dict[str, dict[str, int]]:
        """Async twin of :meth:`counts`."""
        if queue is not None:
            validate_name("queue", queue)
        async with self._aconn_scope(conn) as c:
            return self._counts_of(queue, await self.storage.queue_counts_exact_async(c))

    # -- DLQ ------------------------------------------------------------------------------

    @staticmethod
    def _dlq_filter(job_ids: Iterable[int] | None, queue: str | None, what: str) -> tuple[list[int] | None, str | None]:
        ids = _ids(job_ids)
        if queue is not None:
            validate_name("queue", queue)
        if ids is None and queue is None:
            raise ConfigError(f"dlq_{what}: give job_ids=, queue= or both (both: entries matching both)")
        return ids, queue

    def dlq_list(self, queue: str | None = None, limit: int = 100, *,
                 conn: psycopg.Connection | None = None) -> list[DlqEntry]:
        """Dead-lettered jobs, newest first (of one queue, or all)."""
        if queue is not None:
            validate_name("queue", queue)
        n = int_in("limit", limit, 1, LIST_LIMIT_MAX)
        with self._conn_scope(conn) as c:
            return [DlqEntry.from_row(r) for r in self.storage.dlq_select(c, None, queue, n)]

    async def dlq_list_async(self, queue: str | None = None, limit: int = 100, *,
                             conn: psycopg.AsyncConnection | None = None) -> list[DlqEntry]:
        """Async twin of :meth:`dlq_list`."""
        if queue is not None:
            validate_name("queue", queue)
        n = int_in("limit", limit, 1, LIST_LIMIT_MAX)
        async with self._aconn_scope(conn) as c:
            return [DlqEntry.from_row(r) for r in await self.storage.dlq_select_async(c, None, queue, n)]

    def dlq_retry(self, job_ids: Iterable[int] | None = None, queue: str | None = None, *,
                  conn: psycopg.Connection | None = None) -> list[int]:
        """Move DLQ entries (these ids, this queue, or both filters at once) back to ready with fresh
        attempts; returns the ids moved."""
        ids, q = self._dlq_filter(job_ids, queue, "retry")
        with self._conn_scope(conn) as c:
            return self.storage.dlq_retry_where(c, ids, q)

    async def dlq_retry_async(self, job_ids: Iterable[int] | None = None, queue: str | None = None, *,
                              conn: psycopg.AsyncConnection | None = None) -> list[int]:
        """Async twin of :meth:`dlq_retry`."""
        ids, q = self._dlq_filter(job_ids, queue, "retry")
        async with self._aconn_scope(conn) as c:
            return await self.storage.dlq_retry_where_async(c, ids, q)

    def dlq_purge(self, job_ids: Iterable[int] | None = None, queue: str | None = None, *,
                  conn: psycopg.Connection | None = None) -> list[int]:
        """Delete DLQ entries for good (these ids, this queue, or both filters at once); returns their ids."""
        ids, q = self._dlq_filter(job_ids, queue, "purge")
        with self._conn_scope(conn) as c:
            return self.storage.dlq_purge_where(c, ids, q)

    async def dlq_purge_async(self, job_ids: Iterable[int] | None = None, queue: str | None = None, *,
                              conn: psycopg.AsyncConnection | None = None) -> list[int]:
        """Async twin of :meth:`dlq_purge`."""
        ids, q = self._dlq_filter(job_ids, queue, "purge")
        async with self._aconn_scope(conn) as c:
            return await self.storage.dlq_purge_where_async(c, ids, q)

    # -- callbacks ------------------------------------------------------------------------

    def complete_callback(self, token: str | uuid.UUID, *, conn: psycopg.Connection | None = None) -> bool:
        """Complete a job parked with ``WaitForCallback``; False if the token is unknown, resolved or not a UUID."""
        return self._resolve(token, "complete", None, None, conn)

    def fail_callback(self, token: str | uuid.UUID, error: str = "failed by callback", *,
                      conn: psycopg.Connection | None = None) -> bool:
        """Fail a parked job terminally (to the DLQ when the queue has one)."""
        return self._resolve(token, "fail", None, error, conn)

    def retry_callback(self, token: str | uuid.UUID, error: str = "retried by callback", *,
                       conn: psycopg.Connection | None = None) -> bool:
        """Retry a parked job with backoff (consumes the attempt)."""
        return self._resolve(token, "retry", None, error, conn)

    def resume_callback(self, token: str | uuid.UUID, result: Any = None, *,
                        conn: psycopg.Connection | None = None) -> bool:
        """Run a parked job again with ``job.callback_result = result`` (no attempt consumed)."""
        return self._resolve(token, "resume", encode_payload(result, "callback result"), None, conn)

    async def complete_callback_async(self, token: str | uuid.UUID, *,
                                      conn: psycopg.AsyncConnection | None = None) -> bool:
        """Async twin of :meth:`complete_callback`."""
        return await self._resolve_async(token, "complete", None, None, conn)

    async def fail_callback_async(self, token: str | uuid.UUID, error: str = "failed by callback", *,
                                  conn: psycopg.AsyncConnection | None = None) -> bool:
        """Async twin of :meth:`fail_callback`."""
        return await self._resolve_async(token, "fail", None, error, conn)

    async def retry_callback_async(self, token: str | uuid.UUID, error: str = "retried by callback", *,
                                   conn: psycopg.AsyncConnection | None = None) -> bool:
        """Async twin of :meth:`retry_callback`."""
        return await self._resolve_async(token, "retry", None, error, conn)

    async def resume_callback_async(self, token: str | uuid.UUID, result: Any = None, *,
                                    conn: psycopg.AsyncConnection | None = None) -> bool:
        """Async twin of :meth:`resume_callback`."""
        return await self._resolve_async(token, "resume", encode_payload(result, "callback result"), None, conn)

    def _resolve(self, token: str | uuid.UUID, action: str, payload: Any, error: str | None,
                 conn: psycopg.Connection | None) -> bool:
        tok = _token(token)
        if tok is None:  # never sent: a bad cast would abort the caller's transaction
            return False
        with self._conn_scope(conn) as c:
            return self.storage.callback_resolve(c, tok, action, payload, error) == "ok"

    async def _resolve_async(self, token: str | uuid.UUID, action: str, payload: Any, error: str | None,
                             conn: psycopg.AsyncConnection | None) -> bool:
        tok = _token(token)
        if tok is None:
            return False
        async with self._aconn_scope(conn) as c:
            return await self.storage.callback_resolve_async(c, tok, action, payload, error) == "ok"



__all__ = ["AdminMixin"]
