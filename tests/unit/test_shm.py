"""The shared-memory segment: layout, seqlock across processes, status records, histograms, locator."""

from __future__ import annotations

import json
import logging
import math
import multiprocessing
import os
import pathlib
import secrets
import struct
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from multiprocessing import shared_memory

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from awa_fast.errors import InvalidName
from awa_fast.runtime import shm
from awa_fast.runtime.shm import (
    ClaimerRecord,
    ShmError,
    ShmLayoutError,
    ShmNotFound,
    ShmRing,
    bucket_bounds,
    bucket_index,
    histogram,
    histogram_percentiles,
    layout,
    prune_outcome_counts,
    read_locator,
    records,
    remove_locator,
    write_locator,
)
from awa_fast.runtime.shm import segment as shm_segment

FORK = multiprocessing.get_context("fork")
DEV_SHM = pathlib.Path("/dev/shm")
WRITES = 10_000


@pytest.fixture
def ring() -> Iterator[ShmRing]:
    r = ShmRing.create(None, [("email", 0), ("email", 1), ("reports", 0)])
    try:
        yield r
    finally:
        r.close()
        r.unlink()


# -- processes (module level: children get only the segment name) ----------------
def _child_publish(name: str, index: int) -> None:
    ring = ShmRing.attach(name)
    rec = ring.claimer(index)
    rec.set_state("starting")
    rec.add(claimed=3, completed=2, failed=1, batches=1, claim_calls=4, empty_claims=1)
    rec.observe_latency("pickup", [0.001, 0.002])
    rec.set_in_flight(5)
    rec.set_state("running")
    ring.publish_rings({"claim": {"current_slot": 2, "generation": 9}}, os.getpid())
    ring.close()


def _child_hammer(name: str, index: int, n: int) -> None:
    ring = ShmRing.attach(name)
    rec = ring.claimer(index)
    rec.set_state("running")
    for i in range(n):
        # one publish: counters, a size sample and a gauge together
        rec.publish({"claimed": 1, "completed": 1, "retried": 1, "batches": 1}, {"flush_jobs": [3]}, in_flight=i)
        if i % 100 == 0:
            rec.observe_latency("e2e", [0.01] * 10)
    ring.close()


# -- layout ----------------------------------------------------------------------
def test_layout_sizes() -> None:
    assert shm.segment_size(8) == 576 + 8 * 2176 == 17984
    assert layout.RECORD_SIZE % 64 == 0


def test_create_initialises_header_and_records(ring: ShmRing) -> None:
    assert (DEV_SHM / ring.name).exists()
    h = ring.header()
    assert h["layout_version"] == 2 and h["claimers"] == 3 and h["supervisor_pid"] == os.getpid()
    assert h["segment_size"] == shm.segment_size(3)
    r = ring.claimer(1).read()
    assert (r["queue"], r["stripe"], r["state"], r["pid"], r["starts"]) == ("email", 1, "stopped", 0, 0)
    assert r["torn"] is False and r["claimed"] == 0 and r["pickup"]["p50"] is None
    rings = ring.read_rings()
    assert rings.torn is False and rings.leader_pid == 0 and rings.rings["ready"].current_slot == -1
    with pytest.raises(IndexError):
        ring.claimer(3)


def test_attach_in_another_process_publishes(ring: ShmRing) -> None:
    p = FORK.Process(target=_child_publish, args=(ring.name, 2))
    p.start()
    p.join(10)
    assert p.exitcode == 0
    r = ring.claimer(2).read()
    assert r["state"] == "running" and r["pid"] == p.pid and r["starts"] == 1
    assert (r["claimed"], r["completed"], r["failed"], r["batches_flushed"]) == (3, 2, 1, 1)
    assert (r["claim_calls"], r["empty_claims"], r["in_flight"]) == (4, 1, 5)
    assert r["pickup"]["count"] == 2 and r["pickup"]["sum"] == pytest.approx(0.003)
    assert r["last_alive"] >= r["state_since"] > 0
    snap = ring.read_rings()
    assert snap.leader_pid == p.pid and snap.rings["claim"].generation == 9 and snap.rings["claim"].current_slot == 2
    assert ring.claimer(0).read()["claimed"] == 0  # neighbours untouched


def test_two_writers_and_a_reader_add_up_exactly(ring: ShmRing) -> None:
    writers = [FORK.Process(target=_child_hammer, args=(ring.name, i, WRITES)) for i in (0, 1)]
    for w in writers:
        w.start()
    recs = [ring.claimer(0), ring.claimer(1)]
    last = [0, 0]
    last_e2e = [0, 0]
    reads = torn = 0
    while any(w.is_alive() for w in writers) or reads < 50:
        for i, rec in enumerate(recs):
            r = rec.read()
            reads += 1
            if r["torn"]:
                torn += 1
                continue
            # one publish() is one seqlock write: a consistent read never sees it half done
            assert r["claimed"] == r["completed"] == r["retried"] == r["batches_flushed"] == r["flush_jobs"]["count"]
            assert r["flush_jobs"]["sum"] == 3 * r["claimed"] and r["in_flight"] == max(r["claimed"] - 1, 0)
            assert r["claimed"] >= last[i], "a counter went backwards"
            assert r["e2e"]["count"] >= last_e2e[i]
            last[i], last_e2e[i] = r["claimed"], r["e2e"]["count"]
    for w in writers:
        w.join(10)
        assert w.exitcode == 0
    for rec in recs:
        r = rec.read()
        assert r["torn"] is False
        assert r["claimed"] == r["completed"] == r["retried"] == WRITES
        assert r["e2e"]["count"] == 10 * (WRITES // 100)
    # back-to-back writers on 2 busy CPUs tear a few % of reads; what matters is
    # that torn reads are flagged and every unflagged one was consistent
    assert reads - torn >= 50, f"{torn} of {reads} reads torn"


def test_dead_writer_mid_write_reads_as_torn_until_next_write(ring: ShmRing) -> None:
    rec = ring.claimer(0)
    rec.add(claimed=7)
    buf = ring._buffer()
    off = layout.CLAIMERS_OFFSET
    seq = layout.SEQ.unpack_from(buf, off)[0]
    layout.SEQ.pack_into(buf, off, seq + 1)  # a writer died between its two version writes
    r = rec.read()
    assert r["torn"] is True and r["claimed"] == 7
    rec.add(claimed=1)
    r = rec.read()
    assert r["torn"] is False and r["claimed"] == 8
    assert layout.SEQ.unpack_from(buf, off)[0] % 2 == 0


def test_claimer_record_validation(ring: ShmRing) -> None:
    rec = ring.claimer(0)
    assert isinstance(rec, ClaimerRecord) and ring.claimer(0) is rec
    with pytest.raises(ValueError, match="state"):
        rec.set_state("sleeping")
    with pytest.raises(ValueError, match="histogram"):
        rec.observe_latency("queue", [1.0])
    rec.set_state("starting", pid=4242)
    rec.set_state("starting", pid=4243)
    rec.set_state("draining")
    r = rec.read()
    assert (r["state"], r["pid"], r["starts"]) == ("draining", 4243, 2)
    rec.set_in_flight(-3)
    assert rec.read()["in_flight"] == 0


def test_long_queue_name_is_truncated_with_a_hash() -> None:
    long = "q" * 100
    r = ShmRing.create(None, [(long, 0), ("é" * 40, 1)])
    try:
        a, b = r.claimer(0).read()["queue"], r.claimer(1).read()["queue"]
        assert len(a.encode()) <= 64 and a.startswith("q" * 50) and a[-9] == "~"
        assert len(b.encode()) <= 64 and b.startswith("é" * 27)  # never splits a character
    finally:
        r.close()
        r.unlink()


def test_publish_rings_keeps_unspecified_fields(ring: ShmRing) -> None:
    ring.publish_rings(
        {"ready": {"current_slot": 3, "generation": 12, "slot_count": 16, "last_rotate": 100.5}},
        111,
        leader_host="host-a",
        leader_since=50.0,
        tick=101.0,
    )
    outcomes = prune_outcome_counts(["pruned", "empty", "open_claims", "cursor_behind", "busy", "current", "retained"])
    assert outcomes == {"prune_pruned": 1, "prune_empty": 1, "prune_busy": 1, "prune_blocked": 2, "prune_current": 1,
                        "prune_retained": 1}
    ring.publish_rings({"ready": {**outcomes, "last_prune": 102.0}}, 111, leader_host="h" * 40, role="standby")
    s = ring.read_rings()
    ready = s.rings["ready"]
    assert (ready.current_slot, ready.generation, ready.slot_count, ready.last_rotate) == (3, 12, 16, 100.5)
    assert (ready.prune_blocked, ready.last_prune) == (2, 102.0)
    assert s.leader_since == 50.0 and s.role == "standby" and len(s.leader_host.encode()) <= 32
    assert s.leader_host_hash == records.host_hash("h" * 40) != records.host_hash("host-a")
    with pytest.raises(ValueError, match="ring"):
        ring.publish_rings({"done": {}}, 1)
    with pytest.raises(ValueError, match="fields"):
        ring.publish_rings({"ready": {"slot": 1}}, 1)


def test_snapshot_is_json(ring: ShmRing) -> None:
    ring.claimer(0).observe_latency("e2e", [0.005] * 4)
    snap = json.loads(json.dumps(ring.snapshot()))
    assert snap["name"] == ring.name and snap["supervisor_alive"] is True
    assert len(snap["claimers"]) == 3 and len(snap["histogram_bounds"]) == 39
    assert snap["claimers"][0]["e2e"]["count"] == 4 and snap["maintenance"]["torn"] is False


# -- histograms ----------------------------------------------------------------------
def test_bucket_bounds_are_log_spaced_50us_to_60s() -> None:
    edges = bucket_bounds()
    assert len(edges) == 39 and edges == histogram.TIME_EDGES
    assert edges[0] == pytest.approx(50e-6) and edges[-1] == pytest.approx(60.0)
    ratios = {round(b / a, 9) for a, b in zip(edges, edges[1:])}
    assert len(ratios) == 1 and 1.44 < ratios.pop() < 1.45


def test_bucket_index_edges() -> None:
    edges = bucket_bounds()
    assert bucket_index(0.0) == bucket_index(-1.0) == bucket_index(math.nan) == 0
    assert bucket_index(50e-6) == 0 and bucket_index(51e-6) == 1
    assert bucket_index(edges[10]) == 10 and bucket_index(edges[10] * 1.0001) == 11
    assert bucket_index(60.0) == 38 and bucket_index(61.0) == 39 == bucket_index(math.inf)


_EDGE_SAMPLES = [*histogram.TIME_EDGES, *(e * (1 + 1e-12) for e in histogram.TIME_EDGES), 0.0, -0.0, 60.0, 61.0]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.floats(min_value=-1.0, max_value=100.0), st.sampled_from(_EDGE_SAMPLES),
                          st.sampled_from([math.inf, -math.inf, math.nan])), max_size=60))
def test_time_counts_bucket_every_sample_as_bucket_index_does(samples: list[float]) -> None:
    # the sort-and-bisect tally must agree with one bucket_index per sample, edges, NaN and infinities included
    counts, total = histogram.time_counts(samples)
    expected = [0] * histogram.HIST_BUCKETS
    for s in samples:
        expected[bucket_index(s)] += 1
    assert counts == expected
    assert total == pytest.approx(sum(s for s in samples if 0.0 < s < math.inf), abs=1e-9)


def test_time_counts_of_ordered_flush_samples() -> None:
    samples = [0.0001 * i for i in range(1, 2001)]  # 0.1 ms .. 200 ms, as a flush's e2e samples arrive
    counts, total = histogram.time_counts(samples)
    assert sum(counts) == 2000 and total == pytest.approx(sum(samples))
    assert counts == [sum(1 for s in samples if bucket_index(s) == i) for i in range(histogram.HIST_BUCKETS)]


def test_percentiles_on_known_data() -> None:
    edges = bucket_bounds()
    counts = [0] * 40
    counts[10] = 100  # all in (edges[9], edges[10]]
    p = histogram_percentiles(counts)
    assert p["p50"] == pytest.approx(edges[9] + 0.5 * (edges[10] - edges[9]))
    assert p["p99"] == pytest.approx(edges[9] + 0.99 * (edges[10] - edges[9]))
    counts = [0] * 40
    counts[0], counts[20] = 90, 10
    p = histogram_percentiles(counts, qs=(0.5, 0.9, 0.95, 0.999))
    assert p["p50"] == pytest.approx(50e-6 * 50 / 90)
    assert p["p90"] == pytest.approx(50e-6)
    assert p["p95"] == pytest.approx(edges[19] + 0.5 * (edges[20] - edges[19]))
    assert edges[19] < p["p99.9"] <= edges[20]
    over = [0] * 40
    over[39] = 3
    assert histogram_percentiles(over) == {"p50": 60.0, "p95": 60.0, "p99": 60.0}
    assert histogram_percentiles([0] * 40) == {"p50": None, "p95": None, "p99": None}
    with pytest.raises(ValueError):
        histogram_percentiles([1, 2, 3])


def test_observe_latency_fills_buckets(ring: ShmRing) -> None:
    rec = ring.claimer(0)
    samples = [0.0002] * 50 + [0.02] * 45 + [2.0] * 4 + [120.0, -0.1, math.nan]
    rec.observe_latency("pickup", samples)
    rec.observe_latency("pickup", [])
    h = rec.read()["pickup"]
    assert h["count"] == len(samples)
    assert h["sum"] == pytest.approx(0.0002 * 50 + 0.02 * 45 + 8.0 + 120.0)
    assert h["buckets"][bucket_index(0.0002)] == 50 and h["buckets"][bucket_index(0.02)] == 45
    assert h["buckets"][39] == 1 and h["buckets"][0] == 2
    assert bucket_bounds()[bucket_index(0.0002) - 1] < h["p50"] <= bucket_bounds()[bucket_index(0.0002)]
    assert rec.read()["e2e"]["count"] == 0


# -- attach errors, close, unlink --------------------------------------------------------
def _raw_segment(data: bytes) -> shared_memory.SharedMemory:
    seg = shared_memory.SharedMemory(create=True, size=len(data))
    seg.buf[: len(data)] = data
    return seg


def test_attach_missing_segment() -> None:
    with pytest.raises(ShmNotFound, match="no shared-memory segment"):
        ShmRing.attach("awa_fast_test_missing_segment")
    with pytest.raises(ShmLayoutError, match="name"):
        ShmRing.attach("../etc/passwd")


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda b: b.__setitem__(slice(0, 8), b"GARBAGE!"), "magic"),
        (lambda b: struct.pack_into("<I", b, 8, 99), "layout version 99"),
        (lambda b: struct.pack_into("<I", b, 24, 512), "section sizes"),
        (lambda b: struct.pack_into("<I", b, 12, 9), "do not agree"),
    ],
)
def test_attach_rejects_a_foreign_segment(ring: ShmRing, mutate, match) -> None:  # type: ignore[no-untyped-def]
    data = bytearray(ring._buffer()[: shm.segment_size(3)])
    mutate(data)
    seg = _raw_segment(bytes(data))
    try:
        with pytest.raises(ShmLayoutError, match=match):
            ShmRing.attach(seg.name)
    finally:
        seg.close()
        seg.unlink()


def test_attach_rejects_short_and_truncated_segments(ring: ShmRing) -> None:
    for data in (b"AWAFSHM1", bytes(ring._buffer()[:500])):
        seg = _raw_segment(data)
        try:
            with pytest.raises(ShmLayoutError, match="bytes"):
                ShmRing.attach(seg.name)
        finally:
            seg.close()
            seg.unlink()


def test_unlink_removes_the_segment_and_closed_rings_refuse_work() -> None:
    r = ShmRing.create(None, [("q", 0)])
    path = DEV_SHM / r.name
    other = ShmRing.attach(r.name)
    rec = r.claimer(0)
    r.close()
    r.close()
    with pytest.raises(ShmError, match="closed"):
        rec.add(claimed=1)
    with pytest.raises(ShmError, match="closed"):
        r.snapshot()
    assert path.exists()
    other.claimer(0).add(claimed=1)  # the other mapping still works
    r.unlink()
    assert not path.exists()
    r.unlink()  # idempotent
    assert other.claimer(0).read()["claimed"] == 1  # mapped memory outlives the name
    other.close()
    with pytest.raises(ShmNotFound):
        ShmRing.attach(r.name)
    dup_name = f"awa_fast_test_dup_{os.getpid()}"
    with pytest.raises(ShmError, match="exists"):
        with ShmRing.create(dup_name, []) as dup:
            try:
                ShmRing.create(dup_name, [])
            finally:
                dup.unlink()


_TRACKER_SCRIPT = textwrap.dedent(
    """
    import subprocess, sys
    import multiprocess  # what the supervisor forks with
    from awa_fast.runtime.shm import ShmRing

    def child(name):
        ring = ShmRing.attach(name)
        ring.claimer(0).add(claimed=1)
        ring.close()

    if __name__ == "__main__":
        ring = ShmRing.create(None, [("q", 0)])
        # a forked child shares this process's resource tracker
        p = multiprocess.get_context("fork").Process(target=child, args=(ring.name,))
        p.start(); p.join()
        assert p.exitcode == 0
        # an unrelated process (own tracker), like `awa-fast status`
        subprocess.run([sys.executable, "-c", f"from awa_fast.runtime.shm import ShmRing; "
                        f"r = ShmRing.attach({ring.name!r}); r.snapshot(); r.close()"], check=True)
        again = ShmRing.attach(ring.name)  # still there after every attacher exited
        assert again.claimer(0).read()["claimed"] == 1
        again.close()
        ring.close()
        ring.unlink()
        print("ok")
    """
)


def test_attachers_never_unlink_and_never_confuse_the_resource_tracker(tmp_path: pathlib.Path) -> None:
    """bpo-39959: attaching must not register the segment with a resource tracker."""
    script = tmp_path / "tracker.py"
    script.write_text(_TRACKER_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(pathlib.Path(shm.__file__).parents[3])}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
    # a shared tracker told to unregister a name it lost prints a KeyError; a leak warns
    assert "KeyError" not in out.stderr and "leaked" not in out.stderr, out.stderr


# -- locator ---------------------------------------------------------------------
def test_locator_round_trip(tmp_path: pathlib.Path) -> None:
    assert read_locator(tmp_path, "awa_fast") is None
    path = write_locator(tmp_path, "awa_fast", "awa_fast_seg", os.getpid())
    assert path == tmp_path / "run" / f"awa_fast.{os.getpid()}.json"
    data = json.loads(path.read_text())
    assert {k: data[k] for k in ("shm", "pid")} == {"shm": "awa_fast_seg", "pid": os.getpid()}
    assert read_locator(tmp_path, "awa_fast") == ("awa_fast_seg", os.getpid())
    assert read_locator(tmp_path, "other") is None
    assert remove_locator(tmp_path, "awa_fast", "someone_elses") is False
    assert path.exists()
    assert remove_locator(tmp_path, "awa_fast", "awa_fast_seg") is True
    assert not path.exists() and remove_locator(tmp_path, "awa_fast") is False
    with pytest.raises(InvalidName):
        write_locator(tmp_path, "../x", "n", 1)


def test_locator_of_a_dead_supervisor_or_garbage_is_none(tmp_path: pathlib.Path) -> None:
    p = FORK.Process(target=os._exit, args=(0,))
    p.start()
    p.join(10)
    assert p.pid is not None
    write_locator(tmp_path, "awa_fast", "awa_fast_seg", p.pid)
    assert read_locator(tmp_path, "awa_fast") is None
    (tmp_path / "run" / "awa_fast.json").write_text("{not json")
    assert read_locator(tmp_path, "awa_fast") is None
    (tmp_path / "run" / "awa_fast.json").write_text('{"shm": 5, "pid": 1}')
    assert read_locator(tmp_path, "awa_fast") is None


# -- segment names and the sweep of dead owners' segments -------------------------------
def _wait_for_byte(fd: int) -> None:
    os.read(fd, 1)


def _tagged_segment(name: str) -> pathlib.Path:
    """A real segment named ``name``, not registered with this process's resource tracker."""
    ring = shm_segment._untracked(name, lambda: ShmRing.create(name, [("q", 0)]))
    ring.close()
    return DEV_SHM / name


def test_create_tags_the_segment_with_its_owner(ring: ShmRing) -> None:
    owner = shm.segment_owner(ring.name)
    assert owner is not None, ring.name
    pid, start, scope = owner
    assert pid == os.getpid() and ring.name.startswith(f"awa_fast_{pid}_")
    stat_fields = pathlib.Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    assert start == int(stat_fields[19])  # field 22: start time in clock ticks since boot
    assert scope == shm_segment._owner_scope() and len(scope) == 16
    assert shm_segment._owner_alive(pid, start) is True
    assert shm.segment_owner(f"awa_fast_{pid}_0123abcd") is None  # untagged (old) names have no owner
    assert shm.segment_owner("awa_fast_test_dup_1") is None


def _dead_pid_and_name() -> tuple[int, str]:
    """A pid that existed and is gone, and a segment name tagged with it while it lived."""
    r, w = os.pipe()
    child = FORK.Process(target=_wait_for_byte, args=(r,))
    child.start()
    try:
        assert child.pid is not None
        name = shm.segment_name(child.pid)
    finally:
        os.write(w, b"x")
        child.join(10)
        os.close(r)
        os.close(w)
    assert child.exitcode == 0 and shm.segment_owner(name) is not None
    return child.pid, name


def _sweep_round(dead_pid: int, dead_name: str) -> tuple[dict[str, str], set[str], list[str], list[str]]:
    """Create one segment per case, sweep; (names, cases gone, swept names, INFO messages)."""
    me, my_start, scope = shm.segment_owner(shm.segment_name())  # type: ignore[misc]
    suffix = secrets.token_hex(4)
    names = {
        "dead": dead_name,
        "live": shm.segment_name(),  # this process
        # this pid, but another start time: the pid was reused, that owner is gone
        "reused": f"awa_fast_{me}_{my_start - 1}_{scope}_{suffix}",
        # another pid namespace, time namespace or boot: its pids are not ours to judge
        "foreign": f"awa_fast_{dead_pid}_{my_start}_{'0' * 16 if scope != '0' * 16 else '1' * 16}_{suffix}",
        # the old untagged name of a dead pid: owner unknown
        "untagged": f"awa_fast_{dead_pid}_{suffix}",
    }
    if os.geteuid() == 0:  # another user's segment is never ours to sweep
        names["other_user"] = f"awa_fast_{dead_pid}_{my_start}_{scope}_{suffix}"
    paths = {k: DEV_SHM / n for k, n in names.items()}
    try:
        for k, n in names.items():
            _tagged_segment(n)
            if k == "other_user":
                os.chown(paths[k], 65534, 65534)
        handler = _Capture()
        logger = logging.getLogger("awa_fast.shm")
        logger.addHandler(handler)
        old_level = logger.level
        logger.setLevel(logging.INFO)
        try:
            swept = shm.sweep_dead_segments()
        finally:
            logger.removeHandler(handler)
            logger.setLevel(old_level)
        gone = {k for k, p in paths.items() if not p.exists()}
        if "live" not in gone:
            live = ShmRing.attach(names["live"])  # still a working segment
            live.close()
        return names, gone, swept, handler.infos
    finally:
        for path in paths.values():
            path.unlink(missing_ok=True)


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.infos: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno == logging.INFO:
            self.infos.append(record.getMessage())


def test_sweep_removes_only_segments_whose_owner_is_provably_dead() -> None:
    # A supervisor starting elsewhere on this host (a parallel test run) may sweep a dead
    # owner's segment first - never a kept one; then the round is repeated.
    for _ in range(3):
        dead_pid, dead_name = _dead_pid_and_name()
        names, gone, swept, infos = _sweep_round(dead_pid, dead_name)
        assert gone == {"dead", "reused"}, (gone, swept)
        for name in swept:  # each removal logged at INFO, once
            assert sum(name in m for m in infos) == 1, (name, infos)
        ours = {k for k, n in names.items() if n in swept}
        assert ours <= gone, (ours, swept)
        if ours == gone:
            break
    else:
        raise AssertionError(f"another process swept this test's dead segments first, 3 times: last {swept}")
    for m in infos:
        if names["dead"] in m:
            assert f"left by dead supervisor {dead_pid} " in m, m


def test_owner_alive_is_unknown_rather_than_dead_when_unsure() -> None:
    assert shm_segment._owner_alive(os.getpid(), shm_segment._proc_start_time(os.getpid())) is True  # type: ignore[arg-type]
    assert shm_segment._owner_alive(2**40, 1) is None  # not a pid this kernel can have
    p = FORK.Process(target=os._exit, args=(0,))
    p.start()
    p.join(10)
    assert p.pid is not None and shm_segment._owner_alive(p.pid, 1) is False


# -- layout version 2: status records, maintenance totals -----------------------------
def test_a_segment_of_layout_version_1_is_refused_naming_both_versions(ring: ShmRing) -> None:
    data = bytearray(ring._buffer()[: shm.segment_size(3)])
    struct.pack_into("<I", data, 8, 1)  # what a supervisor of the previous awa-fast wrote
    seg = _raw_segment(bytes(data))
    try:
        with pytest.raises(ShmLayoutError, match=r"layout version 1, this awa-fast reads version 2.*another awa-fast"):
            ShmRing.attach(seg.name)
    finally:
        seg.close()
        seg.unlink()


def test_publish_adds_counters_and_samples_and_sets_gauges(ring: ShmRing) -> None:
    rec = ring.claimer(1)
    rec.publish({"claimed": 4, "heartbeat_failures": 2, "batches": 1},
                {"handler": [0.001, 0.003], "claim_seconds": [0.0005], "claim_jobs": [0, 1, 3, 4, 5, 10_000],
                 "flush_jobs": [4]}, in_flight=7, waiting=3)
    rec.publish({"claimed": 1, "completed": 0}, {"handler": [], "flush_seconds": [0.02]}, in_flight=2)
    r = rec.read()
    assert (r["claimed"], r["heartbeat_failures"], r["batches_flushed"]) == (5, 2, 1)
    assert (r["in_flight"], r["waiting"], r["abandoned"]) == (2, 3, 0)  # a gauge not given keeps its value
    assert r["handler"]["count"] == 2 and r["handler"]["sum"] == pytest.approx(0.004)
    assert r["handler"]["buckets"][bucket_index(0.001)] == 1 and r["handler"]["buckets"][bucket_index(0.003)] == 1
    assert r["flush_seconds"]["count"] == 1 and r["claim_seconds"]["count"] == 1
    # size buckets: le 0, 1, 2, 4, 8, ... 8192, then overflow
    assert r["claim_jobs"]["buckets"] == [1, 1, 0, 2, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]  # 3 and 4 share (2, 4]
    assert r["claim_jobs"]["sum"] == 10_013 and r["flush_jobs"]["buckets"][3] == 1
    assert ring.claimer(0).read()["claimed"] == 0
    for bad in ({"counts": {"nope": 1}}, {"samples": {"nope": [1.0]}}, {"nope": 1}):
        with pytest.raises(ValueError, match="unknown"):
            rec.publish(**bad)  # type: ignore[arg-type]


def test_size_buckets() -> None:
    from awa_fast.runtime.shm import SIZE_EDGES, size_bucket_index

    assert SIZE_EDGES[:5] == (0.0, 1.0, 2.0, 4.0, 8.0) and SIZE_EDGES[-1] == 8192.0 and len(SIZE_EDGES) == 15
    for n in (0, 1, 2, 3, 4, 5, 8, 9, 1024, 8192):
        i = size_bucket_index(n)
        assert n <= SIZE_EDGES[i] and (i == 0 or n > SIZE_EDGES[i - 1])
    assert size_bucket_index(8193) == 15 == size_bucket_index(10**9) and size_bucket_index(-5) == 0
    pct = histogram_percentiles([0, 0, 0, 10] + [0] * 12, (0.5,), edges=SIZE_EDGES)
    assert pct["p50"] == pytest.approx(3.0)  # inside (2, 4]


def test_maintenance_totals_continue_across_a_restarted_publisher(ring: ShmRing) -> None:
    ring.publish_rings({"claim": {"total_pruned": 5, "prune_pruned": 5}}, 1,
                       totals={"promoted": 10, "rescued_receipt": 2, "rescued_lease": 1})
    ring.publish_rings({"claim": {"total_pruned": 7, "prune_pruned": 2}}, 1, totals={"promoted": 12})
    snap = ring.read_rings()
    assert snap.totals == {"promoted": 12, "rescued_receipt": 2, "rescued_lease": 1}
    assert (snap.rings["claim"].total_pruned, snap.rings["claim"].prune_pruned) == (7, 2)
    again = ShmRing.attach(ring.name)  # a new maintenance process starts its own totals from zero
    try:
        again.publish_rings({"claim": {"total_pruned": 1}, "lease": {"total_busy": 4}}, 2, totals={"promoted": 3})
        snap = again.read_rings()
    finally:
        again.close()
    assert snap.totals["promoted"] == 15 and snap.totals["rescued_receipt"] == 2
    assert snap.rings["claim"].total_pruned == 8 and snap.rings["lease"].total_busy == 4
    with pytest.raises(ValueError, match="totals"):
        ring.publish_rings({}, 1, totals={"rotated": 1})


def test_one_ring_order_for_maintenance_and_the_segment() -> None:
    from awa_fast.runtime import maintenance

    assert maintenance.RINGS is layout.RINGS == shm.RINGS == ("claim", "ready", "lease")
