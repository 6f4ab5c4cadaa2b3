"""CPU time of what this round's features run per job, per claim and per enqueue while unused, in isolation.

Each piece is timed with ``time.thread_time`` (this thread's CPU only, so
other processes on the box change it little) as a loop that runs it against
the same loop without it, over real :class:`awa_fast.Job` objects built the
way the claimer builds them; the best of ``--repeat`` rounds, in ns per job
(or per call). ``--dsn`` adds the pieces that need a server: the claim
result's ``progress`` column (a NULL jsonb per row, fetched and dropped) and
``App.enqueue`` on one connection with and without the feature arguments.

    .venv/bin/python perf/feature_cost_micro.py --dsn "$(cat /tmp/feature-cost-pg/dsn)"
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import time
from collections.abc import Callable
from typing import Any

from awa_fast import hooks as _hooks
from awa_fast._impl import new_jobs
from awa_fast.jobs import ClaimSnapshot, JobSpec, attempt_timeout
from awa_fast.limits import LimitWatch
from awa_fast.runtime.shm.histogram import time_counts

N = 1024


def _jobs(n: int = N) -> list[Any]:
    now = _dt.datetime.now(_dt.UTC)
    snaps = [ClaimSnapshot(i, 1, 1, 25, "q", "k", 2, b'{"n": 1}', None, 0, 1, i, 0, 7, now) for i in range(n)]
    jobs = new_jobs(snaps, {"k": None}, None)
    t = time.time()
    for j in jobs:
        j.started_at = t
        j.finished_at = t + 1e-5
    return jobs


def best(fn: Callable[[], None], repeat: int, inner: int) -> float:
    """Best thread CPU seconds of ``inner`` calls of ``fn``, over ``repeat`` rounds."""
    out = []
    for _ in range(repeat):
        t0 = time.thread_time()
        for _ in range(inner):
            fn()
        out.append(time.thread_time() - t0)
    return min(out) / inner


def delta(with_: Callable[[], None], without: Callable[[], None], per: int, repeat: int,
          inner: int) -> dict[str, float]:
    """ns per unit of ``with_`` minus ``without`` (alternated: A B A B ...)."""
    a, b = [], []
    for _ in range(repeat):
        a.append(best(with_, 1, inner))
        b.append(best(without, 1, inner))
    wa, wb = min(a) * 1e9 / per, min(b) * 1e9 / per
    return {"with_ns": round(wa, 1), "without_ns": round(wb, 1), "delta_ns": round(wa - wb, 1)}


def python_pieces(repeat: int) -> dict[str, Any]:
    jobs = _jobs()
    spec = JobSpec("k", lambda job: None, "q", 2, 25, False, None)
    handler = spec.handler
    res: dict[str, Any] = {}

    # executor.py _run_sync (main: _run_sync_attempt): the per-attempt hook check (OTel spans, log job context)
    def hook_with() -> None:
        for job in jobs:
            scope = _hooks.around
            if scope is None:
                handler(job)

    def hook_without() -> None:
        for job in jobs:
            handler(job)
    res["hooks.around check per attempt (otel, logs)"] = delta(hook_with, hook_without, N, repeat, 50)

    # executor.py _run_sync (main: _attempt_started): the attempt timeout (the job's own, else the kind's)
    def timeout_with() -> None:
        for job in jobs:
            if attempt_timeout(job, spec) is not None:
                pass

    def timeout_without() -> None:
        for _job in jobs:
            if spec.timeout is not None:
                pass
    res["attempt_timeout call per attempt (per-job timeout)"] = delta(timeout_with, timeout_without, N, repeat, 50)

    # executor.py _run_sync finally: the handler duration stamp (metrics: handler histogram)
    now = time.time

    def stamp_with() -> None:
        for job in jobs:
            handler(job)
            job.finished_at = now()

    res["finished_at stamp per attempt (handler histogram)"] = delta(stamp_with, hook_without, N, repeat, 50)

    # claimer.py flushed: the handler sample and the flush-listener check per job
    def flushed_full() -> None:
        handler_s: list[float] = []
        closed = None
        for job in jobs:
            started = job.started_at
            if started:
                finished = getattr(job, "finished_at", 0.0)
                if finished:
                    handler_s.append(finished - started)
            if closed is not None:
                pass

    def flushed_no_handler() -> None:
        closed = None
        for job in jobs:
            started = job.started_at
            if started:
                pass
            if closed is not None:
                pass

    def flushed_no_listener_check() -> None:
        for job in jobs:
            started = job.started_at
            if started:
                pass
    res["flushed: handler sample per job (handler histogram)"] = delta(flushed_full, flushed_no_handler, N, repeat, 50)
    res["flushed: flush-listener check per job (App.on_flush)"] = delta(flushed_no_handler, flushed_no_listener_check,
                                                                         N, repeat, 50)
    samples = [1e-5 + i * 1e-9 for i in range(N)]

    def tally() -> None:
        time_counts(samples)

    def nothing() -> None:
        pass
    res["_publish: tally of a flush's handler samples (handler histogram)"] = delta(tally, nothing, N, repeat, 50)

    # limits.py LimitWatch.claim_call between refreshes (per claim call, not per job)
    class _S:
        def lane_claim_result(self) -> None: ...

    watch = LimitWatch(_S(), "q")  # type: ignore[arg-type]
    watch._read_at = time.monotonic() + 1e9  # noqa: SLF001 - no refresh while timing

    def claim_call() -> None:
        watch.claim_call(None)  # type: ignore[arg-type]

    def plain() -> None:
        watch.storage.lane_claim_result  # noqa: B018

    res["LimitWatch.claim_call per claim call (limits, keys), ns per claim"] = delta(claim_call, plain, 1, repeat,
                                                                                     200_000)
    return res


def server_pieces(dsn: str, repeat: int, calls: int) -> dict[str, Any]:
    from awa_fast import App
    from awa_fast.storage import connect, use_raw_jsonb

    res: dict[str, Any] = {}
    conn = connect(dsn, application_name="awa_fast:feature_cost")
    conn.autocommit = True
    use_raw_jsonb(conn)
    cols = ("job_id, run_lease, attempt, max_attempts, queue, kind, priority, args, metadata, ready_slot, lane_id, "
            "lane_seq, claim_slot, claim_id, created_at, errors, callback_result")
    body = ("SELECT g::bigint AS job_id, 1 AS run_lease, 1 AS attempt, 25 AS max_attempts, 'q'::text AS queue, "
            "'k'::text AS kind, 2 AS priority, '{\"n\": 1}'::jsonb AS args, NULL::jsonb AS metadata, 0 AS ready_slot, "
            "1 AS lane_id, g::bigint AS lane_seq, 0 AS claim_slot, 7::bigint AS claim_id, now() AS created_at, "
            "NULL::jsonb AS errors, NULL::jsonb AS callback_result, NULL::jsonb AS progress "
            f"FROM generate_series(1, {N}) g")
    q18 = f"SELECT {cols}, progress FROM ({body}) x"
    q17 = f"SELECT {cols} FROM ({body}) x"

    def fetch(q: str) -> Callable[[], None]:
        def run() -> None:
            cur = conn.cursor(binary=True)
            cur.execute(q)
            cur.fetchall()
        return run
    # thread_time of the client only: the server's time is not on this thread
    res["claim rows: the progress column (NULL jsonb) fetched per row"] = delta(fetch(q18), fetch(q17), N, repeat, 20)
    conn.close()

    app = App(dsn=dsn, schema=_schema_of(dsn))

    @app.job("fc.noop", queue="fc")
    def noop(job: Any) -> None: ...

    with connect(dsn, application_name="awa_fast:feature_cost") as c:
        def plain_call() -> None:
            app.enqueue("fc.noop", {"n": 1}, conn=c)

        def storage_call() -> None:
            # what App.enqueue comes to without the feature arguments' checks (Client._prepare + Storage)
            q, prio, kind, a, m, attempts, when, wait = app._prepare(  # noqa: SLF001
                "fc.noop", {"n": 1}, "fc", 2, 25, None, None, None)
            app.storage.job_enqueue(c, q, prio, kind, a, m, attempts, when, wait)
        with c.transaction(force_rollback=True):
            for _ in range(200):
                plain_call()
                storage_call()
            out_a, out_b = [], []
            per = max(1, calls // repeat)
            for _ in range(repeat):
                out_a.append(best(plain_call, 1, per))
                out_b.append(best(storage_call, 1, per))
        res["App.enqueue per call (thread CPU), all of it vs Client._prepare + Storage.job_enqueue"] = {
            "with_ns": round(min(out_a) * 1e9, 1), "without_ns": round(min(out_b) * 1e9, 1),
            "delta_ns": round((min(out_a) - min(out_b)) * 1e9, 1), "calls": per * repeat}
    return res


def enqueue_pieces(repeat: int) -> dict[str, Any]:
    """The feature arguments' checks of App.enqueue alone (no server): unique, concurrency keys, timeout."""
    from awa_fast import App
    from awa_fast.app import _with_timeout
    from awa_fast.client import _no_unique_with_key
    from awa_fast.limits import check_concurrency_key

    app = App(dsn="host=/nonexistent", schema="bench_fc_micro")

    @app.job("fc.noop", queue="fc")
    def noop(job: Any) -> None: ...

    def checks() -> None:
        m = _with_timeout(None, None)
        u = app._unique_for("fc.noop", None)  # noqa: SLF001
        k = check_concurrency_key(app._key_for("fc.noop", None, None))  # noqa: SLF001
        _no_unique_with_key(u, k is not None)
        if k is not None or u:
            raise AssertionError(m)

    def nothing() -> None:
        pass
    return {"App.enqueue: unique / concurrency_key / timeout checks per call": delta(checks, nothing, 1, repeat,
                                                                                       200_000)}


def _load() -> list[str]:
    with open("/proc/loadavg") as f:
        return f.read().split()[:3]


def _schema_of(dsn: str) -> str:
    return _SCHEMA


_SCHEMA = "bench_fc"


def main() -> None:
    global _SCHEMA
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dsn", default=None, help="a server with the schema migrated (for the server pieces)")
    ap.add_argument("--schema", default="bench_fc")
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--calls", type=int, default=20_000, help="App.enqueue calls per arm")
    args = ap.parse_args()
    _SCHEMA = args.schema
    out: dict[str, Any] = {"loadavg": _load()}
    out.update(python_pieces(args.repeat))
    out.update(enqueue_pieces(args.repeat))
    if args.dsn:
        out.update(server_pieces(args.dsn, args.repeat, args.calls))
    out["loadavg_after"] = _load()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
