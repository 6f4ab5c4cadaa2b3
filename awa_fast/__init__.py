"""awa-fast: a fast, trustworthy PostgreSQL job queue for Python.

Storage follows Awa's ADR-019 queue storage engine with the ADR-023 receipt
plane. ``__impl__`` says which implementation of the accelerated functions
is live (``c`` or ``python``; choose with ``AWA_FAST_IMPL``).
"""

from __future__ import annotations

from awa_fast import _impl
from awa_fast.client import Client
from awa_fast.errors import (
    AwaFastError,
    ConfigError,
    DatabaseUnavailable,
    InvalidName,
    LeaseLost,
    OutOfRange,
    PayloadError,
    SchemaNotMigrated,
    SchemaTooNew,
    TerminalError,
    UnknownJob,
)
from awa_fast.jobs import AttemptClosed, Cancel, ClaimSnapshot, RetryAfter, Snooze, WaitForCallback
from awa_fast.unique import Unique, UniqueConflict  # issue 13: periodic and unique jobs

__impl__: str = _impl.IMPL
__version__ = "0.1.0"

__all__ = [
    "__impl__",
    "AttemptClosed",
    "AwaFastError",
    "Cancel",
    "ClaimSnapshot",
    "Client",
    "ConfigError",
    "DatabaseUnavailable",
    "InvalidName",
    "LeaseLost",
    "OutOfRange",
    "PayloadError",
    "RetryAfter",
    "SchemaNotMigrated",
    "SchemaTooNew",
    "Snooze",
    "TerminalError",
    "Unique",
    "UniqueConflict",
    "UnknownJob",
    "WaitForCallback",
]
