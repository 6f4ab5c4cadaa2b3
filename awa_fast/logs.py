"""Structured logs: one JSON object per line, and the running job's context on every log line.

``awa-fast --log-format json`` (or ``AWA_FAST_LOG_FORMAT=json``) makes the
CLI log through :class:`JsonFormatter`: one object per line with ``ts``,
``level``, ``logger``, ``message``, ``pid``, every ``extra=`` field the
record carries (``action``, ``job_id``, ``queue``, ``run_lease`` ...) and,
while a handler runs, the job's ``job_id``, ``kind``, ``queue`` and
``attempt``. The job is held in a :class:`contextvars.ContextVar` set
around each handler call, so a handler's own ``logging`` calls carry its
job id as well (``async def`` handlers included: each runs in its own
task context).

The library itself never configures logging. Your own configuration wins:
under ``supervise`` an app module that configures the root logger when
imported (``logging.basicConfig(...)``, ``dictConfig``) keeps its handlers
and the CLI adds none. To put the job context in your own format, call
:func:`enable_job_context` and add :class:`JobContextFilter` to your
handler (it sets ``record.job_id``, ``kind``, ``queue`` and ``attempt``,
None outside a handler), or read :func:`current_job`.
"""

from __future__ import annotations

import contextvars
import datetime as _dt
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import orjson

from awa_fast import hooks

FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"

_job: contextvars.ContextVar[Any] = contextvars.ContextVar("awa_fast_job", default=None)

# Attributes every LogRecord has: anything else on a record came from extra=.
_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime", "taskName"}


def current_job() -> Any:
    """The :class:`awa_fast.Job` whose handler runs in this thread or task, else None
    (needs :func:`enable_job_context`, which ``--log-format json`` turns on)."""
    return _job.get()


@contextmanager
def job_scope(job: Any) -> Iterator[None]:
    """Make ``job`` the current job of this thread or task for the duration of the block."""
    token = _job.set(job)
    try:
        yield
    finally:
        _job.reset(token)


def enable_job_context() -> None:
    """Set the current job around every handler call in this process (off by default: it costs a
    context-variable set and reset per attempt)."""
    hooks.install("logs", job_scope)


def disable_job_context() -> None:
    """Stop setting the current job around handler calls."""
    hooks.uninstall("logs")


def job_fields(job: Any) -> dict[str, Any]:
    """The fields a log line carries for ``job``."""
    return {"job_id": job.id, "kind": job.kind, "queue": job.queue, "attempt": job.attempt}


class JobContextFilter(logging.Filter):
    """Adds ``job_id``, ``kind``, ``queue`` and ``attempt`` of the running job to each record
    (None outside a handler; a value the record already has from ``extra=`` is kept)."""

    def filter(self, record: logging.LogRecord) -> bool:
        job = _job.get()
        fields = job_fields(job) if job is not None else dict.fromkeys(("job_id", "kind", "queue", "attempt"))
        for key, value in fields.items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record (orjson), on one line; see the module docstring for the fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": _dt.datetime.fromtimestamp(record.created, _dt.UTC).isoformat(timespec="microseconds"),
            "level": record.levelname, "logger": record.name, "message": record.getMessage(),
            "pid": record.process,
        }
        if record.threadName and record.threadName != "MainThread":
            out["thread"] = record.threadName
        for key, value in record.__dict__.items():
            if key not in _STANDARD and key not in out and not key.startswith("_"):
                out[key] = value
        job = _job.get()
        if job is not None:
            for key, value in job_fields(job).items():
                out.setdefault(key, value)
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack_info"] = self.formatStack(record.stack_info)
        return orjson.dumps(out, default=str, option=orjson.OPT_NON_STR_KEYS).decode()


def format_arg(text: str) -> str:
    """``--log-format`` / ``AWA_FAST_LOG_FORMAT`` for argparse: ``text`` or ``json``."""
    import argparse

    if text.lower() not in FORMATS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a log format; use text or json")
    return text.lower()


class _CliHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The handler the CLI installs on the root logger (told apart from a user's own)."""


def configure(level: str = "INFO", fmt: str = "text", stream: Any = None) -> None:
    """What the CLI does: log to stderr at ``level`` as ``text`` or ``json``, unless the root
    logger already has handlers (someone configured logging: theirs stays)."""
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r}: use one of {', '.join(FORMATS)}")
    root = logging.getLogger()
    if fmt == "json":
        enable_job_context()
    if root.handlers:
        return
    handler = _CliHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper(), logging.INFO))


@contextmanager
def user_config_window() -> Iterator[None]:
    """Import the user's app module inside this block: the CLI's handler steps aside, and comes
    back only if the module configured no root handler of its own (its configuration wins)."""
    root = logging.getLogger()
    ours = [h for h in root.handlers if isinstance(h, _CliHandler)]
    if not ours or len(ours) != len(root.handlers):
        yield
        return
    for h in ours:
        root.removeHandler(h)
    try:
        yield
    finally:
        if not root.handlers:
            for h in ours:
                root.addHandler(h)
