-- awa-fast: the done row of a receipt completed whole in one flush takes the receipt's own attempt arrays.
-- compatible-with-previous: yes
-- Immutable once landed, like every migration.
--
-- What. receipt_done_whole(claim_slots, claim_ids, counts) (new) writes the
-- compact done row (done_receipts, 0015) of each named receipt from the
-- receipt row itself: its slot, lane, range, and its job_ids and run_leases
-- arrays, which are exactly the attempts it gave out (tombstoned rows were
-- never in them). The runtime calls it for the receipts of a flush that
-- holds every attempt of the receipt (the common case of a drain: 205 of
-- 206 receipts in a 200k drain got one done row). It writes a row only where
-- the receipt has exactly as many attempts as the caller holds of it, so a
-- receipt an earlier flush completed a part of (its other attempts are
-- closed, so receipt_guard left them out and the counts differ) is skipped
-- and the caller writes that row from its attempts as before. Returns the
-- claim ids written.
--
-- Why. The named query receipt_done_compact builds each row from
-- per-attempt arrays the client sends as text: parse four arrays of a
-- flush's length, unnest them, group and re-aggregate per receipt. That was
-- ~1.3 us of statement time per job in a drain (pg_stat_statements), and
-- the client builds the four array literals. From the receipt: one row read
-- per receipt (lease_claims primary key; the receipts are locked by
-- receipt_guard in the same transaction), ~0.2 us per job.
--
-- Why a function. The same statement sent as a named query is planned on
-- every call: lease_claims is partitioned by claim_slot, the slots come
-- from an array parameter, and the plan cache keeps choosing custom plans
-- (pg_stat_statements: 181 plans for 179 calls, ~0.4 ms each). Here it is
-- one statement with a generic plan, like the other hot-path functions;
-- the receipt is found by a LATERAL probe (see below), because the plain
-- join's generic plan hashes every live receipt of every claim partition
-- and reads each one's arrays for the count check (~400 buffer hits per
-- call instead of ~40).
--
-- Promise 2 holds: the attempts written are the receipt's own (job_id,
-- run_lease) pairs, and only for a receipt whose every attempt is open and
-- held by the caller (receipt_guard has locked the receipts and reported
-- every closed attempt, which the caller drops, before this runs).
--
-- Compatibility: a new function only. The previous runtime never calls it
-- and keeps its own completion statements, which are unchanged.

CREATE FUNCTION __SCHEMA__.receipt_done_whole(p_claim_slots int[], p_claim_ids bigint[], p_counts int[])
RETURNS SETOF bigint
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
SET jit = off
AS $$
BEGIN
    -- Index: lease_claims primary key (claim_slot, claim_id), one probe per receipt (LATERAL with
    -- LIMIT 1, so the generic plan is a nested loop with run-time partition pruning rather than a
    -- hash join over every claim partition that reads each receipt's arrays); queue_lanes primary key.
    -- The count check reads run_leases, the smaller of the two arrays.
    RETURN QUERY
    INSERT INTO __SCHEMA__.done_receipts (ready_slot, lane_id, claim_id, first_seq, last_seq, queue, job_ids,
        run_leases)
    SELECT c.ready_slot, c.lane_id, c.claim_id, c.first_seq, c.last_seq, ql.queue, c.job_ids, c.run_leases
    FROM unnest(p_claim_slots, p_claim_ids, p_counts) AS u(s, cid, n)
    CROSS JOIN LATERAL (SELECT x.ready_slot, x.lane_id, x.claim_id, x.first_seq, x.last_seq, x.job_ids,
                               x.run_leases
                        FROM __SCHEMA__.lease_claims x
                        WHERE x.claim_slot = u.s AND x.claim_id = u.cid LIMIT 1) c
    JOIN __SCHEMA__.queue_lanes ql ON ql.lane_id = c.lane_id
    WHERE cardinality(c.run_leases) = u.n
    RETURNING done_receipts.claim_id;
END $$;
