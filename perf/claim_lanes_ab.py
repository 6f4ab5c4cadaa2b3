"""What a claim costs when the queue's jobs come from one lane or from two.

A lane is picked by the enqueuing backend, so a producer that spreads its
enqueues over two connections fills two lanes. After each claim the lane it
claimed from keeps its cursor one receipt behind (the cursor moves across
committed receipts at the next claim of that lane), so with two lanes every
claim sees two candidate lanes and runs the several-lanes ordering query.

In fine-grained alternating blocks (so the machine's load hits both arms
alike) one job is enqueued through connection A (arm ``one``) or through A
and B in turn (arm ``two``, distinct shards), then claimed on a third
connection; only the claim call is timed. Reports per arm the median of the
block medians of the claim round trip (and their minimum and lower
quartile: the blocks the machine's load disturbed least), and the shared buffers the claim
statements touched per job when ``pg_stat_statements`` is installed.

    .venv/bin/python perf/claim_lanes_ab.py --dsn DSN [--schema bench_claim_lanes] [--blocks 20] [--per-block 100]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import psycopg

from awa_fast.storage import Storage, connect, use_raw_jsonb
from awa_fast.storage.migrate import migrate


def shard_conns(dsn: str, schema: str, queue: str, want: int) -> list[psycopg.Connection]:
    """``want`` connections whose backends map to enqueue shards 0 .. want-1 of ``queue``."""
    by_shard: dict[int, psycopg.Connection] = {}
    spare: list[psycopg.Connection] = []
    while len(by_shard) < want:
        c = connect(dsn, application_name="perf:claim_lanes:producer")
        row = c.execute(f"SELECT enqueue_shards FROM {schema}.queue_meta WHERE queue = %s", (queue,)).fetchone()
        assert row is not None
        shard = abs(c.info.backend_pid) % int(row[0])
        if shard >= want or shard in by_shard:
            spare.append(c)  # held open so the next backend gets another pid
        else:
            by_shard[shard] = c
    for c in spare:
        c.close()
    return [by_shard[k] for k in sorted(by_shard)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dsn", required=True)
    ap.add_argument("--schema", default="bench_claim_lanes")
    ap.add_argument("--blocks", type=int, default=20)
    ap.add_argument("--per-block", type=int, default=100)
    args = ap.parse_args()
    s = args.schema
    with psycopg.connect(args.dsn, autocommit=True) as c:
        c.execute(f"DROP SCHEMA IF EXISTS {s} CASCADE")
    migrate(args.dsn, s)
    storage = Storage(s)
    claimer = connect(args.dsn, application_name="perf:claim_lanes:claimer")
    use_raw_jsonb(claimer)
    queues = {"one": "lanes_one", "two": "lanes_two"}
    for q in queues.values():
        claimer.execute(f"SELECT {s}.queue_ensure(%s)", (q,))
    producers = {"one": shard_conns(args.dsn, s, queues["one"], 1), "two": shard_conns(args.dsn, s, queues["two"], 2)}
    enqueue = storage.q["job_enqueue"]
    pss = claimer.execute("SELECT 1 FROM pg_extension WHERE extname = 'pg_stat_statements'").fetchone() is not None
    blocks: dict[str, list[float]] = {"one": [], "two": []}
    buffers: dict[str, int] = {"one": 0, "two": 0}
    jobs: dict[str, int] = {"one": 0, "two": 0}
    n = 0
    for b in range(args.blocks * 2 + 2):
        arm = ("one", "two")[b % 2] if (b // 2) % 2 == 0 else ("two", "one")[b % 2]  # ABBA...
        q = queues[arm]
        if pss:
            claimer.execute("SELECT pg_stat_statements_reset()")
        times = []
        for _ in range(args.per_block):
            conn = producers[arm][n % len(producers[arm])]
            n += 1
            conn.execute(enqueue, (q, 2, "k", "{}", None, 3, None))
            t0 = time.perf_counter()
            got = storage.lane_claim(claimer, q, 8)
            times.append((time.perf_counter() - t0) * 1e6)
            assert len(got) == 1
        if b < 2:
            continue  # warm-up blocks: plans, caches, both lanes in use
        blocks[arm].append(statistics.median(times))
        jobs[arm] += args.per_block
        if pss:
            row = claimer.execute("SELECT coalesce(sum(shared_blks_hit + shared_blks_read), 0) FROM pg_stat_statements "
                                  "WHERE query LIKE %s AND toplevel", ("%FROM %claim_batch_v_(%",)).fetchone()
            assert row is not None
            buffers[arm] += int(row[0])
    for arm in ("one", "two"):
        bm = blocks[arm]
        extra = f", {buffers[arm] / jobs[arm]:.0f} shared buffers per claimed job" if pss else ""
        q1 = statistics.quantiles(bm, n=4)[0] if len(bm) > 1 else bm[0]
        print(f"{arm} lane(s): claim round trip, median of {len(bm)} block medians {statistics.median(bm):.0f} us "
              f"(blocks min {min(bm):.0f}, lower quartile {q1:.0f}, max {max(bm):.0f}){extra}")
    with psycopg.connect(args.dsn, autocommit=True) as c:
        c.execute(f"DROP SCHEMA {s} CASCADE")
    return 0


if __name__ == "__main__":
    sys.exit(main())
