"""One PostgreSQL data directory driven with ``initdb`` and ``pg_ctl``: :class:`PostgresCluster`.

By default the server listens on a unix socket only, in the data
directory (or, when that path is too long for a socket, in a private
directory under ``/tmp``), with trust authentication: only the owner of the
data directory (and root) can reach the socket. TCP (a non-empty
``listen_addresses``) needs a password: ``initdb`` sets a generated one for
``postgres`` (``--auth-host=scram-sha-256``), kept in ``<datadir>.pgpass``
(mode 0600, libpq passfile format); :meth:`PostgresCluster.tcp_dsn` refers to
that file with ``passfile=`` and never carries the password itself.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import pathlib
import re
import secrets
import shutil
import stat
import subprocess
import time
from collections.abc import Iterator, Mapping

from awa_fast.embedded.binaries import _binary_version
from awa_fast.embedded.home import (
    _fsync_dir,
    _hold_lock,
    _make_private_dirs,
    _read_nofollow,
    _tail,
    _unsafe_home,
    _write_private,
)
from awa_fast.embedded.pidfile import _clear_stale, _is_postmaster_of, _read_pidfile, _wait_settled
from awa_fast.embedded.privileges import (
    _check_reachable,
    _child_env,
    _run_as_existing,
    _run_as_new,
    _RunAs,
)
from awa_fast.errors import ConfigError, DatabaseUnavailable

log = logging.getLogger("awa_fast.embedded")

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


def _quote_conf(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "''") + "'"


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
            run_as = _run_as_new()
            _check_reachable(run_as, self.datadir.parent, self.bindir)
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
            if _wait_settled(self.datadir, self.log_path, deadline):
                return self.dsn
            self._check_tcp_auth()
            run_as = _run_as_existing(self.datadir)
            _clear_stale(self.datadir, self.socket_dir, deadline)
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
                _run_as_existing(self.datadir),
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
        """Hold ``flock`` on the lock file next to the data directory (the home checked first)."""
        _make_private_dirs(self.lock_path.parent)
        self._check_home()
        with _hold_lock(self.lock_path, deadline):
            yield

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
                env=_child_env(),
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
