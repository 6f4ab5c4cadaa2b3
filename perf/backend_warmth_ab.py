"""Does a quiet queue's call run faster on a server process that has just worked? Two A/Bs.

At 200 jobs/s each call of a quiet queue reaches a server process that has slept ~5 ms. These
A/Bs send the same call to a process that has just run something else, or to one that has not,
the arm alternating job by job (so a drift of the load hits both alike):

* ``--call complete``: enqueue one job, claim it, wait ``--delay`` seconds (the runtime's
  claim-to-flush time is ~0.2 ms), then complete it (``Storage.receipt_complete_rows``, the
  batcher's quiet path) on the claim's own connection (``same``) or on a connection of its own,
  as the batcher has (``other``);
* ``--call claim``: a producer thread enqueues one job every ``--gap`` seconds; on each NOTIFY,
  claim on the LISTEN connection itself (``same``: its server process was just woken to send
  the notification) or on a connection of its own, as the runtime's claimer has (``other``).

Wall time per call, p50 / p95 ms, after ``WARM`` calls. Durable commits throughout.

    .venv/bin/python perf/backend_warmth_ab.py --dsn DSN [--call complete|claim] [--jobs 1500]
        [--gap 0.005] [--delay 0.0002] [--schema bench_warmth]
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import psycopg

from awa_fast.bench import percentiles
from awa_fast.client import encode_payload
from awa_fast.storage import Storage, use_raw_jsonb
from awa_fast.storage.connection import PoolConnection
from awa_fast.storage.migrate import migrate

QUEUE, KIND, PRIORITY = "warmth", "bench.noop", 2
WARM = 20


def _conn(dsn: str) -> PoolConnection:
    c = PoolConnection.connect(dsn, autocommit=True)
    use_raw_jsonb(c)
    return c


def complete_ab(dsn: str, st: Storage, jobs: int, gap: float, delay: float) -> dict[str, list[float]]:
    producer = psycopg.connect(dsn, autocommit=True)
    claimer, batcher = _conn(dsn), _conn(dsn)
    args = encode_payload({})
    out: dict[str, list[float]] = {"other": [], "same": []}
    for i in range(jobs):
        arm = "same" if i % 2 else "other"
        st.job_enqueue(producer, QUEUE, PRIORITY, KIND, args, None, 3)
        snaps = st.lane_claim(claimer, QUEUE, 64)
        time.sleep(delay)
        t0 = time.perf_counter()
        st.receipt_complete_rows(claimer if arm == "same" else batcher, snaps)
        if i >= WARM:
            out[arm].append((time.perf_counter() - t0) * 1e3)
        time.sleep(gap)
    for c in (producer, claimer, batcher):
        c.close()
    return out


def claim_ab(dsn: str, st: Storage, jobs: int, gap: float) -> dict[str, list[float]]:
    listen, other = _conn(dsn), _conn(dsn)
    listen.execute(f"LISTEN {st.channel}")
    args = encode_payload({})

    def produce() -> None:
        with psycopg.connect(dsn, autocommit=True) as p:
            for _ in range(jobs):
                st.job_enqueue(p, QUEUE, PRIORITY, KIND, args, None, 3)
                time.sleep(gap)

    producer = threading.Thread(target=produce)
    producer.start()
    out: dict[str, list[float]] = {"other": [], "same": []}
    n = 0
    while n < jobs:
        if not list(listen.notifies(timeout=5, stop_after=1)):
            break
        arm = "same" if n % 2 else "other"
        conn = listen if arm == "same" else other
        t0 = time.perf_counter()
        snaps = st.lane_claim(conn, QUEUE, 64)
        took = (time.perf_counter() - t0) * 1e3
        if snaps:
            st.receipt_complete_rows(conn, snaps)
        n += len(snaps)
        if n > WARM:
            out[arm].append(took)
    producer.join()
    for c in (listen, other):
        c.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dsn", required=True)
    ap.add_argument("--schema", default="bench_warmth")
    ap.add_argument("--call", choices=("complete", "claim"), default="complete")
    ap.add_argument("--jobs", type=int, default=1500)
    ap.add_argument("--gap", type=float, default=0.005, help="seconds between jobs (0.005: 200/s)")
    ap.add_argument("--delay", type=float, default=0.0002, help="complete: seconds from claim to completion")
    args = ap.parse_args()
    if not args.schema.startswith("bench"):
        raise SystemExit("--schema must start with 'bench' (it is dropped)")
    with psycopg.connect(args.dsn, autocommit=True) as c:
        c.execute(f"DROP SCHEMA IF EXISTS {args.schema} CASCADE")
    migrate(args.dsn, args.schema)
    st = Storage(args.schema)
    load = os.getloadavg()[0]
    res = (complete_ab(args.dsn, st, args.jobs, args.gap, args.delay) if args.call == "complete"
           else claim_ab(args.dsn, st, args.jobs, args.gap))
    print(f"{args.call}: {args.jobs} jobs, gap {args.gap * 1e3:g} ms"
          + (f", claim-to-completion {args.delay * 1e3:g} ms" if args.call == "complete" else "")
          + f"; load {load:.2f} -> {os.getloadavg()[0]:.2f}")
    for arm, ms in res.items():
        p = percentiles(ms, (50, 95))
        assert p is not None, f"no {arm} calls were timed"
        print(f"{arm:6s} n {len(ms)}  p50 {p['p50']:.3f} ms  p95 {p['p95']:.3f} ms")
    with psycopg.connect(args.dsn, autocommit=True) as c:
        c.execute(f"DROP SCHEMA {args.schema} CASCADE")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
