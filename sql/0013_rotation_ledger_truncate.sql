-- awa-fast rotation ledger reclaimed by TRUNCATE, not by DELETE (issue 16).
-- compatible-with-previous: yes
-- Immutable once landed, like every migration.
--
-- Why: ring_rotate (0002) appended one ledger row per rotation and then
-- DELETEd the generation two cycles back, one dead tuple per rotation. A
-- reader idle in transaction pins the xmin horizon, so none of them could
-- be vacuumed: with the claim ring rotating about once a second, a reader
-- pinned for 2 minutes left ~120 dead tuples in ring_rotations (measured
-- peak 121), the largest share of the schema's dead tuples. The rings
-- themselves never had this problem: they are reclaimed by TRUNCATE.
--
-- What: ring_rotations keeps its name and columns and becomes a two-level
-- partitioned table: LIST (ring), then LIST of the generation's bucket
-- ((generation / 256) % 2). A ring's rows alternate between its two bucket
-- children in spans of 256 generations. ring_rotate_v2 trims the ledger by
-- truncating the child that holds the previous span once the current span
-- already holds at least one full cycle of generations (so every slot's
-- latest generation, which ring_prune_v2 and ring_slot_stats read, is still
-- there), and must find the next span's child empty before it enters it.
-- Nothing is ever UPDATEd or DELETEd: the ledger leaves no dead tuple, with
-- or without a pinned reader, and holds at most 512 rows per ring.
-- TRUNCATE takes ACCESS EXCLUSIVE on one small child. Within a span the
-- trim asks for it with NOWAIT, so claims and enqueues (which read the
-- ledger through ring_current) never queue behind it: a child a transaction
-- still holds is left for the next rotation; 256 - slot_count rotations of
-- every span may trim. Only if the next span's child is still not empty
-- when the ring enters that span does the rotation wait for it, under a
-- short lock_timeout (the caller's, 1 ms .. 5 s, as ring_prune), and answer
-- NULL (as for a full ring) when it cannot get it, until it can.
--
-- Also: queue_terminal_rollups (one UPDATE per queue and state per ready
-- prune) gets an autovacuum threshold of 4 dead tuples, so what a pinned
-- reader left there is reclaimed once it ends (see the end of this file).
--
-- Compatibility: the previous runtime keeps working. Its named queries read
-- ring_rotations by the same columns; its ring_rotate (kept, unchanged)
-- still inserts (routed to the right child) and trims with DELETE. New
-- names: ring_rotate_v2 (SECURITY DEFINER: the runtime role has no TRUNCATE
-- privilege, as for ring_prune). ring_current keeps its name and contract
-- (the current slot of a ring) with a body-only change: one static query per
-- ring over that ring's two leaves, so a call locks two tables and their
-- keys (the old ledger: one and its key), not the ten tables and six keys
-- a generic plan over the parent would lock at every call (docs/storage.md,
-- rule 3).

-- Two-level partitioned ledger. The partition key of the second level is an
-- expression, so the primary key lives on each leaf: (ring, generation) is
-- unique within a leaf, and a generation maps to exactly one leaf.
CREATE TABLE __SCHEMA__.ring_rotations_v2 (
    ring        text        NOT NULL CHECK (ring IN ('ready', 'claim', 'lease')),
    generation  bigint      NOT NULL CHECK (generation >= 0),
    slot        int         NOT NULL,
    rotated_at  timestamptz NOT NULL DEFAULT now()
) PARTITION BY LIST (ring);

DO $$
DECLARE
    s text := '__SCHEMA__';
    r text;
    b int;
BEGIN
    FOREACH r IN ARRAY ARRAY['ready', 'claim', 'lease'] LOOP
        EXECUTE format('CREATE TABLE %1$s.ring_rotations_%2$s PARTITION OF %1$s.ring_rotations_v2 '
                       'FOR VALUES IN (%3$L) PARTITION BY LIST (((generation / 256) %% 2))', s, r, r);
        FOR b IN 0 .. 1 LOOP
            EXECUTE format('CREATE TABLE %1$s.ring_rotations_%2$s_%3$s PARTITION OF %1$s.ring_rotations_%2$s '
                           'FOR VALUES IN (%3$s)', s, r, b);
            EXECUTE format('ALTER TABLE %1$s.ring_rotations_%2$s_%3$s '
                           'ADD CONSTRAINT ring_rotations_%2$s_%3$s_pkey PRIMARY KEY (ring, generation)', s, r, b);
        END LOOP;
    END LOOP;
END $$;

-- Carry over the generations the old ledger still holds (at most two cycles per ring).
INSERT INTO __SCHEMA__.ring_rotations_v2 (ring, generation, slot, rotated_at)
SELECT ring, generation, slot, rotated_at FROM __SCHEMA__.ring_rotations;

DROP TABLE __SCHEMA__.ring_rotations;
ALTER TABLE __SCHEMA__.ring_rotations_v2 RENAME TO ring_rotations;

COMMENT ON TABLE __SCHEMA__.ring_rotations IS
    'Append-only rotation ledger: the current slot of a ring is its row with the highest generation. '
    'Partitioned by ring, then by (generation / 256) % 2; ring_rotate_v2 truncates the older span''s child, '
    'nothing is updated or deleted.';

-- Body-only change (same argument, same result): one static query per
-- ring that reads that ring's two leaves directly (not through the
-- partitioned parents), so a call locks two small tables and their primary
-- keys, as the single unpartitioned ledger did with its one table and key.
-- Index: each leaf's primary key (ring, generation), read backwards.
CREATE OR REPLACE FUNCTION __SCHEMA__.ring_current(p_ring text) RETURNS int
LANGUAGE plpgsql STABLE AS $$
BEGIN
    IF p_ring = 'claim' THEN
        RETURN (SELECT x.slot FROM (SELECT slot, generation FROM __SCHEMA__.ring_rotations_claim_0
                                    UNION ALL
                                    SELECT slot, generation FROM __SCHEMA__.ring_rotations_claim_1) x
                ORDER BY x.generation DESC LIMIT 1);
    ELSIF p_ring = 'ready' THEN
        RETURN (SELECT x.slot FROM (SELECT slot, generation FROM __SCHEMA__.ring_rotations_ready_0
                                    UNION ALL
                                    SELECT slot, generation FROM __SCHEMA__.ring_rotations_ready_1) x
                ORDER BY x.generation DESC LIMIT 1);
    ELSIF p_ring = 'lease' THEN
        RETURN (SELECT x.slot FROM (SELECT slot, generation FROM __SCHEMA__.ring_rotations_lease_0
                                    UNION ALL
                                    SELECT slot, generation FROM __SCHEMA__.ring_rotations_lease_1) x
                ORDER BY x.generation DESC LIMIT 1);
    END IF;
    RETURN NULL;
END $$;

-- Rotate a ring to its next slot if that slot is empty (already pruned);
-- returns the new current slot, or NULL when the ring is full (or the next
-- span's ledger child could not be emptied yet). As ring_rotate, but the
-- ledger is trimmed by TRUNCATE of the previous span's child (see the
-- header) instead of a DELETE per rotation, under p_lock_timeout
-- (1 ms .. 5 s). Rotations of one ring serialize on an advisory lock.
CREATE FUNCTION __SCHEMA__.ring_rotate_v2(p_ring text, p_lock_timeout text DEFAULT '50ms') RETURNS int
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    span constant int := 256;
    v_gen bigint;
    v_slot int;
    v_next int;
    v_count int;
    v_timeout interval;
    v_new bigint;
    v_other int;
    v_other_any boolean;
BEGIN
    IF p_ring IS NULL OR p_ring NOT IN ('ready', 'claim', 'lease') THEN
        RAISE EXCEPTION 'unknown ring %; use ready, claim or lease', quote_nullable(p_ring)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    v_timeout := least(greatest(COALESCE(p_lock_timeout, '50ms')::interval, interval '1 millisecond'),
                       interval '5 seconds');
    PERFORM set_config('lock_timeout', ceil(extract(epoch FROM v_timeout) * 1000)::bigint || 'ms', true);
    PERFORM pg_advisory_xact_lock(__SCHEMA__.lock_key('ring_rotate'), hashtext(p_ring));
    SELECT generation, slot INTO STRICT v_gen, v_slot FROM __SCHEMA__.ring_rotations
    WHERE ring = p_ring ORDER BY generation DESC LIMIT 1;
    SELECT slot_count INTO STRICT v_count FROM __SCHEMA__.ring_config WHERE ring = p_ring;
    v_next := (v_slot + 1) % v_count;
    IF NOT __SCHEMA__.ring_slot_empty(p_ring, v_next) THEN
        RETURN NULL;
    END IF;
    v_new := v_gen + 1;
    -- the child that does not hold the new generation: the previous span
    -- (at a span boundary: the child the new generation enters)
    v_other := ((v_new / span) + 1) % 2;  -- used within a span only
    IF v_new % span = 0 THEN
        -- entering a span: its child holds the span before the previous one
        -- (every generation in it is older than a full cycle); it must be empty
        EXECUTE format('SELECT EXISTS (SELECT 1 FROM %s.ring_rotations_%s_%s)', '__SCHEMA__', p_ring, (v_new / span) % 2)
        INTO v_other_any;
        IF v_other_any THEN
            BEGIN
                EXECUTE format('TRUNCATE %s.ring_rotations_%s_%s', '__SCHEMA__', p_ring, (v_new / span) % 2);
            EXCEPTION WHEN lock_not_available THEN
                RETURN NULL;
            END;
        END IF;
    ELSIF v_new % span >= v_count THEN
        -- the current span holds a full cycle (the latest generation of every
        -- slot): the previous span's child is no longer read; trim it if it
        -- still holds rows and nobody holds it right now (NOWAIT: never queue
        -- claims behind the lock), else leave it for the next rotation
        EXECUTE format('SELECT EXISTS (SELECT 1 FROM %s.ring_rotations_%s_%s)', '__SCHEMA__', p_ring, v_other)
        INTO v_other_any;
        IF v_other_any THEN
            BEGIN
                EXECUTE format('LOCK TABLE %s.ring_rotations_%s_%s IN ACCESS EXCLUSIVE MODE NOWAIT',
                               '__SCHEMA__', p_ring, v_other);
                EXECUTE format('TRUNCATE %s.ring_rotations_%s_%s', '__SCHEMA__', p_ring, v_other);
            EXCEPTION WHEN lock_not_available THEN
                NULL;
            END;
        END IF;
    END IF;
    INSERT INTO __SCHEMA__.ring_rotations (ring, generation, slot) VALUES (p_ring, v_new, v_next)
    ON CONFLICT DO NOTHING;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    RETURN v_next;
END $$;

-- The other write a rotation makes: ready prune folds the truncated slot's
-- terminal counts into queue_terminal_rollups (one UPDATE per queue and
-- state per pruned ready slot; a running total, so it stays a mutable row,
-- DESIGN.md section 7). Its few dead tuples never reach autovacuum's default
-- threshold (50 + 20%), so after a pinned reader ends they stayed (31 of the
-- 32 left 60 s after the reader, measured). Vacuum it from the first dead
-- tuples on: the table holds one row per queue and state, a pass is cheap.
ALTER TABLE __SCHEMA__.queue_terminal_rollups
    SET (autovacuum_vacuum_threshold = 4, autovacuum_vacuum_scale_factor = 0);
