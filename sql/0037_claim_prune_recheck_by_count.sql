-- awa-fast: under its lock, a claim-ring prune reads its gates again only when the slot's receipts changed (issue 16).
-- compatible-with-previous: yes
-- Immutable once landed, like every migration.
--
-- Why: ring_prune_v3 checks a sealed slot's gates twice, before and after
-- LOCK TABLE ... IN ACCESS EXCLUSIVE MODE on the slot's children (docs/storage.md,
-- "Rotation and prune"). For the claim ring the second check runs while
-- every claim waits: a claim reads every child of the claim ring (its
-- cursor advance probes them all), so it queues behind the lock. That check
-- (lanes_cursor_advance over the slot's lanes, then claim_prune_gate, which
-- probes the closures of every job of every receipt) grows with the slot:
-- ~1 ms for 200 one-job receipts, ~55 ms for 16,000, all of it with the
-- claims stopped.
--
-- What changes: for the claim ring, the prune counts the slot's receipts
-- before pass 1 reads its gates, and again once it holds the lock. Only a
-- different count reads the gates again. The same count means the same
-- receipts, because:
--   * a slot's receipts are only ever inserted: nothing updates or deletes
--     lease_claims rows, TRUNCATE is their only removal, and this prune holds
--     the slot's ring_slots row (FOR UPDATE), so no other prune truncates it;
--     the receipts pass 1 saw are a subset of those under the lock, and equal
--     counts make them the same set;
--   * the gates only ever stay passed for those receipts: closures are only
--     added (open_claims stays false) and a lane's claim cursor only moves on
--     (cursor_behind stays false), so the cursor advance has nothing to do.
-- A receipt that committed after the count (a claim that read the slot as
-- current just before the rotation, and committed while the prune waited
-- for the lock) makes the counts differ, and the gates are read again under
-- the lock, exactly as before. The ready and lease rings are unchanged.
--
-- Measured: the claims' wait behind one claim-ring prune (lock, second
-- check, TRUNCATE, commit) and the count itself, see docs/performance-log.md
-- (2026-12-08).
--
-- Compatibility: body only (same arguments, answers and grants); the
-- previous runtime calls ring_prune_v3 and gets the same answers.

CREATE OR REPLACE FUNCTION __SCHEMA__.ring_prune_v3(p_ring text, p_slot integer, p_lock_timeout text DEFAULT '50ms'::text, p_retain_s double precision DEFAULT 0)
 RETURNS text
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
DECLARE
    s text := '__SCHEMA__';
    v_tables text[];
    v_list text;
    v_gate text;
    -- a duration (seconds), only ever subtracted from now(): no client clock
    p_retain interval := make_interval(secs => greatest(COALESCE(p_retain_s, 0), 0));
    v_retain boolean := p_ring = 'ready' AND p_retain > interval '0';
    v_gen bigint;
    v_quiet_gen bigint;
    v_quiet_at timestamptz;
    v_timeout interval;
    v_receipts bigint;
    v_count bigint;
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
        WHEN 'ready' THEN ARRAY['ready_entries', 'ready_segments', 'ready_tombstones', 'done_entries', 'done_receipts']
        WHEN 'claim' THEN ARRAY['lease_claims', 'lease_claim_closures', 'lease_claim_closure_batches']
        ELSE ARRAY['leases'] END;
    -- nothing on disk (not even dead tuples): nothing to reclaim
    IF (SELECT sum(pg_relation_size(format('%s.%s_%s', s, t, p_slot)::regclass)) FROM unnest(v_tables) AS t) = 0 THEN
        RETURN 'empty';
    END IF;
    SELECT x.quiet_generation, x.quiet_at INTO v_quiet_gen, v_quiet_at
    FROM __SCHEMA__.ring_slots x WHERE x.ring = p_ring AND x.slot = p_slot FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN 'busy';
    END IF;
    IF v_retain THEN
        -- the slot's latest generation: a quiet mark of an earlier use of the slot does not count
        SELECT max(g.generation) INTO v_gen FROM __SCHEMA__.ring_rotations g
        WHERE g.ring = p_ring AND g.slot = p_slot;
        IF v_quiet_gen IS DISTINCT FROM v_gen THEN
            v_quiet_at := NULL;
        END IF;
        IF v_quiet_at > now() - p_retain THEN
            RETURN 'retained';
        END IF;
    END IF;
    SELECT string_agg(format('%s.%s_%s', s, t, p_slot), ', ') INTO v_list FROM unnest(v_tables) AS t;
    FOR pass IN 1 .. 2 LOOP
        IF p_ring = 'ready' THEN
            PERFORM __SCHEMA__.lanes_cursor_advance(ARRAY(
                SELECT DISTINCT g.lane_id FROM __SCHEMA__.ready_segments g WHERE g.ready_slot = p_slot));
            v_gate := __SCHEMA__.ready_prune_gate(p_slot);
        ELSIF p_ring = 'claim' THEN
            -- The slot's receipts, counted before pass 1 reads its gates and again under the
            -- lock (0037): the same count there means the same receipts, whose gates passed.
            SELECT count(*) INTO v_count FROM __SCHEMA__.lease_claims c WHERE c.claim_slot = p_slot;
            IF pass = 1 OR v_count IS DISTINCT FROM v_receipts THEN
                PERFORM __SCHEMA__.lanes_cursor_advance(ARRAY(
                    SELECT DISTINCT c.lane_id FROM __SCHEMA__.lease_claims c WHERE c.claim_slot = p_slot));
                v_gate := __SCHEMA__.claim_prune_gate(p_slot);
            END IF;
            v_receipts := v_count;
        ELSE
            -- deleted leases leave only dead tuples; a live lease blocks
            v_gate := CASE WHEN EXISTS (SELECT 1 FROM __SCHEMA__.leases l WHERE l.lease_slot = p_slot)
                           THEN 'active_leases' END;
        END IF;
        IF v_gate IS NOT NULL THEN
            IF v_retain AND v_quiet_at IS NOT NULL THEN
                UPDATE __SCHEMA__.ring_slots SET quiet_generation = NULL, quiet_at = NULL
                WHERE ring = p_ring AND slot = p_slot;
            END IF;
            RETURN v_gate;
        END IF;
        IF pass = 1 AND v_retain AND v_quiet_at IS NULL THEN
            -- quiet from now on: keep the slot for p_retain
            UPDATE __SCHEMA__.ring_slots SET quiet_generation = v_gen, quiet_at = now()
            WHERE ring = p_ring AND slot = p_slot;
            RETURN 'retained';
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
             SELECT t.queue, t.state, sum(t.n)::bigint FROM (
                 SELECT queue, state, count(*) AS n FROM %1$s.done_entries_%2$s GROUP BY queue, state
                 UNION ALL
                 SELECT queue, 1::smallint, sum(cardinality(job_ids))::bigint FROM %1$s.done_receipts_%2$s
                 GROUP BY queue) t
             GROUP BY t.queue, t.state
             ON CONFLICT (queue, state) DO UPDATE SET count = r.count + excluded.count', s, p_slot);
    END IF;
    EXECUTE format('TRUNCATE %s', v_list);
    RETURN 'pruned';
EXCEPTION WHEN lock_not_available THEN
    -- any lock this prune would wait on past lock_timeout (a gate query on a
    -- child another pruner holds, for one): skip the slot, never wait
    RETURN 'busy';
END $function$;

