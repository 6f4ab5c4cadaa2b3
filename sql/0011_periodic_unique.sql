-- awa-fast periodic jobs and unique jobs (issue 13).
-- compatible-with-previous: yes
-- Immutable once landed, like every migration.
--
-- Additive: three new tables and new functions only. No existing table,
-- index or function is changed, so the claim, completion, rescue and prune
-- paths of the previous runtime run exactly as before; a job that is not
-- unique and not periodic never touches anything created here.
--
-- Periodic jobs
--   schedules        one cold row per declared schedule (upserted when a
--                    supervisor or worker starts, paused/resumed by operators).
--   schedule_fires   the insert-only fire ledger, keyed by (schedule, tick).
--                    A fire and its enqueue commit in one transaction, so a
--                    second evaluator's insert conflicts and enqueues nothing.
--                    Each fire names the tick before it (prev_tick) and how
--                    many ticks it folded in (coalesced), so every tick is
--                    accounted for exactly once. Pruned by time in batches.
-- Unique jobs
--   unique_keys      key -> holder job id. Taken with INSERT ... ON CONFLICT
--                    (two racing transactions: the second waits on the
--                    first's uncommitted row and then sees it or not). A key
--                    whose holder left its holding states is taken over
--                    lazily by the next conflicting enqueue; completion never
--                    touches this table. Maintenance sweeps stale keys in
--                    batches.
-- Job ids of unique and periodic jobs come from job_id_seq (like
-- deferred-born jobs), so the key or ledger row can name the job before the
-- job row exists; the job is then written by ready_append / deferred_jobs.

CREATE TABLE __SCHEMA__.schedules (
    name          text        PRIMARY KEY,
    cron          text        NOT NULL,
    timezone      text        NOT NULL,
    kind          text        NOT NULL,
    args          jsonb       NOT NULL,
    metadata      jsonb,
    queue         text        NOT NULL,
    priority      smallint    NOT NULL CHECK (priority BETWEEN 1 AND 4),
    max_attempts  smallint    NOT NULL,
    missed        text        NOT NULL CHECK (missed IN ('coalesce', 'catch_up')),
    catch_up_cap  int         NOT NULL DEFAULT 100 CHECK (catch_up_cap BETWEEN 1 AND 10000),
    -- unique fires: key (hash computed by the client), period (s), holding-state mask
    unique_key    bytea,
    unique_period float8,
    unique_states int,
    source        text        NOT NULL,          -- who declared it (the app reference)
    enabled       boolean     NOT NULL DEFAULT true,   -- false: gone from code (kept, not deleted)
    paused        boolean     NOT NULL DEFAULT false,  -- operator pause
    anchor_at     timestamptz NOT NULL DEFAULT now(),  -- ticks after this are due when no fire exists
    created_at    timestamptz NOT NULL DEFAULT now(),
    synced_at     timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE __SCHEMA__.schedule_fires (
    schedule   text        NOT NULL,
    tick       timestamptz NOT NULL,
    prev_tick  timestamptz,                 -- the scheduled fire before this one (NULL: first)
    coalesced  int         NOT NULL DEFAULT 0,   -- ticks between prev_tick and tick folded into this fire
    manual     boolean     NOT NULL DEFAULT false,  -- `awa-fast cron trigger`: outside the tick chain
    job_id     bigint,                      -- the job enqueued (NULL when held by a unique holder)
    held_by    bigint,                      -- the unique holder that made this fire enqueue nothing
    fired_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (schedule, tick)
);
CREATE INDEX schedule_fires_fired ON __SCHEMA__.schedule_fires (fired_at);

CREATE TABLE __SCHEMA__.unique_keys (
    key         bytea       NOT NULL,       -- sha256 of kind + canonical args (+ queue) or the given key
    bucket      bigint      NOT NULL DEFAULT 0,  -- floor(epoch / period) on the database clock; 0 without a period
    job_id      bigint      NOT NULL,       -- the holder
    states      int         NOT NULL,       -- holding-state mask (unique_state_bit)
    expires_at  timestamptz,                -- end of the period bucket (NULL without a period)
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (key, bucket)
);
-- No other index: a takeover rewrites only unindexed columns (a HOT update),
-- and the sweep walks the primary key.

---------------------------------------------------------------------------
-- Unique jobs
---------------------------------------------------------------------------

-- Bit of a job state (job_load's names) in a holding-state mask.
CREATE FUNCTION __SCHEMA__.unique_state_bit(p_state text) RETURNS int
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE p_state
        WHEN 'scheduled' THEN 1 WHEN 'available' THEN 2 WHEN 'running' THEN 4 WHEN 'retryable' THEN 8
        WHEN 'waiting_external' THEN 16 WHEN 'snoozed' THEN 32 WHEN 'completed' THEN 64
        WHEN 'failed' THEN 128 WHEN 'cancelled' THEN 256 WHEN 'dlq' THEN 512 ELSE 0 END
$$;

-- Does job p_job still hold a key with mask p_states? Read with a fresh
-- snapshot by the caller (a statement after the key row's lock). The
-- terminal, deferred and callback places are probed first (an index probe
-- each; a terminal holder, the sweep's common case, costs one probe per
-- ready slot); only a job found nowhere else goes through job_load, which
-- tells available from running (the sweep skips that, see below). A job whose history was pruned or purged is
-- terminal and unknown: it holds only a key whose mask names a terminal
-- state and whose period has not ended.
CREATE FUNCTION __SCHEMA__.unique_holds(p_job bigint, p_states int, p_expires timestamptz,
    p_exact boolean DEFAULT true) RETURNS boolean
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_state smallint;
    v_name text;
BEGIN
    SELECT d.state INTO v_state FROM __SCHEMA__.done_entries d
    WHERE d.job_id = p_job ORDER BY d.run_lease DESC LIMIT 1;
    IF FOUND THEN
        RETURN (p_states & CASE v_state WHEN 1 THEN 64 WHEN 2 THEN 128 ELSE 256 END) <> 0;
    END IF;
    IF EXISTS (SELECT 1 FROM __SCHEMA__.dlq_entries x WHERE x.job_id = p_job) THEN
        RETURN (p_states & 512) <> 0;
    END IF;
    SELECT x.state INTO v_state FROM __SCHEMA__.deferred_jobs x WHERE x.job_id = p_job;
    IF FOUND THEN
        RETURN (p_states & CASE v_state WHEN 1 THEN 1 WHEN 2 THEN 8 ELSE 32 END) <> 0;
    END IF;
    IF EXISTS (SELECT 1 FROM __SCHEMA__.leases l WHERE l.job_id = p_job) THEN
        RETURN (p_states & 16) <> 0;
    END IF;
    -- The sweep (p_exact false) keeps a key whose holder is still in the
    -- ready ring when both available and running hold: never a live key
    -- deleted, at worst a stale one kept until its ready slot is pruned.
    IF NOT p_exact AND (p_states & 6) = 6
       AND EXISTS (SELECT 1 FROM __SCHEMA__.ready_entries e WHERE e.job_id = p_job) THEN
        RETURN true;
    END IF;
    v_name := __SCHEMA__.job_load(p_job) ->> 'state';
    IF v_name IS NULL THEN
        RETURN p_expires IS NOT NULL AND p_expires > now() AND (p_states & (64 | 128 | 256 | 512)) <> 0;
    END IF;
    RETURN (p_states & __SCHEMA__.unique_state_bit(v_name)) <> 0;
END $$;

-- Take unique key (p_key, bucket of now() by p_period) for job p_job, or
-- return the job that holds it. Returns p_job when taken. Two transactions
-- racing for a free key: the second's INSERT waits on the first's
-- uncommitted row; after a commit it finds the holder, after a rollback it
-- inserts. A stale holder is replaced under the row lock (FOR UPDATE), its
-- state read by a later statement, so with a snapshot newer than the lock.
CREATE FUNCTION __SCHEMA__.unique_take(p_key bytea, p_period float8, p_states int, p_job bigint) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    v_bucket bigint := 0;
    v_expires timestamptz;
    k record;
BEGIN
    IF p_period IS NOT NULL THEN
        v_bucket := floor(extract(epoch FROM now()) / p_period)::bigint;
        v_expires := to_timestamp((v_bucket + 1) * p_period);
    END IF;
    LOOP
        INSERT INTO __SCHEMA__.unique_keys (key, bucket, job_id, states, expires_at)
        VALUES (p_key, v_bucket, p_job, p_states, v_expires)
        ON CONFLICT DO NOTHING;
        IF FOUND THEN
            RETURN p_job;
        END IF;
        SELECT u.job_id, u.states, u.expires_at INTO k FROM __SCHEMA__.unique_keys u
        WHERE u.key = p_key AND u.bucket = v_bucket FOR UPDATE;
        CONTINUE WHEN NOT FOUND;  -- swept between the two statements: insert again
        IF __SCHEMA__.unique_holds(k.job_id, k.states, k.expires_at) THEN
            RETURN k.job_id;
        END IF;
        UPDATE __SCHEMA__.unique_keys u SET job_id = p_job, states = p_states, expires_at = v_expires,
            created_at = now()
        WHERE u.key = p_key AND u.bucket = v_bucket;
        RETURN p_job;
    END LOOP;
END $$;

-- Write the body of a job whose id was taken from job_id_seq (unique or
-- periodic): to ready now, or to deferred_jobs for a future run_at.
CREATE FUNCTION __SCHEMA__.job_write(p_job bigint, p_queue text, p_priority int, p_kind text, p_args jsonb,
    p_metadata jsonb, p_max_attempts int, p_run_at timestamptz) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF p_run_at IS NOT NULL AND p_run_at > now() THEN
        PERFORM __SCHEMA__.queue_ensure_nowait(p_queue);
        INSERT INTO __SCHEMA__.deferred_jobs (job_id, queue, priority, kind, args, metadata, attempt,
            max_attempts, lease_base, state, run_at, created_at)
        VALUES (p_job, p_queue, p_priority, p_kind, p_args, p_metadata, 0, p_max_attempts, 0, 1, p_run_at, now());
    ELSE
        PERFORM __SCHEMA__.ready_append(p_queue, p_priority, p_job, p_kind, p_args, p_metadata, 0,
            p_max_attempts, 0, now(), NULL, NULL);
    END IF;
END $$;

-- Enqueue one unique job in the caller's transaction. Returns the new job
-- (inserted true) or the job holding the key (inserted false; nothing was
-- written, the caller's transaction stays usable). p_delay (seconds) is
-- measured on the database clock.
CREATE FUNCTION __SCHEMA__.job_enqueue_unique(p_key bytea, p_period float8, p_states int, p_queue text,
    p_priority int, p_kind text, p_args jsonb, p_metadata jsonb, p_max_attempts int, p_run_at timestamptz,
    p_delay float8, OUT job_id bigint, OUT inserted boolean)
LANGUAGE plpgsql AS $$
DECLARE
    v_job bigint := nextval('__SCHEMA__.job_id_seq');
BEGIN
    job_id := __SCHEMA__.unique_take(p_key, p_period, p_states, v_job);
    inserted := job_id = v_job;
    IF inserted THEN
        PERFORM __SCHEMA__.job_write(v_job, p_queue, p_priority, p_kind, p_args, p_metadata, p_max_attempts,
            CASE WHEN p_delay IS NOT NULL AND p_delay > 0 THEN now() + make_interval(secs => p_delay)
                 ELSE p_run_at END);
    END IF;
END $$;

-- Many unique jobs of one kind: one key per row (the client removed
-- duplicates within the batch). Every row's key is taken (or its holder
-- found) first; the rows that took their key are then written with one
-- lane range, like job_enqueue_many. Returns one (job_id, inserted) per
-- row, in order.
CREATE FUNCTION __SCHEMA__.job_enqueue_unique_many(p_keys bytea[], p_period float8, p_states int, p_queue text,
    p_priority int, p_kind text, p_args jsonb[], p_metadata jsonb, p_max_attempts int)
RETURNS TABLE (job_id bigint, inserted boolean)
LANGUAGE plpgsql AS $$
DECLARE
    n int := COALESCE(cardinality(p_keys), 0);
    v_ids bigint[] := '{}';
    v_new boolean[] := '{}';
    v_take bigint[] := '{}';
    v_args jsonb[] := '{}';
    v_job bigint;
    v_got bigint;
    r record;
    i int;
BEGIN
    FOR i IN 1 .. n LOOP
        v_job := nextval('__SCHEMA__.job_id_seq');
        v_got := __SCHEMA__.unique_take(p_keys[i], p_period, p_states, v_job);
        v_ids := v_ids || v_got;
        v_new := v_new || (v_got = v_job);
        IF v_got = v_job THEN
            v_take := v_take || v_job;
            v_args := v_args || p_args[i];
        END IF;
    END LOOP;
    IF cardinality(v_take) > 0 THEN
        SELECT * INTO r FROM __SCHEMA__.lane_reserve(p_queue, p_priority, cardinality(v_take), pg_backend_pid());
        INSERT INTO __SCHEMA__.ready_entries (ready_slot, lane_id, lane_seq, job_id, kind, args, metadata,
            attempt, max_attempts, lease_base)
        SELECT r.ready_slot, r.lane_id, r.first_seq + t.n - 1, t.j, p_kind, t.a, p_metadata, 0, p_max_attempts, 0
        FROM unnest(v_take, v_args) WITH ORDINALITY AS t(j, a, n);
    END IF;
    RETURN QUERY SELECT u.j, u.b FROM unnest(v_ids, v_new) WITH ORDINALITY AS u(j, b, o) ORDER BY u.o;
END $$;

-- Sweep stale keys (holder out of its holding states, or period ended):
-- one batch of p_limit keys after (p_after_key, p_after_bucket) in key
-- order. The batch is locked first (SKIP LOCKED: a key being taken is
-- skipped); the delete is a second statement, so its snapshot is newer
-- than the locks and sees the holder of a key taken over meanwhile. Set
-- based: a terminal holder is found by one index probe per ready slot;
-- a holder found nowhere (history pruned or purged) is released unless its
-- mask names a terminal state and its period has not ended; a key whose
-- mask leaves out a non-terminal state goes through unique_holds. A holder
-- still in the ready ring holds when both available and running do (at
-- worst a stale key is kept until its ready slot is pruned). Returns how
-- many were deleted and where the batch ended (NULL at the end of the table).
CREATE FUNCTION __SCHEMA__.unique_sweep(p_after_key bytea, p_after_bucket bigint, p_limit int,
    OUT swept int, OUT scanned int, OUT last_key bytea, OUT last_bucket bigint)
LANGUAGE plpgsql AS $$
DECLARE
    v_keys bytea[];
    v_buckets bigint[];
BEGIN
    SELECT array_agg(b.key ORDER BY b.key, b.bucket), array_agg(b.bucket ORDER BY b.key, b.bucket), count(*)
    INTO v_keys, v_buckets, scanned
    FROM (SELECT u.key, u.bucket FROM __SCHEMA__.unique_keys u
          WHERE p_after_key IS NULL OR (u.key, u.bucket) > (p_after_key, p_after_bucket)
          ORDER BY u.key, u.bucket LIMIT p_limit
          FOR UPDATE SKIP LOCKED) b;
    IF scanned = 0 THEN
        swept := 0;
        RETURN;
    END IF;
    last_key := v_keys[scanned];
    last_bucket := v_buckets[scanned];
    DELETE FROM __SCHEMA__.unique_keys u USING unnest(v_keys, v_buckets) AS x(k, b)
    WHERE u.key = x.k AND u.bucket = x.b
      AND ((u.expires_at IS NOT NULL AND u.expires_at <= now())
           OR EXISTS (SELECT 1 FROM __SCHEMA__.done_entries d WHERE d.job_id = u.job_id
                      AND (u.states & CASE d.state WHEN 1 THEN 64 WHEN 2 THEN 128 ELSE 256 END) = 0)
           OR EXISTS (SELECT 1 FROM __SCHEMA__.dlq_entries q WHERE q.job_id = u.job_id AND (u.states & 512) = 0)
           OR (NOT EXISTS (SELECT 1 FROM __SCHEMA__.done_entries d WHERE d.job_id = u.job_id)
               AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.dlq_entries q WHERE q.job_id = u.job_id)
               AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.deferred_jobs f WHERE f.job_id = u.job_id)
               AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.leases l WHERE l.job_id = u.job_id)
               AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.ready_entries e WHERE e.job_id = u.job_id)
               AND NOT ((u.states & (64 | 128 | 256 | 512)) <> 0 AND COALESCE(u.expires_at > now(), false)))
           OR ((u.states & 63) <> 63 AND NOT __SCHEMA__.unique_holds(u.job_id, u.states, u.expires_at, false)));
    GET DIAGNOSTICS swept = ROW_COUNT;
    IF scanned < p_limit THEN
        last_key := NULL;
        last_bucket := NULL;
    END IF;
END $$;

---------------------------------------------------------------------------
-- Periodic jobs
---------------------------------------------------------------------------

-- Fire schedule p_name for p_tick (an evaluator computed it from the
-- schedule's cron, zone and newest fire p_prev, on the database clock), in
-- the caller's transaction. Serialized per schedule by a transaction
-- advisory lock; under it the newest scheduled fire must still be p_prev
-- (else 'stale': another evaluator fired meanwhile, evaluate again), the
-- schedule enabled, unpaused and unchanged (p_cron, p_timezone), and the
-- tick due. The ledger insert is the exactly-once arbiter: a conflicting
-- one returns 'duplicate' and enqueues nothing. Returns 'fired', 'held'
-- (a unique holder is still in a holding state; the fire is recorded with
-- held_by and nothing is enqueued), 'duplicate', 'stale', 'not_due' or
-- 'inactive'. A manual fire (p_manual) is outside the tick chain.
CREATE FUNCTION __SCHEMA__.schedule_fire(p_name text, p_tick timestamptz, p_prev timestamptz, p_coalesced int,
    p_cron text, p_timezone text, p_manual boolean DEFAULT false, OUT outcome text, OUT job_id bigint)
LANGUAGE plpgsql AS $$
DECLARE
    s __SCHEMA__.schedules%ROWTYPE;
    v_job bigint;
    v_holder bigint;
    v_meta jsonb;
BEGIN
    PERFORM pg_advisory_xact_lock(__SCHEMA__.lock_key('schedule'), hashtext(p_name));
    IF p_tick IS NULL THEN
        p_tick := now();  -- a manual fire: now
    END IF;
    SELECT * INTO s FROM __SCHEMA__.schedules x WHERE x.name = p_name;
    IF NOT FOUND OR (NOT p_manual AND (NOT s.enabled OR s.paused OR s.cron <> p_cron
                                       OR s.timezone <> p_timezone)) THEN
        outcome := 'inactive';
        RETURN;
    END IF;
    IF p_tick > now() THEN
        outcome := 'not_due';
        RETURN;
    END IF;
    IF NOT p_manual AND (SELECT max(f.tick) FROM __SCHEMA__.schedule_fires f
                         WHERE f.schedule = p_name AND NOT f.manual) IS DISTINCT FROM p_prev THEN
        outcome := 'stale';
        RETURN;
    END IF;
    v_job := nextval('__SCHEMA__.job_id_seq');
    v_meta := COALESCE(s.metadata, '{}'::jsonb)
        || jsonb_build_object('awa.periodic', s.name, 'awa.tick', p_tick);
    IF s.unique_key IS NULL THEN
        INSERT INTO __SCHEMA__.schedule_fires (schedule, tick, prev_tick, coalesced, manual, job_id)
        VALUES (p_name, p_tick, p_prev, p_coalesced, p_manual, v_job)
        ON CONFLICT DO NOTHING;
        IF NOT FOUND THEN
            outcome := 'duplicate';
            RETURN;
        END IF;
        PERFORM __SCHEMA__.job_write(v_job, s.queue, s.priority, s.kind, s.args, v_meta, s.max_attempts, NULL);
        outcome := 'fired';
        job_id := v_job;
        RETURN;
    END IF;
    -- Unique fire: the key first, then the ledger, in a subtransaction so a
    -- duplicate fire takes back the key it took.
    BEGIN
        v_holder := __SCHEMA__.unique_take(s.unique_key, s.unique_period, s.unique_states, v_job);
        INSERT INTO __SCHEMA__.schedule_fires (schedule, tick, prev_tick, coalesced, manual, job_id, held_by)
        VALUES (p_name, p_tick, p_prev, p_coalesced, p_manual,
                CASE WHEN v_holder = v_job THEN v_job END, CASE WHEN v_holder <> v_job THEN v_holder END)
        ON CONFLICT DO NOTHING;
        IF NOT FOUND THEN
            RAISE EXCEPTION USING ERRCODE = 'AF001';
        END IF;
    EXCEPTION WHEN SQLSTATE 'AF001' THEN
        outcome := 'duplicate';
        RETURN;
    END;
    IF v_holder <> v_job THEN
        outcome := 'held';
        job_id := v_holder;
        RETURN;
    END IF;
    PERFORM __SCHEMA__.job_write(v_job, s.queue, s.priority, s.kind, s.args, v_meta, s.max_attempts, NULL);
    outcome := 'fired';
    job_id := v_job;
END $$;

-- Drop fires older than p_keep in one batch of at most p_limit, never the
-- newest scheduled fire of a schedule (the evaluator continues from it).
CREATE FUNCTION __SCHEMA__.schedule_fires_prune(p_keep interval, p_limit int) RETURNS int
LANGUAGE plpgsql AS $$
DECLARE
    n int;
BEGIN
    DELETE FROM __SCHEMA__.schedule_fires f
    WHERE (f.schedule, f.tick) IN (
        SELECT o.schedule, o.tick FROM __SCHEMA__.schedule_fires o
        WHERE o.fired_at < now() - p_keep
          AND (o.manual OR o.tick < (SELECT max(m.tick) FROM __SCHEMA__.schedule_fires m
                                     WHERE m.schedule = o.schedule AND NOT m.manual))
        ORDER BY o.fired_at LIMIT p_limit);
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END $$;

-- Generic plans, like every PL/pgSQL function of the schema (0003): job_load
-- and ready_append read partitioned tables.
DO $$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN
        SELECT p.oid::regprocedure FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang
        WHERE p.pronamespace = '__SCHEMA__'::regnamespace AND l.lanname = 'plpgsql'
          AND p.proname IN ('unique_holds', 'unique_take', 'job_write', 'job_enqueue_unique',
                            'job_enqueue_unique_many', 'unique_sweep', 'schedule_fire', 'schedule_fires_prune')
    LOOP
        EXECUTE format('ALTER FUNCTION %s SET plan_cache_mode = force_generic_plan', f);
    END LOOP;
END $$;
