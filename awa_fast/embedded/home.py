"""The home directory: where it is, who may write there, and files read or written without following a symlink.

The home (the data directory's parent, where the lock, the password file and
initdb's temporary directory live) must be owned by the caller (or root) and
writable by nobody else, nor may any directory above it be (sticky ones such
as ``/tmp`` excepted). Every file awa-fast reads back or writes there, or in
the data directory, is opened with ``O_NOFOLLOW``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import pathlib
import pwd
import stat
import time
from collections.abc import Iterator, Mapping

from awa_fast.errors import ConfigError, DatabaseUnavailable


def default_home(env: Mapping[str, str] | None = None) -> pathlib.Path:
    """Return ``$AWA_FAST_HOME`` or ``~/.local/share/awa-fast`` (absolute)."""
    env = os.environ if env is None else env
    value = env.get("AWA_FAST_HOME", "").strip()
    if value:
        return pathlib.Path(value).expanduser().absolute()
    return pathlib.Path.home() / ".local" / "share" / "awa-fast"


def _tail(path: pathlib.Path, lines: int = 20) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        with open(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return "(no server log)"
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 8192))
            data = f.read().decode(errors="replace")
    except OSError:
        return "(no server log)"
    return "\n".join(data.splitlines()[-lines:]) or "(server log is empty)"


def _fsync_dir(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_nofollow(path: pathlib.Path, limit: int = 1 << 20) -> str:
    """Read a small file without following a symlink at its last component.

    Files in a data directory owned by the server's user (``setpriv`` mode)
    may be replaced by that user: root must never read through them into
    another file and repeat its content in an error message.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise FileNotFoundError(f"{path} is not a regular file")
        chunks: list[bytes] = []
        size = 0
        while size < limit:
            chunk = os.read(fd, min(65536, limit - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks).decode(errors="replace")


def _write_private(path: pathlib.Path, data: str, owner: tuple[int, int] | None = None) -> None:
    """Atomically replace ``path`` by a new 0600 file holding ``data``.

    The temporary file is created with ``O_EXCL | O_NOFOLLOW`` (a symlink
    planted in its place is never followed) and renamed over ``path``.
    """
    tmp = path.with_name(f".{path.name}.tmp")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # removes a symlink itself, never its target
    try:
        fd = os.open(
            tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
    except OSError as exc:
        raise ConfigError(f"cannot create {tmp}: {exc}; remove it and try again") from exc
    try:
        os.fchmod(fd, 0o600)
        if owner is not None:
            os.fchown(fd, *owner)
        view = memoryview(data.encode())
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _make_private_dirs(path: pathlib.Path) -> None:
    """Create ``path`` and missing parents, each mode 0700 (never loosening one)."""
    missing: list[pathlib.Path] = []
    for directory in [path, *path.parents]:
        if os.path.lexists(directory):
            break
        missing.append(directory)
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory, 0o700)


def _unsafe_home(home: pathlib.Path, uid: int) -> str | None:
    """Why ``home`` is not safe for files root (or ``uid``) writes, or None.

    The home and every directory above it must be owned by ``uid`` or root
    and not writable by group or others; above the home, a sticky directory
    (``/tmp``) is allowed, since nobody else can rename our entry in it.
    """
    real = pathlib.Path(os.path.realpath(home))
    for directory in [*reversed(real.parents), real]:
        try:
            st = os.lstat(directory)
        except FileNotFoundError:
            return None
        where = "the home" if directory == real else "a parent directory of the home"
        if st.st_uid not in (uid, 0):
            try:
                owner = pwd.getpwuid(st.st_uid).pw_name
            except KeyError:
                owner = f"uid {st.st_uid}"
            me = "root" if uid == 0 else f"uid {uid} or root"
            return f"{directory} ({where}) is owned by {owner}, not {me}: use a home owned by you"
        if st.st_mode & 0o022 and not (directory != real and st.st_mode & stat.S_ISVTX):
            return (
                f"{directory} ({where}) is writable by group or others (mode "
                f"{stat.S_IMODE(st.st_mode):04o}): run `chmod go-w {directory}` or use "
                "another home"
            )
    return None


@contextlib.contextmanager
def _hold_lock(path: pathlib.Path, deadline: float) -> Iterator[None]:
    """Hold ``flock`` on ``path`` (created 0600, never through a symlink) until the block ends."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        hint = " (a symlink: awa-fast never follows one here)" if exc.errno == errno.ELOOP else ""
        raise ConfigError(f"cannot open lock file {path}{hint}: {exc}; remove it") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise ConfigError(
                f"lock file {path} is not a regular file owned by uid {os.geteuid()}: remove it"
            )
        delay = 0.002
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise DatabaseUnavailable(
                        f"another process holds {path} (starting or stopping the "
                        "server); try again or check for a stuck process"
                    ) from None
                time.sleep(delay)
                delay = min(delay * 2, 0.05)
        yield
    finally:
        os.close(fd)
