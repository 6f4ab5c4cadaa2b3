"""Finding the segments of local supervisors: one locator file per supervisor.

Each supervisor writes its own ``$AWA_FAST_HOME/run/<schema>.<pid>.json`` =
``{"shm": name, "pid": pid, "started": time}`` and removes only its own
(:func:`write_locator`, :func:`read_locators`, :func:`read_locator`,
:func:`remove_locator`).
"""

from __future__ import annotations

import json
import os
import pathlib
import time

from awa_fast.runtime.shm.records import pid_alive as _pid_alive
from awa_fast.storage.schema import validate_schema

__all__ = ["read_locator", "read_locators", "remove_locator", "write_locator"]


# One file per supervisor, ``<home>/run/<schema>.<pid>.json``: two supervisors
# of one schema on one host (a rolling restart, two apps) each keep their own,
# and the first to exit removes only its own. Schema names hold no '.', so the
# pattern never matches another schema's files.
def _locator_dir(home: str | os.PathLike[str]) -> pathlib.Path:
    return pathlib.Path(home) / "run"


def _locator_path(home: str | os.PathLike[str], schema: str, pid: int) -> pathlib.Path:
    return _locator_dir(home) / f"{validate_schema(schema)}.{int(pid)}.json"


def _read_one(path: pathlib.Path) -> tuple[str, int, float] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        name, pid, started = data["shm"], data["pid"], data.get("started", 0.0)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if not isinstance(name, str) or not isinstance(pid, int) or isinstance(pid, bool) \
            or not isinstance(started, (int, float)):
        return None
    return name, pid, float(started)


def _locator_files(home: str | os.PathLike[str], schema: str) -> list[pathlib.Path]:
    validate_schema(schema)
    d = _locator_dir(home)
    # <schema>.json: the single locator of earlier versions, still read while such a supervisor runs
    return sorted([*d.glob(f"{schema}.[0-9]*.json"), d / f"{schema}.json"])


def write_locator(home: str | os.PathLike[str], schema: str, name: str, pid: int) -> pathlib.Path:
    """Write ``<home>/run/<schema>.<pid>.json`` = ``{"shm": name, "pid": pid, "started": t}`` atomically.

    Locators of this schema whose supervisor is dead (killed with SIGKILL)
    are removed on the way.
    """
    path = _locator_path(home, schema, pid)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    for other in _locator_files(home, schema):
        found = _read_one(other)
        if other != path and found is not None and not _pid_alive(found[1]):
            try:
                other.unlink()
            except OSError:
                pass
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"shm": name, "pid": pid, "started": time.time()}), encoding="utf-8")
    os.replace(tmp, path)
    return path


def read_locators(home: str | os.PathLike[str], schema: str) -> list[tuple[str, int]]:
    """``(name, pid)`` of every live local supervisor of ``schema``, oldest first."""
    live = []
    for path in _locator_files(home, schema):
        found = _read_one(path)
        if found is not None and _pid_alive(found[1]):
            live.append(found)
    live.sort(key=lambda f: (f[2], f[1]))
    seen: set[str] = set()
    out = []
    for name, pid, _ in live:
        if name not in seen:
            seen.add(name)
            out.append((name, pid))
    return out


def read_locator(home: str | os.PathLike[str], schema: str) -> tuple[str, int] | None:
    """``(name, pid)`` of the oldest live local supervisor of ``schema`` (see :func:`read_locators`); else None."""
    found = read_locators(home, schema)
    return found[0] if found else None


def remove_locator(home: str | os.PathLike[str], schema: str, name: str | None = None,
                   pid: int | None = None) -> bool:
    """Remove the locator of supervisor ``pid`` (default: this process), never another's.

    With ``name``, only if it still names that segment. True if removed.
    """
    path = _locator_path(home, schema, os.getpid() if pid is None else pid)
    if name is not None:
        found = _read_one(path)
        if found is None or found[0] != name:
            return False
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True
