"""A handler that holds the GIL is detected by the heartbeat thread and reported."""

from __future__ import annotations

import sys
import threading
import time

from awa_fast.runtime.heartbeat import Heartbeat, HeartbeatConfig


def test_a_gil_holding_handler_is_detected_and_reported() -> None:
    stalled = threading.Event()
    seen: list[float] = []

    def on_stall(late: float) -> None:
        seen.append(late)
        stalled.set()

    # Nothing is held, so the heartbeat never needs the database.
    hb = Heartbeat(HeartbeatConfig("host=/nonexistent", "unused", interval=0.1, gil_warning_s=0.3),
                   held={}, claimed_at={}, stateful=set(), on_gil_stall=on_stall)
    hb.start()
    old = sys.getswitchinterval()
    try:
        sys.setswitchinterval(3.0)  # this thread keeps the GIL while it computes
        end = time.perf_counter() + 1.0
        x = 0
        while time.perf_counter() < end:
            x += 1
    finally:
        sys.setswitchinterval(old)
    try:
        assert stalled.wait(5.0), "the heartbeat thread did not report the stall"
        assert hb.gil_stalls >= 1 and max(seen) >= 0.3
    finally:
        hb.stop()


def test_no_stall_is_reported_when_handlers_release_the_gil() -> None:
    reports: list[float] = []
    hb = Heartbeat(HeartbeatConfig("host=/nonexistent", "unused", interval=0.05, gil_warning_s=0.5),
                   held={}, claimed_at={}, stateful=set(), on_gil_stall=reports.append)
    hb.start()
    ticks = threading.Event()
    # let the heartbeat thread run a few cycles while this thread sleeps (GIL released)
    ticks.wait(0.6)
    hb.stop()
    assert reports == [] and hb.gil_stalls == 0
