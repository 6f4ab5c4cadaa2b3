"""One error root for awa-fast, with structured subclasses.

Job-control outcomes (retry after, snooze, cancel, wait for callback) are
values in :mod:`awa_fast.jobs`, not errors. SQLSTATEs are mapped to these
classes in the storage layer only.
"""

from __future__ import annotations


class AwaFastError(Exception):
    """Root of every error awa-fast raises on purpose."""


class ConfigError(AwaFastError, ValueError):
    """A setting, DSN or name is invalid; fix it and call again."""


class InvalidName(ConfigError):
    """A queue, kind or schema name is not allowed.

    Names are 1-100 characters of letters, digits and ``_ . : -``; schema
    names are lower-case SQL identifiers (``[a-z_][a-z0-9_]{0,62}``).
    """

    def __init__(self, what: str, value: object, rule: str) -> None:
        self.what = what
        self.value = value
        super().__init__(f"invalid {what} {value!r}: {rule}")


class PayloadError(AwaFastError, ValueError):
    """Job args or metadata cannot be stored as JSON; nothing was written.

    Raised for NaN/infinite floats, NUL bytes or lone surrogates in strings,
    non-string keys, unsupported types, nesting deeper than the limit, or an
    encoded payload larger than the limit.
    """

    def __init__(self, message: str, path: str = "$") -> None:
        self.path = path
        super().__init__(f"{message} at {path}; nothing was enqueued")


class OutOfRange(ConfigError):
    """A priority, attempt count or delay is outside its allowed range."""

    def __init__(self, what: str, value: object, low: object, high: object) -> None:
        self.what = what
        self.value = value
        super().__init__(f"{what}={value!r} is out of range; use {low}..{high}")


class DatabaseUnavailable(AwaFastError):
    """PostgreSQL could not be reached; check the DSN and that the server runs."""


class SchemaNotMigrated(AwaFastError):
    """The database schema is missing or older than this package.

    Run ``awa-fast migrate --schema NAME`` (with the same ``--dsn``); the
    message names the schema that was checked.
    """

    def __init__(self, schema: str, expected: int, found: int | None) -> None:
        self.schema = schema
        self.expected = expected
        self.found = found
        where = "is not installed" if not found else f"is at version {found}"
        super().__init__(
            f"schema {schema!r} {where}, this package needs version {expected}: "
            f"run `awa-fast migrate --schema {schema}` (with the same --dsn)"
        )


class SchemaTooNew(AwaFastError):
    """The database schema is newer than this package; upgrade awa-fast."""

    def __init__(self, schema: str, package: int, found: int) -> None:
        self.schema = schema
        self.package = package
        self.found = found
        super().__init__(
            f"schema {schema!r} is at version {found} but this awa-fast knows only "
            f"up to {package}: upgrade the awa-fast package; nothing was changed"
        )


class UnknownJob(AwaFastError, LookupError):
    """No job with that id exists in the schema (it may have been pruned)."""

    def __init__(self, job_id: int) -> None:
        self.job_id = job_id
        super().__init__(f"no job {job_id} (it never existed or its history was pruned)")


class JobNotCompleted(AwaFastError):
    """``App.result`` was asked for a job that has not completed (yet, or ever).

    ``state`` is where the job is now; wait for it with ``App.wait(job_id)``.
    """

    def __init__(self, job_id: int, state: str, error: str | None = None) -> None:
        self.job_id = job_id
        self.state = state
        self.error = error
        hint = ("wait for it with app.wait(job_id)" if state not in ("failed", "cancelled", "dlq")
                else "it will not complete unless it is retried (app.retry)")
        detail = f" ({error})" if error else ""
        super().__init__(f"job {job_id} is {state}{detail}, not completed: {hint}")


class TerminalError(AwaFastError):
    """Raise from a handler to fail the job at once, without retries."""


class ImplementationUnavailable(AwaFastError, ImportError):
    """``AWA_FAST_IMPL=c`` was asked for but the compiled extension is missing."""
