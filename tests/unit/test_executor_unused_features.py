"""An attempt of a kind that uses no optional feature does no work for them; one that uses each still gets it.

``Executor._run_sync`` runs one sync attempt in one frame (docs/performance-log.md,
feature-cost): per-job timeouts, weight slots, the per-attempt hook (tracing, the
log context) and the handler duration stamp are inline. These tests hold both
sides: unused, the feature's code is not reached; used, it behaves as before.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import threading
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from awa_fast import hooks
from awa_fast.jobs import TIMEOUT_KEY, ClaimSnapshot, Job, JobSpec
from awa_fast.outcomes import COMPLETED, CloseCode, Outcome
from awa_fast.runtime import executor as executor_module
from awa_fast.runtime.attempts import AttemptTable
from awa_fast.runtime.executor import Executor


class _Hooks:
    def released(self, n: int) -> None: ...

    def count(self, key: str, n: int) -> None: ...

    def thread_died(self, what: str, exc: BaseException) -> None:
        raise AssertionError(f"{what} died: {exc!r}")


def _job(job_id: int, kind: str = "k", metadata: bytes | None = None) -> Job[Any]:
    snap = ClaimSnapshot(job_id, 1, 1, 25, "q", kind, 2, b'{"n": 1}', metadata, 0, 1, job_id, 0, 7,
                         _dt.datetime.now(_dt.UTC))
    return Job(snap)


def _executor(*specs: JobSpec) -> Executor:
    return Executor({s.kind: s for s in specs}, 4, None, AttemptTable(), _Hooks(),  # type: ignore[arg-type]
                    threading.Event())


def _spec(kind: str = "k", handler: Any = None, timeout: float | None = None, weight: int = 1) -> JobSpec:
    return JobSpec(kind, handler or (lambda job: None), "q", 2, 25, False, None, timeout, weight)


def test_a_job_without_metadata_of_a_kind_without_timeout_is_not_looked_at_for_one(monkeypatch: Any) -> None:
    def no_call(job: Any, spec: Any) -> float | None:
        raise AssertionError("attempt_timeout was called for a job without metadata")

    monkeypatch.setattr(executor_module, "attempt_timeout", no_call)
    ex = _executor(_spec())
    job = _job(1)
    assert ex._run_sync(job) is COMPLETED
    assert ex._timed == {}
    assert job.started_at > 0 and job.finished_at >= job.started_at


def test_a_kind_timeout_and_a_job_timeout_are_still_watched() -> None:
    ex = _executor(_spec("slow", timeout=30.0), _spec("plain"))
    kind_timed = _job(1, "slow")
    own = _job(2, "plain", orjson.dumps({TIMEOUT_KEY: 5.0}))
    other_metadata = _job(3, "plain", orjson.dumps({"tenant": "a"}))
    for job in (kind_timed, own, other_metadata):
        assert ex._run_sync(job) is COMPLETED
    assert set(ex._timed) == {kind_timed.key, own.key}
    assert ex._timed[kind_timed.key][2] == 30.0
    assert ex._timed[own.key][2] == 5.0


def test_weight_slots_are_taken_while_the_handler_runs_and_given_back_after_a_failure() -> None:
    seen: list[int] = []
    ex: Executor

    def heavy(job: Any) -> None:
        assert ex._slots is not None
        seen.append(ex._slots._free)
        raise RuntimeError("boom")

    ex = _executor(_spec("heavy", heavy, weight=3), _spec("light"))
    assert ex._slots is not None
    outcome = ex._run_sync(_job(1, "heavy"))
    assert isinstance(outcome, Outcome) and outcome.code is CloseCode.RETRY and "boom" in (outcome.error or "")
    assert seen == [1]  # 4 slots, 3 taken while it ran
    assert ex._slots._free == 4
    assert ex._run_sync(_job(2, "light")) is COMPLETED
    assert ex._slots._free == 4


def test_no_slots_are_counted_without_a_weighted_kind() -> None:
    assert _executor(_spec())._slots is None


def test_an_installed_hook_encloses_the_handler_and_sees_its_exception() -> None:
    events: list[str] = []

    @contextlib.contextmanager
    def scope(job: Any) -> Iterator[None]:
        events.append(f"enter {job.id}")
        try:
            yield
        except BaseException as exc:
            events.append(f"raised {type(exc).__name__}")
            raise
        events.append(f"exit {job.id}")

    def handler(job: Any) -> None:
        events.append(f"run {job.id}")
        if job.id == 2:
            raise ValueError("bad")

    ex = _executor(_spec(handler=handler))
    hooks.install("test-unused-features", scope)
    try:
        assert ex._run_sync(_job(1)) is COMPLETED
        failed = ex._run_sync(_job(2))
    finally:
        hooks.uninstall("test-unused-features")
    assert isinstance(failed, Outcome) and failed.code is CloseCode.RETRY
    assert events == ["enter 1", "run 1", "exit 1", "enter 2", "run 2", "raised ValueError"]
    assert hooks.around is None


@pytest.mark.parametrize("value", [None, {"answer": 42}])
def test_a_returned_value_is_still_the_outcome(value: Any) -> None:
    ex = _executor(_spec(handler=lambda job: value))
    outcome = ex._run_sync(_job(1))
    if value is None:
        assert outcome is COMPLETED
    else:
        assert isinstance(outcome, Outcome) and outcome.code is CloseCode.COMPLETE and outcome.result is not None


def test_an_unknown_kind_retries_without_running_anything() -> None:
    ex = _executor(_spec())
    job = _job(1, "other")
    outcome = ex._run_sync(job)
    assert isinstance(outcome, Outcome) and outcome.code is CloseCode.RETRY
    assert job.started_at == 0.0
