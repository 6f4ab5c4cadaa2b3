-- awa-fast storage functions, version 3 of the enqueue reservation.
-- Immutable once landed, like every migration.
--
-- lane_reserve decides whether to NOTIFY from the lane's backlog: rows
-- reserved but not covered by a committed receipt. Version 1 always probed
-- the claim ring for receipts past the claim cursor, and bounded the probe
-- by pg_sequence_last_value(...) inside the query: a volatile call, so not
-- an index bound. When the cursor had caught up (an idle queue: the common
-- case at a trickle) the backward index scan ran through every receipt of
-- the lane in every claim partition before finding none: 0.58 ms per
-- enqueue with ~4k receipts live (perf/pickup_path.py, pg_stat_statements).
--
-- Version 3 reads the cursor into a variable first, so the probe is an index
-- range over receipts past it (none or one, normally), and probes only when
-- the sequences alone say the backlog is 64 rows or more: receipts can only
-- make the backlog smaller, so below 64 the answer (notify) is already known.
CREATE OR REPLACE FUNCTION __SCHEMA__.lane_reserve(p_queue text, p_priority int, p_count int, p_hint int,
    OUT lane_id int, OUT first_seq bigint, OUT ready_slot int)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    v_seq regclass;
    v_before bigint;
    v_claim_seq regclass;
    v_claimed bigint;
    v_receipt bigint;
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
    SELECT h.claim_seq INTO v_claim_seq
    FROM __SCHEMA__.queue_claim_heads h WHERE h.lane_id = lane_reserve.lane_id;
    v_claimed := COALESCE(pg_sequence_last_value(v_claim_seq), 0);
    IF v_before - v_claimed >= 64 THEN
        -- the cursor lags its lane's last receipt: Index lease_claims_lane (lane_id, last_seq)
        SELECT max(c.last_seq) INTO v_receipt FROM __SCHEMA__.lease_claims c
        WHERE c.lane_id = lane_reserve.lane_id AND c.last_seq > v_claimed;
        v_claimed := greatest(v_claimed, v_receipt);
    END IF;
    IF v_before - v_claimed < 64 THEN
        PERFORM pg_notify(__SCHEMA__.notify_channel(), p_queue);
    END IF;
END $$;
