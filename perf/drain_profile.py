"""Where a drain's claimer CPU goes: per thread from /proc, per function from py-spy.

Runs ``awa-fast bench drain`` (the default command: no ``--batch``) as a
subprocess, finds its claimer processes (titled ``awa-fast: claimer ...``),
maps each one's native thread ids to thread names with one ``py-spy dump``,
and then, until the claimer exits:

- reads ``/proc/PID/task/TID/stat`` every 0.1 s and keeps each thread's last
  utime + stime (the thread's CPU over the claimer's life, which is the
  drain's window give or take start-up and the drain);
- optionally (``--spy``) runs ``py-spy record --native -f raw`` on it for the
  whole drain, and folds the samples of all claimers by function and by file
  (self and inclusive), and into the phases of one job's path.

Prints one JSON object (``--out FILE`` also writes it), with the bench's
own result under ``bench``. py-spy stops the process at each sample, so a
profiled run is slower: compare sample counts between profiled runs only,
and CPU per job from runs without ``--spy``.

    .venv/bin/python perf/drain_profile.py --home /tmp/x-pg --schema bench_x [--spy] [--jobs 600000]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
CLK = os.sysconf("SC_CLK_TCK")
_FRAME = re.compile(r"^(?P<fn>.*?) \((?P<file>[^():]*?)(?::(?P<line>\d+))?\)$")


def descendants(root: int) -> list[int]:
    kids: dict[int, list[int]] = collections.defaultdict(list)
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                st = f.read()
        except OSError:
            continue
        ppid = int(st[st.rindex(")") + 2:].split()[1])
        kids[ppid].append(int(d))
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        for c in kids.get(p, ()):
            out.append(c)
            todo.append(c)
    return out


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def thread_cpu(pid: int) -> dict[int, float]:
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for t in tids:
        try:
            with open(f"/proc/{pid}/task/{t}/stat") as f:
                st = f.read()
        except OSError:
            continue
        fields = st[st.rindex(")") + 2:].split()
        out[int(t)] = (int(fields[11]) + int(fields[12])) / CLK
    return out


def thread_names(pid: int) -> dict[int, str]:
    res = subprocess.run([str(BIN / "py-spy"), "dump", "--pid", str(pid)], capture_output=True, text=True,
                         timeout=30)
    names = {}
    for m in re.finditer(r'^Thread (\d+) \([^)]*\): "([^"]*)"', res.stdout, re.M):
        names[int(m.group(1))] = m.group(2)
    return names


def role(name: str) -> str:
    if name.startswith("awa-worker-"):
        return "workers"
    return {"MainThread": "claim loop", "awa-batcher": "batcher"}.get(name, name)


# -- folding py-spy raw samples ------------------------------------------------------

def parse_frame(fr: str) -> tuple[str, str]:
    m = _FRAME.match(fr)
    if not m:
        return fr, ""
    return m.group("fn"), os.path.basename(m.group("file"))


PHASES = [  # (phase, frame function names that put a sample in it, checked from the leaf up)
    ("claim call: decode_snapshots", {"decode_snapshots"}),
    ("claim call: fetchall", {"fetchall"}),
    ("claim call: execute", {"execute"}),
    ("dispatch: new_jobs", {"new_jobs"}),
    ("dispatch: register_receipts", {"register_receipts"}),
    ("dispatch: AttemptTable.claimed", {"claimed"}),
    ("dispatch: Executor.dispatch", {"dispatch"}),
    ("batcher: post-flush publish (shm)", {"_publish"}),
    ("batcher: post-flush accounting", {"flushed"}),
    ("batcher: flush SQL (encode, COPY, commit)", {"_flush_on", "_flush"}),
    ("worker: handler", {"handle", "noop"}),
    ("worker: outcome (returned_outcome)", {"returned_outcome"}),
    ("worker: hand-off (_finish: submit_many, released)", {"_finish"}),
    ("worker: _run_sync frame", {"_run_sync"}),
    ("worker: queue get / wake", {"get"}),
    ("worker: loop", {"_work_loop"}),
    ("batcher: queue drain", {"_loop"}),
    ("claim loop: other", {"_claim_loop"}),
]


def fold(paths: list[Path]) -> dict[str, Any]:
    self_fn: collections.Counter[str] = collections.Counter()
    incl_fn: collections.Counter[str] = collections.Counter()
    self_file: collections.Counter[str] = collections.Counter()
    phase: collections.Counter[str] = collections.Counter()
    gc = 0
    total = 0
    for p in paths:
        if not p.exists():
            continue
        for line in p.read_text(errors="replace").splitlines():
            stack, _, n = line.rpartition(" ")
            if not stack or not n.isdigit():
                continue
            c = int(n)
            frames = [parse_frame(f) for f in stack.split(";")]
            total += c
            fn, fl = frames[-1]
            self_fn[f"{fn} ({fl})"] += c
            self_file[fl or fn] += c
            for key in {f"{a} ({b})" for a, b in frames}:
                incl_fn[key] += c
            names = [a for a, _ in frames]
            if any(n in ("gc_collect_main", "gc_collect_with_callback", "collect") for n in names):
                gc += c
            got = "other"
            for ph, marks in PHASES:
                if any(n in marks for n in names):
                    got = ph
                    break
            phase[got] += c

    def top(c: collections.Counter[str], k: int = 25) -> list[tuple[str, int, float]]:
        return [(name, n, round(100.0 * n / max(total, 1), 1)) for name, n in c.most_common(k)]

    return {"samples": total, "gc_samples": gc, "phases": top(phase, 40), "self": top(self_fn),
            "inclusive": top(incl_fn), "self_by_file": top(self_file)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--home", required=True)
    ap.add_argument("--schema", required=True)
    ap.add_argument("--jobs", type=int, default=600000)
    ap.add_argument("--stripes", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--spy", action="store_true", help="also record py-spy samples of each claimer")
    ap.add_argument("--rate", type=int, default=1000)
    ap.add_argument("--spy-mode", default="--gil", help="py-spy's thread selection: --gil (the GIL holder, "
                    "on-CPU Python) or --idle (every thread)")
    ap.add_argument("--spy-dir", default="/tmp/drain-profile")
    ap.add_argument("--out")
    a = ap.parse_args()
    load0 = os.getloadavg()
    cmd = [str(BIN / "awa-fast"), "bench", "--home", a.home, "--schema", a.schema, "--json", "drain",
           "--jobs", str(a.jobs), "--stripes", str(a.stripes), "--concurrency", str(a.concurrency)]
    bench = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=HERE)
    claimers: dict[int, dict[str, Any]] = {}
    spies: list[subprocess.Popen[bytes]] = []
    spy_dir = Path(a.spy_dir)
    spy_dir.mkdir(parents=True, exist_ok=True)
    outs: list[Path] = []
    while bench.poll() is None:
        for pid in descendants(bench.pid):
            if pid in claimers or "awa-fast: claimer" not in cmdline(pid):
                continue
            # wait for the worker threads (the claimer is forked, then starts its threads)
            deadline = time.monotonic() + 10
            while len(thread_cpu(pid)) < a.concurrency and time.monotonic() < deadline:
                time.sleep(0.01)
            info: dict[str, Any] = {"names": thread_names(pid), "cpu": thread_cpu(pid)}
            info["cpu0"] = dict(info["cpu"])
            claimers[pid] = info
            if a.spy:
                out = spy_dir / f"claimer-{pid}.txt"
                outs.append(out)
                spies.append(subprocess.Popen(
                    [str(BIN / "py-spy"), "record", "--rate", str(a.rate), "--native", a.spy_mode, "-f", "raw",
                     "-o", str(out), "--pid", str(pid)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for pid, info in claimers.items():
            info["cpu"].update(thread_cpu(pid))  # a thread that ended keeps its last value
        time.sleep(0.1)
    stdout = bench.stdout.read() if bench.stdout else ""
    for s in spies:
        try:
            s.wait(30)
        except subprocess.TimeoutExpired:
            s.terminate()
    res = json.loads(stdout[stdout.index("{"):]) if "{" in stdout else {"raw": stdout}
    n = a.jobs
    by_role: collections.Counter[str] = collections.Counter()
    for info in claimers.values():
        for tid, v in info["cpu"].items():
            by_role[role(info["names"].get(tid, f"tid{tid}"))] += v - info["cpu0"].get(tid, 0.0)
    cpu = res.get("cpu") or {}
    out: dict[str, Any] = {
        "load_start": [round(x, 2) for x in load0], "load_end": [round(x, 2) for x in os.getloadavg()],
        "jobs_per_s": res.get("jobs_per_s"), "claim_calls": res.get("claim_calls"),
        "empty_claims": res.get("empty_claims"), "flushes": res.get("flushes"),
        "sup_us_per_job": round(1e6 * (cpu.get("supervisor_cpu_s") or 0) / n, 3),
        "pg_us_per_job": round(1e6 * (cpu.get("postgres_cpu_s") or 0) / n, 3),
        "other_cpu_s": cpu.get("other_cpu_s"),
        "claimer_threads_us_per_job": {k: round(1e6 * v / n, 3) for k, v in by_role.most_common()},
        "claimers": len(claimers),
    }
    if a.spy:
        out["spy"] = fold(outs)
    out["bench"] = res
    text = json.dumps(out, indent=1)
    if a.out:
        Path(a.out).write_text(text)
    print(text)
    return 0 if bench.returncode == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
