"""The storage layer: the only code in awa-fast that runs SQL.

It reads like a table of contents of the storage engine (ADR-019/023):
enqueue (``job_enqueue``, ``job_enqueue_many``, ``job_enqueue_copy``), the
claim path (``lane_claim``), completion (``receipt_complete``), attempt
transitions (``attempt_close``, ``attempt_heartbeat``,
``attempt_register_callback``, ``callback_resolve``, ``job_cancel``),
maintenance (``deferred_promote``, ``receipt_rescue_stale``,
``lease_rescue_expired``, ``ring_rotate``, ``ring_prune``,
``dlq_retention_prune``) and reads (``queue_depth_fast``,
``queue_counts_exact``, ``job_load``, ``dlq_list``).

Every method takes the psycopg connection to run on, so enqueue joins the
caller's own transaction. Names follow the named queries in
``awa_fast/sql/queries.sql``.
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
