"""Value types of the storage layer: raw JSON pass-through, lane ranges, attempt results, close codes."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import psycopg
from psycopg.adapt import Buffer, Dumper, Loader
from psycopg.pq import Format

JSONB_OID = 3802

if psycopg.pq.__impl__ == "python" and os.environ.get("AWA_FAST_ALLOW_PSYCOPG_PYTHON") != "1":
    raise ImportError(
        "awa-fast needs psycopg's C implementation, but only the pure-Python one is installed: "
        "`pip install 'psycopg[binary]'` (or 'psycopg[c]' with libpq headers); "
        "set AWA_FAST_ALLOW_PSYCOPG_PYTHON=1 to run slowly anyway")


class RawJson(bytes):
    """Already-encoded JSON bytes, sent to PostgreSQL as ``jsonb`` without re-encoding."""


class _RawJsonDumper(Dumper):
    oid = JSONB_OID

    def dump(self, obj: bytes) -> Buffer:
        return obj


class _RawJsonbTextLoader(Loader):
    def load(self, data: Buffer) -> bytes:
        return bytes(data)


class _RawJsonbBinaryLoader(Loader):
    format = Format.BINARY

    def load(self, data: Buffer) -> bytes:
        return bytes(data[1:])  # jsonb binary: version byte, then the text


psycopg.adapters.register_dumper(RawJson, _RawJsonDumper)


def use_raw_jsonb(conn: psycopg.Connection | psycopg.AsyncConnection) -> None:
    """Make ``jsonb`` results on ``conn`` come back as raw JSON bytes (decoded lazily)."""
    conn.adapters.register_loader("jsonb", _RawJsonbTextLoader)
    conn.adapters.register_loader("jsonb", _RawJsonbBinaryLoader)


@dataclass(frozen=True, slots=True)
class LaneRange:
    """A reserved lane sequence range in a ready slot (for a COPY of ready rows)."""

    lane_id: int
    first_seq: int
    ready_slot: int


@dataclass(frozen=True, slots=True)
class AttemptResult:
    """Result of one attempt write: ``status`` is ``ok``, ``stale`` or ``cancel``."""

    job_id: int
    run_lease: int
    status: str


# attempt_close outcome codes (sql/0002_storage_functions.sql)
CLOSE_COMPLETE = 1
CLOSE_FAIL = 2
CLOSE_CANCEL = 3
CLOSE_RETRY = 4
CLOSE_SNOOZE = 5


def as_jsonb(payloads: Sequence[bytes]) -> list[RawJson]:
    """Encoded JSON payloads as :class:`RawJson` (sent as jsonb; plain bytes would go as bytea)."""
    return [a if type(a) is RawJson else RawJson(a) for a in payloads]
