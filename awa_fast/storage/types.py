"""Value types of the storage layer: raw JSON pass-through, lane ranges, attempt results, close codes.

The close codes are defined once, as :class:`awa_fast.outcomes.CloseCode`; ``CLOSE_*`` are its members.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import psycopg
from psycopg.adapt import Buffer, Dumper, Loader
from psycopg.pq import Format

from awa_fast._impl import raw_jsonb
from awa_fast.outcomes import CloseCode

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
    """Binary ``jsonb``: the version byte, then the JSON text, cut by the codec's ``raw_jsonb``.

    Its ``load`` is the codec function itself, so psycopg calls C once per
    value instead of a Python method that slices and copies (a claim's
    fetchall of 100k rows: 311 against 381 ns a row; performance-log,
    py-drain).
    """

    format = Format.BINARY
    load = staticmethod(raw_jsonb)


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


# attempt_close outcome codes: the members of awa_fast.outcomes.CloseCode under their older names
CLOSE_COMPLETE = CloseCode.COMPLETE
CLOSE_FAIL = CloseCode.FAIL
CLOSE_CANCEL = CloseCode.CANCEL
CLOSE_RETRY = CloseCode.RETRY
CLOSE_SNOOZE = CloseCode.SNOOZE


def as_jsonb(payloads: Sequence[bytes]) -> list[RawJson]:
    """Encoded JSON payloads as :class:`RawJson` (sent as jsonb; plain bytes would go as bytea)."""
    return [a if type(a) is RawJson else RawJson(a) for a in payloads]
