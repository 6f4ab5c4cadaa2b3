"""A handler that holds the GIL is detected by the heartbeat thread and counted (and logged)."""

from __future__ import annotations

import logging
import sys
import threading
import time

import pytest

from awa_fast.runtime.attempts import AttemptTable
from awa_fast.runtime.heartbeat import Heartbeat, HeartbeatConfig


def test_a_gil_holding_handler_is_detected_and_reported(caplog: pytest.LogCaptureFixture) -> None:
    # Nothing is held, so the heartbeat never needs the database.
    hb = Heartbeat(HeartbeatConfig("host=/nonexistent", "unused", interval=0.1, gil_warning_s=0.3), AttemptTable())
    with caplog.at_level(logging.WARNING, logger="awa_fast.heartbeat"):
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
        # stop() joins the thread: its late wake-up has been counted by the time it returns
        hb.stop()
    assert hb.gil_stalls >= 1
    assert any(getattr(r, "action", None) == "gil_stall" for r in caplog.records), caplog.text


def test_no_stall_is_reported_when_handlers_release_the_gil() -> None:
    hb = Heartbeat(HeartbeatConfig("host=/nonexistent", "unused", interval=0.05, gil_warning_s=0.5), AttemptTable())
    hb.start()
    ticks = threading.Event()
    # let the heartbeat thread run a few cycles while this thread sleeps (GIL released)
    ticks.wait(0.6)
    hb.stop()
    assert hb.gil_stalls == 0
