-- awa-fast: claim_batch_v4, the claim whose per-receipt columns come once per receipt.
-- compatible-with-previous: yes
-- Immutable once landed, like every migration.
--
-- claim_batch_v4 takes the same arguments, takes the same rows, writes the
-- same receipts under the same locks in the same order and returns the same
-- backlog marker as claim_batch_v3 (its body as of migration 0020). Its
-- result rows differ in one way: of the six columns that have one value per
-- receipt (queue, priority, ready_slot, lane_id, claim_slot, claim_id), only
-- the first row of each receipt carries them; the receipt's other rows have
-- NULL there, and the caller carries the first row's values forward
-- (decode_snapshots in the codec and its Python twin). A new name, because
-- the result's meaning changed (rule 2 of docs/storage.md).
--
-- Why. A drain's claim returns 1,024 rows of 18 columns per call; six of
-- them repeat one value across the receipt. Sending them cost PostgreSQL
-- their output functions on every row, and the client psycopg's loaders (a
-- new str for the queue, an int object for each of the others), then the
-- freeing of those objects with each job. A NULL costs a length word on the
-- wire and no loader. The receipt's first row comes from its own primary-key
-- probe, the rest from the same range (or positions) read as before; one
-- more probe per receipt, none per row. Measured: docs/performance-log.md,
-- claim-v4.
--
-- The first row of a receipt is the one at its first position taken (the
-- range's first number, or the first of the receipt's lane_seqs when a
-- tombstone or gap broke the range), always returned before the rest.
-- Receipts follow one another in the result, so a NULL always follows a row
-- of the same receipt. The backlog marker is still a last row whose job_id
-- is NULL.
--
-- Compatibility: a new function only. The previous runtime keeps calling
-- claim_batch_v3 (unchanged, as are the limited and keyed claims that call
-- it) and gets the rows it always got. The runtime of this release calls
-- claim_batch_v4 for a queue without limits; its decoder also takes full
-- rows (a carried column is used only where the row has NULL).

CREATE FUNCTION __SCHEMA__.claim_batch_v4(p_queue text, p_max int, p_stripe int DEFAULT 0, p_stripes int DEFAULT 1)
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
    v_first bigint;
    v_seg_last bigint;
    v_bound bigint;
    v_seqs bigint[];
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
        v_bound := 9223372036854775807;
        LOOP
            -- nothing reserved past the position: no segment to look up
            EXIT WHEN v_left <= 0 OR pg_sequence_last_value(v_eseq) <= v_cur;
            -- Index: ready_segments_lane (lane_id, last_seq)
            -- (its rows are committed with it, all in its slot: the first row past
            -- the position is v_first, and v_first .. v_seg_last are all there)
            SELECT g.ready_slot, greatest(g.first_seq, v_cur + 1), g.last_seq
            INTO v_slot, v_first, v_seg_last FROM __SCHEMA__.ready_segments g
            WHERE g.lane_id = v_lid AND g.last_seq > v_cur
            ORDER BY g.last_seq LIMIT 1;
            EXIT WHEN NOT FOUND;
            v_claim_id := nextval('__SCHEMA__.claim_id_seq');
            -- The receipt first, from the narrow columns of the rows it takes
            -- (Index: ready_entries primary key (ready_slot, lane_id, lane_seq)).
            WITH picked AS MATERIALIZED (
                SELECT r.lane_seq, r.job_id, r.lease_base, (t.lane_seq IS NOT NULL) AS tomb
                FROM __SCHEMA__.ready_entries r
                LEFT JOIN __SCHEMA__.ready_tombstones t
                    ON t.ready_slot = r.ready_slot AND t.lane_id = r.lane_id AND t.lane_seq = r.lane_seq
                WHERE r.ready_slot = v_slot AND r.lane_id = v_lid AND r.lane_seq > v_cur AND r.lane_seq <= v_bound
                ORDER BY r.lane_seq
                LIMIT v_left
            )
            INSERT INTO __SCHEMA__.lease_claims (claim_slot, claim_id, lane_id, ready_slot, first_seq,
                last_seq, job_ids, run_leases, lane_seqs, deadline_at)
            SELECT v_claim_slot, v_claim_id, v_lid, v_slot, v_cur + 1, max(p.lane_seq),
                COALESCE(array_agg(p.job_id ORDER BY p.lane_seq) FILTER (WHERE NOT p.tomb), '{}'),
                COALESCE(array_agg(p.lease_base + 1 ORDER BY p.lane_seq) FILTER (WHERE NOT p.tomb), '{}'),
                COALESCE(array_agg(p.lane_seq ORDER BY p.lane_seq) FILTER (WHERE NOT p.tomb), '{}'),
                now() + v_meta.deadline
            FROM picked p
            -- an unbroken run of numbers from v_first, or nothing at all (bounded
            -- to one segment, every row read is that segment's: taken as it is)
            HAVING count(*) > 0 AND (v_bound = v_seg_last
                OR (min(p.lane_seq) = v_first AND max(p.lane_seq) - v_first + 1 = count(*)))
            RETURNING lease_claims.last_seq, lease_claims.lane_seqs INTO v_last, v_seqs;
            IF NOT FOUND THEN
                -- The rows of this slot past the position are not an unbroken
                -- run: a number in between lives in another slot (or is a gap a
                -- rolled-back reservation left). Nothing was taken; take this
                -- segment's rows alone, then look up the next segment.
                EXIT WHEN v_bound = v_seg_last;
                v_bound := v_seg_last;
                CONTINUE;
            END IF;
            -- Then the receipt's rows, read again in full (ready rows are
            -- immutable, and this transaction's lock on the slot keeps prune's
            -- TRUNCATE out): exactly the positions in the receipt's lane_seqs,
            -- whatever committed or was tombstoned since the statement above.
            v_n := cardinality(v_seqs);
            IF v_n = v_last - v_cur THEN
                -- every position of the range is in the receipt (no tombstone,
                -- no gap): the rows are the range (primary key range scan)
                RETURN QUERY
                SELECT p.job_id, p.lease_base + 1, p.attempt + 1, p.max_attempts::int, p_queue, p.kind,
                    v_prio, p.args, p.metadata, v_slot, v_lid, p.lane_seq, v_claim_slot,
                    v_claim_id, p.created_at, p.errors, p.callback_result, p.progress
                FROM __SCHEMA__.ready_entries p
                WHERE p.ready_slot = v_slot AND p.lane_id = v_lid AND p.lane_seq = v_cur + 1;
                -- the rest of the receipt: its six per-receipt columns NULL (the caller carries them)
                RETURN QUERY
                SELECT p.job_id, p.lease_base + 1, p.attempt + 1, p.max_attempts::int, NULL::text, p.kind,
                    NULL::int, p.args, p.metadata, NULL::int, NULL::int, p.lane_seq, NULL::int,
                    NULL::bigint, p.created_at, p.errors, p.callback_result, p.progress
                FROM __SCHEMA__.ready_entries p
                WHERE p.ready_slot = v_slot AND p.lane_id = v_lid AND p.lane_seq > v_cur + 1
                  AND p.lane_seq <= v_last
                ORDER BY p.lane_seq;
            ELSIF v_n > 0 THEN
                RETURN QUERY
                SELECT p.job_id, p.lease_base + 1, p.attempt + 1, p.max_attempts::int, p_queue, p.kind,
                    v_prio, p.args, p.metadata, v_slot, v_lid, p.lane_seq, v_claim_slot,
                    v_claim_id, p.created_at, p.errors, p.callback_result, p.progress
                FROM __SCHEMA__.ready_entries p
                WHERE p.ready_slot = v_slot AND p.lane_id = v_lid AND p.lane_seq = v_seqs[1];
                RETURN QUERY
                SELECT p.job_id, p.lease_base + 1, p.attempt + 1, p.max_attempts::int, NULL::text, p.kind,
                    NULL::int, p.args, p.metadata, NULL::int, NULL::int, p.lane_seq, NULL::int,
                    NULL::bigint, p.created_at, p.errors, p.callback_result, p.progress
                FROM __SCHEMA__.ready_entries p
                WHERE p.ready_slot = v_slot AND p.lane_id = v_lid AND p.lane_seq = ANY (v_seqs[2:])
                ORDER BY p.lane_seq;
            END IF;
            v_bound := 9223372036854775807;
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
