"""``awa-fast bench SCENARIO``: the standard scenarios of docs/benchmarks.md.

Scenarios (see ``docs/performance.md`` for the exact commands and results):

* ``drain``             COPY-enqueue ``--jobs`` no-op jobs, start a real ``awa-fast
                        supervise`` process, time first pickup -> last durable completion.
* ``bulk-enqueue``      jobs/s through ``App.enqueue_many`` (payload checks + binary COPY).
* ``concurrent-insert`` ``--producers`` processes, each ``App.enqueue`` on its own
                        autocommit connection (one durable commit per job) for ``--seconds``.
* ``latency``           one producer at ``--rate`` jobs/s for ``--seconds``, one
                        transaction per job, supervisor idle-waiting; pickup and
                        end-to-end percentiles per job.
* ``pinned-reader``     ``latency`` while a ``REPEATABLE READ`` transaction that read
                        ``ready_entries`` stays open; dead tuples over time, then the
                        reclaim after the reader ends.

The modules: :mod:`~awa_fast.bench.run` (the entry point, the scenario
table), one module per scenario group (:mod:`~awa_fast.bench.drain`,
:mod:`~awa_fast.bench.insert`, :mod:`~awa_fast.bench.latency`),
:mod:`~awa_fast.bench.worker` (the job, the supervisor's App, the trace),
:mod:`~awa_fast.bench.procs` (the supervisor subprocess handle),
:mod:`~awa_fast.bench.meters` (``/proc`` CPU and RSS) and
:mod:`~awa_fast.bench.report` (percentiles, the table, ``--save``). The SQL
they need is in :mod:`awa_fast.storage.probes`. Nothing is built or read from
the environment at import time.
"""

from __future__ import annotations

from typing import Any

from awa_fast.bench.latency import steady_producer
from awa_fast.bench.meters import CpuMeter, RssSampler, rss_kb
from awa_fast.bench.procs import SupervisorExited, SupervisorProcess, bench_supervisor
from awa_fast.bench.report import format_table, percentiles
from awa_fast.bench.run import SCENARIOS, run_bench
from awa_fast.bench.worker import APP_REF, KIND, QUEUE, read_trace

__all__ = ["APP_REF", "KIND", "QUEUE", "SCENARIOS", "CpuMeter", "RssSampler", "SupervisorExited",
           "SupervisorProcess", "bench_supervisor", "format_table", "percentiles", "read_trace", "rss_kb",
           "run_bench", "steady_producer"]


def __getattr__(name: str) -> Any:
    """``awa_fast.bench:app`` (the older app reference) is :data:`awa_fast.bench.worker.app`, built on access."""
    if name == "app":
        from awa_fast.bench import worker

        return worker.app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
