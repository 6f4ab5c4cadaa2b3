"""Jobs as the runtime sees them: claim snapshots, handler outcomes, the registry.

A :class:`ClaimSnapshot` is the immutable record the claim function returns
for one claimed attempt. The completion batcher writes terminal rows from it,
so completion never reloads ``ready_entries``.
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass
from typing import Any

import msgspec

# done_entries.state / lease_claim_closures.outcome codes (see sql/0001_queue_storage.sql)
STATE_COMPLETED = 1
STATE_FAILED = 2
STATE_CANCELLED = 3

CLOSURE_COMPLETED = 1
CLOSURE_FAILED = 2
CLOSURE_CANCELLED = 3
CLOSURE_RETRIED = 4
CLOSURE_SNOOZED = 5
CLOSURE_DLQ = 6
CLOSURE_RESCUED = 7
CLOSURE_MATERIALIZED = 8


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


@dataclass(frozen=True, slots=True)
class RetryAfter:
    """Handler outcome: run again after ``seconds`` (consumes an attempt)."""

    seconds: float
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class Snooze:
    """Handler outcome: run again after ``seconds`` without consuming an attempt."""

    seconds: float


@dataclass(frozen=True, slots=True)
class Cancel:
    """Handler outcome: end the job as cancelled."""

    reason: str = "cancelled by handler"


@dataclass(frozen=True, slots=True)
class WaitForCallback:
    """Handler outcome: park the attempt until a callback resolves it or ``timeout`` passes.

    The token to resolve it with is ``job.callback_token``.
    """

    timeout: float


Outcome = None | RetryAfter | Snooze | Cancel | WaitForCallback

__all__ = [
    "ClaimSnapshot",
    "RetryAfter",
    "Snooze",
    "Cancel",
    "WaitForCallback",
    "Outcome",
    "Any",
]
