"""The embedded server against a hostile local user (issue 9, items 5, 8 and 9).

- TCP is never trusted: initdb writes no ``host ... trust`` line, a generated
  password (0600 file next to the data directory) is needed over TCP, and a
  TCP listener is refused on a data directory without one.
- The home is not trusted blindly: a lock file or settings temp file planted
  as a symlink is never followed, and a home another user can write (or
  owns) is refused with one clear line.
- The postmaster's environment carries none of the caller's DSNs or secrets.

Real PostgreSQL (the embedded wheel's), real processes; as root the server
runs in a user namespace (see awa_fast/embedded/privileges.py).
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


@pytest.fixture(scope="module")
def tcp_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PostgresCluster]:
    """One initdb'd server listening on 127.0.0.1 (a free port)."""
    home = tmp_path_factory.mktemp("tcp")
    c = PostgresCluster(
        home / "pgdata",
        embedded.embedded_bindir(),
        settings={**FAST, "listen_addresses": "127.0.0.1", "port": str(free_port())},
    )
    c.init()
    c.start()
    yield c
    c.stop("immediate")


# -- item 5: TCP is never trusted ----------------------------------------------------


def test_initdb_trusts_the_unix_socket_only(tcp_cluster: PostgresCluster) -> None:
    lines = hba_lines(tcp_cluster.datadir)
    host = [t for t in lines if t[0] in HOST_TYPES]
    assert host, lines  # loopback TCP lines exist ...
    assert not [t for t in host if "trust" in t], host  # ... and none of them trusts
    assert all(t[-1] == "scram-sha-256" for t in host), host
    assert all(t[-1] == "trust" for t in lines if t[0] == "local"), lines
    # the generated password: a private file of the caller's, next to the data directory
    pf = tcp_cluster.password_file
    assert pf == tcp_cluster.datadir.with_name("pgdata.pgpass")
    st = os.lstat(pf)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_uid == os.geteuid()
    password = tcp_cluster.password()
    assert password and len(password) >= 32


def test_tcp_without_the_password_is_refused(tcp_cluster: PostgresCluster) -> None:
    base = {"host": "127.0.0.1", "port": tcp_cluster.port, "user": "postgres",
            "dbname": "postgres", "sslmode": "disable", "connect_timeout": 10}
    empty = pathlib.Path(os.devnull)
    # no password at all (an empty passfile, so nothing of ~/.pgpass helps)
    with pytest.raises(psycopg.OperationalError, match="password"):
        psycopg.connect(make_conninfo("", **base, passfile=str(empty)))
    with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
        psycopg.connect(make_conninfo("", **base, password="not-the-password"))
    # with the password file: a superuser connection over TCP
    dsn = tcp_cluster.tcp_dsn()
    assert tcp_cluster.password() not in dsn  # the DSN names the file, never the password
    assert conninfo_to_dict(dsn)["passfile"] == str(tcp_cluster.password_file)
    with psycopg.connect(dsn, connect_timeout=10) as conn:
        row = conn.execute("SELECT inet_client_addr() IS NOT NULL, current_user").fetchone()
    assert row == (True, "postgres")
    # the unix socket still trusts (its directory is private to the owner)
    with psycopg.connect(tcp_cluster.dsn, connect_timeout=10) as conn:
        assert conn.execute("SELECT inet_client_addr() IS NULL").fetchone() == (True,)


def test_tcp_listener_refused_without_the_password(
    tmp_path: pathlib.Path, clusters: Callable[..., PostgresCluster]
) -> None:
    tcp = {"listen_addresses": "127.0.0.1", "port": str(free_port())}
    c = clusters(tmp_path / "pgdata", **tcp)
    c.init()
    saved = c.password_file.read_bytes()
    # a data directory without its password file (as an older awa-fast left it)
    c.password_file.unlink()
    with pytest.raises(ConfigError, match=r"listen_addresses='127\.0\.0\.1'.*no password file"):
        c.start()
    assert not c.running()
    with pytest.raises(ConfigError, match="no password file"):
        c.tcp_dsn()
    # the password is back, but pg_hba.conf trusts TCP (an older awa-fast's initdb -A trust)
    fd = os.open(c.password_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, saved)
    os.close(fd)
    hba = c.datadir / "pg_hba.conf"
    original = hba.read_text()
    hba.write_text(original + "host all all 127.0.0.1/32 trust\n")
    with pytest.raises(ConfigError, match="trusts TCP"):
        c.start()
    assert not c.running()
    # without TCP the same data directory starts (unix socket only)
    local = clusters(c.datadir)
    assert local.settings["listen_addresses"] == ""
    with psycopg.connect(local.start(), connect_timeout=10) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
    local.stop()
    hba.write_text(original)
    with psycopg.connect(c.start(), connect_timeout=10) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
    c.stop()


def test_settings_cannot_move_authentication() -> None:
    for name in ("hba_file", "ident_file", "include", "include_dir", "config_file"):
        with pytest.raises(ConfigError, match="managed by PostgresCluster"):
            PostgresCluster(pathlib.Path("/x/pgdata"), pathlib.Path("/y"), settings={name: "/z"})


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


def test_symlinked_password_file_is_refused(tcp_cluster: PostgresCluster, tmp_path: pathlib.Path) -> None:
    other = PostgresCluster(tmp_path / "pgdata", tcp_cluster.bindir)
    os.symlink(tcp_cluster.password_file, other.password_file)
    with pytest.raises(ConfigError, match=f"cannot open password file {other.password_file}"):
        other.password()


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
