"""The storage layer: the only code in awa-fast that runs SQL.

This package only re-exports; the table of contents of the engine (every
named query, grouped by plane) is :class:`awa_fast.storage.engine.Storage`.
"""

from awa_fast.storage.connection import clean_text, close_quietly, connect, redact_dsn
from awa_fast.storage.copy_rows import encode_done_result_rows
from awa_fast.storage.engine import DEFAULT_DEADLINE_S, Storage
from awa_fast.storage.types import (
    CLOSE_CANCEL,
    CLOSE_COMPLETE,
    CLOSE_FAIL,
    CLOSE_RETRY,
    CLOSE_SNOOZE,
    JSONB_OID,
    AttemptResult,
    LaneRange,
    RawJson,
    use_raw_jsonb,
)

__all__ = [
    "CLOSE_CANCEL", "CLOSE_COMPLETE", "CLOSE_FAIL", "CLOSE_RETRY", "CLOSE_SNOOZE", "DEFAULT_DEADLINE_S", "JSONB_OID",
    "AttemptResult", "LaneRange", "RawJson", "Storage", "clean_text", "close_quietly", "connect",
    "encode_done_result_rows", "redact_dsn", "use_raw_jsonb",
]
