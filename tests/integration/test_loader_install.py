"""Loading the app (issue 9 item 10): the working directory never shadows an installed module.

The package is installed *non-editable* into a venv of its own (built once
for this module, ~20-60 s), and ``awa-fast supervise`` and ``awa-fast bench``
run from inside the source checkout, whose ``awa_fast/`` folder is not an
importable copy of the package (no ``awa_fast.sql``, no built extension of
that venv). An app module that fails at import, by an exception or by
``sys.exit()``, is one line and exit 2.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import psycopg
import pytest

from tests.fixtures.waiting import wait_for
from tests.integration.runtime_helpers import REPO_ROOT, cli, counts, enqueue_bulk

pytestmark = pytest.mark.integration

_PROBE_APP = '''
"""An app installed in the venv (site-packages), shadowed by a decoy in the working directory."""
import pathlib, os
from awa_fast.app import App

app = App(schema="awa_fast")


@app.job("probe.ok", queue="q")
def ok(job):
    # Written aside and renamed, so the test never reads a file created but not yet written.
    out = pathlib.Path(os.environ["AWA_PROBE_OUT"])
    (out / f".{job.id}").write_text("installed")
    (out / f".{job.id}").rename(out / f"{job.id}")
'''


@dataclass(frozen=True)
class Installed:
    venv: pathlib.Path
    site: pathlib.Path

    @property
    def awa_fast(self) -> str:
        return str(self.venv / "bin" / "awa-fast")

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if k not in ("AWA_FAST_DSN", "DATABASE_URL", "AWA_FAST_SCHEMA", "AWA_FAST_HOME", "PYTHONPATH",
                            "VIRTUAL_ENV", "PYTHONHOME", "PYTHONSAFEPATH")}
        env["PATH"] = f"{self.venv / 'bin'}:{env.get('PATH', '')}"
        env.update(extra)
        return env


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    """awa-fast installed from a copy of this checkout with ``pip install <dir>`` (not ``-e``)."""
    root = tmp_path_factory.mktemp("install")
    src = root / "src"
    files = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=REPO_ROOT,
                           capture_output=True, check=True).stdout.split(b"\0")
    for rel in filter(None, (f.decode() for f in files)):
        path = REPO_ROOT / rel
        if rel.startswith(".venv/") or not path.is_file():
            continue
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, src / rel)
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", str(src)],
                         capture_output=True, text=True, timeout=900)
    assert pip.returncode == 0, pip.stderr[-3000:]
    site = pathlib.Path(subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True).stdout.strip())
    (site / "awa_probe_app").mkdir()
    (site / "awa_probe_app" / "__init__.py").write_text(_PROBE_APP)
    inst = Installed(venv, site)
    where = subprocess.run([str(venv / "bin" / "python"), "-P", "-c", "import awa_fast; print(awa_fast.__file__)"],
                           cwd=REPO_ROOT, capture_output=True, text=True, env=inst.env(), check=True).stdout
    assert where.startswith(str(site)), f"not the installed package: {where}"
    yield inst
    shutil.rmtree(root, ignore_errors=True)


class Supervise:
    """``<venv>/bin/awa-fast supervise ...`` as a real process in its own session."""

    def __init__(self, inst: Installed, cwd: pathlib.Path, app: str, dsn: str, schema: str,
                 home: pathlib.Path, log: pathlib.Path, **env: str) -> None:
        self._log = open(log, "wb")  # noqa: SIM115 - closed in close()
        self.log_path = log
        self.proc = subprocess.Popen(
            [inst.awa_fast, "supervise", app, "--queue", "q:stripes=1,concurrency=4", "--dsn", dsn,
             "--schema", schema, "--home", str(home), "--poll-interval", "0.2", "--election-interval", "0.5"],
            cwd=str(cwd), env=inst.env(**env), stdout=self._log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True)

    def tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def alive(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"supervise exited with {self.proc.returncode}:\n{self.tail()}")
        return True

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(60)

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        self._log.close()


def _mapped_from(pid: int, directory: pathlib.Path) -> bool:
    """Does ``pid`` map awa_fast's C extension from ``directory``?"""
    maps = pathlib.Path(f"/proc/{pid}/maps").read_text()
    return any("_codec" in line and str(directory) in line for line in maps.splitlines())


def test_supervise_from_the_checkout_runs_the_installed_package(pg_dsn, schema, storage, conn, installed,
                                                                   tmp_path, monkeypatch) -> None:
    # The app module lives only in the checkout (tests/...): the working directory is searched for it,
    # after everything installed, so awa_fast itself still comes from site-packages. The proof is
    # where the claimers mapped the compiled codec from, so the children run the C implementation
    # in both passes of the suite (the Python twin's pass would load no shared object to look at).
    monkeypatch.setenv("AWA_FAST_IMPL", "c")
    sup = Supervise(installed, REPO_ROOT, "tests.integration.runtime_apps:app", pg_dsn, schema,
                    tmp_path / "home", tmp_path / "supervise.log")
    try:
        enqueue_bulk(pg_dsn, schema, "rt.sync", ({"i": i} for i in range(20)))
        wait_for(lambda: sup.alive() and counts(storage, conn).get("completed", 0) == 20, 60, "20 completions",
                 on_timeout=sup.tail)
        from tests.fixtures.supervisor import proc_children

        kids = proc_children(sup.proc.pid)
        assert kids and any(_mapped_from(p, installed.site) for p in kids), "claimers do not run the installed awa_fast"
        assert not any(_mapped_from(p, REPO_ROOT) for p in [sup.proc.pid, *kids])
        assert sup.stop() == 0, sup.tail()
    finally:
        sup.close()


def test_working_directory_never_shadows_an_installed_app(pg_dsn, schema, storage, conn, installed,
                                                           tmp_path) -> None:
    work = tmp_path / "work"
    (work / "awa_probe_app").mkdir(parents=True)
    (work / "awa_probe_app" / "__init__.py").write_text(
        "raise RuntimeError('the decoy in the working directory was imported')\n")
    out = tmp_path / "out"
    out.mkdir()
    sup = Supervise(installed, work, "awa_probe_app:app", pg_dsn, schema, tmp_path / "home",
                    tmp_path / "supervise.log", AWA_PROBE_OUT=str(out))
    try:
        [job] = enqueue_bulk(pg_dsn, schema, "probe.ok", [{}])
        wait_for(lambda: sup.alive() and (out / str(job)).exists(), 60, "the installed handler to run",
                 on_timeout=sup.tail)
        assert (out / str(job)).read_text() == "installed"
        assert sup.stop() == 0, sup.tail()
    finally:
        sup.close()


def test_bench_from_the_checkout_runs_the_installed_package(pg_dsn, installed) -> None:
    schema = "bench_t_" + uuid.uuid4().hex[:10]
    try:
        res = subprocess.run(
            [installed.awa_fast, "--log-level", "WARNING", "bench", "drain", "--jobs", "300", "--stripes", "1",
             "--concurrency", "8", "--batch", "64", "--dsn", pg_dsn, "--schema", schema, "--json"],
            cwd=REPO_ROOT, env=installed.env(), capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
        data = json.loads(res.stdout.strip().splitlines()[-1])
        assert data["scenario"] == "drain"
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as c:
            c.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


@pytest.mark.parametrize(("body", "expected"), [
    ("raise RuntimeError('boom at import')", "raised RuntimeError: boom at import"),
    ("1 / 0", "raised ZeroDivisionError"),
    ("raise SystemExit(0)", "called sys.exit(0)"),
    ("import sys\nsys.exit(3)", "called sys.exit(3)"),
    ("raise SystemExit('bye')", "called sys.exit('bye')"),
])
def test_app_import_failure_is_one_config_error_line(pg_dsn: str, tmp_path: pathlib.Path, body: str,
                                                      expected: str) -> None:
    name = "badapp_" + uuid.uuid4().hex[:8]
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body) + "\n")
    res = cli("supervise", f"{name}:app", "--dsn", pg_dsn, "--queue", "q", cwd=tmp_path)
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("awa-fast: error: ") and expected in lines[0], res.stderr
