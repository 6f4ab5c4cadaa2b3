"""The floor: what PostgreSQL and Python allow on this machine, with awa-fast's SQL shape.

A framework-free, append-only loop (docs/benchmarks.md, "The floor"), with its own
small schema and its own SQL (nothing of awa-fast's):

* ready rows are immutable, loaded by binary COPY, one lane per process;
* one claim function call per batch takes a lane range ``(lo, hi]``, reads the
  rows and writes one receipt row with an array of job ids;
* a no-op Python call per job, after decoding its JSON args (stdlib ``json``
  through psycopg's default jsonb loader; ``--decode msgspec`` for binary
  rows decoded with msgspec);
* one closure row per batch; every commit durable (``synchronous_commit``
  as the server has it); two commits per batch (claim, closure), or one with
  ``--fused`` (the closure of batch k and the claim of k+1 in one statement).

It also measures the COPY load (psycopg ``write_row`` and a prebuilt binary
buffer), durable commits per second with 1 and 4 clients (threads), and with 10
processes (``perf/producers_floor.py``'s plain arm: the floor of the 10-producer
scenario, one prepared one-row INSERT per durable transaction per process).

    python perf/floor.py --dsn DSN                 # 1 and 2 processes x batch 64 and 1024
    python perf/floor.py --dsn DSN --json --save   # JSON on stdout and in perf/results/
    python perf/floor.py                           # no DSN: a private PostgreSQL under /tmp

Prints the machine's load and the settings; exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import multiprocessing
import os
import pathlib
import struct
import sys
import threading
import time
from typing import Any

import psycopg
from producers_floor import plain_commits_per_s

SCHEMA_SQL = """
DROP SCHEMA IF EXISTS floor CASCADE;
CREATE SCHEMA floor;
CREATE TABLE floor.ready (
    lane int NOT NULL, seq bigint NOT NULL, job_id bigint NOT NULL, kind text NOT NULL, args jsonb NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (lane, seq));
CREATE TABLE floor.ready_scratch (LIKE floor.ready INCLUDING ALL);
CREATE TABLE floor.receipts (
    claim_id bigint PRIMARY KEY, lane int NOT NULL, first_seq bigint NOT NULL, last_seq bigint NOT NULL,
    job_ids bigint[] NOT NULL, claimed_at timestamptz NOT NULL DEFAULT now());
CREATE TABLE floor.closures (
    claim_id bigint PRIMARY KEY, n int NOT NULL, closed_at timestamptz NOT NULL DEFAULT now());
CREATE TABLE floor.commits (id bigint, at timestamptz DEFAULT now());
CREATE SEQUENCE floor.claim_id_seq;

-- One call per batch: read the lane range, append one receipt with the ids.
CREATE FUNCTION floor.claim(p_lane int, p_lo bigint, p_hi bigint)
RETURNS TABLE (claim_id bigint, job_id bigint, kind text, args jsonb)
LANGUAGE plpgsql AS $$
DECLARE v_claim bigint := nextval('floor.claim_id_seq');
BEGIN
    RETURN QUERY
    WITH picked AS MATERIALIZED (
        SELECT r.job_id, r.kind, r.args FROM floor.ready r
        WHERE r.lane = p_lane AND r.seq > p_lo AND r.seq <= p_hi ORDER BY r.seq
    ), receipt AS (
        INSERT INTO floor.receipts (claim_id, lane, first_seq, last_seq, job_ids)
        SELECT v_claim, p_lane, p_lo + 1, p_hi, array_agg(p.job_id) FROM picked p RETURNING 1
    )
    SELECT v_claim, p.job_id, p.kind, p.args FROM picked p;
END $$;

-- Fused: close batch k (if any) and claim batch k+1 in one statement.
CREATE FUNCTION floor.close_and_claim(p_prev bigint, p_prev_n int, p_lane int, p_lo bigint, p_hi bigint)
RETURNS TABLE (claim_id bigint, job_id bigint, kind text, args jsonb)
LANGUAGE plpgsql AS $$
BEGIN
    IF p_prev IS NOT NULL THEN
        INSERT INTO floor.closures (claim_id, n) VALUES (p_prev, p_prev_n);
    END IF;
    IF p_hi > p_lo THEN
        RETURN QUERY SELECT * FROM floor.claim(p_lane, p_lo, p_hi);
    END IF;
END $$;
"""

LANES = 2


def noop(args: Any) -> None:
    """The job: nothing."""


# -- load -----------------------------------------------------------------------------


def _payload(i: int) -> bytes:
    return b'{"n":%d,"to":"user%d@example.com"}' % (i, i)


def prebuilt_buffer(lane: int, first: int, n: int) -> bytes:
    """A binary COPY stream of n ready rows (lane, seq, job_id, kind, args)."""
    out = bytearray(b"PGCOPY\n\xff\r\n\x00" + struct.pack("!ii", 0, 0))
    kind = b"floor.noop"
    head = struct.Struct("!hiiiqiq")
    for seq in range(first, first + n):
        args = b"\x01" + _payload(seq)
        out += head.pack(5, 4, lane, 8, seq, 8, (lane << 40) | seq)
        out += struct.pack("!i", len(kind)) + kind + struct.pack("!i", len(args)) + args
    out += struct.pack("!h", -1)
    return bytes(out)


def load_write_row(conn: psycopg.Connection, table: str, per_lane: int) -> float:
    """Load every lane through psycopg's binary ``write_row``; returns seconds."""
    t0 = time.perf_counter()
    with conn.transaction(), conn.cursor() as cur:
        with cur.copy(f"COPY {table} (lane, seq, job_id, kind, args) FROM STDIN (FORMAT binary)") as cp:
            cp.set_types(["int4", "int8", "int8", "text", "jsonb"])
            for lane in range(LANES):
                for seq in range(1, per_lane + 1):
                    cp.write_row((lane, seq, (lane << 40) | seq, "floor.noop", psycopg.types.json.Jsonb(
                        _RawJson(_payload(seq)))))
    return time.perf_counter() - t0


class _RawJson:
    __slots__ = ("b",)

    def __init__(self, b: bytes) -> None:
        self.b = b


def _raw_dumps(obj: Any) -> bytes:
    return obj.b if isinstance(obj, _RawJson) else json.dumps(obj).encode()


def load_prebuilt(conn: psycopg.Connection, table: str, per_lane: int) -> tuple[float, float]:
    """Load from prebuilt binary buffers; returns (build seconds, load seconds)."""
    t0 = time.perf_counter()
    bufs = [prebuilt_buffer(lane, 1, per_lane) for lane in range(LANES)]
    t1 = time.perf_counter()
    with conn.transaction(), conn.cursor() as cur:
        for buf in bufs:
            with cur.copy(f"COPY {table} (lane, seq, job_id, kind, args) FROM STDIN (FORMAT binary)") as cp:
                cp.write(buf)
    return t1 - t0, time.perf_counter() - t1


# -- the drain loop --------------------------------------------------------------------


def _drain_worker(dsn: str, lanes: list[int], per_lane: int, batch: int, fused: bool, decode: str,
                  start_at: float, out: Any) -> None:
    conn = psycopg.connect(dsn, autocommit=True, application_name="awa_fast:floor")
    if decode == "msgspec":
        import msgspec
        from psycopg.adapt import Loader
        from psycopg.pq import Format

        class RawJsonb(Loader):
            format = Format.BINARY

            def load(self, data: Any) -> bytes:
                return bytes(data[1:])

        conn.adapters.register_loader("jsonb", RawJsonb)
        loads = msgspec.json.decode
    else:
        psycopg.types.json.set_json_loads(json.loads, conn)
        loads = None
    binary = decode == "msgspec"
    claim = "SELECT * FROM floor.claim(%s, %s, %s)"
    fused_q = "SELECT * FROM floor.close_and_claim(%s, %s, %s, %s, %s)"
    close = "INSERT INTO floor.closures (claim_id, n) VALUES (%s, %s)"
    conn.execute("SELECT 1")
    while time.time() < start_at:
        time.sleep(0.0005)
    t0 = time.time()
    done = 0
    prev: tuple[int, int] | None = None
    cur = conn.cursor(binary=binary)
    for lane in lanes:
        lo = 0
        while lo < per_lane:
            hi = min(lo + batch, per_lane)
            if fused:
                rows = cur.execute(fused_q, (prev[0] if prev else None, prev[1] if prev else 0,
                                             lane, lo, hi), prepare=True).fetchall()
            else:
                rows = cur.execute(claim, (lane, lo, hi), prepare=True).fetchall()
            if loads is None:
                for _, _, _, args in rows:
                    noop(args)
            else:
                for _, _, _, args in rows:
                    noop(loads(args))
            if fused:
                prev = (rows[0][0], len(rows))
            else:
                cur.execute(close, (rows[0][0], len(rows)), prepare=True)
            done += len(rows)
            lo = hi
    if fused and prev is not None:
        cur.execute(fused_q, (prev[0], prev[1], lanes[-1], 0, 0), prepare=True)
    t1 = time.time()
    conn.close()
    out.put((t0, t1, done))


def drain(dsn: str, procs: int, batch: int, per_lane: int, fused: bool, decode: str) -> dict[str, Any]:
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("TRUNCATE floor.receipts, floor.closures")
    assignment = [list(range(LANES))] if procs == 1 else [[lane] for lane in range(LANES)][:procs]
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    start_at = time.time() + 1.5
    ps = [ctx.Process(target=_drain_worker, args=(dsn, lanes, per_lane, batch, fused, decode, start_at, out))
          for lanes in assignment]
    cpu0 = _cpu()
    for p in ps:
        p.start()
    res = [out.get(timeout=600) for _ in ps]
    for p in ps:
        p.join()
    cpu1 = _cpu()
    t0 = min(r[0] for r in res)
    t1 = max(r[1] for r in res)
    jobs = sum(r[2] for r in res)
    return {"processes": procs, "batch": batch, "fused": fused, "decode": decode, "jobs": jobs,
            "seconds": round(t1 - t0, 4), "jobs_per_s": round(jobs / (t1 - t0), 1),
            "commits_per_batch": 1 if fused else 2,
            "box_busy_fraction": round((cpu1[0] - cpu0[0]) / max(cpu1[1] - cpu0[1], 1e-9), 3)}


# -- commits --------------------------------------------------------------------------


def commits_per_s(dsn: str, clients: int, seconds: float = 2.0) -> float:
    counts = [0] * clients
    stop_at = time.time() + seconds + 0.3
    start_at = time.time() + 0.3

    def run(i: int) -> None:
        with psycopg.connect(dsn, autocommit=True) as c:
            while time.time() < start_at:
                time.sleep(0.001)
            n = 0
            while time.time() < stop_at:
                c.execute("INSERT INTO floor.commits (id) VALUES (%s)", (n,), prepare=True)
                n += 1
            counts[i] = n

    ts = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return round(sum(counts) / seconds, 1)


# -- helpers -----------------------------------------------------------------------------


def _cpu() -> tuple[float, float]:
    try:
        with open("/proc/stat", encoding="ascii") as f:
            parts = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return 0.0, 1.0
    total = sum(parts[:8])
    return float(total - parts[3] - parts[4]), float(total)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="perf/floor.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--dsn", default=os.environ.get("AWA_FAST_DSN"))
    p.add_argument("--jobs", type=int, default=200_000, help="ready rows (split over 2 lanes)")
    p.add_argument("--procs", default="1,2")
    p.add_argument("--batches", default="64,1024")
    p.add_argument("--fused", action="store_true", help="also run the one-commit-per-batch variant")
    p.add_argument("--decode", choices=["json", "msgspec"], default="json")
    p.add_argument("--json", action="store_true")
    p.add_argument("--save", action="store_true", help="write perf/results/floor-<timestamp>.json")
    args = p.parse_args(argv)
    server = contextlib.ExitStack()  # a private server when no --dsn: stopped and removed at the end
    dsn = args.dsn
    if not dsn:
        from awa_fast.embedded import private_server

        dsn = server.enter_context(private_server(settings={"max_connections": "100", "log_min_messages": "warning"},
                                                  prefix="bench-floor-", stop_mode="fast")).dsn
    try:
        load_start = [round(x, 2) for x in os.getloadavg()]
        per_lane = args.jobs // LANES
        psycopg.types.json.set_json_dumps(_raw_dumps)
        with psycopg.connect(dsn, autocommit=True, application_name="awa_fast:floor") as c:
            c.execute(SCHEMA_SQL)
            version = c.execute("SHOW server_version").fetchone()[0]  # type: ignore[index]
            settings = dict(c.execute("SELECT name, current_setting(name) FROM pg_settings WHERE name = ANY(%s)",
                                      (["fsync", "synchronous_commit", "wal_level", "shared_buffers"],)).fetchall())
            wr = load_write_row(c, "floor.ready", per_lane)
            build, pre = load_prebuilt(c, "floor.ready_scratch", per_lane)
            c.execute("VACUUM ANALYZE floor.ready")
        n = per_lane * LANES
        results: dict[str, Any] = {
            "bench": "floor", "postgres_version": version, "server_settings": settings,
            "jobs": n, "loadavg_start": load_start,
            "copy_write_row_jobs_per_s": round(n / wr, 1),
            "copy_prebuilt_jobs_per_s": round(n / pre, 1),
            "copy_prebuilt_build_jobs_per_s": round(n / build, 1),
            "commits_per_s_1_client": commits_per_s(dsn, 1),
            "commits_per_s_4_clients": commits_per_s(dsn, 4),
            "commits_per_s_10_processes": plain_commits_per_s(dsn, "floor_procs", 10, 5.0),
            "drain": [],
        }
        variants = [False, True] if args.fused else [False]
        for procs in [int(x) for x in args.procs.split(",")]:
            for batch in [int(x) for x in args.batches.split(",")]:
                for fused in variants:
                    r = drain(dsn, procs, batch, per_lane, fused, args.decode)
                    results["drain"].append(r)
                    if not args.json:
                        print(f"  drain procs={procs} batch={batch} fused={fused}: {r['jobs_per_s']:,.0f} jobs/s "
                              f"({r['seconds']:.2f}s, box busy {r['box_busy_fraction']:.0%})", file=sys.stderr)
        results["loadavg"] = [round(x, 2) for x in os.getloadavg()]
        results["cpu_count"] = os.cpu_count()
        results["timestamp"] = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute("DROP SCHEMA floor CASCADE")
    finally:
        server.close()
    if args.save:
        d = pathlib.Path(__file__).resolve().parent / "results"
        d.mkdir(exist_ok=True)
        path = d / f"floor-{dt.datetime.now().strftime('%Y%m%dT%H%M%S')}.json"
        path.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
        print(f"saved {path}", file=sys.stderr)
    if args.json:
        print(json.dumps(results, sort_keys=True))
    else:
        print(f"floor on PostgreSQL {version} ({settings}), {os.cpu_count()} CPUs")
        print(f"  COPY load: write_row {results['copy_write_row_jobs_per_s']:,.0f}/s, prebuilt buffer "
              f"{results['copy_prebuilt_jobs_per_s']:,.0f}/s "
              f"(building it: {results['copy_prebuilt_build_jobs_per_s']:,.0f}/s)")
        print(f"  durable commits: {results['commits_per_s_1_client']:,.0f}/s with 1 client, "
              f"{results['commits_per_s_4_clients']:,.0f}/s with 4, "
              f"{results['commits_per_s_10_processes']:,.0f}/s with 10 processes")
        for r in results["drain"]:
            print(f"  drain {r['processes']} proc x batch {r['batch']}{' fused' if r['fused'] else ''}: "
                  f"{r['jobs_per_s']:,.0f} jobs/s")
        print(f"  loadavg {load_start} -> {results['loadavg']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
