"""Structured logs (awa_fast/logs.py): ``--log-format json`` under a real supervisor, the job context of
a handler's own log lines, and a user's own logging configuration winning over the CLI's."""

from __future__ import annotations

import io
import logging
import os

import orjson
import psycopg
import pytest
from psycopg import sql

from awa_fast import hooks, logs
from tests.fixtures.supervisor import SupervisorProc
from tests.fixtures.waiting import wait_for
from tests.integration.runtime_helpers import cli, counts, enqueue_one

pytestmark = pytest.mark.integration

APP = "tests.integration.logs_apps:app"


def _run(pg_dsn, schema, storage, conn, tmp_path, extra):  # noqa: ANN001, ANN202
    sup = SupervisorProc(pg_dsn, schema, tmp_path, app=APP, queues=["logq:stripes=1,concurrency=2"], extra=extra)
    with sup:
        sup.wait_running(1)
        sync_id = enqueue_one(pg_dsn, schema, "logs.say", {"word": "hello"}, queue="logq")
        async_id = enqueue_one(pg_dsn, schema, "logs.say_async", {"word": "there"}, queue="logq")
        wait_for(lambda: counts(storage, conn, "logq").get("completed", 0) == 2, 60, "two completions",
                 on_timeout=sup.tail)
        assert sup.stop(60) == 0, sup.tail()
        return sup.output(), sync_id, async_id


def test_supervise_log_format_json_every_line_parses_and_handler_lines_carry_the_job(
        pg_dsn, schema, storage, conn, tmp_path):
    out, sync_id, async_id = _run(pg_dsn, schema, storage, conn, tmp_path, ["--log-format", "json"])
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) >= 5, out
    records = []
    for line in lines:
        try:
            records.append(orjson.loads(line))
        except orjson.JSONDecodeError:
            pytest.fail(f"not a JSON line: {line!r}\n{out}")
    for rec in records:
        assert {"ts", "level", "logger", "message", "pid"} <= set(rec), rec
    mine = [r for r in records if r["logger"] == "user.handler"]
    by_message = {r["message"]: r for r in mine}
    assert set(by_message) == {"handling hello", "handling async there"}, mine
    hello, there = by_message["handling hello"], by_message["handling async there"]
    assert (hello["job_id"], hello["kind"], hello["queue"], hello["attempt"]) == (sync_id, "logs.say", "logq", 1)
    assert (there["job_id"], there["kind"], there["queue"], there["attempt"]) == (
        async_id, "logs.say_async", "logq", 1)
    # the engine's own lines keep their extra= fields, and carry no job outside a handler
    start = next(r for r in records if r.get("action") == "supervisor_start")
    assert start["logger"] == "awa_fast.supervisor" and "job_id" not in start


def test_a_logging_configuration_in_the_app_module_wins_under_supervise(pg_dsn, schema, storage, conn, tmp_path,
                                                                        monkeypatch):
    monkeypatch.setenv("AWA_TEST_OWN_LOGGING", "1")
    out, sync_id, _ = _run(pg_dsn, schema, storage, conn, tmp_path, ["--log-format", "json"])
    lines = [line for line in out.splitlines() if line.strip()]
    assert "USER INFO user.handler handling hello" in lines, out
    # after the app is imported every line is the user's format: the CLI added no handler of its own
    imported = next(i for i, line in enumerate(lines) if line.startswith("USER "))
    assert all(line.startswith("USER ") or line.startswith(" ") or line.startswith("Traceback")
               for line in lines[imported:]), out


def test_env_var_selects_json_and_an_unknown_format_is_refused(pg_dsn):
    schema = "t_logs_env_json"
    res = cli("migrate", "--dsn", pg_dsn, "--schema", schema, env={"AWA_FAST_LOG_FORMAT": "json"})
    assert res.returncode == 0, res.stderr
    lines = [orjson.loads(line) for line in res.stderr.splitlines() if line.strip()]
    applied = [r for r in lines if r["logger"] == "awa_fast.migrate" or r["message"].startswith("applied migration")]
    assert applied and all(r["level"] == "INFO" for r in applied), res.stderr
    bad = cli("queue", "list", "--log-format", "xml")
    assert bad.returncode == 2 and "--log-format" in bad.stderr and "text or json" in bad.stderr
    bad_env = cli("queue", "list", env={"AWA_FAST_LOG_FORMAT": "yaml"})
    assert bad_env.returncode == 2 and "'yaml' is not a log format" in bad_env.stderr
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


def test_json_formatter_and_filter_in_process():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logs.JsonFormatter())
    handler.addFilter(logs.JobContextFilter())
    log = logging.getLogger("test.logs.inproc")
    log.addHandler(handler)
    log.propagate = False
    log.setLevel(logging.INFO)

    class FakeJob:  # the four fields a Job exposes; a real Job needs a claim
        id, kind, queue, attempt = 42, "k", "q", 3

    try:
        log.info("outside", extra={"action": "x"})
        with logs.job_scope(FakeJob()):
            log.info("inside %d", 1)
            try:
                raise RuntimeError("boom")
            except RuntimeError:
                log.exception("failed")
        assert logs.current_job() is None
    finally:
        log.removeHandler(handler)
    outside, inside, failed = (orjson.loads(line) for line in stream.getvalue().splitlines())
    assert outside["action"] == "x" and outside["job_id"] is None and outside["message"] == "outside"
    assert (inside["job_id"], inside["kind"], inside["queue"], inside["attempt"]) == (42, "k", "q", 3)
    assert inside["message"] == "inside 1" and inside["level"] == "INFO"
    assert failed["job_id"] == 42 and "RuntimeError: boom" in failed["exc_info"]
    assert hooks.around is None  # nothing enabled the per-attempt hook here


def test_serve_log_format_json_every_line_parses(pg_dsn, schema, tmp_path):
    pytest.importorskip("starlette", reason="the [web] extra is not installed")
    import signal
    import socket
    import subprocess
    import sys
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("AWA_FAST_DSN", "DATABASE_URL", "AWA_FAST_SCHEMA")}
    err = tmp_path / "serve.err"
    with open(err, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "awa_fast.cli", "--log-level", "INFO", "serve", "--dsn", pg_dsn,
                                 "--schema", schema, "--bind", f"127.0.0.1:{port}", "--home", str(tmp_path / "home"),
                                 "--token-file", str(tmp_path / "token"), "--log-format", "json"],
                                stdout=out, stderr=out, stdin=subprocess.DEVNULL, env=env)
        try:
            def up() -> bool:
                assert proc.poll() is None, err.read_text()
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/queues", timeout=2) as resp:  # noqa: S310
                        return resp.status == 200
                except OSError:
                    return False
            wait_for(up, 30, "the dashboard serving", on_timeout=err.read_text)
            # a request that is no HTTP: uvicorn logs a warning of its own
            with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
                raw.sendall(b"\x16\x03\x01 not http at all\r\n\r\n")
                raw.recv(1024)
            wait_for(lambda: b"uvicorn" in err.read_bytes(), 30, "uvicorn's warning", on_timeout=err.read_text)
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(30)
    lines = [line for line in err.read_text().splitlines() if line.strip()]
    records = [orjson.loads(line) for line in lines]
    assert all({"ts", "level", "logger", "message"} <= set(rec) for rec in records), lines
    assert any(r["logger"] == "awa_fast.cli" and r.get("action") == "serve_start" for r in records), lines
    assert any(r["logger"].startswith("uvicorn") and r["level"] == "WARNING" for r in records), lines
