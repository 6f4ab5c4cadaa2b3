-- awa-fast: the plain claim reads the current claim and ready slots itself, without two nested calls of ring_current (issue 16).
-- compatible-with-previous: yes
-- Immutable once landed, like every migration.
--
-- claim_batch_v4 (0034) called ring_current('claim') once per claim that
-- found a candidate lane, and ring_current('ready') once for a lane with a
-- short backlog: two nested PL/pgSQL calls per quiet claim, each its own
-- function frame around one query. The claim now runs the same two
-- queries itself (ring_current's of 0013: the ring's two ledger leaves,
-- newest generation first). Body only: same arguments, rows and writes.
--
-- Compatibility: the previous runtime calls claim_batch_v4 and gets the
-- same rows.

CREATE OR REPLACE FUNCTION __SCHEMA__.claim_batch_v4(p_queue text, p_max integer, p_stripe integer DEFAULT 0, p_stripes integer DEFAULT 1)
 RETURNS TABLE(job_id bigint, run_lease integer, attempt integer, max_attempts integer, queue text, kind text, priority integer, args jsonb, metadata jsonb, ready_slot integer, lane_id integer, lane_seq bigint, claim_slot integer, claim_id bigint, created_at timestamp with time zone, errors jsonb, callback_result jsonb, progress jsonb)
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
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
    v_rseq regclass;
    v_from bigint;
    v_guess int;
    v_guessed boolean := false;
    v_hit boolean;
    v_working int;
    v_lane_curs bigint[];
    v_heads bigint[];
    v_shards int[];
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
        -- Several lanes. Each one's effective cursor first (the claim cursor lags one claim
        -- behind its own receipts; Index: lease_claims_lane), the lanes with numbers past it
        -- first, in lane order. One such lane at most: that order is the claim's (the one-lane
        -- path, no segment read). Several: claim-time aged priority, then oldest head, then
        -- the caller's stripe (the order of claim_batch), from each one's oldest unclaimed
        -- segment. Lanes whose rows are all covered by receipts already come last and are only
        -- noted with their position, for the backlog check below.
        SELECT count(*) FILTER (WHERE q.head > q.cur),
               array_agg(h.lane_id ORDER BY q.head <= q.cur, h.lane_id),
               array_agg(h.priority ORDER BY q.head <= q.cur, h.lane_id),
               array_agg(h.claim_seq ORDER BY q.head <= q.cur, h.lane_id),
               array_agg(e.enqueue_seq ORDER BY q.head <= q.cur, h.lane_id),
               array_agg(CASE WHEN q.head <= q.cur THEN q.cur END ORDER BY q.head <= q.cur, h.lane_id),
               array_agg(q.cur ORDER BY q.head <= q.cur, h.lane_id),
               array_agg(q.head ORDER BY q.head <= q.cur, h.lane_id),
               array_agg(h.shard ORDER BY q.head <= q.cur, h.lane_id)
        INTO v_working, v_lids, v_prios, v_cseqs, v_eseqs, v_curs, v_lane_curs, v_heads, v_shards
        FROM __SCHEMA__.queue_claim_heads h
        JOIN __SCHEMA__.queue_enqueue_heads e ON e.lane_id = h.lane_id
        CROSS JOIN LATERAL (SELECT pg_sequence_last_value(h.claim_seq) AS seq_cur,
                                   pg_sequence_last_value(e.enqueue_seq) AS head OFFSET 0) q0
        CROSS JOIN LATERAL (
            -- (OFFSET 0: evaluated once per lane, not once per reference below)
            SELECT greatest(q0.seq_cur, (SELECT max(c.last_seq) FROM __SCHEMA__.lease_claims c
                                         WHERE c.lane_id = h.lane_id AND c.last_seq > q0.seq_cur
                                           AND c.last_seq <= 9223372036854775807)) AS cur,
                   q0.head OFFSET 0) q
        WHERE h.lane_id = ANY(v_lids);
        IF v_working > 1 THEN
            SELECT array_agg(x.lid ORDER BY x.k1, x.k2, x.k3, x.k4, x.lid), array_agg(x.prio ORDER BY x.k1, x.k2, x.k3, x.k4, x.lid),
                   array_agg(x.cseq ORDER BY x.k1, x.k2, x.k3, x.k4, x.lid), array_agg(x.eseq ORDER BY x.k1, x.k2, x.k3, x.k4, x.lid),
                   array_agg(CASE WHEN x.k3 IS NULL THEN x.cur END ORDER BY x.k1, x.k2, x.k3, x.k4, x.lid)
            INTO v_lids, v_prios, v_cseqs, v_eseqs, v_curs
            FROM (
                SELECT u.lid, u.prio, u.cseq, u.eseq, u.cur,
                    u.prio - floor(extract(epoch FROM now() - a.head_at) / v_aging) AS k1,
                    u.prio AS k2, a.head_at AS k3,
                    ((u.shard - p_stripe) % greatest(p_stripes, 1) + greatest(p_stripes, 1))
                        % greatest(p_stripes, 1) AS k4
                FROM unnest(v_lids, v_prios, v_cseqs, v_eseqs, v_lane_curs, v_heads, v_shards)
                    AS u(lid, prio, cseq, eseq, cur, head, shard)
                LEFT JOIN LATERAL (
                    -- age of the lane head: its oldest unclaimed segment
                    SELECT g.created_at AS head_at FROM __SCHEMA__.ready_segments g
                    WHERE g.lane_id = u.lid AND g.last_seq > u.cur AND u.head > u.cur
                    ORDER BY g.last_seq LIMIT 1) a ON true
            ) x;
        END IF;
    END IF;
    IF v_lids IS NOT NULL THEN
        -- the current claim slot: ring_current('claim')'s query, inlined (0036)
        SELECT x.slot INTO v_claim_slot
        FROM (SELECT r.slot, r.generation FROM __SCHEMA__.ring_rotations_claim_0 r
              UNION ALL
              SELECT r.slot, r.generation FROM __SCHEMA__.ring_rotations_claim_1 r) x
        ORDER BY x.generation DESC LIMIT 1;
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
        -- the lane head, and the lane's receipt mark (0025)
        SELECT h.receipt_seq INTO v_rseq FROM __SCHEMA__.queue_claim_heads h
        WHERE h.lane_id = v_lid FOR UPDATE SKIP LOCKED;
        IF NOT FOUND THEN
            v_skipped := true;  -- another claimer holds this lane head right now
            CONTINUE;
        END IF;
        v_cur := __SCHEMA__.lane_cursor_advance(v_lid, v_cseq);
        v_from := v_cur;
        v_bound := 9223372036854775807;
        LOOP
            -- nothing reserved past the position: no segment to look up
            EXIT WHEN v_left <= 0 OR pg_sequence_last_value(v_eseq) <= v_cur;
            -- Index: ready_segments_lane (lane_id, last_seq)
            -- (its rows are committed with it, all in its slot: the first row past
            -- the position is v_first, and v_first .. v_seg_last are all there)
            -- The current ready slot's child first (0032; pruned to that one child when the
            -- plan starts, where the lookup over the ring starts every child): a segment
            -- there that ends past the position and starts at or before the next number
            -- holds that number, so it is the lane's first segment past the position (a
            -- lane's segments cover disjoint ranges of its numbers), the one the lookup
            -- over the whole ring would find. Any other answer there, or none: that lookup.
            v_hit := false;
            IF pg_sequence_last_value(v_eseq) - v_cur <= 64 THEN
                -- a short backlog: its rows are recent, most often all in the current slot
                IF NOT v_guessed THEN
                    -- the current ready slot: ring_current('ready')'s query, inlined (0036)
                    SELECT x.slot INTO v_guess
                    FROM (SELECT r.slot, r.generation FROM __SCHEMA__.ring_rotations_ready_0 r
                          UNION ALL
                          SELECT r.slot, r.generation FROM __SCHEMA__.ring_rotations_ready_1 r) x
                    ORDER BY x.generation DESC LIMIT 1;
                    v_guessed := true;
                END IF;
                SELECT g.ready_slot, greatest(g.first_seq, v_cur + 1), g.last_seq, g.first_seq <= v_cur + 1
                INTO v_slot, v_first, v_seg_last, v_hit FROM __SCHEMA__.ready_segments g
                WHERE g.ready_slot = v_guess AND g.lane_id = v_lid AND g.last_seq > v_cur
                ORDER BY g.last_seq LIMIT 1;
            END IF;
            IF NOT COALESCE(v_hit, false) THEN
                SELECT g.ready_slot, greatest(g.first_seq, v_cur + 1), g.last_seq
                INTO v_slot, v_first, v_seg_last FROM __SCHEMA__.ready_segments g
                WHERE g.lane_id = v_lid AND g.last_seq > v_cur
                ORDER BY g.last_seq LIMIT 1;
                EXIT WHEN NOT FOUND;
            END IF;
            v_claim_id := nextval('__SCHEMA__.claim_id_seq');
            -- The receipt first, from the narrow columns of the rows it takes
            -- (Index: ready_entries primary key (ready_slot, lane_id, lane_seq)).
            WITH picked AS MATERIALIZED (
                -- the first v_left rows past the position, from at most v_left numbers (a primary-key
                -- range from v_first, the first number there is: no plan reads or sorts the lane's
                -- whole backlog), then the tombstones (0024)
                SELECT r.lane_seq, r.job_id, r.lease_base, (t.lane_seq IS NOT NULL) AS tomb
                FROM (SELECT e.lane_seq, e.job_id, e.lease_base FROM __SCHEMA__.ready_entries e
                      WHERE e.ready_slot = v_slot AND e.lane_id = v_lid AND e.lane_seq > v_cur
                        AND e.lane_seq <= least(v_bound, v_first + v_left - 1)
                      ORDER BY e.lane_seq
                      LIMIT v_left) r
                LEFT JOIN __SCHEMA__.ready_tombstones t
                    ON t.ready_slot = v_slot AND t.lane_id = v_lid AND t.lane_seq = r.lane_seq
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
        IF v_cur > v_from THEN
            -- receipts up to v_cur, committed or not: the lane's receipt mark, which the
            -- single enqueue's NOTIFY decision reads (job_enqueue_v3, 0025); a hint only
            PERFORM setval(v_rseq, v_cur, true);
        END IF;
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
END $function$;
