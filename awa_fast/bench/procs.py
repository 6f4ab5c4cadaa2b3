"""The one handle on ``awa-fast supervise`` run as a child process.

:class:`SupervisorProcess` builds the command line, starts it (optionally in
its own session, so the whole process group can be signalled), reads its
shared-memory status, and stops it: SIGTERM and a bounded wait, then SIGKILL.
The bench drives its scenarios with it; the test suite's supervisor handles
(``tests/fixtures/supervisor.py``, the chaos suite's ``Supervise``) extend it
with what only tests need.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import IO, Any

# -P: the working directory (a source checkout, say) must not shadow the installed awa_fast.
DEFAULT_LAUNCHER: tuple[str, ...] = (sys.executable, "-P", "-m", "awa_fast.cli")
# Settings the CLI would otherwise take from the environment: the handle passes them explicitly.
_CLEARED_ENV = ("AWA_FAST_DSN", "DATABASE_URL", "AWA_FAST_SCHEMA", "AWA_FAST_HOME")


class SupervisorExited(RuntimeError):
    """The supervisor process ended while it was expected to run; its log (if any) says why."""


class SupervisorProcess:
    """``awa-fast supervise APP`` as a real child process.

    ``queues`` are ``--queue`` specs; ``options`` further ``supervise``
    arguments. The DSN goes in ``AWA_FAST_DSN`` (kept out of the process
    list) unless ``dsn_in_argv``. ``home`` defaults to a temporary directory
    removed by :meth:`close`. ``log_path`` captures stdout and stderr
    (appended); without it the child shares this process's. With
    ``own_session`` the child leads a new process group, which
    :meth:`signal_group` and :meth:`close` signal as a whole.
    """

    def __init__(self, app_ref: str, dsn: str, schema: str, *, queues: Sequence[str] = (),
                 options: Sequence[str] = (), home: pathlib.Path | str | None = None,
                 log_level: str = "WARNING", launcher: Sequence[str] = DEFAULT_LAUNCHER,
                 env: Mapping[str, str] | None = None, log_path: pathlib.Path | None = None,
                 cwd: pathlib.Path | str | None = None, own_session: bool = False,
                 dsn_in_argv: bool = False) -> None:
        self.app_ref, self.dsn, self.schema = app_ref, dsn, schema
        self._own_home = home is None
        self.home = pathlib.Path(tempfile.mkdtemp(prefix="awa-fast-supervise-home-") if home is None else home)
        self.log_path = log_path
        self.cwd = cwd
        self.own_session = own_session
        self.argv = [*launcher, "--log-level", log_level, "supervise", app_ref, "--schema", schema,
                     *(("--dsn", dsn) if dsn_in_argv else ()), "--home", str(self.home)]
        for spec in queues:
            self.argv += ["--queue", spec]
        self.argv += list(options)
        self.env = {k: v for k, v in os.environ.items() if k not in _CLEARED_ENV}
        if not dsn_in_argv:
            self.env["AWA_FAST_DSN"] = dsn
        self.env.update(env or {})
        self.proc: subprocess.Popen[bytes] | None = None
        self.ring: Any = None
        self.exit_code: int | None = None
        self.started_at = 0.0
        self._log: IO[bytes] | None = None
        self._log_offset = 0

    # -- lifecycle --------------------------------------------------------------------

    def start(self) -> SupervisorProcess:
        """Start the process (again, after it ended: the log is appended to)."""
        self.home.mkdir(parents=True, exist_ok=True)
        stdout: Any = None
        if self.log_path is not None:
            self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
            self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed when the process is reaped
            stdout = self._log
        self.exit_code = None
        self.proc = subprocess.Popen(self.argv, cwd=None if self.cwd is None else str(self.cwd), env=self.env,
                                     stdin=subprocess.DEVNULL, stdout=stdout,
                                     stderr=subprocess.STDOUT if stdout is not None else None,
                                     start_new_session=self.own_session)
        self.started_at = time.monotonic()
        return self

    @property
    def pid(self) -> int:
        """The supervisor's pid (it must have been started)."""
        if self.proc is None:
            raise RuntimeError("the supervisor was not started; call start() first")
        return self.proc.pid

    def alive(self) -> bool:
        """True while the supervisor process runs."""
        return self.proc is not None and self.proc.poll() is None

    def check_alive(self) -> None:
        """Raise :class:`SupervisorExited` (with the log's tail) if the process has ended."""
        if self.proc is not None and self.proc.poll() is None:
            return
        code = None if self.proc is None else self.proc.returncode
        raise SupervisorExited(f"the supervisor exited early with code {code}" +
                               (f"\n{self.tail()}" if self.log_path is not None else ""))

    def send(self, sig: int) -> None:
        """Send ``sig`` to the supervisor process alone."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the supervisor's whole process group (``own_session``), else to it alone."""
        if not self.own_session:
            self.send(sig)
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, sig)

    def wait(self, timeout: float | None = 60.0) -> int:
        """Wait for the process to exit; its exit code. Raises ``subprocess.TimeoutExpired``."""
        assert self.proc is not None
        try:
            self.exit_code = self.proc.wait(timeout)
        finally:
            if self.proc.returncode is not None:
                self._close_log()
        return self.exit_code

    def stop(self, timeout: float = 90.0) -> int | None:
        """SIGTERM (a graceful drain) and wait ``timeout``; then SIGKILL. The exit code; idempotent."""
        self.detach()
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.send(signal.SIGTERM)
            try:
                self.wait(timeout)
            except subprocess.TimeoutExpired:
                self.signal_group(signal.SIGKILL)
                self.wait(30)
        else:
            self.wait(0)
        return self.exit_code

    def close(self) -> None:
        """Whatever happened: nothing of this supervisor is left running, its temporary home removed."""
        self.detach()
        if self.proc is not None and (self.proc.poll() is None or self.own_session):
            self.signal_group(signal.SIGKILL)  # with own_session: orphaned children too
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.wait(30)
        self._close_log()
        if self._own_home:
            shutil.rmtree(self.home, ignore_errors=True)

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> SupervisorProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- its output -------------------------------------------------------------------

    def output(self, since_start: bool = False) -> str:
        """What the process wrote to ``log_path`` (all of it, or since the last :meth:`start`)."""
        if self.log_path is None:
            return ""
        try:
            data = self.log_path.read_bytes()
        except FileNotFoundError:
            return ""
        return (data[self._log_offset:] if since_start else data).decode("utf-8", "replace")

    def tail(self, n: int = 40) -> str:
        """The last ``n`` lines of the log, headed for an assertion message."""
        return "supervisor output (tail):\n" + "\n".join(self.output().splitlines()[-n:])

    # -- its shared-memory status ----------------------------------------------------------

    def attach(self, timeout: float = 60.0) -> None:
        """Wait for the supervisor's shared-memory ring and attach to it."""
        from awa_fast.runtime.shm import ShmRing, read_locator

        deadline = time.monotonic() + timeout
        while True:
            self.check_alive()
            loc = read_locator(self.home, self.schema)
            if loc is not None:
                self.ring = ShmRing.attach(loc[0])
                return
            if time.monotonic() > deadline:
                raise RuntimeError("the supervisor did not publish its shared-memory ring in time")
            time.sleep(0.005)

    def detach(self) -> None:
        """Close the shared-memory ring (before the supervisor removes it)."""
        if self.ring is not None:
            with contextlib.suppress(Exception):
                self.ring.close()
            self.ring = None

    def counters(self) -> dict[str, Any]:
        """Summed claimer counters, states and the raw records from shared memory (after :meth:`attach`)."""
        recs = [self.ring.claimer(i).read() for i in range(self.ring.claimers)]
        return {"claimed": sum(r["claimed"] for r in recs), "completed": sum(r["completed"] for r in recs),
                "states": [r["state"] for r in recs], "records": recs}

    def wait_claimers_running(self, timeout: float = 60.0) -> None:
        """Wait until every claimer in shared memory is ``running`` (after :meth:`attach`)."""
        deadline = time.monotonic() + timeout
        while True:
            self.check_alive()
            if all(s == "running" for s in self.counters()["states"]):
                return
            if time.monotonic() > deadline:
                raise RuntimeError("the claimers did not reach 'running' in time")
            time.sleep(0.01)

    def histograms(self) -> dict[str, Any]:
        """Pickup and e2e histograms merged over claimers (runtime's own view, created_at based)."""
        from awa_fast.runtime.shm import histogram_percentiles

        out = {}
        recs = self.counters()["records"]
        for which in ("pickup", "e2e"):
            buckets = [sum(r[which]["buckets"][i] for r in recs) for i in range(len(recs[0][which]["buckets"]))]
            pct = histogram_percentiles(buckets)
            out[which] = ({k: (round(v * 1000, 3) if v is not None else None) for k, v in pct.items()}
                          if sum(buckets) else None)
        return out


def bench_supervisor(dsn: str, schema: str, stripes: int, concurrency: int, batch: int,
                     trace: str | None = None, metrics: str | None = None) -> SupervisorProcess:
    """The bench's supervisor: :data:`~awa_fast.bench.worker.APP_REF` on the bench queue (not started).

    ``batch`` 0 leaves the claim size to the supervisor's default (sized from the backlog).
    ``trace``: the per-job trace file; ``metrics``: ``HOST:PORT`` where the
    supervisor serves Prometheus ``/metrics`` (``supervise --metrics``).
    """
    from awa_fast.bench.worker import APP_REF, QUEUE, TRACE_ENV

    env = {TRACE_ENV: trace} if trace else {}
    spec = f"{QUEUE}:stripes={stripes},concurrency={concurrency}" + (f",batch={batch}" if batch else "")
    sup = SupervisorProcess(APP_REF, dsn, schema, queues=[spec],
                            options=["--metrics", metrics] if metrics else [], env=env)
    if not trace:
        sup.env.pop(TRACE_ENV, None)
    return sup
