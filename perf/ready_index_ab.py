"""The partial ``ready_entries_job`` index (migration 0019) against the full one, alternated on one server.

Two schemas on one server: ``<prefix>_main``, migrated by a baseline checkout's
interpreter (``--baseline-python``: its package's migrations, e.g. main's up
to 0018), and ``<prefix>_branch``, migrated by this checkout. The client code
is this checkout's for both (the enqueue paths are the same Python). Each
round runs, in both schemas (the order flips every round):

* ``bulk``: ``Client.enqueue_many`` of ``--jobs`` payloads ``{n, to}`` (50k per
  COPY, one transaction), then TRUNCATE of the ready tables and a CHECKPOINT;
* ``single``: ``--singles`` one-job enqueues, one autocommit transaction each
  (synchronous_commit off: CPU and WAL, not the flush);

and reports jobs/s, the backend's CPU per job (``/proc/<pid>/schedstat``: it
hardly moves with the machine's load, unlike jobs/s) and the WAL bytes per job
(``pg_current_wal_lsn``). Then, on a ring of ``--jobs`` lane-born rows plus
``--moved`` retried-and-promoted ones, the backend CPU per call of
``job_load`` and of ``job_cancel`` (each cancelling a different available job),
for a lane-born and a re-entered job.

    python perf/ready_index_ab.py --home /tmp/x-pg --prefix bench_x --baseline-python /other/.venv/bin/python
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import subprocess
import sys
import time
from typing import Any

import psycopg

from awa_fast.client import Client
from awa_fast.embedded.servers import ensure_embedded
from awa_fast.storage import Storage
from awa_fast.storage.migrate import migrate

QUEUE, KIND = "bench", "bench.noop"


def _cpu_ns(pid: int) -> int:
    with open(f"/proc/{pid}/schedstat", encoding="ascii") as f:
        return int(f.read().split()[0])


def _lsn(conn: psycopg.Connection) -> int:
    row = conn.execute("SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn").fetchone()
    assert row is not None
    return int(row[0])


class Arm:
    def __init__(self, dsn: str, schema: str) -> None:
        self.schema = schema
        self.client = Client(dsn, schema)
        self.storage = Storage(schema)
        self.conn = psycopg.connect(dsn, autocommit=True, application_name=f"awa_fast:ready_index_ab:{schema}")
        self.conn.execute("SET synchronous_commit = off")
        self.pid = self.conn.info.backend_pid
        self.obs = psycopg.connect(dsn, autocommit=True)

    def measure(self, n: int, work: Any) -> dict[str, float]:
        w0, c0, t0 = _lsn(self.obs), _cpu_ns(self.pid), time.perf_counter()
        work()
        wall = time.perf_counter() - t0
        cpu, wal = _cpu_ns(self.pid) - c0, _lsn(self.obs) - w0
        return {"per_s": n / wall, "cpu_us": cpu / n / 1e3, "wal_b": wal / n, "load": os.getloadavg()[0]}

    def truncate(self) -> None:
        s = self.schema
        self.conn.execute(f'TRUNCATE "{s}".ready_entries, "{s}".ready_segments, "{s}".ready_tombstones, '
                          f'"{s}".done_entries, "{s}".lease_claims, "{s}".lease_claim_closures')
        self.conn.execute("CHECKPOINT")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--home", required=True, help="embedded server home (started if needed)")
    p.add_argument("--prefix", default="bench_ready_index_ab", help="schema prefix; must start with bench")
    p.add_argument("--baseline-python", required=True, help="interpreter of the baseline checkout (migrates _main)")
    p.add_argument("--jobs", type=int, default=200_000)
    p.add_argument("--singles", type=int, default=2000)
    p.add_argument("--moved", type=int, default=1000)
    p.add_argument("--calls", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=6)
    a = p.parse_args(argv)
    if not a.prefix.startswith("bench"):
        p.error("--prefix must start with 'bench'")
    dsn = ensure_embedded(pathlib.Path(a.home))
    names = {"main": f"{a.prefix}_main", "branch": f"{a.prefix}_branch"}
    with psycopg.connect(dsn, autocommit=True) as c:
        for s in names.values():
            c.execute(f'DROP SCHEMA IF EXISTS "{s}" CASCADE')
    subprocess.run([a.baseline_python, "-c", "import sys; from awa_fast.storage.migrate import migrate; "
                    "migrate(sys.argv[1], sys.argv[2])", dsn, names["main"]], check=True)
    migrate(dsn, names["branch"])
    arms = {k: Arm(dsn, s) for k, s in names.items()}
    for k, arm in arms.items():
        v = arm.conn.execute(f'SELECT max(version) FROM "{arm.schema}".schema_migrations').fetchone()
        print(f"{k}: {arm.schema} at migration {v[0] if v else None}")
        arm.client.enqueue_many(KIND, [{"warm": i} for i in range(100)], queue=QUEUE, conn=arm.conn)
        arm.truncate()
    res: dict[tuple[str, str], list[dict[str, float]]] = {}
    n = a.jobs
    for r in range(a.rounds):
        for k in (["main", "branch"] if r % 2 == 0 else ["branch", "main"]):
            arm = arms[k]
            items = [{"n": i, "to": f"user{i}@example.com"} for i in range(n)]
            res.setdefault((k, "bulk"), []).append(arm.measure(n, lambda arm=arm, items=items: arm.client.enqueue_many(
                KIND, items, queue=QUEUE, conn=arm.conn, chunk=50_000)))
            arm.truncate()

            def singles(arm: Arm = arm) -> None:
                for i in range(a.singles):
                    arm.client.enqueue(KIND, {"n": i}, queue=QUEUE, conn=arm.conn)
            res.setdefault((k, "single"), []).append(arm.measure(a.singles, singles))
            arm.truncate()
    # lookups on a filled ring: lane-born rows, and retried jobs promoted back (re-entered); arms alternated
    samples: dict[str, tuple[list[int], list[int]]] = {}
    for k, arm in arms.items():
        ids = arm.client.enqueue_many(KIND, ({"n": i} for i in range(n)), queue=QUEUE, conn=arm.conn,
                                      return_ids=True)
        snaps = arm.storage.lane_claim(arm.conn, QUEUE, a.moved)
        arm.storage.attempt_close(arm.conn, [(s, 4, 0.0, "again") for s in snaps])
        assert arm.storage.deferred_promote(arm.conn, a.moved) == len(snaps)
        arm.conn.execute(f'ANALYZE "{arm.schema}".ready_entries')
        moved = [s.job_id for s in snaps]
        born = ids[a.moved + 1000:]
        # plan the lookups once in this session (a first call plans every partition: ~10-20 ms)
        arm.storage.job_load(arm.conn, born[-1])
        arm.storage.job_load(arm.conn, moved[-1])
        arm.storage.job_cancel(arm.conn, born.pop())
        samples[k] = (born, moved)
    per_cancel = max(1, len(samples["main"][1]) // a.rounds)
    for r in range(a.rounds):
        for k in (["main", "branch"] if r % 2 == 0 else ["branch", "main"]):
            arm = arms[k]
            born, moved = samples[k]
            sample_born = born[r * a.calls:(r + 1) * a.calls]
            sample_moved = [moved[(r * 97 + i) % len(moved)] for i in range(a.calls)]
            for what, sample in (("get lane-born", sample_born), ("get re-entered", sample_moved)):
                res.setdefault((k, what), []).append(arm.measure(len(sample), lambda s=sample, arm=arm: [
                    arm.storage.job_load(arm.conn, j) for j in s]))
            cancel = born[(a.rounds + r) * a.calls:(a.rounds + r + 1) * a.calls]
            res.setdefault((k, "cancel lane-born"), []).append(arm.measure(len(cancel), lambda s=cancel, arm=arm: [
                arm.storage.job_cancel(arm.conn, j) for j in s]))
            gone = moved[r * per_cancel:(r + 1) * per_cancel]  # each re-entered job cancelled once
            res.setdefault((k, "cancel re-entered"), []).append(arm.measure(len(gone), lambda s=gone, arm=arm: [
                arm.storage.job_cancel(arm.conn, j) for j in s]))
    print(f"PostgreSQL {arms['main'].conn.info.server_version}; {n:,} bulk jobs, {a.singles:,} single enqueues, "
          f"{a.rounds} alternating rounds; {a.calls} calls per lookup round on a {n + a.moved:,}-row ring; "
          f"load now {os.getloadavg()[0]:.2f}")
    print(f"{'series':18s} {'arm':6s} {'per s (median)':>15s} {'backend us/op':>14s} {'WAL B/op':>9s}  "
          f"backend us/op per round; load")
    for what in ("bulk", "single", "get lane-born", "get re-entered", "cancel lane-born", "cancel re-entered"):
        for k in ("main", "branch"):
            rows = res[(k, what)]
            med = {m: statistics.median(x[m] for x in rows) for m in rows[0]}
            per = " ".join(f"{x['cpu_us']:.2f}" for x in rows)
            print(f"{what:18s} {k:6s} {med['per_s']:15,.0f} {med['cpu_us']:14.2f} {med['wal_b']:9.0f}  {per}; "
                  f"{min(x['load'] for x in rows):.1f}-{max(x['load'] for x in rows):.1f}")
    for arm in arms.values():
        arm.conn.close()
        arm.obs.close()
        arm.client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
