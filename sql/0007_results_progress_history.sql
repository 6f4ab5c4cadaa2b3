-- awa-fast storage, version 7: job results, progress that survives retry,
-- and history retention as a setting.
-- compatible-with-previous: yes
-- Immutable once landed, like every migration.
--
-- What and why:
-- 1. Results. done_entries.result (jsonb, NULL) holds the value a handler
--    returned. Only result-carrying completions write it: the runtime
--    sends them through a separate binary COPY that names the column (and
--    lease-backed ones through receipt_complete_results below); the common
--    no-result completion keeps its COPY (which does not name the column)
--    and its statements.
-- 2. Progress survives retry (Awa ADR-014). deferred_jobs.progress and
--    ready_entries.progress (jsonb, NULL) carry the last flushed progress of
--    an attempt (attempt_state.progress, else what the attempt itself was
--    claimed with) through retry, snooze, rescue, callback retry/resume and
--    promotion; claim_batch_v3 returns it as a trailing column. Terminal
--    transitions drop it. job_load_v2 returns progress and result.
-- 3. History retention. queue_meta.history_retention (default 1 hour). The
--    ready ring is shared by every queue: the maintenance leader rotates it
--    every max(history_retention) / (slots - 1) and prunes a sealed slot
--    with ring_prune_v2, which keeps it until it has been quiet (every
--    attempt in it closed, nothing pending) for at least the retention. The
--    moment it went quiet is recorded on its ring_slots row (once per slot
--    per ring cycle), so it survives a change of leader.
--
-- Compatibility: additive only. Every new column is nullable or has a
-- constant default (ALTER TABLE ... ADD COLUMN: no table rewrite). Functions
-- whose output or signature changes get new names (claim_batch_v3,
-- job_load_v2, attempt_defer_v2, ring_prune_v2); the ones
-- replaced in place (attempt_close, callback_resolve, deferred_promote,
-- receipt_rescue_stale, lease_rescue_expired) keep their signature and
-- output and only also carry progress. The previous release's runtime may
-- keep running against this schema: it claims with claim_batch_v2 (its
-- snapshots simply carry no progress), completes by the same COPY, and its
-- leader prunes with ring_prune (no retention) as before.

ALTER TABLE __SCHEMA__.done_entries ADD COLUMN result jsonb;
ALTER TABLE __SCHEMA__.ready_entries ADD COLUMN progress jsonb;
ALTER TABLE __SCHEMA__.deferred_jobs ADD COLUMN progress jsonb;
ALTER TABLE __SCHEMA__.queue_meta ADD COLUMN history_retention interval NOT NULL DEFAULT interval '1 hour'
    CONSTRAINT queue_meta_history_retention_check CHECK (history_retention >= interval '0');
-- quiet_generation: the ring generation in which the slot was last seen
-- quiet by ring_prune_v2, quiet_at: when (only valid for the slot's latest
-- generation, so a slot reused later never inherits an old quiet time).
ALTER TABLE __SCHEMA__.ring_slots ADD COLUMN quiet_generation bigint, ADD COLUMN quiet_at timestamptz;

---------------------------------------------------------------------------
-- Progress carry
---------------------------------------------------------------------------

-- attempt_defer with the attempt's last flushed progress (p_progress, from
-- its attempt_state row; NULL: the progress it was claimed with, carried on
-- its ready row, so an attempt that set none passes the older value on).
CREATE FUNCTION __SCHEMA__.attempt_defer_v2(p_outcome int, p_delay float8, p_ready_slot int, p_lane_id int,
    p_lane_seq bigint, p_job_id bigint, p_run_lease int, p_attempt int, p_error text, p_progress jsonb) RETURNS int
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    b record;
    v_delay float8 := p_delay;
BEGIN
    SELECT r.*, l.queue, l.priority INTO STRICT b
    FROM __SCHEMA__.ready_entries r JOIN __SCHEMA__.queue_lanes l ON l.lane_id = r.lane_id
    WHERE r.ready_slot = p_ready_slot AND r.lane_id = p_lane_id AND r.lane_seq = p_lane_seq;
    IF p_outcome = 4 AND p_attempt >= b.max_attempts THEN
        RETURN __SCHEMA__.attempt_terminal(2, p_ready_slot, p_lane_id, p_lane_seq, p_job_id, p_run_lease,
            p_attempt, COALESCE(p_error, 'retry requested') || ' (attempts exhausted)');
    END IF;
    IF v_delay IS NULL THEN
        -- exponential backoff with jitter: attempt^4 + 15 + rand * 30 * attempt seconds, capped at a day
        v_delay := least(power(p_attempt, 4) + 15 + random() * 30 * p_attempt, 86400);
    END IF;
    INSERT INTO __SCHEMA__.deferred_jobs (job_id, queue, priority, kind, args, metadata, attempt, max_attempts,
        lease_base, state, run_at, created_at, errors, callback_result, progress)
    VALUES (p_job_id, b.queue, b.priority, b.kind, b.args, b.metadata,
        CASE WHEN p_outcome = 5 THEN p_attempt - 1 ELSE p_attempt END, b.max_attempts, p_run_lease,
        CASE WHEN p_outcome = 5 THEN 3 ELSE 2 END, now() + make_interval(secs => v_delay), b.created_at,
        CASE WHEN p_outcome = 4 THEN __SCHEMA__.errors_append(b.errors, p_attempt, p_error) ELSE b.errors END,
        NULL, COALESCE(p_progress, b.progress));
    RETURN p_outcome;
END $$;

-- Same contract as version 1; a retry or snooze now carries progress.
CREATE OR REPLACE FUNCTION __SCHEMA__.attempt_close(p_job_ids bigint[], p_run_leases int[], p_claim_slots int[],
    p_claim_ids bigint[], p_outcomes int[], p_delays float8[], p_errors text[])
RETURNS TABLE (job_id bigint, run_lease int, status text)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    i int;
    v_lease __SCHEMA__.leases%ROWTYPE;
    v_rec record;
    v_slot int; v_lane int; v_seq bigint; v_attempt int;
    v_outcome int;
    v_cancel boolean;
    v_progress jsonb;
    v_result int;
BEGIN
    FOR i IN 1 .. coalesce(cardinality(p_job_ids), 0) LOOP
        job_id := p_job_ids[i];
        run_lease := p_run_leases[i];
        v_outcome := p_outcomes[i];
        DELETE FROM __SCHEMA__.leases l WHERE l.job_id = p_job_ids[i] AND l.run_lease = p_run_leases[i]
        RETURNING * INTO v_lease;
        IF FOUND THEN
            v_slot := v_lease.ready_slot; v_lane := v_lease.lane_id; v_seq := v_lease.lane_seq;
            v_attempt := v_lease.attempt;
        ELSE
            PERFORM pg_advisory_xact_lock(__SCHEMA__.lock_key('claim'), (p_claim_ids[i] % 2147483647)::int);
            SELECT c.ready_slot, c.lane_id, c.lane_seqs[array_position(c.job_ids, p_job_ids[i])] AS seq
            INTO v_rec
            FROM __SCHEMA__.lease_claims c
            WHERE c.claim_slot = p_claim_slots[i] AND c.claim_id = p_claim_ids[i]
              AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.lease_claim_closure_batches b
                              WHERE b.claim_slot = c.claim_slot AND b.claim_id = c.claim_id)
              AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.lease_claim_closures x
                              WHERE x.claim_slot = c.claim_slot AND x.claim_id = c.claim_id AND x.job_id = p_job_ids[i]
                                AND x.run_lease = p_run_leases[i]);
            IF NOT FOUND OR v_rec.seq IS NULL THEN
                status := 'stale';
                RETURN NEXT;
                CONTINUE;
            END IF;
            v_slot := v_rec.ready_slot; v_lane := v_rec.lane_id; v_seq := v_rec.seq;
            SELECT r.attempt + 1 INTO STRICT v_attempt FROM __SCHEMA__.ready_entries r
            WHERE r.ready_slot = v_slot AND r.lane_id = v_lane AND r.lane_seq = v_seq;
        END IF;
        v_cancel := NULL;
        v_progress := NULL;
        DELETE FROM __SCHEMA__.attempt_state a WHERE a.job_id = p_job_ids[i] AND a.run_lease = p_run_leases[i]
        RETURNING a.cancel_requested, a.progress INTO v_cancel, v_progress;
        IF coalesce(v_cancel, false) AND v_outcome IN (4, 5) THEN
            v_outcome := 3;
        END IF;
        IF v_outcome IN (1, 2, 3) THEN
            v_result := __SCHEMA__.attempt_terminal(v_outcome, v_slot, v_lane, v_seq, p_job_ids[i],
                p_run_leases[i], v_attempt, p_errors[i]);
        ELSE
            v_result := __SCHEMA__.attempt_defer_v2(v_outcome, p_delays[i], v_slot, v_lane, v_seq, p_job_ids[i],
                p_run_leases[i], v_attempt, p_errors[i], v_progress);
        END IF;
        IF v_lease.job_id IS NULL THEN
            INSERT INTO __SCHEMA__.lease_claim_closures (claim_slot, claim_id, job_id, run_lease, outcome)
            VALUES (p_claim_slots[i], p_claim_ids[i], p_job_ids[i], p_run_leases[i], v_result);
        END IF;
        v_lease := NULL;
        status := 'ok';
        RETURN NEXT;
    END LOOP;
END $$;

-- Same contract as version 1; retry and resume now carry progress.
CREATE OR REPLACE FUNCTION __SCHEMA__.callback_resolve(p_token uuid, p_action text, p_payload jsonb, p_error text)
RETURNS text
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    v_lease __SCHEMA__.leases%ROWTYPE;
    v_progress jsonb;
    b record;
    v_rng record;
BEGIN
    DELETE FROM __SCHEMA__.leases l WHERE l.callback_token = p_token RETURNING * INTO v_lease;
    IF NOT FOUND THEN
        RETURN 'unknown';
    END IF;
    DELETE FROM __SCHEMA__.attempt_state a WHERE a.job_id = v_lease.job_id AND a.run_lease = v_lease.run_lease
    RETURNING a.progress INTO v_progress;
    IF p_action = 'complete' THEN
        PERFORM __SCHEMA__.attempt_terminal(1, v_lease.ready_slot, v_lease.lane_id, v_lease.lane_seq,
            v_lease.job_id, v_lease.run_lease, v_lease.attempt, NULL);
    ELSIF p_action = 'fail' THEN
        PERFORM __SCHEMA__.attempt_terminal(2, v_lease.ready_slot, v_lease.lane_id, v_lease.lane_seq,
            v_lease.job_id, v_lease.run_lease, v_lease.attempt, COALESCE(p_error, 'failed by callback'));
    ELSIF p_action = 'retry' THEN
        PERFORM __SCHEMA__.attempt_defer_v2(4, NULL, v_lease.ready_slot, v_lease.lane_id, v_lease.lane_seq,
            v_lease.job_id, v_lease.run_lease, v_lease.attempt, COALESCE(p_error, 'retried by callback'), v_progress);
    ELSIF p_action = 'resume' THEN
        SELECT r.*, l.priority INTO STRICT b
        FROM __SCHEMA__.ready_entries r JOIN __SCHEMA__.queue_lanes l ON l.lane_id = r.lane_id
        WHERE r.ready_slot = v_lease.ready_slot AND r.lane_id = v_lease.lane_id AND r.lane_seq = v_lease.lane_seq;
        -- ready_append, plus the progress column
        SELECT * INTO v_rng FROM __SCHEMA__.lane_reserve(v_lease.queue, b.priority, 1, pg_backend_pid());
        INSERT INTO __SCHEMA__.ready_entries (ready_slot, lane_id, lane_seq, job_id, kind, args, metadata,
            attempt, max_attempts, lease_base, created_at, errors, callback_result, progress)
        VALUES (v_rng.ready_slot, v_rng.lane_id, v_rng.first_seq, v_lease.job_id, b.kind, b.args, b.metadata,
            v_lease.attempt - 1, b.max_attempts, v_lease.run_lease, b.created_at, b.errors,
            COALESCE(p_payload, 'null'::jsonb), COALESCE(v_progress, b.progress));
    ELSE
        RAISE EXCEPTION 'unknown callback action %', p_action USING ERRCODE = '22023';
    END IF;
    RETURN 'ok';
END $$;

-- Same contract as version 1; the promoted ready row carries progress.
CREATE OR REPLACE FUNCTION __SCHEMA__.deferred_promote(p_limit int) RETURNS int
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    d record;
    v_rng record;
    n int := 0;
BEGIN
    FOR d IN
        DELETE FROM __SCHEMA__.deferred_jobs x
        WHERE x.job_id IN (SELECT y.job_id FROM __SCHEMA__.deferred_jobs y WHERE y.run_at <= now()
                           ORDER BY y.run_at LIMIT p_limit FOR UPDATE SKIP LOCKED)
        RETURNING *
    LOOP
        -- ready_append, plus the progress column
        SELECT * INTO v_rng FROM __SCHEMA__.lane_reserve(d.queue, d.priority, 1, pg_backend_pid());
        INSERT INTO __SCHEMA__.ready_entries (ready_slot, lane_id, lane_seq, job_id, kind, args, metadata,
            attempt, max_attempts, lease_base, created_at, errors, callback_result, progress)
        VALUES (v_rng.ready_slot, v_rng.lane_id, v_rng.first_seq, d.job_id, d.kind, d.args, d.metadata, d.attempt,
            d.max_attempts, d.lease_base, d.created_at, d.errors, d.callback_result, d.progress);
        n := n + 1;
    END LOOP;
    RETURN n;
END $$;

-- Same contract as version 1; a rescued attempt's requeued row carries
-- its last flushed progress.
CREATE OR REPLACE FUNCTION __SCHEMA__.receipt_rescue_stale(p_limit int) RETURNS int
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    r record;
    v_body record;
    v_rng record;
    n int := 0;
    v_attempt int;
    v_max int;
    v_reason text;
    v_progress jsonb;
BEGIN
    FOR r IN
        SELECT c.claim_slot, c.claim_id, c.ready_slot, c.lane_id, u.j AS job_id, u.l AS run_lease,
               u.s AS lane_seq, (c.deadline_at < now()) AS past_deadline
        FROM __SCHEMA__.lease_claims c
        JOIN __SCHEMA__.queue_lanes ql ON ql.lane_id = c.lane_id
        JOIN __SCHEMA__.queue_meta m ON m.queue = ql.queue
        CROSS JOIN LATERAL unnest(c.job_ids, c.run_leases, c.lane_seqs) AS u(j, l, s)
        LEFT JOIN __SCHEMA__.attempt_state a ON a.job_id = u.j AND a.run_lease = u.l
        WHERE (c.deadline_at < now() OR c.claimed_at < now() - m.heartbeat_timeout)
          AND (c.deadline_at < now() OR COALESCE(a.heartbeat_at, c.claimed_at) < now() - m.heartbeat_timeout)
          AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.lease_claim_closure_batches b
                          WHERE b.claim_slot = c.claim_slot AND b.claim_id = c.claim_id)
          AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.lease_claim_closures x
                          WHERE x.claim_slot = c.claim_slot AND x.claim_id = c.claim_id AND x.job_id = u.j AND x.run_lease = u.l)
        -- receipt locks are taken in ascending claim_id, like every batch path
        ORDER BY c.claim_id
        LIMIT p_limit
    LOOP
        BEGIN
            PERFORM pg_advisory_xact_lock(__SCHEMA__.lock_key('claim'), (r.claim_id % 2147483647)::int);
            INSERT INTO __SCHEMA__.lease_claim_closures (claim_slot, claim_id, job_id, run_lease, outcome)
            SELECT r.claim_slot, r.claim_id, r.job_id, r.run_lease, 7
            WHERE NOT EXISTS (SELECT 1 FROM __SCHEMA__.lease_claim_closure_batches b
                              WHERE b.claim_slot = r.claim_slot AND b.claim_id = r.claim_id)
            ON CONFLICT DO NOTHING;
            IF FOUND THEN
                v_progress := NULL;
                DELETE FROM __SCHEMA__.attempt_state a WHERE a.job_id = r.job_id AND a.run_lease = r.run_lease
                RETURNING a.progress INTO v_progress;
                SELECT e.attempt + 1, e.max_attempts INTO STRICT v_attempt, v_max FROM __SCHEMA__.ready_entries e
                WHERE e.ready_slot = r.ready_slot AND e.lane_id = r.lane_id AND e.lane_seq = r.lane_seq;
                v_reason := CASE WHEN r.past_deadline THEN 'rescued: deadline exceeded'
                                 ELSE 'rescued: heartbeat stale' END;
                IF v_attempt >= v_max THEN
                    PERFORM __SCHEMA__.attempt_terminal(2, r.ready_slot, r.lane_id, r.lane_seq, r.job_id,
                        r.run_lease, v_attempt, v_reason || ' (attempts exhausted)');
                ELSE
                    -- ready_append, plus the progress column
                    SELECT e.*, ql.queue, ql.priority INTO STRICT v_body FROM __SCHEMA__.ready_entries e
                    JOIN __SCHEMA__.queue_lanes ql ON ql.lane_id = e.lane_id
                    WHERE e.ready_slot = r.ready_slot AND e.lane_id = r.lane_id AND e.lane_seq = r.lane_seq;
                    SELECT * INTO v_rng FROM __SCHEMA__.lane_reserve(v_body.queue, v_body.priority, 1, pg_backend_pid());
                    INSERT INTO __SCHEMA__.ready_entries (ready_slot, lane_id, lane_seq, job_id, kind, args, metadata,
                        attempt, max_attempts, lease_base, created_at, errors, callback_result, progress)
                    VALUES (v_rng.ready_slot, v_rng.lane_id, v_rng.first_seq, r.job_id, v_body.kind, v_body.args,
                        v_body.metadata, v_attempt, v_body.max_attempts, r.run_lease, v_body.created_at,
                        __SCHEMA__.errors_append(v_body.errors, v_attempt, v_reason), v_body.callback_result,
                        COALESCE(v_progress, v_body.progress));
                END IF;
                n := n + 1;
            END IF;
        EXCEPTION WHEN OTHERS THEN
            RAISE WARNING 'awa_fast: rescue of job % (run_lease %) failed and was skipped: %',
                r.job_id, r.run_lease, SQLERRM;
        END;
    END LOOP;
    RETURN n;
END $$;

-- Same contract as version 1; the retry of a timed-out callback carries progress.
CREATE OR REPLACE FUNCTION __SCHEMA__.lease_rescue_expired(p_limit int) RETURNS int
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    v_lease record;
    v_progress jsonb;
    n int := 0;
BEGIN
    FOR v_lease IN
        SELECT l.job_id, l.run_lease FROM __SCHEMA__.leases l
        WHERE l.callback_timeout_at < now() LIMIT p_limit
    LOOP
        BEGIN
            DELETE FROM __SCHEMA__.leases l WHERE l.job_id = v_lease.job_id AND l.run_lease = v_lease.run_lease
            RETURNING * INTO v_lease;
            IF FOUND THEN
                v_progress := NULL;
                DELETE FROM __SCHEMA__.attempt_state a
                WHERE a.job_id = v_lease.job_id AND a.run_lease = v_lease.run_lease
                RETURNING a.progress INTO v_progress;
                PERFORM __SCHEMA__.attempt_defer_v2(4, NULL, v_lease.ready_slot, v_lease.lane_id, v_lease.lane_seq,
                    v_lease.job_id, v_lease.run_lease, v_lease.attempt, 'callback timed out', v_progress);
                n := n + 1;
            END IF;
        EXCEPTION WHEN OTHERS THEN
            RAISE WARNING 'awa_fast: callback rescue of job % failed and was skipped: %', v_lease.job_id, SQLERRM;
        END;
    END LOOP;
    RETURN n;
END $$;

---------------------------------------------------------------------------
-- Claim, version 3: claim_batch_v2 plus a trailing progress column (the
-- last flushed progress of an earlier attempt, NULL for a job that never
-- set any). Same locks, same order, same backlog marker (all NULL).
---------------------------------------------------------------------------

CREATE FUNCTION __SCHEMA__.claim_batch_v3(p_queue text, p_max int, p_stripe int DEFAULT 0, p_stripes int DEFAULT 1)
RETURNS TABLE (job_id bigint, run_lease int, attempt int, max_attempts int, queue text, kind text,
    priority int, args jsonb, metadata jsonb, ready_slot int, lane_id int, lane_seq bigint,
    claim_slot int, claim_id bigint, created_at timestamptz, errors jsonb, callback_result jsonb,
    progress jsonb)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    v_meta __SCHEMA__.queue_meta%ROWTYPE;
    v_lids int[];
    v_prios int[];
    v_cseqs regclass[];
    v_eseqs regclass[];
    v_curs bigint[];
    v_done_lids int[] := '{}';
    v_done_curs bigint[] := '{}';
    v_lid int;
    v_prio int;
    v_cseq regclass;
    v_eseq regclass;
    i int;
    v_cur bigint;
    v_last bigint;
    v_slot int;
    v_claim_slot int;
    v_claim_id bigint;
    v_left int := p_max;
    v_n int;
    v_aging float8;
    v_skipped boolean := false;
BEGIN
    SELECT * INTO v_meta FROM __SCHEMA__.queue_meta m WHERE m.queue = p_queue;
    IF NOT FOUND THEN
        PERFORM __SCHEMA__.queue_ensure(p_queue);
        SELECT * INTO STRICT v_meta FROM __SCHEMA__.queue_meta m WHERE m.queue = p_queue;
    END IF;
    IF v_meta.paused OR p_max < 1 THEN
        RETURN;
    END IF;
    v_aging := greatest(extract(epoch FROM v_meta.aging_interval), 0.001);
    -- Candidate lanes from the two sequences alone: the enqueue head is past
    -- the claim cursor. A superset of the lanes with work (the cursor lags
    -- its own last receipt); no partitioned table is read here, so an idle
    -- queue costs no probe of every ring partition.
    SELECT array_agg(h.lane_id ORDER BY h.lane_id), array_agg(h.priority ORDER BY h.lane_id),
           array_agg(h.claim_seq ORDER BY h.lane_id), array_agg(e.enqueue_seq ORDER BY h.lane_id)
    INTO v_lids, v_prios, v_cseqs, v_eseqs
    FROM __SCHEMA__.queue_claim_heads h
    JOIN __SCHEMA__.queue_enqueue_heads e ON e.lane_id = h.lane_id
    WHERE h.queue = p_queue
      AND pg_sequence_last_value(e.enqueue_seq) > pg_sequence_last_value(h.claim_seq);
    IF cardinality(v_lids) > 1 THEN
        -- Several lanes: claim-time aged priority, then oldest head, then the
        -- caller's stripe (the order of claim_batch). Lanes whose rows are all
        -- covered by receipts already (head_at NULL) come last and are only
        -- noted with their position, for the backlog check below.
        SELECT array_agg(x.lid ORDER BY x.k1, x.k2, x.k3, x.k4), array_agg(x.prio ORDER BY x.k1, x.k2, x.k3, x.k4),
               array_agg(x.cseq ORDER BY x.k1, x.k2, x.k3, x.k4), array_agg(x.eseq ORDER BY x.k1, x.k2, x.k3, x.k4),
               array_agg(CASE WHEN x.k3 IS NULL THEN x.cur END ORDER BY x.k1, x.k2, x.k3, x.k4)
        INTO v_lids, v_prios, v_cseqs, v_eseqs, v_curs
        FROM (
            SELECT h.lane_id AS lid, h.priority AS prio, h.claim_seq AS cseq, e.enqueue_seq AS eseq, q.cur,
                h.priority - floor(extract(epoch FROM now() - a.head_at) / v_aging) AS k1,
                h.priority AS k2, a.head_at AS k3,
                ((h.shard - p_stripe) % greatest(p_stripes, 1) + greatest(p_stripes, 1))
                    % greatest(p_stripes, 1) AS k4
            FROM __SCHEMA__.queue_claim_heads h
            JOIN __SCHEMA__.queue_enqueue_heads e ON e.lane_id = h.lane_id
            CROSS JOIN LATERAL (SELECT pg_sequence_last_value(h.claim_seq) AS seq_cur,
                                       pg_sequence_last_value(e.enqueue_seq) AS head) q0
            CROSS JOIN LATERAL (
                -- the effective cursor: the claim cursor lags one claim behind
                -- its own receipts (Index: lease_claims_lane)
                SELECT greatest(q0.seq_cur, (SELECT max(c.last_seq) FROM __SCHEMA__.lease_claims c
                                             WHERE c.lane_id = h.lane_id AND c.last_seq > q0.seq_cur)) AS cur,
                       q0.head) q
            LEFT JOIN LATERAL (
                -- age of the lane head: its oldest unclaimed segment
                SELECT g.created_at AS head_at FROM __SCHEMA__.ready_segments g
                WHERE g.lane_id = h.lane_id AND g.last_seq > q.cur AND q.head > q.cur
                ORDER BY g.last_seq LIMIT 1) a ON true
            WHERE h.lane_id = ANY(v_lids)
        ) x;
    END IF;
    IF v_lids IS NOT NULL THEN
        v_claim_slot := __SCHEMA__.ring_current('claim');
    END IF;
    FOR i IN 1 .. COALESCE(cardinality(v_lids), 0) LOOP
        EXIT WHEN v_left <= 0;
        v_lid := v_lids[i];
        v_prio := v_prios[i];
        v_cseq := v_cseqs[i];
        v_eseq := v_eseqs[i];
        IF v_curs[i] IS NOT NULL THEN
            -- nothing visible past its receipts: note the position, take no lock
            v_done_lids := v_done_lids || v_lid;
            v_done_curs := v_done_curs || v_curs[i];
            CONTINUE;
        END IF;
        PERFORM 1 FROM __SCHEMA__.queue_claim_heads h WHERE h.lane_id = v_lid FOR UPDATE SKIP LOCKED;
        IF NOT FOUND THEN
            v_skipped := true;  -- another claimer holds this lane head right now
            CONTINUE;
        END IF;
        v_cur := __SCHEMA__.lane_cursor_advance(v_lid, v_cseq);
        LOOP
            -- nothing reserved past the position: no segment to look up
            EXIT WHEN v_left <= 0 OR pg_sequence_last_value(v_eseq) <= v_cur;
            -- Index: ready_segments_lane (lane_id, last_seq)
            SELECT g.ready_slot INTO v_slot FROM __SCHEMA__.ready_segments g
            WHERE g.lane_id = v_lid AND g.last_seq > v_cur
            ORDER BY g.last_seq LIMIT 1;
            EXIT WHEN NOT FOUND;
            v_claim_id := nextval('__SCHEMA__.claim_id_seq');
            RETURN QUERY
            WITH picked AS MATERIALIZED (
                -- Index: ready_entries primary key (ready_slot, lane_id, lane_seq)
                SELECT r.*, (t.lane_seq IS NOT NULL) AS tomb
                FROM __SCHEMA__.ready_entries r
                LEFT JOIN __SCHEMA__.ready_tombstones t
                    ON t.ready_slot = r.ready_slot AND t.lane_id = r.lane_id AND t.lane_seq = r.lane_seq
                WHERE r.ready_slot = v_slot AND r.lane_id = v_lid AND r.lane_seq > v_cur
                ORDER BY r.lane_seq
                LIMIT v_left
            ), receipt AS (
                INSERT INTO __SCHEMA__.lease_claims (claim_slot, claim_id, lane_id, ready_slot, first_seq,
                    last_seq, job_ids, run_leases, lane_seqs, deadline_at)
                SELECT v_claim_slot, v_claim_id, v_lid, v_slot, v_cur + 1, max(p.lane_seq),
                    COALESCE(array_agg(p.job_id ORDER BY p.lane_seq) FILTER (WHERE NOT p.tomb), '{}'),
                    COALESCE(array_agg(p.lease_base + 1 ORDER BY p.lane_seq) FILTER (WHERE NOT p.tomb), '{}'),
                    COALESCE(array_agg(p.lane_seq ORDER BY p.lane_seq) FILTER (WHERE NOT p.tomb), '{}'),
                    now() + v_meta.deadline
                FROM picked p
                HAVING count(*) > 0
                RETURNING 1
            )
            SELECT p.job_id, p.lease_base + 1, p.attempt + 1, p.max_attempts::int, p_queue, p.kind,
                v_prio, p.args, p.metadata, v_slot, v_lid, p.lane_seq, v_claim_slot,
                v_claim_id, p.created_at, p.errors, p.callback_result, p.progress
            FROM picked p
            WHERE NOT p.tomb
            ORDER BY p.lane_seq;
            GET DIAGNOSTICS v_n = ROW_COUNT;
            SELECT c.last_seq INTO v_last FROM __SCHEMA__.lease_claims c
            WHERE c.claim_slot = v_claim_slot AND c.claim_id = v_claim_id;
            EXIT WHEN NOT FOUND;
            v_cur := v_last;
            v_left := v_left - v_n;
        END LOOP;
        v_done_lids := v_done_lids || v_lid;
        v_done_curs := v_done_curs || v_cur;
    END LOOP;
    -- The backlog marker: one all-NULL row (job_id NULL) says "short, but
    -- more may be there", so the caller claims again instead of waiting for
    -- a NOTIFY that lane_reserve does not send while a lane has a backlog.
    -- Two reasons: a lane with work was busy (skipped above), or a producer
    -- reserved lane sequence numbers this claim did not see (its rows are
    -- uncommitted or committed after this claim's snapshot): a lane this
    -- claim went through whose head is past where the claim stopped, or any
    -- other lane whose head is past its claim cursor. Sequences are not
    -- transactional, so a producer whose reservation comes after this check
    -- sees this claim's rows as claimed only once it commits; the caller
    -- covers that window by claiming again after any short claim of more
    -- than a few rows (see Claimer._claim_loop).
    IF v_left > 0 AND (v_skipped OR EXISTS (
        SELECT 1
        FROM __SCHEMA__.queue_claim_heads h
        JOIN __SCHEMA__.queue_enqueue_heads e ON e.lane_id = h.lane_id
        LEFT JOIN unnest(v_done_lids, v_done_curs) AS d(lid, cur) ON d.lid = h.lane_id
        WHERE h.queue = p_queue
          AND pg_sequence_last_value(e.enqueue_seq) > COALESCE(d.cur, pg_sequence_last_value(h.claim_seq))))
    THEN
        RETURN NEXT;
    END IF;
END $$;

---------------------------------------------------------------------------
-- Result-carrying completions in one statement (the runtime uses it for
-- lease-backed attempts; receipt-backed ones go by binary COPY after
-- receipt_guard, which measured ~1.5x faster per 1024-job flush):
-- the same guard (per-receipt locks ascending, closure evidence; a
-- lease-backed attempt by deleting its lease row), the same writes plus
-- done_entries.result, and per-attempt closures (a receipt with a result
-- in it is never closed by one compact batch row). Returns the stale
-- attempts; nothing is written for them.
---------------------------------------------------------------------------
CREATE FUNCTION __SCHEMA__.receipt_complete_results(p_claim_slots int[], p_claim_ids bigint[], p_job_ids bigint[],
    p_run_leases int[], p_ready_slots int[], p_lane_ids int[], p_lane_seqs bigint[], p_attempts int[],
    p_queues text[], p_kinds text[], p_lease_backed boolean[], p_results jsonb[])
RETURNS TABLE (job_id bigint, run_lease int)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(__SCHEMA__.lock_key('claim'), (x.cid % 2147483647)::int)
    FROM (SELECT DISTINCT cid FROM unnest(p_claim_ids) AS cid ORDER BY cid) x;
    RETURN QUERY
    WITH input AS (
        SELECT * FROM unnest(p_claim_slots, p_claim_ids, p_job_ids, p_run_leases, p_ready_slots, p_lane_ids,
                             p_lane_seqs, p_attempts, p_queues, p_kinds, p_lease_backed, p_results)
            AS u(cs, cid, j, l, rs, lane, seq, att, q, k, lb, res)
    ), receipts AS (
        SELECT DISTINCT i.cs, i.cid FROM input i WHERE NOT i.lb
    ), gone AS (
        -- receipts closed whole, or no longer there (O(receipts) probes, not O(jobs))
        SELECT r.cid FROM receipts r
        WHERE EXISTS (SELECT 1 FROM __SCHEMA__.lease_claim_closure_batches b
                      WHERE b.claim_slot = r.cs AND b.claim_id = r.cid)
           OR NOT EXISTS (SELECT 1 FROM __SCHEMA__.lease_claims c WHERE c.claim_slot = r.cs AND c.claim_id = r.cid)
    ), already AS (
        -- attempts of these receipts closed already (Index: lease_claim_closures primary key)
        SELECT x.job_id, x.run_lease FROM receipts r
        JOIN __SCHEMA__.lease_claim_closures x ON x.claim_slot = r.cs AND x.claim_id = r.cid
    ), leased AS (
        -- lease-backed attempts (parked for a callback earlier): guarded by their lease row
        DELETE FROM __SCHEMA__.leases x USING input i
        WHERE i.lb AND x.job_id = i.j AND x.run_lease = i.l
        RETURNING x.job_id, x.run_lease
    ), checked AS (
        SELECT i.*, CASE WHEN i.lb THEN (i.j, i.l) NOT IN (SELECT d.job_id, d.run_lease FROM leased d)
                    ELSE i.cid IN (SELECT g.cid FROM gone g)
                         OR (i.j, i.l) IN (SELECT d.job_id, d.run_lease FROM already d) END AS stale
        FROM input i
    ), done AS (
        INSERT INTO __SCHEMA__.done_entries (ready_slot, job_id, lane_id, lane_seq, run_lease, attempt, state,
            queue, kind, result)
        SELECT c.rs, c.j, c.lane, c.seq, c.l, c.att, 1, c.q, c.k, c.res FROM checked c WHERE NOT c.stale
        RETURNING 1
    ), closures AS (
        INSERT INTO __SCHEMA__.lease_claim_closures (claim_slot, claim_id, job_id, run_lease, outcome)
        SELECT c.cs, c.cid, c.j, c.l, 1 FROM checked c WHERE NOT c.stale AND NOT c.lb
        RETURNING 1
    ), cleared AS (
        DELETE FROM __SCHEMA__.attempt_state a USING checked c
        WHERE NOT c.stale AND a.job_id = c.j AND a.run_lease = c.l
        RETURNING 1
    )
    SELECT c.j, c.l FROM checked c WHERE c.stale;
END $$;

---------------------------------------------------------------------------
-- job_load, version 2: job_load plus 'progress' (a running attempt's
-- attempt_state, else the value carried on its deferred or ready row; NULL
-- once terminal) and 'result' (what the handler returned; completed only).
---------------------------------------------------------------------------
CREATE FUNCTION __SCHEMA__.job_load_v2(p_job_id bigint) RETURNS jsonb
LANGUAGE plpgsql STABLE
SET plan_cache_mode = force_generic_plan
AS $$
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
    FROM __SCHEMA__.ready_entries e
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
END $$;

---------------------------------------------------------------------------
-- Prune, version 2: ring_prune plus history retention for the ready ring.
-- p_retain_s > 0 seconds (ready ring only): a sealed slot whose gates pass is first
-- marked quiet (ring_slots.quiet_generation/quiet_at, one UPDATE of a
-- control row per slot per ring cycle) and answered 'retained'; it is
-- truncated only once it has been quiet for p_retain_s. A slot seen quiet
-- recently answers 'retained' from its slot row alone, without the gate
-- queries. Every terminal record in a slot was written while the slot was
-- not yet quiet (closing the slot's last attempt is what makes it quiet),
-- so each stays visible for at least p_retain_s. A gate that fails again
-- (a producer's transaction that reserved rows in the slot before it was
-- sealed committed late) clears the mark. p_retain_s 0: exactly ring_prune.
---------------------------------------------------------------------------
CREATE FUNCTION __SCHEMA__.ring_prune_v2(p_ring text, p_slot int, p_lock_timeout text DEFAULT '50ms',
    p_retain_s float8 DEFAULT 0) RETURNS text
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    s text := '__SCHEMA__';
    v_tables text[];
    v_list text;
    v_gate text;
    -- a duration (seconds), only ever subtracted from now(): no client clock
    p_retain interval := make_interval(secs => greatest(COALESCE(p_retain_s, 0), 0));
    v_retain boolean := p_ring = 'ready' AND p_retain > interval '0';
    v_gen bigint;
    v_quiet_gen bigint;
    v_quiet_at timestamptz;
BEGIN
    PERFORM set_config('lock_timeout', p_lock_timeout, true);
    IF p_slot = __SCHEMA__.ring_current(p_ring) THEN
        RETURN 'current';
    END IF;
    v_tables := CASE p_ring
        WHEN 'ready' THEN ARRAY['ready_entries', 'ready_segments', 'ready_tombstones', 'done_entries']
        WHEN 'claim' THEN ARRAY['lease_claims', 'lease_claim_closures', 'lease_claim_closure_batches']
        ELSE ARRAY['leases'] END;
    -- nothing on disk (not even dead tuples): nothing to reclaim
    IF (SELECT sum(pg_relation_size(format('%s.%s_%s', s, t, p_slot)::regclass)) FROM unnest(v_tables) AS t) = 0 THEN
        RETURN 'empty';
    END IF;
    SELECT x.quiet_generation, x.quiet_at INTO v_quiet_gen, v_quiet_at
    FROM __SCHEMA__.ring_slots x WHERE x.ring = p_ring AND x.slot = p_slot FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN 'busy';
    END IF;
    IF v_retain THEN
        -- the slot's latest generation: a quiet mark of an earlier use of the slot does not count
        SELECT max(g.generation) INTO v_gen FROM __SCHEMA__.ring_rotations g
        WHERE g.ring = p_ring AND g.slot = p_slot;
        IF v_quiet_gen IS DISTINCT FROM v_gen THEN
            v_quiet_at := NULL;
        END IF;
        IF v_quiet_at > now() - p_retain THEN
            RETURN 'retained';
        END IF;
    END IF;
    SELECT string_agg(format('%s.%s_%s', s, t, p_slot), ', ') INTO v_list FROM unnest(v_tables) AS t;
    FOR pass IN 1 .. 2 LOOP
        IF p_ring = 'ready' THEN
            PERFORM __SCHEMA__.lanes_cursor_advance(ARRAY(
                SELECT DISTINCT g.lane_id FROM __SCHEMA__.ready_segments g WHERE g.ready_slot = p_slot));
            v_gate := __SCHEMA__.ready_prune_gate(p_slot);
        ELSIF p_ring = 'claim' THEN
            PERFORM __SCHEMA__.lanes_cursor_advance(ARRAY(
                SELECT DISTINCT c.lane_id FROM __SCHEMA__.lease_claims c WHERE c.claim_slot = p_slot));
            v_gate := __SCHEMA__.claim_prune_gate(p_slot);
        ELSE
            -- deleted leases leave only dead tuples; a live lease blocks
            v_gate := CASE WHEN EXISTS (SELECT 1 FROM __SCHEMA__.leases l WHERE l.lease_slot = p_slot)
                           THEN 'active_leases' END;
        END IF;
        IF v_gate IS NOT NULL THEN
            IF v_retain AND v_quiet_at IS NOT NULL THEN
                UPDATE __SCHEMA__.ring_slots SET quiet_generation = NULL, quiet_at = NULL
                WHERE ring = p_ring AND slot = p_slot;
            END IF;
            RETURN v_gate;
        END IF;
        IF pass = 1 AND v_retain AND v_quiet_at IS NULL THEN
            -- quiet from now on: keep the slot for p_retain
            UPDATE __SCHEMA__.ring_slots SET quiet_generation = v_gen, quiet_at = now()
            WHERE ring = p_ring AND slot = p_slot;
            RETURN 'retained';
        END IF;
        IF pass = 1 THEN
            BEGIN
                EXECUTE format('LOCK TABLE %s IN ACCESS EXCLUSIVE MODE', v_list);
            EXCEPTION WHEN lock_not_available THEN
                RETURN 'busy';
            END;
            IF p_slot = __SCHEMA__.ring_current(p_ring) THEN
                RETURN 'current';
            END IF;
        END IF;
    END LOOP;
    IF p_ring = 'ready' THEN
        EXECUTE format(
            'INSERT INTO %1$s.queue_terminal_rollups AS r (queue, state, count)
             SELECT queue, state, count(*) FROM %1$s.done_entries_%2$s GROUP BY queue, state
             ON CONFLICT (queue, state) DO UPDATE SET count = r.count + excluded.count', s, p_slot);
    END IF;
    EXECUTE format('TRUNCATE %s', v_list);
    RETURN 'pruned';
EXCEPTION WHEN lock_not_available THEN
    -- any lock this prune would wait on past lock_timeout (a gate query on a
    -- child another pruner holds, for one): skip the slot, never wait
    RETURN 'busy';
END $$;
