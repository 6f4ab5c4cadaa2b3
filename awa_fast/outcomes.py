"""How an attempt ends: the one definition of outcomes, from a handler's return value to the SQL codes.

Three layers, each defined once here:

- **What a handler returns** (user-facing, exported from ``awa_fast``):
  ``None`` or any stored value (completes), :class:`RetryAfter`,
  :class:`Snooze`, :class:`Cancel`, :class:`WaitForCallback`; raising
  retries (``TerminalError`` fails). :data:`HandlerOutcome` names the
  control values.
- **What the runtime writes**: the executor turns each handler's result into
  one :class:`Outcome` record (or an :class:`Unwritten` marker when nothing
  is written), and the completion batcher writes it.
- **What the database stores**: :class:`CloseCode` is the ``p_outcomes``
  argument of ``attempt_close`` (``sql/0002_storage_functions.sql``);
  :class:`ClosureCode` is ``lease_claim_closures.outcome`` and
  :class:`DoneState` is ``done_entries.state`` (``sql/0001_queue_storage.sql``).
  The SQL spells these as integers; the values here must match it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import msgspec

__all__ = [
    "COMPLETED",
    "Cancel",
    "CloseCode",
    "ClosureCode",
    "DoneState",
    "HandlerOutcome",
    "Outcome",
    "RetryAfter",
    "Snooze",
    "Unwritten",
    "WaitForCallback",
]


class CloseCode(enum.IntEnum):
    """How the runtime closes an attempt: ``attempt_close``'s outcome codes (sql/0002, ``p_outcomes``)."""

    COMPLETE = 1
    FAIL = 2  # terminally: the DLQ when the queue has one, else failed
    CANCEL = 3
    RETRY = 4  # consumes an attempt; the last one goes to the DLQ (or fails)
    SNOOZE = 5  # runs again without consuming an attempt

    @property
    def closed_as(self) -> str:
        """The word a flush report uses (``AttemptClosed.outcome``): completed, failed, ..."""
        return _CLOSED_AS[self]


_CLOSED_AS = {CloseCode.COMPLETE: "completed", CloseCode.FAIL: "failed", CloseCode.CANCEL: "cancelled",
              CloseCode.RETRY: "retried", CloseCode.SNOOZE: "snoozed"}


class ClosureCode(enum.IntEnum):
    """``lease_claim_closures.outcome``: how an attempt's claim was closed (sql/0001)."""

    COMPLETED = 1
    FAILED = 2
    CANCELLED = 3
    RETRIED = 4
    SNOOZED = 5
    DLQ = 6
    RESCUED = 7
    MATERIALIZED = 8


class DoneState(enum.IntEnum):
    """``done_entries.state``: the terminal state of a finished job (sql/0001)."""

    COMPLETED = 1
    FAILED = 2
    CANCELLED = 3


# -- what a handler returns ------------------------------------------------------------


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


HandlerOutcome = None | RetryAfter | Snooze | Cancel | WaitForCallback
"""The control values a handler may return (any other value completes the job and is stored as its result)."""


# -- what the runtime writes -------------------------------------------------------------


class Outcome(msgspec.Struct, frozen=True, gc=False):
    """How one attempt closes, as the executor decided and the completion batcher writes it.

    ``delay``: seconds until the next run (retry, snooze; None: the queue's
    backoff). ``error``: the text stored with a retry, failure or cancel.
    ``result``: the encoded JSON a completing handler returned (None: no
    result), written with the completion.
    """

    code: CloseCode
    delay: float | None = None
    error: str | None = None
    result: bytes | None = None


COMPLETED = Outcome(CloseCode.COMPLETE)
"""The outcome of a handler that returned None: the common case, one shared record (the batcher's COPY path)."""


class Unwritten(enum.Enum):
    """An attempt that ends here with nothing for the batcher to write."""

    PARKED = "parked"  # parked for a callback: the lease plane holds it, only receipt bookkeeping moves on
    STALE = "stale"  # known to be closed elsewhere (rescued, cancelled, timed out): reported stale
