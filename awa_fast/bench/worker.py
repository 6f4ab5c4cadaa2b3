"""The bench's job, the App its supervisor runs, and the per-job trace file.

``awa-fast supervise awa_fast.bench.worker:app`` loads :data:`app`. The App
is built on first access (module ``__getattr__``), never at import: the
bench tells its supervisor where to write the trace through
:data:`TRACE_ENV`, read only when the App is built, inside that process.

The trace: an :meth:`App.on_flush` listener appends ``(job_id, started_at,
committed_at)`` per completed job, ``started_at`` taken by the claimer right
before the handler is called, ``committed_at`` right after the completion
transaction's ``COMMIT`` returned (both ``time.time()``).
"""

from __future__ import annotations

import os
import pathlib
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from awa_fast.app import App
    from awa_fast.jobs import AttemptClosed

KIND = "bench.noop"
QUEUE = "bench"
APP_REF = "awa_fast.bench.worker:app"
TRACE_ENV = "AWA_FAST_BENCH_TRACE"
_TRACE_REC = struct.Struct("<qdd")  # job_id, started_at, committed_at (time.time())
_DEFAULT_SCHEMA = "bench_drain"  # the supervisor is always given --schema; this only names the App


def noop(job: Any) -> None:
    """The bench handler does nothing: the benchmarks measure the queue."""


def trace_writer(path: str) -> Callable[[list[AttemptClosed]], None]:
    """An :meth:`App.on_flush` listener appending (job_id, started_at, committed_at) per completed job.

    One ``os.write`` per flush (an ``O_APPEND`` file per claimer process),
    after the flush's COMMIT was timed.
    """
    fds: dict[int, int] = {}
    pack = _TRACE_REC.pack

    def write(closed: list[AttemptClosed]) -> None:
        data = b"".join(pack(c.job_id, c.started_at, c.committed_at) for c in closed if c.outcome == "completed")
        if data:
            pid = os.getpid()
            fd = fds.get(pid)
            if fd is None:
                fd = fds[pid] = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            os.write(fd, data)

    return write


def read_trace(path: str | os.PathLike[str]) -> dict[int, tuple[float, float]]:
    """job_id -> (started_at, committed_at) from a trace file (first completion wins)."""
    out: dict[int, tuple[float, float]] = {}
    try:
        data = pathlib.Path(path).read_bytes()
    except FileNotFoundError:
        return out
    usable = len(data) - len(data) % _TRACE_REC.size
    for job_id, started, committed in _TRACE_REC.iter_unpack(data[:usable]):
        out.setdefault(job_id, (started, committed))
    return out


def build_app(schema: str = _DEFAULT_SCHEMA, trace: str | None = None) -> App:
    """The bench App: one no-op job kind on the ``bench`` queue; with ``trace``, the trace listener."""
    from awa_fast.app import App

    bench_app = App(schema=schema)
    bench_app.job(KIND, queue=QUEUE)(noop)
    if trace:
        bench_app.on_flush(trace_writer(trace))
    return bench_app


def client_app(dsn: str, schema: str) -> App:
    """An App for the bench's own producers (enqueue only) on ``schema``."""
    from awa_fast.app import App

    return App(dsn=dsn, schema=schema)


_built: dict[str, App] = {}


def __getattr__(name: str) -> Any:
    """``app``: the supervisor's App, built once on first access (the trace path from :data:`TRACE_ENV`)."""
    if name != "app":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if "app" not in _built:
        _built["app"] = build_app(trace=os.environ.get(TRACE_ENV) or None)
    return _built["app"]
