"""How a bench result is summarised, printed and saved.

:func:`percentiles` and :func:`ms` turn per-job seconds into the reported
milliseconds; :func:`format_table` is the human-readable table;
:func:`save_result` writes the JSON where the user asked (``--save PATH``),
by default into ``perf/results/`` under the current directory, never into
the installed package.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import pathlib
from collections.abc import Sequence
from typing import Any

RESULTS_DIR = pathlib.Path("perf") / "results"  # relative to the current directory


def percentiles(values: Sequence[float], ps: Sequence[float] = (50, 95, 99)) -> dict[str, float] | None:
    """Linear-interpolated percentiles in the input's unit; None for no values."""
    if not values:
        return None
    s = sorted(values)
    out = {}
    for p in ps:
        k = (len(s) - 1) * p / 100.0
        lo = math.floor(k)
        hi = min(lo + 1, len(s) - 1)
        out[f"p{p:g}"] = s[lo] + (s[hi] - s[lo]) * (k - lo)
    return out


def ms(pct: dict[str, float] | None, digits: int = 3) -> dict[str, float] | None:
    """Seconds percentiles as milliseconds, rounded to ``digits``; None stays None."""
    return None if pct is None else {k: round(v * 1000.0, digits) for k, v in pct.items()}


def json_len(obj: Any) -> int:
    """Bytes of ``obj`` as compact JSON (what the client's encoder writes for these plain dicts)."""
    return len(json.dumps(obj, separators=(",", ":")).encode())


def results_path(scenario: str, where: str | pathlib.Path | None = None) -> pathlib.Path:
    """Where ``--save`` writes a result.

    ``where`` naming a ``.json`` file is used as is; a directory (or None:
    :data:`RESULTS_DIR` under the current directory) gets
    ``<scenario>-<timestamp>.json``.
    """
    base = pathlib.Path(where) if where else pathlib.Path.cwd() / RESULTS_DIR
    if base.suffix == ".json":
        return base
    stamp = _dt.datetime.now().strftime("%Y%m%dT%H%M%S")
    return base / f"{scenario}-{stamp}.json"


def save_result(res: dict[str, Any], where: str | pathlib.Path | None = None) -> pathlib.Path:
    """Write ``res`` as indented JSON to :func:`results_path`; returns the path written."""
    path = results_path(str(res["scenario"]), where)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, sort_keys=True, indent=2, default=str) + "\n", encoding="utf-8")
    return path


def format_table(res: dict[str, Any]) -> str:
    """The result as an aligned two-column table, the headline figures first."""
    def pct(v: Any) -> str:
        return "-" if not v else " / ".join(f"{v[k]:.2f}" for k in ("p50", "p95", "p99") if k in v)

    rows = [
        ("scenario", res["scenario"]),
        ("implementation", f"{res['impl']} (psycopg {res.get('psycopg_impl')})"),
        ("postgres", res["postgres_version"]),
        ("jobs", f"{res['jobs']:,}"),
        ("seconds", f"{res['seconds']:.3f}"),
        ("jobs/s", f"{res['jobs_per_s']:,.0f}" if res.get("jobs_per_s") else "-"),
        ("enqueue jobs/s", f"{res['enqueue_jobs_per_s']:,.0f}" if res.get("enqueue_jobs_per_s") else "-"),
        ("pickup ms p50/p95/p99", pct(res.get("pickup_ms"))),
        ("end-to-end ms p50/p95/p99", pct(res.get("e2e_ms"))),
    ]
    if res.get("enqueue_ms"):
        rows.append(("enqueue ms p50/p95/p99", pct(res["enqueue_ms"])))
    if res.get("db_span_s"):
        rows.append(("db span s (lower bound)", f"{res['db_span_s']:.3f} ({res['db_span_jobs_per_s']:,.0f}/s)"))
    rows.append(("dead tuples", f"{res['dead_tuples']:,}" + (f" ({res['dead_tuples'] / res['jobs']:.3f}/job)"
                                                             if res.get("jobs") else "")))
    if "dead_tuples_max_pinned" in res:
        rows.append(("dead tuples max pinned / end reclaim",
                     f"{res['dead_tuples_max_pinned']} / {res['dead_tuples_end_of_reclaim']}"))
        for name, ph in res.get("phases", {}).items():
            rows.append((f"  {name}: jobs/s, e2e p99 ms",
                         f"{ph['jobs_per_s']}, {ph['e2e_ms']['p99'] if ph['e2e_ms'] else '-'}"))
    rss = res.get("claimer_rss_kb")
    if rss:
        for pid, c in rss["per_claimer"].items():
            rows.append((f"rss kB {c['claimer']} pid {pid}",
                         f"first {c['first']:,}, 1/4 {c['quarter']:,}, last {c['last']:,}, max {c['max']:,}; "
                         f"growth {c['growth']:+,} ({c['slope_kb_per_min']} kB/min) over {c['samples']} samples"))
    cpu = res.get("cpu") or {}
    if cpu:
        rows.append(("cpu s: workers / postgres / bench / other",
                     f"{cpu.get('supervisor_cpu_s')} / {cpu.get('postgres_cpu_s')} / {cpu.get('bench_cpu_s')} / "
                     f"{cpu.get('other_cpu_s')} of {cpu.get('box_capacity_cpu_s')} in {cpu.get('window_s')}s"))
    rows.append(("loadavg (start -> end)", f"{res['loadavg_start']} -> {res['loadavg']}"))
    s = res["settings"]
    rows.append(("settings", ", ".join(f"{k}={v}" for k, v in s.items() if k != "server")))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
