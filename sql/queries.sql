-- Named queries of the awa-fast storage layer, loaded once per schema by
-- awa_fast.storage.schema.named_queries(). Each query: a one-line intent
-- and what it relies on. Python methods in awa_fast.storage carry the same
-- names. Functions called here live in the numbered migrations.

-- name: job_enqueue
-- Enqueue one job in the caller's transaction: one function frame for the lane lock, the ready row,
-- its segment and the NOTIFY decision, which reads the claim ring only where the lane's cursor and
-- receipt mark cannot settle it (job_enqueue_v3, 0025; job_enqueue_v2 and job_enqueue stay for the
-- previous runtimes).
SELECT __SCHEMA__.job_enqueue_v3(%s::text, %s::int, %s::text, %s::jsonb, %s::jsonb, %s::int, %s::timestamptz)

-- name: job_enqueue_in
-- Enqueue one job to run after a delay in seconds, measured by the database clock (job_enqueue_v3).
SELECT __SCHEMA__.job_enqueue_v3(%s::text, %s::int, %s::text, %s::jsonb, %s::jsonb, %s::int, now() + make_interval(secs => %s::float8))

-- name: job_enqueue_many
-- Enqueue many jobs of one kind with one lane range (one statement).
SELECT __SCHEMA__.job_enqueue_many(%s::text, %s::int, %s::text, %s::jsonb[], %s::jsonb, %s::int)

-- name: lane_reserve
-- Lock a lane and reserve a sequence range for a COPY of ready rows; the shard tried first is
-- (backend pid + the chunk's number in its call modulo the lanes one call may fill) modulo the
-- queue's shards (see lane_lock_for_enqueue). A call fills at most COPY_LANES lanes and at most half
-- the queue's shards (at least 1): one call never holds the lock of every shard, which would make
-- another producer's search wait (and two transactions that bulk-enqueue to two queues in opposite
-- orders deadlock).
SELECT lane_id, first_seq, ready_slot FROM __SCHEMA__.lane_reserve(%s::text, %s::int, %s::int,
    pg_backend_pid() + %s::int %% least(%s::int, greatest(1, COALESCE(
        (SELECT m.enqueue_shards FROM __SCHEMA__.queue_meta m WHERE m.queue = %s::text), 8) / 2)))

-- name: enqueue_savepoint
-- A bulk enqueue inside the caller's transaction: everything it writes after this can be undone alone.
SAVEPOINT awa_fast_enqueue

-- name: enqueue_savepoint_rollback
-- A bulk enqueue failed (a payload it was still checking, a COPY error): undo what it wrote, keep the caller's work.
ROLLBACK TO SAVEPOINT awa_fast_enqueue

-- name: enqueue_savepoint_release
-- End the bulk enqueue's savepoint (its rows stay in the caller's transaction).
RELEASE SAVEPOINT awa_fast_enqueue

-- name: lane_claim
-- Claim up to N jobs of a queue for a stripe; returns claim snapshots in ClaimSnapshot field order
-- (progress last: carried from an earlier attempt, see claim_batch_v3; queue, priority, ready_slot,
-- lane_id, claim_slot and claim_id on a receipt's first row only, NULL on the rest: see claim_batch_v4),
-- then possibly the backlog marker (a row with job_id NULL; see claim_batch_v2).
SELECT job_id, run_lease, attempt, max_attempts, queue, kind, priority, args, metadata, ready_slot,
       lane_id, lane_seq, claim_slot, claim_id, created_at, errors, callback_result, progress
FROM __SCHEMA__.claim_batch_v4(%s::text, %s::int, %s::int, %s::int)

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

-- name: receipt_done_compact
-- Compact done rows (0015): one per receipt of the flush, naming the attempts of it this flush completes
-- (per-attempt arrays: claim_slot, claim_id, job_id, run_lease); slot, lane and range from the receipt
-- (lease_claims primary key, locked by receipt_guard; one probe per receipt: LATERAL with LIMIT 1, never a
-- hash join over every receipt of the ring), queue from queue_lanes primary key. Returns how many
-- attempts each row completes (the caller checks the sum).
INSERT INTO __SCHEMA__.done_receipts (ready_slot, lane_id, claim_id, first_seq, last_seq, queue, job_ids, run_leases)
SELECT c.ready_slot, c.lane_id, c.claim_id, c.first_seq, c.last_seq, ql.queue, g.js, g.ls
FROM (SELECT u.s, u.c, array_agg(u.j ORDER BY u.o) AS js, array_agg(u.l ORDER BY u.o) AS ls
      FROM unnest(%s::int[], %s::bigint[], %s::bigint[], %s::int[]) WITH ORDINALITY AS u(s, c, j, l, o)
      GROUP BY u.s, u.c) g
CROSS JOIN LATERAL (SELECT x.ready_slot, x.lane_id, x.claim_id, x.first_seq, x.last_seq
                    FROM __SCHEMA__.lease_claims x WHERE x.claim_slot = g.s AND x.claim_id = g.c LIMIT 1) c
JOIN __SCHEMA__.queue_lanes ql ON ql.lane_id = c.lane_id
RETURNING cardinality(job_ids)

-- name: receipt_done_whole
-- Compact done rows for receipts of which the flush holds every attempt, from the receipt's own attempt
-- arrays (0020): per receipt (claim_slot, claim_id, attempts held); returns the receipts written.
SELECT __SCHEMA__.receipt_done_whole(%s::int[], %s::bigint[], %s::int[])

-- name: attempts_completed
-- Which of these attempts have a completed done row under their own run_lease (a replayed flush's check):
-- per-job rows by done_entries_job, compact rows (0015) by the attempts' lane positions (done_receipt_at).
SELECT job_id, run_lease FROM __SCHEMA__.done_entries
WHERE job_id = ANY(%(jobs)s::bigint[]) AND state = 1
UNION ALL
SELECT u.j, u.l FROM unnest(%(jobs)s::bigint[], %(leases)s::int[], %(slots)s::int[], %(lanes)s::int[],
                            %(seqs)s::bigint[]) AS u(j, l, s, n, q)
WHERE __SCHEMA__.done_receipt_at(u.s, u.n, u.q, u.j, u.l) IS NOT NULL

-- name: attempt_state_delete
-- Drop the mutable state of attempts that just ended (primary key probes).
DELETE FROM __SCHEMA__.attempt_state a
USING unnest(%s::bigint[], %s::int[]) AS u(j, l)
WHERE a.job_id = u.j AND a.run_lease = u.l

-- name: attempt_close
-- Close attempts with explicit outcomes (retry, snooze, fail, cancel, lease-backed completion).
-- The outcome codes are awa_fast.outcomes.CloseCode (awa_fast/outcomes.py).
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
-- Cancel a job wherever it lives (a job waiting on its concurrency key too; migration 0012).
SELECT __SCHEMA__.job_cancel_keyed(%s::bigint)

-- name: job_load
-- Find a job wherever it lives (JSON object or NULL), with its progress and result (waiting on its
-- concurrency key too: job_load_keyed, migration 0012; completed by a compact done row too: job_load_keyed_v2,
-- migration 0015).
SELECT __SCHEMA__.job_load_keyed_v2(%s::bigint)

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
-- Trims the rotation ledger by TRUNCATE of a span child (short lock timeout).
SELECT __SCHEMA__.ring_rotate_v2(%s::text, %s::text)

-- name: ring_prune
-- Prune one sealed ring slot by TRUNCATE behind its gates (short lock timeout).
SELECT __SCHEMA__.ring_prune_v3(%s::text, %s::int, %s::text, 0)

-- name: ring_state
-- Current slot, generation and slot count of every ring.
-- Index: the ledger leaves' primary keys (ring, generation), newest row per ring.
SELECT c.ring, r.slot, r.generation, c.slot_count, r.rotated_at
FROM __SCHEMA__.ring_config c
CROSS JOIN LATERAL (SELECT x.slot, x.generation, x.rotated_at FROM __SCHEMA__.ring_rotations x
                    WHERE x.ring = c.ring ORDER BY x.generation DESC LIMIT 1) r
ORDER BY c.ring

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
-- Exact per-queue counts by state (scans live rings); jobs waiting on their concurrency key count as
-- available (due) or scheduled, as job_load_keyed shows them.
SELECT queue, state, sum(count)::bigint FROM (
    SELECT c.queue, c.state, c.count FROM __SCHEMA__.queue_counts_exact_v2() c
    UNION ALL
    SELECT w.queue, CASE WHEN w.run_at > now() THEN 'scheduled' ELSE 'available' END, count(*)
    FROM __SCHEMA__.key_waiting w GROUP BY 1, 2) x
GROUP BY queue, state

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
    dlq_retention = COALESCE(make_interval(secs => %(dlq_retention)s), dlq_retention),
    history_retention = COALESCE(make_interval(secs => %(history_retention)s), history_retention)
WHERE queue = %(queue)s

-- name: queue_list
-- Queue settings.
SELECT queue, paused, stripes, enqueue_shards, dlq_enabled,
       extract(epoch FROM deadline)::float8, extract(epoch FROM heartbeat_timeout)::float8,
       extract(epoch FROM history_retention)::float8
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
-- Completed/failed/cancelled per queue: live done_entries and compact done rows (0015) plus the rollups
-- prune folded in.
SELECT queue, state, sum(n)::bigint FROM (
    SELECT queue, state, count(*) AS n FROM __SCHEMA__.done_entries GROUP BY 1, 2
    UNION ALL SELECT queue, 1::smallint, sum(cardinality(job_ids)) FROM __SCHEMA__.done_receipts GROUP BY 1
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
-- The public API's reads and admin writes (awa_fast.App, the CLI's job/queue/dlq
-- commands). Cold paths: nothing here runs on claim or completion.
-- ---------------------------------------------------------------------------

-- name: job_load_many
-- Jobs by id wherever they live (job_load_keyed each: job_load_v2 or waiting on a key; with the stored result and the carried progress), in
-- the order given, with the flushed progress of an open attempt (attempt_state primary key (job_id, run_lease)).
SELECT u.job_id, j.v, COALESCE(s.progress, j.v->'progress')
FROM unnest(%s::bigint[]) WITH ORDINALITY AS u(job_id, n)
CROSS JOIN LATERAL (SELECT __SCHEMA__.job_load_keyed_v2(u.job_id) AS v) j
LEFT JOIN __SCHEMA__.attempt_state s
    ON s.job_id = u.job_id AND s.run_lease = (j.v->>'run_lease')::int
   AND j.v->>'state' IN ('running', 'waiting_external')
ORDER BY u.n

-- name: job_list_ids
-- Candidate job ids, newest id first, below a keyset cursor, with optional queue/kind filters; one branch
-- per plane, each an index scan in job id order (done_entries_job, the primary keys of deferred_jobs and
-- dlq_entries, leases_job, key_waiting_job: a keyed job waiting for its key's room). Ready rows in two
-- branches (0019): a lane-born row (job_id = lane_id << 40 | lane_seq) by each ready slot's primary key
-- backwards, whose (lane_id, lane_seq) order is its job id order, one slot at a time (run-time pruning);
-- any other row (an id from job_id_seq, or an older id back in ready) by the partial ready_entries_job. Both lane-branch
-- conditions are written for the planner's estimates, so that it reads the primary key backwards to the
-- limit instead of sorting the whole slot: a row comparison is estimated by its first column, so the
-- cursor is `<= (lane, seq - 1)` (not `< (lane, seq)`, which is `lane_id < lane`: nothing, in a one-lane
-- queue); an equality of two expressions is estimated to keep 1 row in 200, the COALESCE (the columns
-- are NOT NULL, so it changes no result) 1 in 2, closer to a ready ring that is nearly all lane-born.
-- The caller resolves states with job_load_many.
SELECT job_id FROM (
    (SELECT b.job_id FROM __SCHEMA__.ring_config rc
     CROSS JOIN generate_series(0, rc.slot_count - 1) AS s(slot)
     CROSS JOIN LATERAL (
         SELECT e.job_id FROM __SCHEMA__.ready_entries e
         WHERE e.ready_slot = s.slot AND COALESCE(e.job_id = ((e.lane_id::bigint << 40) | e.lane_seq), false)
           AND (%(before)s::bigint IS NULL
                OR (e.lane_id, e.lane_seq) <= ((%(before)s::bigint >> 40)::int, (%(before)s::bigint & 1099511627775) - 1))
           AND (%(kind)s::text IS NULL OR e.kind = %(kind)s)
           AND (%(queue)s::text IS NULL OR e.lane_id IN (SELECT l.lane_id FROM __SCHEMA__.queue_lanes l
                                                        WHERE l.queue = %(queue)s))
         ORDER BY e.lane_id DESC, e.lane_seq DESC LIMIT %(limit)s) b
     WHERE %(ready)s AND rc.ring = 'ready')
    UNION
    (SELECT e.job_id FROM __SCHEMA__.ready_entries e
     WHERE %(ready)s AND e.job_id <> ((e.lane_id::bigint << 40) | e.lane_seq)
       AND (%(before)s::bigint IS NULL OR e.job_id < %(before)s)
       AND (%(kind)s::text IS NULL OR e.kind = %(kind)s)
       AND (%(queue)s::text IS NULL OR e.lane_id IN (SELECT l.lane_id FROM __SCHEMA__.queue_lanes l
                                                    WHERE l.queue = %(queue)s))
     ORDER BY e.job_id DESC LIMIT %(limit)s)
    UNION
    (SELECT d.job_id FROM __SCHEMA__.done_entries d
     WHERE %(done)s AND (%(before)s::bigint IS NULL OR d.job_id < %(before)s)
       AND (%(kind)s::text IS NULL OR d.kind = %(kind)s) AND (%(queue)s::text IS NULL OR d.queue = %(queue)s)
     ORDER BY d.job_id DESC LIMIT %(limit)s)
    UNION
    (SELECT x.job_id FROM __SCHEMA__.deferred_jobs x
     WHERE %(deferred)s AND (%(before)s::bigint IS NULL OR x.job_id < %(before)s)
       AND (%(kind)s::text IS NULL OR x.kind = %(kind)s) AND (%(queue)s::text IS NULL OR x.queue = %(queue)s)
     ORDER BY x.job_id DESC LIMIT %(limit)s)
    UNION
    (SELECT x.job_id FROM __SCHEMA__.dlq_entries x
     WHERE %(dlq)s AND (%(before)s::bigint IS NULL OR x.job_id < %(before)s)
       AND (%(kind)s::text IS NULL OR x.kind = %(kind)s) AND (%(queue)s::text IS NULL OR x.queue = %(queue)s)
     ORDER BY x.job_id DESC LIMIT %(limit)s)
    UNION
    (SELECT l.job_id FROM __SCHEMA__.leases l
     WHERE %(leases)s AND (%(before)s::bigint IS NULL OR l.job_id < %(before)s)
       AND (%(kind)s::text IS NULL OR l.kind = %(kind)s) AND (%(queue)s::text IS NULL OR l.queue = %(queue)s)
     ORDER BY l.job_id DESC LIMIT %(limit)s)
    UNION
    (SELECT w.job_id FROM __SCHEMA__.key_waiting w
     WHERE %(waiting)s AND (%(before)s::bigint IS NULL OR w.job_id < %(before)s)
       AND (%(kind)s::text IS NULL OR w.kind = %(kind)s) AND (%(queue)s::text IS NULL OR w.queue = %(queue)s)
     ORDER BY w.job_id DESC LIMIT %(limit)s)
) ids ORDER BY job_id DESC LIMIT %(limit)s

-- name: job_retry
-- Retry one job now: a DLQ entry moves back to ready (dlq_retry), a scheduled/retryable/snoozed job
-- becomes due (deferred_jobs primary key); NULL when it is neither.
WITH d AS (SELECT __SCHEMA__.dlq_retry(ARRAY[%(job_id)s::bigint]) AS job_id),
     u AS (UPDATE __SCHEMA__.deferred_jobs SET run_at = now() WHERE job_id = %(job_id)s::bigint RETURNING job_id)
SELECT CASE WHEN EXISTS (SELECT 1 FROM d) THEN 'retried' WHEN EXISTS (SELECT 1 FROM u) THEN 'due_now' END

-- name: dlq_select
-- DLQ entries matching ids and/or a queue (what a retry or purge would touch), newest first
-- (dlq_entries primary key, or dlq_entries_queue).
SELECT job_id, queue, kind, attempt, max_attempts, reason, failed_at, args
FROM __SCHEMA__.dlq_entries
WHERE (%(ids)s::bigint[] IS NULL OR job_id = ANY (%(ids)s::bigint[]))
  AND (%(queue)s::text IS NULL OR queue = %(queue)s)
ORDER BY failed_at DESC, job_id DESC
LIMIT %(limit)s

-- name: dlq_retry_where
-- Move the DLQ entries matching ids and/or a queue back to ready; returns their ids
-- (dlq_entries primary key, or dlq_entries_queue).
SELECT __SCHEMA__.dlq_retry(ARRAY(
    SELECT job_id FROM __SCHEMA__.dlq_entries
    WHERE (%(ids)s::bigint[] IS NULL OR job_id = ANY (%(ids)s::bigint[]))
      AND (%(queue)s::text IS NULL OR queue = %(queue)s)))

-- name: dlq_purge_where
-- Delete the DLQ entries matching ids and/or a queue (both filters hold); returns their ids
-- (dlq_entries primary key, or dlq_entries_queue).
DELETE FROM __SCHEMA__.dlq_entries
WHERE (%(ids)s::bigint[] IS NULL OR job_id = ANY (%(ids)s::bigint[]))
  AND (%(queue)s::text IS NULL OR queue = %(queue)s)
RETURNING job_id

-- name: queue_settings
-- Every setting of one queue (or of all), durations in seconds (queue_meta primary key).
SELECT queue, paused, stripes, enqueue_shards, dlq_enabled,
       extract(epoch FROM deadline)::float8, extract(epoch FROM heartbeat_timeout)::float8,
       extract(epoch FROM aging_interval)::float8, extract(epoch FROM dlq_retention)::float8, created_at,
       extract(epoch FROM history_retention)::float8,
       (SELECT l.key_max_running FROM __SCHEMA__.queue_limits l WHERE l.queue = m.queue)
FROM __SCHEMA__.queue_meta m
WHERE %(queue)s::text IS NULL OR queue = %(queue)s
ORDER BY queue

-- name: receipt_complete_results
-- Complete attempts whose handler returned a value, storing it as done_entries.result; returns the stale ones.
SELECT job_id, run_lease FROM __SCHEMA__.receipt_complete_results(%s::int[], %s::bigint[], %s::bigint[], %s::int[],
    %s::int[], %s::int[], %s::bigint[], %s::int[], %s::text[], %s::text[], %s::boolean[], %s::jsonb[])

-- name: ring_prune_retained
-- Prune a sealed slot like ring_prune, but keep a ready slot until it has been quiet for the retention.
SELECT __SCHEMA__.ring_prune_v3(%s::text, %s::int, %s::text, %s::float8)

-- name: ready_retention
-- History retention of the shared ready ring: the longest of the queues' (1 hour when no queue is known).
SELECT extract(epoch FROM COALESCE(max(history_retention), interval '1 hour'))::float8 FROM __SCHEMA__.queue_meta
-- Queries of the in-process worker (awa_fast.worker), awa_fast.testing and the
-- rolling-upgrade check (awa_fast.storage.compat).

-- name: queue_work_exists
-- Is any job of these queues available (a ready row past its lane's effective cursor and not tombstoned, or a
-- deferred job that is due) or running (an open receipt)? Lane heads first: a lane whose enqueue head is not past
-- its claim cursor costs no partition read. Indexes: lease_claims_lane, ready_segments_lane, ready_entries pkey,
-- deferred_jobs_due. Callback waits (leases) and deferred jobs due later do not count.
WITH lanes AS (
    SELECT h.lane_id, COALESCE(pg_sequence_last_value(e.enqueue_seq), 0) AS head,
           COALESCE(pg_sequence_last_value(h.claim_seq), 0) AS seq_cur
    FROM __SCHEMA__.queue_claim_heads h JOIN __SCHEMA__.queue_enqueue_heads e ON e.lane_id = h.lane_id
    WHERE h.queue = ANY(%(queues)s::text[])
), cursors AS (
    SELECT l.lane_id, l.head,
           greatest(l.seq_cur, (SELECT max(c.last_seq) FROM __SCHEMA__.lease_claims c
                                WHERE c.lane_id = l.lane_id AND c.last_seq > l.seq_cur)) AS cur
    FROM lanes l WHERE l.head > l.seq_cur
)
SELECT EXISTS (
    SELECT 1 FROM cursors k
    JOIN __SCHEMA__.ready_segments g ON g.lane_id = k.lane_id AND g.last_seq > k.cur
    JOIN __SCHEMA__.ready_entries r ON r.ready_slot = g.ready_slot AND r.lane_id = g.lane_id
        AND r.lane_seq BETWEEN greatest(g.first_seq, k.cur + 1) AND g.last_seq
    WHERE k.head > k.cur
      AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.ready_tombstones t
                      WHERE t.ready_slot = r.ready_slot AND t.lane_id = r.lane_id AND t.lane_seq = r.lane_seq)
) OR EXISTS (
    SELECT 1 FROM lanes l
    JOIN __SCHEMA__.lease_claims c ON c.lane_id = l.lane_id
    CROSS JOIN LATERAL unnest(c.job_ids, c.run_leases) AS u(j, rl)
    WHERE NOT EXISTS (SELECT 1 FROM __SCHEMA__.lease_claim_closure_batches b
                      WHERE b.claim_slot = c.claim_slot AND b.claim_id = c.claim_id)
      AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.lease_claim_closures x
                      WHERE x.claim_slot = c.claim_slot AND x.claim_id = c.claim_id
                        AND x.job_id = u.j AND x.run_lease = u.rl)
) OR EXISTS (
    SELECT 1 FROM __SCHEMA__.deferred_jobs d WHERE d.run_at <= now() AND d.queue = ANY(%(queues)s::text[])
) OR EXISTS (
    -- due jobs waiting on their concurrency key (migration 0012; key_waiting primary key)
    SELECT 1 FROM __SCHEMA__.key_waiting w WHERE w.queue = ANY(%(queues)s::text[]) AND w.run_at <= now()
)

-- name: job_pending_list
-- Jobs waiting to run, optionally of one kind and one queue: ready rows past their lane's effective cursor and not
-- tombstoned, plus deferred jobs (scheduled, retryable, snoozed). For test assertions: scans the live ready rows
-- of the matching lanes (index ready_entries pkey per slot), never used on a hot path.
WITH cursors AS (
    SELECT h.lane_id, h.queue, h.priority,
           greatest(COALESCE(pg_sequence_last_value(h.claim_seq), 0),
                    COALESCE((SELECT max(c.last_seq) FROM __SCHEMA__.lease_claims c WHERE c.lane_id = h.lane_id), 0))
               AS cur
    FROM __SCHEMA__.queue_claim_heads h
    WHERE %(queue)s::text IS NULL OR h.queue = %(queue)s::text
)
SELECT r.job_id, k.queue, r.kind, k.priority::int, r.args, r.metadata, 'available' AS state, r.ready_at AS run_at
FROM __SCHEMA__.ready_entries r JOIN cursors k ON k.lane_id = r.lane_id
WHERE r.lane_seq > k.cur AND (%(kind)s::text IS NULL OR r.kind = %(kind)s::text)
  AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.ready_tombstones t
                  WHERE t.ready_slot = r.ready_slot AND t.lane_id = r.lane_id AND t.lane_seq = r.lane_seq)
UNION ALL
SELECT d.job_id, d.queue, d.kind, d.priority::int, d.args, d.metadata,
       CASE d.state WHEN 1 THEN 'scheduled' WHEN 2 THEN 'retryable' ELSE 'snoozed' END, d.run_at
FROM __SCHEMA__.deferred_jobs d
WHERE (%(queue)s::text IS NULL OR d.queue = %(queue)s::text) AND (%(kind)s::text IS NULL OR d.kind = %(kind)s::text)
ORDER BY 1

-- name: server_wal_level
-- The server's wal_level (minimal can rewind a new lane's cursor sequence after a crash).
SELECT current_setting('wal_level')

-- name: schema_compat_list
-- Recorded compatibility flag of every applied migration from version 5 on (primary key order).
SELECT version, compatible_with_previous FROM __SCHEMA__.schema_compat ORDER BY version

-- name: schema_compat_record
-- Record migrations' compatibility flags (idempotent: a flag, once written, never changes).
INSERT INTO __SCHEMA__.schema_compat (version, compatible_with_previous)
SELECT v, c FROM unnest(%s::int[], %s::boolean[]) AS u(v, c)
ON CONFLICT (version) DO NOTHING

-- name: dlq_depth
-- DLQ size per queue (the metrics gauge; scans dlq_entries, which is small and cold).
SELECT queue, count(*) FROM __SCHEMA__.dlq_entries GROUP BY queue

-- name: ring_slot_stats
-- Per ring slot: live and dead rows of its children from the statistics
-- collector (no scan; may lag) and when the slot last became current
-- (ring_rotations primary key; trimmed generations give NULL).
SELECT r.ring, r.slot,
       COALESCE(sum(st.n_live_tup), 0)::bigint, COALESCE(sum(st.n_dead_tup), 0)::bigint,
       (SELECT max(rr.rotated_at) FROM __SCHEMA__.ring_rotations rr WHERE rr.ring = r.ring AND rr.slot = r.slot)
FROM __SCHEMA__.ring_slots r
LEFT JOIN pg_stat_user_tables st
       ON st.schemaname = %(schema)s
      AND st.relname ~ ('^(' || CASE r.ring
                                   WHEN 'ready' THEN 'ready_entries|ready_segments|ready_tombstones|done_entries|done_receipts'
                                   WHEN 'claim' THEN 'lease_claims|lease_claim_closures|lease_claim_closure_batches'
                                   ELSE 'leases' END || ')_' || r.slot || '$')
GROUP BY r.ring, r.slot
ORDER BY r.ring, r.slot

-- name: runtime_sessions
-- awa-fast's connections to this database by role and client host (the
-- dashboard's runtime page: supervisors and claimers on every host).
SELECT split_part(application_name, ':', 2) AS role, application_name, COALESCE(client_addr::text, 'local'),
       count(*)::int, min(backend_start)
FROM pg_stat_activity
WHERE datname = current_database() AND application_name LIKE 'awa\_fast:%'
GROUP BY 1, 2, 3
ORDER BY 3, 2

-- Flow control (sql/0007_flow_control.sql, docs/flow-control.md) ---------------------

-- name: lane_claim_limited
-- Claim through the limits of a limited queue (max_running, token bucket) in one call; same rows as
-- lane_claim, the backlog marker also when a limit cut the claim short while work remains.
SELECT job_id, run_lease, attempt, max_attempts, queue, kind, priority, args, metadata, ready_slot,
       lane_id, lane_seq, claim_slot, claim_id, created_at, errors, callback_result, progress
FROM __SCHEMA__.lane_claim_limited(%s::text, %s::int, %s::int, %s::int)

-- name: queue_limits_get
-- The flow-control settings of one queue (no row: no limit). Primary key probe; read by claimers every few s.
SELECT max_running, rate_count, rate_per, rate_burst FROM __SCHEMA__.queue_limits WHERE queue = %s

-- name: queue_limits_set
-- Set a queue's limits (operators only; a row whose limits are all NULL means no limit).
INSERT INTO __SCHEMA__.queue_limits AS l (queue, max_running, rate_count, rate_per, rate_burst)
VALUES (%(queue)s, %(max_running)s, %(rate_count)s, %(rate_per)s, %(rate_burst)s)
ON CONFLICT (queue) DO UPDATE SET
    max_running = CASE WHEN %(keep_running)s THEN l.max_running ELSE excluded.max_running END,
    rate_count = CASE WHEN %(keep_rate)s THEN l.rate_count ELSE excluded.rate_count END,
    rate_per = CASE WHEN %(keep_rate)s THEN l.rate_per ELSE excluded.rate_per END,
    rate_burst = CASE WHEN %(keep_rate)s THEN l.rate_burst ELSE excluded.rate_burst END,
    updated_at = now()

-- name: queue_limit_status
-- Per limited queue: limits, running now (derived like the claim, no write), tokens left now.
SELECT queue, max_running, rate_count, rate_per, rate_burst, running, tokens
FROM __SCHEMA__.queue_limit_status()

-- Periodic and unique jobs (migration 0005; awa_fast/periodic.py, awa_fast/unique.py)
-- ---------------------------------------------------------------------------

-- name: job_enqueue_unique
-- Enqueue one unique job: (job_id, inserted); inserted false names the holder and wrote nothing.
SELECT job_id, inserted FROM __SCHEMA__.job_enqueue_unique_v2(%s::bytea, %s::float8, %s::int, %s::text, %s::int,
    %s::text, %s::jsonb, %s::jsonb, %s::int, %s::timestamptz, %s::float8)

-- name: job_enqueue_unique_many
-- Enqueue many unique jobs of one kind (keys distinct within the call): (job_id, inserted) per row, in order.
SELECT job_id, inserted FROM __SCHEMA__.job_enqueue_unique_many_v2(%s::bytea[], %s::float8, %s::int, %s::text,
    %s::int, %s::text, %s::jsonb[], %s::jsonb, %s::int)

-- name: unique_sweep
-- One batch of the stale-key sweep, in key order after a position (NULL: from the start).
SELECT swept, scanned, last_key, last_bucket FROM __SCHEMA__.unique_sweep_v2(%s::bytea, %s::bigint, %s::int)

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
SELECT outcome, job_id FROM __SCHEMA__.schedule_fire_v2(%s::text, %s::timestamptz, %s::timestamptz, %s::int,
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

-- Per-key concurrency (sql/0012_key_limits.sql, docs/flow-control.md).

-- name: job_enqueue_keyed
-- Enqueue one job with a concurrency key: into key_waiting when the queue has key_max_running
-- (queue_limits primary key), else job_enqueue as without a key.
SELECT __SCHEMA__.job_enqueue_keyed(%s::text, %s::int, %s::text, %s::jsonb, %s::jsonb, %s::int, %s::timestamptz,
    %s::text)

-- name: job_enqueue_keyed_in
-- job_enqueue_keyed with a delay in seconds, run_at on the database clock.
SELECT __SCHEMA__.job_enqueue_keyed(%s::text, %s::int, %s::text, %s::jsonb, %s::jsonb, %s::int,
    now() + make_interval(secs => %s::float8), %s::text)

-- name: job_enqueue_keyed_many
-- Enqueue many jobs of one kind with a key each (NULL: none) in one statement; ids in order.
SELECT __SCHEMA__.job_enqueue_keyed_many(%s::text, %s::int, %s::text, %s::jsonb[], %s::jsonb, %s::int, %s::text[])

-- name: lane_claim_keyed
-- Claim of a queue with key_max_running: admit what the keys have room for, then claim through
-- lane_claim_limited; same rows as lane_claim, the marker also while due jobs wait on a key.
SELECT job_id, run_lease, attempt, max_attempts, queue, kind, priority, args, metadata, ready_slot,
       lane_id, lane_seq, claim_slot, claim_id, created_at, errors, callback_result, progress
FROM __SCHEMA__.lane_claim_keyed_v2(%s::text, %s::int, %s::int, %s::int)

-- name: queue_limits_read
-- Every flow-control setting of one queue, the key limit too (primary key probe; claimers, every few s).
SELECT max_running, rate_count, rate_per, rate_burst, key_max_running FROM __SCHEMA__.queue_limits WHERE queue = %s

-- name: queue_key_limit_set
-- Set or (NULL) remove a queue's key_max_running; removing releases its waiting jobs.
SELECT __SCHEMA__.queue_key_limit_set_v2(%s::text, %s::int)

-- name: queue_key_status
-- Per key-limited queue: the limit, jobs waiting on a key, keys waiting, jobs admitted.
SELECT queue, key_max_running, waiting, keys_waiting, admitted FROM __SCHEMA__.queue_key_status()

-- Sessions: what the runtime asks of its own connections (awa_fast/storage/sessions.py).

-- name: session_clock
-- The database's wall clock in epoch seconds (the claimer's latency metrics correct for clock skew with it).
SELECT extract(epoch FROM clock_timestamp())::float8

-- name: session_read_committed
-- The runtime's sessions run at READ COMMITTED whatever the server's or the role's default: a claim, a cancel
-- and prune's cursor advance must see receipts committed up to the moment they lock a lane's claim head, and
-- lane_cursor_advance refuses any other level (migration 0028). A no-op where that is the default already (the usual
-- case), so nothing is left on a server connection a transaction pooler shares (docs/security.md, poolers).
SELECT set_config('default_transaction_isolation', 'read committed', false)
WHERE current_setting('default_transaction_isolation') <> 'read committed'

-- name: transaction_read_committed
-- The first statement of a cancel run as its own transaction (Storage.job_cancel): READ COMMITTED whatever the
-- session's default (migration 0028).
SET TRANSACTION ISOLATION LEVEL READ COMMITTED

-- name: session_utc
-- Report timestamptz results of this session in UTC: psycopg then builds each created_at of a claim without a
-- zone lookup (~0.2 against ~0.65 us a row under 'Etc/UTC'). Instants are unchanged; no claim SQL reads TimeZone.
SET TimeZone TO 'UTC'

-- name: session_index_probes
-- The completion batcher's and the heartbeat's sessions read the claim ring by key only. Their generic plans
-- are made once per session, from the statistics of that moment, and a ring slot just truncated looks
-- empty: a plan made then scans that slot whole on every call once it fills (a one-job completion read
-- ~600 receipts and closures of a slot of 300; a flush of 512 cost 3-9 ms against 2-4 ms), until an
-- ANALYZE of the slot replans it. With sequential scans off every probe keeps its index path; a table
-- without one is still read. Not the claim session: see migration 0026 (tests: test_completion_probes.py).
SET enable_seqscan TO off

-- name: session_ping
-- A round trip proving an idle connection alive (a half-open socket answers nothing).
SELECT 1

-- name: channel_name
-- The LISTEN/NOTIFY channel of this schema as the enqueue functions notify it (see notify_channel in 0002).
SELECT __SCHEMA__.notify_channel()

-- name: leader_lock_try
-- Try the maintenance leader lock (session advisory lock, key lock_key('leader'), 0); held until the session ends.
SELECT pg_try_advisory_lock(__SCHEMA__.lock_key('leader'), 0)

-- name: schema_backends_terminate
-- End the other sessions whose application_name names this schema (before dropping it); returns how many.
SELECT count(*)::int FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity
    WHERE pid <> pg_backend_pid() AND application_name LIKE %s) t

-- name: schema_drop
-- Drop the schema with everything in it (demo reset, test teardown). Owner only.
DROP SCHEMA IF EXISTS __SCHEMA__ CASCADE
