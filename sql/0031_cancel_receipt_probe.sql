-- awa-fast: a cancel, and the first job loader, find a claimed job's receipt by one probe per claim slot (issue 16).
-- compatible-with-previous: yes
-- Immutable once landed, like every migration.
--
-- The problem. 0029 gave job_load_v3 (App.get_job) a running check that
-- reads only the lane's first receipt ending at or after the job's row.
-- Two other functions kept the old form, the range last_seq >= the row's
-- number filtered on first_seq, which reads every receipt of the lane
-- claimed after the job's (index entry and row each), on every
-- PostgreSQL version:
-- - job_cancel (App.cancel, `awa-fast job cancel`, the dashboard's cancel,
--   through job_cancel_keyed), for a job that was claimed: on PostgreSQL
--   15 with 2,000 later receipts in the lane, 214 buffers and 2.2 ms for
--   that statement against 21 and 0.3 ms in the form below (review
--   helper's measurement), while the call holds the lane's claim head
--   FOR UPDATE, so claimers skip the lane meanwhile;
-- - job_load (the first version), which unique_holds_v2 calls when a
--   unique enqueue finds its key held by a job it cannot place otherwise.
-- The worst case is a job whose own receipt is closed (completed by a
-- compact done row, so no per-job done row answers first): with 300 later
-- receipts in its lane, one cancel or load read 303 index entries and rows
-- of the claim ring (tests/integration/test_job_load_probes.py).
--
-- The fix (same arguments and results): both read the lane's first
-- receipt ending at or after the row (ORDER BY last_seq LIMIT 1: a lane's
-- receipts cover disjoint ranges of its numbers, each number is claimed
-- once, so no other receipt can hold the row), and both run with
-- enable_seqscan off, as job_load_v3 does since 0029, so a plan made while
-- a ring slot had an empty table's statistics still probes by key.
--
-- Compatibility: the previous runtime calls the same functions
-- (job_cancel_keyed calls job_cancel) and gets the same results.

CREATE OR REPLACE FUNCTION __SCHEMA__.job_cancel(p_job_id bigint)
 RETURNS text
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
 SET enable_seqscan TO 'off'
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
        -- the receipt that claimed this very row: the lane's first receipt ending at or
        -- after it (a lane's receipts cover disjoint ranges of its numbers; 0031)
        SELECT 1 FROM (
            SELECT x.claim_slot, x.claim_id, x.ready_slot, x.first_seq, x.job_ids
            FROM __SCHEMA__.lease_claims x
            WHERE x.lane_id = r.lane_id AND x.last_seq >= r.lane_seq
            ORDER BY x.last_seq LIMIT 1) c
        WHERE c.ready_slot = r.ready_slot AND c.first_seq <= r.lane_seq AND p_job_id = ANY (c.job_ids)
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

CREATE OR REPLACE FUNCTION __SCHEMA__.job_load(p_job_id bigint)
 RETURNS jsonb
 LANGUAGE plpgsql
 STABLE
 SET plan_cache_mode TO 'force_generic_plan'
 SET enable_seqscan TO 'off'
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
        -- the receipt that claimed this very row (not an older attempt's): the lane's
        -- first receipt ending at or after it, as job_load_v3 finds it (0029, 0031)
        SELECT 1 FROM (
            SELECT x.claim_slot, x.claim_id, x.ready_slot, x.first_seq, x.job_ids
            FROM __SCHEMA__.lease_claims x
            WHERE x.lane_id = r.lane_id AND x.last_seq >= r.lane_seq
            ORDER BY x.last_seq LIMIT 1) c
        WHERE c.ready_slot = r.ready_slot AND c.first_seq <= r.lane_seq AND r.job_id = ANY (c.job_ids)
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
