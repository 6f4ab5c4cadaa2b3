"""awa-fast: a fast, trustworthy PostgreSQL job queue for Python.

Storage follows Awa's ADR-019 queue storage engine with the ADR-023 receipt
plane. Everything a user needs is importable from here: :class:`App`,
:class:`Job`, :class:`JobInfo`, :class:`QueueSettings`, :class:`DlqEntry`,
the handler outcomes (:class:`RetryAfter`, :class:`Snooze`, :class:`Cancel`,
:class:`WaitForCallback`), :class:`AttemptClosed` and the errors.
``__impl__`` says which implementation of the accelerated functions is live
(``c`` or ``python``; choose with ``AWA_FAST_IMPL``).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

from awa_fast import _impl
from awa_fast.app import App
from awa_fast.client import Client
from awa_fast.errors import (
    AwaFastError,
    ConfigError,
    DatabaseUnavailable,
    ImplementationUnavailable,
    InvalidName,
    JobNotCompleted,
    OutOfRange,
    PayloadError,
    SchemaNotMigrated,
    SchemaTooNew,
    TerminalError,
    UnknownJob,
)
from awa_fast.jobs import AttemptClosed, ClaimSnapshot, Job
from awa_fast.limits import Rate
from awa_fast.outcomes import Cancel, RetryAfter, Snooze, WaitForCallback  # what a handler may return
from awa_fast.records import JOB_STATES, TERMINAL_STATES, DlqEntry, JobInfo, QueueSettings
from awa_fast.unique import Unique, UniqueConflict  # issue 13: periodic and unique jobs

__impl__: str = _impl.IMPL
try:
    __version__: str = _version("awa-fast")  # the one version source: pyproject.toml
except PackageNotFoundError:  # running from a checkout that was never installed
    __version__ = "0+unknown"

__all__ = [
    "__impl__",
    "__version__",
    "App",
    "AttemptClosed",
    "AwaFastError",
    "Cancel",
    "ClaimSnapshot",
    "Client",
    "ConfigError",
    "DatabaseUnavailable",
    "DlqEntry",
    "ImplementationUnavailable",
    "InvalidName",
    "JOB_STATES",
    "Job",
    "JobInfo",
    "JobNotCompleted",
    "OutOfRange",
    "PayloadError",
    "QueueSettings",
    "Rate",
    "RetryAfter",
    "SchemaNotMigrated",
    "SchemaTooNew",
    "Snooze",
    "TERMINAL_STATES",
    "TerminalError",
    "Unique",
    "UniqueConflict",
    "UnknownJob",
    "WaitForCallback",
]
