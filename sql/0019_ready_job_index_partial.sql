-- awa-fast: ready_entries_job indexes only the ready rows whose job_id is not their lane position.
-- compatible-with-previous: yes
-- Immutable once landed, like every migration.
--
-- Every ready row is indexed twice: by the primary key (ready_slot, lane_id,
-- lane_seq) and by ready_entries_job (job_id). A lane-born job's id is its
-- birth position, job_id = lane_id << 40 | lane_seq (the bulk COPY after
-- lane_reserve, job_enqueue_many, and job_enqueue / job_enqueue_v2 of a job
-- due now), so for that row the job_id index repeats the primary key. Every
-- other row has a job_id that differs from its position: a job that took its
-- id from job_id_seq (below 2^40; lane ids start at 1) before it had a lane
-- position (a scheduled job, a keyed job of a limited queue, a unique job, a
-- periodic fire), and any job back in ready under its old id (a retry or
-- snooze promoted from deferred_jobs, a rescue, a callback's resume, a DLQ
-- retry, a keyed admission). Those keep an index entry each, as before. On a bulk
-- COPY of 200k jobs the second index was 30% of the backend's CPU and 24% of
-- the WAL per job (docs/performance-log.md, bulk-enq). Now it is partial: it
-- holds the rows whose job_id is not lane_id << 40 | lane_seq.
--
-- ready_rows_of(job_id) (new, SQL, inlined by the planner) returns a job's
-- ready rows from both places: the row at its birth position, by the primary
-- key (lane_id, lane_seq from the id; no slot, so each child's primary key is
-- searched by a skip scan over its single ready_slot value), and the rows
-- that re-entered, by the partial index. The two branches are disjoint (a
-- row's job_id either is its position or is not) and together are exactly
-- the rows WHERE job_id = p: a row whose id is its position is found by the
-- first whatever path wrote it, any other row by the second, so no reader
-- depends on which paths derive ids. Every function that found a ready row
-- by job_id now reads ready_rows_of instead (body only, rule 3 of
-- docs/storage.md: same arguments, same results and writes):
--   job_cancel, job_done_compact, job_load, job_load_v2, job_load_v3,
--   key_admit, key_admit_v2, unique_holds, unique_holds_v2, unique_sweep,
--   unique_sweep_v2.
-- job_done_compact also moves from SQL to PL/pgSQL, one generic-plan
-- statement per case (its comment below says why).
-- The job list (named query job_list_ids) reads lane-born rows per slot in
-- primary-key order and re-entered rows by the partial index.
--
-- Compatibility. The previous runtime calls the same function names, which
-- now have these bodies, so it runs correctly and with the same index scans.
-- Its job_list_ids text (ORDER BY job_id over ready_entries) stays correct
-- but, without a full job_id index, sorts the ready ring it reads: a cold
-- admin path (`awa-fast job list`, the dashboard's list), slower on a large
-- ring until the runtime is upgraded. The new runtime's job_list_ids reads
-- only columns and indexes the previous schema also has, so it is correct
-- there too.
--
-- Locks. The new index is built first, under a temporary name: CREATE INDEX
-- on the partitioned parent takes SHARE on ready_entries and on each child
-- while it scans that child (CONCURRENTLY is not available for a partitioned
-- parent), so enqueues wait and claims and reads go on. The build reads every
-- ready row but sorts and writes only the re-entered ones. Then DROP INDEX of
-- the old one takes ACCESS EXCLUSIVE on ready_entries and its children, held
-- until the migration commits (the function replacements after it are
-- catalog writes only). Both locks are held to the end of the migration's
-- transaction: enqueue waits for the whole build, every reader of
-- ready_entries (claims included) for the last part.

CREATE INDEX ready_entries_job_partial ON __SCHEMA__.ready_entries (job_id)
    WHERE job_id <> ((lane_id::bigint << 40) | lane_seq);
DROP INDEX __SCHEMA__.ready_entries_job;
ALTER INDEX __SCHEMA__.ready_entries_job_partial RENAME TO ready_entries_job;
-- The children's indexes were named while the old ones still held their names.
DO $$
DECLARE
    c record;
BEGIN
    FOR c IN SELECT i.relname AS idx, t.relname AS tbl
             FROM pg_inherits h
             JOIN pg_class i ON i.oid = h.inhrelid
             JOIN pg_index x ON x.indexrelid = i.oid
             JOIN pg_class t ON t.oid = x.indrelid
             WHERE h.inhparent = '__SCHEMA__.ready_entries_job'::regclass LOOP
        IF c.idx <> c.tbl || '_job_id_idx' THEN
            EXECUTE format('ALTER INDEX __SCHEMA__.%I RENAME TO %I', c.idx, c.tbl || '_job_id_idx');
        END IF;
    END LOOP;
END $$;

-- A job's ready rows: the one at its birth position (primary key) and the ones that
-- re-entered ready under this id (partial ready_entries_job). Disjoint; together every
-- row WHERE job_id = p_job_id. Inlined into its callers (SQL, STABLE, no SET). An id
-- below 2^40 (job_id_seq: scheduled, keyed, unique, periodic jobs) has no birth position
-- (lane ids start at 1): the first branch's condition on the id alone is a one-time
-- filter that skips its partition scans for such an id.
CREATE FUNCTION __SCHEMA__.ready_rows_of(p_job_id bigint) RETURNS SETOF __SCHEMA__.ready_entries
LANGUAGE sql STABLE AS $function$
    SELECT e.* FROM __SCHEMA__.ready_entries e
    WHERE p_job_id >= 1099511627776
      AND e.lane_id = (p_job_id >> 40)::int AND e.lane_seq = (p_job_id & 1099511627775) AND e.job_id = p_job_id
    UNION ALL
    SELECT e.* FROM __SCHEMA__.ready_entries e
    WHERE e.job_id = p_job_id AND e.job_id <> ((e.lane_id::bigint << 40) | e.lane_seq)
$function$;

CREATE OR REPLACE FUNCTION __SCHEMA__.job_cancel(p_job_id bigint)
 RETURNS text
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
DECLARE
    d __SCHEMA__.deferred_jobs%ROWTYPE;
    v_lease __SCHEMA__.leases%ROWTYPE;
    r record;
    v_cur bigint;
BEGIN
    DELETE FROM __SCHEMA__.deferred_jobs x WHERE x.job_id = p_job_id RETURNING * INTO d;
    IF FOUND THEN
        INSERT INTO __SCHEMA__.done_entries (ready_slot, job_id, run_lease, attempt, state, queue, kind, error,
            args, metadata)
        VALUES (__SCHEMA__.ring_current('ready'), d.job_id, d.lease_base, d.attempt, 3, d.queue, d.kind,
            'cancelled', d.args, d.metadata);
        RETURN 'cancelled';
    END IF;
    DELETE FROM __SCHEMA__.leases l WHERE l.job_id = p_job_id RETURNING * INTO v_lease;
    IF FOUND THEN
        DELETE FROM __SCHEMA__.attempt_state a WHERE a.job_id = v_lease.job_id AND a.run_lease = v_lease.run_lease;
        PERFORM __SCHEMA__.attempt_terminal(3, v_lease.ready_slot, v_lease.lane_id, v_lease.lane_seq,
            v_lease.job_id, v_lease.run_lease, v_lease.attempt, 'cancelled');
        RETURN 'cancelled';
    END IF;
    IF EXISTS (SELECT 1 FROM __SCHEMA__.dlq_entries x WHERE x.job_id = p_job_id)
       OR EXISTS (SELECT 1 FROM __SCHEMA__.done_entries x WHERE x.job_id = p_job_id) THEN
        RETURN 'terminal';
    END IF;
    -- The newest ready row of the job (a retried job has older ones).
    SELECT e.ready_slot, e.lane_id, e.lane_seq, e.lease_base, e.attempt, h.claim_seq INTO r
    FROM __SCHEMA__.ready_rows_of(p_job_id) e JOIN __SCHEMA__.queue_claim_heads h ON h.lane_id = e.lane_id
    WHERE e.job_id = p_job_id ORDER BY e.lease_base DESC LIMIT 1;
    IF NOT FOUND THEN
        RETURN 'unknown';
    END IF;
    PERFORM 1 FROM __SCHEMA__.queue_claim_heads h WHERE h.lane_id = r.lane_id FOR UPDATE;
    v_cur := __SCHEMA__.lane_cursor_advance(r.lane_id, r.claim_seq);
    IF r.lane_seq > v_cur THEN
        INSERT INTO __SCHEMA__.ready_tombstones (ready_slot, lane_id, lane_seq, job_id)
        VALUES (r.ready_slot, r.lane_id, r.lane_seq, p_job_id)
        ON CONFLICT DO NOTHING;
        IF FOUND THEN
            PERFORM __SCHEMA__.attempt_terminal(3, r.ready_slot, r.lane_id, r.lane_seq, p_job_id,
                r.lease_base, r.attempt, 'cancelled');
        END IF;
        RETURN 'cancelled';
    END IF;
    -- Claimed: flag the open attempt so its handler can see it.
    INSERT INTO __SCHEMA__.attempt_state AS a (job_id, run_lease, cancel_requested)
    SELECT p_job_id, r.lease_base + 1, true
    WHERE EXISTS (
        SELECT 1 FROM __SCHEMA__.lease_claims c
        WHERE c.lane_id = r.lane_id AND c.ready_slot = r.ready_slot AND p_job_id = ANY (c.job_ids)
          AND r.lane_seq BETWEEN c.first_seq AND c.last_seq
          AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.lease_claim_closure_batches b
                          WHERE b.claim_slot = c.claim_slot AND b.claim_id = c.claim_id)
          AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.lease_claim_closures x
                          WHERE x.claim_slot = c.claim_slot AND x.claim_id = c.claim_id AND x.job_id = p_job_id
                            AND x.run_lease = r.lease_base + 1))
    ON CONFLICT ON CONSTRAINT attempt_state_pkey DO UPDATE SET cancel_requested = true, updated_at = now();
    IF FOUND THEN
        RETURN 'cancel_requested';
    END IF;
    RETURN 'terminal';
END $function$;

-- job_done_compact: PL/pgSQL now (it was a SQL function the planner did not inline, planned
-- again on every call: with the partial index the one-slot custom plan was cheap enough that
-- the plan cache kept choosing it, and the key admission gate, which calls this once per
-- admission per claim, measured 2-3x slower). Each case has its own statement with a generic
-- plan: a slot given prunes to that slot at run time; an id below 2^40 (job_id_seq: every
-- keyed, unique, scheduled and periodic job) has no birth position, so only the partial index
-- is read. Same arguments, same result.
CREATE OR REPLACE FUNCTION __SCHEMA__.job_done_compact(p_job_id bigint, p_ready_slot integer DEFAULT NULL::integer)
 RETURNS boolean
 LANGUAGE plpgsql
 STABLE
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
BEGIN
    IF p_job_id < 1099511627776 THEN
        IF p_ready_slot IS NULL THEN
            RETURN EXISTS (
                SELECT 1 FROM __SCHEMA__.ready_entries e
                WHERE e.job_id = p_job_id AND e.job_id <> ((e.lane_id::bigint << 40) | e.lane_seq)
                  AND __SCHEMA__.done_receipt_at(e.ready_slot, e.lane_id, e.lane_seq, e.job_id, e.lease_base + 1)
                      IS NOT NULL);
        END IF;
        RETURN EXISTS (
            SELECT 1 FROM __SCHEMA__.ready_entries e
            WHERE e.job_id = p_job_id AND e.job_id <> ((e.lane_id::bigint << 40) | e.lane_seq)
              AND e.ready_slot = p_ready_slot
              AND __SCHEMA__.done_receipt_at(e.ready_slot, e.lane_id, e.lane_seq, e.job_id, e.lease_base + 1)
                  IS NOT NULL);
    END IF;
    IF p_ready_slot IS NULL THEN
        RETURN EXISTS (
            SELECT 1 FROM __SCHEMA__.ready_rows_of(p_job_id) e
            WHERE __SCHEMA__.done_receipt_at(e.ready_slot, e.lane_id, e.lane_seq, e.job_id, e.lease_base + 1)
                  IS NOT NULL);
    END IF;
    RETURN EXISTS (
        SELECT 1 FROM __SCHEMA__.ready_rows_of(p_job_id) e
        WHERE e.ready_slot = p_ready_slot
          AND __SCHEMA__.done_receipt_at(e.ready_slot, e.lane_id, e.lane_seq, e.job_id, e.lease_base + 1)
              IS NOT NULL);
END $function$;

CREATE OR REPLACE FUNCTION __SCHEMA__.job_load(p_job_id bigint)
 RETURNS jsonb
 LANGUAGE plpgsql
 STABLE
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
DECLARE
    v jsonb;
    r record;
    v_state text;
BEGIN
    SELECT jsonb_build_object('state', CASE d.state WHEN 1 THEN 'completed' WHEN 2 THEN 'failed' ELSE 'cancelled' END,
        'job_id', d.job_id, 'queue', d.queue, 'kind', d.kind, 'attempt', d.attempt, 'run_lease', d.run_lease,
        'error', d.error, 'finished_at', d.finished_at,
        'args', COALESCE(d.args, e.args), 'metadata', COALESCE(d.metadata, e.metadata), 'errors', e.errors,
        'max_attempts', e.max_attempts, 'created_at', e.created_at)
    INTO v
    FROM __SCHEMA__.done_entries d
    LEFT JOIN __SCHEMA__.ready_entries e
        ON e.ready_slot = d.ready_slot AND e.lane_id = d.lane_id AND e.lane_seq = d.lane_seq
    WHERE d.job_id = p_job_id ORDER BY d.run_lease DESC LIMIT 1;
    IF v IS NOT NULL THEN RETURN v; END IF;
    SELECT jsonb_build_object('state', 'dlq', 'job_id', x.job_id, 'queue', x.queue, 'kind', x.kind,
        'priority', x.priority, 'args', x.args, 'metadata', x.metadata, 'attempt', x.attempt,
        'max_attempts', x.max_attempts, 'run_lease', x.lease_base, 'errors', x.errors, 'error', x.reason,
        'created_at', x.created_at, 'finished_at', x.failed_at)
    INTO v FROM __SCHEMA__.dlq_entries x WHERE x.job_id = p_job_id;
    IF v IS NOT NULL THEN RETURN v; END IF;
    SELECT jsonb_build_object('state', CASE x.state WHEN 1 THEN 'scheduled' WHEN 2 THEN 'retryable' ELSE 'snoozed' END,
        'job_id', x.job_id, 'queue', x.queue, 'kind', x.kind, 'priority', x.priority, 'args', x.args,
        'metadata', x.metadata, 'attempt', x.attempt, 'max_attempts', x.max_attempts, 'run_lease', x.lease_base,
        'errors', x.errors, 'run_at', x.run_at, 'created_at', x.created_at)
    INTO v FROM __SCHEMA__.deferred_jobs x WHERE x.job_id = p_job_id;
    IF v IS NOT NULL THEN RETURN v; END IF;
    SELECT jsonb_build_object('state', 'waiting_external', 'job_id', l.job_id, 'queue', l.queue, 'kind', l.kind,
        'attempt', l.attempt, 'max_attempts', l.max_attempts, 'run_lease', l.run_lease,
        'callback_timeout_at', l.callback_timeout_at, 'args', e.args, 'metadata', e.metadata,
        'errors', e.errors, 'created_at', e.created_at)
    INTO v FROM __SCHEMA__.leases l
    JOIN __SCHEMA__.ready_entries e ON e.ready_slot = l.ready_slot AND e.lane_id = l.lane_id AND e.lane_seq = l.lane_seq
    WHERE l.job_id = p_job_id;
    IF v IS NOT NULL THEN RETURN v; END IF;
    SELECT e.*, ql.queue, ql.priority, h.claim_seq INTO r
    FROM __SCHEMA__.ready_rows_of(p_job_id) e
    JOIN __SCHEMA__.queue_lanes ql ON ql.lane_id = e.lane_id
    JOIN __SCHEMA__.queue_claim_heads h ON h.lane_id = e.lane_id
    WHERE e.job_id = p_job_id ORDER BY e.lease_base DESC LIMIT 1;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    IF EXISTS (SELECT 1 FROM __SCHEMA__.ready_tombstones t
               WHERE t.ready_slot = r.ready_slot AND t.lane_id = r.lane_id AND t.lane_seq = r.lane_seq) THEN
        v_state := 'cancelled';
    ELSIF EXISTS (
        -- the receipt that claimed this very row (not an older attempt's)
        SELECT 1 FROM __SCHEMA__.lease_claims c
        WHERE c.lane_id = r.lane_id AND c.ready_slot = r.ready_slot
          AND r.lane_seq BETWEEN c.first_seq AND c.last_seq AND r.job_id = ANY (c.job_ids)
          AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.lease_claim_closure_batches b
                          WHERE b.claim_slot = c.claim_slot AND b.claim_id = c.claim_id)
          AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.lease_claim_closures x
                          WHERE x.claim_slot = c.claim_slot AND x.claim_id = c.claim_id AND x.job_id = r.job_id
                            AND x.run_lease = r.lease_base + 1)) THEN
        v_state := 'running';
    ELSIF r.lane_seq > greatest(pg_sequence_last_value(r.claim_seq),
                                COALESCE((SELECT max(c.last_seq) FROM __SCHEMA__.lease_claims c
                                          WHERE c.lane_id = r.lane_id), 0)) THEN
        v_state := 'available';
    ELSE
        -- claimed and closed, and no terminal, deferred or DLQ record is left
        -- (purged or pruned): unknown
        RETURN NULL;
    END IF;
    RETURN jsonb_build_object(
        'state', v_state,
        'job_id', r.job_id, 'queue', r.queue, 'kind', r.kind, 'priority', r.priority, 'args', r.args,
        'metadata', r.metadata,
        'attempt', CASE WHEN v_state = 'running' THEN r.attempt + 1 ELSE r.attempt END,
        'max_attempts', r.max_attempts,
        'run_lease', CASE WHEN v_state = 'running' THEN r.lease_base + 1 ELSE r.lease_base END,
        'errors', r.errors, 'created_at', r.created_at);
END $function$;

CREATE OR REPLACE FUNCTION __SCHEMA__.job_load_v2(p_job_id bigint)
 RETURNS jsonb
 LANGUAGE plpgsql
 STABLE
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
DECLARE
    v jsonb;
    r record;
    v_state text;
    v_progress jsonb;
BEGIN
    SELECT jsonb_build_object('state', CASE d.state WHEN 1 THEN 'completed' WHEN 2 THEN 'failed' ELSE 'cancelled' END,
        'job_id', d.job_id, 'queue', d.queue, 'kind', d.kind, 'attempt', d.attempt, 'run_lease', d.run_lease,
        'error', d.error, 'finished_at', d.finished_at,
        'args', COALESCE(d.args, e.args), 'metadata', COALESCE(d.metadata, e.metadata), 'errors', e.errors,
        'max_attempts', e.max_attempts, 'created_at', e.created_at, 'progress', NULL, 'result', d.result)
    INTO v
    FROM __SCHEMA__.done_entries d
    LEFT JOIN __SCHEMA__.ready_entries e
        ON e.ready_slot = d.ready_slot AND e.lane_id = d.lane_id AND e.lane_seq = d.lane_seq
    WHERE d.job_id = p_job_id ORDER BY d.run_lease DESC LIMIT 1;
    IF v IS NOT NULL THEN RETURN v; END IF;
    SELECT jsonb_build_object('state', 'dlq', 'job_id', x.job_id, 'queue', x.queue, 'kind', x.kind,
        'priority', x.priority, 'args', x.args, 'metadata', x.metadata, 'attempt', x.attempt,
        'max_attempts', x.max_attempts, 'run_lease', x.lease_base, 'errors', x.errors, 'error', x.reason,
        'created_at', x.created_at, 'finished_at', x.failed_at, 'progress', NULL, 'result', NULL)
    INTO v FROM __SCHEMA__.dlq_entries x WHERE x.job_id = p_job_id;
    IF v IS NOT NULL THEN RETURN v; END IF;
    SELECT jsonb_build_object('state', CASE x.state WHEN 1 THEN 'scheduled' WHEN 2 THEN 'retryable' ELSE 'snoozed' END,
        'job_id', x.job_id, 'queue', x.queue, 'kind', x.kind, 'priority', x.priority, 'args', x.args,
        'metadata', x.metadata, 'attempt', x.attempt, 'max_attempts', x.max_attempts, 'run_lease', x.lease_base,
        'errors', x.errors, 'run_at', x.run_at, 'created_at', x.created_at, 'progress', x.progress, 'result', NULL)
    INTO v FROM __SCHEMA__.deferred_jobs x WHERE x.job_id = p_job_id;
    IF v IS NOT NULL THEN RETURN v; END IF;
    SELECT jsonb_build_object('state', 'waiting_external', 'job_id', l.job_id, 'queue', l.queue, 'kind', l.kind,
        'attempt', l.attempt, 'max_attempts', l.max_attempts, 'run_lease', l.run_lease,
        'callback_timeout_at', l.callback_timeout_at, 'args', e.args, 'metadata', e.metadata,
        'errors', e.errors, 'created_at', e.created_at,
        'progress', COALESCE((SELECT a.progress FROM __SCHEMA__.attempt_state a
                              WHERE a.job_id = l.job_id AND a.run_lease = l.run_lease), e.progress),
        'result', NULL)
    INTO v FROM __SCHEMA__.leases l
    JOIN __SCHEMA__.ready_entries e ON e.ready_slot = l.ready_slot AND e.lane_id = l.lane_id AND e.lane_seq = l.lane_seq
    WHERE l.job_id = p_job_id;
    IF v IS NOT NULL THEN RETURN v; END IF;
    SELECT e.*, ql.queue, ql.priority, h.claim_seq INTO r
    FROM __SCHEMA__.ready_rows_of(p_job_id) e
    JOIN __SCHEMA__.queue_lanes ql ON ql.lane_id = e.lane_id
    JOIN __SCHEMA__.queue_claim_heads h ON h.lane_id = e.lane_id
    WHERE e.job_id = p_job_id ORDER BY e.lease_base DESC LIMIT 1;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    IF EXISTS (SELECT 1 FROM __SCHEMA__.ready_tombstones t
               WHERE t.ready_slot = r.ready_slot AND t.lane_id = r.lane_id AND t.lane_seq = r.lane_seq) THEN
        v_state := 'cancelled';
    ELSIF EXISTS (
        -- the receipt that claimed this very row (not an older attempt's)
        SELECT 1 FROM __SCHEMA__.lease_claims c
        WHERE c.lane_id = r.lane_id AND c.ready_slot = r.ready_slot
          AND r.lane_seq BETWEEN c.first_seq AND c.last_seq AND r.job_id = ANY (c.job_ids)
          AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.lease_claim_closure_batches b
                          WHERE b.claim_slot = c.claim_slot AND b.claim_id = c.claim_id)
          AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.lease_claim_closures x
                          WHERE x.claim_slot = c.claim_slot AND x.claim_id = c.claim_id AND x.job_id = r.job_id
                            AND x.run_lease = r.lease_base + 1)) THEN
        v_state := 'running';
    ELSIF r.lane_seq > greatest(pg_sequence_last_value(r.claim_seq),
                                COALESCE((SELECT max(c.last_seq) FROM __SCHEMA__.lease_claims c
                                          WHERE c.lane_id = r.lane_id), 0)) THEN
        v_state := 'available';
    ELSE
        -- claimed and closed, and no terminal, deferred or DLQ record is left
        -- (purged or pruned): unknown
        RETURN NULL;
    END IF;
    IF v_state = 'running' THEN
        SELECT a.progress INTO v_progress FROM __SCHEMA__.attempt_state a
        WHERE a.job_id = r.job_id AND a.run_lease = r.lease_base + 1;
    END IF;
    RETURN jsonb_build_object(
        'state', v_state,
        'job_id', r.job_id, 'queue', r.queue, 'kind', r.kind, 'priority', r.priority, 'args', r.args,
        'metadata', r.metadata,
        'attempt', CASE WHEN v_state = 'running' THEN r.attempt + 1 ELSE r.attempt END,
        'max_attempts', r.max_attempts,
        'run_lease', CASE WHEN v_state = 'running' THEN r.lease_base + 1 ELSE r.lease_base END,
        'errors', r.errors, 'created_at', r.created_at,
        'progress', CASE WHEN v_state = 'cancelled' THEN NULL ELSE COALESCE(v_progress, r.progress) END,
        'result', NULL);
END $function$;

CREATE OR REPLACE FUNCTION __SCHEMA__.job_load_v3(p_job_id bigint)
 RETURNS jsonb
 LANGUAGE plpgsql
 STABLE
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
DECLARE
    v jsonb;
    r record;
    v_state text;
    v_progress jsonb;
    v_finished timestamptz;
BEGIN
    SELECT jsonb_build_object('state', CASE d.state WHEN 1 THEN 'completed' WHEN 2 THEN 'failed' ELSE 'cancelled' END,
        'job_id', d.job_id, 'queue', d.queue, 'kind', d.kind, 'attempt', d.attempt, 'run_lease', d.run_lease,
        'error', d.error, 'finished_at', d.finished_at,
        'args', COALESCE(d.args, e.args), 'metadata', COALESCE(d.metadata, e.metadata), 'errors', e.errors,
        'max_attempts', e.max_attempts, 'created_at', e.created_at, 'progress', NULL, 'result', d.result)
    INTO v
    FROM __SCHEMA__.done_entries d
    LEFT JOIN __SCHEMA__.ready_entries e
        ON e.ready_slot = d.ready_slot AND e.lane_id = d.lane_id AND e.lane_seq = d.lane_seq
    WHERE d.job_id = p_job_id ORDER BY d.run_lease DESC LIMIT 1;
    IF v IS NOT NULL THEN RETURN v; END IF;
    SELECT jsonb_build_object('state', 'dlq', 'job_id', x.job_id, 'queue', x.queue, 'kind', x.kind,
        'priority', x.priority, 'args', x.args, 'metadata', x.metadata, 'attempt', x.attempt,
        'max_attempts', x.max_attempts, 'run_lease', x.lease_base, 'errors', x.errors, 'error', x.reason,
        'created_at', x.created_at, 'finished_at', x.failed_at, 'progress', NULL, 'result', NULL)
    INTO v FROM __SCHEMA__.dlq_entries x WHERE x.job_id = p_job_id;
    IF v IS NOT NULL THEN RETURN v; END IF;
    SELECT jsonb_build_object('state', CASE x.state WHEN 1 THEN 'scheduled' WHEN 2 THEN 'retryable' ELSE 'snoozed' END,
        'job_id', x.job_id, 'queue', x.queue, 'kind', x.kind, 'priority', x.priority, 'args', x.args,
        'metadata', x.metadata, 'attempt', x.attempt, 'max_attempts', x.max_attempts, 'run_lease', x.lease_base,
        'errors', x.errors, 'run_at', x.run_at, 'created_at', x.created_at, 'progress', x.progress, 'result', NULL)
    INTO v FROM __SCHEMA__.deferred_jobs x WHERE x.job_id = p_job_id;
    IF v IS NOT NULL THEN RETURN v; END IF;
    SELECT jsonb_build_object('state', 'waiting_external', 'job_id', l.job_id, 'queue', l.queue, 'kind', l.kind,
        'attempt', l.attempt, 'max_attempts', l.max_attempts, 'run_lease', l.run_lease,
        'callback_timeout_at', l.callback_timeout_at, 'args', e.args, 'metadata', e.metadata,
        'errors', e.errors, 'created_at', e.created_at,
        'progress', COALESCE((SELECT a.progress FROM __SCHEMA__.attempt_state a
                              WHERE a.job_id = l.job_id AND a.run_lease = l.run_lease), e.progress),
        'result', NULL)
    INTO v FROM __SCHEMA__.leases l
    JOIN __SCHEMA__.ready_entries e ON e.ready_slot = l.ready_slot AND e.lane_id = l.lane_id AND e.lane_seq = l.lane_seq
    WHERE l.job_id = p_job_id;
    IF v IS NOT NULL THEN RETURN v; END IF;
    SELECT e.*, ql.queue, ql.priority, h.claim_seq INTO r
    FROM __SCHEMA__.ready_rows_of(p_job_id) e
    JOIN __SCHEMA__.queue_lanes ql ON ql.lane_id = e.lane_id
    JOIN __SCHEMA__.queue_claim_heads h ON h.lane_id = e.lane_id
    WHERE e.job_id = p_job_id ORDER BY e.lease_base DESC LIMIT 1;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    IF EXISTS (SELECT 1 FROM __SCHEMA__.ready_tombstones t
               WHERE t.ready_slot = r.ready_slot AND t.lane_id = r.lane_id AND t.lane_seq = r.lane_seq) THEN
        v_state := 'cancelled';
    ELSIF EXISTS (
        -- the receipt that claimed this very row (not an older attempt's)
        SELECT 1 FROM __SCHEMA__.lease_claims c
        WHERE c.lane_id = r.lane_id AND c.ready_slot = r.ready_slot
          AND r.lane_seq BETWEEN c.first_seq AND c.last_seq AND r.job_id = ANY (c.job_ids)
          AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.lease_claim_closure_batches b
                          WHERE b.claim_slot = c.claim_slot AND b.claim_id = c.claim_id)
          AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.lease_claim_closures x
                          WHERE x.claim_slot = c.claim_slot AND x.claim_id = c.claim_id AND x.job_id = r.job_id
                            AND x.run_lease = r.lease_base + 1)) THEN
        v_state := 'running';
    ELSIF r.lane_seq > greatest(pg_sequence_last_value(r.claim_seq),
                                COALESCE((SELECT max(c.last_seq) FROM __SCHEMA__.lease_claims c
                                          WHERE c.lane_id = r.lane_id), 0)) THEN
        v_state := 'available';
    ELSE
        -- claimed and closed, and no per-job terminal, deferred or DLQ record:
        -- completed by a compact done row of its receipt (0015), else the record
        -- is gone (purged or pruned): unknown
        v_finished := __SCHEMA__.done_receipt_at(r.ready_slot, r.lane_id, r.lane_seq, r.job_id, r.lease_base + 1);
        IF v_finished IS NULL THEN
            RETURN NULL;
        END IF;
        RETURN jsonb_build_object('state', 'completed',
            'job_id', r.job_id, 'queue', r.queue, 'kind', r.kind, 'attempt', r.attempt + 1,
            'run_lease', r.lease_base + 1, 'error', NULL, 'finished_at', v_finished,
            'args', r.args, 'metadata', r.metadata, 'errors', r.errors,
            'max_attempts', r.max_attempts, 'created_at', r.created_at, 'progress', NULL, 'result', NULL);
    END IF;
    IF v_state = 'running' THEN
        SELECT a.progress INTO v_progress FROM __SCHEMA__.attempt_state a
        WHERE a.job_id = r.job_id AND a.run_lease = r.lease_base + 1;
    END IF;
    RETURN jsonb_build_object(
        'state', v_state,
        'job_id', r.job_id, 'queue', r.queue, 'kind', r.kind, 'priority', r.priority, 'args', r.args,
        'metadata', r.metadata,
        'attempt', CASE WHEN v_state = 'running' THEN r.attempt + 1 ELSE r.attempt END,
        'max_attempts', r.max_attempts,
        'run_lease', CASE WHEN v_state = 'running' THEN r.lease_base + 1 ELSE r.lease_base END,
        'errors', r.errors, 'created_at', r.created_at,
        'progress', CASE WHEN v_state = 'cancelled' THEN NULL ELSE COALESCE(v_progress, r.progress) END,
        'result', NULL);
END $function$;

CREATE OR REPLACE FUNCTION __SCHEMA__.key_admit(p_queue text, p_kmax integer)
 RETURNS integer
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
 SET jit TO 'off'
AS $function$
DECLARE
    v_jobs bigint[]; v_prios smallint[]; v_seqs bigint[]; v_kinds text[]; v_args jsonb[]; v_metas jsonb[];
    v_maxs smallint[]; v_created timestamptz[]; v_ckeys text[];
    v_pick_keys text[]; v_pick_seqs bigint[];
    v_prio smallint;
    v_cnt int;
    v_rng record;
    v_phase int;
BEGIN
    -- Index: key_admits primary key (queue, ...); done_entries_job; dlq_entries primary key.
    -- The done row of a job that ran from its admitted ready row is in that row's ready slot:
    -- one partition probed (run-time pruning). A job that moved (retried, snoozed, rescued)
    -- ends elsewhere: every partition is probed for an eighth of the admissions per call
    -- (job_id mod 8 against a random phase), so its slot frees a few claim calls late at most.
    -- An admission older than 5 minutes whose job is nowhere live any more (its terminal row
    -- pruned with its ready slot while no claim ran) is retired too: a key never stays full
    -- of jobs that ended (ready_rows_of, deferred_jobs primary key, leases_job).
    v_phase := floor(random() * 8)::int;
    DELETE FROM __SCHEMA__.key_admits a
    WHERE a.queue = p_queue
      AND (EXISTS (SELECT 1 FROM __SCHEMA__.done_entries x WHERE x.ready_slot = a.ready_slot AND x.job_id = a.job_id)
           OR EXISTS (SELECT 1 FROM __SCHEMA__.dlq_entries x WHERE x.job_id = a.job_id)
           OR (a.job_id % 8 = v_phase
               AND EXISTS (SELECT 1 FROM __SCHEMA__.done_entries x WHERE x.job_id = a.job_id))
           OR (a.admitted_at < now() - interval '5 minutes'
               AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.ready_rows_of(a.job_id) x WHERE x.job_id = a.job_id)
               AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.deferred_jobs x WHERE x.job_id = a.job_id)
               AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.leases x WHERE x.job_id = a.job_id)));
    WITH RECURSIVE keys AS (
        (SELECT w.ckey FROM __SCHEMA__.key_waiting w WHERE w.queue = p_queue ORDER BY w.ckey LIMIT 1)
        UNION ALL
        SELECT (SELECT w.ckey FROM __SCHEMA__.key_waiting w WHERE w.queue = p_queue AND w.ckey > keys.ckey
                ORDER BY w.ckey LIMIT 1)
        FROM keys WHERE keys.ckey IS NOT NULL
    ), pick AS MATERIALIZED (
        SELECT k.ckey, x.seq
        FROM keys k
        CROSS JOIN LATERAL (SELECT p_kmax - count(*) AS room FROM __SCHEMA__.key_admits a
                            WHERE a.queue = p_queue AND a.ckey = k.ckey) r
        CROSS JOIN LATERAL (SELECT w.seq FROM __SCHEMA__.key_waiting w
                            WHERE w.queue = p_queue AND w.ckey = k.ckey AND w.run_at <= now()
                            ORDER BY w.seq LIMIT CASE WHEN p_kmax IS NULL THEN NULL ELSE greatest(r.room, 0) END) x
        WHERE k.ckey IS NOT NULL
    )
    SELECT array_agg(p.ckey), array_agg(p.seq) INTO v_pick_keys, v_pick_seqs FROM pick p;
    IF v_pick_keys IS NULL THEN
        RETURN 0;
    END IF;
    -- Primary-key deletes of exactly the picked rows (a join with the pick, flattened, let the
    -- planner read every waiting row of a hot key: 10,000 rows for 0 picked).
    WITH gone AS (
        DELETE FROM __SCHEMA__.key_waiting w USING unnest(v_pick_keys, v_pick_seqs) AS u(ck, s)
        WHERE w.queue = p_queue AND w.ckey = u.ck AND w.seq = u.s
        RETURNING w.*
    )
    SELECT array_agg(g.job_id ORDER BY g.priority, g.seq), array_agg(g.priority ORDER BY g.priority, g.seq),
           array_agg(g.seq ORDER BY g.priority, g.seq), array_agg(g.kind ORDER BY g.priority, g.seq),
           array_agg(g.args ORDER BY g.priority, g.seq), array_agg(g.metadata ORDER BY g.priority, g.seq),
           array_agg(g.max_attempts ORDER BY g.priority, g.seq), array_agg(g.created_at ORDER BY g.priority, g.seq),
           array_agg(g.ckey ORDER BY g.priority, g.seq)
    INTO v_jobs, v_prios, v_seqs, v_kinds, v_args, v_metas, v_maxs, v_created, v_ckeys
    FROM gone g;
    IF v_jobs IS NULL THEN
        RETURN 0;
    END IF;
    FOR v_prio, v_cnt IN SELECT u.p, count(*) FROM unnest(v_prios) AS u(p) GROUP BY u.p ORDER BY u.p LOOP
        SELECT * INTO v_rng FROM __SCHEMA__.lane_reserve(p_queue, v_prio, v_cnt, pg_backend_pid());
        INSERT INTO __SCHEMA__.ready_entries (ready_slot, lane_id, lane_seq, job_id, kind, args, metadata,
            attempt, max_attempts, lease_base, created_at)
        SELECT v_rng.ready_slot, v_rng.lane_id, v_rng.first_seq + (row_number() OVER (ORDER BY u.s)) - 1,
            u.j, u.k, u.a, u.m, 0, u.x, 0, u.c
        FROM unnest(v_jobs, v_prios, v_seqs, v_kinds, v_args, v_metas, v_maxs, v_created) AS u(j, p, s, k, a, m, x, c)
        WHERE u.p = v_prio;
        IF p_kmax IS NOT NULL THEN
            INSERT INTO __SCHEMA__.key_admits (queue, ckey, job_id, ready_slot)
            SELECT p_queue, u.ck, u.j, v_rng.ready_slot
            FROM unnest(v_jobs, v_prios, v_ckeys) AS u(j, p, ck) WHERE u.p = v_prio;
        END IF;
    END LOOP;
    RETURN cardinality(v_jobs);
END $function$;

CREATE OR REPLACE FUNCTION __SCHEMA__.key_admit_v2(p_queue text, p_kmax integer)
 RETURNS integer
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
 SET jit TO 'off'
AS $function$
DECLARE
    v_jobs bigint[]; v_prios smallint[]; v_seqs bigint[]; v_kinds text[]; v_args jsonb[]; v_metas jsonb[];
    v_maxs smallint[]; v_created timestamptz[]; v_ckeys text[]; v_bases int[]; v_errors jsonb[];
    v_pick_keys text[]; v_pick_seqs bigint[];
    v_prio smallint;
    v_cnt int;
    v_rng record;
    v_phase int;
BEGIN
    -- Index: key_admits primary key (queue, ...); done_entries_job; dlq_entries primary key.
    -- The done row of a job that ran from its admitted ready row is in that row's ready slot:
    -- one partition probed (run-time pruning). A job that moved (retried, snoozed, rescued)
    -- ends elsewhere: every partition is probed for an eighth of the admissions per call
    -- (job_id mod 8 against a random phase), so its slot frees a few claim calls late at most.
    -- An admission older than 5 minutes whose job is nowhere live any more (its terminal row
    -- pruned with its ready slot while no claim ran) is retired too: a key never stays full
    -- of jobs that ended (ready_rows_of, deferred_jobs primary key, leases_job).
    -- A dead-lettered job's key is kept in key_dlq (0017), for its DLQ retry.
    v_phase := floor(random() * 8)::int;
    WITH retired AS (
        DELETE FROM __SCHEMA__.key_admits a
        WHERE a.queue = p_queue
          AND (EXISTS (SELECT 1 FROM __SCHEMA__.done_entries x WHERE x.ready_slot = a.ready_slot AND x.job_id = a.job_id)
               -- completed by a compact done row (0015), probed like the done row: the admitted slot
               -- every call (ready_rows_of in one partition, then done_receipts_lane)
               OR __SCHEMA__.job_done_compact(a.job_id, a.ready_slot)
               OR EXISTS (SELECT 1 FROM __SCHEMA__.dlq_entries x WHERE x.job_id = a.job_id)
               OR (a.job_id % 8 = v_phase
                   AND (EXISTS (SELECT 1 FROM __SCHEMA__.done_entries x WHERE x.job_id = a.job_id)
                        OR __SCHEMA__.job_done_compact(a.job_id)))
               OR (a.admitted_at < now() - interval '5 minutes'
                   AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.ready_rows_of(a.job_id) x WHERE x.job_id = a.job_id)
                   AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.deferred_jobs x WHERE x.job_id = a.job_id)
                   AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.leases x WHERE x.job_id = a.job_id)))
        RETURNING a.queue, a.ckey, a.job_id
    )
    INSERT INTO __SCHEMA__.key_dlq (job_id, queue, ckey)
    SELECT r.job_id, r.queue, r.ckey FROM retired r
    WHERE EXISTS (SELECT 1 FROM __SCHEMA__.dlq_entries x WHERE x.job_id = r.job_id)
    ON CONFLICT (job_id) DO NOTHING;
    WITH RECURSIVE keys AS (
        (SELECT w.ckey FROM __SCHEMA__.key_waiting w WHERE w.queue = p_queue ORDER BY w.ckey LIMIT 1)
        UNION ALL
        SELECT (SELECT w.ckey FROM __SCHEMA__.key_waiting w WHERE w.queue = p_queue AND w.ckey > keys.ckey
                ORDER BY w.ckey LIMIT 1)
        FROM keys WHERE keys.ckey IS NOT NULL
    ), pick AS MATERIALIZED (
        SELECT k.ckey, x.seq
        FROM keys k
        CROSS JOIN LATERAL (SELECT p_kmax - count(*) AS room FROM __SCHEMA__.key_admits a
                            WHERE a.queue = p_queue AND a.ckey = k.ckey) r
        CROSS JOIN LATERAL (SELECT w.seq FROM __SCHEMA__.key_waiting w
                            WHERE w.queue = p_queue AND w.ckey = k.ckey AND w.run_at <= now()
                            ORDER BY w.seq LIMIT CASE WHEN p_kmax IS NULL THEN NULL ELSE greatest(r.room, 0) END) x
        WHERE k.ckey IS NOT NULL
    )
    SELECT array_agg(p.ckey), array_agg(p.seq) INTO v_pick_keys, v_pick_seqs FROM pick p;
    IF v_pick_keys IS NULL THEN
        RETURN 0;
    END IF;
    -- Primary-key deletes of exactly the picked rows (a join with the pick, flattened, let the
    -- planner read every waiting row of a hot key: 10,000 rows for 0 picked).
    WITH gone AS (
        DELETE FROM __SCHEMA__.key_waiting w USING unnest(v_pick_keys, v_pick_seqs) AS u(ck, s)
        WHERE w.queue = p_queue AND w.ckey = u.ck AND w.seq = u.s
        RETURNING w.*
    )
    SELECT array_agg(g.job_id ORDER BY g.priority, g.seq), array_agg(g.priority ORDER BY g.priority, g.seq),
           array_agg(g.seq ORDER BY g.priority, g.seq), array_agg(g.kind ORDER BY g.priority, g.seq),
           array_agg(g.args ORDER BY g.priority, g.seq), array_agg(g.metadata ORDER BY g.priority, g.seq),
           array_agg(g.max_attempts ORDER BY g.priority, g.seq), array_agg(g.created_at ORDER BY g.priority, g.seq),
           array_agg(g.ckey ORDER BY g.priority, g.seq), array_agg(g.lease_base ORDER BY g.priority, g.seq),
           array_agg(g.errors ORDER BY g.priority, g.seq)
    INTO v_jobs, v_prios, v_seqs, v_kinds, v_args, v_metas, v_maxs, v_created, v_ckeys, v_bases, v_errors
    FROM gone g;
    IF v_jobs IS NULL THEN
        RETURN 0;
    END IF;
    FOR v_prio, v_cnt IN SELECT u.p, count(*) FROM unnest(v_prios) AS u(p) GROUP BY u.p ORDER BY u.p LOOP
        SELECT * INTO v_rng FROM __SCHEMA__.lane_reserve(p_queue, v_prio, v_cnt, pg_backend_pid());
        INSERT INTO __SCHEMA__.ready_entries (ready_slot, lane_id, lane_seq, job_id, kind, args, metadata,
            attempt, max_attempts, lease_base, created_at, errors)
        SELECT v_rng.ready_slot, v_rng.lane_id, v_rng.first_seq + (row_number() OVER (ORDER BY u.s)) - 1,
            u.j, u.k, u.a, u.m, 0, u.x, u.b, u.c, u.e
        FROM unnest(v_jobs, v_prios, v_seqs, v_kinds, v_args, v_metas, v_maxs, v_created, v_bases, v_errors)
            AS u(j, p, s, k, a, m, x, c, b, e)
        WHERE u.p = v_prio;
        IF p_kmax IS NOT NULL THEN
            INSERT INTO __SCHEMA__.key_admits (queue, ckey, job_id, ready_slot)
            SELECT p_queue, u.ck, u.j, v_rng.ready_slot
            FROM unnest(v_jobs, v_prios, v_ckeys) AS u(j, p, ck) WHERE u.p = v_prio;
        END IF;
    END LOOP;
    RETURN cardinality(v_jobs);
END $function$;

CREATE OR REPLACE FUNCTION __SCHEMA__.unique_holds(p_job bigint, p_states integer, p_expires timestamp with time zone, p_exact boolean DEFAULT true)
 RETURNS boolean
 LANGUAGE plpgsql
 STABLE
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
DECLARE
    v_state smallint;
    v_name text;
BEGIN
    SELECT d.state INTO v_state FROM __SCHEMA__.done_entries d
    WHERE d.job_id = p_job ORDER BY d.run_lease DESC LIMIT 1;
    IF FOUND THEN
        RETURN (p_states & CASE v_state WHEN 1 THEN 64 WHEN 2 THEN 128 ELSE 256 END) <> 0;
    END IF;
    IF EXISTS (SELECT 1 FROM __SCHEMA__.dlq_entries x WHERE x.job_id = p_job) THEN
        RETURN (p_states & 512) <> 0;
    END IF;
    SELECT x.state INTO v_state FROM __SCHEMA__.deferred_jobs x WHERE x.job_id = p_job;
    IF FOUND THEN
        RETURN (p_states & CASE v_state WHEN 1 THEN 1 WHEN 2 THEN 8 ELSE 32 END) <> 0;
    END IF;
    IF EXISTS (SELECT 1 FROM __SCHEMA__.leases l WHERE l.job_id = p_job) THEN
        RETURN (p_states & 16) <> 0;
    END IF;
    -- The sweep (p_exact false) keeps a key whose holder is still in the
    -- ready ring when both available and running hold: never a live key
    -- deleted, at worst a stale one kept until its ready slot is pruned.
    IF NOT p_exact AND (p_states & 6) = 6
       AND EXISTS (SELECT 1 FROM __SCHEMA__.ready_rows_of(p_job) e WHERE e.job_id = p_job) THEN
        RETURN true;
    END IF;
    v_name := __SCHEMA__.job_load(p_job) ->> 'state';
    IF v_name IS NULL THEN
        RETURN p_expires IS NOT NULL AND p_expires > now() AND (p_states & (64 | 128 | 256 | 512)) <> 0;
    END IF;
    RETURN (p_states & __SCHEMA__.unique_state_bit(v_name)) <> 0;
END $function$;

CREATE OR REPLACE FUNCTION __SCHEMA__.unique_holds_v2(p_job bigint, p_states integer, p_expires timestamp with time zone, p_exact boolean DEFAULT true)
 RETURNS boolean
 LANGUAGE plpgsql
 STABLE
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
DECLARE
    v_state smallint;
    v_name text;
BEGIN
    SELECT d.state INTO v_state FROM __SCHEMA__.done_entries d
    WHERE d.job_id = p_job ORDER BY d.run_lease DESC LIMIT 1;
    IF FOUND THEN
        RETURN (p_states & CASE v_state WHEN 1 THEN 64 WHEN 2 THEN 128 ELSE 256 END) <> 0;
    END IF;
    -- completed by a compact done row (0015): terminal, like a done_entries row
    IF __SCHEMA__.job_done_compact(p_job) THEN
        RETURN (p_states & 64) <> 0;
    END IF;
    IF EXISTS (SELECT 1 FROM __SCHEMA__.dlq_entries x WHERE x.job_id = p_job) THEN
        RETURN (p_states & 512) <> 0;
    END IF;
    SELECT x.state INTO v_state FROM __SCHEMA__.deferred_jobs x WHERE x.job_id = p_job;
    IF FOUND THEN
        RETURN (p_states & CASE v_state WHEN 1 THEN 1 WHEN 2 THEN 8 ELSE 32 END) <> 0;
    END IF;
    IF EXISTS (SELECT 1 FROM __SCHEMA__.leases l WHERE l.job_id = p_job) THEN
        RETURN (p_states & 16) <> 0;
    END IF;
    -- The sweep (p_exact false) keeps a key whose holder is still in the
    -- ready ring when both available and running hold: never a live key
    -- deleted, at worst a stale one kept until its ready slot is pruned.
    IF NOT p_exact AND (p_states & 6) = 6
       AND EXISTS (SELECT 1 FROM __SCHEMA__.ready_rows_of(p_job) e WHERE e.job_id = p_job) THEN
        RETURN true;
    END IF;
    v_name := __SCHEMA__.job_load(p_job) ->> 'state';
    IF v_name IS NULL THEN
        RETURN p_expires IS NOT NULL AND p_expires > now() AND (p_states & (64 | 128 | 256 | 512)) <> 0;
    END IF;
    RETURN (p_states & __SCHEMA__.unique_state_bit(v_name)) <> 0;
END $function$;

CREATE OR REPLACE FUNCTION __SCHEMA__.unique_sweep(p_after_key bytea, p_after_bucket bigint, p_limit integer, OUT swept integer, OUT scanned integer, OUT last_key bytea, OUT last_bucket bigint)
 RETURNS record
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
DECLARE
    v_keys bytea[];
    v_buckets bigint[];
BEGIN
    SELECT array_agg(b.key ORDER BY b.key, b.bucket), array_agg(b.bucket ORDER BY b.key, b.bucket), count(*)
    INTO v_keys, v_buckets, scanned
    FROM (SELECT u.key, u.bucket FROM __SCHEMA__.unique_keys u
          WHERE p_after_key IS NULL OR (u.key, u.bucket) > (p_after_key, p_after_bucket)
          ORDER BY u.key, u.bucket LIMIT p_limit
          FOR UPDATE SKIP LOCKED) b;
    IF scanned = 0 THEN
        swept := 0;
        RETURN;
    END IF;
    last_key := v_keys[scanned];
    last_bucket := v_buckets[scanned];
    DELETE FROM __SCHEMA__.unique_keys u USING unnest(v_keys, v_buckets) AS x(k, b)
    WHERE u.key = x.k AND u.bucket = x.b
      AND ((u.expires_at IS NOT NULL AND u.expires_at <= now())
           OR EXISTS (SELECT 1 FROM __SCHEMA__.done_entries d WHERE d.job_id = u.job_id
                      AND (u.states & CASE d.state WHEN 1 THEN 64 WHEN 2 THEN 128 ELSE 256 END) = 0)
           OR EXISTS (SELECT 1 FROM __SCHEMA__.dlq_entries q WHERE q.job_id = u.job_id AND (u.states & 512) = 0)
           OR (NOT EXISTS (SELECT 1 FROM __SCHEMA__.done_entries d WHERE d.job_id = u.job_id)
               AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.dlq_entries q WHERE q.job_id = u.job_id)
               AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.deferred_jobs f WHERE f.job_id = u.job_id)
               AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.leases l WHERE l.job_id = u.job_id)
               AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.ready_rows_of(u.job_id) e WHERE e.job_id = u.job_id)
               AND NOT ((u.states & (64 | 128 | 256 | 512)) <> 0 AND COALESCE(u.expires_at > now(), false)))
           OR ((u.states & 63) <> 63 AND NOT __SCHEMA__.unique_holds(u.job_id, u.states, u.expires_at, false)));
    GET DIAGNOSTICS swept = ROW_COUNT;
    IF scanned < p_limit THEN
        last_key := NULL;
        last_bucket := NULL;
    END IF;
END $function$;

CREATE OR REPLACE FUNCTION __SCHEMA__.unique_sweep_v2(p_after_key bytea, p_after_bucket bigint, p_limit integer, OUT swept integer, OUT scanned integer, OUT last_key bytea, OUT last_bucket bigint)
 RETURNS record
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
DECLARE
    v_keys bytea[];
    v_buckets bigint[];
BEGIN
    SELECT array_agg(b.key ORDER BY b.key, b.bucket), array_agg(b.bucket ORDER BY b.key, b.bucket), count(*)
    INTO v_keys, v_buckets, scanned
    FROM (SELECT u.key, u.bucket FROM __SCHEMA__.unique_keys u
          WHERE p_after_key IS NULL OR (u.key, u.bucket) > (p_after_key, p_after_bucket)
          ORDER BY u.key, u.bucket LIMIT p_limit
          FOR UPDATE SKIP LOCKED) b;
    IF scanned = 0 THEN
        swept := 0;
        RETURN;
    END IF;
    last_key := v_keys[scanned];
    last_bucket := v_buckets[scanned];
    DELETE FROM __SCHEMA__.unique_keys u USING unnest(v_keys, v_buckets) AS x(k, b)
    WHERE u.key = x.k AND u.bucket = x.b
      AND ((u.expires_at IS NOT NULL AND u.expires_at <= now())
           OR EXISTS (SELECT 1 FROM __SCHEMA__.done_entries d WHERE d.job_id = u.job_id
                      AND (u.states & CASE d.state WHEN 1 THEN 64 WHEN 2 THEN 128 ELSE 256 END) = 0)
           OR EXISTS (SELECT 1 FROM __SCHEMA__.dlq_entries q WHERE q.job_id = u.job_id AND (u.states & 512) = 0)
           OR ((u.states & 64) = 0 AND __SCHEMA__.job_done_compact(u.job_id))
           OR (NOT EXISTS (SELECT 1 FROM __SCHEMA__.done_entries d WHERE d.job_id = u.job_id)
               AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.dlq_entries q WHERE q.job_id = u.job_id)
               AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.deferred_jobs f WHERE f.job_id = u.job_id)
               AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.leases l WHERE l.job_id = u.job_id)
               AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.ready_rows_of(u.job_id) e WHERE e.job_id = u.job_id)
               AND NOT ((u.states & (64 | 128 | 256 | 512)) <> 0 AND COALESCE(u.expires_at > now(), false)))
           OR ((u.states & 63) <> 63 AND NOT __SCHEMA__.unique_holds_v2(u.job_id, u.states, u.expires_at, false)));
    GET DIAGNOSTICS swept = ROW_COUNT;
    IF scanned < p_limit THEN
        last_key := NULL;
        last_bucket := NULL;
    END IF;
END $function$;
