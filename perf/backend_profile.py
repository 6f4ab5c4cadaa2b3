"""Where one server process's CPU goes for a quiet queue's call: ``perf`` stacks, folded by phase.

One call is run in a loop on its own connection while ``perf record`` samples that connection's
server process (``-e cpu-clock``: no hardware counters needed; ``--call-graph dwarf``: the
server's binaries keep their symbols). The stacks are then folded into the shares the
performance log reports: the PL/pgSQL function, its nested functions, the executor's start and
end and the cached-plan checks of every statement, the commit and its ``fdatasync``, and the
protocol (reading the call, answering, waiting in ``epoll``), plus the server CPU per call.

* ``--call claim``: enqueue one job, claim it (``claim_batch_v4``), complete it; the claim's process;
* ``--call complete``: the same loop; the completion's process (``receipt_complete_rows``);
* ``--call enqueue``: ``App.enqueue`` alone; its pool connection's process.

The server must be local and ``perf`` installed, run by a user allowed to attach to the server's
processes (root here). Durable commits throughout; ``--gap`` sleeps between loops.

    .venv/bin/python perf/backend_profile.py --dsn DSN [--call claim|complete|enqueue]
        [--seconds 3] [--hz 2000] [--gap 0] [--schema bench_backend_profile]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator

import psycopg

from awa_fast.app import App
from awa_fast.client import encode_payload
from awa_fast.storage import Storage, use_raw_jsonb
from awa_fast.storage.connection import PoolConnection
from awa_fast.storage.migrate import migrate

QUEUE, KIND = "profiled", "bench.noop"
_FRAME = re.compile(r"^\s+[0-9a-f]+\s+(\S+?)(?:\+0x[0-9a-f]+)?\s")

# (label, frame that marks it) in the order they are printed; a sample counts in each whose frame it holds
SHARES = (
    ("the PL/pgSQL function", "plpgsql_exec_function"),
    ("executor start (every statement)", "standard_ExecutorStart"),
    ("cached-plan checks (GetCachedPlan)", "GetCachedPlan"),
    ("executor end", "standard_ExecutorEnd"),
    ("the commit", "CommitTransaction"),
    ("- its fdatasync", "pg_fdatasync"),
    ("reading the call", "secure_read"),
    ("answering", "secure_write"),
)


# the frame under the outermost function that says what kind of PL/pgSQL statement a sample is in
_KINDS = {
    "exec_stmt_execsql.isra.0": "SELECT INTO, INSERT, UPDATE, DELETE",
    "exec_stmt_execsql": "SELECT INTO, INSERT, UPDATE, DELETE",
    "SPI_execute_plan_extended": "RETURN QUERY",
    "exec_run_select.constprop.0": "PERFORM, and loops over a query",
    "exec_run_select": "PERFORM, and loops over a query",
    "exec_assign_expr": "assignments (v := expression)",
    "exec_eval_boolean": "conditions (IF, EXIT WHEN)",
}


def stacks(perf_script: Iterator[str]) -> list[list[str]]:
    """Each sample's frames, leaf first, from ``perf script`` output."""
    out: list[list[str]] = []
    cur: list[str] | None = None
    for line in perf_script:
        if not line.strip():
            if cur:
                out.append(cur)
            cur = None
        elif line[0] not in " \t":
            cur = []
        elif cur is not None:
            m = _FRAME.match(line)
            if m:
                cur.append(m.group(1))
    if cur:
        out.append(cur)
    return out


def fold(samples: list[list[str]]) -> dict[str, float]:
    """The shares (percent of samples) of SHARES, of nested PL/pgSQL calls and of statement kinds."""
    n = len(samples) or 1
    out = {label: 100.0 * sum(1 for s in samples if frame in s) / n for label, frame in SHARES}
    out["- nested PL/pgSQL functions"] = 100.0 * sum(1 for s in samples
                                                     if s.count("plpgsql_exec_function") >= 2) / n
    kinds: collections.Counter[str] = collections.Counter()
    for s in samples:
        if "plpgsql_exec_function" in s and s.count("plpgsql_exec_function") < 2:
            outer = [_KINDS[f] for f in reversed(s) if f in _KINDS]
            kinds[outer[0] if outer else "the function's own work (frames, variables)"] += 1
    for kind, k in kinds.most_common():
        out[f"- statements: {kind}"] = 100.0 * k / n
    return out


def record(pid: int, seconds: float, hz: int, path: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(["perf", "record", "-q", "-e", "cpu-clock", "-F", str(hz), "--call-graph", "dwarf,16384",
                             "-p", str(pid), "-o", path, "--", "sleep", str(seconds)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def loop_until(done: threading.Event, step: Callable[[], None], gap: float) -> int:
    n = 0
    while not done.is_set():
        step()
        n += 1
        if gap:
            time.sleep(gap)
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dsn", required=True)
    ap.add_argument("--schema", default="bench_backend_profile")
    ap.add_argument("--call", choices=("claim", "complete", "enqueue"), default="claim")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--hz", type=int, default=2000)
    ap.add_argument("--gap", type=float, default=0.0)
    args = ap.parse_args()
    if not args.schema.startswith("bench"):
        raise SystemExit("--schema must start with 'bench' (it is dropped)")
    if shutil.which("perf") is None:
        raise SystemExit("perf is not installed (apt-get install linux-perf, or linux-tools for this kernel)")
    with psycopg.connect(args.dsn, autocommit=True) as c:
        c.execute(f"DROP SCHEMA IF EXISTS {args.schema} CASCADE")
    migrate(args.dsn, args.schema)
    st = Storage(args.schema)
    payload = encode_payload({})
    conns: list[psycopg.Connection] = []
    app: App | None = None
    if args.call == "enqueue":
        app = App(dsn=args.dsn, schema=args.schema)

        def step() -> None:
            assert app is not None
            app.enqueue(KIND, {}, queue=QUEUE)

        step()
        with psycopg.connect(args.dsn, autocommit=True) as c:
            row = c.execute("SELECT pid FROM pg_stat_activity WHERE application_name LIKE %s "
                            "AND pid <> pg_backend_pid() AND backend_type = 'client backend' "
                            "ORDER BY backend_start DESC LIMIT 1", ("awa_fast%",)).fetchone()
        assert row is not None, "the App's pool connection was not found"
        pid = int(row[0])
    else:
        producer = psycopg.connect(args.dsn, autocommit=True)
        claimer = psycopg.connect(args.dsn, autocommit=True)
        use_raw_jsonb(claimer)
        st.session_read_committed(claimer)
        batcher = PoolConnection.connect(args.dsn, autocommit=True)
        st.session_index_probes(batcher)
        st.session_read_committed(batcher)
        conns = [producer, claimer, batcher]

        def step() -> None:
            st.job_enqueue(producer, QUEUE, 2, KIND, payload, None, 3)
            st.receipt_complete_rows(batcher, st.lane_claim(claimer, QUEUE, 64))

        pid = (claimer if args.call == "claim" else batcher).info.backend_pid
    warm = threading.Event()
    threading.Timer(1.0, warm.set).start()
    loop_until(warm, step, args.gap)  # plans made, caches warm
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "perf.data")
        perf = record(pid, args.seconds, args.hz, path)
        done = threading.Event()
        threading.Thread(target=lambda: (perf.wait(), done.set()), daemon=True).start()
        calls = loop_until(done, step, args.gap)
        if perf.returncode != 0:
            raise SystemExit(f"perf record failed (exit {perf.returncode}): run as a user allowed to attach")
        script = subprocess.run(["perf", "script", "-i", path], capture_output=True, text=True, check=True)
    samples = stacks(iter(script.stdout.splitlines()))
    per_call_us = len(samples) / args.hz / max(calls, 1) * 1e6
    print(f"{args.call}: {calls} loops in {args.seconds:g} s, {len(samples)} samples at {args.hz} Hz; "
          f"server CPU ~{per_call_us:.0f} us per call; load {load:.2f} -> {os.getloadavg()[0]:.2f}")
    for label, share in fold(samples).items():
        print(f"{share:6.1f}%  {label}")
    for c in conns:
        c.close()
    if app is not None:
        app.close()
    with psycopg.connect(args.dsn, autocommit=True) as c:
        c.execute(f"DROP SCHEMA {args.schema} CASCADE")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
