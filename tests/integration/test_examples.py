"""The recipes under examples/, each run for real: servers on loopback, scripts and commands as processes."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shlex
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import httpx
import psycopg

from awa_fast.app import App
from awa_fast.testing import assert_enqueued, assert_not_enqueued
from tests.fixtures.waiting import wait_for
from tests.integration.runtime_helpers import REPO_ROOT, counts

EXAMPLES = REPO_ROOT / "examples"


def _env(pg_dsn: str, schema: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("AWA_FAST_DSN", "DATABASE_URL", "AWA_FAST_SCHEMA", "AWA_FAST_HOME", "PYTHONPATH")}
    env.update(DATABASE_URL=pg_dsn, AWA_FAST_SCHEMA=schema, **extra)
    return env


@contextmanager
def asgi_server(app_ref: str, app_dir: pathlib.Path, env: dict[str, str], log: pathlib.Path,
                lifespan: str = "on") -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """uvicorn serving ``app_ref`` on a loopback socket bound here (no port race), until the block ends."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "uvicorn", app_ref, "--app-dir", str(app_dir),
                                 "--fd", str(sock.fileno()), "--lifespan", lifespan, "--log-level", "info"],
                                pass_fds=[sock.fileno()], env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=str(app_dir))
        sock.close()
        try:
            def up() -> bool:
                if proc.poll() is not None:
                    raise AssertionError(f"uvicorn exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
                return "Uvicorn running on" in log.read_text(errors="replace")  # after lifespan startup
            wait_for(up, 60, "uvicorn startup", on_timeout=lambda: log.read_text()[-3000:])
            yield base, proc
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)


def test_fastapi_enqueues_in_the_request_transaction_and_its_lifespan_worker_runs_the_job(
        pg_dsn, schema, storage, conn, tmp_path):
    log = tmp_path / "uvicorn.log"
    app = App(pg_dsn, schema)
    with asgi_server("main:api", EXAMPLES / "fastapi_app", _env(pg_dsn, schema), log) as (base, proc):
        with httpx.Client(base_url=base, timeout=30) as http:
            r = http.post("/signup", json={"email": "ada@example.com"})
            assert r.status_code == 201, r.text
            signup_id, job_id = r.json()["signup_id"], r.json()["job_id"]
            wait_for(lambda: http.get(f"/signup/{signup_id}").json()["welcomed"], 30, "the welcome job",
                     on_timeout=lambda: log.read_text()[-3000:])
            # the handler's row commits before its completion does (the batcher's own transaction)
            wait_for(lambda: storage.job_load(conn, job_id)["state"] == "completed", 30,
                     "the welcome job's completion")

            refused = http.post("/signup", json={"email": "eve@invalid.example"})
            assert refused.status_code == 422
            assert_not_enqueued(app, "send_welcome")  # the row and its job rolled back together
            assert counts(storage, conn, "email") == {"completed": 1}
        proc.send_signal(signal.SIGTERM)  # uvicorn's shutdown cancels the worker task: it drains
        # uvicorn re-raises the signal it handled once shut down: -SIGTERM is its clean exit
        assert proc.wait(60) in (0, -signal.SIGTERM), log.read_text()[-3000:]
    text = log.read_text()
    assert "Application shutdown complete" in text and "Traceback" not in text and "ERROR" not in text, text
    with psycopg.connect(pg_dsn) as c:
        assert c.execute("SELECT count(*) FROM signups WHERE email = 'eve@invalid.example'").fetchone()[0] == 0
        # no connection of the worker outlives the server
        assert c.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE 'awa_fast:%%' "
                         "AND application_name NOT LIKE 'awa_fast:test:%%'").fetchone()[0] == 0
    app.close()


def test_django_view_enqueues_in_transaction_atomic_through_djangos_psycopg_connection(
        pg_dsn, schema, storage, conn, tmp_path):
    site = EXAMPLES / "django_app"
    env = _env(pg_dsn, schema, DJANGO_SETTINGS_MODULE="signup_site.settings")
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute("CREATE TABLE IF NOT EXISTS subscribers (id bigserial PRIMARY KEY, email text NOT NULL, "
                  "confirmed_at timestamptz)")
    app = App(pg_dsn, schema)
    # Django's ASGI handler speaks no lifespan protocol: the jobs run in `awa-fast supervise` below.
    with asgi_server("signup_site.asgi:application", site, env, tmp_path / "uvicorn.log", lifespan="off") as (base, _):
        with httpx.Client(base_url=base, timeout=30) as http:
            ok = http.post("/subscribe", json={"email": "grace@example.com"})
            assert ok.status_code == 201, ok.text
            refused = http.post("/subscribe", json={"email": "mallory@invalid.example"})
            assert refused.status_code == 422, refused.text
    subscriber_id, job_id = ok.json()["subscriber_id"], ok.json()["job_id"]
    assert_enqueued(app, "send_confirmation", {"subscriber_id": subscriber_id}, count=1)  # only the committed one
    with open(tmp_path / "supervise.log", "wb") as out:
        sup = subprocess.Popen([sys.executable, "-m", "awa_fast.cli", "supervise", "signup_site.jobs:awa",
                                "--queue", "email", "--dsn", pg_dsn, "--schema", schema,
                                "--home", str(tmp_path / "home")],
                               cwd=str(site), env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            wait_for(lambda: storage.job_load(conn, job_id)["state"] == "completed", 60, "the confirmation job",
                     on_timeout=lambda: (tmp_path / "supervise.log").read_text()[-3000:])
            sup.send_signal(signal.SIGTERM)
            assert sup.wait(60) == 0, (tmp_path / "supervise.log").read_text()[-3000:]
        finally:
            if sup.poll() is None:
                sup.kill()
                sup.wait(30)
    with psycopg.connect(pg_dsn) as c:
        rows = c.execute("SELECT email, confirmed_at IS NOT NULL FROM subscribers ORDER BY id").fetchall()
    assert ("grace@example.com", True) in rows and not [r for r in rows if r[0] == "mallory@invalid.example"]
    app.close()


def test_pipeline_bulk_enqueues_by_copy_and_drains_10000_jobs_until_empty(pg_dsn, schema, storage, conn):
    res = subprocess.run([sys.executable, str(EXAMPLES / "pipeline.py"), "--dsn", pg_dsn, "--schema", schema,
                          "--count", "10000", "--json"], capture_output=True, text=True, timeout=300,
                         env=_env(pg_dsn, schema), cwd=str(REPO_ROOT), stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["enqueued"] == 10_000
    assert (out["completed"], out["retried"], out["failed"], out["cancelled"]) == (10_000, 0, 0, 0)
    assert out["empty"] and out["clean"] and out["claimed"] == 10_000
    assert counts(storage, conn, "pipeline") == {"completed": 10_000}


# -- deploy recipes: the systemd unit and the Kubernetes Deployment, run as written --------------

DEPLOY = EXAMPLES / "deploy"
DEPLOY_APP = "tests.integration.worker_apps:deploy_app"
_SUPERVISOR_MARGIN = 5.0  # Supervisor._drain waits drain_timeout + 5 s before it SIGKILLs children


def _deploy_env(pg_dsn: str, schema: str, home: pathlib.Path, base: dict[str, str] | None = None) -> dict[str, str]:
    env = _env(pg_dsn, schema)
    env.pop("DATABASE_URL")
    env.update(base or {})
    env.update(AWA_FAST_DSN=pg_dsn, AWA_FAST_SCHEMA=schema, AWA_FAST_HOME=str(home),
               PATH=f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    return env


def _with_app(argv: Sequence[str]) -> list[str]:
    """The recipe's own command line with its application replaced by the test app (and this venv's awa-fast)."""
    assert argv[1] == "supervise" and ":" in argv[2], argv
    exe = pathlib.Path(sys.executable).parent / "awa-fast"
    return [str(exe), "supervise", DEPLOY_APP, *argv[3:]]


def _run_until_drained(cmd: list[str], env: dict[str, str], storage, conn, log: pathlib.Path,  # noqa: ANN001
                       stop_within: float, ready: object = None) -> None:
    app = App(env["AWA_FAST_DSN"], env["AWA_FAST_SCHEMA"])
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, cwd=str(REPO_ROOT), stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            if ready is not None:
                wait_for(ready, 60, "the recipe's readiness", on_timeout=lambda: log.read_text()[-3000:])
            app.enqueue_many("deploy.noop", ({"i": i} for i in range(50)), queue="default")
            wait_for(lambda: counts(storage, conn, "default").get("completed", 0) == 50, 60, "50 jobs",
                     on_timeout=lambda: log.read_text()[-3000:])
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(stop_within) == 0, log.read_text()[-3000:]
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
    assert "supervisor drained (clean)" in log.read_text()
    app.close()


def _unit(path: pathlib.Path) -> dict[str, dict[str, list[str]]]:
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        key, _, value = line.partition("=")
        assert current is not None and _, f"not a unit file line: {raw!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def test_systemd_unit_execstart_runs_and_drains_on_sigterm_within_timeoutstopsec(
        pg_dsn, schema, storage, conn, tmp_path):
    unit = _unit(DEPLOY / "awa-fast.service")
    svc = unit["Service"]
    argv = shlex.split(svc["ExecStart"][0])
    drain = float(argv[argv.index("--drain-timeout") + 1])
    stop_timeout = float(svc["TimeoutStopSec"][0])
    assert stop_timeout > drain + _SUPERVISOR_MARGIN
    assert svc["KillSignal"] == ["SIGTERM"] and svc["KillMode"] == ["mixed"]
    assert svc["RestartPreventExitStatus"] == ["2"]
    cmd = _with_app(argv)
    if subprocess.run(["sh", "-c", "command -v systemd-analyze"], capture_output=True).returncode == 0:
        # systemd's own parser, on the unit as written but for this venv's binary
        local = tmp_path / "awa-fast.service"
        local.write_text((DEPLOY / "awa-fast.service").read_text().replace(argv[0], cmd[0]))
        res = subprocess.run(["systemd-analyze", "verify", str(local)], capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stdout + res.stderr
    assert subprocess.run([cmd[0], "supervise", "--help"], capture_output=True, timeout=60).returncode == 0
    environment = dict(e.split("=", 1) for e in svc.get("Environment", []))
    assert "AWA_FAST_HOME" in environment
    _run_until_drained(cmd, _deploy_env(pg_dsn, schema, tmp_path / "home", environment), storage, conn,
                       tmp_path / "unit.log", stop_timeout)


def _manifest_commands(path: pathlib.Path) -> list[list[str]]:
    return [json.loads(m.group(1)) for m in re.finditer(r"^\s*command: (\[.*\])\s*$", path.read_text(), re.M)]


def test_kubernetes_deployment_commands_run_and_the_grace_period_covers_the_drain(
        pg_dsn, schema, storage, conn, tmp_path):
    manifest = DEPLOY / "k8s-deployment.yaml"
    grace = float(re.search(r"^\s*terminationGracePeriodSeconds: (\d+)\s*$", manifest.read_text(), re.M).group(1))
    migrate_cmd, supervise_cmd, probe_cmd = _manifest_commands(manifest)
    assert migrate_cmd[:2] == ["awa-fast", "migrate"] and supervise_cmd[:2] == ["awa-fast", "supervise"]
    drain = float(supervise_cmd[supervise_cmd.index("--drain-timeout") + 1])
    assert grace > drain + _SUPERVISOR_MARGIN
    env = _deploy_env(pg_dsn, schema, tmp_path / "home")
    res = subprocess.run(migrate_cmd, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "already up to date" in res.stdout, res.stderr

    def probe() -> int:
        return subprocess.run(probe_cmd, env=env, capture_output=True, timeout=60).returncode

    assert probe() == 1  # no supervisor in this "pod" yet: not alive
    _run_until_drained(_with_app(supervise_cmd), env, storage, conn, tmp_path / "pod.log", grace,
                       ready=lambda: probe() == 0)
    assert probe() == 1
    dead_db = dict(env, AWA_FAST_DSN="host=/nonexistent port=5 dbname=x connect_timeout=2")
    assert subprocess.run(probe_cmd, env=dead_db, capture_output=True, timeout=60).returncode == 0


def test_docs_deploy_md_includes_the_deploy_files_as_they_are():
    doc = (REPO_ROOT / "docs" / "deploy.md").read_text()
    for name in ("awa-fast.service", "k8s-deployment.yaml"):
        assert (DEPLOY / name).read_text().strip() in doc, f"docs/deploy.md is out of date with examples/deploy/{name}"


def test_the_sample_user_project_passes_its_own_suite_with_only_awa_fast_testing(tmp_path):
    """examples/testing as a user runs it: its own pytest configuration, the plugin loaded by its entry point.

    Its awa_dsn starts a private PostgreSQL of its own (unless AWA_FAST_TEST_DSN is set).
    """
    sample = EXAMPLES / "testing"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "PYTHONPATH")}
    env["PYTHONPATH"] = str(sample)  # or `pip install -e examples/testing`
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "--basetemp", str(tmp_path / "sample")], cwd=str(sample), env=env,
                         capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert re.search(r"\b5 passed\b", res.stdout), res.stdout[-2000:]
