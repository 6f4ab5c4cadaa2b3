"""OpenTelemetry (awa_fast/otel.py): producer spans on enqueue, consumer spans per attempt, W3C context in metadata.

Real PostgreSQL, a real in-process worker, the SDK's in-memory span exporter.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from awa_fast import hooks, otel
from awa_fast.app import App
from awa_fast.client import Client
from tests.fixtures.supervisor import REPO_ROOT, SupervisorProc
from tests.fixtures.waiting import wait_for
from tests.integration.runtime_helpers import enqueue_one


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    otel.enable(provider)
    exporter.provider = provider  # for the handlers' own spans
    try:
        yield exporter
    finally:
        otel.disable()
        provider.shutdown()


def _app(dsn: str, schema: str) -> App:
    app = App(dsn, schema)

    @app.job("ok", queue="traced")
    def ok(job):  # noqa: ANN001, ANN202
        return None

    @app.job("boom", queue="traced", max_attempts=1)
    def boom(job):  # noqa: ANN001, ANN202
        raise ValueError("the handler broke")

    @app.job("aok", queue="traced")
    async def aok(job):  # noqa: ANN001, ANN202
        return None

    return app


def test_spans_a_handler_opens_are_children_of_its_attempt(pg_dsn, schema, spans):
    app = App(pg_dsn, schema)
    user = spans.provider.get_tracer("user")

    @app.job("inner", queue="traced")
    def inner(job):  # noqa: ANN001, ANN202
        with user.start_as_current_span("user work sync"):
            return None

    @app.job("ainner", queue="traced")
    async def ainner(job):  # noqa: ANN001, ANN202
        await asyncio.sleep(0)
        with user.start_as_current_span("user work async"):
            await asyncio.sleep(0)

    sync_id, async_id = app.enqueue("inner", {}), app.enqueue("ainner", {})
    _drain(app)
    finished = spans.get_finished_spans()
    consumers = {s.attributes["messaging.message.id"]: s for s in finished if s.kind == SpanKind.CONSUMER}
    mine = {s.name: s for s in finished if s.name.startswith("user work")}
    assert mine["user work sync"].parent.span_id == consumers[str(sync_id)].context.span_id
    assert mine["user work async"].parent.span_id == consumers[str(async_id)].context.span_id
    app.close()


def _drain(app: App) -> None:
    summary = app.run_worker(["traced"], until_empty=True, install_signal_handlers=False, maintenance=False)
    assert summary.empty


def test_consumer_span_is_a_child_of_and_linked_to_the_producer_span(pg_dsn, schema, spans):
    app = _app(pg_dsn, schema)
    job_id = app.enqueue("ok", {"n": 1}, metadata={"mine": "kept"})
    info = app.get_job(job_id)
    assert info is not None
    md = info.metadata if isinstance(info.metadata, dict) else json.loads(info.metadata)
    assert md["mine"] == "kept"
    assert md[otel.TRACE_KEY]["traceparent"].startswith("00-")
    _drain(app)
    finished = spans.get_finished_spans()
    producer = next(s for s in finished if s.kind == SpanKind.PRODUCER)
    consumer = next(s for s in finished if s.kind == SpanKind.CONSUMER)
    assert producer.name == "publish traced" and consumer.name == "process traced"
    assert dict(producer.attributes) == {
        "messaging.system": "awa_fast", "messaging.destination.name": "traced",
        "messaging.operation.type": "publish", "messaging.operation.name": "publish",
        "awa_fast.job.kind": "ok", "messaging.message.id": str(job_id)}
    assert consumer.attributes["messaging.system"] == "awa_fast"
    assert consumer.attributes["messaging.operation.type"] == "process"
    assert consumer.attributes["messaging.destination.name"] == "traced"
    assert consumer.attributes["messaging.message.id"] == str(job_id)
    assert consumer.attributes["awa_fast.job.attempt"] == 1
    assert consumer.context.trace_id == producer.context.trace_id
    assert consumer.parent is not None and consumer.parent.span_id == producer.context.span_id
    assert [link.context.span_id for link in consumer.links] == [producer.context.span_id]
    assert consumer.status.status_code == StatusCode.UNSET
    app.close()


def test_a_failed_attempt_records_the_exception_and_an_error_status(pg_dsn, schema, spans):
    app = _app(pg_dsn, schema)
    job_id = app.enqueue("boom", {})
    _drain(app)
    consumer = next(s for s in spans.get_finished_spans() if s.kind == SpanKind.CONSUMER)
    assert consumer.attributes["messaging.message.id"] == str(job_id)
    assert consumer.status.status_code == StatusCode.ERROR
    events = [e for e in consumer.events if e.name == "exception"]
    assert len(events) == 1
    assert events[0].attributes["exception.type"] == "ValueError"
    assert events[0].attributes["exception.message"] == "the handler broke"
    info = app.get_job(job_id)
    assert info is not None and info.state in ("dlq", "failed")  # the failure itself is unchanged
    app.close()


def test_enqueue_many_and_async_enqueue_and_handlers_are_traced(pg_dsn, schema, spans):
    app = _app(pg_dsn, schema)
    ids = app.enqueue_many("ok", [{"i": 1}, {"i": 2}, {"i": 3}], return_ids=True)
    assert app.enqueue_many("ok", ({"g": i} for i in range(2)), queue="other") == 2  # a generator: counted after

    async def produce() -> int:
        async with app:
            return await app.enqueue_async("aok", {"x": 1})

    aid = asyncio.run(produce())
    _drain(app)
    finished = spans.get_finished_spans()
    producers = [s for s in finished if s.kind == SpanKind.PRODUCER]
    consumers = {s.attributes["messaging.message.id"]: s for s in finished if s.kind == SpanKind.CONSUMER}
    assert len(producers) == 3
    generated = next(p for p in producers if p.attributes["messaging.destination.name"] == "other")
    assert generated.attributes["messaging.batch.message_count"] == 2
    producers.remove(generated)
    batch = next(p for p in producers if p.attributes["awa_fast.job.kind"] == "ok")
    single = next(p for p in producers if p.attributes["awa_fast.job.kind"] == "aok")
    assert batch.attributes["messaging.batch.message_count"] == 3
    assert single.attributes["messaging.message.id"] == str(aid)
    assert set(consumers) == {str(i) for i in ids} | {str(aid)}
    for i in ids:
        assert consumers[str(i)].parent.span_id == batch.context.span_id
    assert consumers[str(aid)].parent.span_id == single.context.span_id
    app.close()


def test_disable_restores_the_plain_enqueue_and_no_metadata_key(pg_dsn, schema):
    plain = Client.enqueue
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    otel.enable(provider)
    assert Client.enqueue is not plain and "otel" in hooks.installed()
    otel.disable()
    assert Client.enqueue is plain and hooks.around is None and not otel.is_enabled()
    app = _app(pg_dsn, schema)
    job_id = app.enqueue("ok", {})
    info = app.get_job(job_id)
    assert info is not None and not info.metadata
    _drain(app)
    assert exporter.get_finished_spans() == ()
    app.close()


def test_tracing_off_never_imports_opentelemetry(pg_dsn, schema):
    script = textwrap.dedent(f"""
        import sys
        from awa_fast.app import App
        app = App({pg_dsn!r}, {schema!r})

        @app.job("ok", queue="traced")
        def ok(job):
            return None

        jid = app.enqueue("ok", {{}})
        app.enqueue_many("ok", [{{}}, {{}}])
        s = app.run_worker(["traced"], until_empty=True, install_signal_handlers=False, maintenance=False)
        assert s.completed == 3, s
        md = app.get_job(jid).metadata
        print(sorted(m for m in sys.modules if m.startswith("opentelemetry")), bool(md))
        app.close()
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO_ROOT,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == "[] False"


def test_trace_context_crosses_into_a_supervised_claimer(pg_dsn, schema, tmp_path, spans, monkeypatch):
    span_file = tmp_path / "spans.jsonl"
    monkeypatch.setenv("AWA_FAST_OTEL", "1")
    monkeypatch.setenv("AWA_TEST_SPANS", str(span_file))
    with SupervisorProc(pg_dsn, schema, tmp_path, app="tests.integration.otel_apps:app",
                        queues=["oq:stripes=1,concurrency=2"]) as sup:
        sup.wait_running(1)
        ok_id = enqueue_one(pg_dsn, schema, "otel.ok", {}, queue="oq")  # traced here, by the fixture's provider
        boom_id = enqueue_one(pg_dsn, schema, "otel.boom", {}, queue="oq")
        wait_for(lambda: sum(1 for line in span_file.read_text().splitlines() if '"CONSUMER"' in line) == 2
                 if span_file.exists() else False, 60, "two consumer spans", on_timeout=sup.tail)
        assert sup.stop(60) == 0, sup.tail()
    producers = {s.attributes["messaging.message.id"]: s for s in spans.get_finished_spans()
                 if s.kind == SpanKind.PRODUCER}
    consumers = {s["attributes"]["messaging.message.id"]: s
                 for s in map(json.loads, span_file.read_text().splitlines()) if s["kind"] == "CONSUMER"}
    assert set(producers) == set(consumers) == {str(ok_id), str(boom_id)}
    for job_id, consumer in consumers.items():
        producer = producers[job_id].context
        assert consumer["pid"] != sup.pid and consumer["name"] == "process oq"
        assert consumer["trace_id"] == f"{producer.trace_id:032x}"
        assert consumer["parent_id"] == consumer["links"][0] == f"{producer.span_id:016x}"
    assert consumers[str(ok_id)]["status"] == "UNSET"
    assert consumers[str(boom_id)]["status"] == "ERROR" and consumers[str(boom_id)]["events"] == ["exception"]


def test_tracing_and_the_log_context_together(pg_dsn, schema, spans):
    import io
    import logging

    from awa_fast import logs

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logs.JsonFormatter())
    user = logging.getLogger("test.otel.both")
    user.addHandler(handler)
    user.setLevel(logging.INFO)
    app = App(pg_dsn, schema)

    @app.job("both", queue="traced")
    def both(job):  # noqa: ANN001, ANN202
        from opentelemetry import trace

        user.info("in span %s", format(trace.get_current_span().get_span_context().span_id, "016x"))

    logs.enable_job_context()
    try:
        assert hooks.installed() == ("otel", "logs")
        job_id = app.enqueue("both", {})
        _drain(app)
    finally:
        logs.disable_job_context()
        user.removeHandler(handler)
    assert hooks.installed() == ("otel",)
    consumer = next(s for s in spans.get_finished_spans() if s.kind == SpanKind.CONSUMER)
    (line,) = [json.loads(x) for x in stream.getvalue().splitlines()]
    assert line["job_id"] == job_id and line["kind"] == "both" and line["attempt"] == 1
    assert line["message"] == f"in span {consumer.context.span_id:016x}"
    app.close()
