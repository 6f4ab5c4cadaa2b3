"""Jobs as the runtime sees them: claim snapshots, the handle a handler gets, the registry.

A :class:`ClaimSnapshot` is the immutable record the claim function returns
for one claimed attempt. The completion batcher writes terminal rows from it,
so completion never reloads ``ready_entries``. The handler outcomes
(:class:`RetryAfter`, :class:`Snooze`, :class:`Cancel`,
:class:`WaitForCallback`) are defined in :mod:`awa_fast.outcomes` and
importable from here too.
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import msgspec

from awa_fast.errors import PayloadError
from awa_fast.outcomes import Cancel, ClosureCode, DoneState, RetryAfter, Snooze, WaitForCallback

if TYPE_CHECKING:
    import asyncio

# Encoded size limit of one job.set_progress() value (JSON bytes). Progress
# rides on every heartbeat batch of its claimer, so it is kept small.
MAX_PROGRESS_BYTES = 64 * 1024

# done_entries.state / lease_claim_closures.outcome codes: defined in awa_fast.outcomes, named here too
STATE_COMPLETED = DoneState.COMPLETED
STATE_FAILED = DoneState.FAILED
STATE_CANCELLED = DoneState.CANCELLED

CLOSURE_COMPLETED = ClosureCode.COMPLETED
CLOSURE_FAILED = ClosureCode.FAILED
CLOSURE_CANCELLED = ClosureCode.CANCELLED
CLOSURE_RETRIED = ClosureCode.RETRIED
CLOSURE_SNOOZED = ClosureCode.SNOOZED
CLOSURE_DLQ = ClosureCode.DLQ
CLOSURE_RESCUED = ClosureCode.RESCUED
CLOSURE_MATERIALIZED = ClosureCode.MATERIALIZED


class ClaimSnapshot(msgspec.Struct, frozen=True, gc=False):
    """One claimed attempt, exactly as the claim function returned it.

    ``args``/``metadata`` are the raw JSON bytes stored in ``ready_entries``;
    they are decoded lazily by :class:`awa_fast.Job`.
    """

    job_id: int
    run_lease: int
    attempt: int
    max_attempts: int
    queue: str
    kind: str
    priority: int
    args: bytes
    metadata: bytes | None
    ready_slot: int
    lane_id: int
    lane_seq: int
    claim_slot: int
    claim_id: int
    created_at: _dt.datetime
    errors: bytes | None = None
    callback_result: bytes | None = None
    # the last flushed progress of an earlier attempt (retry, snooze, rescue), raw JSON; None if never set
    progress: bytes | None = None


# The ClaimSnapshot fields a claim (claim_batch_v4, migration 0021) sends once per receipt: on the
# receipt's first row, NULL (None) on the rest, which carry the first row's values (decode_snapshots
# in the codec and its Python twin). All six come together.
RECEIPT_FIELDS = ("queue", "priority", "ready_slot", "lane_id", "claim_slot", "claim_id")


__all__ = [
    "AttemptClosed",
    "ClaimSnapshot",
    "Job",
    "JobSpec",
    "RetryAfter",
    "Snooze",
    "Cancel",
    "WaitForCallback",
]


T = TypeVar("T")


class Job(Generic[T]):
    """What a handler receives: one claimed attempt of one job.

    ``args`` are decoded lazily (with msgspec, into the handler's declared
    ``msgspec.Struct`` type when it has one). ``set_progress`` and
    ``is_cancelled`` talk to the claimer's heartbeat thread, never to the
    database directly.
    """

    __slots__ = ("snapshot", "key", "_args_type", "_args", "_progress", "_cancelled", "_stale", "_runtime",
                 "callback_token", "lease_backed", "started_at", "finished_at", "_task")
    # Slots that __init__ leaves unset (see the comment there); declared for the type checker only,
    # a bare annotation creates no class attribute, so the slots stay as they are.
    _stale: bool
    _task: asyncio.Future[Any]
    finished_at: float

    def __init__(self, snapshot: ClaimSnapshot, args_type: type | None = None, runtime: Any = None) -> None:
        # Only stores into slots: the codec's new_jobs (the claimer's dispatch) fills the same slots
        # in C once an import-time probe found a Job built both ways equal slot by slot.
        self.snapshot = snapshot
        # (job_id, run_lease): the attempt's key in every runtime structure, built once per claim
        self.key = (snapshot.job_id, snapshot.run_lease)
        self._args_type = args_type
        self._args: Any = _UNSET
        self._progress: Any = None
        self._cancelled = False
        # Set only when needed, so a claimed job costs no more than before:
        # _stale (the attempt was rescued or closed elsewhere: the heartbeat said stale)
        # and _task (the asyncio task of an async handler, which the runtime cancels),
        # finished_at (when the handler returned: the handler duration metric).
        self._runtime = runtime
        self.callback_token: Any = None
        self.lease_backed = False
        self.started_at = 0.0

    def __repr__(self) -> str:
        s = self.snapshot
        return f"Job(id={s.job_id}, kind={s.kind!r}, queue={s.queue!r}, attempt={s.attempt}, run_lease={s.run_lease})"

    @property
    def id(self) -> int:
        """The job id (stable across attempts)."""
        return self.snapshot.job_id

    @property
    def kind(self) -> str:
        return self.snapshot.kind

    @property
    def queue(self) -> str:
        return self.snapshot.queue

    @property
    def attempt(self) -> int:
        """This attempt's number, from 1."""
        return self.snapshot.attempt

    @property
    def max_attempts(self) -> int:
        return self.snapshot.max_attempts

    @property
    def run_lease(self) -> int:
        """Increments on every claim; guards every write about this attempt."""
        return self.snapshot.run_lease

    @property
    def priority(self) -> int:
        return self.snapshot.priority

    @property
    def args(self) -> T:
        """The decoded job args (a dict, or the handler's ``msgspec.Struct`` type)."""
        if self._args is _UNSET:
            if self._args_type is not None:
                self._args = msgspec.json.decode(self.snapshot.args, type=self._args_type)
            else:
                self._args = msgspec.json.decode(self.snapshot.args)
        args: T = self._args
        return args

    @property
    def metadata(self) -> dict[str, Any]:
        m = self.snapshot.metadata
        return {} if m is None else msgspec.json.decode(m)

    @property
    def callback_result(self) -> Any:
        """The payload a ``resume`` callback resolution delivered, else None."""
        c = self.snapshot.callback_result
        return None if c is None else msgspec.json.decode(c)

    @property
    def errors(self) -> list[Any]:
        """Errors of earlier attempts, oldest first (at most 10)."""
        e = self.snapshot.errors
        return [] if e is None else msgspec.json.decode(e)

    @property
    def progress(self) -> Any:
        """The current progress: what this attempt set last, else the last value an earlier
        attempt of the job flushed (it survives retry, snooze and rescue); None if never set."""
        if self._progress is not None:
            return self._progress
        p = self.snapshot.progress
        return None if p is None else msgspec.json.decode(p)

    def set_progress(self, progress: Any) -> None:
        """Record progress (JSON-able, at most 64 KiB encoded); flushed with the next heartbeat batch.

        The value is checked and encoded here, with the same rules as job
        args at enqueue: a value that cannot be stored (a NUL in a string, a
        ``set``, NaN, a non-string key, too deep, too large) raises
        :class:`~awa_fast.PayloadError` in the handler and is not recorded;
        the progress recorded before stays.
        """
        from awa_fast.client import encode_payload  # client -> storage -> jobs: imported late

        limit = getattr(self._runtime, "max_progress_bytes", MAX_PROGRESS_BYTES)
        try:
            data = encode_payload(progress, "progress", limit)
        except PayloadError as exc:
            raise _progress_error(exc) from None
        self._progress = data
        if self._runtime is not None:
            self._runtime.progress_changed(self)

    def is_cancelled(self) -> bool:
        """True once this attempt should stop: an operator asked to cancel the job, or the
        attempt was rescued (deadline, heartbeat timeout) or closed elsewhere.

        Seen by the heartbeat thread, so it turns True within one heartbeat
        interval. An ``async def`` handler's task is also cancelled; a sync
        handler must look at this itself (a thread cannot be stopped).
        """
        return self._cancelled

    def is_abandoned(self) -> bool:
        """True once this attempt was rescued or closed elsewhere: whatever it returns is discarded."""
        return getattr(self, "_stale", False)

    def register_callback(self, timeout: float) -> str:
        """Park this attempt for an external callback; returns the token to resolve it with.

        Return :class:`WaitForCallback` from the handler afterwards. The
        registration is durable before this returns, so a callback that
        arrives at once is not lost.
        """
        if self._runtime is None:
            raise RuntimeError("register_callback needs a running claimer")
        token: str = self._runtime.register_callback(self, timeout)
        self.callback_token = token
        self.lease_backed = True
        return token


def _progress_error(exc: PayloadError) -> PayloadError:
    """The enqueue check's PayloadError, worded for progress (nothing is enqueued here)."""
    text = str(exc)
    tail = "; nothing was enqueued"
    if text.endswith(tail):
        text = text[: -len(tail)]
    err = PayloadError("progress rejected", exc.path)
    err.args = (f"{text}; the progress was not recorded",)
    return err


class _Unset:
    __slots__ = ()


_UNSET = _Unset()


@dataclass(frozen=True, slots=True)
class AttemptClosed:
    """One attempt written by a completion flush (what :meth:`App.on_flush` listeners get).

    ``outcome`` is ``completed``, ``retried``, ``snoozed``, ``cancelled``,
    ``failed`` or ``stale`` (the attempt had been rescued or closed elsewhere,
    nothing was written): what the worker wrote, so a retry of the last
    allowed attempt reads ``retried`` although the database moved the job
    to the DLQ (or failed it). Times are this worker's ``time.time()``:
    ``started_at`` right before the handler ran (0.0 if it never ran),
    ``committed_at`` right after the flush's COMMIT returned.
    """

    job_id: int
    run_lease: int
    kind: str
    outcome: str
    started_at: float
    committed_at: float


@dataclass(frozen=True, slots=True)
class JobSpec:
    """A registered handler and its defaults."""

    kind: str
    handler: Any
    queue: str
    priority: int
    max_attempts: int
    is_async: bool
    args_type: type | None
    # seconds one attempt may run, from the handler's start; None: no timeout (the claimer
    # then pays nothing for it: only attempts of kinds with a timeout are watched)
    timeout: float | None = None
    # worker slots one running attempt of this kind takes out of the claimer's concurrency
    weight: int = 1


#: The metadata key of a per-job timeout (``app.enqueue(..., timeout=)``). Metadata keys that
#: start with ``awa_fast.`` are reserved for awa-fast (docs/handlers.md).
TIMEOUT_KEY = "awa_fast.timeout"
_TIMEOUT_KEY_JSON = b'"awa_fast.timeout"'


def attempt_timeout(job: Job[Any], spec: JobSpec) -> float | None:
    """The timeout of ``job``'s attempt: its own (set at enqueue), else its kind's.

    A job without metadata is never decoded for it.
    """
    raw = job.snapshot.metadata
    if raw is not None and _TIMEOUT_KEY_JSON in raw:
        value = job.metadata.get(TIMEOUT_KEY)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return float(value)
    return spec.timeout
