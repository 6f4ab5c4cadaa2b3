-- awa-fast storage functions: the claim's segment lookup in one partition.
-- Immutable once landed, like every migration.
--
-- claim_batch_v2 found the segment holding the lane's next row with a
-- lookup by (lane_id, last_seq) over every ready partition: a generic plan
-- cannot prune on lane_id, so each claim started an index scan in all 16
-- ready partitions (~170 us per call measured on PostgreSQL 18, a third of
-- a one-job claim's server time). Same function, same contract; the lookup
-- first tries the current ready slot, a parameter the plan prunes on.
CREATE OR REPLACE FUNCTION __SCHEMA__.claim_batch_v2(p_queue text, p_max int, p_stripe int DEFAULT 0, p_stripes int DEFAULT 1)
RETURNS TABLE (job_id bigint, run_lease int, attempt int, max_attempts int, queue text, kind text,
    priority int, args jsonb, metadata jsonb, ready_slot int, lane_id int, lane_seq bigint,
    claim_slot int, claim_id bigint, created_at timestamptz, errors jsonb, callback_result jsonb)
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
    v_ready_slot int;
    v_first bigint;
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
        v_ready_slot := __SCHEMA__.ring_current('ready');
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
            -- The segment holding the next row. First in the current ready
            -- slot alone (one partition): taken when it holds v_cur + 1, so
            -- no row can lie before it; otherwise (rows older than the last
            -- ready rotation, or a gap a rolled-back reservation left) across
            -- the ring. Index: ready_segments_lane (lane_id, last_seq)
            v_slot := NULL;
            SELECT g.ready_slot, g.first_seq INTO v_slot, v_first FROM __SCHEMA__.ready_segments g
            WHERE g.ready_slot = v_ready_slot AND g.lane_id = v_lid AND g.last_seq > v_cur
            ORDER BY g.last_seq LIMIT 1;
            IF v_slot IS NULL OR v_first > v_cur + 1 THEN
                SELECT g.ready_slot INTO v_slot FROM __SCHEMA__.ready_segments g
                WHERE g.lane_id = v_lid AND g.last_seq > v_cur
                ORDER BY g.last_seq LIMIT 1;
                EXIT WHEN NOT FOUND;
            END IF;
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

