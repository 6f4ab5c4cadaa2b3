"""What the bench measures from ``/proc``: CPU seconds per process tree, the box, and claimer RSS.

No dependency: ``/proc/<pid>/stat`` (utime + stime of every process, grouped
by its ancestry), ``/proc/stat`` (the whole machine) and
``/proc/<pid>/status`` (VmRSS). On a system without ``/proc`` the meters
report nothing rather than fail.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol


class ClaimerRecords(Protocol):
    """Anything that lists the supervisor's claimer records (a :class:`~awa_fast.bench.procs.SupervisorProcess`)."""

    def counters(self) -> dict[str, Any]: ...


_CLK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def proc_table() -> dict[int, tuple[int, float]]:
    """pid -> (ppid, cpu seconds user+system) of every visible process."""
    out: dict[int, tuple[int, float]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                raw = f.read()
        except OSError:
            continue
        rest = raw[raw.rfind(b")") + 2:].split()
        try:
            out[int(entry)] = (int(rest[1]), (int(rest[11]) + int(rest[12])) / _CLK)
        except (IndexError, ValueError):
            continue
    return out


def _descendants(table: dict[int, tuple[int, float]], root: int) -> set[int]:
    kids: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        kids.setdefault(ppid, []).append(pid)
    found, stack = set(), [root]
    while stack:
        p = stack.pop()
        if p in found:
            continue
        found.add(p)
        stack.extend(kids.get(p, ()))
    return found


def _box_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, from /proc/stat."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            parts = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0.0, 0.0
    total = sum(parts[:8])
    idle = parts[3] + (parts[4] if len(parts) > 4 else 0)
    return (total - idle) / _CLK, total / _CLK


class CpuMeter:
    """CPU seconds used by the supervisor tree, the PostgreSQL server, this process and the box."""

    def __init__(self, postmaster: int | None) -> None:
        self.postmaster = postmaster
        self.supervisor: int | None = None
        self._start: dict[str, Any] | None = None
        self.result: dict[str, Any] | None = None

    def _sample(self) -> dict[str, Any]:
        table = proc_table()
        groups: dict[str, dict[int, float]] = {}
        for name, root in (("supervisor", self.supervisor), ("postgres", self.postmaster)):
            if root is not None and root in table:
                groups[name] = {p: table[p][1] for p in _descendants(table, root) if p in table}
        me = os.getpid()
        groups["bench"] = {p: table[p][1] for p in _descendants(table, me) if p in table
                           and p not in groups.get("supervisor", {})}
        busy, total = _box_cpu()
        return {"t": time.perf_counter(), "groups": groups, "busy": busy, "total": total}

    def start(self) -> None:
        """Take the first sample: the window starts now."""
        self._start = self._sample()

    def stop(self) -> dict[str, Any] | None:
        """CPU seconds per group over the window since :meth:`start` (None if never started)."""
        if self._start is None:
            return None
        end = self._sample()
        start = self._start
        wall = end["t"] - start["t"]
        out: dict[str, Any] = {"window_s": round(wall, 3)}
        for name in ("supervisor", "postgres", "bench"):
            now, then = end["groups"].get(name), start["groups"].get(name, {})
            if now is None:
                out[f"{name}_cpu_s"] = None
                continue
            out[f"{name}_cpu_s"] = round(sum(v - then.get(p, 0.0) for p, v in now.items()), 3)
        ncpu = os.cpu_count() or 1
        box_busy = end["busy"] - start["busy"]
        out["box_busy_cpu_s"] = round(box_busy, 3)
        out["box_capacity_cpu_s"] = round(wall * ncpu, 3)
        known = sum(v for k, v in out.items() if k.endswith("_cpu_s") and k != "box_busy_cpu_s"
                    and k != "box_capacity_cpu_s" and v is not None)
        out["other_cpu_s"] = round(max(0.0, box_busy - known), 3)
        self.result = out
        return out


def rss_kb(pid: int) -> int | None:
    """VmRSS of ``pid`` in kB (``/proc/<pid>/status``); None when it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmRSS:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


class RssSampler:
    """Samples the VmRSS of every claimer process of a bench supervisor, every ``every`` seconds.

    Claimer pids come from the supervisor's shared-memory records, read at
    each sample (a restarted claimer shows up as a new pid). A thread samples
    at ``start``, then on a fixed schedule, and once more at ``stop``.
    """

    def __init__(self, sup: ClaimerRecords, every: float) -> None:
        self.sup, self.every = sup, float(every)
        self.samples: list[tuple[float, dict[str, int]]] = []
        self.claimers: dict[str, str] = {}  # pid -> "queue#stripe"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0

    def _sample(self) -> None:
        now = time.monotonic() - self._t0
        rss: dict[str, int] = {}
        for rec in self.sup.counters()["records"]:
            pid = int(rec["pid"])
            kb = rss_kb(pid) if pid > 0 else None
            if kb is not None:
                rss[str(pid)] = kb
                self.claimers.setdefault(str(pid), f"{rec['queue']}#{rec['stripe']}")
        self.samples.append((now, rss))

    def _run(self) -> None:
        k = 1
        while not self._stop.wait(max(0.0, self._t0 + k * self.every - time.monotonic())):
            self._sample()
            k += 1

    def start(self) -> None:
        """Take the first sample now and sample every ``every`` seconds on a thread."""
        self._t0 = time.monotonic()
        self._sample()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()

    def stop(self, final: bool = True) -> None:
        """Stop the thread (before the supervisor's ring is closed); one last sample unless ``final`` is False."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(10)
        self._thread = None
        if final:
            self._sample()

    def summary(self) -> dict[str, Any]:
        """``claimer_rss_kb``: the samples, and per claimer first/last/min/max and growth since 1/4 of the run."""
        end_t = self.samples[-1][0] if self.samples else 0.0
        per: dict[str, Any] = {}
        for pid, label in self.claimers.items():
            series = [(t, m[pid]) for t, m in self.samples if pid in m]
            values = [v for _, v in series]
            q_t, q_v = next(((t, v) for t, v in series if t >= end_t / 4), series[-1])
            tail = [(t, v) for t, v in series if t >= q_t]
            per[pid] = {"claimer": label, "samples": len(series), "first": values[0], "last": values[-1],
                        "min": min(values), "max": max(values), "quarter_t": round(q_t, 2), "quarter": q_v,
                        "growth": values[-1] - q_v,
                        "growth_pct": round(100.0 * (values[-1] - q_v) / q_v, 2) if q_v else None,
                        "slope_kb_per_min": _slope_per_min(tail)}
        growths = [c["growth"] for c in per.values()]
        return {"every_s": self.every, "seconds": round(end_t, 2),
                "samples": [[round(t, 2), m] for t, m in self.samples], "per_claimer": per,
                "max_growth": max(growths) if growths else None,
                "method": "VmRSS (kB) of each claimer pid published in the supervisor's shared memory, "
                          "sampled while the producer runs; growth = last sample - first sample at or after "
                          "1/4 of the run (warm-up excluded); slope = least squares over that tail"}


def _slope_per_min(series: Sequence[tuple[float, int]]) -> float | None:
    """Least-squares slope of (seconds, kB) points in kB per minute; None for fewer than 2 distinct times."""
    if len(series) < 2:
        return None
    mt = sum(t for t, _ in series) / len(series)
    mv = sum(v for _, v in series) / len(series)
    var = sum((t - mt) ** 2 for t, _ in series)
    if var <= 0:
        return None
    return round(60.0 * sum((t - mt) * (v - mv) for t, v in series) / var, 2)
