"""Shared, standard-library-only helpers of the peer drivers (they run in the peers' own venvs).

Every driver measures the same scenarios the same way as ``awa-fast bench``:

* drain: bulk-enqueue N no-op jobs by the peer's fastest bulk path, start
  its worker(s) in subprocess(es), time first handler start -> last durable
  completion (how "durable" is observed is peer-specific and recorded in
  ``method``);
* bulk-enqueue: jobs/s through the bulk path;
* concurrent-insert: P producer processes, one job per transaction, for S s;
* latency: one producer at R jobs/s for S s (each enqueue its own
  transaction) with an idle worker; pickup = handler start - enqueue ack,
  end-to-end = the peer's own completion timestamp (written in the
  completing transaction: ``now()``, i.e. that transaction's start, a lower
  bound of its commit) - enqueue ack.
"""

from __future__ import annotations

import argparse
import atexit
import json
import math
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any


def percentiles(values: Sequence[float], ps: Sequence[float] = (50, 95, 99)) -> dict[str, float] | None:
    """Linear-interpolated percentiles of seconds, returned in milliseconds."""
    if not values:
        return None
    s = sorted(values)
    out = {}
    for p in ps:
        k = (len(s) - 1) * p / 100.0
        lo = math.floor(k)
        hi = min(lo + 1, len(s) - 1)
        out[f"p{p:g}"] = round((s[lo] + (s[hi] - s[lo]) * (k - lo)) * 1000.0, 3)
    return out


def parser(peer: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"peer_{peer}.py")
    p.add_argument("scenario", choices=["drain", "bulk-enqueue", "concurrent-insert", "latency", "worker"])
    p.add_argument("--dsn", required=True, help="postgresql:// URL")
    p.add_argument("--jobs", type=int, default=20_000)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--rate", type=float, default=200.0)
    p.add_argument("--producers", type=int, default=10)
    p.add_argument("--procs", type=int, default=1, help="worker processes (drain)")
    p.add_argument("--batch", type=int, default=0, help="peer batch size (0: peer-specific best)")
    p.add_argument("--concurrency", type=int, default=0, help="peer concurrency (0: peer-specific best)")
    # worker subprocess options
    p.add_argument("--mode", default="drain")
    p.add_argument("--out", default="")
    p.add_argument("--stop-file", default="")
    p.add_argument("--expect", type=int, default=0)
    return p


def emit(result: dict[str, Any]) -> None:
    result.setdefault("loadavg", [round(x, 2) for x in os.getloadavg()])
    result.setdefault("python", sys.version.split()[0])
    print(json.dumps(result, sort_keys=True, default=str))
    sys.stdout.flush()


def write_records(path: str, records: list[tuple[Any, float]]) -> None:
    """Worker side: (job key, handler start time) pairs, written once at exit."""
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(records, f)


def read_records(paths: Sequence[str]) -> list[tuple[Any, float]]:
    out: list[tuple[Any, float]] = []
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                out.extend((k, t) for k, t in json.load(f))
        except FileNotFoundError:
            pass
    return out


def discard_worker_folder(tmp: str) -> None:
    """Remove a run's worker folder, first copying any worker's non-empty stderr log to ours."""
    for name in sorted(os.listdir(tmp)) if os.path.isdir(tmp) else ():
        if name.endswith(".log") and os.path.getsize(os.path.join(tmp, name)):
            with open(os.path.join(tmp, name), encoding="utf-8", errors="replace") as f:
                sys.stderr.write(f"[{os.path.basename(tmp)}/{name}]\n{f.read()}\n")
    shutil.rmtree(tmp, ignore_errors=True)


_WORKERS: list[subprocess.Popen[bytes]] = []
END = "__end__"  # the record key a drain worker writes with its end time


def spawn_worker(script: str, args: argparse.Namespace, mode: str, out: str, stop_file: str = "",
                 expect: int = 0, extra: Sequence[str] = ()) -> subprocess.Popen[bytes]:
    """Start a worker subprocess (stdout discarded, stderr to ``out + '.log'``); reaped at exit."""
    cmd = [sys.executable, script, "worker", "--dsn", args.dsn, "--mode", mode, "--out", out,
           "--batch", str(args.batch), "--concurrency", str(args.concurrency), "--expect", str(expect),
           "--stop-file", stop_file, *extra]
    with open(out + ".log", "wb") as err:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)
    _WORKERS.append(proc)
    return proc


def _reap() -> None:
    for proc in _WORKERS:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


atexit.register(_reap)


def rate_result(jobs: int, seconds: float, method: str) -> dict[str, Any]:
    """The result of an enqueue-only scenario: ``jobs`` in ``seconds``."""
    return {"jobs": jobs, "seconds": round(seconds, 4), "jobs_per_s": round(jobs / seconds, 1),
            "enqueue_jobs_per_s": round(jobs / seconds, 1), "method": method}


def drain_result(starts: Sequence[float], end: float, jobs: int, enqueue_s: float, method: str) -> dict[str, Any]:
    """The result of a drain: first handler start (of ``starts``) -> ``end``."""
    secs = end - min(starts)
    return {"jobs": len(starts), "seconds": round(secs, 4), "jobs_per_s": round(len(starts) / secs, 1),
            "enqueue_jobs_per_s": round(jobs / enqueue_s, 1), "handled": len(starts), "method": method}


def drain_workers(script: str, args: argparse.Namespace, procs: int, timeout: float,
                  expect: int = 0) -> tuple[list[float], float]:
    """Run ``procs`` drain workers to their end; returns (handler start times, last worker end)."""
    tmp = tempfile.mkdtemp(prefix="peer-drain-")
    try:
        outs = [os.path.join(tmp, f"w{i}.json") for i in range(procs)]
        workers = [spawn_worker(script, args, "drain", o, expect=expect) for o in outs]
        for w in workers:
            w.wait(timeout=timeout)
        recs = read_records(outs)
    finally:
        discard_worker_folder(tmp)
    return [t for k, t in recs if k != END], max(t for k, t in recs if k == END)


class ServeWorker:
    """One worker subprocess in ``serve`` mode until :meth:`stop`; then its handler start times."""

    def __init__(self, script: str, args: argparse.Namespace) -> None:
        self.tmp = tempfile.mkdtemp(prefix="peer-serve-")
        self.out, self.stop_file = os.path.join(self.tmp, "w.json"), os.path.join(self.tmp, "stop")
        self.proc = spawn_worker(script, args, "serve", self.out, self.stop_file)

    def stop(self, timeout: float = 60) -> dict[Any, float]:
        """Ask the worker to stop, wait for it, and return {job key: handler start time}.

        The worker's folder is removed either way.
        """
        try:
            open(self.stop_file, "w").close()
            self.proc.wait(timeout=timeout)
            return {k: t for k, t in read_records([self.out]) if k != END}
        finally:
            discard_worker_folder(self.tmp)


def stop_requested(path: str) -> bool:
    return bool(path) and os.path.exists(path)


def concurrent_insert(producer: Callable[..., tuple[int, list[float]]], dsn: str, producers: int,
                      seconds: float) -> dict[str, Any]:
    """Run ``producer(dsn, window, ready_q)`` in P spawned processes; jobs/s over the common window.

    Each producer connects and warms up, reports ready, then waits for the
    window (start, stop), which the parent fixes once all are ready.
    """
    ctx = multiprocessing.get_context("spawn")
    out, ready = ctx.Queue(), ctx.Queue()
    window = ctx.Array("d", [0.0, 0.0])
    procs = [ctx.Process(target=_producer_shell, args=(producer, dsn, window, out, ready))
             for _ in range(producers)]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=300)
    start_at = time.time() + 0.2
    window[1] = start_at + seconds
    window[0] = start_at
    results = [out.get(timeout=120 + seconds) for _ in procs]
    for p in procs:
        p.join(10)
    total = sum(n for n, _ in results)
    lat = [x for _, ls in results for x in ls]
    return {"jobs": total, "seconds": seconds, "jobs_per_s": round(total / seconds, 1),
            "enqueue_jobs_per_s": round(total / seconds, 1), "enqueue_ms": percentiles(lat),
            "per_producer": [n for n, _ in results]}


def wait_window(window: Any) -> tuple[float, float]:
    """Producer side: block until the parent set the window, then until its start."""
    while window[0] == 0.0:
        time.sleep(0.002)
    start_at, stop_at = window[0], window[1]
    while time.time() < start_at:
        time.sleep(0.001)
    return start_at, stop_at


async def insert_until(window: Any, ready: Any, insert_one: Callable[[int], Any]) -> tuple[int, list[float]]:
    """Producer side, once connected and warmed up: report ready, wait for the window, then
    ``await insert_one(n)`` (one job, one transaction) until it ends; returns (jobs, latencies).

    Only inserts that returned inside the window count.
    """
    ready.put(os.getpid())
    _, stop_at = wait_window(window)
    n, lat = 0, []
    while True:
        t0 = time.time()
        if t0 >= stop_at:
            break
        await insert_one(n)
        t1 = time.time()
        if t1 <= stop_at:
            n += 1
            lat.append(t1 - t0)
    return n, lat


def _producer_shell(producer: Callable[..., tuple[int, list[float]]], dsn: str, window: Any,
                    out: Any, ready: Any) -> None:
    out.put(producer(dsn, window, ready))


def done_times(dsn: str, table: str, key: str, fallback_ts: str, where: str = "TRUE") -> tuple[dict[Any, float], str]:
    """key -> completion time from the completion row: its commit timestamp when the server tracks
    them (``track_commit_timestamp``, the moment of the completing commit), else ``fallback_ts``."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as c:
        on = c.execute("SHOW track_commit_timestamp").fetchone()[0] == "on"
        ts = "pg_xact_commit_timestamp(xmin)" if on else fallback_ts
        rows = c.execute(f"SELECT {key}, extract(epoch FROM {ts})::float8 FROM {table} WHERE {where}").fetchall()
    method = "commit timestamp of the completion row (track_commit_timestamp)" if on else fallback_ts
    return {k: float(t) for k, t in rows if k is not None and t is not None}, method


def latency_summary(sent: dict[Any, float], starts: dict[Any, float], done: dict[Any, float],
                    produced_s: float) -> dict[str, Any]:
    pickup = [starts[k] - t for k, t in sent.items() if k in starts]
    e2e = [done[k] - t for k, t in sent.items() if k in done]
    return {"jobs": len(sent), "seconds": round(produced_s, 3),
            "jobs_per_s": round(len(e2e) / produced_s, 1) if produced_s else None,
            "enqueue_jobs_per_s": round(len(sent) / produced_s, 1) if produced_s else None,
            "pickup_ms": percentiles(pickup), "e2e_ms": percentiles(e2e),
            "started": len(pickup), "completed_seen": len(e2e)}


async def steady(rate: float, seconds: float, enqueue_one: Callable[[int], Any]) -> tuple[dict[Any, float], float]:
    """Call ``await enqueue_one(i)`` at ``rate``/s for ``seconds``; returns ({key: ack time}, elapsed)."""
    import asyncio

    sent: dict[Any, float] = {}
    interval = 1.0 / rate
    start = time.time()
    i = 0
    while True:
        due = start + i * interval
        if due - start >= seconds:
            break
        now = time.time()
        if due > now:
            await asyncio.sleep(due - now)
        key = await enqueue_one(i)
        sent[key] = time.time()
        i += 1
    return sent, time.time() - start
