"""An app for tests/integration/test_otel.py under ``awa-fast supervise`` with ``AWA_FAST_OTEL=1``.

It only configures the OpenTelemetry SDK, as an application would (a global TracerProvider whose
exporter appends one JSON line per span to ``$AWA_TEST_SPANS``); awa-fast's instrumentation is
turned on by the environment variable.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

from awa_fast.app import App


class LineExporter(SpanExporter):
    """One JSON object per finished span, appended to a file (each process appends its own lines)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = []
        for s in spans:
            lines.append(json.dumps({
                "name": s.name, "kind": s.kind.name, "pid": os.getpid(),
                "trace_id": f"{s.context.trace_id:032x}", "span_id": f"{s.context.span_id:016x}",
                "parent_id": f"{s.parent.span_id:016x}" if s.parent else None,
                "links": [f"{link.context.span_id:016x}" for link in s.links],
                "status": s.status.status_code.name, "attributes": dict(s.attributes or {}),
                "events": [e.name for e in s.events]}) + "\n")
        with open(self.path, "a") as f:
            f.write("".join(lines))
        return SpanExportResult.SUCCESS


provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(LineExporter(os.environ["AWA_TEST_SPANS"])))
trace.set_tracer_provider(provider)

app = App()


@app.job("otel.ok", queue="oq")
def ok(job):  # noqa: ANN001, ANN202
    return None


@app.job("otel.boom", queue="oq", max_attempts=1)
def boom(job):  # noqa: ANN001, ANN202
    raise RuntimeError("nope")
