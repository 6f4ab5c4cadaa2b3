"""The ``latency`` and ``pinned-reader`` scenarios: one steady producer, an idle-waiting supervisor.

How latency is measured (the honest way, per job, one clock): the producer
records ``time.time()`` right after its enqueue statement returns, i.e. after
the enqueue transaction's commit was acknowledged (the row's ``created_at``
is the *start* of that transaction, earlier than its commit, so measuring
from it would overstate latency by the enqueue's own duration). Inside the
supervisor the bench App's trace listener (:mod:`awa_fast.bench.worker`)
appends ``(job_id, started_at, committed_at)`` per job. pickup =
``started_at - enqueue ack``, end-to-end = ``committed_at - enqueue ack``.
The runtime's own shared-memory histograms (``created_at``-based, ~1.45x
buckets) are reported beside them as ``shm_pickup_ms`` / ``shm_e2e_ms``.

``pinned-reader`` runs the same while a ``REPEATABLE READ`` transaction that
read ``ready_entries`` stays open, samples dead tuples every second, then
ends the reader and keeps producing for ``--reclaim-seconds`` to show the
reclaim. ``--rss-every S`` samples every claimer's VmRSS (see
:class:`awa_fast.bench.meters.RssSampler`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import threading
import time
from typing import TYPE_CHECKING, Any

import psycopg

from awa_fast.bench.drain import wait_done
from awa_fast.bench.meters import CpuMeter, RssSampler
from awa_fast.bench.procs import bench_supervisor
from awa_fast.bench.report import ms, percentiles
from awa_fast.bench.worker import KIND, QUEUE, client_app, read_trace
from awa_fast.progress import ProgressBar
from awa_fast.storage import connect, probes

if TYPE_CHECKING:
    from awa_fast.app import App


def steady_producer(client: App, rate: float, seconds: float, sent: list[tuple[int, float]],
                    stop: threading.Event | None = None, progress: ProgressBar | None = None,
                    offset: float = 0.0) -> float:
    """Enqueue one job per transaction at ``rate``/s for ``seconds``; appends (job_id, ack time)."""
    interval = 1.0 / rate
    start = time.time()
    i = 0
    enqueue = client.enqueue
    while True:
        due = start + i * interval
        if due - start >= seconds or (stop is not None and stop.is_set()):
            break
        now = time.time()
        if due > now:
            time.sleep(due - now)
        jid = enqueue(KIND, {"i": i}, queue=QUEUE)
        sent.append((jid, time.time()))
        i += 1
        if progress is not None:
            progress.update(offset + time.time() - start, "s")
    return time.time() - start


def _latency_run(args: argparse.Namespace, dsn: str, schema: str, srv: dict[str, Any],
                 pinned: bool) -> dict[str, Any]:
    rate = float(args.rate)
    seconds = float(args.seconds)
    reclaim_s = float(getattr(args, "reclaim_seconds", None) or max(2.0, min(30.0, seconds / 2))) if pinned else 0.0
    trace_dir = tempfile.mkdtemp(prefix="awa-fast-bench-trace-")
    trace = os.path.join(trace_dir, "trace.bin")
    sup = bench_supervisor(dsn, schema, args.stripes, args.concurrency, args.batch, trace=trace)
    client = client_app(dsn, schema)
    sent: list[tuple[int, float]] = []
    cpu = CpuMeter(srv["postmaster_pid"])
    samples: list[dict[str, Any]] = []
    phase = {"name": "pinned" if pinned else "run"}
    stop_sampler = threading.Event()
    reader: psycopg.Connection | None = None
    pin_window: tuple[float, float] | None = None
    rss_every = float(getattr(args, "rss_every", 0.0) or 0.0)
    rss: RssSampler | None = None
    try:
        client.enqueue(KIND, {"warm": 1}, queue="bench-warmup")  # connect outside the window
        sup.start()
        sup.attach()
        sup.wait_claimers_running()
        time.sleep(0.5)  # let LISTEN connections settle: idle-waiting workers
        cpu.supervisor = sup.pid
        sampler = None
        if pinned:
            reader = psycopg.connect(dsn, application_name="awa_fast:bench:pinned-reader")
            reader_xmin = probes.pinned_reader_begin(reader, schema)

            def _sample() -> None:
                t_start = time.time()
                with connect(dsn, application_name="awa_fast:bench:sampler") as sc:
                    while not stop_sampler.is_set():
                        probes.stats_snapshot_clear(sc)
                        samples.append({"t": round(time.time() - t_start, 2), "phase": phase["name"],
                                        "dead_tuples": probes.dead_tuples_total(sc, schema),
                                        "completed": sup.counters()["completed"]})
                        stop_sampler.wait(1.0)

            sampler = threading.Thread(target=_sample, name="dead-tuple-sampler", daemon=True)
            sampler.start()
        cpu.start()
        if rss_every > 0:
            rss = RssSampler(sup, rss_every)
            rss.start()
        total_s = seconds + reclaim_s
        bar = ProgressBar(total_s, "  latency", "s")
        t_run0 = time.time()
        steady_producer(client, rate, seconds, sent, progress=bar)
        if pinned:
            pin_window = (t_run0, time.time())
            assert reader is not None
            reader.rollback()
            reader.close()
            reader = None
            phase["name"] = "reclaim"
            steady_producer(client, rate, reclaim_s, sent, progress=bar, offset=seconds)
        produced_s = time.time() - t_run0
        if rss is not None:
            rss.stop()
        bar.close()
        wait_done(sup, len(sent), timeout=60.0)
        cpu_res = cpu.stop()
        shm_hist = sup.histograms()
        if pinned:
            time.sleep(1.0)  # one more sample after the last completion
            stop_sampler.set()
            if sampler is not None:
                sampler.join(5)
        code = sup.stop()
    finally:
        stop_sampler.set()
        if rss is not None:
            rss.stop(final=False)  # before sup.stop() closes the ring it reads
        if reader is not None:
            reader.close()
        client.close()
        sup.close()
    tr = read_trace(trace)
    shutil.rmtree(trace_dir, ignore_errors=True)
    # The peers' way, for a like-for-like comparison: the completion row's own
    # timestamp (now() = start of the completing transaction) - enqueue ack.
    # With track_commit_timestamp on, the completion row's commit time is exact; else finished_at.
    with connect(dsn, application_name="awa_fast:bench") as c:
        commit_ts = probes.setting(c, "track_commit_timestamp") == "on"
        finished = probes.completion_at_by_job(c, schema, [j for j, _ in sent], commit_ts)
    e2e_db = [finished[j] - ack for j, ack in sent if finished.get(j) is not None]
    pickup, e2e, missing = [], [], 0
    by_phase: dict[str, list[tuple[float, float, float]]] = {}
    for jid, ack in sent:
        rec = tr.get(jid)
        if rec is None:
            missing += 1
            continue
        started, committed = rec
        pickup.append(started - ack)
        e2e.append(committed - ack)
        if pin_window is not None:
            name = "pinned" if ack <= pin_window[1] else "reclaim"
            by_phase.setdefault(name, []).append((started - ack, committed - ack, committed))
    n = len(sent)
    out: dict[str, Any] = {
        "jobs": n, "seconds": round(produced_s, 3), "jobs_per_s": round(len(e2e) / produced_s, 1),
        "enqueue_jobs_per_s": round(n / produced_s, 1), "target_rate": rate,
        "pickup_ms": ms(percentiles(pickup)), "e2e_ms": ms(percentiles(e2e)),
        "pickup_max_ms": round(max(pickup) * 1000, 3) if pickup else None,
        "e2e_max_ms": round(max(e2e) * 1000, 3) if e2e else None,
        "e2e_db_ms": ms(percentiles(e2e_db)),
        "e2e_db_method": "completion row commit timestamp" if commit_ts else "done_entries.finished_at",
        "traced": len(e2e), "untraced": missing,
        "shm_pickup_ms": shm_hist["pickup"], "shm_e2e_ms": shm_hist["e2e"],
        "supervisor_exit": code, "cpu": cpu_res,
        "method": "per job: pickup = claimer's handler-start time - producer's enqueue commit ack; "
                  "e2e = completion COMMIT return time in the batcher - enqueue commit ack (trace hook); "
                  "e2e_db = done_entries.finished_at (start of the completing transaction) - enqueue ack",
    }
    if rss is not None:
        out["claimer_rss_kb"] = rss.summary()
    if pinned:
        phases = {}
        for name, rows in by_phase.items():
            commits = [c for _, _, c in rows]
            span = (max(commits) - min(commits)) if len(commits) > 1 else 0.0
            phases[name] = {"jobs": len(rows), "jobs_per_s": round(len(rows) / span, 1) if span else None,
                            "pickup_ms": ms(percentiles([p for p, _, _ in rows])),
                            "e2e_ms": ms(percentiles([e for _, e, _ in rows]))}
        pinned_dead = [s["dead_tuples"] for s in samples if s["phase"] == "pinned"]
        out.update({
            "pinned_seconds": seconds, "reclaim_seconds": reclaim_s, "phases": phases,
            "reader_xmin": reader_xmin,
            "dead_tuples_series": samples,
            "dead_tuples_max_pinned": max(pinned_dead) if pinned_dead else None,
            "dead_tuples_end_of_pin": pinned_dead[-1] if pinned_dead else None,
            "dead_tuples_end_of_reclaim": samples[-1]["dead_tuples"] if samples else None,
        })
    return out


def bench_latency(args: argparse.Namespace, dsn: str, schema: str, srv: dict[str, Any]) -> dict[str, Any]:
    """``latency``: pickup and end-to-end percentiles per job at ``--rate`` jobs/s."""
    return _latency_run(args, dsn, schema, srv, pinned=False)


def bench_pinned_reader(args: argparse.Namespace, dsn: str, schema: str, srv: dict[str, Any]) -> dict[str, Any]:
    """``pinned-reader``: ``latency`` under a pinned snapshot, dead tuples over time, then the reclaim."""
    return _latency_run(args, dsn, schema, srv, pinned=True)
