"""Handler result to outcome: what the executor writes for what a handler returned or raised.

Pure functions (no thread, no connection): the error texts stored with an
attempt, and the :class:`~awa_fast.outcomes.Outcome` of a returned value.
``awa_fast.testing`` uses the same texts, so a test sees what production
stores.
"""

from __future__ import annotations

import traceback
from typing import Any

import msgspec

from awa_fast.client import encode_payload
from awa_fast.errors import PayloadError
from awa_fast.jobs import Job
from awa_fast.outcomes import COMPLETED, Cancel, CloseCode, Outcome, RetryAfter, Snooze, Unwritten, WaitForCallback
from awa_fast.storage import clean_text

_MAX_ERROR = 8192
_MAX_TRACEBACK = 4096  # the tail of a handler's traceback stored with its error (within _MAX_ERROR)


def error_text(exc: BaseException | str) -> str:
    """Error text safe to store: no NUL, no lone surrogates, at most 8 KiB.

    Names the exception's type always (``SystemExit: 3``, ``KeyboardInterrupt``),
    even when its ``__str__`` is empty or itself raises.
    """
    if isinstance(exc, str):
        text = exc
    else:
        name = type(exc).__name__
        try:
            detail = str(exc)
            text = f"{name}: {detail}" if detail else name
        except BaseException:  # noqa: BLE001 - an exception whose __str__ fails (or raises SystemExit)
            text = name
    return clean_text(text, _MAX_ERROR) or ""


def failure_text(exc: BaseException) -> str:
    """A handler's exception as stored with its attempt: ``error_text(exc)``, then the last
    4 KiB of its traceback, at most 8 KiB in all (the first line stays the ``Name: detail``)."""
    head = error_text(exc)
    try:
        tb = "".join(traceback.format_exception(exc))
    except BaseException:  # noqa: BLE001 - a traceback that cannot be formatted: the summary alone
        return head
    if len(tb) > _MAX_TRACEBACK:
        tb = "..." + tb[-_MAX_TRACEBACK:]
    return clean_text(f"{head[:_MAX_ERROR - _MAX_TRACEBACK - 8]}\n{tb.rstrip()}", _MAX_ERROR) or head


def one_line(text: str, limit: int = 1000) -> str:
    """The first line of ``text``, at most ``limit`` characters (for a log line)."""
    first = text.split("\n", 1)[0]
    return first if len(first) <= limit else first[:limit] + "..."


def timeout_text(timeout: float) -> str:
    """The error stored with an attempt closed by its kind's timeout."""
    return f"timed out after {timeout:g} s"


def unknown_kind_text(kind: str) -> str:
    """The error stored with an attempt of a kind this worker has no handler for."""
    return f"no handler registered for kind {kind!r} in this worker"


def seconds(value: object) -> float:
    """A delay a handler asked for, as seconds: 0 for anything unusable, at most ten years."""
    try:
        v = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return 0.0
    if v != v or v < 0:
        return 0.0
    return min(v, 10 * 365 * 86400.0)


_PLAIN_JSON = (dict, list, str, int, float, bool, tuple)


def result_outcome(value: object) -> Outcome:
    """The outcome of a handler that returned ``value`` (not None, not an outcome object).

    A JSON-able value completes the attempt and is stored as the job's
    result, checked and size-limited like enqueue args (1 MiB of JSON);
    msgspec Structs, dataclasses, datetimes, UUIDs and Decimals are
    converted by ``msgspec.to_builtins`` first. A value that cannot be
    stored retries the attempt with an error naming its type.
    """
    try:
        if type(value) in _PLAIN_JSON:
            try:
                return Outcome(CloseCode.COMPLETE, result=encode_payload(value, "result"))
            except PayloadError:
                if type(value) not in (dict, list, tuple):
                    raise
                # a Struct, dataclass, datetime ... inside a plain container
        return Outcome(CloseCode.COMPLETE, result=encode_payload(msgspec.to_builtins(value), "result"))
    except (PayloadError, TypeError, ValueError, OverflowError) as exc:
        text = (f"handler returned a value of type {type(value).__name__} that cannot be stored as the job's "
                f"result: {exc}")
        return Outcome(CloseCode.RETRY, error=clean_text(text))


def returned_outcome(job: Job[Any], result: object) -> Outcome | Unwritten:
    """The outcome of a handler of ``job`` that returned ``result``.

    ``WaitForCallback`` registers the callback here (on the handler's
    thread, durable before the attempt is parked) unless the handler did.
    """
    if result is None:
        return COMPLETED
    if isinstance(result, RetryAfter):
        return Outcome(CloseCode.RETRY, seconds(result.seconds), error_text(result.reason or "retry requested"))
    if isinstance(result, Snooze):
        return Outcome(CloseCode.SNOOZE, seconds(result.seconds))
    if isinstance(result, Cancel):
        return Outcome(CloseCode.CANCEL, error=error_text(result.reason))
    if isinstance(result, WaitForCallback):
        if not job.lease_backed:
            try:
                job.register_callback(seconds(result.timeout))
            except Exception as exc:  # noqa: BLE001 - registration failed: retry the job
                return Outcome(CloseCode.RETRY, error=error_text(exc))
        return Unwritten.PARKED
    # Any other value is the job's result: it completes the attempt and is
    # stored (checked like enqueue args); one that cannot be stored retries.
    return result_outcome(result)
