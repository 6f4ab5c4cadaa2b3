"""The pyperf regression gate: run the suite, compare it with a baseline, fail on a slowdown.

    .venv/bin/python perf/regress.py             # full run, compared with perf/baselines/python-<N>cpu.json
    .venv/bin/python perf/regress.py --fast      # backlog 1k only, fewer processes and values
    .venv/bin/python perf/regress.py --baseline perf/baselines/python-2cpu.json --output run.json
    .venv/bin/python perf/regress.py --only lane_claim,flush512        # a subset (names containing a word)
    .venv/bin/python perf/regress.py --compare run.json --baseline old.json   # no run: compare two files
    .venv/bin/python perf/regress.py --output perf/baselines/python-2cpu.json --no-compare   # a new baseline

Exit status: 0 when no benchmark is slower beyond its noise (or there is no
baseline to compare with), 1 when at least one is (each is named), 2 when
the run or the comparison could not be done.

The suite (one pyperf benchmark each, every value taken in a pyperf worker
process; the master only prepares the database and compares):

* codec, both implementations, the same inputs as ``perf/micro_codec.py``:
  ``check_payload``, ``encode_ready_rows`` (1024 payloads),
  ``encode_done_rows`` and ``encode_closure_rows`` (512 snapshots),
  ``decode_snapshots`` (1024 rows), each as ``<function>[c]`` and
  ``<function>[python]`` (the C pair is skipped when the extension is not
  built);
* ``lane_claim[depth=D,batch=B,rollback]``: one claim call at a backlog of
  D = 1k, 100k and 1M jobs (``--fast``: 1k only), B = 1 and 100, rolled back
  so the backlog stays at D (``perf/claim_depth.py``);
* ``flush512[whole,commit]``: the completion flush of 512 claimed jobs,
  committed (``perf/flush512.py``; the claim is outside the timed region);
* ``enqueue[1]``: ``App.enqueue`` of one job on an autocommit connection
  (``Storage.job_enqueue``, one durable commit);
* ``enqueue_many[10000]``: ``App.enqueue_many`` of 10,000 jobs (payload
  checks, binary COPY, one commit), into a schema of the worker's own so
  every value sees the same table size;
* ``drain[jobs=5000]``: ``awa-fast bench drain --jobs 5000 --stripes 2
  --concurrency 64 --batch 1024``, a real supervisor process; the value is
  the bench's own first-claim-to-last-completion time.

The clock (``Clock``): every benchmark but the drain times its loops with
``time.perf_counter`` less the time this thread and its database backend
waited on the run queue for a CPU (``/proc/<pid>/schedstat``), which is
most of the noise on a shared machine; a sleep, a lock or an fsync stays
in the value. On 2 vCPUs at a load of 7-10 it cut the spread of the claim
call's values from 40-70% of the mean to 12-27%. The set-up (the claims
before a flush, top-ups, migrations) stays out of the timed region; the
value is the time per call. The database benchmarks use the live
implementation (``AWA_FAST_IMPL``, inherited by the workers), stored as
metadata with the clock used (``timer``).

The server: ``--dsn``, else ``AWA_FAST_DSN``, else a private PostgreSQL in a
temporary directory (``awa_fast.embedded.private_server``, durable commits,
removed at the end). On a shared server the claim backlogs are kept in
``perf_depth_<D>`` and reused, as ``perf/claim_depth.py`` does; the
``perf_regress_*`` and ``perf_flush512`` schemas are dropped or rebuilt.

The threshold. A benchmark fails when its mean is slower than the
baseline's mean by more than

    max(5%, 3 * sqrt(se_base**2 + se_new**2) / mean_base)

where ``se`` is the standard error of the mean taken over pyperf's worker
processes (the standard deviation of the per-process means over the square
root of their number). Why:

* the question is whether the mean moved, and pyperf's worker processes
  are its independent samples (each its own start, hash seed and moment of
  the machine's load); the difference of two means has the standard error
  ``sqrt(se_base**2 + se_new**2)``, and three of it is exceeded by chance in
  about 0.1% of comparisons (one-sided, Gaussian), so a suite of ~25
  benchmarks raises a false alarm in about 3% of runs *when the machine is
  as fast as it was for the baseline*;
* not 3 standard deviations of the values (the spread of a single value):
  on this project's shared 2-CPU machine, with elapsed time, the values
  spread by 20-70% of the mean, which puts that limit at 85-300% and let a
  2.5x slower claim call pass;
* the 5% floor: on a quiet machine the standard error is well under 1%,
  and a change smaller than 5% is within what a rebuild, another kernel or
  the page cache moves; chasing it needs a dedicated machine and
  ``--rigorous``;
* what no threshold can absorb is the machine changing speed between the
  baseline and the run in ways the clock does not remove (CPU frequency, a
  busy sibling, the hypervisor, the disk under an fsync): on the shared
  machine, with the load at 7-10 on 2 CPUs, the claim call's mean moved
  2.8x between two unchanged runs a minute apart with elapsed time, and
  37% with the clock. The comparison prints the load of both runs; rerun a
  failure with ``--only NAME`` when the machine is quieter before believing
  it (a regression reproduces, load usually does not).

A faster result beyond the same threshold is reported as faster and
passes; refresh the baseline when it is a real improvement. The comparison
also prints ``python -m pyperf compare_to --table`` (pyperf's own table, for
reading; the exit status is the gate's).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime as dt
import json
import math
import os
import pathlib
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import claim_depth
import flush512
import micro_codec
import pyperf

HERE = pathlib.Path(__file__).resolve().parent
DEPTHS_FULL = (1_000, 100_000, 1_000_000)
DEPTHS_FAST = (1_000,)
CLAIM_BATCHES = (1, 100)
ENQUEUE_MANY = 10_000
DRAIN_JOBS = 5_000
DRAIN_SETTINGS = ("--stripes", "2", "--concurrency", "64", "--batch", "1024")
QUEUE = "perf"
KIND = "perf.noop"
ENQUEUE1_SCHEMA = "perf_regress_enqueue1"
DRAIN_SCHEMA = "bench_regress"  # awa-fast bench only drops schemas named bench*
MIN_SLOWDOWN = 0.05
SIGMAS = 3.0
SERVER_SETTINGS = {"fsync": "on", "synchronous_commit": "on", "max_connections": "100",
                   "shared_buffers": "256MB", "log_min_messages": "warning"}


# -- the benchmarks (each function runs in a pyperf worker) ----------------------------------


class Clock:
    """Elapsed time less the time this thread and its database backends waited for a CPU.

    On a shared machine most of the noise is the run queue: another
    session's process holds the CPU while ours is runnable. Linux accounts
    that wait per task in ``/proc/<pid>/schedstat`` (the second field,
    nanoseconds), so the clock subtracts it, for this thread and for each
    backend it talks to (a client and its backend take turns: their waits
    do not overlap). A sleep, a lock or an fsync is not a run-queue wait
    and stays in the value. Without schedstat it is plain elapsed time.
    """

    def __init__(self, backend_pids: tuple[int, ...] = ()) -> None:
        paths = ["/proc/thread-self/schedstat", *(f"/proc/{pid}/schedstat" for pid in backend_pids)]
        self.paths = [p for p in paths if os.path.exists(p)]

    def _waited(self) -> float:
        total = 0
        for path in self.paths:
            with open(path, "rb") as f:
                total += int(f.read().split()[1])
        return total / 1e9

    def start(self) -> tuple[float, float]:
        t0 = time.perf_counter()  # then the waits: every wait read lies inside the elapsed interval
        return t0, self._waited()

    def since(self, mark: tuple[float, float]) -> float:
        waited = self._waited() - mark[1]
        elapsed = time.perf_counter() - mark[0]
        # A backend can be accounted a wait that began just before the mark. When that leaves
        # nothing, the value is the plain elapsed time: pyperf refuses a zero (the smoke test
        # failed so on a loaded box), and a value too slow is the safe side for a gate.
        run = elapsed - waited
        return run if run > 0.0 else elapsed


TIMER = "elapsed - run-queue wait" if os.path.exists("/proc/thread-self/schedstat") else "elapsed"


def _codec_timer(fn: Callable[..., Any], *args: Any) -> Callable[[int], float]:
    clock = Clock()

    def time_func(loops: int) -> float:
        it = range(loops)
        mark = clock.start()
        for _ in it:
            fn(*args)
        return clock.since(mark)

    return time_func


def _drop_schema(dsn: str, schema: str) -> None:
    import psycopg
    from psycopg import sql

    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def _drop_schemas(dsn: str) -> None:
    """Remove every schema the benchmarks made on a server given by DSN."""
    for schema in (ENQUEUE1_SCHEMA, flush512.SCHEMA, DRAIN_SCHEMA):
        _drop_schema(dsn, schema)


_STATE: dict[str, Any] = {}


def _conn(dsn: str, key: str, autocommit: bool = True) -> Any:
    """One connection per purpose and worker, returning jsonb as raw bytes."""
    if key not in _STATE:
        import psycopg

        from awa_fast.storage import use_raw_jsonb

        conn = psycopg.connect(dsn, autocommit=autocommit, application_name="awa_fast:perf")
        use_raw_jsonb(conn)
        _STATE[key] = conn
    return _STATE[key]


def _app(dsn: str, schema: str) -> Any:
    key = f"app:{schema}"
    if key not in _STATE:
        from awa_fast.app import App

        _STATE[key] = App(dsn=dsn, schema=schema, default_queue=QUEUE)
    return _STATE[key]


def bench_claim(loops: int, dsn: str, depth: int, batch: int) -> float:
    """One ``Storage.lane_claim`` call at backlog ``depth``, rolled back so the backlog stays."""
    from awa_fast.storage import Storage

    tx = _conn(dsn, f"claim:{depth}", autocommit=False)
    claim = Storage(claim_depth.schema_for(depth)).lane_claim
    queue = claim_depth.QUEUE
    clock = Clock((tx.info.backend_pid,))
    mark = clock.start()
    for _ in range(loops):
        claim(tx, queue, batch)
        tx.rollback()
    return clock.since(mark)


def bench_flush512(loops: int, dsn: str) -> float:
    """``Storage.receipt_complete`` of 512 freshly claimed jobs, one whole receipt, committed."""
    from awa_fast.storage import Storage

    conn = _conn(dsn, "flush")
    storage = Storage(flush512.SCHEMA)
    storage.session_index_probes(conn)  # planned as the runtime's batcher session is (untimed)
    clock = Clock((conn.info.backend_pid,))
    elapsed = 0.0
    for _ in range(loops):
        snaps = storage.lane_claim(conn, flush512.QUEUE, flush512.N)  # untimed: a committed claim of 512
        if len(snaps) < flush512.N:
            flush512.enqueue(dsn, 20 * flush512.N)
            snaps += storage.lane_claim(conn, flush512.QUEUE, flush512.N - len(snaps))
        whole = {(s.claim_slot, s.claim_id) for s in snaps}
        mark = clock.start()
        with conn.transaction():
            stale = storage.receipt_complete(conn, snaps, whole)
        elapsed += clock.since(mark)
        assert not stale, f"{len(stale)} stale completions"
    return elapsed


def bench_enqueue1(loops: int, dsn: str) -> float:
    """``App.enqueue`` of one job, one durable commit per loop."""
    conn = _conn(dsn, "enqueue1")
    enqueue = _app(dsn, ENQUEUE1_SCHEMA).enqueue
    clock = Clock((conn.info.backend_pid,))
    mark = clock.start()
    for i in range(loops):
        enqueue(KIND, {"n": i, "to": "user@example.com"}, conn=conn)
    return clock.since(mark)


def bench_enqueue_many(loops: int, dsn: str, n: int) -> float:
    """``App.enqueue_many`` of ``n`` jobs per loop in one committed transaction, in this worker's own schema."""
    schema = f"perf_regress_many_{os.getpid()}"
    if "many" not in _STATE:
        from awa_fast.storage.migrate import migrate

        _drop_schema(dsn, schema)
        migrate(dsn, schema)
        atexit.register(_drop_schema, dsn, schema)
        _STATE["many"] = [{"n": i, "to": f"user{i}@example.com", "template": "welcome"} for i in range(n)]
    payloads = _STATE["many"]
    app = _app(dsn, schema)
    conn = _conn(dsn, "many_conn", autocommit=False)
    clock = Clock((conn.info.backend_pid,))
    mark = clock.start()
    for _ in range(loops):
        app.enqueue_many(KIND, payloads, queue=QUEUE, conn=conn)
        conn.commit()
    return clock.since(mark)


def bench_drain(loops: int, dsn: str, jobs: int) -> float:
    """``awa-fast bench drain``: the sum of the bench's own drain times (first claim -> last completion)."""
    total = 0.0
    cmd = [sys.executable, "-m", "awa_fast.cli", "--log-level", "WARNING", "bench", "drain", "--dsn", dsn,
           "--schema", DRAIN_SCHEMA, "--jobs", str(jobs), *DRAIN_SETTINGS, "--json"]
    for _ in range(loops):
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
        if out.returncode != 0:
            raise RuntimeError(f"awa-fast bench drain exited {out.returncode}:\n{out.stderr[-2000:]}")
        total += float(json.loads(out.stdout.strip().splitlines()[-1])["seconds"])
    return total


class _Only:
    """``runner.bench_time_func`` for the benchmarks whose name contains one of ``--only``'s words."""

    def __init__(self, runner: pyperf.Runner, only: str | None) -> None:
        self.runner = runner
        self.words = [w for w in (only or "").split(",") if w]

    def bench_time_func(self, name: str, *args: Any) -> None:
        if not self.words or any(w in name for w in self.words):
            self.runner.bench_time_func(name, *args)


def register(runner: pyperf.Runner, dsn: str, depths: tuple[int, ...]) -> None:
    """Every benchmark of the suite, in a fixed order (the workers find theirs by position)."""
    runner = _Only(runner, runner.args.only)  # type: ignore[assignment]
    codecs: list[tuple[str, ModuleType]] = [("c", micro_codec._codec)] if micro_codec._codec is not None else []
    codecs.append(("python", micro_codec._pycodec))
    payloads = micro_codec._payloads(1024)
    rows = [micro_codec._row(i) for i in range(1024)]
    snapshots = [micro_codec.ClaimSnapshot(*micro_codec._row(i)) for i in range(512)]
    for impl, mod in codecs:
        runner.bench_time_func(f"check_payload[{impl}]", _codec_timer(mod.check_payload, micro_codec.PAYLOAD))
    for impl, mod in codecs:
        runner.bench_time_func(f"encode_ready_rows[{impl}]", _codec_timer(
            mod.encode_ready_rows, 3, 7, 100_000, "send_email", payloads, None, 0, 25))
    for impl, mod in codecs:
        runner.bench_time_func(f"encode_done_rows[{impl}]", _codec_timer(mod.encode_done_rows, snapshots))
    for impl, mod in codecs:
        runner.bench_time_func(f"encode_closure_rows[{impl}]", _codec_timer(mod.encode_closure_rows, snapshots, 1))
    for impl, mod in codecs:
        runner.bench_time_func(f"decode_snapshots[{impl}]", _codec_timer(mod.decode_snapshots, rows))

    for depth in depths:
        for batch in CLAIM_BATCHES:
            runner.bench_time_func(f"lane_claim[depth={depth},batch={batch},rollback]", bench_claim,
                                   dsn, depth, batch)
    runner.bench_time_func("flush512[whole,commit]", bench_flush512, dsn)
    runner.bench_time_func("enqueue[1]", bench_enqueue1, dsn)
    runner.bench_time_func(f"enqueue_many[{ENQUEUE_MANY}]", bench_enqueue_many, dsn, ENQUEUE_MANY)
    runner.bench_time_func(f"drain[jobs={DRAIN_JOBS}]", bench_drain, dsn, DRAIN_JOBS)


# -- the master: the server, the data, the comparison --------------------------------------------


def _loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def prepare(dsn: str, depths: tuple[int, ...]) -> None:
    """The backlogs and schemas the benchmarks read (outside every timed region)."""
    from awa_fast.storage.migrate import migrate

    t0 = time.perf_counter()
    for depth in depths:
        claim_depth.prepare(dsn, depth, rebuild=False)
    flush512.prepare(dsn)
    _drop_schema(dsn, ENQUEUE1_SCHEMA)
    migrate(dsn, ENQUEUE1_SCHEMA)
    print(f"# prepared the backlogs in {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)


def mean_and_se(bench: pyperf.Benchmark) -> tuple[float, float, int]:
    """The mean, its standard error over worker processes, and the number of processes.

    Each worker process is one independent sample (its own start, its own
    moment of the machine's load), so the standard error is taken over the
    per-process means. With one process it is taken over its values, and
    with one value it is 0 (only the floor applies).
    """
    per_process = [math.fsum(r.values) / len(r.values) for r in bench.get_runs() if r.values]
    mean = bench.mean()
    if len(per_process) > 1:
        return mean, statistics.stdev(per_process) / math.sqrt(len(per_process)), len(per_process)
    values = bench.get_values()
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
    return mean, se, len(per_process)


def _load_per_cpu(suite: pyperf.BenchmarkSuite) -> str:
    loads = [float(r.get_metadata()["load_avg_1min"]) for b in suite.get_benchmarks() for r in b.get_runs()
             if "load_avg_1min" in r.get_metadata()]
    cpus = suite.get_metadata().get("cpu_count") or os.cpu_count() or 1
    if not loads:
        return "unknown"
    return f"{min(loads):.1f}-{max(loads):.1f} (median {statistics.median(loads):.1f}) on {cpus} CPUs"


def compare(baseline: pathlib.Path, result: pathlib.Path, min_slowdown: float = MIN_SLOWDOWN,
            sigmas: float = SIGMAS) -> int:
    """Print pyperf's table and the gate's verdict per benchmark; 1 when one is slower beyond its noise."""
    table = subprocess.run([sys.executable, "-m", "pyperf", "compare_to", "--table", str(baseline), str(result)],
                           capture_output=True, text=True, check=False)
    print(f"$ python -m pyperf compare_to --table {baseline} {result}")
    print(table.stdout.rstrip() or table.stderr.rstrip())
    if table.returncode != 0:
        print(f"regress: pyperf compare_to failed (exit {table.returncode}):\n{table.stderr}", file=sys.stderr)
        return 2
    base = pyperf.BenchmarkSuite.load(str(baseline))
    new = pyperf.BenchmarkSuite.load(str(result))
    for key in ("awa_fast_impl", "cpu_count"):
        b, n = base.get_metadata().get(key), new.get_metadata().get(key)
        if b != n:
            print(f"# warning: {key} is {n!r} here and {b!r} in the baseline: not the same kind of run")
    base_names = set(base.get_benchmark_names())
    new_names = set(new.get_benchmark_names())
    rows = []
    slower = []
    for name in new.get_benchmark_names():
        if name not in base_names:
            rows.append((name, "-", new.get_benchmark(name).format_value(new.get_benchmark(name).mean()), "-", "-",
                         "new: not in the baseline"))
            continue
        b, n = base.get_benchmark(name), new.get_benchmark(name)
        (mb, se_b, _), (mn, se_n, _) = mean_and_se(b), mean_and_se(n)
        change = mn / mb - 1.0
        limit = max(min_slowdown, sigmas * math.hypot(se_b, se_n) / mb)
        if change > limit:
            verdict = "SLOWER"
            slower.append(name)
        elif change < -limit:
            verdict = "faster"
        else:
            verdict = "within noise"
        rows.append((name, b.format_value(mb), n.format_value(mn), f"{change:+.1%}", f"{limit:.1%}", verdict))
    for name in sorted(base_names - new_names):
        rows.append((name, "-", "-", "-", "-", "not run"))
    head = ("benchmark", "baseline", "this run", "change", "limit", "verdict")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    print(f"\nload (1 min) during the baseline: {_load_per_cpu(base)}; during this run: {_load_per_cpu(new)}")
    print(f"the gate: a mean slower than the baseline's by more than max({min_slowdown:.0%}, "
          f"{sigmas:g} x the combined standard error) fails")
    for r in [head, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())
    if slower:
        print(f"\nregress: FAIL: {len(slower)} benchmark(s) slower beyond their noise: {', '.join(slower)}")
        return 1
    compared = sum(1 for r in rows if r[4] != "-")
    print(f"\nregress: ok: {compared} benchmark(s) compared, none slower beyond its noise")
    return 0


def stamp_metadata(path: pathlib.Path, metadata: dict[str, str]) -> None:
    """Add what only the master knows (the server, the load around the run) to every benchmark of ``path``."""
    suite = pyperf.BenchmarkSuite.load(str(path))
    for bench in suite.get_benchmarks():
        bench.update_metadata(metadata)
    suite.dump(str(path), replace=True)


def default_baseline() -> pathlib.Path:
    return HERE / "baselines" / f"python-{os.cpu_count()}cpu.json"


def add_cmdline_args(cmd: list[str], args: Any) -> None:
    cmd.extend(("--dsn", args.dsn, "--depths", args.depths))
    if args.only:
        cmd.extend(("--only", args.only))


def main() -> int:
    runner = pyperf.Runner(processes=10, add_cmdline_args=add_cmdline_args)
    runner.argparser.add_argument("--dsn", default=None,
                                  help="PostgreSQL DSN (default: AWA_FAST_DSN, else a private server)")
    runner.argparser.add_argument("--depths", default=None,
                                  help="claim backlog depths (default: 1000,100000,1000000; 1000 with --fast)")
    runner.argparser.add_argument("--only", default=None, metavar="WORDS",
                                  help="run only the benchmarks whose name contains one of these comma-separated "
                                       "words, e.g. lane_claim,flush512")
    runner.argparser.add_argument("--baseline", default=None,
                                  help=f"pyperf JSON to compare with (default: {default_baseline().name} "
                                       "in perf/baselines/, when it exists)")
    runner.argparser.add_argument("--no-compare", action="store_true", help="run and write, compare nothing")
    runner.argparser.add_argument("--compare", metavar="RESULT", default=None,
                                  help="run nothing: compare RESULT (a pyperf JSON) with the baseline")
    runner.argparser.add_argument("--min-slowdown", type=float, default=MIN_SLOWDOWN,
                                  help="the threshold's floor, a fraction (default: 0.05)")
    runner.argparser.add_argument("--sigmas", type=float, default=SIGMAS,
                                  help="the threshold's noise multiple (default: 3)")
    args = runner.parse_args()
    import psycopg.pq

    import awa_fast

    runner.metadata["awa_fast_impl"] = awa_fast.__impl__
    runner.metadata["psycopg_impl"] = psycopg.pq.__impl__
    runner.metadata["timer"] = TIMER
    if args.worker:
        register(runner, args.dsn, tuple(int(x) for x in args.depths.split(",")))
        return 0

    baseline = pathlib.Path(args.baseline) if args.baseline else default_baseline()
    if args.baseline and not baseline.is_file():
        print(f"regress: no baseline at {baseline}", file=sys.stderr)
        return 2
    if args.compare:
        return compare(baseline, pathlib.Path(args.compare), args.min_slowdown, args.sigmas)

    if args.depths is None:
        fast = args.fast or args.debug_single_value
        args.depths = ",".join(str(d) for d in (DEPTHS_FAST if fast else DEPTHS_FULL))
    if not args.output:
        stamp = dt.datetime.now().strftime("%Y%m%dT%H%M%S")
        (HERE / "results").mkdir(exist_ok=True)
        args.output = str(HERE / "results" / f"regress-{stamp}.json")
    # the workers get a clean environment: keep the implementation choice
    args.inherit_environ = [*(args.inherit_environ or []), "AWA_FAST_IMPL"]
    print(f"# load {_loadavg()}; cpus {os.cpu_count()}; awa_fast {awa_fast.__impl__}, psycopg "
          f"{psycopg.pq.__impl__}; C codec {'built' if micro_codec._codec is not None else 'missing'}",
          flush=True)

    dsn = args.dsn or os.environ.get("AWA_FAST_DSN")
    server = "given DSN" if dsn else "private"
    with contextlib.ExitStack() as stack:
        if dsn:  # a given server: drop the schemas made here on the way out
            stack.callback(_drop_schemas, dsn)
        else:  # a private server in a temporary directory, removed afterwards
            from awa_fast.embedded import private_server

            dsn = stack.enter_context(private_server(settings=SERVER_SETTINGS, stop_mode="fast",
                                                     prefix="awa-fast-regress-")).dsn
        args.dsn = dsn
        with psycopg.connect(dsn) as c:
            version = str(c.execute("SHOW server_version").fetchone()[0])  # type: ignore[index]
        master_metadata = {"postgres": f"{version} ({server})", "loadavg_start": _loadavg()}
        print(f"# PostgreSQL {version} ({server}); claim depths {args.depths}; output {args.output}", flush=True)
        prepare(dsn, tuple(int(x) for x in args.depths.split(",")))
        register(runner, dsn, tuple(int(x) for x in args.depths.split(",")))
    stamp_metadata(pathlib.Path(args.output), {**master_metadata, "loadavg_end": _loadavg()})
    print(f"# load at the end {_loadavg()}; wrote {args.output}", flush=True)
    if args.no_compare:
        return 0
    if not baseline.is_file():
        print(f"# no baseline at {baseline}: nothing to compare (write one with --output {baseline})")
        return 0
    return compare(baseline, pathlib.Path(args.output), args.min_slowdown, args.sigmas)


if __name__ == "__main__":
    sys.exit(main())
