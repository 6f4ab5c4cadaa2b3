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
from tests.fixtures.database import connect, sqlx_all
from tests.fixtures.supervisor import pid_alive
from tests.fixtures.waiting import wait_for
from tests.integration.runtime_helpers import (
    QUEUE,
    cli,
    cli_json,
    enqueue_one,
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
        before = sqlx_all(c, fresh_schema, "SELECT version, name, applied_at FROM __SCHEMA__.schema_migrations")
        objects = _schema_objects(c)
    second = cli("migrate", "--dsn", pg_dsn, "--schema", fresh_schema)
    assert second.returncode == 0, second.stderr
    assert "already up to date" in second.stdout
    third = cli_json("migrate", "--dsn", pg_dsn, "--schema", fresh_schema, "--json")
    assert {k: third[k] for k in ("schema", "from_version", "to_version", "changed")} == {
        "schema": fresh_schema, "from_version": latest_version(), "to_version": latest_version(), "changed": False}
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        assert sqlx_all(c, fresh_schema, "SELECT version, name, applied_at FROM __SCHEMA__.schema_migrations") == before
        assert _schema_objects(c) == objects


def test_migrate_refuses_a_schema_newer_than_the_package(pg_dsn, schema, conn):
    newer = latest_version() + 1
    conn.execute(render("INSERT INTO __SCHEMA__.schema_migrations (version, name) VALUES (%s, 'from_the_future')",
                        schema), (newer,))
    before = sqlx_all(conn, schema, "SELECT version, name, applied_at FROM __SCHEMA__.schema_migrations ORDER BY 1")
    objects = _schema_objects(conn)
    res = cli("migrate", "--dsn", pg_dsn, "--schema", schema)
    line = _one_error_line(res)
    assert f"version {newer}" in line and "upgrade the awa-fast package" in line, line
    assert sqlx_all(conn, schema,
                    "SELECT version, name, applied_at FROM __SCHEMA__.schema_migrations ORDER BY 1") == before
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
    assert sqlx_all(conn, schema, "SELECT run_at <= now() FROM __SCHEMA__.deferred_jobs WHERE job_id = %s",
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
    # a whole queue: refused without --yes when stdin is no terminal, --dry-run only lists
    line = _one_error_line(_admin(pg_dsn, schema, "dlq", "purge", "--queue", "adminq", "--json"), code=2)
    assert "--yes" in line and "1 DLQ entries" in line, line
    res = _admin(pg_dsn, schema, "dlq", "purge", "--queue", "adminq", "--dry-run", "--json")
    assert res.returncode == 0 and json.loads(res.stdout) == {"would_purge": [c]}, res
    assert {r["job_id"] for r in json.loads(_admin(pg_dsn, schema, "dlq", "list", "--json").stdout)} == {c}
    res = _admin(pg_dsn, schema, "dlq", "purge", "--queue", "adminq", "--yes", "--json")
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


def test_dlq_purge_and_retry_honour_both_filters(pg_dsn, schema, storage, conn):
    a = _dlq_job(pg_dsn, schema, storage, conn, "a")              # queue adminq
    other = _dlq_job_in(pg_dsn, schema, storage, conn, "otherq")
    res = _admin(pg_dsn, schema, "dlq", "purge", "--id", str(other), "--queue", "adminq", "--json")
    assert res.returncode == 0 and json.loads(res.stdout) == {"purged": 0}, res
    res = _admin(pg_dsn, schema, "dlq", "retry", "--id", str(other), "--queue", "adminq", "--json")
    assert res.returncode == 0 and json.loads(res.stdout) == {"retried": []}, res
    res = _admin(pg_dsn, schema, "dlq", "retry", "--queue", "otherq", "--dry-run", "--json")
    assert json.loads(res.stdout) == {"would_retry": [other]}
    assert {r["job_id"] for r in json.loads(_admin(pg_dsn, schema, "dlq", "list", "--json").stdout)} == {a, other}
    res = _admin(pg_dsn, schema, "dlq", "purge", "--id", str(a), "--id", str(other), "--queue", "adminq")
    assert res.returncode == 0 and res.stdout.strip() == "purged 1 jobs", res
    assert [r["job_id"] for r in json.loads(_admin(pg_dsn, schema, "dlq", "list", "--json").stdout)] == [other]


def _dlq_job_in(pg_dsn, schema, storage, conn, queue):  # noqa: ANN001, ANN202
    job_id = enqueue_one(pg_dsn, schema, "rt.sync", {}, queue=queue)
    claimer = connect(pg_dsn, schema, "claimer")
    try:
        snap = [s for s in storage.lane_claim(claimer, queue, 100) if s.job_id == job_id][0]
        assert storage.attempt_close(claimer, [(snap, CLOSE_FAIL, None, "x")])[0].status == "ok"
    finally:
        claimer.close()
    return job_id


def test_dlq_purge_of_a_queue_asks_on_a_terminal(pg_dsn, schema, storage, conn):
    import pty
    import subprocess
    import sys

    from tests.integration.runtime_helpers import REPO_ROOT

    job_id = _dlq_job(pg_dsn, schema, storage, conn)

    def run(answer: bytes) -> subprocess.CompletedProcess[str]:
        primary, secondary = pty.openpty()
        try:
            os.write(primary, answer)
            return subprocess.run([sys.executable, "-m", "awa_fast.cli", "dlq", "purge", "--queue", "adminq",
                                   "--dsn", pg_dsn, "--schema", schema], stdin=secondary, capture_output=True,
                                  text=True, timeout=60, cwd=str(REPO_ROOT))
        finally:
            os.close(primary)
            os.close(secondary)

    no = run(b"n\n")
    assert no.returncode == 1 and "purge all 1 DLQ entries of queue adminq" in no.stderr, no
    assert "nothing purged" in no.stderr and storage.job_load(conn, job_id)["state"] == "dlq"
    yes = run(b"y\n")
    assert yes.returncode == 0 and yes.stdout.strip() == "purged 1 jobs", yes
    assert storage.job_load(conn, job_id) is None


@pytest.mark.parametrize("args", [
    ["job", "show", "99999999999999999999"], ["job", "show", "-1"], ["job", "show", "0"], ["job", "show", "abc"],
    ["job", "cancel", "99999999999999999999"], ["job", "retry", "-5"], ["dlq", "list", "--limit", "-1"],
    ["dlq", "list", "--limit", "0"], ["job", "list", "--limit", "100001"], ["job", "list", "--state", "nope"],
    ["dlq", "purge", "--id", "99999999999999999999"], ["queue", "configure", "q", "--deadline", "-3"],
    ["queue", "configure", "q", "--enqueue-shards", "65"], ["queue", "configure", "q", "--heartbeat-timeout", "0"],
    ["job", "list", "--before", "-1"], ["queue", "show", "bad queue!"], ["--log-level", "loud", "status"],
])
def test_out_of_range_values_are_one_line_exit_2(pg_dsn, schema, args):
    line = _one_error_line(cli(*args, "--dsn", pg_dsn, "--schema", schema), code=2)
    assert line.startswith("awa-fast"), line


def test_a_database_error_is_one_line_exit_2(pg_dsn, schema, conn):
    enqueue_one(pg_dsn, schema, "rt.sync", {}, queue="adminq")
    conn.execute(render("DROP FUNCTION __SCHEMA__.job_load_v3(bigint) CASCADE", schema))
    for args in (["job", "show", "1"], ["job", "list"]):
        line = _one_error_line(_admin(pg_dsn, schema, *args), code=2)
        assert line.startswith("awa-fast: error: database error:") and "job_load" in line, line


def test_job_list_and_show_with_progress_and_errors(pg_dsn, schema, storage, conn):
    from awa_fast.client import encode_payload
    from awa_fast.storage import CLOSE_RETRY

    a = enqueue_one(pg_dsn, schema, "rt.sync", {"n": 1}, queue="adminq")
    claimer = connect(pg_dsn, schema, "claimer")
    try:
        snap = storage.lane_claim(claimer, "adminq", 10)[0]
        assert storage.attempt_close(claimer, [(snap, CLOSE_RETRY, 0.0, "first try broke")])[0].status == "ok"
        assert storage.deferred_promote(claimer) == 1
        snap = storage.lane_claim(claimer, "adminq", 10)[0]
        storage.attempt_heartbeat(claimer, [snap], [encode_payload({"pct": 50})])
    finally:
        claimer.close()
    b = enqueue_one(pg_dsn, schema, "rt.other", {}, queue="otherq")
    c = enqueue_one(pg_dsn, schema, "rt.sync", {}, queue="adminq", delay=3600)
    rows = json.loads(_admin(pg_dsn, schema, "job", "list", "--json").stdout)
    assert [r["job_id"] for r in rows] == sorted([a, b, c], reverse=True)
    assert [r["job_id"] for r in json.loads(_admin(pg_dsn, schema, "job", "list", "--queue", "otherq",
                                                   "--json").stdout)] == [b]
    assert [r["job_id"] for r in json.loads(_admin(pg_dsn, schema, "job", "list", "--kind", "rt.sync",
                                                   "--state", "scheduled", "--json").stdout)] == [c]
    assert len(json.loads(_admin(pg_dsn, schema, "job", "list", "--limit", "1", "--json").stdout)) == 1
    text = _admin(pg_dsn, schema, "job", "list", "--state", "running").stdout
    assert text.strip() == f"{a} running adminq rt.sync attempt 2/25", text

    shown = json.loads(_admin(pg_dsn, schema, "job", "show", str(a), "--json").stdout)
    assert (shown["state"], shown["attempt"], shown["progress"], shown["result"]) == ("running", 2, {"pct": 50}, None)
    assert [e["error"] for e in shown["errors"]] == ["first try broke"]
    text = _admin(pg_dsn, schema, "job", "show", str(a)).stdout
    assert f"job {a}: running" in text and 'progress {"pct": 50}' in text and "result null" in text, text
    assert "    attempt 1: first try broke" in text, text


def test_queue_configure_show_and_list_show_the_deadline(pg_dsn, schema, storage, conn):
    enqueue_one(pg_dsn, schema, "rt.sync", {}, queue="adminq")
    res = _admin(pg_dsn, schema, "queue", "configure", "adminq", "--deadline", "300", "--heartbeat-timeout", "45",
                 "--no-dlq", "--dlq-retention", "3600", "--history-retention", "7200", "--json")
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    assert (got["deadline"], got["heartbeat_timeout"], got["dlq"], got["dlq_retention"], got["history_retention"]) \
        == (300.0, 45.0, False, 3600.0, 7200.0), got
    text = _admin(pg_dsn, schema, "queue", "list").stdout
    assert text.strip().startswith("adminq: active, deadline 300s, heartbeat timeout 45s, dlq off"), text
    shown = json.loads(_admin(pg_dsn, schema, "queue", "show", "adminq", "--json").stdout)
    assert shown["deadline"] == 300.0 and shown["counts"]["available"] == 1, shown
    assert "available 1" in _admin(pg_dsn, schema, "queue", "show", "adminq").stdout
    res = _admin(pg_dsn, schema, "queue", "configure", "adminq", "--deadline", "0", "--dlq", "--json")
    assert (json.loads(res.stdout)["deadline"], json.loads(res.stdout)["dlq"]) == (None, True), res
    assert "deadline none" in _admin(pg_dsn, schema, "queue", "list").stdout
    line = _one_error_line(_admin(pg_dsn, schema, "queue", "show", "nosuchq"), code=2)
    assert "no queue 'nosuchq'" in line, line


def test_version_module_entry_point_and_global_options_after_the_command(pg_dsn, schema):
    import subprocess
    import sys

    import awa_fast

    res = cli("--version")
    assert res.returncode == 0 and res.stdout.strip() == f"awa-fast {awa_fast.__version__}"
    via_module = subprocess.run([sys.executable, "-m", "awa_fast", "queue", "list", "--dsn", pg_dsn, "--schema",
                                 schema, "--json"], capture_output=True, text=True, timeout=60)
    assert via_module.returncode == 0 and json.loads(via_module.stdout) == []
    assert subprocess.run([sys.executable, "-m", "awa_fast", "--version"], capture_output=True,
                          text=True).stdout == res.stdout
    quiet = cli("queue", "list", "--dsn", pg_dsn, "--schema", schema, "--log-level", "DEBUG")
    assert quiet.returncode == 0 and "DEBUG awa_fast.cli" in quiet.stderr, quiet.stderr
    assert "using PostgreSQL at" in quiet.stderr and "(from --dsn)" in quiet.stderr
    before = cli("--log-level", "WARNING", "queue", "list", "--dsn", pg_dsn, "--schema", schema)
    assert before.returncode == 0 and before.stderr == ""


HELP_COMMANDS = [[], ["migrate"], ["db"], ["db", "start"], ["db", "stop"], ["db", "status"], ["db", "url"],
                 ["supervise"], ["status"], ["job"], ["job", "list"], ["job", "show"], ["job", "cancel"],
                 ["job", "retry"], ["queue"], ["queue", "list"], ["queue", "show"], ["queue", "configure"],
                 ["queue", "pause"], ["queue", "resume"], ["dlq"], ["dlq", "list"], ["dlq", "retry"],
                 ["dlq", "purge"], ["bench"]]


@pytest.mark.parametrize("args", HELP_COMMANDS, ids=lambda a: "-".join(a) or "top")
def test_every_help_says_what_the_command_does_with_an_example(args):
    res = cli(*args, "--help")
    assert res.returncode == 0, res.stderr
    if len(args) == 1 and args[0] in ("db", "job", "queue", "dlq"):
        assert "ACTION" in res.stdout          # groups list their actions, each with its own example
        return
    assert "example" in res.stdout and "awa-fast " in res.stdout.split("example")[1], res.stdout


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["queue", "list"], ["job", "list"],
                                  ["dlq", "list", "--json"], ["status"]])
def test_output_into_a_closed_pipe_ends_quietly(pg_dsn, schema, args):
    import subprocess
    import sys

    enqueue_one(pg_dsn, schema, "rt.sync", {}, queue="adminq")
    full = [*args] if args[0].startswith("--") else [*args, "--dsn", pg_dsn, "--schema", schema]
    proc = subprocess.Popen([sys.executable, "-m", "awa_fast", *full], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()                      # the reader is gone before the first line is written
    code = proc.wait(timeout=60)
    err = proc.stderr.read()
    proc.stderr.close()
    assert "Traceback" not in err and "BrokenPipe" not in err, err
    assert code in (0, 141), (code, err)


def test_status_and_admin_commands_never_start_the_embedded_server(tmp_path):
    home = tmp_path / "home"
    for args in (["status"], ["job", "list"], ["queue", "list"], ["dlq", "list"]):
        line = _one_error_line(cli(*args, env={"AWA_FAST_HOME": str(home)}), code=2)
        assert "embedded server" in line and "awa-fast db start" in line, line
    assert not (home / "pgdata").exists()


def test_not_migrated_hint_names_the_schema(pg_dsn):
    line = _one_error_line(cli("status", "--dsn", pg_dsn, "--schema", "nowhere_yet"), code=2)
    assert "awa-fast migrate --schema nowhere_yet" in line, line
    line = _one_error_line(cli("queue", "list", "--dsn", pg_dsn, env={"AWA_FAST_SCHEMA": "nowhere_env"}), code=2)
    assert "awa-fast migrate --schema nowhere_env" in line, line


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
