-- awa-fast: the attempt-state sweep probes each state's own receipt (cancel flags name theirs), and a lane reservation refuses a count below one (issue 16).
-- compatible-with-previous: yes
-- Immutable once landed, like every migration.
--
-- 1. attempt_state_sweep (the maintenance leader, once a second) deletes
--    the attempt_state rows (heartbeats, progress, cancel flags) of
--    attempts that ended. It tested every state older than five seconds
--    against every receipt of the claim ring by array membership
--    (a.job_id = ANY (c.job_ids)): the work was the stale states times the
--    receipts. A schema audit measured 67 ms for 1,050 stale states and 42
--    open receipts on PostgreSQL 15; each extra receipt in the ring (about
--    a second of claims per slot) made every state's test longer.
--    A heartbeat's row already stores the receipt it was written under
--    (claim_slot, claim_id), and a receipt never moves while it is open
--    (claim_prune_gate keeps its slot), so the sweep now probes that one
--    receipt by its primary key. A cancel flag (job_cancel on a claimed
--    job) named no receipt; it now stores the receipt it found, which is
--    the one that claimed the row (0031's probe), and gives it to a row
--    that names none. Rows that name no receipt (written before this
--    migration) keep the old test, which the OR below evaluates for them
--    alone: PostgreSQL may evaluate an OR's arms in any order, which
--    changes the cost, never the result.
--    The function runs without sequential scans, as lane_cursor_advance and
--    limit_open_receipts do (0026, 0027): its plan is generic and kept for
--    the leader's session, and a plan made while a claim slot had an empty
--    table's statistics would scan the slot once per state.
--    tests/integration/test_sweep_probes.py counts the claim-ring entries
--    one sweep reads.
--
-- 2. lane_reserve with p_count below one wrote a ready segment that ends
--    before it starts (first_seq + p_count - 1 < first_seq) and took a lane
--    number nobody would fill. No caller of the runtime passes it, but the
--    runtime role may call the function; it now raises
--    invalid_parameter_value before it locks or writes anything. One
--    comparison per call on the enqueue paths that use it.
--
-- Compatibility: same arguments and results for all three functions; the
-- previous runtime's calls are served unchanged.

CREATE OR REPLACE FUNCTION __SCHEMA__.attempt_state_sweep()
 RETURNS integer
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
 SET enable_seqscan TO 'off'
AS $function$
DECLARE
    n int;
BEGIN
    DELETE FROM __SCHEMA__.attempt_state a
    WHERE a.updated_at < now() - interval '5 seconds'
      AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.leases l WHERE l.job_id = a.job_id AND l.run_lease = a.run_lease)
      -- the receipt the state was written under, still open for this attempt
      -- (Index: lease_claims primary key; no row when the state names none)
      AND NOT EXISTS (
          SELECT 1 FROM __SCHEMA__.lease_claims c
          WHERE c.claim_slot = a.claim_slot AND c.claim_id = a.claim_id
            AND a.job_id = ANY (c.job_ids)
            AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.lease_claim_closure_batches b
                            WHERE b.claim_slot = c.claim_slot AND b.claim_id = c.claim_id)
            AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.lease_claim_closures x
                            WHERE x.claim_slot = c.claim_slot AND x.claim_id = c.claim_id AND x.job_id = a.job_id
                              AND x.run_lease = a.run_lease))
      -- a state that names no receipt (or half of one): any open receipt holding the attempt
      AND ((a.claim_slot IS NOT NULL AND a.claim_id IS NOT NULL) OR NOT EXISTS (
          SELECT 1 FROM __SCHEMA__.lease_claims c
          WHERE a.job_id = ANY (c.job_ids)
            AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.lease_claim_closure_batches b
                            WHERE b.claim_slot = c.claim_slot AND b.claim_id = c.claim_id)
            AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.lease_claim_closures x
                            WHERE x.claim_slot = c.claim_slot AND x.claim_id = c.claim_id AND x.job_id = a.job_id
                              AND x.run_lease = a.run_lease)));
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END $function$;

CREATE OR REPLACE FUNCTION __SCHEMA__.lane_reserve(p_queue text, p_priority integer, p_count integer, p_hint integer, OUT lane_id integer, OUT first_seq bigint, OUT ready_slot integer)
 RETURNS record
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
DECLARE
    v_seq regclass;
    v_before bigint;
    v_claim_seq regclass;
    v_claimed bigint;
    v_receipt bigint;
BEGIN
    IF p_count IS NULL OR p_count < 1 THEN
        RAISE EXCEPTION 'lane_reserve needs a count of at least 1 (got %)', p_count
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Reserve one lane number per job to write; a call with no jobs has nothing to reserve.';
    END IF;
    SELECT l.lane_id, l.enqueue_seq INTO lane_id, v_seq
    FROM __SCHEMA__.lane_lock_for_enqueue(p_queue, p_priority, p_hint) l;
    ready_slot := __SCHEMA__.ring_current('ready');
    v_before := pg_sequence_last_value(v_seq);
    first_seq := nextval(v_seq);
    IF p_count > 1 THEN
        PERFORM setval(v_seq, first_seq + p_count - 1, true);
    END IF;
    INSERT INTO __SCHEMA__.ready_segments (ready_slot, lane_id, first_seq, last_seq)
    VALUES (lane_reserve.ready_slot, lane_reserve.lane_id, first_seq, first_seq + p_count - 1);
    -- Wake claimers unless this lane already had a real backlog (64 rows
    -- or more not covered by any committed receipt): then claimers are busy
    -- and come back for more on their own. A small backlog may be a claim
    -- still in flight, which can miss this row, so it is notified too. A
    -- NOTIFY takes a database-wide lock from pre-commit to the end of
    -- commit: notifying every enqueue serializes concurrent producers.
    SELECT h.claim_seq INTO v_claim_seq
    FROM __SCHEMA__.queue_claim_heads h WHERE h.lane_id = lane_reserve.lane_id;
    v_claimed := COALESCE(pg_sequence_last_value(v_claim_seq), 0);
    IF v_before - v_claimed >= 64 THEN
        -- the cursor lags its lane's last receipt: Index lease_claims_lane (lane_id, last_seq)
        SELECT max(c.last_seq) INTO v_receipt FROM __SCHEMA__.lease_claims c
        WHERE c.lane_id = lane_reserve.lane_id AND c.last_seq > v_claimed;
        v_claimed := greatest(v_claimed, v_receipt);
    END IF;
    IF v_before - v_claimed < 64 THEN
        PERFORM pg_notify(__SCHEMA__.notify_channel(), p_queue);
    END IF;
END $function$;

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
    -- Claimed: flag the open attempt so its handler can see it, with the
    -- receipt it runs under (the sweep probes that receipt by key; 0033).
    INSERT INTO __SCHEMA__.attempt_state AS a (job_id, run_lease, claim_slot, claim_id, cancel_requested)
    SELECT p_job_id, r.lease_base + 1, c.claim_slot, c.claim_id, true
    FROM (
        -- the receipt that claimed this very row: the lane's first receipt ending at or
        -- after it (a lane's receipts cover disjoint ranges of its numbers; 0031)
        SELECT x.claim_slot, x.claim_id, x.ready_slot, x.first_seq, x.job_ids
        FROM __SCHEMA__.lease_claims x
        WHERE x.lane_id = r.lane_id AND x.last_seq >= r.lane_seq
        ORDER BY x.last_seq LIMIT 1) c
    WHERE c.ready_slot = r.ready_slot AND c.first_seq <= r.lane_seq AND p_job_id = ANY (c.job_ids)
      AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.lease_claim_closure_batches b
                      WHERE b.claim_slot = c.claim_slot AND b.claim_id = c.claim_id)
      AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.lease_claim_closures x
                      WHERE x.claim_slot = c.claim_slot AND x.claim_id = c.claim_id AND x.job_id = p_job_id
                        AND x.run_lease = r.lease_base + 1)
    ON CONFLICT ON CONSTRAINT attempt_state_pkey DO UPDATE
        SET cancel_requested = true, updated_at = now(),
            -- a row that names its receipt keeps it; one that names none (or half of one) takes this one
            claim_slot = CASE WHEN a.claim_slot IS NULL OR a.claim_id IS NULL THEN excluded.claim_slot
                              ELSE a.claim_slot END,
            claim_id = CASE WHEN a.claim_slot IS NULL OR a.claim_id IS NULL THEN excluded.claim_id
                            ELSE a.claim_id END;
    IF FOUND THEN
        RETURN 'cancel_requested';
    END IF;
    RETURN 'terminal';
END $function$;
