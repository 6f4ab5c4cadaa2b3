"""The supervisor's stop handler does no I/O but the signals; the drain logs it afterwards.

The handler runs on the main thread between two bytecodes, so it may land
inside a log write; a buffered stream refuses a re-entrant write
(``RuntimeError: reentrant call``), and logging's handler lock is re-entrant,
so a handler that logged wrote into the middle of the line being written.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Iterator

import pytest

from awa_fast.runtime.supervisor import Supervisor, SupervisorConfig


class _MidWrite(logging.Handler):
    """Records every message; raises SIGTERM to this process inside the first emit, once."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []
        self.nested: list[str] = []  # messages emitted while another emit was still running
        self._depth = 0
        self._raised = False

    def emit(self, record: logging.LogRecord) -> None:
        if self._depth:
            self.nested.append(record.getMessage())
        self._depth += 1
        try:
            if not self._raised:
                self._raised = True
                signal.raise_signal(signal.SIGTERM)  # the handler runs here, mid-"write"
            self.messages.append(record.getMessage())
        finally:
            self._depth -= 1


@pytest.fixture
def supervisor() -> Iterator[Supervisor]:
    sup = Supervisor(SupervisorConfig(app_ref="tests:app", dsn="", schema="awa_fast", queues=()))
    before = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, sup.request_drain)  # as Supervisor.run installs it
    try:
        yield sup
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_stop_signal_inside_a_log_write_writes_nothing_inside_it(supervisor: Supervisor) -> None:
    log = logging.getLogger("awa_fast.supervisor")
    catcher = _MidWrite()
    old_level = log.level
    log.addHandler(catcher)
    log.setLevel(logging.INFO)
    try:
        log.info("a line being written")
        assert supervisor._draining  # the handler ran
        assert catcher.nested == []  # and wrote nothing into the line being written
        assert supervisor._drain() == 0  # no children: a clean drain, which says why it began
    finally:
        log.removeHandler(catcher)
        log.setLevel(old_level)
    assert catcher.messages[0] == "a line being written"
    assert "drain requested" in catcher.messages
