-- awa-fast: loading a job reads a few index entries, however full the rings are and whatever statistics its plans were made with (issue 16).
-- compatible-with-previous: yes
-- Immutable once landed, like every migration.
--
-- The problem. job_load_v3 (0015, 0019), behind App.get_job, App.wait, the
-- dashboard and `awa-fast job show`, runs on long-lived pooled connections
-- whose generic plans are made once:
-- - planned while a claim-ring slot had an empty table's statistics (a slot
--   is truncated about once a second), its check whether a job is running
--   read the slot by sequential scans: 308 receipts and 307 closures for
--   each load of a running job once the slot held 300
--   (tests/integration/test_job_load_probes.py);
-- - with small ring partitions its lookups by job id were sequential scans
--   of done_entries and ready_entries partitions (cheap while they are
--   small, kept as they grow: generic plans);
-- - even by index, the running check read every receipt of the job's lane
--   that ended after the job's row (the range last_seq >= the row's number,
--   filtered on first_seq): 301 index entries for a job followed by 300
--   receipts of its lane.
--
-- The fix (same arguments and results): the function runs with
-- enable_seqscan off, and the running check reads only the lane's first
-- receipt that ends at or after the row (ORDER BY last_seq LIMIT 1: a
-- lane's receipts cover disjoint ranges of its numbers, each number is
-- claimed once, so no other receipt can hold the row). Every other lookup
-- of the function already has its index (done_entries_job, the primary
-- keys of dlq_entries, deferred_jobs, ready_entries, ready_tombstones,
-- attempt_state, lease_claim_closures and lease_claim_closure_batches,
-- leases_job, ready_entries_job).
--
-- Compatibility: the previous runtime and clients call job_load_keyed_v2,
-- which calls this function, and get the same results.

CREATE OR REPLACE FUNCTION __SCHEMA__.job_load_v3(p_job_id bigint)
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
        -- the receipt that claimed this very row (not an older attempt's). A lane's
        -- receipts cover disjoint ranges of its numbers, so it is the lane's first
        -- receipt ending at or after the row: one index probe per claim partition,
        -- however many receipts of the lane follow it (0029)
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
