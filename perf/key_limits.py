"""What a key-limited claim costs (docs/flow-control.md, "Per-key concurrency", costs).

For K keys (default 10, 200 and 2,000) with ``key_max_running = 2`` and a
backlog waiting on every key, the first claim admits and claims 2 x K jobs,
which stay open (running). Then, on one connection, it measures the mean time of

* a claim call that finds every key full (it retires nothing, admits
  nothing: the probes of the 2 x K admissions and of the K waiting keys);
* a claim call after one of the open jobs completed (untimed): retire one
  admission, admit that key's next job, claim it;
* the plain claim of a queue with no work (``claim_batch_v3``), for scale;

and the writes per keyed job on ``key_waiting`` and ``key_admits``
(``pg_stat_user_tables``: inserts, deletes, updates) once the queue drained.

    .venv/bin/python perf/key_limits.py --dsn DSN [--keys 10,200,2000] [--calls 200]

Creates and drops its own schema ``key_bench``. Prints one line per size.
"""

from __future__ import annotations

import argparse
import time

import psycopg

from awa_fast.client import Client
from awa_fast.storage import Storage, use_raw_jsonb
from awa_fast.storage.migrate import migrate
from awa_fast.storage.schema import render

S = "key_bench"
Q = "kq"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dsn", required=True)
    ap.add_argument("--keys", default="10,200,2000")
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    for k in [int(x) for x in args.keys.split(",")]:
        run(args.dsn, k, args.calls)


def run(dsn: str, n_keys: int, calls: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(f"DROP SCHEMA IF EXISTS {S} CASCADE")
    migrate(dsn, S)
    conn = psycopg.connect(dsn, autocommit=True)
    use_raw_jsonb(conn)
    st = Storage(S)

    def q(text: str, params: object = None) -> list:
        cur = conn.execute(render(text, S), params)  # type: ignore[arg-type]
        return cur.fetchall() if cur.description else []

    st.queue_key_limit_set(conn, Q, 2)
    per_key = 2 + max(2, (calls + n_keys - 1) // n_keys + 1)
    client = Client(dsn, S)
    keys = [f"k{i}" for i in range(n_keys) for _ in range(per_key)]
    client.enqueue_many("w", [{} for _ in keys], queue=Q, concurrency_key=keys)
    client.close()
    first, _ = st.lane_claim_keyed_result(conn, Q, 4 * n_keys)
    assert len(first) == 2 * n_keys, (len(first), n_keys)
    q("ANALYZE __SCHEMA__.key_waiting")
    q("ANALYZE __SCHEMA__.key_admits")

    t0 = time.perf_counter()
    for _ in range(calls):
        got, more = st.lane_claim_keyed_result(conn, Q, 16)
        assert not got and more
    full_ms = (time.perf_counter() - t0) / calls * 1000

    open_jobs = list(first)
    spent = 0.0
    for _ in range(calls):
        st.receipt_complete_rows(conn, [open_jobs.pop(0)])
        t = time.perf_counter()
        got, _ = st.lane_claim_keyed_result(conn, Q, 16)
        spent += time.perf_counter() - t
        assert len(got) == 1, len(got)
        open_jobs.extend(got)
    one_ms = spent / calls * 1000

    st.queue_ensure(conn, "empty")
    t0 = time.perf_counter()
    for _ in range(calls):
        st.lane_claim_result(conn, "empty", 16)
    plain_ms = (time.perf_counter() - t0) / calls * 1000

    # drain: complete everything, admitting the rest, to count the writes per keyed job
    while open_jobs:
        st.receipt_complete_rows(conn, open_jobs)
        open_jobs, _ = st.lane_claim_keyed_result(conn, Q, 4 * n_keys)
    st.lane_claim_keyed_result(conn, Q, 1)  # retire the last admissions
    n = len(keys)

    def read_writes() -> dict[str, list]:
        return {t: q("SELECT n_tup_ins, n_tup_del, n_tup_upd FROM pg_stat_user_tables "
                     "WHERE schemaname = %s AND relname = %s", (S, t)) for t in ("key_waiting", "key_admits")}

    q("SELECT pg_stat_force_next_flush()")  # this session's counters; the client's were sent at its exit
    deadline = time.monotonic() + 10
    writes = read_writes()
    while time.monotonic() < deadline and any(not w or int(w[0][1]) < n for w in writes.values()):
        time.sleep(0.2)  # a benchmark, not a test: the statistics collector has no event to wait on
        q("SELECT pg_stat_force_next_flush()")
        writes = read_writes()
    left = q("SELECT (SELECT count(*) FROM __SCHEMA__.key_waiting), (SELECT count(*) FROM __SCHEMA__.key_admits)")[0]
    per_job = {t: tuple(round(int(x) / n, 2) for x in w[0]) if w else None for t, w in writes.items()}
    print(f"keys {n_keys:>5} (admitted {2 * n_keys}, waiting {n - 2 * n_keys}): claim with every key full "
          f"{full_ms:.2f} ms, claim after one completion {one_ms:.2f} ms, plain empty claim {plain_ms:.2f} ms; "
          f"per keyed job (ins, del, upd) key_waiting {per_job['key_waiting']} key_admits {per_job['key_admits']}; "
          f"left {tuple(left)}")
    conn.close()
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(f"DROP SCHEMA IF EXISTS {S} CASCADE")


if __name__ == "__main__":
    main()
