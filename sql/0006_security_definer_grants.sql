-- awa-fast security hardening: no SECURITY DEFINER function acts on an
-- compatible-with-previous: yes
-- identifier the runtime role can write, and nothing is executable by PUBLIC.
-- Immutable once landed, like every migration.
--
-- What changed and why (issue 9, items 6 and 7):
--
-- 1. The confused deputy. ring_prune runs as the schema owner (SECURITY
--    DEFINER) and, through lanes_cursor_advance and lane_cursor_advance,
--    called setval() on the regclass stored in queue_claim_heads.claim_seq,
--    a column the runtime role could UPDATE: pointing it at any sequence the
--    owner can reach (an application's own orders_id_seq) and writing a
--    lease_claims row made the next prune move that sequence as the owner.
--    The prune gates also read pg_sequence_last_value() of that regclass as
--    the owner (a comparison oracle on any sequence). Audit of every
--    function that runs as the owner: lane_ensure (reads only lane ids; the
--    sequences it creates and setval()s are named from the new identity
--    value) and ring_prune with what it calls: ring_current (reads a slot
--    number), lanes_cursor_advance, lane_cursor_advance, ready_prune_gate,
--    claim_prune_gate (read claim_seq: fixed here).
--    Fix, both ways:
--    - lane_claim_seq(lane_id) derives a lane's claim cursor from the
--      validated schema and the lane key, exactly as lane_ensure names it
--      (<schema>.lane_<id>_claim; NULL when there is no such relation);
--      lanes_cursor_advance, ready_prune_gate and claim_prune_gate (same
--      names, CREATE OR REPLACE) use it and never read claim_seq. The
--      worst a forged lane id or receipt can do is move a lane cursor of
--      this schema, which the runtime role may setval() itself anyway.
--      A missing or never-called cursor now blocks a prune gate (counted
--      as 0) instead of letting it pass.
--    - runtime_grant no longer gives INSERT, UPDATE or DELETE on the lane
--      identity tables (queue_lanes, queue_enqueue_heads, queue_claim_heads:
--      only lane_ensure writes them, as the owner). The claim's
--      FOR UPDATE SKIP LOCKED row lock on queue_claim_heads needs UPDATE on
--      one column: it gets UPDATE (shard) only, the one column whose change
--      costs at most a stripe preference. So neither the owner nor another
--      invoker role (an application enqueuing with its own privileges
--      calls nextval() on enqueue_seq) can be pointed at a foreign sequence.
--    ring_prune (CREATE OR REPLACE, same behaviour otherwise) also refuses
--    an unknown ring name (it was treated as 'lease') and keeps its
--    caller's lock_timeout within 1 ms .. 5 s ('0' meant wait forever while
--    holding the slot row, as the owner).
-- 2. EXECUTE is revoked from PUBLIC on every function of the schema (a
--    function is executable by PUBLIC when created, and two of them run as
--    the owner); runtime_grant(role) grants it to the runtime role, minus
--    runtime_grant and ring_install (owner tools). The migrator repeats the
--    revoke after every migration it applies (awa_fast/storage/migrate.py),
--    so functions of later migrations are covered too. Roles granted by an
--    earlier runtime_grant (they hold EXECUTE on ring_prune) are granted
--    again with the new rules at the end of this migration.

-- The claim cursor sequence of a lane, named from the schema and the lane
-- id (never read from a table): what lane_ensure created, or NULL.
CREATE FUNCTION __SCHEMA__.lane_claim_seq(p_lane int) RETURNS regclass
LANGUAGE sql STABLE AS $$
    SELECT CASE WHEN p_lane > 0 THEN to_regclass(format('%s.lane_%s_claim', '__SCHEMA__', p_lane)) END
$$;

-- Version 2: the cursor of each lane is lane_claim_seq(lane_id), not
-- queue_claim_heads.claim_seq (it runs as the owner inside ring_prune).
CREATE OR REPLACE FUNCTION __SCHEMA__.lanes_cursor_advance(p_lanes int[]) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    h record;
    v_seq regclass;
    v_cur bigint;
    v_next record;
    v_slot int;
    v_moved boolean;
BEGIN
    FOR h IN
        SELECT x.lane_id FROM __SCHEMA__.queue_claim_heads x
        WHERE x.lane_id = ANY (p_lanes) ORDER BY x.lane_id FOR UPDATE SKIP LOCKED
    LOOP
        v_seq := __SCHEMA__.lane_claim_seq(h.lane_id);
        CONTINUE WHEN v_seq IS NULL;
        v_cur := __SCHEMA__.lane_cursor_advance(h.lane_id, v_seq);
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
            PERFORM setval(v_seq, v_cur, true);
        END IF;
    END LOOP;
END $$;

-- Version 2: cursors from lane_claim_seq(); a missing cursor counts as 0.
CREATE OR REPLACE FUNCTION __SCHEMA__.ready_prune_gate(p_slot int) RETURNS text
LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM __SCHEMA__.ready_segments g
               JOIN __SCHEMA__.queue_claim_heads h ON h.lane_id = g.lane_id
               WHERE g.ready_slot = p_slot
                 AND g.last_seq > COALESCE(pg_sequence_last_value(__SCHEMA__.lane_claim_seq(h.lane_id)), 0)) THEN
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

-- Version 2: cursors from lane_claim_seq(); a missing cursor counts as 0.
CREATE OR REPLACE FUNCTION __SCHEMA__.claim_prune_gate(p_slot int) RETURNS text
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
               WHERE c.claim_slot = p_slot
                 AND c.last_seq > COALESCE(pg_sequence_last_value(__SCHEMA__.lane_claim_seq(h.lane_id)), 0)) THEN
        RETURN 'cursor_behind';
    END IF;
    RETURN NULL;
END $$;

-- Version 2 of ring_prune: as version 1 (0002), plus an unknown ring is an
-- error and the lock timeout is kept within 1 ms .. 5 s. What it calls now
-- derives every sequence from the schema and lane ids (see the header).
-- SECURITY DEFINER: the runtime role needs no TRUNCATE privilege; prune is
-- the only path that takes ACCESS EXCLUSIVE or truncates.
CREATE OR REPLACE FUNCTION __SCHEMA__.ring_prune(p_ring text, p_slot int, p_lock_timeout text DEFAULT '50ms') RETURNS text
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    s text := '__SCHEMA__';
    v_tables text[];
    v_list text;
    v_gate text;
    v_timeout interval;
BEGIN
    IF p_ring IS NULL OR p_ring NOT IN ('ready', 'claim', 'lease') THEN
        RAISE EXCEPTION 'unknown ring %; use ready, claim or lease', quote_nullable(p_ring)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    v_timeout := least(greatest(COALESCE(p_lock_timeout, '50ms')::interval, interval '1 millisecond'),
                       interval '5 seconds');
    PERFORM set_config('lock_timeout', ceil(extract(epoch FROM v_timeout) * 1000)::bigint || 'ms', true);
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

-- Version 2 of runtime_grant: as version 1 (0002), minus any write on the
-- lane identity tables (UPDATE (shard) on queue_claim_heads is the row lock
-- the claim takes) and minus EXECUTE on the owner tools runtime_grant and
-- ring_install. No DDL and no TRUNCATE: lane creation and prune run as the
-- owner through SECURITY DEFINER functions. Lane sequences created later
-- are covered by default privileges of the owner.
CREATE OR REPLACE FUNCTION __SCHEMA__.runtime_grant(p_role text) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    s text := '__SCHEMA__';
BEGIN
    EXECUTE format('GRANT USAGE ON SCHEMA %s TO %I', s, p_role);
    EXECUTE format('GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA %s TO %I', s, p_role);
    EXECUTE format('REVOKE INSERT, UPDATE, DELETE ON %1$s.queue_lanes, %1$s.queue_enqueue_heads, '
                   '%1$s.queue_claim_heads FROM %2$I', s, p_role);
    EXECUTE format('GRANT UPDATE (shard) ON %s.queue_claim_heads TO %I', s, p_role);
    EXECUTE format('GRANT USAGE, SELECT, UPDATE ON ALL SEQUENCES IN SCHEMA %s TO %I', s, p_role);
    EXECUTE format('GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA %s TO %I', s, p_role);
    EXECUTE format('REVOKE EXECUTE ON FUNCTION %1$s.runtime_grant(text), %1$s.ring_install(int, int, int) '
                   'FROM %2$I', s, p_role);
    EXECUTE format('ALTER DEFAULT PRIVILEGES IN SCHEMA %s GRANT USAGE, SELECT, UPDATE ON SEQUENCES TO %I',
                   s, p_role);
    EXECUTE format('ALTER DEFAULT PRIVILEGES IN SCHEMA %s GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO %I',
                   s, p_role);
END $$;

REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA __SCHEMA__ FROM PUBLIC;

-- Roles an earlier runtime_grant covered hold EXECUTE on ring_prune:
-- grant them again under the rules above (revokes their lane-table writes).
DO $$
DECLARE
    r record;
BEGIN
    FOR r IN
        SELECT DISTINCT a.rolname
        FROM pg_proc p
        CROSS JOIN LATERAL aclexplode(p.proacl) x
        JOIN pg_roles a ON a.oid = x.grantee
        WHERE p.oid = '__SCHEMA__.ring_prune(text, int, text)'::regprocedure
          AND x.privilege_type = 'EXECUTE' AND x.grantee <> p.proowner
    LOOP
        PERFORM __SCHEMA__.runtime_grant(r.rolname);
    END LOOP;
END $$;
