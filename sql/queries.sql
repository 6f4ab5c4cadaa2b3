-- Named queries of the awa-fast storage layer, loaded once per schema by
-- awa_fast.storage.schema.named_queries(). Each query: a one-line intent
-- and what it relies on. Python methods in awa_fast.storage carry the same
-- names. Functions called here live in the numbered migrations.

-- name: job_enqueue
-- Enqueue one job in the caller's transaction (lane lock + one ready row + segment).
SELECT __SCHEMA__.job_enqueue(%s::text, %s::int, %s::text, %s::jsonb, %s::jsonb, %s::int, %s::timestamptz)

-- name: job_enqueue_in
-- Enqueue one job to run after a delay in seconds, measured by the database clock.
SELECT __SCHEMA__.job_enqueue(%s::text, %s::int, %s::text, %s::jsonb, %s::jsonb, %s::int, now() + make_interval(secs => %s::float8))

-- name: job_enqueue_many
-- Enqueue many jobs of one kind with one lane range (one statement).
SELECT __SCHEMA__.job_enqueue_many(%s::text, %s::int, %s::text, %s::jsonb[], %s::jsonb, %s::int)

-- name: lane_reserve
-- Lock a lane and reserve a sequence range for a COPY of ready rows.
SELECT lane_id, first_seq, ready_slot FROM __SCHEMA__.lane_reserve(%s::text, %s::int, %s::int, pg_backend_pid())

-- name: lane_claim
-- Claim up to N jobs of a queue for a stripe; returns claim snapshots in ClaimSnapshot field order,
-- then possibly the backlog marker (a row with job_id NULL; see claim_batch_v2).
SELECT job_id, run_lease, attempt, max_attempts, queue, kind, priority, args, metadata, ready_slot,
       lane_id, lane_seq, claim_slot, claim_id, created_at, errors, callback_result
FROM __SCHEMA__.claim_batch_v2(%s::text, %s::int, %s::int, %s::int)

-- name: receipt_guard
-- Lock the receipts of a completion batch; returns what in them is no longer open (job_id NULL: all of it).
SELECT claim_id, job_id, run_lease FROM __SCHEMA__.receipt_guard(%s::int[], %s::bigint[])

-- name: receipt_complete_rows
-- Complete a small batch in one statement (low-latency path); returns the stale attempts.
SELECT job_id, run_lease FROM __SCHEMA__.receipt_complete_rows_v2(%s::int[], %s::bigint[], %s::bigint[], %s::int[],
    %s::int[], %s::int[], %s::bigint[], %s::int[], %s::text[], %s::text[], %s::boolean[])

-- name: receipt_close_batches
-- Compact closure: one row closes every attempt of a receipt (all completed in one flush).
INSERT INTO __SCHEMA__.lease_claim_closure_batches (claim_slot, claim_id, outcome)
SELECT s, c, 1 FROM unnest(%s::int[], %s::bigint[]) AS u(s, c)

-- name: attempts_completed
-- Which of these attempts have a completed done row under their own run_lease (a replayed flush's check).
SELECT job_id, run_lease FROM __SCHEMA__.done_entries
WHERE job_id = ANY(%s::bigint[]) AND state = 1

-- name: attempt_state_delete
-- Drop the mutable state of attempts that just ended (primary key probes).
DELETE FROM __SCHEMA__.attempt_state a
USING unnest(%s::bigint[], %s::int[]) AS u(j, l)
WHERE a.job_id = u.j AND a.run_lease = u.l

-- name: attempt_close
-- Close attempts with explicit outcomes (retry, snooze, fail, cancel, lease-backed completion).
SELECT job_id, run_lease, status FROM __SCHEMA__.attempt_close(%s::bigint[], %s::int[], %s::int[], %s::bigint[], %s::int[], %s::float8[], %s::text[])

-- name: attempt_heartbeat
-- Heartbeat/progress for a batch of attempts; lazily creates attempt_state.
SELECT job_id, run_lease, status FROM __SCHEMA__.attempt_heartbeat(%s::bigint[], %s::int[], %s::int[], %s::bigint[], %s::jsonb[])

-- name: attempt_register_callback
-- Materialize an attempt into the lease plane with a callback token.
SELECT __SCHEMA__.attempt_register_callback(%s::bigint, %s::int, %s::int, %s::bigint, %s::float8)

-- name: callback_resolve
-- Resolve a parked callback by token.
SELECT __SCHEMA__.callback_resolve(%s::uuid, %s::text, %s::jsonb, %s::text)

-- name: job_cancel
-- Cancel a job wherever it lives.
SELECT __SCHEMA__.job_cancel(%s::bigint)

-- name: job_load
-- Find a job wherever it lives (JSON object or NULL).
SELECT __SCHEMA__.job_load(%s::bigint)

-- name: deferred_promote
-- Promote due deferred jobs into ready (index deferred_jobs_due).
SELECT __SCHEMA__.deferred_promote(%s::int)

-- name: receipt_rescue_stale
-- Rescue receipt-backed attempts past deadline or heartbeat timeout.
SELECT __SCHEMA__.receipt_rescue_stale(%s::int)

-- name: lease_rescue_expired
-- Rescue lease-backed attempts whose callback timed out.
SELECT __SCHEMA__.lease_rescue_expired(%s::int)

-- name: attempt_state_sweep
-- Drop attempt_state rows of attempts that are no longer open.
SELECT __SCHEMA__.attempt_state_sweep()

-- name: ring_rotate
-- Rotate a ring to its next slot if that slot is empty; NULL when full.
SELECT __SCHEMA__.ring_rotate(%s::text)

-- name: ring_prune
-- Prune one sealed ring slot by TRUNCATE behind its gates (short lock timeout).
SELECT __SCHEMA__.ring_prune(%s::text, %s::int, %s::text)

-- name: ring_state
-- Current slot, generation and slot count of every ring.
SELECT DISTINCT ON (r.ring) r.ring, r.slot, r.generation, c.slot_count, r.rotated_at
FROM __SCHEMA__.ring_rotations r JOIN __SCHEMA__.ring_config c ON c.ring = r.ring
ORDER BY r.ring, r.generation DESC

-- name: dlq_retention_prune
-- Delete DLQ entries past their queue's retention.
SELECT __SCHEMA__.dlq_retention_prune(%s::int)

-- name: dlq_list
-- List DLQ entries of a queue (or all), newest first.
SELECT job_id, queue, kind, attempt, max_attempts, reason, failed_at, args
FROM __SCHEMA__.dlq_entries
WHERE (%(queue)s::text IS NULL OR queue = %(queue)s)
ORDER BY failed_at DESC, job_id DESC
LIMIT %(limit)s

-- name: dlq_retry
-- Move DLQ entries back to ready.
SELECT __SCHEMA__.dlq_retry(%s::bigint[])

-- name: dlq_retry_queue
-- Move every DLQ entry of a queue back to ready.
SELECT __SCHEMA__.dlq_retry(ARRAY(SELECT job_id FROM __SCHEMA__.dlq_entries WHERE queue = %s::text))

-- name: dlq_purge
-- Delete DLQ entries by id.
DELETE FROM __SCHEMA__.dlq_entries WHERE job_id = ANY (%s::bigint[])

-- name: dlq_purge_queue
-- Delete every DLQ entry of a queue.
DELETE FROM __SCHEMA__.dlq_entries WHERE queue = %s

-- name: queue_depth_fast
-- Per-queue depth from lane heads (no scan).
SELECT queue, depth FROM __SCHEMA__.queue_depth_fast()

-- name: queue_counts_exact
-- Exact per-queue counts by state (scans live rings).
SELECT queue, state, count FROM __SCHEMA__.queue_counts_exact()

-- name: queue_ensure
-- Register a queue (idempotent).
SELECT __SCHEMA__.queue_ensure(%s::text)

-- name: queue_pause
-- Pause or resume a queue's claims.
UPDATE __SCHEMA__.queue_meta SET paused = %s WHERE queue = %s

-- name: queue_configure
-- Change a queue's settings (NULL keeps the current value).
UPDATE __SCHEMA__.queue_meta SET
    stripes = COALESCE(%(stripes)s, stripes),
    enqueue_shards = COALESCE(%(enqueue_shards)s, enqueue_shards),
    dlq_enabled = COALESCE(%(dlq_enabled)s, dlq_enabled),
    deadline = CASE WHEN %(deadline_set)s THEN make_interval(secs => %(deadline)s) ELSE deadline END,
    heartbeat_timeout = COALESCE(make_interval(secs => %(heartbeat_timeout)s), heartbeat_timeout),
    aging_interval = COALESCE(make_interval(secs => %(aging_interval)s), aging_interval),
    dlq_retention = COALESCE(make_interval(secs => %(dlq_retention)s), dlq_retention)
WHERE queue = %(queue)s

-- name: queue_list
-- Queue settings.
SELECT queue, paused, stripes, enqueue_shards, dlq_enabled,
       extract(epoch FROM deadline)::float8, extract(epoch FROM heartbeat_timeout)::float8
FROM __SCHEMA__.queue_meta ORDER BY queue

-- name: dead_tuples
-- Dead tuples summed over the schema's tables (pg_stat_user_tables).
SELECT COALESCE(sum(n_dead_tup), 0)::bigint FROM pg_stat_user_tables WHERE schemaname = %s

-- name: deferred_run_now
-- Make a scheduled, retryable or snoozed job due now (admin retry).
UPDATE __SCHEMA__.deferred_jobs SET run_at = now() WHERE job_id = %s::bigint

-- name: leader_info
-- The backend holding this schema's maintenance leader lock, if any.
SELECT a.pid, a.application_name, a.client_addr::text, a.backend_start
FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2 AND l.objid = 0
  AND l.classid::bigint = (__SCHEMA__.lock_key('leader')::bigint & 4294967295)

-- name: runtime_grant
-- Grant a runtime role DML and EXECUTE (no DDL, no TRUNCATE) on this schema.
SELECT __SCHEMA__.runtime_grant(%s::text)

-- name: queue_terminal_counts
-- Completed/failed/cancelled per queue: live done_entries plus the rollups prune folded in.
SELECT queue, state, sum(n)::bigint FROM (
    SELECT queue, state, count(*) AS n FROM __SCHEMA__.done_entries GROUP BY 1, 2
    UNION ALL SELECT queue, state, count FROM __SCHEMA__.queue_terminal_rollups) t
GROUP BY 1, 2

-- name: receipt_lock
-- Take the per-receipt advisory locks of a batch in ascending claim_id (the global lock order).
SELECT count(pg_advisory_xact_lock(__SCHEMA__.lock_key('claim'), (x.cid %% 2147483647)::int))
FROM (SELECT DISTINCT cid FROM unnest(%s::bigint[]) AS cid ORDER BY cid) x

-- name: ring_slot_empty
-- Does a ring slot hold no live rows? (maintenance skips rotating an empty current slot)
SELECT __SCHEMA__.ring_slot_empty(%s::text, %s::int)

-- ---------------------------------------------------------------------------
-- Periodic and unique jobs (migration 0005; awa_fast/periodic.py, awa_fast/unique.py)
-- ---------------------------------------------------------------------------

-- name: job_enqueue_unique
-- Enqueue one unique job: (job_id, inserted); inserted false names the holder and wrote nothing.
SELECT job_id, inserted FROM __SCHEMA__.job_enqueue_unique(%s::bytea, %s::float8, %s::int, %s::text, %s::int,
    %s::text, %s::jsonb, %s::jsonb, %s::int, %s::timestamptz, %s::float8)

-- name: job_enqueue_unique_many
-- Enqueue many unique jobs of one kind (keys distinct within the call): (job_id, inserted) per row, in order.
SELECT job_id, inserted FROM __SCHEMA__.job_enqueue_unique_many(%s::bytea[], %s::float8, %s::int, %s::text,
    %s::int, %s::text, %s::jsonb[], %s::jsonb, %s::int)

-- name: unique_sweep
-- One batch of the stale-key sweep, in key order after a position (NULL: from the start).
SELECT swept, scanned, last_key, last_bucket FROM __SCHEMA__.unique_sweep(%s::bytea, %s::bigint, %s::int)

-- name: unique_key_holder
-- The job holding a key now (any state), for admin and tests.
SELECT job_id, bucket, states, expires_at FROM __SCHEMA__.unique_keys WHERE key = %s::bytea ORDER BY bucket DESC

-- name: schedule_upsert
-- Declare a schedule from code: insert, or update its definition (a changed cron re-anchors nothing:
-- the evaluator continues from the newest fire). Re-enables a schedule that came back into code.
INSERT INTO __SCHEMA__.schedules AS s (name, cron, timezone, kind, args, metadata, queue, priority, max_attempts,
    missed, catch_up_cap, unique_key, unique_period, unique_states, source)
VALUES (%(name)s, %(cron)s, %(timezone)s, %(kind)s, %(args)s::jsonb, %(metadata)s::jsonb, %(queue)s,
    %(priority)s, %(max_attempts)s, %(missed)s, %(catch_up_cap)s, %(unique_key)s::bytea, %(unique_period)s,
    %(unique_states)s, %(source)s)
ON CONFLICT (name) DO UPDATE SET cron = excluded.cron, timezone = excluded.timezone, kind = excluded.kind,
    args = excluded.args, metadata = excluded.metadata, queue = excluded.queue, priority = excluded.priority,
    max_attempts = excluded.max_attempts, missed = excluded.missed, catch_up_cap = excluded.catch_up_cap,
    unique_key = excluded.unique_key, unique_period = excluded.unique_period,
    unique_states = excluded.unique_states, source = excluded.source, enabled = true,
    anchor_at = CASE WHEN s.enabled THEN s.anchor_at ELSE now() END, synced_at = now()
WHERE (s.cron, s.timezone, s.kind, s.args, s.metadata, s.queue, s.priority, s.max_attempts, s.missed,
       s.catch_up_cap, s.unique_key, s.unique_period, s.unique_states, s.source, s.enabled)
   IS DISTINCT FROM (excluded.cron, excluded.timezone, excluded.kind, excluded.args, excluded.metadata,
       excluded.queue, excluded.priority, excluded.max_attempts, excluded.missed, excluded.catch_up_cap,
       excluded.unique_key, excluded.unique_period, excluded.unique_states, excluded.source, true)
RETURNING (xmax = 0) AS created

-- name: schedule_disable_missing
-- Disable (never delete) the schedules of a source that its code no longer declares; returns their names.
UPDATE __SCHEMA__.schedules SET enabled = false, synced_at = now()
WHERE source = %s AND enabled AND NOT (name = ANY (%s::text[]))
RETURNING name

-- name: schedule_due_list
-- Enabled, unpaused schedules with their newest scheduled fire, and the database clock.
SELECT now(), s.name, s.cron, s.timezone, s.missed, s.catch_up_cap, s.anchor_at,
       (SELECT max(f.tick) FROM __SCHEMA__.schedule_fires f WHERE f.schedule = s.name AND NOT f.manual)
FROM __SCHEMA__.schedules s WHERE s.enabled AND NOT s.paused ORDER BY s.name

-- name: schedule_fire
-- Fire one tick of a schedule (ledger row + enqueue in this transaction): (outcome, job_id).
SELECT outcome, job_id FROM __SCHEMA__.schedule_fire(%s::text, %s::timestamptz, %s::timestamptz, %s::int,
    %s::text, %s::text, %s::boolean)

-- name: schedule_list
-- Every schedule with its newest fire (any kind) for `awa-fast cron list`, and the database clock.
SELECT now(), s.name, s.cron, s.timezone, s.kind, s.queue, s.missed, s.enabled, s.paused, s.source, s.anchor_at,
       (SELECT max(f.tick) FROM __SCHEMA__.schedule_fires f WHERE f.schedule = s.name AND NOT f.manual),
       (SELECT max(f.fired_at) FROM __SCHEMA__.schedule_fires f WHERE f.schedule = s.name)
FROM __SCHEMA__.schedules s ORDER BY s.name

-- name: schedule_pause
-- Pause or resume a schedule (resume re-anchors at now: ticks missed while paused never fire).
UPDATE __SCHEMA__.schedules SET paused = %(paused)s,
    anchor_at = CASE WHEN paused AND NOT %(paused)s THEN now() ELSE anchor_at END
WHERE name = %(name)s

-- name: schedule_fires_list
-- The fire ledger of a schedule, oldest first.
SELECT tick, prev_tick, coalesced, manual, job_id, held_by, fired_at
FROM __SCHEMA__.schedule_fires WHERE schedule = %s ORDER BY tick

-- name: schedule_fires_prune
-- Drop fires older than a retention in one batch (never a schedule's newest scheduled fire).
SELECT __SCHEMA__.schedule_fires_prune(make_interval(secs => %s::float8), %s::int)

-- name: db_now
-- The database clock (periodic evaluation compares ticks against it, never the client's clock).
SELECT now()
