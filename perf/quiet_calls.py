"""The two calls of a quiet queue's pickup and e2e, one job at a time, arm by arm on one server.

At 200 jobs/s every job is claimed alone and completed alone: one claim call
(``claim_batch_v4``) and one quiet completion (``receipt_complete_rows``, the
batcher's small-flush path), each its own autocommit transaction. This script
enqueues one job, claims it and completes it, over and over, and times each
call in one of several arms, the arm chosen round-robin per job (so a drift of
the load hits all arms alike):

completion arms (``--calls complete``):

* ``lists``: the statement through a psycopg cursor with Python lists as its
  eleven array parameters (what main sent before 2026-12-05);
* ``literals``: the same cursor, the arrays sent as array literals;
* ``libpq``: ``Storage.receipt_complete_rows`` on a ``PoolConnection`` (the
  batcher's): a statement prepared once, run through libpq with literals;
* ``empty``: a PL/pgSQL function with the same eleven parameters that does
  nothing, called like ``literals`` (the call's fixed cost without its work).

claim arms (``--calls claim``):

* ``cursor``: the statement through a new binary cursor per call, what ``Storage.lane_claim``
  runs on a plain connection (and the claimer ran until 2026-12-07);
* ``direct``: ``Storage.lane_claim`` on a ``PoolConnection``, as the claimer does now: the
  statement prepared once and run through libpq, the rows loaded by the connection's kept
  Transformer and decoded into snapshots;
* ``reused``: the same statement on one cursor kept for the whole run;
* ``libpq``: the statement prepared and run through libpq, the result left undecoded
  (a lower bound for a client that decoded libpq's binary rows itself); its jobs stay
  claimed, not completed.

Each arm reports the wall time per call (p50 / p95) and the client's CPU per
call (``time.thread_time``: this thread's user and system time, socket calls
included). ``--sync off`` runs both calls with ``synchronous_commit = off`` to
take the WAL flush out of the comparison (never a product setting).

    python perf/quiet_calls.py --home /tmp/NAME-pg [--calls complete,claim] [--jobs 1500] [--sync on|off]

The schema (``--schema``, default ``bench_quiet``; it must start with ``bench``) is
dropped and migrated anew; no maintenance runs, so the claim ring only grows during
the run (keep ``--jobs`` in the low thousands).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import struct
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
from psycopg import pq

from awa_fast.client import encode_payload
from awa_fast.jobs import ClaimSnapshot
from awa_fast.storage import Storage, use_raw_jsonb
from awa_fast.storage.connection import PoolConnection
from awa_fast.storage.engine import _bool_array, _direct_statement, _int_array, _text_array
from awa_fast.storage.migrate import migrate

QUEUE, KIND, PRIORITY = "bench", "bench.noop", 2
COMPLETE_ARMS = ("lists", "literals", "libpq", "empty")
CLAIM_ARMS = ("cursor", "direct", "reused", "libpq")
WARM = 10  # first calls of each arm not counted (statement preparation)


def _complete_params(snaps: Sequence[ClaimSnapshot], literal: bool) -> tuple[Any, ...]:
    cols: list[list[Any]] = [[s.claim_slot for s in snaps], [s.claim_id for s in snaps], [s.job_id for s in snaps],
                             [s.run_lease for s in snaps], [s.ready_slot for s in snaps], [s.lane_id for s in snaps],
                             [s.lane_seq for s in snaps], [s.attempt for s in snaps]]
    texts = [[s.queue for s in snaps], [s.kind for s in snaps]]
    flags = [False for _ in snaps]
    if not literal:
        return (*cols, *texts, flags)
    return (*map(_int_array, cols), *map(_text_array, texts), _bool_array(flags))


def run(dsn: str, schema: str, calls: Sequence[str], jobs: int, sync: str) -> dict[str, Any]:
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    migrate(dsn, schema)
    st = Storage(schema)
    producer = psycopg.connect(dsn, autocommit=True)
    claimer = PoolConnection.connect(dsn, autocommit=True)  # every claim arm runs on this one session
    use_raw_jsonb(claimer)
    batcher = PoolConnection.connect(dsn, autocommit=True)  # a plain cursor path runs on it too
    for c in (claimer, batcher):
        c.execute(f"SET synchronous_commit = {sync}")
    q_complete = st.q["receipt_complete_rows"]
    empty = ("CREATE FUNCTION __SCHEMA__.bench_empty_complete(p_claim_slots int[], p_claim_ids bigint[], "
             "p_job_ids bigint[], p_run_leases int[], p_ready_slots int[], p_lane_ids int[], p_lane_seqs bigint[], "
             "p_attempts int[], p_queues text[], p_kinds text[], p_with_state boolean[]) "
             "RETURNS TABLE (job_id bigint, run_lease int) LANGUAGE plpgsql "
             "SET plan_cache_mode = force_generic_plan AS $$ BEGIN RETURN; END $$")
    batcher.execute(empty.replace("__SCHEMA__", f'"{schema}"'))
    q_empty = q_complete.replace("receipt_complete_rows_v2(", "bench_empty_complete(")
    reused = claimer.cursor(binary=True)
    claim_name = _direct_statement(st.q["lane_claim"])[0]  # the name Storage prepares the claim under
    ints = struct.Struct("!i")

    def complete_arm(arm: str) -> Callable[[list[ClaimSnapshot]], object]:
        if arm == "lists":
            return lambda s: batcher.execute(q_complete, _complete_params(s, False)).fetchall()
        if arm == "literals":
            return lambda s: batcher.execute(q_complete, _complete_params(s, True)).fetchall()
        if arm == "libpq":
            return lambda s: st.receipt_complete_rows(batcher, s)
        return lambda s: batcher.execute(q_empty, _complete_params(s, True)).fetchall()

    def snapshots(rows: list[Any]) -> list[ClaimSnapshot]:
        """The cursor arms' rows as Storage decodes them: the backlog marker dropped, then snapshots."""
        from awa_fast import _impl

        if rows and rows[-1][0] is None:
            rows.pop()
        return _impl.decode_snapshots(rows)

    def claim_cursor() -> list[ClaimSnapshot]:
        cur = claimer.cursor(binary=True)  # what Storage.lane_claim_result runs on a plain connection
        cur.execute(st.q["lane_claim"], (QUEUE, 64, 0, 1))
        return snapshots(cur.fetchall())

    def claim_reused() -> list[ClaimSnapshot]:
        reused.execute(st.q["lane_claim"], (QUEUE, 64, 0, 1))
        return snapshots(reused.fetchall())

    # the direct arm's statement, prepared on the session before the first job (the queue is empty:
    # nothing is claimed); the libpq arm runs the same prepared statement
    st.lane_claim(claimer, QUEUE, 64)

    def claim_libpq() -> list[Any]:
        res = claimer.pgconn.exec_prepared(claim_name, [QUEUE.encode(), ints.pack(64), ints.pack(0), ints.pack(1)],
                                           [1, 1, 1, 1], 1)
        assert res.status == pq.ExecStatus.TUPLES_OK, res.error_message
        return [tuple(res.get_value(i, j) for j in range(res.nfields)) for i in range(res.ntuples)
                if res.get_value(i, 0) is not None]

    claim_arms = {"cursor": claim_cursor, "direct": lambda: st.lane_claim(claimer, QUEUE, 64),
                  "reused": claim_reused, "libpq": claim_libpq}
    timed: dict[str, dict[str, tuple[list[float], list[float]]]] = {}
    if "complete" in calls:
        timed["complete"] = {a: ([], []) for a in COMPLETE_ARMS}
    if "claim" in calls:
        timed["claim"] = {a: ([], []) for a in CLAIM_ARMS}
    args = encode_payload({})
    completes = 0
    for i in range(jobs):
        st.job_enqueue(producer, QUEUE, PRIORITY, KIND, args, None, 3)
        if "claim" in timed:
            arm = CLAIM_ARMS[i % len(CLAIM_ARMS)]
            t, u = time.perf_counter(), time.thread_time()
            got = claim_arms[arm]()
            cpu, wall = time.thread_time() - u, time.perf_counter() - t
            timed["claim"][arm][0].append(wall)
            timed["claim"][arm][1].append(cpu)
            # the libpq arm's rows stay undecoded: its job's receipt stays open (no completion
            # is timed for it), which the claims after it do not read
            snaps = got if arm != "libpq" else []
        else:
            snaps = st.lane_claim(claimer, QUEUE, 64)
        if "complete" in timed and snaps:
            arm = COMPLETE_ARMS[completes % len(COMPLETE_ARMS)]  # its own turn: the claim arms leave gaps
            completes += 1
            t, u = time.perf_counter(), time.thread_time()
            complete_arm(arm)(snaps)
            cpu, wall = time.thread_time() - u, time.perf_counter() - t
            timed["complete"][arm][0].append(wall)
            timed["complete"][arm][1].append(cpu)
            if arm == "empty":
                st.receipt_complete_rows(batcher, snaps)
        elif snaps:
            st.receipt_complete_rows(batcher, snaps)
    out: dict[str, Any] = {"schema": schema, "jobs": jobs, "synchronous_commit": sync, "calls": {}}
    for call, arms in timed.items():
        out["calls"][call] = {}
        for arm, (walls, cpus) in arms.items():
            w, c = sorted(walls[WARM:]), cpus[WARM:]
            if not w:
                continue
            out["calls"][call][arm] = {"n": len(w), "wall_p50_ms": round(statistics.median(w) * 1e3, 3),
                                       "wall_p95_ms": round(w[int(len(w) * 0.95)] * 1e3, 3),
                                       "client_cpu_us": round(statistics.mean(c) * 1e6, 1)}
    for c in (producer, claimer, batcher):
        c.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dsn")
    ap.add_argument("--home", default="/tmp/quiet-calls-pg")
    ap.add_argument("--schema", default="bench_quiet")
    ap.add_argument("--calls", default="complete,claim")
    ap.add_argument("--jobs", type=int, default=1500)
    ap.add_argument("--sync", choices=("on", "off"), default="on")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if not args.schema.startswith("bench"):
        ap.error("--schema must start with 'bench' (it is dropped and migrated anew)")
    calls = [c for c in args.calls.split(",") if c]
    if not set(calls) <= {"complete", "claim"}:
        ap.error("--calls takes complete and/or claim")
    dsn = args.dsn
    if dsn is None:
        from awa_fast.embedded.servers import ensure_embedded

        dsn = ensure_embedded(pathlib.Path(args.home))
    load0 = pathlib.Path("/proc/loadavg").read_text().split()[:3]
    out = run(dsn, args.schema, calls, args.jobs, args.sync)
    out["loadavg"] = [load0, pathlib.Path("/proc/loadavg").read_text().split()[:3]]
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{args.jobs} jobs, synchronous_commit={args.sync}, load {' '.join(load0)} -> {' '.join(out['loadavg'][1])}")
    for call, arms in out["calls"].items():
        print(f"| {call} arm | calls | wall p50 / p95 ms | client CPU us/call |")
        print("|---|---|---|---|")
        for arm, r in arms.items():
            print(f"| {arm} | {r['n']} | {r['wall_p50_ms']:.3f} / {r['wall_p95_ms']:.3f} | {r['client_cpu_us']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
