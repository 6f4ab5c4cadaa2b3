"""The embedded server against a hostile local user (issue 9, items 8 and 9).

- The home is not trusted blindly: a lock file or settings temp file planted
  as a symlink is never followed, and a home another user can write (or
  owns) is refused with one clear line.
- The postmaster's environment carries none of the caller's DSNs or secrets.

Real PostgreSQL (the embedded wheel's), real processes; as root the server
runs in a user namespace (see awa_fast/embedded.py).
"""

from __future__ import annotations

import os
import pathlib
import pwd
import socket
import stat
from collections.abc import Callable, Iterator

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from awa_fast import embedded
from awa_fast.embedded import PostgresCluster
from awa_fast.errors import ConfigError

pytestmark = pytest.mark.integration

IS_ROOT = os.geteuid() == 0
FAST = {"autovacuum": "off", "shared_buffers": "32MB"}
HOST_TYPES = ("host", "hostssl", "hostnossl", "hostgssenc", "hostnogssenc")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def hba_lines(datadir: pathlib.Path) -> list[list[str]]:
    out = []
    for line in (datadir / "pg_hba.conf").read_text().splitlines():
        tokens = line.split("#", 1)[0].split()
        if tokens:
            out.append(tokens)
    return out


@pytest.fixture
def clusters() -> Iterator[Callable[..., PostgresCluster]]:
    """Make clusters; every one still running at teardown is crash-stopped."""
    made: list[PostgresCluster] = []

    def make(datadir: pathlib.Path, **settings: str) -> PostgresCluster:
        c = PostgresCluster(datadir, embedded.embedded_bindir(), settings={**FAST, **settings})
        made.append(c)
        return c

    yield make
    for c in made:
        if c.running():
            c.stop("immediate")


# -- item 9: the home is not trusted blindly -------------------------------------------


def test_symlinked_lock_file_is_not_followed(
    tmp_path: pathlib.Path, clusters: Callable[..., PostgresCluster]
) -> None:
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    victim = elsewhere / "victim"
    victim.write_text("precious\n")
    os.chmod(victim, 0o644)
    c = clusters(home / "pgdata")
    os.symlink(victim, c.lock_path)
    with pytest.raises(ConfigError, match=rf"lock file {c.lock_path}.*symlink"):
        c.init()
    assert victim.read_text() == "precious\n" and stat.S_IMODE(victim.stat().st_mode) == 0o644
    assert not c.datadir.exists()
    # a dangling link is not followed either: nothing is created at its target
    c.lock_path.unlink()
    os.symlink(elsewhere / "created-by-us", c.lock_path)
    with pytest.raises(ConfigError, match="symlink"):
        c.init()
    assert not (elsewhere / "created-by-us").exists()


def test_symlinked_settings_temp_file_is_not_followed(
    tmp_path: pathlib.Path, clusters: Callable[..., PostgresCluster]
) -> None:
    """``.awa_fast.conf.tmp`` in the data directory (which belongs to the server's user in
    setpriv mode) planted as a symlink: the start rewrites the settings, not the target."""
    c = clusters(tmp_path / "pgdata")
    c.init()
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    os.chmod(victim, 0o644)
    os.symlink(victim, c.datadir / ".awa_fast.conf.tmp")
    with psycopg.connect(c.start(), connect_timeout=10) as conn:
        assert conn.execute("SHOW autovacuum").fetchone() == ("off",)
    assert victim.read_text() == "precious\n" and stat.S_IMODE(victim.stat().st_mode) == 0o644
    conf = c.datadir / "awa_fast.conf"
    assert not conf.is_symlink() and "autovacuum = 'off'" in conf.read_text()
    c.stop()


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o777], ids=lambda m: f"{m:o}")
def test_home_writable_by_others_is_refused(
    tmp_path: pathlib.Path, clusters: Callable[..., PostgresCluster], mode: int
) -> None:
    home = tmp_path / "home"
    home.mkdir()
    os.chmod(home, mode)
    c = clusters(home / "pgdata")
    with pytest.raises(ConfigError) as info:
        c.init()
    message = str(info.value)
    assert "\n" not in message
    assert f"unsafe home {home}" in message and f"chmod go-w {home}" in message, message
    assert list(home.iterdir()) == []  # nothing written: no lock, no password, no initdb dir
    assert stat.S_IMODE(home.stat().st_mode) == mode  # and nothing loosened or fixed behind our back


def test_parent_writable_by_others_is_refused_unless_sticky(
    tmp_path: pathlib.Path, clusters: Callable[..., PostgresCluster]
) -> None:
    parent = tmp_path / "shared"
    parent.mkdir()
    os.chmod(parent, 0o777)  # anyone could rename our home away and put theirs in its place
    home = parent / "home"
    home.mkdir(mode=0o700)
    c = clusters(home / "pgdata")
    with pytest.raises(ConfigError, match=rf"{parent} \(a parent directory of the home\) is writable"):
        c.init()
    os.chmod(parent, 0o1777)  # sticky, like /tmp: others cannot rename our entry
    c.init()
    assert c.initialized()


@pytest.mark.skipif(not IS_ROOT, reason="needs root to give a directory to another user")
def test_home_owned_by_another_user_is_refused(
    tmp_path: pathlib.Path, clusters: Callable[..., PostgresCluster]
) -> None:
    nobody = pwd.getpwnam("nobody")
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    os.chown(home, nobody.pw_uid, nobody.pw_gid)
    c = clusters(home / "pgdata")
    with pytest.raises(ConfigError, match=rf"unsafe home {home}: {home} \(the home\) is owned by nobody"):
        c.init()
    assert list(home.iterdir()) == []


def test_missing_home_is_created_private(
    tmp_path: pathlib.Path, clusters: Callable[..., PostgresCluster]
) -> None:
    old = os.umask(0o002)  # a umask that would make new directories group-writable
    try:
        c = clusters(tmp_path / "a" / "b" / "pgdata")
        c.init()
    finally:
        os.umask(old)
    for d in (tmp_path / "a", tmp_path / "a" / "b"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d


# -- item 8 (embedded part): no DSN or secret in the postmaster's environment ----------------


def test_postmaster_environment_has_no_dsn_or_secret(
    tmp_path: pathlib.Path, clusters: Callable[..., PostgresCluster], monkeypatch: pytest.MonkeyPatch
) -> None:
    secrets = {
        "AWA_FAST_DSN": "postgresql://app:dsn-Secret-1@db.example/app",
        "DATABASE_URL": "postgresql://app:url-Secret-2@db.example/app",
        "PGPASSWORD": "pg-Secret-3",
        "PGPASSFILE": "/root/secret-pgpass-4",
        "APP_API_TOKEN": "token-Secret-5",
    }
    for key, value in secrets.items():
        monkeypatch.setenv(key, value)
    c = clusters(tmp_path / "pgdata")
    c.init()
    c.start()
    pid = c.pid()
    assert pid is not None
    raw = pathlib.Path(f"/proc/{pid}/environ").read_bytes()
    env = dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)
    assert env, "could not read the postmaster's environment"
    leaked = {k for k in secrets if k in env} | {k for k, v in secrets.items() if v in raw.decode()}
    assert not leaked, f"the postmaster inherited {sorted(leaked)}"
    assert env.get("LC_ALL") == "C"
    # and a backend (what COPY ... PROGRAM runs under) sees none of them either
    with psycopg.connect(c.dsn, autocommit=True, connect_timeout=10) as conn:
        conn.execute("CREATE TEMP TABLE e (line text)")
        conn.execute("COPY e FROM PROGRAM 'env'")
        lines = [r[0] for r in conn.execute("SELECT line FROM e").fetchall()]
    assert lines and not [line for line in lines if any(v in line for v in secrets.values())], lines
    c.stop()
