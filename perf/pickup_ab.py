"""The engine's pickup leg, arm against arm: which function or schema costs the time.

Each arm names a schema, the enqueue function the producer calls, the claim
function the claimer calls and optionally how many producer connections
(one lane each) the enqueues take turns over, e.g.
``pool2=bench_x:job_enqueue_v2:claim_batch_v3:2``.
The arms run alternately (ABAB..., ``--rounds`` times) on one server. In each
run a producer subprocess calls ``SELECT <schema>.<enqueue>(...)`` in
autocommit (one job per durable transaction) at ``--rate`` jobs/s and prints
each acknowledgement time; this process LISTENs on the schema's channel and,
on each NOTIFY, claims (``--claim-max`` at most, binary results, autocommit)
until a claim comes back short without the backlog marker, as
``perf/pickup_path.py`` does, and records per job:

* ``claim``: NOTIFY read -> the claim that returned the job came back;
* ``pickup``: enqueue acknowledged -> that claim came back;
* ``call``: the duration of the claim call that returned the job alone;
* ``calls``: claim calls made after the NOTIFY up to the one that returned
  the job (1 when the first claim already saw it);
* ``empty_first``: how often the first claim after a NOTIFY returned no job.

With ``--stats`` the claimer's backend is sampled: wait events seen in
``pg_stat_activity`` while a claim ran (from a third connection).

    .venv/bin/python perf/pickup_ab.py --dsn DSN --arms A=...,B=... [--rounds 4] [--rate 200] [--seconds 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from typing import Any

import psycopg

CLAIM_COLS = "job_id, run_lease"


def produce(dsn: str, schema: str, queue: str, enqueue: str, rate: float, seconds: float, conns: int) -> None:
    """Producer mode: one enqueue per autocommit transaction at ``rate``, acks on stdout.

    With ``conns`` > 1 the enqueues take turns over that many connections
    whose backends map to distinct enqueue shards (so distinct lanes), as a
    connection pool used FIFO does.
    """
    sql = f"SELECT {schema}.{enqueue}(%s::text, 2, 'k', '{{}}'::jsonb, NULL::jsonb, 3, NULL::timestamptz)"
    by_shard: dict[int, psycopg.Connection] = {}
    spare: list[psycopg.Connection] = []
    while len(by_shard) < conns:  # shards 0 .. conns-1: the same lanes in every run of the arm
        c = psycopg.connect(dsn, autocommit=True, application_name="pickup_ab:producer")
        n_shards = c.execute(f"SELECT enqueue_shards FROM {schema}.queue_meta WHERE queue = %s",
                             (queue,)).fetchone()[0]  # type: ignore[index]
        shard = abs(c.info.backend_pid) % n_shards
        if shard >= conns or shard in by_shard:
            spare.append(c)  # kept open until the end, so the next backend gets another pid
        else:
            by_shard[shard] = c
        if len(spare) > 64:
            raise SystemExit("no backend pid maps to the wanted shards")
    for c in spare:
        c.close()
    pool = [by_shard[k] for k in sorted(by_shard)]
    for c in pool:
        c.execute(sql, ("pickup_ab_warm",))
    period = 1.0 / rate
    start = time.perf_counter()
    n = 0
    while True:
        due = start + n * period
        now = time.perf_counter()
        if due - start >= seconds:
            break
        if due > now:
            time.sleep(due - now)
        jid = pool[n % conns].execute(sql, (queue,)).fetchone()[0]  # type: ignore[index]
        sys.stdout.write(f"{jid} {time.time():.6f}\n")
        sys.stdout.flush()
        n += 1
    for c in pool:
        c.close()


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(len(s) * p))]


def run_arm(dsn: str, schema: str, queue: str, enqueue: str, claim: str, conns: int, rate: float, seconds: float,
            claim_max: int, sample: bool) -> dict[str, Any]:
    conn = psycopg.connect(dsn, autocommit=True, application_name="pickup_ab:claimer")
    conn.execute(f"SELECT {schema}.queue_ensure(%s)", (queue,))
    chan = conn.execute(f"SELECT {schema}.notify_channel()").fetchone()[0]  # type: ignore[index]
    cur = conn.cursor(binary=True)
    sql = f"SELECT {CLAIM_COLS} FROM {schema}.{claim}(%s::text, %s::int, 0, 1)"
    for _ in range(3):
        while cur.execute(sql, (queue, 1024)).fetchall():  # drain leftovers, warm plans
            pass
    conn.execute(f'LISTEN "{chan}"')
    pid = conn.info.backend_pid
    waits: Counter[str] = Counter()
    stop = threading.Event()

    def sampler() -> None:
        with psycopg.connect(dsn, autocommit=True) as s:
            q = "SELECT state, wait_event_type, wait_event FROM pg_stat_activity WHERE pid = %s"
            while not stop.is_set():
                row = s.execute(q, (pid,)).fetchone()
                if row and row[0] == "active":
                    waits[f"{row[1]}:{row[2]}"] += 1
                time.sleep(0.0005)

    smp = threading.Thread(target=sampler, daemon=True) if sample else None
    if smp:
        smp.start()
    producer = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--producer", "--dsn", dsn,
                                 "--schema", schema, "--queue", queue, "--enqueue", enqueue, "--rate", str(rate),
                                 "--seconds", str(seconds), "--conns", str(conns)], stdout=subprocess.PIPE, text=True)
    acks: dict[int, float] = {}

    def read_acks() -> None:
        assert producer.stdout is not None
        for line in producer.stdout:
            jid, t = line.split()
            acks[int(jid)] = float(t)

    reader = threading.Thread(target=read_acks, daemon=True)
    reader.start()
    got: dict[int, tuple[float, float, int, float]] = {}
    notifies = 0
    empty_first = 0
    markers = 0
    deadline = time.time() + seconds + 5
    while time.time() < deadline and (producer.poll() is None or len(got) < len(acks)):
        if not list(conn.notifies(timeout=0.2, stop_after=1)):
            continue
        t_notify = time.time()
        notifies += 1
        calls = 0
        while True:
            t_call = time.time()
            rows = cur.execute(sql, (queue, claim_max)).fetchall()
            t_claim = time.time()
            calls += 1
            busy = bool(rows) and rows[-1][0] is None
            if busy:
                rows.pop()
                markers += 1
            if calls == 1 and not rows:
                empty_first += 1
            for r in rows:
                got[r[0]] = (t_notify, t_claim, calls, t_call)
            if not rows and not busy:
                break
    producer.wait(10)
    reader.join(10)
    stop.set()
    if smp:
        smp.join(2)
    conn.close()
    jobs = [j for j in acks if j in got]
    claim_ms = [(got[j][1] - got[j][0]) * 1000 for j in jobs]
    pickup_ms = [(got[j][1] - acks[j]) * 1000 for j in jobs]
    calls = [got[j][2] for j in jobs]
    call_ms = [(got[j][1] - got[j][3]) * 1000 for j in jobs]
    return {
        "jobs": len(jobs), "unclaimed": len(acks) - len(jobs), "notifies": notifies,
        "claim_p50": pct(claim_ms, 0.5), "claim_p95": pct(claim_ms, 0.95),
        "pickup_p50": pct(pickup_ms, 0.5), "pickup_p95": pct(pickup_ms, 0.95),
        "call_p50": pct(call_ms, 0.5), "call_p95": pct(call_ms, 0.95),
        "calls_mean": statistics.fmean(calls) if calls else float("nan"),
        "empty_first": empty_first, "markers": markers,
        "waits": dict(waits.most_common(6)),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dsn", required=True)
    ap.add_argument("--arms", help="NAME=SCHEMA:ENQUEUE_FN:CLAIM_FN,...")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--rate", type=float, default=200.0)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--claim-max", type=int, default=8)
    ap.add_argument("--stats", action="store_true", help="sample the claimer's wait events")
    ap.add_argument("--json", help="append each run as a JSON line to this file")
    ap.add_argument("--producer", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--schema", help=argparse.SUPPRESS)
    ap.add_argument("--enqueue", help=argparse.SUPPRESS)
    ap.add_argument("--queue", help=argparse.SUPPRESS)
    ap.add_argument("--conns", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.producer:
        produce(args.dsn, args.schema, args.queue, args.enqueue, args.rate, args.seconds, args.conns)
        return 0
    arms = []
    for spec in args.arms.split(","):
        name, rest = spec.split("=", 1)
        parts = rest.split(":")
        schema, enq, claim = parts[:3]
        arms.append((name, schema, enq, claim, int(parts[3]) if len(parts) > 3 else 1))
    results: dict[str, list[dict[str, Any]]] = {a[0]: [] for a in arms}
    for rnd in range(args.rounds):
        for name, schema, enq, claim, conns in arms:
            load = os.getloadavg()[0]
            r = run_arm(args.dsn, schema, "pab_" + name, enq, claim, conns, args.rate, args.seconds,
                        args.claim_max, args.stats)
            r.update(arm=name, round=rnd, load=round(load, 2))
            results[name].append(r)
            print(f"r{rnd} {name:>10} load {load:4.2f} jobs {r['jobs']} "
                  f"claim p50/p95 {r['claim_p50']:.2f}/{r['claim_p95']:.2f} "
                  f"call {r['call_p50']:.2f}/{r['call_p95']:.2f} "
                  f"pickup {r['pickup_p50']:.2f}/{r['pickup_p95']:.2f} calls {r['calls_mean']:.2f} "
                  f"empty1st {r['empty_first']} markers {r['markers']} {r['waits'] or ''}", flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(r) + "\n")
    print("medians over rounds:")
    keys = ("claim_p50", "claim_p95", "call_p50", "call_p95", "pickup_p50", "pickup_p95", "calls_mean")
    for name, rs in results.items():
        med = {k: statistics.median(r[k] for r in rs) for k in keys}
        print(f"  {name:>10} claim p50/p95 {med['claim_p50']:.2f}/{med['claim_p95']:.2f} "
              f"call p50/p95 {med['call_p50']:.2f}/{med['call_p95']:.2f} "
              f"pickup p50/p95 {med['pickup_p50']:.2f}/{med['pickup_p95']:.2f} calls {med['calls_mean']:.2f} "
              f"(loads {[r['load'] for r in rs]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
