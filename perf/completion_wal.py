"""What one plain completion writes per job, independent of the machine's load.

Bulk-enqueues N no-op jobs into a fresh schema, claims them ``--batch`` at a
time and completes each receipt in ``--split`` transactions through
``Storage.receipt_complete`` (the batcher's COPY path). Reports, for the
completion transactions only: WAL bytes per job (``pg_current_wal_lsn()``
before and after each), the rows inserted into the done and closure tables
(``pg_stat_user_tables.n_tup_ins``), and the client-observed time per job.

    python perf/completion_wal.py --dsn DSN [--schema bench_completion_wal] [--jobs 51200] [--batch 1024]
        [--split 1]

Run it with each checkout's own interpreter to compare two versions of the
engine (it imports the awa_fast it is run with). The server should be a
private one: the WAL position is server-wide. A checkpoint inside the run adds
full-page writes; run each arm several times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import awa_fast
from awa_fast.client import Client
from awa_fast.storage import Storage, connect
from awa_fast.storage.migrate import migrate
from awa_fast.storage.schema import validate_schema
from awa_fast.storage.types import use_raw_jsonb


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dsn", required=True)
    ap.add_argument("--schema", default="bench_completion_wal")
    ap.add_argument("--jobs", type=int, default=51_200)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--split", type=int, default=1, help="transactions per receipt")
    a = ap.parse_args()
    schema = validate_schema(a.schema)
    with connect(a.dsn) as c:
        c.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    migrate(a.dsn, schema)
    st = Storage(schema)
    cl = Client(a.dsn, schema)
    cl.enqueue_many("w.noop", ({"n": i} for i in range(a.jobs)), queue="q")
    cl.close()
    conn = connect(a.dsn, application_name="awa_fast:completion_wal")
    use_raw_jsonb(conn)
    conn.execute("CHECKPOINT")

    def lsn() -> int:
        row = conn.execute("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn").fetchone()
        assert row is not None
        return int(row[0])

    wal = done = 0
    per_job_s: list[float] = []
    while done < a.jobs:
        snaps = st.lane_claim(conn, "q", a.batch)
        if not snaps:
            break
        k = -(-len(snaps) // max(1, a.split))
        for i in range(0, len(snaps), k):
            part = snaps[i:i + k]
            whole = {(s.claim_slot, s.claim_id) for s in part} if len(part) == len(snaps) else set()
            l0, t0 = lsn(), time.perf_counter()
            with conn.transaction():
                assert not st.receipt_complete(conn, part, whole)
            per_job_s.append((time.perf_counter() - t0) / len(part))
            wal += lsn() - l0
        done += len(snaps)
    conn.close()
    time.sleep(1.0)  # an exiting backend flushes its table statistics
    with connect(a.dsn) as c:
        rows = {r[0]: int(r[1]) for r in c.execute(
            "SELECT relname, n_tup_ins FROM pg_stat_user_tables WHERE schemaname = %s "
            "AND relname ~ '^(done_|lease_claim_clo)'", (schema,)).fetchall()}
        counts = st.queue_counts_exact(c)
    print(json.dumps({
        "awa_fast": awa_fast.__file__, "jobs": done, "batch": a.batch, "split": a.split,
        "wal_bytes_per_job": round(wal / max(done, 1), 1),
        "completion_us_per_job_median": round(statistics.median(per_job_s) * 1e6, 2),
        "rows_inserted": {k: v for k, v in sorted(rows.items()) if v}, "counts": counts}))


if __name__ == "__main__":
    main()
