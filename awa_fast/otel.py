"""OpenTelemetry traces of enqueue and of every attempt (extra ``awa-fast[otel]``), off unless enabled.

:func:`enable` turns tracing on for this process: every enqueue through
:class:`awa_fast.Client` or :class:`awa_fast.App` (``enqueue``,
``enqueue_many`` and their async twins) gets a PRODUCER span
``publish <queue>``, and writes the span's W3C trace context into the
job's metadata under :data:`TRACE_KEY`; every attempt a claimer runs gets
a CONSUMER span ``process <queue>``, a child of that context and linked to
it. Attributes follow the OpenTelemetry messaging semantic conventions
(``messaging.system="awa_fast"``, ``messaging.destination.name``,
``messaging.operation.type``, ``messaging.message.id``). A handler that
raises leaves its exception on the span and the span's status ERROR.

Nothing here is imported until :func:`enable` runs. While tracing is off
the enqueue methods are the plain ones (``enable`` installs the traced
versions, :func:`disable` puts the plain ones back), the claimer checks one
module attribute per attempt (:data:`awa_fast.hooks.around`), and no job
gets a metadata key.

Under ``awa-fast supervise``, call ``enable()`` in the app module (after
configuring your SDK's TracerProvider and exporter) so that the claimer
processes, which import that module, trace too; ``AWA_FAST_OTEL=1`` makes
the CLI call it with the global TracerProvider.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from awa_fast import hooks
from awa_fast.errors import ConfigError

#: The metadata key that carries the producer's trace context (``{"traceparent": ..., "tracestate": ...}``).
TRACE_KEY = "awa_fast.trace_context"
SYSTEM = "awa_fast"

# The tracer while tracing is on, else None.
tracer: Any = None

_lock = threading.Lock()
_originals: dict[str, Callable[..., Any]] = {}
_ENQUEUE_METHODS = ("enqueue", "enqueue_async", "enqueue_many", "enqueue_many_async")


def _api() -> Any:
    try:
        from opentelemetry import trace
    except ImportError:
        raise ConfigError("tracing needs OpenTelemetry: pip install 'awa-fast[otel]'") from None
    return trace


def enable(tracer_provider: Any = None) -> None:
    """Trace enqueues and attempts in this process, with ``tracer_provider`` (default: the global one).

    Calling it again switches the provider. Raises :class:`awa_fast.ConfigError`
    when OpenTelemetry is not installed (``pip install 'awa-fast[otel]'``).
    """
    global tracer
    trace = _api()
    from awa_fast import __version__
    from awa_fast.client import Client

    with _lock:
        tracer = trace.get_tracer("awa_fast", __version__, tracer_provider=tracer_provider)
        for name in _ENQUEUE_METHODS:
            if name not in _originals:
                plain = getattr(Client, name)
                _originals[name] = plain
                setattr(Client, name, _traced(name, plain))
        hooks.install("otel", attempt_span)


def disable() -> None:
    """Stop tracing in this process (the plain enqueue methods come back)."""
    global tracer
    from awa_fast.client import Client

    with _lock:
        hooks.uninstall("otel")
        for name, plain in _originals.items():
            setattr(Client, name, plain)
        _originals.clear()
        tracer = None


def is_enabled() -> bool:
    """True while :func:`enable` is in force."""
    return tracer is not None


# -- producer ----------------------------------------------------------------------------


def _traced(name: str, plain: Callable[..., Any]) -> Callable[..., Any]:
    many = name.startswith("enqueue_many")

    def start(client: Any, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
        kind = a[0] if a else kw.get("kind")
        args: Any = a[1] if len(a) > 1 else kw.get("args_list" if many else "args")
        queue = kw.get("queue")
        queue = queue if queue is not None else client.default_queue
        attrs: dict[str, Any] = {"messaging.system": SYSTEM, "messaging.destination.name": str(queue),
                                 "messaging.operation.type": "publish", "messaging.operation.name": "publish",
                                 "awa_fast.job.kind": str(kind)}
        if many:
            try:
                attrs["messaging.batch.message_count"] = len(args)
            except TypeError:
                pass
        from opentelemetry.trace import SpanKind

        return tracer.start_as_current_span(f"publish {queue}", kind=SpanKind.PRODUCER, attributes=attrs)

    def finish(span: Any, result: Any) -> Any:
        if not many:
            span.set_attribute("messaging.message.id", str(result))
        else:
            # how many rows went in: an int (a UniqueManyResult is one too), or the ids
            count = int(result) if isinstance(result, int) else len(result) if isinstance(result, list) else None
            if count is not None:
                span.set_attribute("messaging.batch.message_count", count)
        return result

    if name.endswith("_async"):
        @functools.wraps(plain)
        async def traced_async(self: Any, *a: Any, **kw: Any) -> Any:
            if tracer is None:  # disabled while a call was in flight
                return await plain(self, *a, **kw)
            with start(self, a, kw) as span:
                kw["metadata"] = with_trace_context(kw.get("metadata"))
                return finish(span, await plain(self, *a, **kw))
        return traced_async

    @functools.wraps(plain)
    def traced(self: Any, *a: Any, **kw: Any) -> Any:
        if tracer is None:  # disabled while a call was in flight
            return plain(self, *a, **kw)
        with start(self, a, kw) as span:
            kw["metadata"] = with_trace_context(kw.get("metadata"))
            return finish(span, plain(self, *a, **kw))
    return traced


def with_trace_context(metadata: Any) -> Any:
    """``metadata`` with the current trace context under :data:`TRACE_KEY` (a new dict; the caller's is
    left as it was). Metadata that is not a JSON object is returned unchanged: there is no place for it."""
    from opentelemetry import propagate

    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    if not carrier:
        return metadata
    if metadata is None:
        return {TRACE_KEY: carrier}
    if not isinstance(metadata, dict):
        from awa_fast.client import to_plain

        metadata = to_plain(metadata)
        if not isinstance(metadata, dict):
            return metadata
    return {**metadata, TRACE_KEY: carrier}


# -- consumer ----------------------------------------------------------------------------


def producer_context(job: Any) -> Any:
    """The OpenTelemetry context the job was enqueued in (from its metadata), or None."""
    raw = job.snapshot.metadata
    if not raw or TRACE_KEY.encode() not in raw:
        return None
    try:
        carrier = job.metadata.get(TRACE_KEY)
    except Exception:  # noqa: BLE001 - metadata that is no JSON object carries no context
        return None
    if not isinstance(carrier, dict):
        return None
    from opentelemetry import propagate

    return propagate.extract({str(k): str(v) for k, v in carrier.items()})


@contextmanager
def attempt_span(job: Any) -> Iterator[None]:
    """The CONSUMER span of one attempt, around its handler (installed as a per-attempt hook)."""
    t = tracer
    if t is None:
        yield
        return
    from opentelemetry import trace
    from opentelemetry.trace import Link, SpanKind

    parent = producer_context(job)
    links = []
    if parent is not None:
        ctx = trace.get_current_span(parent).get_span_context()
        if ctx.is_valid:
            links.append(Link(ctx))
    attrs = {"messaging.system": SYSTEM, "messaging.destination.name": job.queue,
             "messaging.operation.type": "process", "messaging.operation.name": "process",
             "messaging.message.id": str(job.id), "awa_fast.job.kind": job.kind,
             "awa_fast.job.attempt": job.attempt, "awa_fast.job.run_lease": job.run_lease}
    with t.start_as_current_span(f"process {job.queue}", context=parent, kind=SpanKind.CONSUMER, links=links,
                                 attributes=attrs):
        yield
