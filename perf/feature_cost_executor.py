"""Thread CPU of ``Executor._run_sync`` per attempt: main 2d327ef's three calls against this checkout's one frame.

The attempt is a no-op handler of a kind with no timeout and no weight, on
a job without metadata, no per-attempt hook installed: what a drain that
uses none of the optional features runs per job. ``Main`` copies main's
``_run_sync`` / ``_run_sync_attempt`` / ``_attempt_started`` verbatim. The
two are timed alternately with ``time.thread_time`` (best and median of
``--rounds`` rounds of 30 x 1,024 attempts).

    .venv/bin/python perf/feature_cost_executor.py
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import threading
import time
from typing import Any

from awa_fast.jobs import JobSpec, attempt_timeout
from awa_fast.runtime.attempts import AttemptTable
from awa_fast.runtime.executor import (
    CloseCode,
    Executor,
    Outcome,
    Unwritten,
    _attempt_hooks,
    returned_outcome,
    unknown_kind_text,
)

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from feature_cost_micro import _jobs  # noqa: E402


class _Hooks:
    def released(self, n: int) -> None: ...

    def count(self, key: str, n: int) -> None: ...

    def thread_died(self, what: str, exc: BaseException) -> None: ...


class Main(Executor):
    """The executor of main 2d327ef: the attempt in three calls."""

    def _run_sync(self, job: Any) -> Outcome | Unwritten:
        spec = self.registry.get(job.kind)
        if spec is None:
            return Outcome(CloseCode.RETRY, error=unknown_kind_text(job.kind))
        if self._slots is None:
            return self._run_sync_attempt(job, spec)
        self._slots.acquire(spec.weight)
        try:
            return self._run_sync_attempt(job, spec)
        finally:
            self._slots.release(spec.weight)

    def _run_sync_attempt(self, job: Any, spec: JobSpec) -> Outcome | Unwritten:
        self._attempt_started_main(job, spec)
        try:
            scope = _attempt_hooks.around
            if scope is None:
                return returned_outcome(job, spec.handler(job))
            with scope(job):
                result = spec.handler(job)
            return returned_outcome(job, result)
        except BaseException as exc:  # noqa: BLE001
            return self._failed(job, spec, exc)
        finally:
            job.finished_at = time.time()

    def _attempt_started_main(self, job: Any, spec: JobSpec) -> None:
        job.started_at = time.time()
        timeout = attempt_timeout(job, spec)
        if timeout is not None:
            self._arm_timeout(job, timeout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=21)
    args = ap.parse_args()
    reg = {"k": JobSpec("k", lambda job: None, "q", 2, 25, False, None)}
    old = Main(reg, 64, None, AttemptTable(), _Hooks(), threading.Event())  # type: ignore[arg-type]
    new = Executor(reg, 64, None, AttemptTable(), _Hooks(), threading.Event())  # type: ignore[arg-type]
    jobs = _jobs()

    def timed(ex: Executor, inner: int = 30) -> float:
        run = ex._run_sync
        t0 = time.thread_time()
        for _ in range(inner):
            for j in jobs:
                run(j)
        return (time.thread_time() - t0) / inner / len(jobs) * 1e9

    a: list[float] = []
    b: list[float] = []
    for _ in range(args.rounds):
        a.append(timed(old))
        b.append(timed(new))
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    print(f"load {load}; ns per attempt, best: main {min(a):.1f}, this checkout {min(b):.1f} "
          f"({min(b) - min(a):+.1f}); median: main {statistics.median(a):.1f}, this checkout "
          f"{statistics.median(b):.1f}")


if __name__ == "__main__":
    main()
