"""pyperf: the completion flush of 512 claimed jobs (``Storage.receipt_complete``).

    .venv/bin/python perf/flush512.py --dsn DSN --fast -o flush512.json
    .venv/bin/python perf/flush512.py --dsn DSN --quick          # one value each: proves it runs

Benchmarks (each loop: claim 512 outside the timed region, then time the flush):

* ``flush512[whole,commit]``       one compact closure row per receipt (what the
                                   batcher writes when a whole claim completes), committed;
* ``flush512[per_attempt,commit]`` one closure row per job (partial receipts), committed;
* ``flush512[whole,rollback]``     the same statements rolled back: the CPU and
                                   round trips without the commit's fsync.

Schema ``perf_flush512`` (re-created by the master process); the backlog is
refilled by COPY outside the timed region. No DSN: ``AWA_FAST_DSN``,
``DATABASE_URL``, then the embedded server (as the CLI).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import pyperf
from quick import take_quick_flag

from awa_fast.cli import resolve_dsn

QUEUE = "perf"
KIND = "perf.noop"
SCHEMA = "perf_flush512"
N = 512
QUICK = take_quick_flag()


def enqueue(dsn: str, n: int) -> None:
    from awa_fast.client import Client

    client = Client(dsn, SCHEMA)
    try:
        client.enqueue_many(KIND, ({"n": i, "to": f"user{i}@example.com"} for i in range(n)), queue=QUEUE,
                            chunk=50_000)
    finally:
        client.close()


def prepare(dsn: str) -> None:
    import psycopg

    from awa_fast.storage.migrate import migrate
    from awa_fast.storage.schema import render

    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(render("DROP SCHEMA IF EXISTS __SCHEMA__ CASCADE", SCHEMA))
    migrate(dsn, SCHEMA)
    enqueue(dsn, 20 * N)


_STATE: dict[str, Any] = {}


def _conn(dsn: str) -> tuple[Any, Any]:
    if "conn" not in _STATE:
        import psycopg

        from awa_fast.storage import Storage, use_raw_jsonb

        conn = psycopg.connect(dsn, autocommit=True, application_name="awa_fast:perf")
        use_raw_jsonb(conn)
        storage = Storage(SCHEMA)
        storage.session_index_probes(conn)  # planned as the runtime's batcher session is
        _STATE["conn"] = (storage, conn)
    return _STATE["conn"]


def _claim(dsn: str, storage: Any, conn: Any) -> list[Any]:
    snaps = storage.lane_claim(conn, QUEUE, N)
    if len(snaps) < N:
        enqueue(dsn, 20 * N)
        snaps += storage.lane_claim(conn, QUEUE, N - len(snaps))
    return snaps


def bench_flush(loops: int, dsn: str, closure: str, end: str) -> float:
    storage, conn = _conn(dsn)
    elapsed = 0.0
    snaps = _claim(dsn, storage, conn) if end == "rollback" else None
    for _ in range(loops):
        if end == "commit":
            snaps = _claim(dsn, storage, conn)  # untimed: a fresh, committed claim of 512
        assert snaps is not None
        whole = {(s.claim_slot, s.claim_id) for s in snaps} if closure == "whole" else set()
        t0 = time.perf_counter()
        tx = conn.transaction(force_rollback=(end == "rollback"))
        with tx:
            stale = storage.receipt_complete(conn, snaps, whole)
        elapsed += time.perf_counter() - t0
        assert not stale, f"{len(stale)} stale completions"
    return elapsed


def add_cmdline_args(cmd: list[str], args: Any) -> None:
    if args.dsn:
        cmd.extend(("--dsn", args.dsn))


def main() -> None:
    runner = pyperf.Runner(add_cmdline_args=add_cmdline_args)
    runner.argparser.add_argument("--dsn", default=None)
    args = runner.parse_args()
    dsn = resolve_dsn(args)
    args.dsn = dsn
    if not args.worker:
        import awa_fast

        prepare(dsn)
        runner.metadata["awa_fast_impl"] = awa_fast.__impl__
        runner.metadata["loadavg"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
        print(f"awa_fast implementation: {awa_fast.__impl__}; loadavg {os.getloadavg()}", file=sys.stderr)
    for closure, end in (("whole", "commit"), ("per_attempt", "commit"), ("whole", "rollback")):
        runner.bench_time_func(f"flush512[{closure},{end}]", bench_flush, dsn, closure, end, inner_loops=1)


if __name__ == "__main__":
    main()
