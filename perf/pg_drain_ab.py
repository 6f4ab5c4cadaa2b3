"""Alternate two source trees through ``perf/pg_cpu_split.py`` (ABAB...) and compare CPU per drained job.

Each run imports awa_fast from its tree (``PYTHONPATH``; the supervisor the
bench starts inherits it), re-migrates the bench schema from that tree's
``sql/`` and drains on the same embedded server, so the two arms differ only
in their code and migrations. Give each tree a built codec (``tools/dev.py
setup``, or a copy of the other tree's ``awa_fast/_codec*.so`` when ``cext/``
is the same: a codec from another ``cext/`` may not decode that tree's claim
rows, e.g. claim_batch_v4's carried columns). An arm runs under its tree's ``.venv/bin/python`` when there is
one (an editable install resolves ``awa_fast.sql`` to its own checkout).

    python perf/pg_drain_ab.py --a /path/to/main-tree --b . --home /tmp/NAME-pg --schema bench_NAME
        [--rounds 6] [--jobs 200000] [--out DIR]

Prints each run and, per arm, the median jobs/s and the mean and median
PostgreSQL CPU per job, split as pg_cpu_split does (claimers, batchers,
leader), with the client side (the supervisor's processes) beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent


def run(tree: pathlib.Path, a: argparse.Namespace, out: pathlib.Path) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    # The tree's own interpreter when it has one: an editable install maps awa_fast.sql (the
    # migrations and named queries) to its own checkout's sql/, which PYTHONPATH does not override.
    python = tree / ".venv" / "bin" / "python"
    cmd = [str(python if python.exists() else sys.executable), str(HERE / "pg_cpu_split.py"),
           "--home", str(a.home), "--schema", a.schema, "--jobs", str(a.jobs), "--json"]
    with open(out.with_suffix(".err"), "w") as err:
        proc = subprocess.run(cmd, env=env, cwd="/", stdout=subprocess.PIPE, stderr=err, text=True, check=True)
    out.write_text(proc.stdout)
    res: dict[str, Any] = json.loads(proc.stdout)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", type=pathlib.Path, required=True, help="source tree of arm A")
    ap.add_argument("--b", type=pathlib.Path, required=True, help="source tree of arm B")
    ap.add_argument("--home", type=pathlib.Path, required=True)
    ap.add_argument("--schema", required=True)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--jobs", type=int, default=200_000)
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("/tmp/pg_drain_ab"))
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    arms: dict[str, list[dict[str, Any]]] = {"A": [], "B": []}
    for r in range(1, a.rounds + 1):
        for arm, tree in (("A", a.a), ("B", a.b)):
            res = run(tree.resolve(), a, a.out / f"{r}-{arm}.json")
            arms[arm].append(res)
            b = res["by_process_us_per_job"]
            print(f"{r} {arm} {res['jobs_per_s']:9.0f}/s load {res['load_start'][0]:5.2f} server "
                  f"{res['server_us_per_job']:5.2f} claimer {b.get('claimer', 0):5.2f} batcher "
                  f"{b.get('batcher', 0):5.2f} leader {b.get('maintenance', 0):5.2f} client "
                  f"{res['supervisor_us_per_job']:5.2f} us/job, dead {res['dead_tuples']}", flush=True)
    for arm, runs in arms.items():
        def med(key: str, runs: list[dict[str, Any]] = runs) -> float:
            return statistics.median(x["by_process_us_per_job"].get(key, 0.0) for x in runs)
        srv = [x["server_us_per_job"] for x in runs]
        print(f"{arm}: jobs/s median {statistics.median(x['jobs_per_s'] for x in runs):.0f}; PostgreSQL us/job mean "
              f"{statistics.mean(srv):.2f} median {statistics.median(srv):.2f} (claimers {med('claimer'):.2f}, "
              f"batchers {med('batcher'):.2f}, leader {med('maintenance'):.2f}); client "
              f"{statistics.median(x['supervisor_us_per_job'] for x in runs):.2f}")


if __name__ == "__main__":
    main()
