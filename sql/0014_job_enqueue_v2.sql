-- awa-fast: a flatter single enqueue, job_enqueue_v2 (issue 16, step 5).
-- compatible-with-previous: yes
-- Immutable once landed, like every migration.
--
-- Additive: one new function. job_enqueue, lane_reserve and
-- lane_lock_for_enqueue are unchanged and stay for the previous runtime
-- (and for job_enqueue_many, the COPY path and the unique and per-key
-- enqueues, which still reserve through lane_reserve).
--
-- Why: job_enqueue called lane_reserve, which called lane_lock_for_enqueue
-- and ring_current: four PL/pgSQL frames, each with its own SET
-- plan_cache_mode (a GUC save and restore per call), two of them called
-- as table functions (SELECT * FROM f(...): a tuplestore per call). On an
-- embedded 18 server (track_functions = all, pg_stat_statements.track =
-- all) the call took ~210 us of server time, of which its own statements
-- were ~65 us; the rest was the frames around them.
--
-- job_enqueue_v2 does the same work in one frame:
--   1. one statement reads the preferred lane (shard = backend pid modulo
--      queue_meta.enqueue_shards, as lane_lock_for_enqueue starts), its
--      enqueue and claim sequences, and the current ready slot;
--   2. a non-waiting advisory lock on that lane (the same key as
--      lane_lock_for_enqueue, so the two functions exclude each other);
--      when the lane does not exist yet or is busy, it falls back to
--      lane_lock_for_enqueue, which tries the other shards, creates lanes
--      and waits only when every shard is busy, exactly as before;
--   3. under the lock: nextval, then the segment row and the ready row in
--      one statement, then the backlog probe and NOTIFY decision of
--      lane_reserve (0004), unchanged: notify unless 64 rows or more of
--      this lane are not covered by a committed receipt.
-- The lookups of step 1 happen before the lock, so less runs while it is
-- held. The lane lock itself is still held until the caller's transaction
-- ends: that is what makes the lane sequence a commit order. A claim takes
-- the rows visible past the lane's cursor and its receipt covers the range
-- up to the last row it took (claim_batch_v3), so a row whose number was
-- reserved earlier but committed later would be passed over for good.
-- Releasing the lock at the end of the call would allow exactly that.
CREATE FUNCTION __SCHEMA__.job_enqueue_v2(p_queue text, p_priority int, p_kind text, p_args jsonb,
    p_metadata jsonb, p_max_attempts int, p_run_at timestamptz)
RETURNS bigint
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    v_lane int;
    v_seq regclass;
    v_claim_seq regclass;
    v_slot int;
    v_first bigint;
    v_claimed bigint;
    v_receipt bigint;
    v_job bigint;
BEGIN
    IF p_run_at IS NOT NULL AND p_run_at > now() THEN
        v_job := nextval('__SCHEMA__.job_id_seq');
        PERFORM __SCHEMA__.queue_ensure_nowait(p_queue);
        INSERT INTO __SCHEMA__.deferred_jobs (job_id, queue, priority, kind, args, metadata, attempt,
            max_attempts, lease_base, state, run_at, created_at)
        VALUES (v_job, p_queue, p_priority, p_kind, p_args, p_metadata, 0, p_max_attempts, 0, 1, p_run_at, now());
        RETURN v_job;
    END IF;
    -- The preferred lane and the current ready slot, in one statement.
    -- Index: queue_enqueue_heads (queue, priority, shard) unique; queue_claim_heads primary key.
    SELECT h.lane_id, h.enqueue_seq, c.claim_seq,
           (SELECT r.slot FROM __SCHEMA__.ring_rotations r
            WHERE r.ring = 'ready' ORDER BY r.generation DESC LIMIT 1)
    INTO v_lane, v_seq, v_claim_seq, v_slot
    FROM __SCHEMA__.queue_meta m
    JOIN __SCHEMA__.queue_enqueue_heads h
      ON h.queue = m.queue AND h.priority = p_priority AND h.shard = abs(pg_backend_pid()) % m.enqueue_shards
    JOIN __SCHEMA__.queue_claim_heads c ON c.lane_id = h.lane_id
    WHERE m.queue = p_queue;
    IF NOT FOUND OR NOT pg_try_advisory_xact_lock(__SCHEMA__.lock_key('lane'), v_lane) THEN
        -- No such lane yet, or another producer holds it: the shard search
        -- of version 1 (creates lanes, waits only when every shard is busy).
        SELECT l.lane_id, l.enqueue_seq INTO v_lane, v_seq
        FROM __SCHEMA__.lane_lock_for_enqueue(p_queue, p_priority, pg_backend_pid()) l;
        SELECT c.claim_seq INTO STRICT v_claim_seq FROM __SCHEMA__.queue_claim_heads c WHERE c.lane_id = v_lane;
        v_slot := (SELECT r.slot FROM __SCHEMA__.ring_rotations r
                   WHERE r.ring = 'ready' ORDER BY r.generation DESC LIMIT 1);
    END IF;
    -- Under the lane lock: the number before v_first is the lane's last
    -- reserved number (increment 1; nobody else can reserve in this lane).
    v_first := nextval(v_seq);
    v_job := (v_lane::bigint << 40) | v_first;
    WITH seg AS (
        INSERT INTO __SCHEMA__.ready_segments (ready_slot, lane_id, first_seq, last_seq)
        VALUES (v_slot, v_lane, v_first, v_first)
    )
    INSERT INTO __SCHEMA__.ready_entries (ready_slot, lane_id, lane_seq, job_id, kind, args, metadata,
        attempt, max_attempts, lease_base)
    VALUES (v_slot, v_lane, v_first, v_job, p_kind, p_args, p_metadata, 0, p_max_attempts, 0);
    -- The NOTIFY decision of lane_reserve (0004): wake claimers unless the
    -- lane already had 64 rows or more not covered by a committed receipt.
    v_claimed := COALESCE(pg_sequence_last_value(v_claim_seq), 0);
    IF v_first - 1 - v_claimed >= 64 THEN
        -- the cursor lags its lane's last receipt: Index lease_claims_lane (lane_id, last_seq)
        SELECT max(c.last_seq) INTO v_receipt FROM __SCHEMA__.lease_claims c
        WHERE c.lane_id = v_lane AND c.last_seq > v_claimed;
        v_claimed := greatest(v_claimed, v_receipt);
    END IF;
    IF v_first - 1 - v_claimed < 64 THEN
        PERFORM pg_notify(__SCHEMA__.notify_channel(), p_queue);
    END IF;
    RETURN v_job;
END $$;
