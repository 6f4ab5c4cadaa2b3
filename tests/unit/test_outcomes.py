"""One definition of outcomes: the enums match the SQL that stores them, and every older spelling is them."""

from __future__ import annotations

import re
from importlib import resources

import msgspec
import pytest

import awa_fast
import awa_fast.jobs as jobs
import awa_fast.storage as storage
from awa_fast.outcomes import (
    COMPLETED,
    Cancel,
    CloseCode,
    ClosureCode,
    DoneState,
    Outcome,
    RetryAfter,
    Snooze,
    Unwritten,
    WaitForCallback,
)
from awa_fast.runtime.handler_outcome import result_outcome, returned_outcome, timeout_text


def _sql(name: str) -> str:
    return resources.files("awa_fast.sql").joinpath(name).read_text("utf-8")


def _codes(text: str) -> dict[int, str]:
    """``1 complete, 2 fail terminally, ...`` -> {1: 'complete', 2: 'fail', ...}"""
    return {int(n): w for n, w in re.findall(r"(\d) (\w+)", text)}


def test_close_codes_are_the_ones_attempt_close_reads():
    sql = _sql("0002_storage_functions.sql")
    m = re.search(r"-- p_outcomes: (.*?)Returns", sql, re.S)
    assert m, "attempt_close's comment listing its outcome codes is gone"
    assert _codes(m.group(1).replace("--", " ")) == {c.value: c.name.lower() for c in CloseCode}


def test_closure_codes_are_the_ones_lease_claim_closures_stores():
    sql = _sql("0001_queue_storage.sql")
    m = re.search(r"-- outcome: (.*?)CREATE TABLE", sql, re.S)
    assert m
    assert _codes(m.group(1).replace("--", " ")) == {c.value: c.name.lower() for c in ClosureCode}
    # a closure written for a closed attempt carries its close code's value
    for code in CloseCode:
        assert ClosureCode(code.value).name.startswith(code.name[:4])


def test_done_states_fit_the_done_entries_check():
    assert "state        smallint    NOT NULL CHECK (state BETWEEN 1 AND 3)" in _sql("0001_queue_storage.sql")
    assert [s.value for s in DoneState] == [1, 2, 3]


def test_every_older_spelling_is_the_enum_member():
    assert storage.CLOSE_COMPLETE is CloseCode.COMPLETE and storage.CLOSE_FAIL is CloseCode.FAIL
    assert storage.CLOSE_CANCEL is CloseCode.CANCEL and storage.CLOSE_RETRY is CloseCode.RETRY
    assert storage.CLOSE_SNOOZE is CloseCode.SNOOZE
    assert jobs.CLOSURE_DLQ is ClosureCode.DLQ and jobs.STATE_CANCELLED is DoneState.CANCELLED
    assert jobs.RetryAfter is RetryAfter and awa_fast.Snooze is Snooze and awa_fast.Cancel is Cancel
    assert awa_fast.WaitForCallback is WaitForCallback
    assert not hasattr(jobs, "Outcome"), "one type is called Outcome: awa_fast.outcomes.Outcome"
    assert "Any" not in jobs.__all__
    for name in jobs.__all__:
        assert hasattr(jobs, name), name


def test_words_of_a_flush_report():
    assert {c.closed_as for c in CloseCode} == {"completed", "failed", "cancelled", "retried", "snoozed"}


class _Job:
    """What returned_outcome reads of a job (only WaitForCallback touches it)."""

    lease_backed = False

    def __init__(self) -> None:
        self.registered: list[float] = []

    def register_callback(self, timeout: float) -> str:
        self.registered.append(timeout)
        return "token"


def test_what_a_handler_returns_becomes_one_outcome_record():
    job = _Job()
    assert returned_outcome(job, None) is COMPLETED  # type: ignore[arg-type]
    assert returned_outcome(job, RetryAfter(3, "later")) == Outcome(CloseCode.RETRY, 3.0, "later")  # type: ignore[arg-type]
    assert returned_outcome(job, RetryAfter(-1)) == Outcome(CloseCode.RETRY, 0.0, "retry requested")  # type: ignore[arg-type]
    assert returned_outcome(job, Snooze(float("nan"))) == Outcome(CloseCode.SNOOZE, 0.0)  # type: ignore[arg-type]
    assert returned_outcome(job, Cancel()) == Outcome(CloseCode.CANCEL, error="cancelled by handler")  # type: ignore[arg-type]
    assert returned_outcome(job, WaitForCallback(7)) is Unwritten.PARKED  # type: ignore[arg-type]
    assert job.registered == [7.0]
    stored = returned_outcome(job, {"n": 1})  # type: ignore[arg-type]
    assert isinstance(stored, Outcome) and stored.code is CloseCode.COMPLETE
    assert stored.result is not None and msgspec.json.decode(stored.result) == {"n": 1}


def test_a_value_that_cannot_be_stored_retries_naming_its_type():
    out = result_outcome(object())
    assert out.code is CloseCode.RETRY and out.result is None
    assert out.error is not None and "of type object" in out.error


def test_outcome_records_are_immutable():
    with pytest.raises(AttributeError):
        COMPLETED.code = CloseCode.FAIL  # type: ignore[misc]
    assert timeout_text(2.5) == "timed out after 2.5 s"
