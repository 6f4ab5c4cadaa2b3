-- awa-fast storage functions, version 2: cheaper plans and a claim that
-- says when it came back short only because a lane was busy.
-- Immutable once landed, like every migration.

---------------------------------------------------------------------------
-- Claim, version 2 (claim_batch stays for version-1 callers).
-- Same as claim_batch, plus the backlog marker: when the claim is short
-- of p_max but a lane was busy or a producer holds reserved sequence
-- numbers this claim did not see, the last row returned has job_id NULL
-- and nothing else. A claimer that gets a short claim without the marker
-- has drained every lane it could see and may wait for a NOTIFY
-- (lane_reserve sends one whenever the backlog is small); with the marker
-- it claims again.
---------------------------------------------------------------------------

CREATE FUNCTION __SCHEMA__.claim_batch_v2(p_queue text, p_max int, p_stripe int DEFAULT 0, p_stripes int DEFAULT 1)
RETURNS TABLE (job_id bigint, run_lease int, attempt int, max_attempts int, queue text, kind text,
    priority int, args jsonb, metadata jsonb, ready_slot int, lane_id int, lane_seq bigint,
    claim_slot int, claim_id bigint, created_at timestamptz, errors jsonb, callback_result jsonb)
LANGUAGE plpgsql AS $$
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
                v_claim_id, p.created_at, p.errors, p.callback_result
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
-- Completion, version 2: receipt_complete_rows with a one-claim-slot path.
-- A completion batch nearly always closes attempts of one claim slot;
-- then the slot is a plain parameter, so each closure/receipt probe opens
-- one ring partition instead of all of them (generic plans prune at
-- executor start only on parameters, not on values joined from unnest).
---------------------------------------------------------------------------
CREATE FUNCTION __SCHEMA__.receipt_complete_rows_v2(p_claim_slots int[], p_claim_ids bigint[], p_job_ids bigint[],
    p_run_leases int[], p_ready_slots int[], p_lane_ids int[], p_lane_seqs bigint[], p_attempts int[],
    p_queues text[], p_kinds text[], p_with_state boolean[]) RETURNS TABLE (job_id bigint, run_lease int)
LANGUAGE plpgsql AS $$
DECLARE
    v_cs int := p_claim_slots[1];
BEGIN
    IF v_cs IS NULL OR NOT p_claim_slots <@ ARRAY[v_cs] THEN
        -- several claim slots (a batch across a claim-ring rotation): version 1
        RETURN QUERY SELECT * FROM __SCHEMA__.receipt_complete_rows(p_claim_slots, p_claim_ids, p_job_ids,
            p_run_leases, p_ready_slots, p_lane_ids, p_lane_seqs, p_attempts, p_queues, p_kinds, p_with_state);
        RETURN;
    END IF;
    PERFORM pg_advisory_xact_lock(__SCHEMA__.lock_key('claim'), (x.cid % 2147483647)::int)
    FROM (SELECT DISTINCT cid FROM unnest(p_claim_ids) AS cid ORDER BY cid) x;
    RETURN QUERY
    WITH input AS (
        SELECT * FROM unnest(p_claim_slots, p_claim_ids, p_job_ids, p_run_leases, p_ready_slots, p_lane_ids,
                             p_lane_seqs, p_attempts, p_queues, p_kinds, p_with_state)
            AS u(cs, cid, j, l, rs, lane, seq, att, q, k, st)
    ), checked AS (
        SELECT i.*, (
            EXISTS (SELECT 1 FROM __SCHEMA__.lease_claim_closures x
                    WHERE x.claim_slot = v_cs AND x.claim_id = i.cid AND x.job_id = i.j AND x.run_lease = i.l)
            OR EXISTS (SELECT 1 FROM __SCHEMA__.lease_claim_closure_batches b
                       WHERE b.claim_slot = v_cs AND b.claim_id = i.cid)
            OR NOT EXISTS (SELECT 1 FROM __SCHEMA__.lease_claims c
                           WHERE c.claim_slot = v_cs AND c.claim_id = i.cid)) AS stale
        FROM input i
    ), done AS (
        INSERT INTO __SCHEMA__.done_entries (ready_slot, job_id, lane_id, lane_seq, run_lease, attempt, state,
            queue, kind)
        SELECT c.rs, c.j, c.lane, c.seq, c.l, c.att, 1, c.q, c.k FROM checked c WHERE NOT c.stale
        RETURNING 1
    ), closed AS (
        INSERT INTO __SCHEMA__.lease_claim_closures (claim_slot, claim_id, job_id, run_lease, outcome)
        SELECT c.cs, c.cid, c.j, c.l, 1 FROM checked c WHERE NOT c.stale
        RETURNING 1
    ), cleared AS (
        DELETE FROM __SCHEMA__.attempt_state a USING checked c
        WHERE c.st AND NOT c.stale AND a.job_id = c.j AND a.run_lease = c.l
        RETURNING 1
    )
    SELECT c.j, c.l FROM checked c WHERE c.stale;
END $$;

---------------------------------------------------------------------------
-- Receipt arrays out of line without compression. A claim of 1024 jobs
-- writes ~20 kB of arrays; compressing them with pglz (this server has no
-- lz4) took ~2 ms of the ~4 ms claim statement. Recurses to every claim
-- ring partition.
---------------------------------------------------------------------------
ALTER TABLE __SCHEMA__.lease_claims
    ALTER COLUMN job_ids SET STORAGE EXTERNAL,
    ALTER COLUMN run_leases SET STORAGE EXTERNAL,
    ALTER COLUMN lane_seqs SET STORAGE EXTERNAL;

---------------------------------------------------------------------------
-- Generic plans for every PL/pgSQL function of the schema.
-- Their statements read partitioned tables with parameters, so the plan
-- cache keeps choosing a custom plan (the custom plan prunes partitions at
-- plan time and looks cheaper) and plans each statement again on every
-- call: ~1 ms per completion call and ~0.3 ms per claim measured on
-- PostgreSQL 18. A generic plan prunes at executor start instead.
---------------------------------------------------------------------------
DO $$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN
        SELECT p.oid::regprocedure FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang
        WHERE p.pronamespace = '__SCHEMA__'::regnamespace AND l.lanname = 'plpgsql'
    LOOP
        EXECUTE format('ALTER FUNCTION %s SET plan_cache_mode = force_generic_plan', f);
    END LOOP;
END $$;
