-- awa-fast: the lane cursor's receipt lookup stays an index probe when the claim slot is full of one lane (issue 16).
-- compatible-with-previous: yes
-- Immutable once landed, like every migration.
--
-- The problem. lane_cursor_advance (0002), which every claim runs for each
-- lane it takes from, finds the lane's receipts past its cursor:
--     WHERE c.lane_id = p_lane AND c.last_seq > v_cur
-- Its generic plan cannot know v_cur, so it takes the default selectivity
-- of an inequality (one third). Once autovacuum has analyzed a claim
-- partition whose receipts are mostly of one lane (one queue, a few lanes:
-- the quiet case), a third of the partition looks cheaper to read whole,
-- and the claim read every receipt of the current claim slot by a
-- sequential scan: 301 rows for a claim of one job in a slot of 300
-- receipts (tests/integration/test_completion_probes.py). The claim ring
-- rotates about once a second, so this grew with the claim rate.
--
-- The fix (body only: same arguments, same result, same setval): the
-- lookup also says c.last_seq <= 9223372036854775807, true of every bigint.
-- With a bound on each side the planner estimates the pair as a range
-- (0.5%, its default for a range with an unknown end) instead of one third,
-- so the plan stays the lane_id, last_seq index of each partition, reading
-- the few receipts past the cursor.
--
-- Compatibility: the previous runtime calls lane_cursor_advance by the same
-- name and gets the same results.

CREATE OR REPLACE FUNCTION __SCHEMA__.lane_cursor_advance(p_lane int, p_claim_seq regclass) RETURNS bigint
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    v_cur bigint := pg_sequence_last_value(p_claim_seq);
    v_rec bigint;
    v_own bigint;
BEGIN
    -- Receipts of this very transaction are not committed evidence: a
    -- rollback would undo them but not the setval. They still move the
    -- position this transaction claims from (returned), never the sequence.
    -- Index: lease_claims_lane (lane_id, last_seq); the upper bound holds for
    -- every row and only makes the planner see a range (see the header).
    SELECT max(c.last_seq) FILTER (WHERE c.xmin IS DISTINCT FROM pg_current_xact_id_if_assigned()::xid),
           max(c.last_seq)
    INTO v_rec, v_own
    FROM __SCHEMA__.lease_claims c
    WHERE c.lane_id = p_lane AND c.last_seq > v_cur AND c.last_seq <= 9223372036854775807;
    IF v_rec IS NOT NULL THEN
        PERFORM setval(p_claim_seq, v_rec, true);
        v_cur := v_rec;
    END IF;
    RETURN greatest(v_cur, v_own);
END $$;
