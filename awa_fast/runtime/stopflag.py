"""The stop flag: a ``threading.Event`` for stop requests that a signal handler may set at any point.

A stop handler (SIGTERM, SIGINT) runs on the main thread, between two
bytecodes of whatever that thread was doing. ``threading.Event.set`` takes
the event's lock, which is not re-entrant, and ``Event.wait`` holds that
same lock just before and after it blocks: a signal that lands there made
the handler wait on a lock its own thread holds, for good (the process never
drained and was SIGKILLed). :class:`StopFlag` takes no lock at all.
"""

from __future__ import annotations

import math
import os
import select


class StopFlag:
    """A latched, lock-free event: once set it stays set, and every wait, now or later, returns True.

    ``set`` may be called from any thread and from a signal handler at any
    point (also one that lands inside another ``set`` or inside a ``wait``):
    it sets a bool and writes one byte to a non-blocking self-pipe. The pipe
    is never drained, so its read end stays readable and wakes every waiter
    on every thread. Same ``is_set``/``set``/``wait`` as ``threading.Event``
    (there is no ``clear``: a stop is not taken back; the wake-up that is
    cleared, :class:`~awa_fast.runtime.listener.Wakeup`, is a subclass).
    """

    __slots__ = ("_flag", "_r", "_w", "__weakref__")

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self._flag = False

    def set(self) -> None:
        if self._flag:
            return
        self._flag = True
        try:
            os.write(self._w, b"\1")
        except OSError:  # full: the read end is readable anyway
            pass

    def is_set(self) -> bool:
        return self._flag

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until set or ``timeout`` seconds passed (None: no limit); True if set."""
        if self._flag:
            return True
        wait_readable((self._r,), timeout)
        return self._flag

    def __del__(self) -> None:
        # Closed only when nothing can call set() any more (a handler that can still call it holds a
        # reference), so no fd number is reused under a setter.
        for fd in (getattr(self, "_r", -1), getattr(self, "_w", -1)):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass


def wait_readable(fds: tuple[int, ...], timeout: float | None) -> None:
    """Block until one of ``fds`` is readable (or has hung up) or ``timeout`` seconds passed (None: no limit).

    ``poll``, not ``select``: a process with more than 1,024 open files (an
    application hosting the in-process worker) may hand out larger numbers.
    """
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    poller.poll(None if timeout is None else max(0, math.ceil(timeout * 1000.0)))
