"""``postmaster.pid``: whether a server runs on a data directory, and clearing what a dead one left.

A pid file whose process is gone, an unreaped zombie or a pid reused by
another program is stale; it is removed only once no process of the old
server is still attached to its shared memory (an orphaned backend
finishing a query), since starting beside one corrupts data.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import pathlib
import time
from dataclasses import dataclass

from awa_fast.embedded.home import _read_nofollow, _tail
from awa_fast.errors import DatabaseUnavailable

log = logging.getLogger("awa_fast.embedded")


@dataclass(frozen=True)
class _PidFile:
    pid: int
    port: int | None
    socket_dir: str | None
    shm_key: int | None
    shm_id: int | None
    status: str


def _read_pidfile(path: pathlib.Path) -> _PidFile | None:
    try:
        lines = _read_nofollow(path, 4096).split("\n")
    except OSError as exc:  # missing, or a symlink (never followed)
        if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP) or exc.errno is None:
            return None
        raise
    try:
        pid = int(lines[0])
    except (ValueError, IndexError):
        return None

    def line(i: int) -> str:
        return lines[i].strip() if len(lines) > i else ""

    port = int(line(3)) if line(3).isdigit() else None
    shm = line(6).split()
    shm_key = int(shm[0]) if len(shm) == 2 and shm[0].isdigit() else None
    shm_id = int(shm[1]) if len(shm) == 2 and shm[1].isdigit() else None
    return _PidFile(pid, port, line(4) or None, shm_key, shm_id, line(7))


def _proc_state(pid: int) -> tuple[str, str] | None:
    """(comm, state) from /proc, or None if there is no such process."""
    try:
        raw = pathlib.Path(f"/proc/{pid}/stat").read_text(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:
        return ("?", "?")
    comm = raw[raw.find("(") + 1 : raw.rfind(")")]
    rest = raw[raw.rfind(")") + 1 :].split()
    return comm, (rest[0] if rest else "?")


def _pid_exists(pid: int) -> bool:
    """Like ``kill(pid, 0)`` but a zombie counts as gone."""
    if pid <= 0:
        return False
    if os.path.isdir("/proc/self"):
        state = _proc_state(pid)
        return state is not None and state[1] not in ("Z", "X")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _is_postmaster_of(pid: int, datadir: pathlib.Path) -> bool:
    """True if ``pid`` is a live postgres whose working directory is ``datadir``."""
    if not _pid_exists(pid):
        return False
    state = _proc_state(pid) if os.path.isdir("/proc/self") else None
    if state is None:
        return True  # no /proc: trust kill(pid, 0)
    if state[0] not in ("postgres", "?"):
        return False  # the pid was reused by another program
    try:
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return True  # not allowed to look; the name matched
    return os.path.realpath(cwd) == os.path.realpath(datadir)


def _shm_attached(key: int, shmid: int) -> int | None:
    """Processes attached to a SysV segment, or None if unknown/gone."""
    try:
        rows = pathlib.Path("/proc/sysvipc/shm").read_text().splitlines()[1:]
    except OSError:
        return None
    for row in rows:
        cols = row.split()
        if len(cols) >= 7 and cols[1] == str(shmid) and cols[0] == str(key):
            return int(cols[6])
    return None


def _remove_shm(shmid: int) -> None:
    """Best effort ``shmctl(IPC_RMID)`` of a segment nobody is attached to."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.shmctl(ctypes.c_int(shmid), ctypes.c_int(0), None)  # 0 == IPC_RMID
    except (OSError, AttributeError):
        pass


def _wait_settled(datadir: pathlib.Path, log_path: pathlib.Path, deadline: float) -> bool:
    """True once a server running on ``datadir`` is ready; False if none runs."""
    delay = 0.005
    while True:
        info = _read_pidfile(datadir / "postmaster.pid")
        if info is None or not _is_postmaster_of(info.pid, datadir):
            return False
        if info.status in ("ready", "standby"):
            return True
        if time.monotonic() >= deadline:
            raise DatabaseUnavailable(
                f"PostgreSQL (pid {info.pid}) on {datadir} is still "
                f"{info.status or 'starting'}; last lines of {log_path}:\n"
                f"{_tail(log_path)}"
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


def _clear_stale(datadir: pathlib.Path, socket_dir: pathlib.Path, deadline: float) -> None:
    """Make a ``postmaster.pid`` left by a dead server on ``datadir`` harmless."""
    pidfile = datadir / "postmaster.pid"
    info = _read_pidfile(pidfile)
    if info is None:
        return
    # Never start while processes of the old server still use its shared
    # memory (orphaned backends finishing a query): that corrupts data.
    if info.shm_key is not None and info.shm_id is not None:
        delay = 0.005
        while (_shm_attached(info.shm_key, info.shm_id) or 0) > 0:
            if time.monotonic() >= deadline:
                raise DatabaseUnavailable(
                    f"processes of the previous server on {datadir} (pid "
                    f"{info.pid}) are still attached to its shared memory; wait for "
                    "them to exit (or kill them), then start again"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.1)
    if not _pid_exists(info.pid):
        state = _proc_state(info.pid) if os.path.isdir("/proc/self") else None
        if state is None:
            return  # truly gone: postgres clears its own lock file and memory
        reason = "a zombie"  # not reaped by init: kill(pid, 0) would still succeed
    else:
        reason = "another program"  # pid reused
    log.warning(
        "removing stale %s: pid %d is %s and the old server has no attached process",
        pidfile,
        info.pid,
        reason,
    )
    if info.socket_dir == str(socket_dir) and info.port:
        sock_lock = pathlib.Path(info.socket_dir) / f".s.PGSQL.{info.port}.lock"
        stale = _read_pidfile(sock_lock)
        if stale is not None and stale.pid == info.pid:
            with contextlib.suppress(FileNotFoundError):
                sock_lock.unlink()
    with contextlib.suppress(FileNotFoundError):
        pidfile.unlink()
    if (
        info.shm_id is not None
        and info.shm_key is not None
        and _shm_attached(info.shm_key, info.shm_id) == 0
    ):
        _remove_shm(info.shm_id)
