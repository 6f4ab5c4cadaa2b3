"""The pickup path, timed leg by leg, without the runtime around it.

What the latency bar (pickup p50 <= 1 ms) asks of this machine. A producer
process enqueues one job per transaction at ``--rate`` jobs/s exactly as
``awa-fast bench latency`` does (``App.enqueue``, durable commit) and reports
each acknowledgement time; this process LISTENs on the schema's channel and, on
each NOTIFY, claims through the one claim function (``lane_claim``, one
round trip, autocommit) until the claim comes back short. Per job it records:

* ``notify``: enqueue acknowledged -> NOTIFY read by the listener (negative
  when the notification arrives before the producer sees its COMMIT return);
* ``claim``: NOTIFY read -> claim returned (the claim statement plus its
  commit, which waits for WAL flush);
* ``pickup``: enqueue acknowledged -> claim returned: the least pickup the
  engine allows here, before any thread hand-off, handler dispatch or
  metrics of the runtime.

A job still unclaimed a second after its acknowledgement with no NOTIFY
pending is claimed by a poll, as the runtime's ``poll_interval`` would, and
counted in ``claimed_by_poll``: each one is a wake-up the engine lost. A leg
ends once the producer has exited and every acknowledgement it wrote is read
and claimed (or 60 s past its length), so a producer that starts late or a
reader that lags cannot leave jobs uncounted.

It runs twice: with durable claim commits (what awa-fast does) and with the
claim connection at ``synchronous_commit = off`` (unsafe for a product, see
bug L in docs/reliability.md; here only to show what the WAL flush costs).
The difference between ``awa-fast bench latency``'s pickup and this
``pickup`` is the runtime's own share.

``--producer-connections N`` sends the jobs through N connections in turn,
one per enqueue shard, so one lane each, as an application's pool of
several connections does. ``--runtime-rule`` stops claiming after a short
claim of fewer than 8 rows without the backlog marker, as the runtime's
claimer does (by default the loop claims until a claim comes back empty,
and that empty claim, with one candidate lane, advances the lane's cursor
over its last receipt). With both, each claim also sees the lanes the last
claims emptied, whose cursors lag their receipts (see migration 0034).

    .venv/bin/python perf/pickup_path.py [--dsn DSN] [--rate 200] [--seconds 10] [--json]
        [--producer-connections N] [--runtime-rule]
    .venv/bin/python perf/pickup_path.py --quick        # one short run: proves it works
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from typing import Any

import orjson

from awa_fast.app import App
from awa_fast.bench import KIND, QUEUE, percentiles, steady_producer
from awa_fast.cli import resolve_dsn
from awa_fast.client import PRIORITY_DEFAULT
from awa_fast.storage import RawJson, Storage, connect, use_raw_jsonb
from awa_fast.storage.migrate import migrate

SCHEMA = "perf_pickup_path"
POLL_AFTER_S = 1.0  # the runtime's poll_interval: a job acknowledged this long ago without a claim is polled for


class _AckWriter:
    """What ``steady_producer`` appends to: each (job id, ack time) goes out as a line at once."""

    def append(self, item: tuple[int, float]) -> None:
        sys.stdout.write(f"{item[0]} {item[1]:.6f}\n")
        sys.stdout.flush()


class _Rotating:
    """An ``App.enqueue`` stand-in that sends each job through the next of several connections,
    one per enqueue shard (so one lane each): a producer with several connections, as a pool
    of a multi-threaded or multi-process application is. Same statement as ``App.enqueue``."""

    def __init__(self, dsn: str, connections: int) -> None:
        from claim_lanes_ab import shard_conns  # perf/ is on the path when this runs as a script

        self.storage = Storage(SCHEMA)
        with connect(dsn) as c:
            c.execute(f"SELECT {SCHEMA}.queue_ensure(%s)", (QUEUE,))
        self.conns = shard_conns(dsn, SCHEMA, QUEUE, connections)
        self.turn = 0

    def enqueue(self, kind: str, args: Any, *, queue: str) -> int:
        conn = self.conns[self.turn % len(self.conns)]
        self.turn += 1
        return self.storage.job_enqueue(conn, queue, PRIORITY_DEFAULT, kind, RawJson(orjson.dumps(args)), None, 25)

    def close(self) -> None:
        for c in self.conns:
            c.close()


def produce(dsn: str, rate: float, seconds: float, connections: int = 1) -> None:
    """Producer mode: the latency bench's producer (App.enqueue, one job per transaction) at ``rate``;
    with ``connections`` > 1, the same statement through that many connections in turn."""
    app: Any = App(dsn=dsn, schema=SCHEMA) if connections == 1 else _Rotating(dsn, connections)
    for _ in range(max(2, connections)):
        app.enqueue(KIND, {"warm": 1}, queue="pickup-warmup")  # connect and plan outside the window
    steady_producer(app, rate, seconds, _AckWriter())  # type: ignore[arg-type]
    app.close()


def run_leg(dsn: str, rate: float, seconds: float, durable: bool, connections: int = 1,
            runtime_rule: bool = False) -> dict[str, Any]:
    """One run: a producer subprocess and the listen-and-claim loop here."""
    storage = Storage(SCHEMA)
    conn = connect(dsn, application_name="awa_fast:perf:pickup-claimer")
    use_raw_jsonb(conn)
    if not durable:
        conn.execute("SET synchronous_commit = off")
    while storage.lane_claim(conn, QUEUE, 1024):  # an empty queue, and warm plans
        pass
    conn.execute(f"LISTEN {storage.channel}")
    acks: dict[int, float] = {}
    producer = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--producer", "--dsn", dsn,
                                 "--rate", str(rate), "--seconds", str(seconds),
                                 "--producer-connections", str(connections)],
                                stdout=subprocess.PIPE, text=True)

    def read_acks() -> None:
        assert producer.stdout is not None
        for line in producer.stdout:
            jid, t = line.split()
            acks[int(jid)] = float(t)

    reader = threading.Thread(target=read_acks, daemon=True)
    reader.start()
    claimed: dict[int, tuple[float, float]] = {}  # job -> (notify read, claim returned)
    polled: set[int] = set()  # jobs a claim found without a NOTIFY: each one a lost wake-up
    # The leg ends once the producer has exited, its every ack is read (the reader thread saw
    # the pipe close) and claimed; a late producer start or a lagging reader does not end it early.
    deadline = time.time() + seconds + 60

    def claim_until_short(t_wake: float, by_poll: bool) -> None:
        while True:
            snaps, busy = storage.lane_claim_result(conn, QUEUE, 8)
            t_claim = time.time()
            for snap in snaps:
                claimed[snap.job_id] = (t_wake, t_claim)
                if by_poll:
                    polled.add(snap.job_id)
            if not snaps and not busy:
                break
            if runtime_rule and len(snaps) < 8 and not busy:
                break  # the runtime's claimer: a short claim of a few rows and no marker waits for a NOTIFY

    while time.time() < deadline and (producer.poll() is None or reader.is_alive() or len(claimed) < len(acks)):
        # leave the notifies() generator before using the connection again
        if list(conn.notifies(timeout=0.2, stop_after=1)):
            claim_until_short(time.time(), by_poll=False)
            continue
        now = time.time()
        if any(now - t > POLL_AFTER_S for j, t in list(acks.items()) if j not in claimed):
            claim_until_short(now, by_poll=True)  # acknowledged long ago, no NOTIFY came: poll, and count it
    producer.wait(10)
    reader.join(10)
    conn.close()
    jobs = [j for j in acks if j in claimed]
    ms = 1000.0
    return {
        "durable_claim": durable,
        "jobs": len(jobs),
        "unclaimed": len(acks) - len(jobs),
        "claimed_by_poll": len(polled),
        "notify_ms": percentiles([(claimed[j][0] - acks[j]) * ms for j in jobs]),
        "claim_ms": percentiles([(claimed[j][1] - claimed[j][0]) * ms for j in jobs]),
        "pickup_ms": percentiles([(claimed[j][1] - acks[j]) * ms for j in jobs]),
    }


def commit_ms(dsn: str, n: int) -> dict[str, float] | None:
    """Round trip of a one-row INSERT with its durable commit (the WAL flush alone, nearly)."""
    with connect(dsn) as conn:
        conn.execute("DROP TABLE IF EXISTS perf_pickup_commit")
        conn.execute("CREATE TABLE perf_pickup_commit (x int)")
        out = []
        for i in range(n):
            t0 = time.perf_counter()
            conn.execute("INSERT INTO perf_pickup_commit VALUES (%s)", (i,))
            out.append((time.perf_counter() - t0) * 1000.0)
        conn.execute("DROP TABLE perf_pickup_commit")
    return percentiles(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dsn")
    ap.add_argument("--rate", type=float, default=200.0)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quick", action="store_true", help="one-second legs: proves the script runs")
    ap.add_argument("--producer-connections", type=int, default=1, metavar="N",
                    help="enqueue through N connections in turn, one lane each (1-8; default 1: App.enqueue)")
    ap.add_argument("--runtime-rule", action="store_true",
                    help="after a short claim of fewer than 8 rows and no backlog marker, wait for the next "
                         "NOTIFY as the runtime's claimer does (default: claim until a claim comes back empty)")
    ap.add_argument("--producer", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    dsn = resolve_dsn(args.dsn)
    if not 1 <= args.producer_connections <= 8:
        raise SystemExit("--producer-connections: 1 to 8 (a queue's default enqueue shards)")
    if args.producer:
        produce(dsn, args.rate, args.seconds, args.producer_connections)
        return 0
    seconds = 1.0 if args.quick else args.seconds
    with connect(dsn) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
    migrate(dsn, SCHEMA)
    load0 = os.getloadavg()
    result = {
        "rate": args.rate, "seconds": seconds, "loadavg_start": [round(x, 2) for x in load0],
        "durable_commit_ms": commit_ms(dsn, 50 if args.quick else 500),
        "producer_connections": args.producer_connections,
        "runtime_rule": args.runtime_rule,
        "legs": [run_leg(dsn, args.rate, seconds, durable=d, connections=args.producer_connections,
                         runtime_rule=args.runtime_rule) for d in (True, False)],
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
    }
    with connect(dsn) as conn:
        conn.execute(f"DROP SCHEMA {SCHEMA} CASCADE")
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"rate {args.rate:g}/s for {seconds:g} s, {args.producer_connections} producer connection(s); "
          f"load {result['loadavg_start']} -> {result['loadavg_end']}")
    c = result["durable_commit_ms"]
    print(f"one-row INSERT + durable commit: p50 {c['p50']:.2f} ms, p95 {c['p95']:.2f} ms")
    print("| claim commit | jobs | unclaimed | claimed by poll | notify p50/p95 ms | claim p50/p95 ms "
          "| pickup p50/p95/p99 ms |")
    print("|---|---|---|---|---|---|---|")
    for leg in result["legs"]:
        n, cl, p = leg["notify_ms"], leg["claim_ms"], leg["pickup_ms"]
        print(f"| {'durable' if leg['durable_claim'] else 'async (unsafe)'} | {leg['jobs']} "
              f"| {leg['unclaimed']} | {leg['claimed_by_poll']} "
              f"| {n['p50']:.2f} / {n['p95']:.2f} | {cl['p50']:.2f} / {cl['p95']:.2f} "
              f"| {p['p50']:.2f} / {p['p95']:.2f} / {p['p99']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
