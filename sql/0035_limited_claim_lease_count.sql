-- awa-fast: a limited queue's claim counts its parked callbacks by an index, and only up to its room (issue 16).
-- compatible-with-previous: yes
-- Immutable once landed, like every migration.
--
-- The problem. lane_claim_limited (0010) derives a queue's running attempts
-- from its open receipts plus its leases, the attempts parked for an
-- external callback. It counted those with count(*) over leases WHERE
-- queue = p_queue, and no index of leases starts with queue: every claim
-- of a queue with max_running read every lease of every queue. Leases
-- live as long as their callbacks wait (minutes to hours), so the claim's
-- cost grew with the callbacks parked anywhere in the schema. A schema
-- audit measured a limited claim at 2.2 ms with no leases and 4.9 ms with
-- 20,000 leases of other queues (PostgreSQL 15).
--
-- The fix.
-- 1. An index leases_queue (queue) on the lease ring (one entry per
--    parked callback: attempt_register_callback writes one row per
--    callback wait, nothing on the per-job path). A new lease slot's
--    partition gets it from the parent.
-- 2. The claim counts the queue's leases only up to the room its receipts
--    leave (max_running minus the open attempts of its receipts), in a
--    new function queue_leases_up_to that runs with sequential scans off
--    (a generic plan's estimate for one queue of a few is a large share of
--    the ring, where the planner would read it whole): past
--    that the claim allows nothing whatever the exact count, so it reads
--    at most max_running index entries. The queue's parked callbacks are
--    normally at most max_running anyway (each was claimed under the
--    limit); the bound holds also after the limit was lowered.
--
-- Contract. Same arguments and result rows; the claim allows exactly what
-- it allowed before (min(n, max_running - running) is 0 either way once
-- the leases fill the room). One written value differs: the state row's
-- running column (written for status only, read by nothing: status and
-- queue_limit_status derive running exactly, now by the index) holds
-- the capped count when the leases alone fill the room.
--
-- Compatibility: the previous runtime calls lane_claim_limited with the
-- same arguments and gets the same rows.

CREATE INDEX leases_queue ON __SCHEMA__.leases (queue);

-- The leases of a queue, counted up to p_limit (nothing read when it is 0 or less).
-- Sequential scans off, as 0026, 0027 and 0033 do for their probes: the plan is generic
-- and kept for the session, and a generic estimate for "queue = $1" on a lease ring
-- holding few queues is a large share of it, where a sequential scan reads every lease
-- of every queue.
CREATE FUNCTION __SCHEMA__.queue_leases_up_to(p_queue text, p_limit int) RETURNS int
LANGUAGE plpgsql STABLE
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $$
BEGIN
    IF p_limit <= 0 THEN
        RETURN 0;
    END IF;
    -- Index: leases_queue (queue)
    RETURN (SELECT count(*) FROM (SELECT 1 FROM __SCHEMA__.leases l WHERE l.queue = p_queue LIMIT p_limit) x);
END $$;

CREATE OR REPLACE FUNCTION __SCHEMA__.lane_claim_limited(p_queue text, p_max int, p_stripe int DEFAULT 0, p_stripes int DEFAULT 1)
RETURNS TABLE (job_id bigint, run_lease int, attempt int, max_attempts int, queue text, kind text,
    priority int, args jsonb, metadata jsonb, ready_slot int, lane_id int, lane_seq bigint,
    claim_slot int, claim_id bigint, created_at timestamptz, errors jsonb, callback_result jsonb,
    progress jsonb)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
SET jit = off
AS $$
DECLARE
    v_lim __SCHEMA__.queue_limits%ROWTYPE;
    v_st __SCHEMA__.queue_limit_state%ROWTYPE;
    v_now timestamptz;
    v_tokens float8;
    v_running int := 0;
    v_allow int := greatest(p_max, 0);
    v_limited boolean;
    v_changed boolean := false;
    v_open_slots smallint[];
    v_open_ids bigint[];
    v_seen_lanes int[];
    v_seen_seqs bigint[];
BEGIN
    SELECT * INTO v_lim FROM __SCHEMA__.queue_limits l WHERE l.queue = p_queue;
    v_limited := FOUND AND (v_lim.max_running IS NOT NULL OR v_lim.rate_count IS NOT NULL) AND p_max > 0;
    IF v_limited THEN
        -- one claim at a time per limited queue: nobody else can see the same room
        PERFORM pg_advisory_xact_lock(__SCHEMA__.lock_key('limit'), hashtext(p_queue));
        v_now := clock_timestamp();  -- read after the wait: serialized refills only move forward
        SELECT * INTO v_st FROM __SCHEMA__.queue_limit_state s WHERE s.queue = p_queue;
        IF NOT FOUND THEN
            INSERT INTO __SCHEMA__.queue_limit_state (queue, tokens, refilled_at)
            VALUES (p_queue, COALESCE(v_lim.rate_burst, 0), v_now)
            RETURNING * INTO v_st;
        END IF;
        v_open_slots := v_st.open_slots; v_open_ids := v_st.open_ids;
        v_seen_lanes := v_st.seen_lanes; v_seen_seqs := v_st.seen_seqs;
        IF v_lim.rate_count IS NOT NULL THEN
            v_tokens := least(v_lim.rate_burst, v_st.tokens
                + greatest(extract(epoch FROM v_now - v_st.refilled_at), 0) * v_lim.rate_count / v_lim.rate_per);
            v_allow := least(v_allow, floor(v_tokens + 1e-9)::int);
        END IF;
        IF v_lim.max_running IS NOT NULL THEN
            SELECT COALESCE(array_agg(o.claim_slot ORDER BY o.claim_slot, o.claim_id) FILTER (WHERE o.claim_id IS NOT NULL), '{}'),
                   COALESCE(array_agg(o.claim_id ORDER BY o.claim_slot, o.claim_id) FILTER (WHERE o.claim_id IS NOT NULL), '{}'),
                   COALESCE(array_agg(o.lane_id ORDER BY o.lane_id) FILTER (WHERE o.claim_id IS NULL), '{}'),
                   COALESCE(array_agg(o.seen ORDER BY o.lane_id) FILTER (WHERE o.claim_id IS NULL), '{}'),
                   COALESCE(sum(o.open_n), 0)
            INTO v_open_slots, v_open_ids, v_seen_lanes, v_seen_seqs, v_running
            FROM __SCHEMA__.limit_open_receipts(p_queue, v_st.open_slots, v_st.open_ids,
                                                v_st.seen_lanes, v_st.seen_seqs) o;
            -- attempts parked for a callback (receipt closed, lease live) still run; counted up to
            -- the room the receipts leave, no further (Index: leases_queue (queue))
            v_running := v_running + __SCHEMA__.queue_leases_up_to(p_queue, v_lim.max_running - v_running);
            v_allow := greatest(least(v_allow, v_lim.max_running - v_running), 0);
        END IF;
        v_changed := v_open_ids IS DISTINCT FROM v_st.open_ids OR v_open_slots IS DISTINCT FROM v_st.open_slots
            OR v_seen_seqs IS DISTINCT FROM v_st.seen_seqs OR v_seen_lanes IS DISTINCT FROM v_st.seen_lanes;
    END IF;
    -- Claim what fits, pass its rows through, charge the bucket and write
    -- the state row once (only when something changed), and end with the
    -- backlog marker when the inner claim sent one or a limit cut the claim
    -- short while some lane still holds unclaimed rows (past its effective
    -- cursor: the claim cursor or, when it lags, its lane's last receipt)
    -- and the queue is not paused.
    RETURN QUERY
    WITH c AS MATERIALIZED (
        SELECT * FROM __SCHEMA__.claim_batch_v3(p_queue, v_allow, p_stripe, p_stripes)  -- INNER CLAIM (the one call of the current claim function)
        WHERE v_allow > 0
    ), t AS (
        SELECT count(*) FILTER (WHERE c.job_id IS NOT NULL)::int AS n, COALESCE(bool_or(c.job_id IS NULL), false) AS marker
        FROM c
    ), upd AS (
        UPDATE __SCHEMA__.queue_limit_state s SET
            tokens = CASE WHEN v_tokens IS NULL THEN s.tokens ELSE v_tokens - t.n END,
            refilled_at = CASE WHEN v_tokens IS NULL THEN s.refilled_at ELSE v_now END,
            open_slots = v_open_slots, open_ids = v_open_ids, seen_lanes = v_seen_lanes, seen_seqs = v_seen_seqs,
            running = v_running + t.n, updated_at = v_now
        FROM t
        WHERE v_limited AND s.queue = p_queue AND (t.n > 0 OR v_changed)
        RETURNING 1
    )
    SELECT * FROM c WHERE c.job_id IS NOT NULL
    UNION ALL
    SELECT NULL::bigint, NULL::int, NULL::int, NULL::int, NULL::text, NULL::text, NULL::int, NULL::jsonb,
        NULL::jsonb, NULL::int, NULL::int, NULL::bigint, NULL::int, NULL::bigint, NULL::timestamptz,
        NULL::jsonb, NULL::jsonb, NULL::jsonb
    FROM t
    WHERE t.marker OR (v_limited AND v_allow < p_max AND t.n >= v_allow
        AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.queue_meta m WHERE m.queue = p_queue AND m.paused)
        AND EXISTS (
        SELECT 1 FROM __SCHEMA__.queue_claim_heads h
        JOIN __SCHEMA__.queue_enqueue_heads e ON e.lane_id = h.lane_id
        CROSS JOIN LATERAL (SELECT pg_sequence_last_value(h.claim_seq) AS cur) q0
        WHERE h.queue = p_queue
          AND pg_sequence_last_value(e.enqueue_seq) > greatest(q0.cur,
              -- Index: lease_claims_lane (lane_id, last_seq)
              (SELECT max(x.last_seq) FROM __SCHEMA__.lease_claims x
               WHERE x.lane_id = h.lane_id AND x.last_seq > q0.cur))));
END $$;
