-- awa-fast: the lane cursor moves only across other transactions' committed receipts: a savepoint's receipt is its transaction's own, and claims run only at READ COMMITTED.
-- compatible-with-previous: yes
-- Immutable once landed, like every migration.
--
-- The problem. lane_cursor_advance (0002, 0023, 0026) moves a lane's claim
-- cursor (a sequence: not transactional) across the lane's receipts past
-- it, except this transaction's own: a rollback would undo those receipts
-- but not the setval. It told its own receipts by
--     c.xmin IS DISTINCT FROM pg_current_xact_id_if_assigned()::xid
-- which is only the top-level transaction id. A receipt written inside a
-- savepoint carries the subtransaction's id, so a second claim in the same
-- transaction took it for a committed receipt and set the cursor past it;
-- when the transaction then rolled back, the jobs of that receipt stayed
-- behind the cursor, never claimed again (tests/integration/
-- test_storage_claim.py, test_claims_in_savepoints_of_a_rolled_back_
-- transaction_lose_nothing: 3 of 4 jobs left available). The runtime never
-- claims inside a savepoint; code that calls the claim functions inside
-- its own transactions (psycopg's nested conn.transaction() blocks are
-- savepoints) could.
--
-- The fix (body only; the SET options of 0023 and 0026 kept). A receipt is
-- this transaction's own when its xmin, read as a full transaction id
-- counted from the current one, is still in progress: a visible row of
-- another transaction is committed, and only this transaction's own rows
-- (top level or any savepoint, released or not) are visible while in
-- progress. The 32-bit xmin is widened from the current transaction's
-- id: subtransaction ids are assigned after their parent's, so an own
-- receipt's xmin is at most 2^31 ahead of it; a row behind it was written
-- by an older, committed transaction (xmin_is_own below). It runs only
-- for the lane's receipts past the cursor (usually one: the claim before),
-- and only in a transaction with an id (a claim has one: it locked the
-- lane's claim head).
--
-- The second problem (a review of the first fix): under REPEATABLE READ
-- or SERIALIZABLE a claim reads the receipts of its transaction's
-- snapshot, taken before it locked the lane's claim head. A claimer that
-- committed a receipt in between is invisible to it, and the cursor lags
-- the last receipt by one claim, so it claimed the same rows again: two
-- claimers, one job (an autocommit claim counts: a one-statement
-- transaction at those levels uses the snapshot of its start, and a
-- server or role whose default_transaction_isolation is repeatable read
-- makes every session's claims run so). job_cancel, the other caller
-- outside prune, could likewise tombstone a job another claimer had just
-- taken. The row lock on the claim head raises no serialization error:
-- nobody updates that row. So lane_cursor_advance now refuses to run at
-- any level but READ COMMITTED (feature_not_supported, with a hint), before
-- it reads or writes anything; the runtime sets its sessions' default to
-- read committed (Storage.session_read_committed), whatever the server's.
--
-- Compatibility: the previous runtime calls lane_cursor_advance (through
-- the claim functions) and gets the same results at READ COMMITTED, the
-- level it runs at unless the server's default says otherwise; there the
-- claim now fails instead of issuing a job twice.

CREATE OR REPLACE FUNCTION __SCHEMA__.lane_cursor_advance(p_lane int, p_claim_seq regclass) RETURNS bigint
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $$
DECLARE
    v_cur bigint := pg_sequence_last_value(p_claim_seq);
    v_top bigint := pg_current_xact_id_if_assigned()::text::bigint;  -- NULL: this transaction wrote nothing
    v_rec bigint;
    v_own bigint;
BEGIN
    -- Only READ COMMITTED sees the receipts committed before the caller
    -- locked the lane's claim head (the header says why).
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'awa-fast claims and cancels need READ COMMITTED isolation; this transaction runs at %',
            current_setting('transaction_isolation')
            USING ERRCODE = 'feature_not_supported',
                  HINT = 'Run it in a READ COMMITTED transaction, or SET default_transaction_isolation TO '
                         '''read committed'' for the session.';
    END IF;
    -- Receipts of this very transaction, savepoints included, are not
    -- committed evidence: a rollback would undo them but not the setval.
    -- They still move the position this transaction claims from (returned),
    -- never the sequence. Index: lease_claims_lane (lane_id, last_seq); the
    -- upper bound holds for every row and only makes the planner see a
    -- range (0023).
    SELECT max(c.last_seq) FILTER (WHERE v_top IS NULL OR NOT __SCHEMA__.xmin_is_own(c.xmin, v_top)),
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

-- Whether a visible row's xmin is the current transaction's, top level or
-- subtransaction. p_top: the current transaction's full id (not NULL).
-- ahead: the xmin's distance past p_top, modulo 2^32. 2^31 or more: the
-- row is older than this transaction, so committed. Otherwise its full id
-- is p_top + ahead; at or past the xmax of the statement's snapshot only
-- this transaction's own rows are visible (under REPEATABLE READ they can
-- be newer than the snapshot); below it pg_xact_status answers, and it
-- never sees an id from the future there (that would be an error). A row
-- frozen long ago whose raw xmin wraps into that window can only be taken
-- for an own row: the safe side (the cursor is not moved across it).
-- VOLATILE because pg_xact_status is: a SQL function may only be inlined
-- into its caller's statement when it calls nothing more volatile than it
-- is declared (inlined, it costs no call per row).
CREATE FUNCTION __SCHEMA__.xmin_is_own(p_xmin xid, p_top bigint) RETURNS boolean
LANGUAGE sql VOLATILE AS $$
    SELECT CASE
        WHEN (p_xmin::text::bigint - p_top) & 4294967295 >= 2147483648 THEN false
        WHEN p_top + ((p_xmin::text::bigint - p_top) & 4294967295)
             >= pg_snapshot_xmax(pg_current_snapshot())::text::bigint THEN true
        ELSE pg_xact_status((p_top + ((p_xmin::text::bigint - p_top) & 4294967295))::text::xid8) = 'in progress'
    END
$$;
