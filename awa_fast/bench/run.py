"""``awa-fast bench SCENARIO``: check the arguments, prepare a fresh schema, run, report.

Every run drops and re-migrates its own schema (``bench_<scenario>``, or
``--schema`` when it starts with ``bench``), so it never touches an
application's schema. Dead tuples are read after every bench connection is
gone (backends flush their statistics when they exit), without any manual
vacuum.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import pathlib
import platform
import sys
import time
from typing import Any

import awa_fast
from awa_fast.bench.drain import bench_bulk_enqueue, bench_drain
from awa_fast.bench.insert import bench_concurrent_insert
from awa_fast.bench.latency import bench_latency, bench_pinned_reader
from awa_fast.bench.meters import proc_table
from awa_fast.bench.report import format_table, save_result
from awa_fast.client import MAX_PAYLOAD_BYTES
from awa_fast.errors import ConfigError
from awa_fast.storage import connect, probes
from awa_fast.storage.schema import validate_schema

SCENARIOS = {
    "drain": bench_drain,
    "bulk-enqueue": bench_bulk_enqueue,
    "concurrent-insert": bench_concurrent_insert,
    "latency": bench_latency,
    "pinned-reader": bench_pinned_reader,
}
_SERVER_SETTINGS = ("fsync", "synchronous_commit", "wal_level", "shared_buffers", "max_connections", "autovacuum",
                    "autovacuum_naptime", "commit_delay", "full_page_writes", "wal_sync_method")
_STATS_APP = "awa_fast:bench:stats"


def fresh_schema(dsn: str, schema: str) -> None:
    """Drop the bench schema (its sessions first) and migrate it anew."""
    from awa_fast.storage.migrate import migrate

    with connect(dsn, application_name="awa_fast:bench") as c:
        probes.schema_drop(c, schema)
    migrate(dsn, schema)


def server_info(dsn: str) -> dict[str, Any]:
    """Server version, the settings that matter for these numbers, and the postmaster pid."""
    postmaster = None
    with connect(dsn, application_name="awa_fast:bench") as c:
        version = probes.server_version(c)
        settings = probes.settings(c, _SERVER_SETTINGS)
        backend = probes.backend_pid(c)
        # while our backend lives: its parent is the postmaster (when the server is local)
        try:
            ppid = proc_table().get(backend, (None, 0.0))[0]
            if ppid and pathlib.Path(f"/proc/{ppid}/comm").read_text().strip().startswith("postgres"):
                postmaster = int(ppid)
        except OSError:
            pass
    return {"version": version, "settings": settings, "postmaster_pid": postmaster}


def settled_dead_tuples(dsn: str, schema: str, since: float, timeout: float = 15.0) -> dict[str, Any]:
    """n_dead_tup summed over the schema once every bench backend has exited (stats flushed).

    A backend flushes pending statistics when it exits; a live, idle one may
    hold them for up to 10 s. So wait (up to ``timeout``) until no backend
    started by the bench (``backend_start >= since``, application awa_fast*)
    remains, then read with a fresh statistics snapshot. No vacuum is run.
    """
    t0 = time.monotonic()
    with connect(dsn, application_name=_STATS_APP) as c:
        since_ts = _dt.datetime.fromtimestamp(since, _dt.UTC)
        while True:
            waited_for = probes.backends_started_since(c, since_ts, _STATS_APP)
            if not waited_for or time.monotonic() - t0 > timeout:
                break
            time.sleep(0.1)
        probes.stats_flush(c)
        dead = probes.dead_tuples_total(c, schema)
        per_table = probes.dead_tuples_top(c, schema)
    return {"dead_tuples": dead, "top_tables": per_table, "backends_still_open": waited_for,
            "settle_s": round(time.monotonic() - t0, 2)}


def schema_for(args: argparse.Namespace) -> str:
    """The schema a run drops and re-creates: ``bench_<scenario>``, or ``--schema`` when it starts with ``bench``."""
    default = "bench_" + str(args.scenario).replace("-", "_")
    if getattr(args, "schema_given", False) and args.schema:
        name = validate_schema(args.schema)
        if not name.startswith("bench"):
            raise ConfigError(f"bench drops and re-creates its schema; {name!r} does not start with 'bench', "
                              "so it is refused (use e.g. --schema bench_mine)")
        return name
    return default


def run_bench(args: argparse.Namespace, dsn: str) -> int:
    """Run one scenario against ``dsn``; print a table (or JSON with --json). Returns the exit code."""
    import psycopg.pq

    scenario = args.scenario
    fn = SCENARIOS.get(scenario)
    if fn is None:
        raise ConfigError(f"unknown scenario {scenario!r}; use one of {', '.join(SCENARIOS)}")
    for name in ("jobs", "producers", "stripes", "concurrency"):
        if int(getattr(args, name)) < 1:
            raise ConfigError(f"--{name} must be at least 1")
    if int(args.batch) < 0:
        raise ConfigError("--batch must be 0 (the supervisor's default: claims sized from the backlog) or more")
    if float(args.rate) <= 0 or float(args.seconds) <= 0:
        raise ConfigError("--rate and --seconds must be positive")
    payload_bytes = getattr(args, "payload_bytes", None)
    if payload_bytes is not None:
        if scenario not in ("drain", "bulk-enqueue"):
            raise ConfigError("--payload-bytes applies to the drain and bulk-enqueue scenarios only")
        if not 1 <= int(payload_bytes) <= MAX_PAYLOAD_BYTES:
            raise ConfigError(f"--payload-bytes must be between 1 and {MAX_PAYLOAD_BYTES}")
    rss_every = float(getattr(args, "rss_every", 0.0) or 0.0)
    if rss_every < 0 or not math.isfinite(rss_every):
        raise ConfigError("--rss-every must be 0 (off) or a positive number of seconds")
    if rss_every and scenario not in ("latency", "pinned-reader"):
        raise ConfigError("--rss-every applies to the latency and pinned-reader scenarios only")
    schema = schema_for(args)
    load_start = [round(x, 2) for x in os.getloadavg()]
    started = time.time()
    srv = server_info(dsn)
    fresh_schema(dsn, schema)
    result = fn(args, dsn, schema, srv)
    dead = settled_dead_tuples(dsn, schema, started)
    res: dict[str, Any] = {
        "scenario": scenario,
        **result,
        "dead_tuples": dead["dead_tuples"],
        "dead_tuples_per_job": round(dead["dead_tuples"] / result["jobs"], 4) if result.get("jobs") else None,
        "dead_tuples_top": dead["top_tables"],
        "stats_backends_still_open": dead["backends_still_open"],
        "impl": awa_fast.__impl__,
        "psycopg_impl": psycopg.pq.__impl__,
        "awa_fast_version": awa_fast.__version__,
        "postgres_version": srv["version"],
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "loadavg_start": load_start,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "timestamp": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "schema": schema,
        "settings": {"jobs": args.jobs, "rate": args.rate, "seconds": args.seconds,
                     "concurrency": args.concurrency, "stripes": args.stripes, "batch": args.batch,
                     "producers": args.producers, "payload_bytes": payload_bytes, "rss_every": rss_every,
                     "server": srv["settings"]},
    }
    text = json.dumps(res, sort_keys=True, default=str)
    save = getattr(args, "save", None)
    if save:
        path = save_result(res, None if save is True else save)
        print(f"saved {path}", file=sys.stderr)
    if getattr(args, "json", False):
        print(text)
    else:
        print(format_table(res))
    ok = result.get("supervisor_exit") in (None, 0)
    if not ok:
        print(f"awa-fast bench: the supervisor exited with code {result.get('supervisor_exit')}", file=sys.stderr)
    return 0 if ok else 1
