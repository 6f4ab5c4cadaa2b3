"""What the public API returns about jobs and queues: :class:`JobInfo`, :class:`QueueSettings`.

Both are frozen snapshots read from the database at one moment; read again
(``app.get_job``, ``app.queue_settings``) to see later changes.
"""

from __future__ import annotations

import datetime as _dt
import math
from dataclasses import asdict, dataclass
from typing import Any

from awa_fast.errors import ConfigError, OutOfRange

#: States a job can be in. Terminal: completed, failed, cancelled, dlq.
JOB_STATES = ("available", "running", "waiting_external", "scheduled", "retryable", "snoozed",
              "completed", "failed", "cancelled", "dlq")
TERMINAL_STATES = frozenset({"completed", "failed", "cancelled", "dlq"})


def _ts(value: Any) -> _dt.datetime | None:
    if value is None or isinstance(value, _dt.datetime):
        return value
    return _dt.datetime.fromisoformat(str(value))


@dataclass(frozen=True, slots=True)
class JobInfo:
    """One job as the database holds it now.

    ``state`` is one of :data:`JOB_STATES`; ``attempt`` counts attempts
    started (the running one included); ``run_lease`` increments on every
    claim. ``errors`` lists earlier attempts' errors (oldest first, at most
    10, each ``{"attempt", "error"}``), ``error`` is the final or
    last error. ``progress`` is the last value flushed with
    ``job.set_progress`` (by the running attempt, or carried from an earlier
    one while the job waits for its next attempt; dropped once terminal).
    ``result`` is what the handler returned, for a completed job (None when
    it returned None). Times are the database's.
    """

    job_id: int
    state: str
    queue: str
    kind: str
    args: Any
    metadata: Any
    attempt: int
    max_attempts: int | None
    run_lease: int
    priority: int | None
    errors: list[Any]
    error: str | None
    progress: Any
    result: Any
    created_at: _dt.datetime | None
    run_at: _dt.datetime | None
    finished_at: _dt.datetime | None
    callback_timeout_at: _dt.datetime | None

    @property
    def id(self) -> int:
        """The job id (same as ``job_id``)."""
        return self.job_id

    @property
    def terminal(self) -> bool:
        """True when the job will not run again by itself (completed, failed, cancelled, dlq)."""
        return self.state in TERMINAL_STATES

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> JobInfo:
        """Build from a storage row (``Storage.job_load_many``)."""
        return cls(
            job_id=int(row["job_id"]), state=str(row["state"]), queue=str(row["queue"]), kind=str(row["kind"]),
            args=row.get("args"), metadata=row.get("metadata"), attempt=int(row.get("attempt") or 0),
            max_attempts=row.get("max_attempts"), run_lease=int(row.get("run_lease") or 0),
            priority=row.get("priority"), errors=list(row.get("errors") or []), error=row.get("error"),
            progress=row.get("progress"), result=row.get("result"), created_at=_ts(row.get("created_at")),
            run_at=_ts(row.get("run_at")), finished_at=_ts(row.get("finished_at")),
            callback_timeout_at=_ts(row.get("callback_timeout_at")))

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able fields (times as ISO 8601 strings)."""
        out = asdict(self)
        for key, value in out.items():
            if isinstance(value, _dt.datetime):
                out[key] = value.isoformat()
        return out


@dataclass(frozen=True, slots=True)
class QueueSettings:
    """A queue's settings; durations in seconds (``deadline`` None: no per-attempt deadline).

    ``history_retention`` is None: the schema does not store it yet (see
    :meth:`awa_fast.App.configure_queue`).
    """

    queue: str
    paused: bool
    stripes: int
    enqueue_shards: int
    dlq: bool
    deadline: float | None
    heartbeat_timeout: float
    aging_interval: float
    dlq_retention: float
    history_retention: float | None
    created_at: _dt.datetime | None
    key_max_running: int | None = None  # jobs of one concurrency key at once (docs/flow-control.md)

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> QueueSettings:
        """Build from a storage row (``Storage.queue_settings``)."""
        return cls(queue=row["queue"], paused=bool(row["paused"]), stripes=int(row["stripes"]),
                   enqueue_shards=int(row["enqueue_shards"]), dlq=bool(row["dlq_enabled"]),
                   deadline=row["deadline_s"], heartbeat_timeout=float(row["heartbeat_timeout_s"]),
                   aging_interval=float(row["aging_interval_s"]), dlq_retention=float(row["dlq_retention_s"]),
                   history_retention=row.get("history_retention_s"), created_at=row.get("created_at"),
                   key_max_running=row.get("key_max_running"))

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able fields."""
        out = asdict(self)
        if isinstance(out["created_at"], _dt.datetime):
            out["created_at"] = out["created_at"].isoformat()
        return out


@dataclass(frozen=True, slots=True)
class DlqEntry:
    """One dead-lettered job: why it failed, after how many attempts, and its args."""

    job_id: int
    queue: str
    kind: str
    attempt: int
    max_attempts: int
    reason: str
    failed_at: _dt.datetime
    args: Any

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> DlqEntry:
        """Build from a storage row (``Storage.dlq_select``)."""
        return cls(job_id=int(row["job_id"]), queue=row["queue"], kind=row["kind"], attempt=int(row["attempt"]),
                   max_attempts=int(row["max_attempts"]), reason=row["reason"], failed_at=row["failed_at"],
                   args=row["args"])

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able fields."""
        out = asdict(self)
        out["failed_at"] = self.failed_at.isoformat()
        return out


# -- validation of configure_queue's values --------------------------------------------

MAX_DURATION_S = 10 * 365 * 86400.0


def seconds(what: str, value: object, *, low: float = 0.001, allow_none: bool = False) -> float | None:
    """A positive, finite duration in seconds (at most ten years); None passes when ``allow_none``."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not low <= value <= MAX_DURATION_S:
        raise OutOfRange(what, value, low, MAX_DURATION_S)
    return float(value)


def int_in(what: str, value: object, low: int, high: int) -> int:
    """An int in ``low..high`` (bool refused)."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise OutOfRange(what, value, low, high)
    return value


def flag(what: str, value: object) -> bool:
    """A real bool (``1``/``"yes"`` are refused, they hide typos)."""
    if not isinstance(value, bool):
        raise ConfigError(f"{what}={value!r}: use True or False")
    return value
