"""``perf/regress.py`` still runs: the whole suite once, tiny, then the comparison step.

No timing is asserted. pyperf's ``--debug-single-value`` (one worker process
per benchmark, one value of one loop, which also picks the ``--fast`` suite:
claim backlog 1k only) runs every benchmark against the session's
PostgreSQL; the test checks the pyperf JSON it writes and that the
comparison with the checked-in baseline prints both tables. The gate's
arithmetic is then checked without timing: the result compared with itself
passes, and a copy with one benchmark made twice as slow fails, naming it.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import psycopg
import pytest
from psycopg import sql

pyperf = pytest.importorskip("pyperf")  # the perf extra (tools/dev.py setup installs it)

pytestmark = pytest.mark.integration

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO / "perf" / "regress.py"
BASELINE = REPO / "perf" / "baselines" / "python-2cpu.json"
CODEC = ("check_payload", "encode_ready_rows", "encode_done_rows", "encode_closure_rows", "decode_snapshots")
DATABASE = {"lane_claim[depth=1000,batch=1,rollback]", "lane_claim[depth=1000,batch=100,rollback]",
            "flush512[whole,commit]", "enqueue[1]", "enqueue_many[10000]", "drain[jobs=5000]"}
LEFT_BEHIND = ("perf_depth_1000", "perf_flush512", "bench_regress")


def _regress(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300,
                          cwd=REPO, check=False)


def _slower_copy(src: pathlib.Path, dst: pathlib.Path, name: str, factor: float) -> None:
    data = json.loads(src.read_text(encoding="utf-8"))
    for bench in data["benchmarks"]:
        if bench.get("metadata", {}).get("name") == name:
            for run in bench["runs"]:
                if "values" in run:
                    run["values"] = [v * factor for v in run["values"]]
            break
    else:
        raise AssertionError(f"{name} not in {src}")
    dst.write_text(json.dumps(data), encoding="utf-8")


def test_regress_runs_and_compares(pg_dsn: str, tmp_path: pathlib.Path) -> None:
    out = tmp_path / "regress.json"
    try:
        proc = _regress("--debug-single-value", "--quiet", "--dsn", pg_dsn, "--output", str(out),
                        "--baseline", str(BASELINE))
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as c:
            for schema in LEFT_BEHIND:
                c.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
    log = proc.stdout + proc.stderr
    # 0: within noise, 1: a slowdown beyond it (one loop per value is not a measurement): both are a run
    assert proc.returncode in (0, 1), log
    suite = pyperf.BenchmarkSuite.load(str(out))
    names = set(suite.get_benchmark_names())
    impls = ("c", "python") if any(n.endswith("[c]") for n in names) else ("python",)
    assert names == {f"{fn}[{impl}]" for fn in CODEC for impl in impls} | DATABASE, log
    for bench in suite.get_benchmarks():
        assert bench.get_nvalue() == 1 and bench.mean() > 0, bench.get_name()
    assert suite.get_metadata()["awa_fast_impl"] in ("c", "python")
    assert "pyperf compare_to --table" in proc.stdout, log
    assert "the gate:" in proc.stdout and "regress: " in proc.stdout, log

    same = _regress("--compare", str(out), "--baseline", str(out))
    assert same.returncode == 0, same.stdout + same.stderr
    assert "none slower beyond its noise" in same.stdout

    slower = tmp_path / "slower.json"
    _slower_copy(out, slower, "lane_claim[depth=1000,batch=1,rollback]", 2.0)
    worse = _regress("--compare", str(slower), "--baseline", str(out))
    assert worse.returncode == 1, worse.stdout + worse.stderr
    assert "slower beyond their noise: lane_claim[depth=1000,batch=1,rollback]" in worse.stdout
