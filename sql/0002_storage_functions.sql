-- awa-fast storage functions, version 1: rings, lanes, enqueue, claim,
-- attempt transitions, rescue, promote, prune, reads.
-- A function whose behaviour changes later gets a new versioned name in a
-- new migration; this file is immutable once landed.

---------------------------------------------------------------------------
-- Small helpers
---------------------------------------------------------------------------

-- Advisory-lock namespace per purpose and schema (two-int4 key form).
CREATE FUNCTION __SCHEMA__.lock_key(p_purpose text) RETURNS int
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT hashtext('awa_fast:' || p_purpose || ':' || '__SCHEMA__')
$$;

-- LISTEN/NOTIFY channel of this schema.
CREATE FUNCTION __SCHEMA__.notify_channel() RETURNS text
LANGUAGE sql IMMUTABLE AS $$
    SELECT 'awa_fast_' || replace('__SCHEMA__', '"', '')
$$;

-- Current slot of a ring: the newest row of the rotation ledger.
-- Index: ring_rotations primary key (ring, generation).
-- PL/pgSQL rather than SQL so its plan is cached (a non-inlinable SQL
-- function is planned again on every call, twice per claim).
CREATE FUNCTION __SCHEMA__.ring_current(p_ring text) RETURNS int
LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN (SELECT slot FROM __SCHEMA__.ring_rotations
            WHERE ring = p_ring ORDER BY generation DESC LIMIT 1);
END $$;

-- Create ring children and the generation-0 ledger rows (install time).
CREATE FUNCTION __SCHEMA__.ring_install(p_ready int, p_claim int, p_lease int) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    s text := '__SCHEMA__';
    i int;
    t text;
BEGIN
    INSERT INTO __SCHEMA__.ring_config VALUES ('ready', p_ready), ('claim', p_claim), ('lease', p_lease);
    FOR i IN 0 .. p_ready - 1 LOOP
        FOREACH t IN ARRAY ARRAY['ready_entries', 'ready_segments', 'ready_tombstones', 'done_entries'] LOOP
            EXECUTE format('CREATE TABLE %s.%s_%s PARTITION OF %s.%s FOR VALUES IN (%s)', s, t, i, s, t, i);
        END LOOP;
        INSERT INTO __SCHEMA__.ring_slots VALUES ('ready', i);
    END LOOP;
    FOR i IN 0 .. p_claim - 1 LOOP
        FOREACH t IN ARRAY ARRAY['lease_claims', 'lease_claim_closures', 'lease_claim_closure_batches'] LOOP
            EXECUTE format('CREATE TABLE %s.%s_%s PARTITION OF %s.%s FOR VALUES IN (%s)', s, t, i, s, t, i);
        END LOOP;
        INSERT INTO __SCHEMA__.ring_slots VALUES ('claim', i);
    END LOOP;
    FOR i IN 0 .. p_lease - 1 LOOP
        EXECUTE format('CREATE TABLE %s.leases_%s PARTITION OF %s.leases FOR VALUES IN (%s)', s, i, s, i);
        INSERT INTO __SCHEMA__.ring_slots VALUES ('lease', i);
    END LOOP;
    INSERT INTO __SCHEMA__.ring_rotations (ring, generation, slot)
    VALUES ('ready', 0, 0), ('claim', 0, 0), ('lease', 0, 0);
END $$;

---------------------------------------------------------------------------
-- Lanes
---------------------------------------------------------------------------

CREATE FUNCTION __SCHEMA__.queue_ensure(p_queue text) RETURNS void
LANGUAGE sql AS $$
    INSERT INTO __SCHEMA__.queue_meta (queue) VALUES (p_queue) ON CONFLICT DO NOTHING
$$;

-- Register a queue from inside a producer's transaction without ever
-- waiting: if another open transaction is registering it right now, skip
-- (claimers and the supervisor register queues too, in autocommit).
CREATE FUNCTION __SCHEMA__.queue_ensure_nowait(p_queue text) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM __SCHEMA__.queue_meta m WHERE m.queue = p_queue)
       AND pg_try_advisory_xact_lock(__SCHEMA__.lock_key('queue_create'), hashtext(p_queue)) THEN
        INSERT INTO __SCHEMA__.queue_meta (queue) VALUES (p_queue) ON CONFLICT DO NOTHING;
    END IF;
END $$;

-- Lane id of (queue, priority, shard), creating the lane, its heads and
-- its two cursor sequences on first use (the only DDL on the enqueue path).
-- SECURITY DEFINER: a runtime role without DDL rights may create lanes.
CREATE FUNCTION __SCHEMA__.lane_ensure(p_queue text, p_priority int, p_shard int) RETURNS int
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
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
    -- last_value 0, is_called: pg_sequence_last_value() reads 0, nextval() gives 1
    PERFORM setval(format('%s.lane_%s_enqueue', s, v_lane)::regclass, 0, true);
    PERFORM setval(format('%s.lane_%s_claim', s, v_lane)::regclass, 0, true);
    INSERT INTO __SCHEMA__.queue_enqueue_heads VALUES
        (v_lane, p_queue, p_priority, p_shard, format('%s.lane_%s_enqueue', s, v_lane)::regclass);
    INSERT INTO __SCHEMA__.queue_claim_heads VALUES
        (v_lane, p_queue, p_priority, p_shard, format('%s.lane_%s_claim', s, v_lane)::regclass);
    RETURN v_lane;
END $$;

-- Pick and lock (transaction-scoped advisory lock) an enqueue lane of
-- (queue, priority). Shards are tried without waiting starting at
-- p_hint % shards, so concurrent producers spread over shards instead of
-- serializing on one lane; only when every shard is busy does it wait.
-- The lock is held until commit: that is what keeps a later lane range
-- from becoming visible while an earlier one may still commit.
CREATE FUNCTION __SCHEMA__.lane_lock_for_enqueue(p_queue text, p_priority int, p_hint int,
    OUT lane_id int, OUT enqueue_seq regclass)
LANGUAGE plpgsql AS $$
DECLARE
    v_shards int;
    v_start int;
    v_shard int;
    i int;
BEGIN
    SELECT m.enqueue_shards INTO v_shards FROM __SCHEMA__.queue_meta m WHERE m.queue = p_queue;
    IF NOT FOUND THEN
        PERFORM __SCHEMA__.queue_ensure_nowait(p_queue);
        v_shards := 8;  -- queue_meta.enqueue_shards default
    END IF;
    v_start := abs(p_hint) % v_shards;
    FOR i IN 0 .. v_shards - 1 LOOP
        v_shard := (v_start + i) % v_shards;
        SELECT h.lane_id, h.enqueue_seq INTO lane_id, enqueue_seq FROM __SCHEMA__.queue_enqueue_heads h
        WHERE h.queue = p_queue AND h.priority = p_priority AND h.shard = v_shard;
        IF NOT FOUND THEN
            -- A lane first used by an open transaction elsewhere: try the next
            -- shard instead of waiting on its uncommitted registration.
            CONTINUE WHEN NOT pg_try_advisory_xact_lock(__SCHEMA__.lock_key('lane_create'),
                                                         hashtext(p_queue || ':' || p_priority || ':' || v_shard));
            lane_id := __SCHEMA__.lane_ensure(p_queue, p_priority, v_shard);
            SELECT h.enqueue_seq INTO STRICT enqueue_seq FROM __SCHEMA__.queue_enqueue_heads h
            WHERE h.lane_id = lane_lock_for_enqueue.lane_id;
        END IF;
        IF pg_try_advisory_xact_lock(__SCHEMA__.lock_key('lane'), lane_id) THEN
            RETURN;
        END IF;
    END LOOP;
    -- Every shard is busy: wait for the preferred one.
    lane_id := __SCHEMA__.lane_ensure(p_queue, p_priority, v_start);
    SELECT h.enqueue_seq INTO STRICT enqueue_seq FROM __SCHEMA__.queue_enqueue_heads h
    WHERE h.lane_id = lane_lock_for_enqueue.lane_id;
    PERFORM pg_advisory_xact_lock(__SCHEMA__.lock_key('lane'), lane_id);
END $$;

-- Move a lane's claim cursor across committed receipts and return the
-- position to claim after. Caller holds the lane's queue_claim_heads row
-- lock. Receipts written earlier in the caller's own transaction move the
-- returned position but not the sequence (claims are not meant to run
-- inside savepoints: a subtransaction's receipt would count as evidence).
-- Index: lease_claims_lane (lane_id, last_seq).
CREATE FUNCTION __SCHEMA__.lane_cursor_advance(p_lane int, p_claim_seq regclass) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    v_cur bigint := pg_sequence_last_value(p_claim_seq);
    v_rec bigint;
    v_own bigint;
BEGIN
    -- Receipts of this very transaction are not committed evidence: a
    -- rollback would undo them but not the setval. They still move the
    -- position this transaction claims from (returned), never the sequence.
    SELECT max(c.last_seq) FILTER (WHERE c.xmin IS DISTINCT FROM pg_current_xact_id_if_assigned()::xid),
           max(c.last_seq)
    INTO v_rec, v_own
    FROM __SCHEMA__.lease_claims c
    WHERE c.lane_id = p_lane AND c.last_seq > v_cur;
    IF v_rec IS NOT NULL THEN
        PERFORM setval(p_claim_seq, v_rec, true);
        v_cur := v_rec;
    END IF;
    RETURN greatest(v_cur, v_own);
END $$;

---------------------------------------------------------------------------
-- Enqueue
---------------------------------------------------------------------------

-- Reserve p_count lane sequence numbers on a locked lane of (queue,
-- priority) in the current ready slot and record the segment; the caller
-- then writes the rows (COPY or INSERT) in the same transaction.
CREATE FUNCTION __SCHEMA__.lane_reserve(p_queue text, p_priority int, p_count int, p_hint int,
    OUT lane_id int, OUT first_seq bigint, OUT ready_slot int)
LANGUAGE plpgsql AS $$
DECLARE
    v_seq regclass;
    v_before bigint;
    v_claimed bigint;
BEGIN
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
    SELECT greatest(pg_sequence_last_value(h.claim_seq),
                    (SELECT max(c.last_seq) FROM __SCHEMA__.lease_claims c
                     WHERE c.lane_id = h.lane_id AND c.last_seq > pg_sequence_last_value(h.claim_seq)))
    INTO v_claimed
    FROM __SCHEMA__.queue_claim_heads h WHERE h.lane_id = lane_reserve.lane_id;
    IF v_before - COALESCE(v_claimed, 0) < 64 THEN
        PERFORM pg_notify(__SCHEMA__.notify_channel(), p_queue);
    END IF;
END $$;

-- Append one runnable row for an existing job (promote, rescue, resume,
-- DLQ retry). Returns the new lane_seq.
CREATE FUNCTION __SCHEMA__.ready_append(p_queue text, p_priority int, p_job_id bigint, p_kind text,
    p_args jsonb, p_metadata jsonb, p_attempt int, p_max_attempts int, p_lease_base int,
    p_created_at timestamptz, p_errors jsonb, p_callback_result jsonb) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    r record;
BEGIN
    SELECT * INTO r FROM __SCHEMA__.lane_reserve(p_queue, p_priority, 1, pg_backend_pid());
    INSERT INTO __SCHEMA__.ready_entries (ready_slot, lane_id, lane_seq, job_id, kind, args, metadata,
        attempt, max_attempts, lease_base, created_at, errors, callback_result)
    VALUES (r.ready_slot, r.lane_id, r.first_seq, p_job_id, p_kind, p_args, p_metadata,
        p_attempt, p_max_attempts, p_lease_base, p_created_at, p_errors, p_callback_result);
    RETURN r.first_seq;
END $$;

-- Enqueue one job inside the caller's transaction. A future run_at goes to
-- deferred_jobs. Returns the job id.
CREATE FUNCTION __SCHEMA__.job_enqueue(p_queue text, p_priority int, p_kind text, p_args jsonb,
    p_metadata jsonb, p_max_attempts int, p_run_at timestamptz) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    r record;
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
    SELECT * INTO r FROM __SCHEMA__.lane_reserve(p_queue, p_priority, 1, pg_backend_pid());
    v_job := (r.lane_id::bigint << 40) | r.first_seq;
    INSERT INTO __SCHEMA__.ready_entries (ready_slot, lane_id, lane_seq, job_id, kind, args, metadata,
        attempt, max_attempts, lease_base)
    VALUES (r.ready_slot, r.lane_id, r.first_seq, v_job, p_kind, p_args, p_metadata, 0, p_max_attempts, 0);
    RETURN v_job;
END $$;

-- Enqueue many jobs of one kind in one statement (one lane range).
CREATE FUNCTION __SCHEMA__.job_enqueue_many(p_queue text, p_priority int, p_kind text, p_args jsonb[],
    p_metadata jsonb, p_max_attempts int) RETURNS SETOF bigint
LANGUAGE plpgsql AS $$
DECLARE
    r record;
BEGIN
    IF cardinality(p_args) IS NULL OR cardinality(p_args) = 0 THEN
        RETURN;
    END IF;
    SELECT * INTO r FROM __SCHEMA__.lane_reserve(p_queue, p_priority, cardinality(p_args), pg_backend_pid());
    RETURN QUERY
    INSERT INTO __SCHEMA__.ready_entries (ready_slot, lane_id, lane_seq, job_id, kind, args, metadata,
        attempt, max_attempts, lease_base)
    SELECT r.ready_slot, r.lane_id, r.first_seq + a.n - 1, (r.lane_id::bigint << 40) | (r.first_seq + a.n - 1),
        p_kind, a.args, p_metadata, 0, p_max_attempts, 0
    FROM unnest(p_args) WITH ORDINALITY AS a(args, n)
    RETURNING job_id;
END $$;

---------------------------------------------------------------------------
-- Claim: one function, one round trip.
---------------------------------------------------------------------------

-- Claim up to p_max runnable jobs of a queue. For each lane with work, in
-- order of claim-time aged priority (priority minus whole aging intervals
-- the lane head has waited), then oldest head first, then the caller's
-- stripe: lock the claim head
-- FOR UPDATE SKIP LOCKED, move its cursor across committed receipts,
-- resolve the slot of the next rows through ready_segments, take the next
-- rows, treat tombstoned ones as spent, append one receipt, and return the
-- claim snapshots. The cursor is only ever set to committed evidence, so a
-- rolled-back claim cannot make it skip work; the rows claimed here are
-- passed by the next claim of the lane (or by prune) after this commits.
CREATE FUNCTION __SCHEMA__.claim_batch(p_queue text, p_max int, p_stripe int DEFAULT 0, p_stripes int DEFAULT 1)
RETURNS TABLE (job_id bigint, run_lease int, attempt int, max_attempts int, queue text, kind text,
    priority int, args jsonb, metadata jsonb, ready_slot int, lane_id int, lane_seq bigint,
    claim_slot int, claim_id bigint, created_at timestamptz, errors jsonb, callback_result jsonb)
LANGUAGE plpgsql AS $$
DECLARE
    v_meta __SCHEMA__.queue_meta%ROWTYPE;
    v_lane record;
    v_cur bigint;
    v_last bigint;
    v_slot int;
    v_claim_slot int;
    v_claim_id bigint;
    v_left int := p_max;
    v_n int;
    v_aging float8;
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
    v_claim_slot := __SCHEMA__.ring_current('claim');
    FOR v_lane IN
        SELECT h.lane_id AS lid, h.priority AS prio, h.claim_seq AS cseq
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
        CROSS JOIN LATERAL (
            -- age of the lane head: its oldest unclaimed segment
            SELECT g.created_at AS head_at FROM __SCHEMA__.ready_segments g
            WHERE g.lane_id = h.lane_id AND g.last_seq > q.cur
            ORDER BY g.last_seq LIMIT 1) a
        WHERE h.queue = p_queue AND q.head > q.cur
        ORDER BY
            h.priority - floor(extract(epoch FROM now() - a.head_at) / v_aging),
            h.priority,
            a.head_at,
            ((h.shard - p_stripe) % greatest(p_stripes, 1) + greatest(p_stripes, 1)) % greatest(p_stripes, 1)
    LOOP
        EXIT WHEN v_left <= 0;
        PERFORM 1 FROM __SCHEMA__.queue_claim_heads h WHERE h.lane_id = v_lane.lid FOR UPDATE SKIP LOCKED;
        CONTINUE WHEN NOT FOUND;
        v_cur := __SCHEMA__.lane_cursor_advance(v_lane.lid, v_lane.cseq);
        LOOP
            EXIT WHEN v_left <= 0;
            -- Index: ready_segments_lane (lane_id, last_seq)
            SELECT g.ready_slot INTO v_slot FROM __SCHEMA__.ready_segments g
            WHERE g.lane_id = v_lane.lid AND g.last_seq > v_cur
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
                WHERE r.ready_slot = v_slot AND r.lane_id = v_lane.lid AND r.lane_seq > v_cur
                ORDER BY r.lane_seq
                LIMIT v_left
            ), receipt AS (
                INSERT INTO __SCHEMA__.lease_claims (claim_slot, claim_id, lane_id, ready_slot, first_seq,
                    last_seq, job_ids, run_leases, lane_seqs, deadline_at)
                SELECT v_claim_slot, v_claim_id, v_lane.lid, v_slot, v_cur + 1, max(p.lane_seq),
                    COALESCE(array_agg(p.job_id ORDER BY p.lane_seq) FILTER (WHERE NOT p.tomb), '{}'),
                    COALESCE(array_agg(p.lease_base + 1 ORDER BY p.lane_seq) FILTER (WHERE NOT p.tomb), '{}'),
                    COALESCE(array_agg(p.lane_seq ORDER BY p.lane_seq) FILTER (WHERE NOT p.tomb), '{}'),
                    now() + v_meta.deadline
                FROM picked p
                HAVING count(*) > 0
                RETURNING 1
            )
            SELECT p.job_id, p.lease_base + 1, p.attempt + 1, p.max_attempts::int, p_queue, p.kind,
                v_lane.prio::int, p.args, p.metadata, v_slot, v_lane.lid, p.lane_seq, v_claim_slot,
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
    END LOOP;
END $$;

---------------------------------------------------------------------------
-- Attempt transitions. Every write about a receipt-backed attempt first
-- takes the per-receipt advisory lock and checks closure evidence; the
-- closure primary key (claim_slot, job_id, run_lease) backs it up. A
-- lease-backed attempt is guarded by deleting its (job_id, run_lease)
-- lease row. A stale writer matches nothing and is reported as stale.
---------------------------------------------------------------------------

-- Lock the receipts of a completion batch (ascending claim_id: the global
-- lock order) and return what in them is no longer open: every attempt
-- already closed (job_id, run_lease), or claim_id alone (job_id NULL) when
-- the whole receipt is closed or gone. O(receipts) parameters, not O(jobs).
-- Index: lease_claim_closures primary key (claim_slot, claim_id, ...).
CREATE FUNCTION __SCHEMA__.receipt_guard(p_claim_slots int[], p_claim_ids bigint[])
RETURNS TABLE (claim_id bigint, job_id bigint, run_lease int)
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(__SCHEMA__.lock_key('claim'), (x.cid % 2147483647)::int)
    FROM (SELECT DISTINCT cid FROM unnest(p_claim_ids) AS cid ORDER BY cid) x;
    RETURN QUERY
    SELECT r.cid, x.job_id, x.run_lease
    FROM unnest(p_claim_slots, p_claim_ids) AS r(cs, cid)
    JOIN __SCHEMA__.lease_claim_closures x ON x.claim_slot = r.cs AND x.claim_id = r.cid
    UNION ALL
    SELECT r.cid, NULL::bigint, NULL::int
    FROM unnest(p_claim_slots, p_claim_ids) AS r(cs, cid)
    WHERE EXISTS (SELECT 1 FROM __SCHEMA__.lease_claim_closure_batches b
                  WHERE b.claim_slot = r.cs AND b.claim_id = r.cid)
       OR NOT EXISTS (SELECT 1 FROM __SCHEMA__.lease_claims c
                      WHERE c.claim_slot = r.cs AND c.claim_id = r.cid);
END $$;

-- Complete a small batch of receipt-backed attempts in one statement (the
-- low-latency path: in autocommit this is one round trip and one commit).
-- Same guard and writes as the COPY path: per-receipt locks ascending,
-- stale attempts skipped and returned, done_entries and per-attempt
-- closures appended from the claim snapshots, attempt_state dropped.
CREATE FUNCTION __SCHEMA__.receipt_complete_rows(p_claim_slots int[], p_claim_ids bigint[], p_job_ids bigint[],
    p_run_leases int[], p_ready_slots int[], p_lane_ids int[], p_lane_seqs bigint[], p_attempts int[],
    p_queues text[], p_kinds text[], p_with_state boolean[]) RETURNS TABLE (job_id bigint, run_lease int)
LANGUAGE plpgsql AS $$
BEGIN
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
                    WHERE x.claim_slot = i.cs AND x.claim_id = i.cid AND x.job_id = i.j AND x.run_lease = i.l)
            OR EXISTS (SELECT 1 FROM __SCHEMA__.lease_claim_closure_batches b
                       WHERE b.claim_slot = i.cs AND b.claim_id = i.cid)
            OR NOT EXISTS (SELECT 1 FROM __SCHEMA__.lease_claims c
                           WHERE c.claim_slot = i.cs AND c.claim_id = i.cid)) AS stale
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

-- Append an error entry to a job's error history (newest last, at most 10).
CREATE FUNCTION __SCHEMA__.errors_append(p_errors jsonb, p_attempt int, p_message text) RETURNS jsonb
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN p_message IS NULL THEN p_errors ELSE (
        SELECT COALESCE(jsonb_agg(e ORDER BY n), '[]'::jsonb)
        FROM (
            SELECT e, n FROM jsonb_array_elements(
                COALESCE(p_errors, '[]'::jsonb) || jsonb_build_array(jsonb_build_object(
                    'attempt', p_attempt, 'error', left(p_message, 8192)))
            ) WITH ORDINALITY AS a(e, n)
            ORDER BY n DESC LIMIT 10
        ) last10
    ) END
$$;

-- Write the terminal record of an attempt whose body is (ready_slot,
-- lane_id, lane_seq): failed attempts go to the DLQ when the queue has it
-- enabled. Returns the closure outcome code to record.
CREATE FUNCTION __SCHEMA__.attempt_terminal(p_state int, p_ready_slot int, p_lane_id int, p_lane_seq bigint,
    p_job_id bigint, p_run_lease int, p_attempt int, p_error text) RETURNS int
LANGUAGE plpgsql AS $$
DECLARE
    b record;
    v_dlq boolean;
BEGIN
    SELECT r.*, l.queue, l.priority INTO STRICT b
    FROM __SCHEMA__.ready_entries r JOIN __SCHEMA__.queue_lanes l ON l.lane_id = r.lane_id
    WHERE r.ready_slot = p_ready_slot AND r.lane_id = p_lane_id AND r.lane_seq = p_lane_seq;
    IF p_state = 2 THEN
        SELECT m.dlq_enabled INTO v_dlq FROM __SCHEMA__.queue_meta m WHERE m.queue = b.queue;
        IF v_dlq THEN
            INSERT INTO __SCHEMA__.dlq_entries (job_id, queue, priority, kind, args, metadata, attempt,
                max_attempts, lease_base, errors, reason, created_at)
            VALUES (p_job_id, b.queue, b.priority, b.kind, b.args, b.metadata, p_attempt, b.max_attempts,
                p_run_lease, __SCHEMA__.errors_append(b.errors, p_attempt, p_error),
                COALESCE(left(p_error, 8192), 'failed'), b.created_at);
            RETURN 6;
        END IF;
    END IF;
    INSERT INTO __SCHEMA__.done_entries (ready_slot, job_id, lane_id, lane_seq, run_lease, attempt, state,
        queue, kind, error)
    VALUES (p_ready_slot, p_job_id, p_lane_id, p_lane_seq, p_run_lease, p_attempt, p_state, b.queue, b.kind,
        left(p_error, 8192));
    RETURN p_state;
END $$;

-- Move an attempt back to deferred_jobs (retry consumes the attempt,
-- snooze gives it back). Exhausted retries fail terminally instead.
-- Returns the closure outcome code.
CREATE FUNCTION __SCHEMA__.attempt_defer(p_outcome int, p_delay float8, p_ready_slot int, p_lane_id int,
    p_lane_seq bigint, p_job_id bigint, p_run_lease int, p_attempt int, p_error text) RETURNS int
LANGUAGE plpgsql AS $$
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
        lease_base, state, run_at, created_at, errors, callback_result)
    VALUES (p_job_id, b.queue, b.priority, b.kind, b.args, b.metadata,
        CASE WHEN p_outcome = 5 THEN p_attempt - 1 ELSE p_attempt END, b.max_attempts, p_run_lease,
        CASE WHEN p_outcome = 5 THEN 3 ELSE 2 END, now() + make_interval(secs => v_delay), b.created_at,
        CASE WHEN p_outcome = 4 THEN __SCHEMA__.errors_append(b.errors, p_attempt, p_error) ELSE b.errors END,
        NULL);
    RETURN p_outcome;
END $$;

-- Close a batch of attempts with explicit outcomes (anything but the COPY
-- completion fast path, and every lease-backed attempt).
-- p_outcomes: 1 complete, 2 fail terminally, 3 cancel, 4 retry (delay NULL
-- = backoff), 5 snooze. Returns one row per input: 'ok' or 'stale'.
CREATE FUNCTION __SCHEMA__.attempt_close(p_job_ids bigint[], p_run_leases int[], p_claim_slots int[],
    p_claim_ids bigint[], p_outcomes int[], p_delays float8[], p_errors text[])
RETURNS TABLE (job_id bigint, run_lease int, status text)
LANGUAGE plpgsql AS $$
DECLARE
    i int;
    v_lease __SCHEMA__.leases%ROWTYPE;
    v_rec record;
    v_slot int; v_lane int; v_seq bigint; v_attempt int;
    v_outcome int;
    v_cancel boolean;
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
        DELETE FROM __SCHEMA__.attempt_state a WHERE a.job_id = p_job_ids[i] AND a.run_lease = p_run_leases[i]
        RETURNING a.cancel_requested INTO v_cancel;
        IF coalesce(v_cancel, false) AND v_outcome IN (4, 5) THEN
            v_outcome := 3;
        END IF;
        IF v_outcome IN (1, 2, 3) THEN
            v_result := __SCHEMA__.attempt_terminal(v_outcome, v_slot, v_lane, v_seq, p_job_ids[i],
                p_run_leases[i], v_attempt, p_errors[i]);
        ELSE
            v_result := __SCHEMA__.attempt_defer(v_outcome, p_delays[i], v_slot, v_lane, v_seq, p_job_ids[i],
                p_run_leases[i], v_attempt, p_errors[i]);
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

-- Heartbeat and/or progress for a batch of attempts. Creates attempt_state
-- lazily for receipt-backed attempts; touches the lease row for
-- lease-backed ones. Returns 'ok', 'cancel' (cancel requested) or 'stale'.
CREATE FUNCTION __SCHEMA__.attempt_heartbeat(p_job_ids bigint[], p_run_leases int[], p_claim_slots int[],
    p_claim_ids bigint[], p_progress jsonb[]) RETURNS TABLE (job_id bigint, run_lease int, status text)
LANGUAGE plpgsql AS $$
DECLARE
    i int;
    v_cancel boolean;
BEGIN
    FOR i IN 1 .. coalesce(cardinality(p_job_ids), 0) LOOP
        job_id := p_job_ids[i];
        run_lease := p_run_leases[i];
        UPDATE __SCHEMA__.leases l SET heartbeat_at = now()
        WHERE l.job_id = p_job_ids[i] AND l.run_lease = p_run_leases[i];
        IF NOT FOUND THEN
            PERFORM pg_advisory_xact_lock(__SCHEMA__.lock_key('claim'), (p_claim_ids[i] % 2147483647)::int);
            PERFORM 1 FROM __SCHEMA__.lease_claims c
            WHERE c.claim_slot = p_claim_slots[i] AND c.claim_id = p_claim_ids[i]
              AND p_job_ids[i] = ANY (c.job_ids)
              AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.lease_claim_closure_batches b
                              WHERE b.claim_slot = c.claim_slot AND b.claim_id = c.claim_id)
              AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.lease_claim_closures x
                              WHERE x.claim_slot = c.claim_slot AND x.claim_id = c.claim_id AND x.job_id = p_job_ids[i]
                                AND x.run_lease = p_run_leases[i]);
            IF NOT FOUND THEN
                status := 'stale';
                RETURN NEXT;
                CONTINUE;
            END IF;
        END IF;
        INSERT INTO __SCHEMA__.attempt_state AS a (job_id, run_lease, claim_slot, claim_id, heartbeat_at, progress)
        VALUES (p_job_ids[i], p_run_leases[i], p_claim_slots[i], p_claim_ids[i], now(), p_progress[i])
        ON CONFLICT ON CONSTRAINT attempt_state_pkey DO UPDATE
            SET heartbeat_at = now(), progress = COALESCE(excluded.progress, a.progress), updated_at = now()
        RETURNING a.cancel_requested INTO v_cancel;
        status := CASE WHEN v_cancel THEN 'cancel' ELSE 'ok' END;
        RETURN NEXT;
    END LOOP;
END $$;

-- Materialize a receipt-backed attempt into the lease plane with a
-- callback token and timeout. NULL when the attempt is no longer open.
CREATE FUNCTION __SCHEMA__.attempt_register_callback(p_job_id bigint, p_run_lease int, p_claim_slot int,
    p_claim_id bigint, p_timeout float8) RETURNS uuid
LANGUAGE plpgsql AS $$
DECLARE
    v_rec record;
    v_token uuid := gen_random_uuid();
BEGIN
    PERFORM pg_advisory_xact_lock(__SCHEMA__.lock_key('claim'), (p_claim_id % 2147483647)::int);
    SELECT c.ready_slot, c.lane_id, c.lane_seqs[array_position(c.job_ids, p_job_id)] AS seq INTO v_rec
    FROM __SCHEMA__.lease_claims c
    WHERE c.claim_slot = p_claim_slot AND c.claim_id = p_claim_id
      AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.lease_claim_closure_batches b
                      WHERE b.claim_slot = c.claim_slot AND b.claim_id = c.claim_id)
      AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.lease_claim_closures x
                      WHERE x.claim_slot = c.claim_slot AND x.claim_id = c.claim_id AND x.job_id = p_job_id AND x.run_lease = p_run_lease);
    IF NOT FOUND OR v_rec.seq IS NULL THEN
        RETURN NULL;
    END IF;
    INSERT INTO __SCHEMA__.lease_claim_closures (claim_slot, claim_id, job_id, run_lease, outcome)
    VALUES (p_claim_slot, p_claim_id, p_job_id, p_run_lease, 8);
    INSERT INTO __SCHEMA__.leases (lease_slot, job_id, run_lease, claim_slot, claim_id, ready_slot, lane_id,
        lane_seq, queue, kind, attempt, max_attempts, callback_token, callback_timeout_at)
    SELECT __SCHEMA__.ring_current('lease'), p_job_id, p_run_lease, p_claim_slot, p_claim_id, r.ready_slot,
        r.lane_id, r.lane_seq, l.queue, r.kind, r.attempt + 1, r.max_attempts, v_token,
        now() + make_interval(secs => p_timeout)
    FROM __SCHEMA__.ready_entries r JOIN __SCHEMA__.queue_lanes l ON l.lane_id = r.lane_id
    WHERE r.ready_slot = v_rec.ready_slot AND r.lane_id = v_rec.lane_id AND r.lane_seq = v_rec.seq;
    RETURN v_token;
END $$;

-- Resolve a parked callback: 'complete', 'fail', 'retry' or 'resume'
-- (run again with p_payload as job.callback_result, no attempt consumed).
-- Returns 'ok', or 'unknown' when the token is not (or no longer) parked.
CREATE FUNCTION __SCHEMA__.callback_resolve(p_token uuid, p_action text, p_payload jsonb, p_error text)
RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    v_lease __SCHEMA__.leases%ROWTYPE;
    b record;
BEGIN
    DELETE FROM __SCHEMA__.leases l WHERE l.callback_token = p_token RETURNING * INTO v_lease;
    IF NOT FOUND THEN
        RETURN 'unknown';
    END IF;
    DELETE FROM __SCHEMA__.attempt_state a WHERE a.job_id = v_lease.job_id AND a.run_lease = v_lease.run_lease;
    IF p_action = 'complete' THEN
        PERFORM __SCHEMA__.attempt_terminal(1, v_lease.ready_slot, v_lease.lane_id, v_lease.lane_seq,
            v_lease.job_id, v_lease.run_lease, v_lease.attempt, NULL);
    ELSIF p_action = 'fail' THEN
        PERFORM __SCHEMA__.attempt_terminal(2, v_lease.ready_slot, v_lease.lane_id, v_lease.lane_seq,
            v_lease.job_id, v_lease.run_lease, v_lease.attempt, COALESCE(p_error, 'failed by callback'));
    ELSIF p_action = 'retry' THEN
        PERFORM __SCHEMA__.attempt_defer(4, NULL, v_lease.ready_slot, v_lease.lane_id, v_lease.lane_seq,
            v_lease.job_id, v_lease.run_lease, v_lease.attempt, COALESCE(p_error, 'retried by callback'));
    ELSIF p_action = 'resume' THEN
        SELECT r.*, l.priority INTO STRICT b
        FROM __SCHEMA__.ready_entries r JOIN __SCHEMA__.queue_lanes l ON l.lane_id = r.lane_id
        WHERE r.ready_slot = v_lease.ready_slot AND r.lane_id = v_lease.lane_id AND r.lane_seq = v_lease.lane_seq;
        PERFORM __SCHEMA__.ready_append(v_lease.queue, b.priority, v_lease.job_id, b.kind, b.args, b.metadata,
            v_lease.attempt - 1, b.max_attempts, v_lease.run_lease, b.created_at, b.errors,
            COALESCE(p_payload, 'null'::jsonb));
    ELSE
        RAISE EXCEPTION 'unknown callback action %', p_action USING ERRCODE = '22023';
    END IF;
    RETURN 'ok';
END $$;

-- Cancel a job wherever it is. Returns 'cancelled', 'cancel_requested'
-- (running: its handler sees job.is_cancelled()), 'terminal' or 'unknown'.
CREATE FUNCTION __SCHEMA__.job_cancel(p_job_id bigint) RETURNS text
LANGUAGE plpgsql AS $$
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
    FROM __SCHEMA__.ready_entries e JOIN __SCHEMA__.queue_claim_heads h ON h.lane_id = e.lane_id
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
    -- Claimed: flag the open attempt so its handler can see it.
    INSERT INTO __SCHEMA__.attempt_state AS a (job_id, run_lease, cancel_requested)
    SELECT p_job_id, r.lease_base + 1, true
    WHERE EXISTS (
        SELECT 1 FROM __SCHEMA__.lease_claims c
        WHERE c.lane_id = r.lane_id AND c.ready_slot = r.ready_slot AND p_job_id = ANY (c.job_ids)
          AND r.lane_seq BETWEEN c.first_seq AND c.last_seq
          AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.lease_claim_closure_batches b
                          WHERE b.claim_slot = c.claim_slot AND b.claim_id = c.claim_id)
          AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.lease_claim_closures x
                          WHERE x.claim_slot = c.claim_slot AND x.claim_id = c.claim_id AND x.job_id = p_job_id
                            AND x.run_lease = r.lease_base + 1))
    ON CONFLICT ON CONSTRAINT attempt_state_pkey DO UPDATE SET cancel_requested = true, updated_at = now();
    IF FOUND THEN
        RETURN 'cancel_requested';
    END IF;
    RETURN 'terminal';
END $$;

---------------------------------------------------------------------------
-- Maintenance: promote, rescue, rotate, prune, retention.
---------------------------------------------------------------------------

-- Append due deferred jobs back into ready_entries. Returns the count.
-- Index: deferred_jobs_due (run_at).
CREATE FUNCTION __SCHEMA__.deferred_promote(p_limit int) RETURNS int
LANGUAGE plpgsql AS $$
DECLARE
    d record;
    n int := 0;
BEGIN
    FOR d IN
        DELETE FROM __SCHEMA__.deferred_jobs x
        WHERE x.job_id IN (SELECT y.job_id FROM __SCHEMA__.deferred_jobs y WHERE y.run_at <= now()
                           ORDER BY y.run_at LIMIT p_limit FOR UPDATE SKIP LOCKED)
        RETURNING *
    LOOP
        PERFORM __SCHEMA__.ready_append(d.queue, d.priority, d.job_id, d.kind, d.args, d.metadata, d.attempt,
            d.max_attempts, d.lease_base, d.created_at, d.errors, d.callback_result);
        n := n + 1;
    END LOOP;
    RETURN n;
END $$;

-- Rescue receipt-backed attempts past their deadline or whose heartbeat
-- (or claim time, before any heartbeat) is older than the queue's
-- heartbeat_timeout: close the receipt append-only, then requeue (the
-- rescue consumes the attempt) or fail when attempts are exhausted. One
-- bad row is logged and skipped; it never blocks the rest.
CREATE FUNCTION __SCHEMA__.receipt_rescue_stale(p_limit int) RETURNS int
LANGUAGE plpgsql AS $$
DECLARE
    r record;
    n int := 0;
    v_attempt int;
    v_max int;
    v_reason text;
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
                DELETE FROM __SCHEMA__.attempt_state a WHERE a.job_id = r.job_id AND a.run_lease = r.run_lease;
                SELECT e.attempt + 1, e.max_attempts INTO STRICT v_attempt, v_max FROM __SCHEMA__.ready_entries e
                WHERE e.ready_slot = r.ready_slot AND e.lane_id = r.lane_id AND e.lane_seq = r.lane_seq;
                v_reason := CASE WHEN r.past_deadline THEN 'rescued: deadline exceeded'
                                 ELSE 'rescued: heartbeat stale' END;
                IF v_attempt >= v_max THEN
                    PERFORM __SCHEMA__.attempt_terminal(2, r.ready_slot, r.lane_id, r.lane_seq, r.job_id,
                        r.run_lease, v_attempt, v_reason || ' (attempts exhausted)');
                ELSE
                    PERFORM __SCHEMA__.ready_append(ql.queue, ql.priority, r.job_id, e.kind, e.args, e.metadata,
                        v_attempt, e.max_attempts, r.run_lease, e.created_at,
                        __SCHEMA__.errors_append(e.errors, v_attempt, v_reason), e.callback_result)
                    FROM __SCHEMA__.ready_entries e JOIN __SCHEMA__.queue_lanes ql ON ql.lane_id = e.lane_id
                    WHERE e.ready_slot = r.ready_slot AND e.lane_id = r.lane_id AND e.lane_seq = r.lane_seq;
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

-- Rescue lease-backed attempts whose callback timed out (retry, or fail
-- when exhausted). Returns the count.
CREATE FUNCTION __SCHEMA__.lease_rescue_expired(p_limit int) RETURNS int
LANGUAGE plpgsql AS $$
DECLARE
    v_lease record;
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
                DELETE FROM __SCHEMA__.attempt_state a
                WHERE a.job_id = v_lease.job_id AND a.run_lease = v_lease.run_lease;
                PERFORM __SCHEMA__.attempt_defer(4, NULL, v_lease.ready_slot, v_lease.lane_id, v_lease.lane_seq,
                    v_lease.job_id, v_lease.run_lease, v_lease.attempt, 'callback timed out');
                n := n + 1;
            END IF;
        EXCEPTION WHEN OTHERS THEN
            RAISE WARNING 'awa_fast: callback rescue of job % failed and was skipped: %', v_lease.job_id, SQLERRM;
        END;
    END LOOP;
    RETURN n;
END $$;

-- Drop attempt_state rows whose attempt is no longer open (e.g. a cancel
-- request that raced completion). Small table; rare deletes.
CREATE FUNCTION __SCHEMA__.attempt_state_sweep() RETURNS int
LANGUAGE plpgsql AS $$
DECLARE
    n int;
BEGIN
    DELETE FROM __SCHEMA__.attempt_state a
    WHERE a.updated_at < now() - interval '5 seconds'
      AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.leases l WHERE l.job_id = a.job_id AND l.run_lease = a.run_lease)
      AND NOT EXISTS (
          SELECT 1 FROM __SCHEMA__.lease_claims c
          WHERE a.job_id = ANY (c.job_ids)
            AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.lease_claim_closure_batches b
                            WHERE b.claim_slot = c.claim_slot AND b.claim_id = c.claim_id)
            AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.lease_claim_closures x
                            WHERE x.claim_slot = c.claim_slot AND x.claim_id = c.claim_id AND x.job_id = a.job_id
                              AND x.run_lease = a.run_lease));
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END $$;

-- Is a slot's set of child tables empty? (rotation target check)
CREATE FUNCTION __SCHEMA__.ring_slot_empty(p_ring text, p_slot int) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    s text := '__SCHEMA__';
    t text;
    v_any boolean;
BEGIN
    FOREACH t IN ARRAY CASE p_ring
        WHEN 'ready' THEN ARRAY['ready_entries', 'ready_segments', 'ready_tombstones', 'done_entries']
        WHEN 'claim' THEN ARRAY['lease_claims', 'lease_claim_closures', 'lease_claim_closure_batches']
        ELSE ARRAY['leases'] END
    LOOP
        EXECUTE format('SELECT EXISTS (SELECT 1 FROM %s.%s_%s)', s, t, p_slot) INTO v_any;
        IF v_any THEN
            RETURN false;
        END IF;
    END LOOP;
    RETURN true;
END $$;

-- Rotate a ring to its next slot if that slot is empty (already pruned).
-- Appends a ledger row; a concurrent rotation loses on the primary key.
-- Returns the new current slot, or NULL when the ring is full.
CREATE FUNCTION __SCHEMA__.ring_rotate(p_ring text) RETURNS int
LANGUAGE plpgsql AS $$
DECLARE
    v_gen bigint;
    v_slot int;
    v_next int;
    v_count int;
BEGIN
    SELECT generation, slot INTO STRICT v_gen, v_slot FROM __SCHEMA__.ring_rotations
    WHERE ring = p_ring ORDER BY generation DESC LIMIT 1;
    SELECT slot_count INTO STRICT v_count FROM __SCHEMA__.ring_config WHERE ring = p_ring;
    v_next := (v_slot + 1) % v_count;
    IF NOT __SCHEMA__.ring_slot_empty(p_ring, v_next) THEN
        RETURN NULL;
    END IF;
    INSERT INTO __SCHEMA__.ring_rotations (ring, generation, slot) VALUES (p_ring, v_gen + 1, v_next)
    ON CONFLICT DO NOTHING;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    -- keep the ledger short: generations older than two full cycles go
    DELETE FROM __SCHEMA__.ring_rotations WHERE ring = p_ring AND generation < v_gen + 1 - 2 * v_count;
    RETURN v_next;
END $$;

-- Move the claim cursors of the given lanes across committed receipts and
-- then across a committed prefix of tombstoned rows (cancelled before any
-- claim), skipping lanes a claimer holds right now. Prune uses it so a
-- slot whose rows were all claimed or cancelled can go even when no
-- claimer serves the queue.
CREATE FUNCTION __SCHEMA__.lanes_cursor_advance(p_lanes int[]) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    h record;
    v_cur bigint;
    v_next record;
    v_slot int;
    v_moved boolean;
BEGIN
    FOR h IN
        SELECT x.lane_id, x.claim_seq FROM __SCHEMA__.queue_claim_heads x
        WHERE x.lane_id = ANY (p_lanes) ORDER BY x.lane_id FOR UPDATE SKIP LOCKED
    LOOP
        v_cur := __SCHEMA__.lane_cursor_advance(h.lane_id, h.claim_seq);
        v_moved := false;
        LOOP
            SELECT g.ready_slot INTO v_slot FROM __SCHEMA__.ready_segments g
            WHERE g.lane_id = h.lane_id AND g.last_seq > v_cur ORDER BY g.last_seq LIMIT 1;
            EXIT WHEN NOT FOUND;
            SELECT r.lane_seq, (t.lane_seq IS NOT NULL) AS tomb INTO v_next
            FROM __SCHEMA__.ready_entries r
            LEFT JOIN __SCHEMA__.ready_tombstones t
                ON t.ready_slot = r.ready_slot AND t.lane_id = r.lane_id AND t.lane_seq = r.lane_seq
            WHERE r.ready_slot = v_slot AND r.lane_id = h.lane_id AND r.lane_seq > v_cur
            ORDER BY r.lane_seq LIMIT 1;
            EXIT WHEN NOT FOUND OR NOT v_next.tomb;
            v_cur := v_next.lane_seq;
            v_moved := true;
        END LOOP;
        IF v_moved THEN
            PERFORM setval(h.claim_seq, v_cur, true);
        END IF;
    END LOOP;
END $$;

-- Prune gate of a sealed ready slot: NULL when it may be truncated, else
-- the reason it may not.
CREATE FUNCTION __SCHEMA__.ready_prune_gate(p_slot int) RETURNS text
LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM __SCHEMA__.ready_segments g
               JOIN __SCHEMA__.queue_claim_heads h ON h.lane_id = g.lane_id
               WHERE g.ready_slot = p_slot AND g.last_seq > pg_sequence_last_value(h.claim_seq)) THEN
        RETURN 'pending_ready';
    END IF;
    IF EXISTS (SELECT 1 FROM __SCHEMA__.lease_claims c
               CROSS JOIN LATERAL unnest(c.job_ids, c.run_leases) AS u(j, l)
               WHERE c.ready_slot = p_slot
                 AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.lease_claim_closure_batches b
                                 WHERE b.claim_slot = c.claim_slot AND b.claim_id = c.claim_id)
                 AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.lease_claim_closures x
                                 WHERE x.claim_slot = c.claim_slot AND x.claim_id = c.claim_id AND x.job_id = u.j AND x.run_lease = u.l)) THEN
        RETURN 'open_claims';
    END IF;
    IF EXISTS (SELECT 1 FROM __SCHEMA__.leases l WHERE l.ready_slot = p_slot) THEN
        RETURN 'active_leases';
    END IF;
    RETURN NULL;
END $$;

-- Prune gate of a sealed claim slot: every receipt closed, and every lane
-- cursor past every receipt (else a lagging cursor would lose its evidence).
CREATE FUNCTION __SCHEMA__.claim_prune_gate(p_slot int) RETURNS text
LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM __SCHEMA__.lease_claims c
               CROSS JOIN LATERAL unnest(c.job_ids, c.run_leases) AS u(j, l)
               WHERE c.claim_slot = p_slot
                 AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.lease_claim_closure_batches b
                                 WHERE b.claim_slot = c.claim_slot AND b.claim_id = c.claim_id)
                 AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.lease_claim_closures x
                                 WHERE x.claim_slot = c.claim_slot AND x.claim_id = c.claim_id AND x.job_id = u.j AND x.run_lease = u.l)) THEN
        RETURN 'open_claims';
    END IF;
    IF EXISTS (SELECT 1 FROM __SCHEMA__.lease_claims c
               JOIN __SCHEMA__.queue_claim_heads h ON h.lane_id = c.lane_id
               WHERE c.claim_slot = p_slot AND c.last_seq > pg_sequence_last_value(h.claim_seq)) THEN
        RETURN 'cursor_behind';
    END IF;
    RETURN NULL;
END $$;

-- Prune one sealed slot of a ring: lock its slot row, check the gates,
-- take ACCESS EXCLUSIVE on the children within p_lock_timeout, check the
-- gates again, fold terminal counts into the rollups (ready ring), then
-- TRUNCATE. A busy or blocked slot is skipped, never waited on for long.
-- Returns 'pruned', 'empty', 'current', 'busy', or the gate that failed.
-- SECURITY DEFINER: the runtime role needs no TRUNCATE privilege; prune is
-- the only path that takes ACCESS EXCLUSIVE or truncates.
CREATE FUNCTION __SCHEMA__.ring_prune(p_ring text, p_slot int, p_lock_timeout text DEFAULT '50ms') RETURNS text
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    s text := '__SCHEMA__';
    v_tables text[];
    v_list text;
    v_gate text;
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
    PERFORM 1 FROM __SCHEMA__.ring_slots WHERE ring = p_ring AND slot = p_slot FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN 'busy';
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
            RETURN v_gate;
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

-- DLQ retention: delete entries older than their queue's dlq_retention.
CREATE FUNCTION __SCHEMA__.dlq_retention_prune(p_limit int) RETURNS int
LANGUAGE plpgsql AS $$
DECLARE
    n int;
BEGIN
    DELETE FROM __SCHEMA__.dlq_entries x
    WHERE x.job_id IN (
        SELECT d.job_id FROM __SCHEMA__.dlq_entries d JOIN __SCHEMA__.queue_meta m ON m.queue = d.queue
        WHERE d.failed_at < now() - m.dlq_retention LIMIT p_limit);
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END $$;

-- Move DLQ entries back to ready with fresh attempts. Returns the job ids.
CREATE FUNCTION __SCHEMA__.dlq_retry(p_job_ids bigint[]) RETURNS SETOF bigint
LANGUAGE plpgsql AS $$
DECLARE
    d record;
BEGIN
    FOR d IN DELETE FROM __SCHEMA__.dlq_entries x WHERE x.job_id = ANY (p_job_ids) RETURNING * LOOP
        PERFORM __SCHEMA__.ready_append(d.queue, d.priority, d.job_id, d.kind, d.args, d.metadata, 0,
            d.max_attempts, d.lease_base, d.created_at, d.errors, NULL);
        RETURN NEXT d.job_id;
    END LOOP;
END $$;

---------------------------------------------------------------------------
-- Reads
---------------------------------------------------------------------------

-- Fast per-queue depth from the lane heads: enqueue cursor minus claim
-- cursor. No scan; may over-count (gaps, tombstones, a lagging cursor).
CREATE FUNCTION __SCHEMA__.queue_depth_fast() RETURNS TABLE (queue text, depth bigint)
LANGUAGE sql STABLE AS $$
    SELECT e.queue, sum(greatest(pg_sequence_last_value(e.enqueue_seq) - pg_sequence_last_value(h.claim_seq), 0))::bigint
    FROM __SCHEMA__.queue_enqueue_heads e JOIN __SCHEMA__.queue_claim_heads h ON h.lane_id = e.lane_id
    GROUP BY e.queue
$$;

-- Exact counts per queue and state (scans the live rings; admin use).
CREATE FUNCTION __SCHEMA__.queue_counts_exact() RETURNS TABLE (queue text, state text, count bigint)
LANGUAGE sql STABLE AS $$
    WITH cursors AS (
        SELECT h.lane_id, h.queue,
               greatest(pg_sequence_last_value(h.claim_seq),
                        COALESCE((SELECT max(c.last_seq) FROM __SCHEMA__.lease_claims c WHERE c.lane_id = h.lane_id), 0)) AS cur
        FROM __SCHEMA__.queue_claim_heads h
    ), open_claims AS (
        SELECT ql.queue, u.j, u.l
        FROM __SCHEMA__.lease_claims c
        JOIN __SCHEMA__.queue_lanes ql ON ql.lane_id = c.lane_id
        CROSS JOIN LATERAL unnest(c.job_ids, c.run_leases) AS u(j, l)
        WHERE NOT EXISTS (SELECT 1 FROM __SCHEMA__.lease_claim_closure_batches b
                          WHERE b.claim_slot = c.claim_slot AND b.claim_id = c.claim_id)
          AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.lease_claim_closures x
                          WHERE x.claim_slot = c.claim_slot AND x.claim_id = c.claim_id AND x.job_id = u.j AND x.run_lease = u.l)
    )
    SELECT k.queue, 'available', count(*)
    FROM __SCHEMA__.ready_entries r JOIN cursors k ON k.lane_id = r.lane_id
    WHERE r.lane_seq > k.cur
      AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.ready_tombstones t
                      WHERE t.ready_slot = r.ready_slot AND t.lane_id = r.lane_id AND t.lane_seq = r.lane_seq)
    GROUP BY k.queue
    UNION ALL SELECT o.queue, 'running', count(*) FROM open_claims o GROUP BY o.queue
    UNION ALL SELECT l.queue, 'waiting', count(*) FROM __SCHEMA__.leases l GROUP BY l.queue
    UNION ALL SELECT d.queue, CASE d.state WHEN 1 THEN 'scheduled' WHEN 2 THEN 'retryable' ELSE 'snoozed' END,
                     count(*) FROM __SCHEMA__.deferred_jobs d GROUP BY 1, 2
    UNION ALL SELECT q.queue, CASE q.state WHEN 1 THEN 'completed' WHEN 2 THEN 'failed' ELSE 'cancelled' END,
                     sum(q.n)::bigint
              FROM (SELECT de.queue, de.state, count(*) AS n FROM __SCHEMA__.done_entries de GROUP BY 1, 2
                    UNION ALL SELECT tr.queue, tr.state, tr.count FROM __SCHEMA__.queue_terminal_rollups tr) q
              GROUP BY 1, 2
    UNION ALL SELECT x.queue, 'dlq', count(*) FROM __SCHEMA__.dlq_entries x GROUP BY x.queue
$$;

-- Where is a job now? One JSON object, or NULL when unknown (or pruned).
CREATE FUNCTION __SCHEMA__.job_load(p_job_id bigint) RETURNS jsonb
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v jsonb;
    r record;
    v_state text;
BEGIN
    SELECT jsonb_build_object('state', CASE d.state WHEN 1 THEN 'completed' WHEN 2 THEN 'failed' ELSE 'cancelled' END,
        'job_id', d.job_id, 'queue', d.queue, 'kind', d.kind, 'attempt', d.attempt, 'run_lease', d.run_lease,
        'error', d.error, 'finished_at', d.finished_at,
        'args', COALESCE(d.args, e.args), 'metadata', COALESCE(d.metadata, e.metadata), 'errors', e.errors,
        'max_attempts', e.max_attempts, 'created_at', e.created_at)
    INTO v
    FROM __SCHEMA__.done_entries d
    LEFT JOIN __SCHEMA__.ready_entries e
        ON e.ready_slot = d.ready_slot AND e.lane_id = d.lane_id AND e.lane_seq = d.lane_seq
    WHERE d.job_id = p_job_id ORDER BY d.run_lease DESC LIMIT 1;
    IF v IS NOT NULL THEN RETURN v; END IF;
    SELECT jsonb_build_object('state', 'dlq', 'job_id', x.job_id, 'queue', x.queue, 'kind', x.kind,
        'priority', x.priority, 'args', x.args, 'metadata', x.metadata, 'attempt', x.attempt,
        'max_attempts', x.max_attempts, 'run_lease', x.lease_base, 'errors', x.errors, 'error', x.reason,
        'created_at', x.created_at, 'finished_at', x.failed_at)
    INTO v FROM __SCHEMA__.dlq_entries x WHERE x.job_id = p_job_id;
    IF v IS NOT NULL THEN RETURN v; END IF;
    SELECT jsonb_build_object('state', CASE x.state WHEN 1 THEN 'scheduled' WHEN 2 THEN 'retryable' ELSE 'snoozed' END,
        'job_id', x.job_id, 'queue', x.queue, 'kind', x.kind, 'priority', x.priority, 'args', x.args,
        'metadata', x.metadata, 'attempt', x.attempt, 'max_attempts', x.max_attempts, 'run_lease', x.lease_base,
        'errors', x.errors, 'run_at', x.run_at, 'created_at', x.created_at)
    INTO v FROM __SCHEMA__.deferred_jobs x WHERE x.job_id = p_job_id;
    IF v IS NOT NULL THEN RETURN v; END IF;
    SELECT jsonb_build_object('state', 'waiting_external', 'job_id', l.job_id, 'queue', l.queue, 'kind', l.kind,
        'attempt', l.attempt, 'max_attempts', l.max_attempts, 'run_lease', l.run_lease,
        'callback_timeout_at', l.callback_timeout_at, 'args', e.args, 'metadata', e.metadata,
        'errors', e.errors, 'created_at', e.created_at)
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
    RETURN jsonb_build_object(
        'state', v_state,
        'job_id', r.job_id, 'queue', r.queue, 'kind', r.kind, 'priority', r.priority, 'args', r.args,
        'metadata', r.metadata,
        'attempt', CASE WHEN v_state = 'running' THEN r.attempt + 1 ELSE r.attempt END,
        'max_attempts', r.max_attempts,
        'run_lease', CASE WHEN v_state = 'running' THEN r.lease_base + 1 ELSE r.lease_base END,
        'errors', r.errors, 'created_at', r.created_at);
END $$;

---------------------------------------------------------------------------
-- Least privilege
---------------------------------------------------------------------------

-- Grant a runtime role what enqueue, supervise and admin need: DML on the
-- tables, the sequences (cursors are setval'd), EXECUTE on the functions.
-- No DDL and no TRUNCATE: lane creation and prune run as the owner through
-- SECURITY DEFINER functions. Lane sequences created later are covered by
-- default privileges of the owner.
CREATE FUNCTION __SCHEMA__.runtime_grant(p_role text) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    s text := '__SCHEMA__';
BEGIN
    EXECUTE format('GRANT USAGE ON SCHEMA %s TO %I', s, p_role);
    EXECUTE format('GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA %s TO %I', s, p_role);
    EXECUTE format('GRANT USAGE, SELECT, UPDATE ON ALL SEQUENCES IN SCHEMA %s TO %I', s, p_role);
    EXECUTE format('GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA %s TO %I', s, p_role);
    EXECUTE format('ALTER DEFAULT PRIVILEGES IN SCHEMA %s GRANT USAGE, SELECT, UPDATE ON SEQUENCES TO %I',
                   s, p_role);
    EXECUTE format('ALTER DEFAULT PRIVILEGES IN SCHEMA %s GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO %I',
                   s, p_role);
END $$;
