"""The drain bench with ``supervise --metrics`` on and off, side by side in one run.

Runs ``awa-fast bench drain --json`` alternately without and with
``--metrics 127.0.0.1:<free port>``; while a run with metrics drains, a
scraper reads ``/metrics`` every ``--scrape-every`` seconds (1 s by default,
harsher than Prometheus' usual 15 s), so the measured cost includes serving
scrapes. Prints each run's jobs/s and the ratio of the medians (on / off).

    .venv/bin/python perf/metrics_ab.py --rounds 3 --jobs 20000 [--dsn DSN]

The recording itself (counters and histogram buckets in shared memory)
runs with or without ``--metrics``; this measures the exporter.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape_loop(url: str, every: float, stop: threading.Event, seen: list[int]) -> None:
    while not stop.wait(every):
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:  # noqa: S310 - loopback
                resp.read()
                seen[0] += 1
        except OSError:
            pass  # not serving yet


def one_run(base: list[str], metrics: bool, scrape_every: float) -> dict:
    cmd = list(base)
    stop = threading.Event()
    seen = [0]
    scraper = None
    if metrics:
        port = _free_port()
        cmd += ["--metrics", f"127.0.0.1:{port}"]
        scraper = threading.Thread(target=_scrape_loop, args=(f"http://127.0.0.1:{port}/metrics", scrape_every,
                                                              stop, seen), daemon=True)
        scraper.start()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    finally:
        stop.set()
        if scraper is not None:
            scraper.join()
    res = json.loads(out.stdout)
    return {"metrics": metrics, "jobs_per_s": res["jobs_per_s"], "completed": res.get("completed"),
            "scrapes": seen[0], "loadavg": res.get("loadavg"),
            "other_cpu_share": _other_share(res.get("cpu"))}


def _other_share(cpu: dict | None) -> float | None:
    """The share of the machine's CPU that other processes used during the drain (noise)."""
    if not cpu or not cpu.get("box_capacity_cpu_s"):
        return None
    return round(cpu.get("other_cpu_s", 0.0) / cpu["box_capacity_cpu_s"], 3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="pairs of runs (off, on), alternating")
    ap.add_argument("--jobs", type=int, default=20000)
    ap.add_argument("--dsn", default=None)
    ap.add_argument("--home", default=None, help="embedded server home (without --dsn)")
    ap.add_argument("--scrape-every", type=float, default=1.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    base = [sys.executable, "-m", "awa_fast.cli", "bench", "drain", "--json", "--jobs", str(args.jobs)]
    if args.dsn:
        base += ["--dsn", args.dsn]
    if args.home:
        base += ["--home", args.home]
    runs = []
    for r in range(args.rounds):
        for metrics in ((False, True) if r % 2 == 0 else (True, False)):  # ABBA: drift hits both arms alike
            run = one_run(base, metrics, args.scrape_every)
            runs.append(run)
            print(f"round {r + 1} metrics {'on ' if metrics else 'off'}: {run['jobs_per_s']:>9.1f} jobs/s "
                  f"(completed {run['completed']}, scrapes {run['scrapes']}, load {run['loadavg']}, "
                  f"other processes' CPU share {run['other_cpu_share']})",
                  file=sys.stderr, flush=True)
    off = statistics.median(r["jobs_per_s"] for r in runs if not r["metrics"])
    on = statistics.median(r["jobs_per_s"] for r in runs if r["metrics"])
    # On a shared machine the throughput follows the CPU other processes leave: jobs/s per share of
    # the machine they left free is the steadier comparison (both are reported).
    for r in runs:
        share = r["other_cpu_share"]
        r["jobs_per_s_per_free_cpu"] = round(r["jobs_per_s"] / (1.0 - share), 1) if share is not None and share < 1 \
            else None
    free = {m: [r["jobs_per_s_per_free_cpu"] for r in runs if r["metrics"] is m and r["jobs_per_s_per_free_cpu"]]
            for m in (False, True)}
    free_ratio = round(statistics.median(free[True]) / statistics.median(free[False]), 4) \
        if free[True] and free[False] else None
    summary = {"runs": runs, "median_off": off, "median_on": on, "ratio_on_off": round(on / off, 4),
               "ratio_on_off_per_free_cpu": free_ratio,
               "loadavg_end": [round(x, 2) for x in os.getloadavg()], "date": time.strftime("%Y-%m-%d %H:%M")}
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"median off {off:.1f} jobs/s, on {on:.1f} jobs/s, on/off {on / off:.4f}; "
              f"per free CPU share, on/off {free_ratio}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
