"""The ``awa-fast`` command line as a user runs it: a real process, real PostgreSQL.

migrate (idempotent, refuses a newer schema), clear one-line errors that
never leak a password, the admin commands with ``--json``, and the embedded
server's start/stop/status across a ``kill -9`` of its postmaster.
"""

from __future__ import annotations

import json
import os
import signal
import uuid

import psycopg
import pytest

from awa_fast.storage import CLOSE_FAIL
from awa_fast.storage.schema import latest_version, render
from tests.integration.runtime_helpers import (
    QUEUE,
    cli,
    cli_json,
    connect,
    enqueue_one,
    pid_alive,
    sqlx,
    wait_for,
)

pytestmark = pytest.mark.integration

PASSWORD = "secretpw"
UNREACHABLE = f"postgresql://u:{PASSWORD}@127.0.0.1:1/db"
HOSTILE_SCHEMA = 'x"; drop table y; --'


def _one_error_line(res, *, code: int | None = None) -> str:  # noqa: ANN001
    assert res.returncode != 0, f"exit 0 (stdout {res.stdout!r})"
    if code is not None:
        assert res.returncode == code, (res.returncode, res.stderr)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, f"want one error line on stderr, got {len(lines)}:\n{res.stderr}"
    assert "Traceback" not in res.stderr
    return lines[0]


def _schema_objects(conn: psycopg.Connection) -> set[tuple[str, str]]:
    return {(r[0], r[1]) for r in conn.execute(
        "SELECT n.nspname, c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname NOT IN ('pg_catalog', 'information_schema', 'pg_toast')").fetchall()}


# -- migrate -----------------------------------------------------------------------------


@pytest.fixture
def fresh_schema(pg_dsn):
    """A schema name nobody created yet; dropped afterwards."""
    name = "cli_" + uuid.uuid4().hex[:12]
    yield name
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


def test_migrate_twice_second_changes_nothing(pg_dsn, fresh_schema):
    first = cli("migrate", "--dsn", pg_dsn, "--schema", fresh_schema)
    assert first.returncode == 0, first.stderr
    assert f"version 0 -> {latest_version()}" in first.stdout
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        before = sqlx(c, fresh_schema, "SELECT version, name, applied_at FROM __SCHEMA__.schema_migrations")
        objects = _schema_objects(c)
    second = cli("migrate", "--dsn", pg_dsn, "--schema", fresh_schema)
    assert second.returncode == 0, second.stderr
    assert "already up to date" in second.stdout
    third = cli_json("migrate", "--dsn", pg_dsn, "--schema", fresh_schema, "--json")
    assert {k: third[k] for k in ("schema", "from_version", "to_version", "changed")} == {
        "schema": fresh_schema, "from_version": latest_version(), "to_version": latest_version(), "changed": False}
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        assert sqlx(c, fresh_schema, "SELECT version, name, applied_at FROM __SCHEMA__.schema_migrations") == before
        assert _schema_objects(c) == objects


def test_migrate_refuses_a_schema_newer_than_the_package(pg_dsn, schema, conn):
    newer = latest_version() + 1
    conn.execute(render("INSERT INTO __SCHEMA__.schema_migrations (version, name) VALUES (%s, 'from_the_future')",
                        schema), (newer,))
    before = sqlx(conn, schema, "SELECT version, name, applied_at FROM __SCHEMA__.schema_migrations ORDER BY 1")
    objects = _schema_objects(conn)
    res = cli("migrate", "--dsn", pg_dsn, "--schema", schema)
    line = _one_error_line(res)
    assert f"version {newer}" in line and "upgrade the awa-fast package" in line, line
    assert sqlx(conn, schema, "SELECT version, name, applied_at FROM __SCHEMA__.schema_migrations ORDER BY 1") == before
    assert _schema_objects(conn) == objects
    # Every other command refuses it too, instead of running old SQL against it.
    for args in (["status"], ["queue", "list"], ["dlq", "list"]):
        res = cli(*args, "--dsn", pg_dsn, "--schema", schema)
        assert "upgrade the awa-fast package" in _one_error_line(res), args


# -- clear errors, no secrets ------------------------------------------------------------


COMMANDS = [
    ["migrate"],
    ["status", "--json"],
    ["queue", "list", "--json"],
    ["job", "show", "1"],
    ["dlq", "list"],
]


@pytest.mark.parametrize("args", COMMANDS, ids=lambda a: "-".join(a[:2]))
def test_invalid_dsn_is_one_clear_line(args):
    res = cli(*args, "--dsn", "not a dsn")
    line = _one_error_line(res, code=2)
    assert "invalid DSN" in line, line


@pytest.mark.parametrize("args", COMMANDS, ids=lambda a: "-".join(a[:2]))
def test_unreachable_host_is_one_clear_line_without_the_password(args):
    res = cli(*args, "--dsn", UNREACHABLE, timeout=60)
    line = _one_error_line(res, code=3)
    assert "127.0.0.1" in line and ("connect" in line or "connection" in line), line
    assert PASSWORD not in res.stdout + res.stderr


def test_unreachable_host_in_the_environment_is_not_leaked_either():
    res = cli("status", env={"AWA_FAST_DSN": UNREACHABLE})
    _one_error_line(res, code=3)
    res2 = cli("migrate", env={"DATABASE_URL": UNREACHABLE})
    _one_error_line(res2, code=3)
    assert PASSWORD not in res.stdout + res.stderr + res2.stdout + res2.stderr


@pytest.mark.parametrize("args", COMMANDS, ids=lambda a: "-".join(a[:2]))
def test_hostile_schema_name_is_refused_before_any_sql(pg_dsn, conn, args):
    objects = _schema_objects(conn)
    res = cli(*args, "--dsn", pg_dsn, "--schema", HOSTILE_SCHEMA)
    line = _one_error_line(res, code=2)
    assert "invalid schema" in line, line
    assert _schema_objects(conn) == objects


def test_supervise_errors_are_clear_and_secret_free(pg_dsn, tmp_path):
    app = "tests.integration.runtime_apps:app"
    home = str(tmp_path / "home")
    res = cli("supervise", app, "--dsn", UNREACHABLE, "--schema", "awa_fast", "--home", home, "--queue", QUEUE)
    assert res.returncode == 3, res.stderr
    assert PASSWORD not in res.stdout + res.stderr
    assert "Traceback" not in res.stderr
    res = cli("supervise", app, "--dsn", pg_dsn, "--schema", HOSTILE_SCHEMA, "--home", home, "--queue", QUEUE)
    assert res.returncode == 2 and "invalid schema" in res.stderr and "Traceback" not in res.stderr, res.stderr
    res = cli("supervise", app, "--dsn", pg_dsn, "--schema", "never_migrated_here", "--home", home,
              "--queue", QUEUE)
    assert res.returncode == 2 and "awa-fast migrate" in res.stderr and "Traceback" not in res.stderr, res.stderr


# -- admin commands with --json ----------------------------------------------------------


def _admin(pg_dsn: str, schema: str, *args: str):  # noqa: ANN202
    return cli(*args, "--dsn", pg_dsn, "--schema", schema)


def _dlq_job(pg_dsn: str, schema: str, storage, conn, reason: str = "broken") -> int:  # noqa: ANN001
    """A job failed terminally into the DLQ through the storage API (no supervisor needed)."""
    job_id = enqueue_one(pg_dsn, schema, "rt.sync", {"dlq": reason}, queue="adminq")
    claimer = connect(pg_dsn, schema, "claimer")
    try:
        snaps = [s for s in storage.lane_claim(claimer, "adminq", 100) if s.job_id == job_id]
        assert len(snaps) == 1
        assert storage.attempt_close(claimer, [(snaps[0], CLOSE_FAIL, None, reason)])[0].status == "ok"
    finally:
        claimer.close()
    assert storage.job_load(conn, job_id)["state"] == "dlq"
    return job_id


def test_job_show_cancel_retry_json(pg_dsn, schema, storage, conn):
    ready = enqueue_one(pg_dsn, schema, "rt.sync", {"x": 1}, queue="adminq")
    shown = json.loads(_admin(pg_dsn, schema, "job", "show", str(ready), "--json").stdout)
    assert shown["state"] == "available" and shown["job_id"] == ready and shown["args"] == {"x": 1}, shown

    res = _admin(pg_dsn, schema, "job", "cancel", str(ready), "--json")
    assert res.returncode == 0 and json.loads(res.stdout) == {"job_id": ready, "result": "cancelled"}, res
    assert storage.job_load(conn, ready)["state"] == "cancelled"
    again = _admin(pg_dsn, schema, "job", "cancel", str(ready), "--json")
    assert again.returncode == 1 and json.loads(again.stdout)["result"] == "terminal", again

    dead = _dlq_job(pg_dsn, schema, storage, conn)
    res = _admin(pg_dsn, schema, "job", "retry", str(dead), "--json")
    assert res.returncode == 0 and json.loads(res.stdout) == {"job_id": dead, "result": "retried"}, res
    assert storage.job_load(conn, dead)["state"] == "available"

    later = enqueue_one(pg_dsn, schema, "rt.sync", {}, queue="adminq", delay=3600)
    assert storage.job_load(conn, later)["state"] == "scheduled"
    res = _admin(pg_dsn, schema, "job", "retry", str(later), "--json")
    assert res.returncode == 0 and json.loads(res.stdout) == {"job_id": later, "result": "due now"}, res
    assert sqlx(conn, schema, "SELECT run_at <= now() FROM __SCHEMA__.deferred_jobs WHERE job_id = %s",
                (later,)) == [(True,)]

    # Errors: one line, non-zero.
    line = _one_error_line(_admin(pg_dsn, schema, "job", "retry", str(ready), "--json"), code=2)
    assert "cancelled" in line, line
    line = _one_error_line(_admin(pg_dsn, schema, "job", "show", "12345", "--json"), code=2)
    assert "no job 12345" in line, line


def test_queue_pause_resume_list_json(pg_dsn, schema, storage, conn):
    job_id = enqueue_one(pg_dsn, schema, "rt.sync", {}, queue="adminq")
    rows = json.loads(_admin(pg_dsn, schema, "queue", "list", "--json").stdout)
    assert [r["queue"] for r in rows] == ["adminq"] and rows[0]["paused"] is False, rows

    res = _admin(pg_dsn, schema, "queue", "pause", "adminq", "--json")
    assert res.returncode == 0 and json.loads(res.stdout) == {"queue": "adminq", "paused": True}, res
    assert json.loads(_admin(pg_dsn, schema, "queue", "list", "--json").stdout)[0]["paused"] is True
    claimer = connect(pg_dsn, schema, "claimer")
    try:
        assert storage.lane_claim(claimer, "adminq", 10) == [], "a paused queue was claimed"
        res = _admin(pg_dsn, schema, "queue", "resume", "adminq", "--json")
        assert res.returncode == 0 and json.loads(res.stdout) == {"queue": "adminq", "paused": False}, res
        assert [s.job_id for s in storage.lane_claim(claimer, "adminq", 10)] == [job_id]
    finally:
        claimer.close()

    line = _one_error_line(_admin(pg_dsn, schema, "queue", "pause", "nosuchqueue", "--json"), code=2)
    assert "nosuchqueue" in line, line
    line = _one_error_line(_admin(pg_dsn, schema, "queue", "pause", "bad queue!", "--json"), code=2)
    assert "invalid queue" in line, line


def test_dlq_list_retry_purge_json(pg_dsn, schema, storage, conn):
    a = _dlq_job(pg_dsn, schema, storage, conn, "reason a")
    b = _dlq_job(pg_dsn, schema, storage, conn, "reason b")
    c = _dlq_job(pg_dsn, schema, storage, conn, "reason c")
    rows = json.loads(_admin(pg_dsn, schema, "dlq", "list", "--json").stdout)
    assert {r["job_id"] for r in rows} == {a, b, c}
    assert {r["reason"] for r in rows} == {"reason a", "reason b", "reason c"}
    assert all(r["queue"] == "adminq" and r["attempt"] == 1 and r["kind"] == "rt.sync" for r in rows), rows
    assert json.loads(_admin(pg_dsn, schema, "dlq", "list", "--queue", "otherq", "--json").stdout) == []

    res = _admin(pg_dsn, schema, "dlq", "retry", "--id", str(a), "--json")
    assert res.returncode == 0 and json.loads(res.stdout) == {"retried": [a]}, res
    assert storage.job_load(conn, a)["state"] != "dlq"  # (see the job_load test below for 'available')
    assert storage.queue_counts_exact(conn)["adminq"] == {"available": 1, "dlq": 2}

    res = _admin(pg_dsn, schema, "dlq", "purge", "--id", str(b), "--json")
    assert res.returncode == 0 and json.loads(res.stdout) == {"purged": 1}, res
    assert {r["job_id"] for r in json.loads(_admin(pg_dsn, schema, "dlq", "list", "--json").stdout)} == {c}
    res = _admin(pg_dsn, schema, "dlq", "purge", "--queue", "adminq", "--json")
    assert res.returncode == 0 and json.loads(res.stdout) == {"purged": 1}, res
    assert json.loads(_admin(pg_dsn, schema, "dlq", "list", "--json").stdout) == []

    line = _one_error_line(_admin(pg_dsn, schema, "dlq", "retry", "--json"), code=2)
    assert "--id" in line and "--queue" in line, line


def test_a_job_retried_from_the_dlq_shows_available(pg_dsn, schema, storage, conn):
    storage.queue_configure(conn, "adminq", enqueue_shards=1)  # the retry lands in the same lane
    job_id = _dlq_job(pg_dsn, schema, storage, conn)
    res = _admin(pg_dsn, schema, "job", "retry", str(job_id), "--json")
    assert res.returncode == 0 and json.loads(res.stdout) == {"job_id": job_id, "result": "retried"}, res
    assert storage.queue_counts_exact(conn)["adminq"] == {"available": 1}
    job = storage.job_load(conn, job_id)
    assert job["state"] == "available", job


def test_a_purged_dlq_job_is_unknown_not_closing(pg_dsn, schema, storage, conn):
    job_id = _dlq_job(pg_dsn, schema, storage, conn)
    res = _admin(pg_dsn, schema, "dlq", "purge", "--id", str(job_id), "--json")
    assert res.returncode == 0 and json.loads(res.stdout) == {"purged": 1}, res
    assert storage.job_load(conn, job_id) is None
    line = _one_error_line(_admin(pg_dsn, schema, "job", "show", str(job_id), "--json"), code=2)
    assert f"no job {job_id}" in line


# -- the embedded server -----------------------------------------------------------------


def test_db_start_twice_kill_9_start_again_stop(tmp_path):
    home = tmp_path / "h"
    env = {"AWA_FAST_HOME": str(home)}
    try:
        first = cli_json("db", "start", "--json", env=env, timeout=180)
        assert first["running"] is True
        second = cli_json("db", "start", "--json", env=env, timeout=60)
        assert second == first, "a second start must find the running server"
        status = cli_json("db", "status", "--json", env=env)
        assert status["running"] is True and status["dsn"] == first["dsn"]
        pid = status["pid"]
        with psycopg.connect(first["dsn"], connect_timeout=10) as c:
            assert c.execute("SELECT 1").fetchone() == (1,)

        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not pid_alive(pid), 10, "the postmaster to die")
        down = cli("db", "status", "--json", env=env)
        assert down.returncode == 1 and json.loads(down.stdout)["running"] is False, down

        third = cli_json("db", "start", "--json", env=env, timeout=120)
        assert third["running"] is True and third["dsn"] == first["dsn"]
        status = cli_json("db", "status", "--json", env=env)
        assert status["running"] is True and status["pid"] != pid
        with psycopg.connect(third["dsn"], connect_timeout=10) as c:
            assert c.execute("SELECT 1").fetchone() == (1,)
        url = cli("db", "url", env=env)
        assert url.returncode == 0 and url.stdout.strip() == first["dsn"]

        stopped = cli_json("db", "stop", "--json", env=env, timeout=120)
        assert stopped == {"stopped": True}
        assert cli_json("db", "stop", "--json", env=env) == {"stopped": False}
        final = cli("db", "status", "--json", env=env)
        assert final.returncode == 1 and json.loads(final.stdout)["running"] is False
    finally:
        from awa_fast.embedded import stop_embedded

        stop_embedded(home, mode="immediate")
