"""The bench package builds nothing at import time and writes results where it is told."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

from awa_fast.bench.report import RESULTS_DIR, results_path, save_result


def test_import_builds_no_app_and_reads_no_environment(tmp_path: pathlib.Path) -> None:
    code = ("import os, awa_fast.bench as b, awa_fast.bench.worker as w\n"
            "assert not w._built, 'an App was built at import'\n"
            "os.environ['AWA_FAST_BENCH_TRACE'] = os.environ['TRACE_TO']\n"
            "app = b.app\n"
            "assert app is w.app and w._built\n"
            "assert list(app.registry) == ['bench.noop'] and len(app.flush_listeners) == 1\n"
            "print('ok')\n")
    env = dict(os.environ, TRACE_TO=str(tmp_path / "trace.bin"))
    env.pop("AWA_FAST_BENCH_TRACE", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_results_go_where_asked(tmp_path: pathlib.Path, monkeypatch) -> None:  # noqa: ANN001
    res = {"scenario": "drain", "jobs": 3}
    named = save_result(res, tmp_path / "mine.json")
    assert named == tmp_path / "mine.json"
    assert json.loads(named.read_text()) == res
    into_dir = save_result(res, tmp_path / "runs")
    assert into_dir.parent == tmp_path / "runs" and into_dir.name.startswith("drain-")
    monkeypatch.chdir(tmp_path)
    default = results_path("latency")
    assert default.parent == tmp_path / RESULTS_DIR
    assert "site-packages" not in str(default)
