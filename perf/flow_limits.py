"""What a limited claim costs (docs/flow-control.md, "Costs measured").

For 0, 1,000 and 10,000 open attempts of a queue with ``max_running`` (each
open attempt its own receipt, the worst case: a limited queue's claims are
small), it measures on one connection:

* ``EXPLAIN (ANALYZE, BUFFERS)`` of the running derivation
  (``limit_open_receipts`` with the queue's stored state, plus its leases);
* the mean time of a claim of 1 job through ``lane_claim_limited`` (with
  ``max_running`` = open + 1, so each claim fits exactly one) against
  ``claim_batch_v2`` directly, and of a claim that finds the limit full
  (each claimed job is completed, untimed, so the open count stays put);
* the tuples written per claim call on ``queue_limit_state`` and its TOAST
  table (``pg_stat_user_tables`` / ``pg_statio``: updates, dead tuples).

    .venv/bin/python perf/flow_limits.py --dsn DSN [--sizes 0,1000,10000] [--calls 200]

Creates and drops its own schema ``flow_bench``. Prints one line per size.
"""

from __future__ import annotations

import argparse
import time

import psycopg

from awa_fast import _impl
from awa_fast.client import Client
from awa_fast.storage import Storage, use_raw_jsonb
from awa_fast.storage.migrate import migrate
from awa_fast.storage.schema import render

S = "flow_bench"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dsn", required=True)
    ap.add_argument("--sizes", default="0,1000,10000")
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    for n in [int(x) for x in args.sizes.split(",")]:
        run(args.dsn, n, args.calls)


def run(dsn: str, n_open: int, calls: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(f"DROP SCHEMA IF EXISTS {S} CASCADE")
    migrate(dsn, S)
    conn = psycopg.connect(dsn, autocommit=True)
    use_raw_jsonb(conn)
    st = Storage(S)

    def q(text: str, params: object = None) -> list:
        cur = conn.execute(render(text, S), params)  # type: ignore[arg-type]
        return cur.fetchall() if cur.description else []

    client = Client(dsn, S)
    total = n_open + 2 * calls + 100
    for i in range(0, total, 5000):
        client.enqueue_many("b", [{"i": j} for j in range(i, min(total, i + 5000))], queue="lim")
        client.enqueue_many("b", [{"i": j} for j in range(i, min(total, i + 5000))], queue="plain")
    client.close()
    st.queue_limits_set(conn, "lim", max_running=n_open)
    for _ in range(n_open):  # one receipt per open attempt (plain claims: the setup stays linear)
        assert len(st.lane_claim_result(conn, "lim", 1)[0]) == 1
    assert st.lane_claim_limited_result(conn, "lim", 1)[0] == []  # full: the state catches up on every receipt
    st.queue_limits_set(conn, "lim", max_running=n_open + 1)
    state = q("SELECT open_slots, open_ids, seen_lanes, seen_seqs FROM __SCHEMA__.queue_limit_state")[0]
    q("SET jit = off")  # as lane_claim_limited runs it (migration 0007)
    plan = q("EXPLAIN (ANALYZE, BUFFERS, TIMING OFF, SUMMARY ON) SELECT sum(open_n) FROM "
             "__SCHEMA__.limit_open_receipts('lim', %s, %s, %s, %s)", state)
    derive_ms = [r[0] for r in plan if "Execution Time" in r[0]][0]
    buffers = next((r[0].strip() for r in plan if "Buffers" in r[0]), "")

    def stats() -> tuple[int, int, int]:
        conn.execute("SELECT pg_stat_force_next_flush()") if conn.info.server_version >= 150000 else None
        row = q("SELECT n_tup_upd, n_tup_hot_upd, n_dead_tup FROM pg_stat_user_tables "
                "WHERE schemaname = %s AND relname = 'queue_limit_state'", (S,))[0]
        return int(row[0]), int(row[1]), int(row[2])

    def toast_dead() -> int:
        row = q("SELECT COALESCE(s.n_tup_del + s.n_tup_upd, 0) FROM pg_class c "
                "JOIN pg_stat_all_tables s ON s.relid = c.reltoastrelid "
                "WHERE c.oid = '__SCHEMA__.queue_limit_state'::regclass")
        return int(row[0][0]) if row else 0

    def timed(text: str, queue: str, k: int) -> float:
        """Mean ms of claim calls; what each claimed is completed (untimed), so open stays n_open."""
        cur = conn.cursor(binary=True)
        spent = 0.0
        got = 0
        for _ in range(k):
            t0 = time.perf_counter()
            cur.execute(render(text, S), (queue,))
            rows = cur.fetchall()
            spent += time.perf_counter() - t0
            snaps = _impl.decode_snapshots([r for r in rows if r[0] is not None])
            got += len(snaps)
            if snaps:
                st.receipt_complete_rows(conn, snaps)
        claimed[queue] = claimed.get(queue, 0) + got
        return spent / k * 1000

    claimed: dict[str, int] = {}
    upd0, hot0, _ = stats()
    t_dead0 = toast_dead()
    limited = timed("SELECT * FROM __SCHEMA__.lane_claim_limited(%s, 1, 0, 1)", "lim", calls)
    upd1, hot1, dead1 = stats()
    t_dead1 = toast_dead()
    plain = timed("SELECT * FROM __SCHEMA__.claim_batch_v2(%s, 1, 0, 1)", "plain", calls)
    st.queue_limits_set(conn, "lim", max_running=0)
    st.lane_claim_limited_result(conn, "lim", 1)
    upd2, _, _ = stats()
    full = timed("SELECT * FROM __SCHEMA__.lane_claim_limited(%s, 1, 0, 1)", "lim", calls)
    upd3, _, _ = stats()
    print(f"open={n_open:>6}  derive running: {derive_ms.split(':')[1].strip():>10} ({buffers})  "
          f"claimed {claimed}; claim of 1: limited {limited:.3f} ms, plain {plain:.3f} ms, limit full {full:.3f} ms  "
          f"state writes per claim: {(upd1 - upd0) / calls:.2f} (HOT {(hot1 - hot0) / calls:.2f}), "
          f"dead now {dead1}; toast tuples per claim {(t_dead1 - t_dead0) / calls:.1f}; "
          f"writes per full-limit call {(upd3 - upd2) / calls:.2f}", flush=True)
    conn.close()
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(f"DROP SCHEMA IF EXISTS {S} CASCADE")


if __name__ == "__main__":
    main()
