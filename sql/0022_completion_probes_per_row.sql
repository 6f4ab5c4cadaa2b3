-- awa-fast: the quiet completion probes each attempt's receipt by key, whatever the claim slot holds (issue 16).
-- compatible-with-previous: yes
-- Immutable once landed, like every migration.
--
-- The problem. receipt_complete_rows_v2 (0015), the batcher's small flush
-- (every completion at a trickle), decides per attempt whether it is stale
-- with three correlated EXISTS tests: a closure of the attempt, a whole-
-- receipt closure, the receipt itself. The planner may turn such an EXISTS
-- into a hashed subplan: read every row of the subquery that does not
-- depend on the outer row once, hash it, probe the hash per outer row. Its
-- generic plan estimates the unnest input at 10 rows and, on a freshly
-- migrated schema (or after a vacuum counted the claim partitions), chose
-- the hashed form for some of the three: an index scan on claim_slot alone,
-- so every completion of one job read every closure and every receipt of
-- its claim slot (auto_explain, 1,501 closure and 1,502 receipt entries for
-- one job; its time grew from 0.55 to 1.4 ms as the slot filled, until the
-- backend happened to plan again). The slot holds everything claimed since
-- the claim ring last rotated into it, so the cost grew with traffic: the
-- thing DESIGN.md section 1 rules out on the hot path.
--
-- The fix (body only: same arguments, same result, same rows written, same
-- locks in the same order): each EXISTS subquery gets OFFSET 0, which keeps
-- the planner from converting it to the hashable form, so each test is one
-- primary-key probe per attempt, in the one partition the claim slot names
-- (run-time pruning on the slot parameter). receipt_complete_rows (version
-- 1, the fallback for a batch across claim slots) gets the same change, and
-- so do the receipt tests of the COPY completion (receipt_guard, which read
-- every receipt of the slot by a sequential scan for a batch of one) and of
-- receipt_complete_results (the same test in its gone CTE).
-- Each probe reads a handful of index pages, however full the slot is;
-- tests/integration/test_completion_probes.py counts the rows and index
-- entries a completion reads (601 for one job in a slot of 300 before).
--
-- Compatibility: the previous runtime calls these four functions by the same
-- names and gets the same results.

CREATE OR REPLACE FUNCTION __SCHEMA__.receipt_complete_rows(p_claim_slots int[], p_claim_ids bigint[],
    p_job_ids bigint[], p_run_leases int[], p_ready_slots int[], p_lane_ids int[], p_lane_seqs bigint[],
    p_attempts int[], p_queues text[], p_kinds text[], p_with_state boolean[])
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
                             p_lane_seqs, p_attempts, p_queues, p_kinds, p_with_state)
            AS u(cs, cid, j, l, rs, lane, seq, att, q, k, st)
    ), checked AS (
        -- one probe per attempt and test (OFFSET 0: never a hashed scan of the whole slot)
        SELECT i.*, (
            EXISTS (SELECT 1 FROM __SCHEMA__.lease_claim_closures x
                    WHERE x.claim_slot = i.cs AND x.claim_id = i.cid AND x.job_id = i.j AND x.run_lease = i.l
                    OFFSET 0)
            OR EXISTS (SELECT 1 FROM __SCHEMA__.lease_claim_closure_batches b
                       WHERE b.claim_slot = i.cs AND b.claim_id = i.cid OFFSET 0)
            OR NOT EXISTS (SELECT 1 FROM __SCHEMA__.lease_claims c
                           WHERE c.claim_slot = i.cs AND c.claim_id = i.cid OFFSET 0)) AS stale
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

CREATE OR REPLACE FUNCTION __SCHEMA__.receipt_complete_rows_v2(p_claim_slots int[], p_claim_ids bigint[],
    p_job_ids bigint[], p_run_leases int[], p_ready_slots int[], p_lane_ids int[], p_lane_seqs bigint[],
    p_attempts int[], p_queues text[], p_kinds text[], p_with_state boolean[])
RETURNS TABLE (job_id bigint, run_lease int)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
AS $$
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
        -- one probe per attempt and test in the slot's one partition (OFFSET 0: never a hashed
        -- scan of everything the slot holds)
        SELECT i.*, (
            EXISTS (SELECT 1 FROM __SCHEMA__.lease_claim_closures x
                    WHERE x.claim_slot = v_cs AND x.claim_id = i.cid AND x.job_id = i.j AND x.run_lease = i.l
                    OFFSET 0)
            OR EXISTS (SELECT 1 FROM __SCHEMA__.lease_claim_closure_batches b
                       WHERE b.claim_slot = v_cs AND b.claim_id = i.cid OFFSET 0)
            OR NOT EXISTS (SELECT 1 FROM __SCHEMA__.lease_claims c
                           WHERE c.claim_slot = v_cs AND c.claim_id = i.cid OFFSET 0)) AS stale
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

CREATE OR REPLACE FUNCTION __SCHEMA__.receipt_guard(p_claim_slots integer[], p_claim_ids bigint[])
RETURNS TABLE(claim_id bigint, job_id bigint, run_lease integer)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
AS $$
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
    -- one primary-key probe per receipt and test (OFFSET 0: never a hashed scan of the slots)
    WHERE EXISTS (SELECT 1 FROM __SCHEMA__.lease_claim_closure_batches b
                  WHERE b.claim_slot = r.cs AND b.claim_id = r.cid OFFSET 0)
       OR NOT EXISTS (SELECT 1 FROM __SCHEMA__.lease_claims c
                      WHERE c.claim_slot = r.cs AND c.claim_id = r.cid OFFSET 0);
END $$;

CREATE OR REPLACE FUNCTION __SCHEMA__.receipt_complete_results(p_claim_slots integer[], p_claim_ids bigint[], p_job_ids bigint[], p_run_leases integer[], p_ready_slots integer[], p_lane_ids integer[], p_lane_seqs bigint[], p_attempts integer[], p_queues text[], p_kinds text[], p_lease_backed boolean[], p_results jsonb[])
RETURNS TABLE(job_id bigint, run_lease integer)
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
        -- (OFFSET 0: a probe per receipt, never a hashed scan of the slots)
        WHERE EXISTS (SELECT 1 FROM __SCHEMA__.lease_claim_closure_batches b
                      WHERE b.claim_slot = r.cs AND b.claim_id = r.cid OFFSET 0)
           OR NOT EXISTS (SELECT 1 FROM __SCHEMA__.lease_claims c WHERE c.claim_slot = r.cs AND c.claim_id = r.cid
                          OFFSET 0)
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
