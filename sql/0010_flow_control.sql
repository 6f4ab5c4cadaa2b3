-- awa-fast flow control: fleet-wide max_running and a token-bucket rate
-- limit per queue, enforced in the claim (issue 14; docs/flow-control.md).
-- compatible-with-previous: yes
-- Immutable once landed, like every migration (rule: docs/storage.md,
-- "Migrations").
--
-- Additive only: two new tables and three new functions. No existing
-- table, function or grant changes; the claim function claim_batch_v3 is
-- untouched and is still what a queue without limits claims through.
--
-- Previous runtimes: a runtime from before this migration keeps running
-- against it unchanged (it never reads the new tables and calls only
-- functions that are unchanged). It does not enforce limits either: a
-- limit configured while such a runtime claims the queue is exceeded by
-- what that runtime claims. Upgrade every supervisor of a queue before
-- configuring a limit on it.
--
-- The shape (why no hot counter, why one row per queue):
-- - queue_limits: the operator's settings, one row per limited queue,
--   written only by configure. A queue without a row (or with every limit
--   NULL) is claimed exactly as before: the runtime reads this table every
--   few seconds and calls claim_batch_v3 directly.
-- - queue_limit_state: one small row per limited queue, updated at most
--   once per claim call (never per job) and only when the call changed
--   something (jobs claimed, or the set of receipts it watches shrank or
--   grew): the token bucket (tokens, refilled_at) and the bookkeeping that
--   keeps the running count cheap (open_*: receipts of the queue that may
--   still hold an open attempt; seen_*: per lane, the highest receipt
--   last_seq already looked at).
-- - running is derived, never counted up and down: open attempts = the
--   attempts of the watched receipts that have no closure (neither a
--   lease_claim_closure_batches row nor a lease_claim_closures row), plus
--   the queue's materialized leases (callback waits). Receipts the state
--   has not seen yet are found per lane by the index lease_claims_lane
--   (lane_id, last_seq > seen), which also catches receipts of claimers
--   that called the claim function directly (a runtime that has not re-read
--   the settings yet). Per lane, committed receipts become visible in
--   last_seq order (the claim head row lock serializes claims of a lane
--   up to commit), so "last_seq > seen" never misses one.
-- - concurrent claimers of one limited queue serialize on a transaction
--   advisory lock (lock_key('limit'), hashtext(queue)) taken inside
--   lane_claim_limited: two cannot both see room. Queues without limits
--   never take it.

CREATE TABLE __SCHEMA__.queue_limits (
    queue            text PRIMARY KEY,
    max_running      int    CHECK (max_running >= 0),             -- NULL: no concurrency limit
    rate_count       float8 CHECK (rate_count > 0),               -- NULL: no rate limit
    rate_per         float8 CHECK (rate_per > 0),                 -- seconds
    rate_burst       float8 CHECK (rate_burst >= 1),              -- bucket capacity
    updated_at       timestamptz NOT NULL DEFAULT now(),
    CHECK ((rate_count IS NULL) = (rate_per IS NULL) AND (rate_count IS NULL) = (rate_burst IS NULL))
);

-- fillfactor 50: the per-claim UPDATE stays a HOT update on the same page,
-- so its dead versions are pruned in place without vacuum.
CREATE TABLE __SCHEMA__.queue_limit_state (
    queue        text        PRIMARY KEY,
    tokens       float8      NOT NULL,
    refilled_at  timestamptz NOT NULL,
    open_slots   smallint[]  NOT NULL DEFAULT '{}',
    open_ids     bigint[]    NOT NULL DEFAULT '{}',
    seen_lanes   int[]       NOT NULL DEFAULT '{}',
    seen_seqs    bigint[]    NOT NULL DEFAULT '{}',
    running      int         NOT NULL DEFAULT 0,      -- as of the last writing claim call (status)
    updated_at   timestamptz NOT NULL DEFAULT now()
) WITH (fillfactor = 50);

---------------------------------------------------------------------------
-- The open receipts of a queue, from the watched set plus what was
-- committed since (per lane, last_seq past the seen mark). One row per
-- receipt that still holds an open attempt, with how many, and per lane
-- the new seen mark (rows with claim_id NULL). A receipt's closures are
-- all of its own attempts (the closure key starts with the receipt), so its
-- open count is its attempts minus its closures. Cost: one PK probe of
-- lease_claims and one of each closure table per watched receipt (run-time
-- partition pruning: one partition each), one index range per lane whose
-- enqueue head moved past its seen mark.
---------------------------------------------------------------------------
CREATE FUNCTION __SCHEMA__.limit_open_receipts(p_queue text, p_open_slots smallint[], p_open_ids bigint[],
    p_seen_lanes int[], p_seen_seqs bigint[])
RETURNS TABLE (claim_slot smallint, claim_id bigint, lane_id int, seen bigint, open_n int)
LANGUAGE sql STABLE AS $$
    WITH lanes AS (
        SELECT e.lane_id AS lid, COALESCE(s.seq, 0) AS seen, e.enqueue_seq
        FROM __SCHEMA__.queue_enqueue_heads e
        LEFT JOIN unnest(p_seen_lanes, p_seen_seqs) AS s(lid, seq) ON s.lid = e.lane_id
        WHERE e.queue = p_queue
    ), fresh AS (
        -- only lanes whose enqueue head is past the mark can have a receipt
        -- past it; Index: lease_claims_lane (lane_id, last_seq), both bounds
        -- in the index condition (OFFSET 0: a parameterized range per lane)
        SELECT f.cs, f.cid, l.lid, f.last_seq
        FROM lanes l
        CROSS JOIN LATERAL (
            SELECT c.claim_slot AS cs, c.claim_id AS cid, c.last_seq FROM __SCHEMA__.lease_claims c
            WHERE c.lane_id = l.lid AND c.last_seq > l.seen
            OFFSET 0) f
        WHERE pg_sequence_last_value(l.enqueue_seq) > l.seen
    ), cand AS (
        SELECT u.cs, u.cid FROM unnest(p_open_slots, p_open_ids) AS u(cs, cid)
        UNION
        SELECT f.cs, f.cid FROM fresh f
    )
    SELECT c.claim_slot, c.claim_id, c.lane_id, NULL::bigint, c.n::int
    FROM cand k
    CROSS JOIN LATERAL (
        -- primary-key probes, one partition each (run-time pruning on k.cs);
        -- OFFSET 0 keeps them probes: flattened, the planner hash-joins a
        -- seq scan of every live receipt
        SELECT r.claim_slot, r.claim_id, r.lane_id,
               cardinality(r.job_ids) - (SELECT count(*) FROM __SCHEMA__.lease_claim_closures x
                                         WHERE x.claim_slot = r.claim_slot AND x.claim_id = r.claim_id) AS n
        FROM __SCHEMA__.lease_claims r
        WHERE r.claim_slot = k.cs AND r.claim_id = k.cid
          AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.lease_claim_closure_batches b
                          WHERE b.claim_slot = r.claim_slot AND b.claim_id = r.claim_id)
        OFFSET 0) c
    WHERE c.n > 0
    UNION ALL
    SELECT NULL, NULL, l.lid, greatest(l.seen, COALESCE((SELECT max(f.last_seq) FROM fresh f WHERE f.lid = l.lid), 0)), NULL
    FROM lanes l
$$;

---------------------------------------------------------------------------
-- The claim of a queue with limits: same arguments and result rows as the
-- claim function it calls (claim snapshots, then possibly the backlog
-- marker, a row with job_id NULL). In one transaction: lock the queue's
-- limit (advisory, transaction-scoped), derive running, refill the bucket
-- on the database clock, claim at most what fits, charge the bucket for
-- what was claimed, write the state row once. When a limit (not the lack
-- of work) made the claim short it returns the backlog marker, so the
-- claimer comes back after its short busy pause instead of waiting for a
-- NOTIFY that a full limit never sends.
---------------------------------------------------------------------------
CREATE FUNCTION __SCHEMA__.lane_claim_limited(p_queue text, p_max int, p_stripe int DEFAULT 0, p_stripes int DEFAULT 1)
RETURNS TABLE (job_id bigint, run_lease int, attempt int, max_attempts int, queue text, kind text,
    priority int, args jsonb, metadata jsonb, ready_slot int, lane_id int, lane_seq bigint,
    claim_slot int, claim_id bigint, created_at timestamptz, errors jsonb, callback_result jsonb,
    progress jsonb)
LANGUAGE plpgsql AS $$
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
            -- attempts parked for a callback (receipt closed, lease live) still run
            v_running := v_running + (SELECT count(*) FROM __SCHEMA__.leases l WHERE l.queue = p_queue);
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

---------------------------------------------------------------------------
-- Flow-control status per limited queue: the limits, running now (derived
-- as the claim derives it, without writing) and tokens left now.
---------------------------------------------------------------------------
CREATE FUNCTION __SCHEMA__.queue_limit_status()
RETURNS TABLE (queue text, max_running int, rate_count float8, rate_per float8, rate_burst float8,
    running bigint, tokens float8)
LANGUAGE sql STABLE AS $$
    SELECT l.queue, l.max_running, l.rate_count, l.rate_per, l.rate_burst,
        (SELECT COALESCE(sum(o.open_n), 0) FROM __SCHEMA__.limit_open_receipts(l.queue,
             COALESCE(s.open_slots, '{}'), COALESCE(s.open_ids, '{}'),
             COALESCE(s.seen_lanes, '{}'), COALESCE(s.seen_seqs, '{}')) o)
        + (SELECT count(*) FROM __SCHEMA__.leases x WHERE x.queue = l.queue),
        CASE WHEN l.rate_count IS NOT NULL THEN
            least(l.rate_burst, COALESCE(s.tokens, l.rate_burst)
                + greatest(extract(epoch FROM clock_timestamp() - COALESCE(s.refilled_at, clock_timestamp())), 0)
                  * l.rate_count / l.rate_per) END
    FROM __SCHEMA__.queue_limits l
    LEFT JOIN __SCHEMA__.queue_limit_state s ON s.queue = l.queue
    ORDER BY l.queue
$$;

-- Generic plans (as 0003 pins for every PL/pgSQL function), and no JIT:
-- the planner costs the probes over every ring partition high enough to
-- cross jit_above_cost, and compiling them took ~180 ms per call at 1,000
-- open receipts for ~10 ms of execution.
ALTER FUNCTION __SCHEMA__.lane_claim_limited(text, int, int, int)
    SET plan_cache_mode = force_generic_plan SET jit = off;
ALTER FUNCTION __SCHEMA__.queue_limit_status() SET jit = off;

-- Roles an earlier runtime_grant covered get EXECUTE on the functions above
-- from the migrator, which grants every such role again after it applies
-- migrations (awa_fast/storage/migrate.py), and revokes EXECUTE from PUBLIC.
