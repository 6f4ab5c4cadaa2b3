"""Ready-made servers: the embedded default under the home, and a private throwaway one.

The embedded default (``ensure_embedded``, ``stop_embedded``,
``embedded_status``) is ``<home>/pgdata`` with the wheel's binaries; it
keeps running until stopped. :func:`private_server` is a server for one
block of code (a test session, a tool run, a benchmark): started on entry,
stopped on exit, its files removed unless the caller chose where they live.
"""

from __future__ import annotations

import contextlib
import pathlib
import shutil
import tempfile
from collections.abc import Iterator, Mapping

from awa_fast.embedded.binaries import embedded_bindir, system_bindir
from awa_fast.embedded.cluster import PostgresCluster
from awa_fast.embedded.home import default_home
from awa_fast.errors import ConfigError


def _embedded_cluster(
    home: pathlib.Path | None, settings: Mapping[str, str] | None = None
) -> PostgresCluster:
    home = default_home() if home is None else pathlib.Path(home)
    return PostgresCluster(home / "pgdata", embedded_bindir(), settings=settings)


def ensure_embedded(
    home: pathlib.Path | None = None,
    *,
    settings: Mapping[str, str] | None = None,
    timeout: float = 60,
) -> str:
    """Init (if needed) and start the embedded server under ``home/pgdata``; return its DSN."""
    cluster = _embedded_cluster(home, settings)
    cluster.init()
    return cluster.start(timeout=timeout)


def stop_embedded(home: pathlib.Path | None = None, *, mode: str = "fast") -> bool:
    """Stop the embedded server; True if one was running."""
    cluster = _embedded_cluster(home)
    if not cluster.running():
        return False
    cluster.stop(mode)
    return True


def embedded_status(home: pathlib.Path | None = None) -> dict[str, object]:
    """``running``, ``pid``, ``datadir``, ``dsn``, ``version`` of the embedded server."""
    cluster = _embedded_cluster(home)
    pid = cluster.pid()
    return {
        "running": pid is not None,
        "pid": pid,
        "datadir": str(cluster.datadir),
        "dsn": cluster.dsn,
        "version": cluster.version(),
    }


@contextlib.contextmanager
def private_server(
    directory: pathlib.Path | None = None,
    *,
    settings: Mapping[str, str] | None = None,
    bindir: pathlib.Path | None = None,
    stop_mode: str = "immediate",
    prefix: str = "awa-fast-pg-",
    timeout: float = 60,
) -> Iterator[PostgresCluster]:
    """A throwaway PostgreSQL server for the ``with`` block: initialized, started, then stopped.

    The data directory is ``directory/data`` when ``directory`` is given (left
    in place afterwards, e.g. pytest's ``tmp_path``, for a post mortem), else
    ``data`` in a fresh temporary directory named ``prefix...``, removed with
    everything in it on exit. The binaries are ``bindir``, else the machine's
    (:func:`system_bindir`), else the embedded wheel's. ``settings`` go to
    :class:`PostgresCluster` unchanged; the server listens on its unix socket
    only (``cluster.dsn``) unless they set ``listen_addresses``. On exit it is
    stopped with ``stop_mode`` (``immediate`` by default: nothing to keep).
    """
    if stop_mode not in ("fast", "immediate", "smart"):
        raise ConfigError(f"stop_mode must be fast, immediate or smart, not {stop_mode!r}")
    owned = directory is None
    root = pathlib.Path(tempfile.mkdtemp(prefix=prefix)) if directory is None else pathlib.Path(directory)
    try:
        cluster = PostgresCluster(root / "data", bindir or system_bindir() or embedded_bindir(), settings=settings)
        cluster.init()
        cluster.start(timeout=timeout)
        try:
            yield cluster
        finally:
            cluster.stop(stop_mode)
    finally:
        if owned:
            shutil.rmtree(root, ignore_errors=True)
