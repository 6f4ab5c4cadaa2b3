-- awa-fast: a lane's receipt mark, so a single enqueue decides its NOTIFY without reading the claim ring (issue 16).
-- compatible-with-previous: yes
-- Immutable once landed, like every migration.
--
-- The problem. A single enqueue wakes claimers (NOTIFY) unless its lane
-- already had 64 rows or more not covered by a committed receipt (0004).
-- The lane's claim cursor lags its last receipt by one claim (the cursor
-- moves only after a claim commits, at the lane's next claim), so while the
-- cursor said "64 or more", job_enqueue_v2 (0014) read the lane's receipts
-- past it: max(last_seq) over lease_claims, an index probe in each of the
-- claim ring's partitions (8 by default). With a backlog, every enqueue
-- took that branch: 26 of the call's 48 relation locks, and about a quarter
-- of its server CPU (one connection, asynchronous commit, 8 alternated
-- blocks of 3,000 calls: backend CPU 253 us per call for job_enqueue_v2,
-- 187 us for job_enqueue_v3 below; ten producers on two cores, durable
-- commits, 6 alternated rounds: 520 against 444 us, and 2,375 against
-- 2,639 calls/s, v3 ahead in every round; perf/producers_floor.py,
-- docs/performance-log.md, 2026-12-06).
--
-- The mark. Each lane gets a third sequence, <schema>.lane_<id>_receipt,
-- named in the new column queue_claim_heads.receipt_seq (set by lane_ensure
-- as the owner; the runtime role cannot update that column, so it cannot
-- point a claim's setval at another sequence). Every claim that writes
-- receipts for a lane sets the lane's mark to the last number its receipts
-- cover, while it still holds the lane head (FOR UPDATE, until it commits).
-- A sequence is not transactional: the mark is set before the claim
-- commits and stays if it rolls back. So the mark is never below the last
-- number of any committed receipt of the lane (claims of one lane take
-- turns on its head, each one starts past every committed receipt, and two
-- claims in one transaction continue past its own receipts), and it may be
-- above it while a claim is in flight or after one rolled back. It is a
-- hint for the NOTIFY decision only: no claim, prune gate or cursor reads
-- it. (A mark a claim could trust would strand rows: a rolled-back claim's
-- mark would make its rows look taken.)
--
-- job_enqueue_v3: job_enqueue_v2 with the same NOTIFY decisions, read more
-- cheaply. While the cursor alone shows 64 or more rows, 64 or more past
-- the mark too prove that 64 or more lie past every committed receipt: no
-- wake-up, and the claim ring is not read. Otherwise (a claim in flight, or
-- the cursor lagging a committed claim: after a drain) it reads the
-- receipts as v2 does. Same arguments, results and NOTIFYs, but it needs
-- this migration's column, so the previous runtime keeps calling
-- job_enqueue_v2, unchanged; lane_reserve (the bulk paths, one call per
-- 1,024 rows) keeps its probe.
--
-- claim_batch_v3 and claim_batch_v4 (body only, rule 3): the same rows,
-- receipts, locks in the same order, cursor moves and results; the lane
-- head's lock statement now also reads receipt_seq, and one setval per lane
-- that got a receipt (about 6 us of server CPU alone; a claim of one job
-- measured 703 against 690 us of backend CPU, inside its spread). The
-- lane_claim_limited and lane_claim_keyed functions claim through v3.
--
-- receipt_seq may be NULL: a lane whose lane_ensure call was waiting on
-- this migration's lock inserts its head with the previous body (without
-- the column). Its claims' setval of NULL does nothing (setval is strict)
-- and its enqueues read the receipts whenever the cursor shows 64 rows.
--
-- Upgrading: ADD COLUMN takes an ACCESS EXCLUSIVE lock on queue_claim_heads,
-- which every claim and enqueue reads, so the migration waits for the
-- transactions that hold it and claims and enqueues wait for the migration
-- (a few milliseconds on its own; as long as the longest open transaction
-- that enqueued, if one is open).
--
-- Compatibility: the previous runtime calls job_enqueue_v2, claim_batch_v3
-- and claim_batch_v4 by the same names and gets the same results, and its
-- claims set the mark the new enqueue reads. claim_batch_v2 does not set it,
-- but no runtime that calls it may run against this schema (migration 0015
-- is not compatible with the runtime before it).

ALTER TABLE __SCHEMA__.queue_claim_heads ADD COLUMN receipt_seq regclass;

-- Existing lanes start with their mark at their enqueue head, which is at or
-- past every receipt they can have (so the invariant holds whatever this
-- transaction's snapshot saw): their enqueues read the receipts as before
-- until their next claim sets the mark.
DO $migrate$
DECLARE
    s text := '__SCHEMA__';
    r record;
BEGIN
    FOR r IN
        SELECT e.lane_id, COALESCE(pg_sequence_last_value(e.enqueue_seq), 0) AS head
        FROM __SCHEMA__.queue_enqueue_heads e
    LOOP
        EXECUTE format('CREATE SEQUENCE %s.lane_%s_receipt MINVALUE 0 START 0', s, r.lane_id);
        PERFORM setval(format('%s.lane_%s_receipt', s, r.lane_id)::regclass, r.head, true);
        UPDATE __SCHEMA__.queue_claim_heads SET receipt_seq = format('%s.lane_%s_receipt', s, r.lane_id)::regclass
        WHERE lane_id = r.lane_id;
    END LOOP;
END $migrate$;

-- Version 2: creates the lane's receipt mark beside its two cursors.
CREATE OR REPLACE FUNCTION __SCHEMA__.lane_ensure(p_queue text, p_priority integer, p_shard integer)
 RETURNS integer
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
DECLARE
    s text := '__SCHEMA__';
    v_lane int;
BEGIN
    SELECT lane_id INTO v_lane FROM __SCHEMA__.queue_enqueue_heads
    WHERE queue = p_queue AND priority = p_priority AND shard = p_shard;
    IF FOUND THEN
        RETURN v_lane;
    END IF;
    INSERT INTO __SCHEMA__.queue_lanes (queue, priority, shard)
    VALUES (p_queue, p_priority, p_shard)
    ON CONFLICT DO NOTHING
    RETURNING lane_id INTO v_lane;
    IF v_lane IS NULL THEN
        SELECT lane_id INTO STRICT v_lane FROM __SCHEMA__.queue_lanes
        WHERE queue = p_queue AND priority = p_priority AND shard = p_shard;
        RETURN v_lane;
    END IF;
    EXECUTE format('CREATE SEQUENCE %s.lane_%s_enqueue MINVALUE 0 START 0', s, v_lane);
    EXECUTE format('CREATE SEQUENCE %s.lane_%s_claim MINVALUE 0 START 0', s, v_lane);
    EXECUTE format('CREATE SEQUENCE %s.lane_%s_receipt MINVALUE 0 START 0', s, v_lane);
    -- last_value 0, is_called: pg_sequence_last_value() reads 0, nextval() gives 1
    PERFORM setval(format('%s.lane_%s_enqueue', s, v_lane)::regclass, 0, true);
    PERFORM setval(format('%s.lane_%s_claim', s, v_lane)::regclass, 0, true);
    PERFORM setval(format('%s.lane_%s_receipt', s, v_lane)::regclass, 0, true);
    INSERT INTO __SCHEMA__.queue_enqueue_heads VALUES
        (v_lane, p_queue, p_priority, p_shard, format('%s.lane_%s_enqueue', s, v_lane)::regclass);
    INSERT INTO __SCHEMA__.queue_claim_heads (lane_id, queue, priority, shard, claim_seq, receipt_seq) VALUES
        (v_lane, p_queue, p_priority, p_shard, format('%s.lane_%s_claim', s, v_lane)::regclass,
         format('%s.lane_%s_receipt', s, v_lane)::regclass);
    RETURN v_lane;
END $function$;

-- job_enqueue_v2 (0014) with the NOTIFY decision read from the receipt mark.
CREATE FUNCTION __SCHEMA__.job_enqueue_v3(p_queue text, p_priority int, p_kind text, p_args jsonb,
    p_metadata jsonb, p_max_attempts int, p_run_at timestamptz)
RETURNS bigint
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    v_lane int;
    v_seq regclass;
    v_claim_seq regclass;
    v_mark_seq regclass;
    v_slot int;
    v_first bigint;
    v_claimed bigint;
    v_mark bigint;
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
    SELECT h.lane_id, h.enqueue_seq, c.claim_seq, c.receipt_seq,
           (SELECT r.slot FROM __SCHEMA__.ring_rotations r
            WHERE r.ring = 'ready' ORDER BY r.generation DESC LIMIT 1)
    INTO v_lane, v_seq, v_claim_seq, v_mark_seq, v_slot
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
        SELECT c.claim_seq, c.receipt_seq INTO STRICT v_claim_seq, v_mark_seq
        FROM __SCHEMA__.queue_claim_heads c WHERE c.lane_id = v_lane;
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
    -- The NOTIFY decision of job_enqueue_v2 (0004, 0014): wake claimers unless the lane already
    -- had 64 rows or more not covered by a committed receipt. The claim cursor lags its last
    -- receipt by one claim; while it alone says 64 or more, the lane's receipt mark (0025: at or
    -- past the last number of every committed receipt) settles it when 64 or more rows lie past
    -- it too, and only otherwise are the receipts read (Index lease_claims_lane (lane_id, last_seq)).
    v_claimed := COALESCE(pg_sequence_last_value(v_claim_seq), 0);
    IF v_first - 1 - v_claimed >= 64 THEN
        v_mark := pg_sequence_last_value(v_mark_seq);  -- NULL: a lane without a mark
        IF v_mark IS NOT NULL AND v_first - 1 - v_mark >= 64 THEN
            RETURN v_job;  -- claimers have a backlog: no wake-up, and no claim partition read
        END IF;
        SELECT max(c.last_seq) INTO v_receipt FROM __SCHEMA__.lease_claims c
        WHERE c.lane_id = v_lane AND c.last_seq > v_claimed;
        v_claimed := greatest(v_claimed, v_receipt);
    END IF;
    IF v_first - 1 - v_claimed < 64 THEN
        PERFORM pg_notify(__SCHEMA__.notify_channel(), p_queue);
    END IF;
    RETURN v_job;
END $$;

CREATE OR REPLACE FUNCTION __SCHEMA__.claim_batch_v3(p_queue text, p_max integer, p_stripe integer DEFAULT 0, p_stripes integer DEFAULT 1)
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
                                             WHERE c.lane_id = h.lane_id AND c.last_seq > q0.seq_cur
                                               AND c.last_seq <= 9223372036854775807)) AS cur,
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
            SELECT g.ready_slot, greatest(g.first_seq, v_cur + 1), g.last_seq
            INTO v_slot, v_first, v_seg_last FROM __SCHEMA__.ready_segments g
            WHERE g.lane_id = v_lid AND g.last_seq > v_cur
            ORDER BY g.last_seq LIMIT 1;
            EXIT WHEN NOT FOUND;
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
                WHERE p.ready_slot = v_slot AND p.lane_id = v_lid AND p.lane_seq > v_cur AND p.lane_seq <= v_last
                ORDER BY p.lane_seq;
            ELSIF v_n > 0 THEN
                RETURN QUERY
                SELECT p.job_id, p.lease_base + 1, p.attempt + 1, p.max_attempts::int, p_queue, p.kind,
                    v_prio, p.args, p.metadata, v_slot, v_lid, p.lane_seq, v_claim_slot,
                    v_claim_id, p.created_at, p.errors, p.callback_result, p.progress
                FROM __SCHEMA__.ready_entries p
                WHERE p.ready_slot = v_slot AND p.lane_id = v_lid AND p.lane_seq = ANY (v_seqs)
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
                                             WHERE c.lane_id = h.lane_id AND c.last_seq > q0.seq_cur
                                               AND c.last_seq <= 9223372036854775807)) AS cur,
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
            SELECT g.ready_slot, greatest(g.first_seq, v_cur + 1), g.last_seq
            INTO v_slot, v_first, v_seg_last FROM __SCHEMA__.ready_segments g
            WHERE g.lane_id = v_lid AND g.last_seq > v_cur
            ORDER BY g.last_seq LIMIT 1;
            EXIT WHEN NOT FOUND;
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
