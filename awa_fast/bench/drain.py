"""The backlog scenarios: ``drain`` (COPY a backlog, time a supervisor working it off) and ``bulk-enqueue``.

Drain is timed from ``min(lease_claims.claimed_at)`` (the first claim
statement's start, read while that receipt still exists) to the moment the
bench sees the shared-memory ``completed`` counters reach N (they are
published after each completion ``COMMIT``; polled every 5 ms). The
database-only span ``max(done_entries.finished_at) - min(claimed_at)`` is
reported as ``db_span_s`` (a lower bound: ``finished_at`` is the start of the
last completion transaction, not its commit).

``--payload-bytes N`` pads every job's args with a ``"pad"`` string of random
hex (TOAST compression cannot shrink it) to about N bytes of compact JSON.
"""

from __future__ import annotations

import argparse
import secrets
import time
from typing import Any

from awa_fast.bench.meters import CpuMeter
from awa_fast.bench.procs import SupervisorProcess, bench_supervisor
from awa_fast.bench.report import json_len
from awa_fast.bench.worker import KIND, QUEUE, client_app
from awa_fast.progress import ProgressBar
from awa_fast.storage import Storage, connect, probes


def payload_pad(args: argparse.Namespace, widest: dict[str, Any]) -> str | None:
    """The ``"pad"`` value that brings ``widest`` to about ``--payload-bytes`` of JSON; None when not set.

    Random hex, so TOAST compression cannot shrink the stored args; one string
    shared by every job (jobs with a shorter ``n`` come out a few bytes smaller).
    """
    target = getattr(args, "payload_bytes", None)
    if target is None:
        return None
    k = max(0, int(target) - json_len({**widest, "pad": ""}))
    return secrets.token_hex((k + 1) // 2)[:k]


def copy_chunk(args: argparse.Namespace) -> int:
    """Rows per COPY chunk: 50k, fewer for big payloads (about 64 MiB of args per chunk)."""
    target = getattr(args, "payload_bytes", None)
    return 50_000 if target is None else max(100, min(50_000, (64 << 20) // max(1, int(target))))


def wait_done(sup: SupervisorProcess, target: int, timeout: float, progress: ProgressBar | None = None,
               poll: float = 0.005, stall: float = 30.0) -> int:
    """Poll the shared-memory ``completed`` counters until ``target``; fail on a stall or timeout."""
    deadline = time.monotonic() + timeout
    done = last = 0
    last_change = time.monotonic()
    while done < target:
        sup.check_alive()
        done = sup.counters()["completed"]
        now = time.monotonic()
        if done != last:
            last, last_change = done, now
        if progress is not None:
            progress.update(done)
        if done >= target:
            break
        if now > deadline or now - last_change > stall:
            raise RuntimeError(f"only {done} of {target} jobs completed (no progress for "
                               f"{now - last_change:.0f}s); see the supervisor's log above")
        time.sleep(poll)
    return done


def bench_drain(args: argparse.Namespace, dsn: str, schema: str, srv: dict[str, Any]) -> dict[str, Any]:
    """``drain``: COPY-enqueue ``--jobs`` no-op jobs, then time a real supervisor working them off."""
    n = int(args.jobs)
    pad = payload_pad(args, {"n": n - 1})
    client = client_app(dsn, schema)
    bar = ProgressBar(n, "  enqueue")
    t0 = time.perf_counter()
    jobs = ({"n": i} for i in range(n)) if pad is None else ({"n": i, "pad": pad} for i in range(n))
    client.enqueue_many(KIND, jobs, queue=QUEUE, progress=bar.update, chunk=copy_chunk(args))
    enqueue_s = time.perf_counter() - t0
    bar.close()
    client.close()
    sup = bench_supervisor(dsn, schema, args.stripes, args.concurrency, args.batch,
                           metrics=getattr(args, "metrics", None))
    cpu = CpuMeter(srv["postmaster_pid"])
    first_claim: float | None = None
    try:
        sup.start()
        sup.attach()
        cpu.supervisor = sup.pid
        bar = ProgressBar(n, "  drain")
        with connect(dsn, application_name="awa_fast:bench") as c:
            # first pickup: read min(claimed_at) as soon as the first receipt is committed
            give_up = time.monotonic() + 60.0
            while True:
                if time.monotonic() > give_up:
                    raise RuntimeError("no job was claimed within 60 s of the supervisor start")
                sup.check_alive()
                if sup.counters()["claimed"] > 0:
                    cpu.start()
                    first = probes.claim_first_at(c, schema)
                    first_claim = first if first is not None else time.time()
                    break
                time.sleep(0.001)
            wait_done(sup, n, timeout=max(120.0, n / 500.0), progress=bar)
            observed_end = time.time()
            cpu_res = cpu.stop()
            bar.close()
            last_done = probes.completion_last_at(c, schema)
            shm_hist = sup.histograms()
            recs = sup.counters()["records"]
            work = {k: sum(r[k] for r in recs) for k in ("claim_calls", "empty_claims", "batches_flushed")}
        code = sup.stop()
        with connect(dsn, application_name="awa_fast:bench") as c:
            counts = Storage(schema).queue_counts_exact(c).get(QUEUE, {})
    finally:
        sup.close()
    seconds = observed_end - first_claim
    db_span = (last_done - first_claim) if last_done is not None else None
    out: dict[str, Any] = {
        "jobs": n, "seconds": round(seconds, 4), "jobs_per_s": round(n / seconds, 1),
        "db_span_s": round(db_span, 4) if db_span else None,
        "db_span_jobs_per_s": round(n / db_span, 1) if db_span else None,
        "enqueue_seconds": round(enqueue_s, 4), "enqueue_jobs_per_s": round(n / enqueue_s, 1),
        "pickup_ms": None, "e2e_ms": None,
        "shm_pickup_ms": shm_hist["pickup"], "shm_e2e_ms": shm_hist["e2e"],
        "completed": counts.get("completed"), "supervisor_exit": code, "cpu": cpu_res,
        # what the drain took in calls, whatever the load: claims (and the empty ones among
        # them) and completion flushes, summed over the claimers' shared-memory counters
        "claim_calls": work["claim_calls"], "empty_claims": work["empty_claims"],
        "flushes": work["batches_flushed"],
        "notes": "pickup/e2e not measured for a bulk backlog (they would measure queueing); "
                 "shm_* are the runtime's created_at-based histograms",
    }
    if pad is not None:
        out["args_bytes"] = json_len({"n": n - 1, "pad": pad})
    return out


def bench_bulk_enqueue(args: argparse.Namespace, dsn: str, schema: str, srv: dict[str, Any]) -> dict[str, Any]:
    """``bulk-enqueue``: jobs/s of one ``App.enqueue_many`` call (payload checks + binary COPY)."""
    n = int(args.jobs)
    client = client_app(dsn, schema)
    client.enqueue_many(KIND, [{"warm": 1}], queue="bench-warmup")  # connect, warm caches
    pad = payload_pad(args, {"n": n - 1, "to": f"user{n - 1}@example.com"})
    payloads = [{"n": i, "to": f"user{i}@example.com"} for i in range(n)]
    if pad is not None:
        for p in payloads:
            p["pad"] = pad
    cpu = CpuMeter(srv["postmaster_pid"])
    bar = ProgressBar(n, "  enqueue")
    cpu.start()
    t0 = time.perf_counter()
    client.enqueue_many(KIND, payloads, queue=QUEUE, progress=bar.update, chunk=copy_chunk(args))
    seconds = time.perf_counter() - t0
    cpu_res = cpu.stop()
    bar.close()
    client.close()
    rate = n / seconds
    shape = ("50k rows per COPY chunk; payload {n, to}" if pad is None
             else f"{copy_chunk(args):,} rows per COPY chunk; payload {{n, to, pad}}")
    out: dict[str, Any] = {
        "jobs": n, "seconds": round(seconds, 4), "jobs_per_s": round(rate, 1),
        "enqueue_jobs_per_s": round(rate, 1), "pickup_ms": None, "e2e_ms": None, "cpu": cpu_res,
        "notes": f"one App.enqueue_many call (payload checks + JSON encode + binary COPY), one transaction, {shape}"}
    if pad is not None:
        out["args_bytes"] = json_len(payloads[-1])
    return out
