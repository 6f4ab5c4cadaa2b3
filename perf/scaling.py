"""Scaling and memory: drain throughput against stripes, batch, concurrency and payload; claimer RSS over time.

    .venv/bin/python perf/scaling.py                     # ~15 min; JSON in perf/results/scaling-<UTC ts>.json
    .venv/bin/python perf/scaling.py --repeat 3          # each point three times, median in the tables
    .venv/bin/python perf/scaling.py --rss-minutes 0     # the drain points only
    .venv/bin/python perf/scaling.py --quick             # a tiny run of every point: proves it runs

Each point is one ``awa-fast bench drain --json`` subprocess (fresh schema
``bench_scaling``, a real supervisor), varying one setting from the base
(stripes 2, batch 1024, concurrency 64, the bench's default ``{"n": i}`` args):

* stripes 1, 2, 4
* batch 64, 256, 1024
* concurrency 8, 32, 64
* payload 100 B, 4 KiB, 64 KiB (``--payload-bytes``; ``--big-payload-jobs`` jobs at 64 KiB)

A point shared by several dimensions runs once (per repeat). Then, unless
``--rss-minutes 0``, ``awa-fast bench latency`` at ``--rss-rate`` jobs/s for
``--rss-minutes`` with ``--rss-every``: each claimer's VmRSS from a quarter of
the run to its end must stay flat. A table per dimension is printed (jobs/s,
drain seconds, CPU split, load average); the JSON holds every bench object.
No DSN: ``AWA_FAST_DSN``, ``DATABASE_URL``, then the embedded server (as the CLI).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
from typing import Any

from awa_fast.cli import resolve_dsn

SCHEMA = "bench_scaling"
RESULTS = pathlib.Path(__file__).resolve().parent / "results"
BASE = {"stripes": 2, "batch": 1024, "concurrency": 64, "payload": None}
DIMENSIONS: dict[str, list[Any]] = {
    "stripes": [1, 2, 4],
    "batch": [64, 256, 1024],
    "concurrency": [8, 32, 64],
    "payload": [100, 4096, 65536],
}
BIG_PAYLOAD = 65536


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def bench(dsn: str, scenario: str, *options: str, timeout: float) -> dict[str, Any]:
    """One ``awa-fast bench SCENARIO --json`` subprocess; its JSON, or ``{"error": ...}``."""
    cmd = [sys.executable, "-m", "awa_fast.cli", "--log-level", "WARNING", "bench", scenario, "--json",
           "--dsn", dsn, "--schema", SCHEMA, *options]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f}s", "command": cmd[3:]}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return {"error": f"exit {proc.returncode}: {proc.stderr.strip()[-2000:]}", "command": cmd[3:]}
    return json.loads(lines[-1])


def point_key(stripes: int, batch: int, concurrency: int, payload: int | None, jobs: int) -> str:
    return f"s{stripes}-b{batch}-c{concurrency}-p{payload or 'default'}-j{jobs}"


def run_drains(dsn: str, args: argparse.Namespace) -> tuple[dict[str, list[dict[str, Any]]], dict[str, Any]]:
    """Every point of every dimension, ``--repeat`` times (shared points once); (runs by key, dimensions)."""
    runs: dict[str, list[dict[str, Any]]] = {}
    dims: dict[str, Any] = {}
    for name, values in DIMENSIONS.items():
        dims[name] = []
        for value in values:
            cfg = {**BASE, name: value}
            jobs = args.big_payload_jobs if (cfg["payload"] or 0) >= BIG_PAYLOAD else args.jobs
            key = point_key(cfg["stripes"], cfg["batch"], cfg["concurrency"], cfg["payload"], jobs)
            dims[name].append({"value": value, "key": key, "jobs": jobs, **cfg})
            if key in runs:
                continue
            options = ["--jobs", str(jobs), "--stripes", str(cfg["stripes"]), "--batch", str(cfg["batch"]),
                       "--concurrency", str(cfg["concurrency"])]
            if cfg["payload"] is not None:
                options += ["--payload-bytes", str(cfg["payload"])]
            runs[key] = []
            for i in range(args.repeat):
                if args.pause and (len(runs) > 1 or i):
                    time.sleep(args.pause)
                res = bench(dsn, "drain", *options, timeout=max(600.0, jobs / 100.0))
                runs[key].append(res)
                log(f"drain {key} #{i + 1}: " + (res["error"].splitlines()[0] if "error" in res else
                                                 f"{res['jobs_per_s']:,.0f} jobs/s, load {res['loadavg'][0]}"))
    return runs, dims


def _fmt_range(values: list[float]) -> str:
    if not values:
        return "-"
    med = statistics.median(values)
    return f"{med:,.0f}" if len(values) == 1 else f"{med:,.0f} ({min(values):,.0f}-{max(values):,.0f})"


def tables(runs: dict[str, list[dict[str, Any]]], dims: dict[str, Any]) -> str:
    """A markdown table per dimension: median jobs/s (range over repeats), seconds, CPU, load."""
    out = []
    for name, points in dims.items():
        out.append(f"### {name}\n")
        out.append(f"| {name} | jobs | jobs/s | drain s | enqueue jobs/s | cpu s workers / postgres / other "
                   "| loadavg start -> end |")
        out.append("|---|---|---|---|---|---|---|")
        for p in points:
            ok = [r for r in runs[p["key"]] if "error" not in r]
            label = "default" if p["value"] is None else (f"{p['value']:,} B" if name == "payload" else p["value"])
            if not ok:
                out.append(f"| {label} | {p['jobs']:,} | failed | | | | |")
                continue
            mid = sorted(ok, key=lambda r: r["jobs_per_s"])[len(ok) // 2]
            cpu = mid.get("cpu") or {}
            out.append(f"| {label} | {p['jobs']:,} | {_fmt_range([r['jobs_per_s'] for r in ok])} "
                       f"| {mid['seconds']:.2f} | {mid['enqueue_jobs_per_s']:,.0f} "
                       f"| {cpu.get('supervisor_cpu_s')} / {cpu.get('postgres_cpu_s')} / {cpu.get('other_cpu_s')} "
                       f"| {mid['loadavg_start'][0]} -> {mid['loadavg'][0]} |")
        out.append("")
    return "\n".join(out)


def rss_table(res: dict[str, Any]) -> str:
    """The claimer RSS run as a markdown table (kB)."""
    if "error" in res:
        return f"### claimer RSS\n\nfailed: {res['error']}\n"
    rss = res["claimer_rss_kb"]
    e2e = res.get("e2e_ms") or {}
    out = [f"### claimer RSS: latency at {res['target_rate']:g} jobs/s ({res['enqueue_jobs_per_s']:,.0f} achieved), "
           f"{res['jobs']:,} jobs in {res['seconds']:.0f} s, sampled every {rss['every_s']:g} s; "
           f"e2e p50/p99 {e2e.get('p50')}/{e2e.get('p99')} ms; load {res['loadavg_start'][0]} -> {res['loadavg'][0]}\n",
           "| claimer | pid | first | at 1/4 | last | max | growth since 1/4 | slope kB/min |",
           "|---|---|---|---|---|---|---|---|"]
    for pid, c in rss["per_claimer"].items():
        out.append(f"| {c['claimer']} | {pid} | {c['first']:,} | {c['quarter']:,} | {c['last']:,} | {c['max']:,} "
                   f"| {c['growth']:+,} ({c['growth_pct']}%) | {c['slope_kb_per_min']} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="perf/scaling.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--dsn", default=None, help="default: AWA_FAST_DSN, DATABASE_URL, else the embedded server")
    p.add_argument("--home", default=os.environ.get("AWA_FAST_HOME") or None, help="embedded server home")
    p.add_argument("--quick", action="store_true", help="a tiny run of every point: proves it runs")
    p.add_argument("--jobs", type=int, default=None, help="jobs per drain point (100000; --quick: 500)")
    p.add_argument("--big-payload-jobs", type=int, default=None,
                   help="jobs per drain point with 64 KiB args (20000; --quick: 200)")
    p.add_argument("--repeat", type=int, default=1, help="runs per drain point (median shown)")
    p.add_argument("--pause", type=float, default=None, help="seconds between runs (3; --quick: 0)")
    p.add_argument("--rss-minutes", type=float, default=None,
                   help="length of the RSS run (0: skip it; 10; --quick: 0.2)")
    p.add_argument("--rss-rate", type=float, default=500.0, help="jobs/s of the RSS run")
    p.add_argument("--rss-every", type=float, default=None,
                   help="RSS sampling period in seconds (default: the run / 120, at least 0.5)")
    p.add_argument("-o", "--output", default=None, help="JSON path (default perf/results/scaling-<UTC ts>.json)")
    args = p.parse_args(argv)
    for name, full, quick in (("jobs", 100_000, 500), ("big_payload_jobs", 20_000, 200), ("pause", 3.0, 0.0),
                              ("rss_minutes", 10.0, 0.2)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if args.jobs < 1 or args.big_payload_jobs < 1 or args.repeat < 1 or args.rss_minutes < 0:
        p.error("--jobs, --big-payload-jobs and --repeat must be at least 1, --rss-minutes at least 0")
    dsn = resolve_dsn(args)
    started = dt.datetime.now(dt.UTC)
    load_start = [round(x, 2) for x in os.getloadavg()]
    log(f"scaling: {args.jobs:,} jobs per point ({args.big_payload_jobs:,} at 64 KiB), repeat {args.repeat}, "
        f"RSS run {args.rss_minutes:g} min; loadavg {load_start}")
    runs, dims = run_drains(dsn, args)
    rss: dict[str, Any] | None = None
    if args.rss_minutes > 0:
        seconds = args.rss_minutes * 60.0
        every = args.rss_every or max(0.5, round(seconds / 120.0, 1))
        log(f"latency {args.rss_rate:g} jobs/s for {seconds:.0f} s, claimer RSS every {every:g} s")
        if args.pause:
            time.sleep(args.pause)
        rss = bench(dsn, "latency", "--rate", str(args.rss_rate), "--seconds", str(seconds),
                    "--rss-every", str(every), "--stripes", str(BASE["stripes"]),
                    "--batch", str(BASE["batch"]), "--concurrency", str(BASE["concurrency"]),
                    timeout=seconds + 600.0)
        log("rss: " + (rss["error"].splitlines()[0] if "error" in rss else
                       f"max growth since 1/4 {rss['claimer_rss_kb']['max_growth']} kB"))
    text = tables(runs, dims) + ("\n" + rss_table(rss) if rss is not None else "")
    result = {
        "bench": "scaling", "quick": args.quick, "timestamp": started.isoformat(timespec="seconds"),
        "finished": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "loadavg_start": load_start, "loadavg": [round(x, 2) for x in os.getloadavg()],
        "cpu_count": os.cpu_count(), "base": BASE,
        "settings": {"jobs": args.jobs, "big_payload_jobs": args.big_payload_jobs, "repeat": args.repeat,
                     "pause": args.pause, "rss_minutes": args.rss_minutes, "rss_rate": args.rss_rate,
                     "rss_every": args.rss_every},
        "dimensions": dims, "runs": runs, "rss": rss, "tables_md": text,
    }
    if args.output:
        path = pathlib.Path(args.output)
    else:
        RESULTS.mkdir(parents=True, exist_ok=True)
        path = RESULTS / f"scaling-{started.strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps(result, indent=2, sort_keys=True, default=str) + "\n", encoding="utf-8")
    print(text)
    log(f"saved {path}")
    failed = [k for k, rs in runs.items() for r in rs if "error" in r] + (["rss"] if rss and "error" in rss else [])
    if failed:
        log(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
