"""The demo a new user runs first: bulk enqueue, supervise, clean drain."""

from __future__ import annotations

import os
import subprocess
import sys

import psycopg
import pytest

pytestmark = pytest.mark.integration

DEMO_SCHEMA = "awa_fast_demo"


@pytest.fixture
def demo_schema(pg_dsn):
    yield DEMO_SCHEMA
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                  "WHERE pid <> pg_backend_pid() AND application_name LIKE %s", (f"%{DEMO_SCHEMA}%",))
        c.execute(f'DROP SCHEMA IF EXISTS "{DEMO_SCHEMA}" CASCADE')


def test_demo_2000_jobs_clean_drain(pg_dsn, demo_schema, tmp_path):
    res = subprocess.run([sys.executable, "-m", "awa_fast.demo", "--jobs", "2000", "--dsn", pg_dsn],
                         capture_output=True, text=True, timeout=180, cwd=str(tmp_path), stdin=subprocess.DEVNULL)
    assert res.returncode == 0, f"stdout:\n{res.stdout}\nstderr:\n{res.stderr[-3000:]}"
    assert "clean drain" in res.stdout and "NOT clean" not in res.stdout, res.stdout
    assert "'completed': 2000" in res.stdout, res.stdout
    assert "Traceback" not in res.stderr, res.stderr
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        left = c.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE 'awa_fast:%%' "
                         "AND application_name NOT LIKE 'awa_fast:test:%%' AND pid <> pg_backend_pid() "
                         "AND (application_name LIKE %s OR application_name LIKE 'awa_fast:claimer:demo%%')",
                         (f"%{DEMO_SCHEMA}%",)).fetchone()[0]
    assert left == 0, "the demo left its supervisor's connections behind"


def test_demo_on_the_embedded_server_says_it_keeps_running_and_how_to_stop_it(tmp_path):
    """The README's first command: no DSN anywhere, so the demo starts the embedded server and leaves it up."""
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if k not in ("AWA_FAST_DSN", "DATABASE_URL", "AWA_FAST_SCHEMA")}
    env["AWA_FAST_HOME"] = str(home)
    res = subprocess.run([sys.executable, "-m", "awa_fast.demo", "--jobs", "300"], capture_output=True, text=True,
                         env=env, timeout=240, stdin=subprocess.DEVNULL)
    try:
        assert res.returncode == 0, res.stdout + res.stderr
        assert "embedded PostgreSQL running" in res.stdout, res.stdout
        assert "keeps running" in res.stdout and "awa-fast db stop" in res.stdout, res.stdout
        status = subprocess.run([sys.executable, "-m", "awa_fast", "db", "status", "--home", str(home)],
                                capture_output=True, text=True, env=env, timeout=60)
        assert status.returncode == 0, status.stdout + status.stderr  # still running, as it said
    finally:
        stop = subprocess.run([sys.executable, "-m", "awa_fast", "db", "stop", "--home", str(home)],
                              capture_output=True, text=True, env=env, timeout=120)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    status = subprocess.run([sys.executable, "-m", "awa_fast", "db", "status", "--home", str(home)],
                            capture_output=True, text=True, env=env, timeout=60)
    assert status.returncode == 1, status.stdout
