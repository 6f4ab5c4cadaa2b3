"""StopFlag: the lock-free, latched stop event that signal handlers set (see test_stop_reentrant.py)."""

from __future__ import annotations

import gc
import os
import signal
import threading
import time

import pytest

from awa_fast.runtime.stopflag import StopFlag


def test_unset_it_times_out_and_reports_unset() -> None:
    flag = StopFlag()
    assert not flag.is_set()
    assert not flag.wait(0)
    assert not flag.wait(0.01)


def test_a_set_from_another_thread_wakes_every_waiter_and_stays_set() -> None:
    flag = StopFlag()
    woke: list[bool] = []
    waiters = [threading.Thread(target=lambda: woke.append(flag.wait(5)), daemon=True) for _ in range(3)]
    for t in waiters:
        t.start()
    threading.Thread(target=flag.set, daemon=True).start()
    assert flag.wait(5)  # and the main thread's own wait
    for t in waiters:
        t.join(5)
    assert woke == [True, True, True]
    flag.set()  # again: changes nothing
    assert flag.is_set() and flag.wait(0) and flag.wait(None)  # latched: later waits return at once


def _blocked_in_poll(native_id: int) -> bool | None:
    """Whether that thread sleeps in poll() (Linux's wchan: "0" while it runs); None where there is no wchan."""
    try:
        with open(f"/proc/self/task/{native_id}/wchan") as f:
            return "poll" in f.read()
    except OSError:
        return None


def _signal_once_in_poll(sig: int) -> None:
    main = threading.main_thread()
    assert main.native_id is not None and main.ident is not None
    deadline = time.monotonic() + 2.0  # a kernel that hides wchan ("0" always): send anyway
    while _blocked_in_poll(main.native_id) is False and time.monotonic() < deadline:
        time.sleep(0.001)  # until the main thread is inside StopFlag.wait's poll
    signal.pthread_kill(main.ident, sig)


def test_a_real_signal_whose_handler_sets_it_ends_the_main_threads_wait() -> None:
    flag = StopFlag()
    old = signal.signal(signal.SIGUSR2, lambda *_: flag.set())
    try:
        sender = threading.Thread(target=_signal_once_in_poll, args=(signal.SIGUSR2,), daemon=True)
        sender.start()
        t0 = time.monotonic()
        assert flag.wait(5)  # only the handler sets it: it has run
        assert time.monotonic() - t0 < 5.0
        sender.join(5)
        signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGUSR2)  # a second one: handled, no-op
        assert flag.is_set() and flag.wait(0)
    finally:
        signal.signal(signal.SIGUSR2, old)


def test_its_pipe_is_closed_once_nothing_can_set_it() -> None:
    flag = StopFlag()
    fds = (flag._r, flag._w)  # noqa: SLF001
    for fd in fds:
        os.fstat(fd)
    del flag
    gc.collect()
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)
