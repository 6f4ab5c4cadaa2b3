"""Running the PostgreSQL binaries without root.

PostgreSQL refuses to run as root. When this process is root the binaries
run inside a fresh user namespace with no uid mapping (``unshare --user``):
the server sees itself as the overflow uid ``nobody``, holds no capability
on the host, and still owns its root-owned files, even under a 0700 home.
Where user namespaces are blocked, the server runs as ``nobody`` through
``setpriv`` on a data directory owned by ``nobody``; nothing else changes
owner or mode. Non-root users run the binaries directly. The binaries get a
minimal environment (no DSNs, passwords or other secrets of the caller).
"""

from __future__ import annotations

import functools
import logging
import os
import pathlib
import pwd
import shutil
import subprocess
from dataclasses import dataclass

from awa_fast.errors import ConfigError

log = logging.getLogger("awa_fast.embedded")

# The only variables of the caller the binaries see (everything else, DSNs and
# passwords included, would be readable by any superuser session).
_CHILD_ENV_KEEP = ("PATH", "TZ", "TMPDIR", "LD_LIBRARY_PATH")


@functools.cache
def _userns_available() -> bool:
    """True if ``unshare --user`` works here (probed once per process)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return False
    try:
        probe = subprocess.run(
            [unshare, "--user", "--", "true"],
            capture_output=True,
            timeout=10,
            check=False,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return probe.returncode == 0


@dataclass(frozen=True)
class _RunAs:
    """How the PostgreSQL binaries are launched, and who owns the files."""

    kind: str  # "direct" | "userns" | "setpriv"
    uid: int  # owner of the data directory
    gid: int

    def prefix(self) -> list[str]:
        if self.kind == "userns":
            return [_tool("unshare"), "--user", "--"]
        if self.kind == "setpriv":
            return [
                _tool("setpriv"),
                f"--reuid={self.uid}",
                f"--regid={self.gid}",
                "--clear-groups",
                "--",
            ]
        return []

    def chown(self, path: pathlib.Path) -> None:
        """Give ``path`` to the server's user (setpriv mode only)."""
        if self.kind == "setpriv":
            os.chown(path, self.uid, self.gid, follow_symlinks=False)


def _tool(name: str) -> str:
    path = shutil.which(name) or shutil.which(name, path="/usr/bin:/bin:/usr/sbin:/sbin")
    if path is None:
        raise ConfigError(f"`{name}` (util-linux) is needed to run PostgreSQL as root")
    return path


def _nobody() -> tuple[int, int]:
    try:
        entry = pwd.getpwnam("nobody")
    except KeyError as exc:
        raise ConfigError(
            "running as root without user namespaces needs the `nobody` user; "
            "run awa-fast as an ordinary user instead"
        ) from exc
    return entry.pw_uid, entry.pw_gid


def _blocking_dir(path: pathlib.Path, uid: int, gid: int) -> pathlib.Path | None:
    """First directory on the way to ``path`` that ``uid`` cannot traverse."""
    for directory in [*reversed(path.parents), path]:
        try:
            st = os.stat(directory)
        except FileNotFoundError:
            return None  # created later by root, owned appropriately
        if st.st_uid == uid:
            bits = st.st_mode >> 6
        elif st.st_gid == gid:
            bits = st.st_mode >> 3
        else:
            bits = st.st_mode
        if not bits & 0o1:
            return directory
    return None


def _run_as_existing(datadir: pathlib.Path) -> _RunAs:
    """How to launch binaries on the existing data directory ``datadir``."""
    if os.geteuid() != 0:
        return _RunAs("direct", os.geteuid(), os.getegid())
    st = os.stat(datadir)
    if st.st_uid != 0:
        # Owned by an ordinary user (e.g. nobody, from the setpriv fallback).
        return _RunAs("setpriv", st.st_uid, st.st_gid)
    if not _userns_available():
        raise ConfigError(
            f"{datadir} is owned by root; PostgreSQL refuses to run as root and "
            "user namespaces (`unshare --user`) are blocked here. Run awa-fast as an "
            "ordinary user, or use a new data directory (it will be owned by `nobody`)."
        )
    return _RunAs("userns", 0, 0)


def _run_as_new() -> _RunAs:
    """How to launch initdb for a new data directory."""
    if os.geteuid() != 0:
        return _RunAs("direct", os.geteuid(), os.getegid())
    if _userns_available():
        return _RunAs("userns", 0, 0)
    uid, gid = _nobody()
    log.info("user namespaces are blocked: PostgreSQL will run as nobody via setpriv")
    return _RunAs("setpriv", uid, gid)


def _check_reachable(run_as: _RunAs, *targets: pathlib.Path) -> None:
    """Refuse (setpriv mode) when the server's user cannot enter one of ``targets``."""
    if run_as.kind != "setpriv":
        return
    for target in targets:
        blocked = _blocking_dir(target, run_as.uid, run_as.gid)
        if blocked is not None:
            raise ConfigError(
                f"PostgreSQL must run as uid {run_as.uid} (user namespaces are blocked "
                f"and it refuses root), but that user cannot enter {blocked} on the way "
                f"to {target}. awa-fast never loosens directory permissions: set "
                "AWA_FAST_HOME to a directory that user can reach (owned by root, "
                "mode 0755, e.g. under /srv), or run awa-fast as an ordinary user."
            )


def _child_env() -> dict[str, str]:
    """The environment of every binary: an allow-list of the caller's variables plus ``LC_ALL=C``."""
    # An allow-list, not a deny-list: the postmaster inherits this, and any
    # superuser session can read it (COPY ... PROGRAM 'env'), so no DSN
    # (AWA_FAST_DSN, DATABASE_URL), PG* variable (PGPASSWORD, and PGPORT,
    # PGDATA... would change what the binaries do) or other secret of the
    # caller may pass. Everything the binaries need is on the command line.
    env = {k: os.environ[k] for k in _CHILD_ENV_KEEP if k in os.environ}
    env.setdefault("PATH", "/usr/bin:/bin")
    env["LC_ALL"] = "C"
    return env
