"""pyperf: one ``Storage.lane_claim`` call at backlog depths 1k, 100k and 1M (flat is the requirement).

    .venv/bin/python perf/claim_depth.py --dsn DSN --fast -o claim_depth.json
    .venv/bin/python perf/claim_depth.py --dsn DSN --quick          # one value each: proves it runs
    .venv/bin/python -m pyperf compare_to old.json claim_depth.json

Benchmarks ``lane_claim[depth=D,batch=B,MODE]`` for B in 1 and 100:

* ``rollback``: the claim runs in a transaction that is rolled back, so the
  backlog stays exactly at D; this is the claim function's own cost.
* ``complete``: the claim commits (autocommit), then ``receipt_complete``
  completes the batch in its own committed transaction; the backlog is
  topped up by COPY outside the timed region whenever it falls more than
  ``max(B, D/10)`` below D. Two durable commits per call: fsync shows here.

The master process prepares one schema per depth (``perf_depth_<D>``,
reused when it already holds a matching backlog; ``--rebuild`` forces it).
No DSN: ``AWA_FAST_DSN``, ``DATABASE_URL``, then the embedded server (as the CLI).
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
QUICK = take_quick_flag()


def schema_for(depth: int) -> str:
    return f"perf_depth_{depth}"


def enqueue(dsn: str, schema: str, n: int) -> None:
    from awa_fast.client import Client

    client = Client(dsn, schema)
    try:
        client.enqueue_many(KIND, ({"n": i} for i in range(n)), queue=QUEUE, chunk=50_000)
    finally:
        client.close()


def depth_of(conn: Any, storage: Any) -> int:
    return int(storage.queue_depth_fast(conn).get(QUEUE, 0))


def prepare(dsn: str, depth: int, rebuild: bool) -> int:
    """Make schema perf_depth_<depth> hold ``depth`` unclaimed jobs; returns the depth found."""
    import psycopg

    from awa_fast.storage import Storage, connect
    from awa_fast.storage.migrate import migrate
    from awa_fast.storage.schema import render

    schema = schema_for(depth)
    storage = Storage(schema)
    if not rebuild:
        try:
            with connect(dsn) as c:
                storage.schema_check(c)
                found = depth_of(c, storage)
            if found >= depth * 0.9:
                if found < depth:
                    enqueue(dsn, schema, depth - found)
                return depth
        except Exception:  # noqa: BLE001 - missing or stale: rebuild
            pass
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(render("DROP SCHEMA IF EXISTS __SCHEMA__ CASCADE", schema))
    migrate(dsn, schema)
    t0 = time.perf_counter()
    enqueue(dsn, schema, depth)
    print(f"prepared {schema}: {depth:,} jobs in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    with connect(dsn) as c:
        storage.queue_ensure(c, QUEUE)
        return depth_of(c, storage)


_STATE: dict[str, Any] = {}


def _conns(dsn: str, schema: str) -> tuple[Any, Any, Any]:
    key = schema
    if key not in _STATE:
        import psycopg

        from awa_fast.storage import Storage, use_raw_jsonb

        tx = psycopg.connect(dsn, autocommit=False, application_name="awa_fast:perf")
        auto = psycopg.connect(dsn, autocommit=True, application_name="awa_fast:perf")
        use_raw_jsonb(tx)
        use_raw_jsonb(auto)
        _STATE[key] = (Storage(schema), tx, auto)
    return _STATE[key]


def bench_claim(loops: int, dsn: str, depth: int, batch: int, mode: str) -> float:
    schema = schema_for(depth)
    storage, tx, auto = _conns(dsn, schema)
    claim = storage.lane_claim
    if mode == "rollback":
        t0 = time.perf_counter()
        for _ in range(loops):
            claim(tx, QUEUE, batch)
            tx.rollback()
        return time.perf_counter() - t0
    threshold = max(batch, depth // 10)
    consumed = 0
    elapsed = 0.0
    for _ in range(loops):
        t0 = time.perf_counter()
        snaps = claim(auto, QUEUE, batch)
        with auto.transaction():
            storage.receipt_complete(auto, snaps, {(s.claim_slot, s.claim_id) for s in snaps})
        elapsed += time.perf_counter() - t0
        consumed += len(snaps)
        if consumed >= threshold or not snaps:
            enqueue(dsn, schema, consumed or batch)
            consumed = 0
    if consumed:
        enqueue(dsn, schema, consumed)
    return elapsed


def add_cmdline_args(cmd: list[str], args: Any) -> None:
    if args.dsn:
        cmd.extend(("--dsn", args.dsn))
    cmd.extend(("--depths", args.depths, "--modes", args.modes))


def main() -> None:
    runner = pyperf.Runner(add_cmdline_args=add_cmdline_args)
    runner.argparser.add_argument("--dsn", default=None)
    runner.argparser.add_argument("--depths", default="1000,100000,1000000")
    runner.argparser.add_argument("--modes", default="rollback,complete")
    runner.argparser.add_argument("--rebuild", action="store_true")
    args = runner.parse_args()
    dsn = resolve_dsn(args)
    args.dsn = dsn
    depths = [int(x) for x in args.depths.split(",")]
    if not args.worker:
        import awa_fast

        for d in depths:
            prepare(dsn, d, args.rebuild)
        runner.metadata["awa_fast_impl"] = awa_fast.__impl__
        runner.metadata["loadavg"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
        print(f"awa_fast implementation: {awa_fast.__impl__}; loadavg {os.getloadavg()}", file=sys.stderr)
    for mode in args.modes.split(","):
        for d in depths:
            for b in (1, 100):
                runner.bench_time_func(f"lane_claim[depth={d},batch={b},{mode}]", bench_claim, dsn, d, b, mode,
                                       inner_loops=1)


if __name__ == "__main__":
    main()
