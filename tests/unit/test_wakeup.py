"""The claim loop's Wakeup: an Event that can be waited on together with a socket (a self-pipe)."""

from __future__ import annotations

import os
import signal
import threading
import time

from awa_fast.runtime.listener import Wakeup, wait_readable


def test_a_set_from_another_thread_ends_a_wait_and_the_pipe_is_readable_until_cleared() -> None:
    wake = Wakeup()
    assert not wake.is_set() and not wake.wait(0.0)
    threading.Timer(0.05, wake.set).start()
    t0 = time.monotonic()
    assert wake.wait(10.0)
    assert time.monotonic() - t0 < 5.0
    wake.set()  # a second set while set writes nothing more and changes nothing
    t0 = time.monotonic()
    wait_readable((wake.fileno(),), 10.0)  # what Listener.wait selects on
    assert time.monotonic() - t0 < 1.0
    wake.clear()
    assert not wake.is_set()
    t0 = time.monotonic()
    wait_readable((wake.fileno(),), 0.2)  # drained: the pipe no longer wakes a poll
    assert time.monotonic() - t0 >= 0.15
    assert not wake.wait(0.05)


def test_a_set_from_a_signal_handler_ends_the_main_threads_wait() -> None:
    wake = Wakeup()
    old = signal.signal(signal.SIGUSR1, lambda *_: wake.set())
    try:
        threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        t0 = time.monotonic()
        assert wake.wait(10.0)
        assert time.monotonic() - t0 < 5.0
    finally:
        signal.signal(signal.SIGUSR1, old)
