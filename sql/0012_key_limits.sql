-- awa-fast per-key concurrency: at most key_max_running jobs of one
-- concurrency key at once, fleet-wide, without head-of-line blocking
-- (issue 14 item 3; design: docs/flow-control.md, "Per-key concurrency").
-- compatible-with-previous: yes
-- Immutable once landed, like every migration (rule: docs/storage.md,
-- "Migrations").
--
-- Additive only: one new column of queue_limits (NULL: no key limit), two
-- new tables and new functions. No existing function or grant changes; a
-- queue without key_max_running enqueues and claims exactly as before.
--
-- Previous runtimes: a runtime from before this migration keeps running
-- against it unchanged. It never enqueues into key_waiting and never admits
-- from it: a queue with key_max_running needs every supervisor and every
-- producer of that queue upgraded (an older claimer would not admit waiting
-- jobs; an older producer's jobs are not gated).
--
-- The shape (why no counter per key):
-- - key_waiting: the hold table of a key-limited queue's keyed jobs, by
--   (queue, ckey, seq). Inserted at enqueue, deleted once when admitted;
--   never updated. The lane only ever receives admitted jobs, so a
--   saturated key's backlog is never in front of another key's job.
-- - key_admits: one row per admitted job that has not reached a terminal
--   state yet. Inserted when the job enters the lane, deleted once when the
--   claim sees its terminal evidence (done_entries or dlq_entries); never
--   updated. admitted(key) = count of the key's rows: at most
--   key_max_running, so the table is keys x key_max_running rows at most.

ALTER TABLE __SCHEMA__.queue_limits ADD COLUMN key_max_running int CHECK (key_max_running >= 1);

CREATE SEQUENCE __SCHEMA__.key_waiting_seq;

CREATE TABLE __SCHEMA__.key_waiting (
    queue         text        NOT NULL,
    ckey          text        NOT NULL,
    seq           bigint      NOT NULL DEFAULT nextval('__SCHEMA__.key_waiting_seq'),
    job_id        bigint      NOT NULL,
    priority      smallint    NOT NULL,
    kind          text        NOT NULL,
    args          jsonb       NOT NULL,
    metadata      jsonb,
    max_attempts  smallint    NOT NULL,
    run_at        timestamptz NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (queue, ckey, seq)
);
-- cancel finds a waiting job by id
CREATE UNIQUE INDEX key_waiting_job ON __SCHEMA__.key_waiting (job_id);

CREATE TABLE __SCHEMA__.key_admits (
    queue        text        NOT NULL,
    ckey         text        NOT NULL,
    job_id       bigint      NOT NULL,
    ready_slot   smallint    NOT NULL,  -- where its done row goes unless it moves (retry, rescue)
    admitted_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (queue, ckey, job_id)
);

---------------------------------------------------------------------------
-- Enqueue one job with a concurrency key, in the caller's transaction.
-- Without key_max_running on the queue: job_enqueue as it is (the key is
-- not kept). With it: into key_waiting (a scheduled run_at is kept there);
-- NOTIFY only when the key had nothing waiting (a waiting key is saturated
-- and its claimers come back on their own). Returns the job id.
---------------------------------------------------------------------------
CREATE FUNCTION __SCHEMA__.job_enqueue_keyed(p_queue text, p_priority int, p_kind text, p_args jsonb,
    p_metadata jsonb, p_max_attempts int, p_run_at timestamptz, p_key text) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    v_job bigint;
    v_quiet boolean;
BEGIN
    IF p_key IS NULL OR NOT EXISTS (SELECT 1 FROM __SCHEMA__.queue_limits l
                                    WHERE l.queue = p_queue AND l.key_max_running IS NOT NULL) THEN
        RETURN __SCHEMA__.job_enqueue(p_queue, p_priority, p_kind, p_args, p_metadata, p_max_attempts, p_run_at);
    END IF;
    PERFORM __SCHEMA__.queue_ensure_nowait(p_queue);
    v_job := nextval('__SCHEMA__.job_id_seq');
    -- Index: key_waiting primary key (queue, ckey, seq)
    v_quiet := NOT EXISTS (SELECT 1 FROM __SCHEMA__.key_waiting w WHERE w.queue = p_queue AND w.ckey = p_key);
    INSERT INTO __SCHEMA__.key_waiting (queue, ckey, job_id, priority, kind, args, metadata, max_attempts, run_at)
    VALUES (p_queue, p_key, v_job, p_priority, p_kind, p_args, p_metadata, p_max_attempts,
            greatest(COALESCE(p_run_at, now()), now()));
    IF v_quiet AND (p_run_at IS NULL OR p_run_at <= now()) THEN
        PERFORM pg_notify(__SCHEMA__.notify_channel(), p_queue);
    END IF;
    RETURN v_job;
END $$;

---------------------------------------------------------------------------
-- Enqueue many jobs of one kind, each with its key (NULL: no key), in one
-- statement. Without key_max_running on the queue: job_enqueue_many (one
-- lane range; the keys are not kept). With it: keyed rows into key_waiting
-- (in order, so per-key FIFO holds), unkeyed rows into one lane range.
-- Returns the job ids in the order of p_args.
---------------------------------------------------------------------------
CREATE FUNCTION __SCHEMA__.job_enqueue_keyed_many(p_queue text, p_priority int, p_kind text, p_args jsonb[],
    p_metadata jsonb, p_max_attempts int, p_keys text[]) RETURNS SETOF bigint
LANGUAGE plpgsql AS $$
DECLARE
    v_lane_args jsonb[];
    v_lane_pos bigint[];
    v_lane_ids bigint[];
    v_key_ids bigint[];
    v_key_pos bigint[];
    v_quiet bigint;
BEGIN
    IF cardinality(p_args) IS NULL OR cardinality(p_args) = 0 THEN
        RETURN;
    END IF;
    IF cardinality(p_keys) IS DISTINCT FROM cardinality(p_args) THEN
        RAISE EXCEPTION 'job_enqueue_keyed_many: % args but % keys', cardinality(p_args), cardinality(p_keys)
            USING ERRCODE = '22023';
    END IF;
    IF NOT EXISTS (SELECT 1 FROM __SCHEMA__.queue_limits l
                   WHERE l.queue = p_queue AND l.key_max_running IS NOT NULL) THEN
        RETURN QUERY SELECT * FROM __SCHEMA__.job_enqueue_many(p_queue, p_priority, p_kind, p_args, p_metadata,
                                                               p_max_attempts);
        RETURN;
    END IF;
    PERFORM __SCHEMA__.queue_ensure_nowait(p_queue);
    SELECT array_agg(a.args ORDER BY a.n), array_agg(a.n ORDER BY a.n) INTO v_lane_args, v_lane_pos
    FROM unnest(p_args, p_keys) WITH ORDINALITY AS a(args, k, n) WHERE a.k IS NULL;
    IF v_lane_args IS NOT NULL THEN
        -- lane-born ids grow with their position in the range
        SELECT array_agg(x.id ORDER BY x.id) INTO v_lane_ids
        FROM __SCHEMA__.job_enqueue_many(p_queue, p_priority, p_kind, v_lane_args, p_metadata, p_max_attempts) AS x(id);
    END IF;
    WITH k AS (
        SELECT a.args, a.k, a.n FROM unnest(p_args, p_keys) WITH ORDINALITY AS a(args, k, n) WHERE a.k IS NOT NULL
    ), quiet AS (
        -- Index: key_waiting primary key (queue, ckey, seq); one probe per distinct key
        SELECT count(*) AS c FROM (SELECT DISTINCT k.k FROM k) d
        WHERE NOT EXISTS (SELECT 1 FROM __SCHEMA__.key_waiting w WHERE w.queue = p_queue AND w.ckey = d.k)
    ), ins AS (
        INSERT INTO __SCHEMA__.key_waiting (queue, ckey, job_id, priority, kind, args, metadata, max_attempts, run_at)
        SELECT p_queue, k.k, nextval('__SCHEMA__.job_id_seq'), p_priority, p_kind, k.args, p_metadata,
            p_max_attempts, now()
        FROM k ORDER BY k.n
        RETURNING job_id, seq
    )
    SELECT (SELECT array_agg(i.job_id ORDER BY i.seq) FROM ins i), (SELECT array_agg(k.n ORDER BY k.n) FROM k),
           (SELECT q.c FROM quiet q)
    INTO v_key_ids, v_key_pos, v_quiet;
    IF v_quiet > 0 THEN
        PERFORM pg_notify(__SCHEMA__.notify_channel(), p_queue);
    END IF;
    RETURN QUERY
    SELECT u.id FROM (
        SELECT l.id, l.pos FROM unnest(v_lane_ids, v_lane_pos) AS l(id, pos)
        UNION ALL
        SELECT w.id, w.pos FROM unnest(v_key_ids, v_key_pos) AS w(id, pos)) u
    WHERE u.id IS NOT NULL
    ORDER BY u.pos;
END $$;

---------------------------------------------------------------------------
-- Admission: the gate of a key-limited queue, opened by its claim (the
-- caller holds the queue's limit lock). Retire the admissions whose job
-- reached a terminal state, then per key with waiting jobs admit the
-- oldest due ones up to key_max_running minus what the key still has
-- admitted: delete them from key_waiting, append them to the lane (one
-- lane range per priority), record their admission. p_kmax NULL admits
-- every due waiting job (the key limit was removed). Returns how many.
-- Cost: one probe of done_entries (done_entries_job, each ring partition)
-- and of dlq_entries per admitted job; one index probe per distinct
-- waiting key (a loose scan of key_waiting's primary key), never one per
-- waiting job.
---------------------------------------------------------------------------
CREATE FUNCTION __SCHEMA__.key_admit(p_queue text, p_kmax int) RETURNS int
LANGUAGE plpgsql AS $$
DECLARE
    v_jobs bigint[]; v_prios smallint[]; v_seqs bigint[]; v_kinds text[]; v_args jsonb[]; v_metas jsonb[];
    v_maxs smallint[]; v_created timestamptz[]; v_ckeys text[];
    v_pick_keys text[]; v_pick_seqs bigint[];
    v_prio smallint;
    v_cnt int;
    v_rng record;
    v_phase int;
BEGIN
    -- Index: key_admits primary key (queue, ...); done_entries_job; dlq_entries primary key.
    -- The done row of a job that ran from its admitted ready row is in that row's ready slot:
    -- one partition probed (run-time pruning). A job that moved (retried, snoozed, rescued)
    -- ends elsewhere: every partition is probed for an eighth of the admissions per call
    -- (job_id mod 8 against a random phase), so its slot frees a few claim calls late at most.
    -- An admission older than 5 minutes whose job is nowhere live any more (its terminal row
    -- pruned with its ready slot while no claim ran) is retired too: a key never stays full
    -- of jobs that ended (ready_entries_job, deferred_jobs primary key, leases_job).
    v_phase := floor(random() * 8)::int;
    DELETE FROM __SCHEMA__.key_admits a
    WHERE a.queue = p_queue
      AND (EXISTS (SELECT 1 FROM __SCHEMA__.done_entries x WHERE x.ready_slot = a.ready_slot AND x.job_id = a.job_id)
           OR EXISTS (SELECT 1 FROM __SCHEMA__.dlq_entries x WHERE x.job_id = a.job_id)
           OR (a.job_id % 8 = v_phase
               AND EXISTS (SELECT 1 FROM __SCHEMA__.done_entries x WHERE x.job_id = a.job_id))
           OR (a.admitted_at < now() - interval '5 minutes'
               AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.ready_entries x WHERE x.job_id = a.job_id)
               AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.deferred_jobs x WHERE x.job_id = a.job_id)
               AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.leases x WHERE x.job_id = a.job_id)));
    WITH RECURSIVE keys AS (
        (SELECT w.ckey FROM __SCHEMA__.key_waiting w WHERE w.queue = p_queue ORDER BY w.ckey LIMIT 1)
        UNION ALL
        SELECT (SELECT w.ckey FROM __SCHEMA__.key_waiting w WHERE w.queue = p_queue AND w.ckey > keys.ckey
                ORDER BY w.ckey LIMIT 1)
        FROM keys WHERE keys.ckey IS NOT NULL
    ), pick AS MATERIALIZED (
        SELECT k.ckey, x.seq
        FROM keys k
        CROSS JOIN LATERAL (SELECT p_kmax - count(*) AS room FROM __SCHEMA__.key_admits a
                            WHERE a.queue = p_queue AND a.ckey = k.ckey) r
        CROSS JOIN LATERAL (SELECT w.seq FROM __SCHEMA__.key_waiting w
                            WHERE w.queue = p_queue AND w.ckey = k.ckey AND w.run_at <= now()
                            ORDER BY w.seq LIMIT CASE WHEN p_kmax IS NULL THEN NULL ELSE greatest(r.room, 0) END) x
        WHERE k.ckey IS NOT NULL
    )
    SELECT array_agg(p.ckey), array_agg(p.seq) INTO v_pick_keys, v_pick_seqs FROM pick p;
    IF v_pick_keys IS NULL THEN
        RETURN 0;
    END IF;
    -- Primary-key deletes of exactly the picked rows (a join with the pick, flattened, let the
    -- planner read every waiting row of a hot key: 10,000 rows for 0 picked).
    WITH gone AS (
        DELETE FROM __SCHEMA__.key_waiting w USING unnest(v_pick_keys, v_pick_seqs) AS u(ck, s)
        WHERE w.queue = p_queue AND w.ckey = u.ck AND w.seq = u.s
        RETURNING w.*
    )
    SELECT array_agg(g.job_id ORDER BY g.priority, g.seq), array_agg(g.priority ORDER BY g.priority, g.seq),
           array_agg(g.seq ORDER BY g.priority, g.seq), array_agg(g.kind ORDER BY g.priority, g.seq),
           array_agg(g.args ORDER BY g.priority, g.seq), array_agg(g.metadata ORDER BY g.priority, g.seq),
           array_agg(g.max_attempts ORDER BY g.priority, g.seq), array_agg(g.created_at ORDER BY g.priority, g.seq),
           array_agg(g.ckey ORDER BY g.priority, g.seq)
    INTO v_jobs, v_prios, v_seqs, v_kinds, v_args, v_metas, v_maxs, v_created, v_ckeys
    FROM gone g;
    IF v_jobs IS NULL THEN
        RETURN 0;
    END IF;
    FOR v_prio, v_cnt IN SELECT u.p, count(*) FROM unnest(v_prios) AS u(p) GROUP BY u.p ORDER BY u.p LOOP
        SELECT * INTO v_rng FROM __SCHEMA__.lane_reserve(p_queue, v_prio, v_cnt, pg_backend_pid());
        INSERT INTO __SCHEMA__.ready_entries (ready_slot, lane_id, lane_seq, job_id, kind, args, metadata,
            attempt, max_attempts, lease_base, created_at)
        SELECT v_rng.ready_slot, v_rng.lane_id, v_rng.first_seq + (row_number() OVER (ORDER BY u.s)) - 1,
            u.j, u.k, u.a, u.m, 0, u.x, 0, u.c
        FROM unnest(v_jobs, v_prios, v_seqs, v_kinds, v_args, v_metas, v_maxs, v_created) AS u(j, p, s, k, a, m, x, c)
        WHERE u.p = v_prio;
        IF p_kmax IS NOT NULL THEN
            INSERT INTO __SCHEMA__.key_admits (queue, ckey, job_id, ready_slot)
            SELECT p_queue, u.ck, u.j, v_rng.ready_slot
            FROM unnest(v_jobs, v_prios, v_ckeys) AS u(j, p, ck) WHERE u.p = v_prio;
        END IF;
    END LOOP;
    RETURN cardinality(v_jobs);
END $$;

---------------------------------------------------------------------------
-- The claim of a queue with key_max_running: same arguments and result
-- rows as claim_batch_v3 (claim snapshots, then possibly the backlog
-- marker). Under the queue's limit lock (the one lane_claim_limited takes,
-- re-entrant): admit what the keys have room for, then claim through
-- lane_claim_limited (max_running and max_rate still apply; the rows just
-- admitted are visible to it). Ends with the backlog marker when it came
-- back short while due jobs still wait on a key: nobody NOTIFYs when a
-- key's slot frees, so the claimer comes back after its busy pause.
---------------------------------------------------------------------------
CREATE FUNCTION __SCHEMA__.lane_claim_keyed(p_queue text, p_max int, p_stripe int DEFAULT 0, p_stripes int DEFAULT 1)
RETURNS TABLE (job_id bigint, run_lease int, attempt int, max_attempts int, queue text, kind text,
    priority int, args jsonb, metadata jsonb, ready_slot int, lane_id int, lane_seq bigint,
    claim_slot int, claim_id bigint, created_at timestamptz, errors jsonb, callback_result jsonb,
    progress jsonb)
LANGUAGE plpgsql AS $$
DECLARE
    v_kmax int;
    v_open boolean;
BEGIN
    SELECT l.key_max_running INTO v_kmax FROM __SCHEMA__.queue_limits l WHERE l.queue = p_queue;
    v_open := v_kmax IS NOT NULL AND p_max > 0
        AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.queue_meta m WHERE m.queue = p_queue AND m.paused);
    IF v_open THEN
        PERFORM pg_advisory_xact_lock(__SCHEMA__.lock_key('limit'), hashtext(p_queue));
        PERFORM __SCHEMA__.key_admit(p_queue, v_kmax);
    END IF;
    RETURN QUERY
    WITH c AS MATERIALIZED (
        SELECT * FROM __SCHEMA__.lane_claim_limited(p_queue, p_max, p_stripe, p_stripes)
    ), t AS (
        SELECT count(*) FILTER (WHERE c.job_id IS NOT NULL)::int AS n, COALESCE(bool_or(c.job_id IS NULL), false) AS marker
        FROM c
    )
    SELECT * FROM c WHERE c.job_id IS NOT NULL
    UNION ALL
    SELECT NULL::bigint, NULL::int, NULL::int, NULL::int, NULL::text, NULL::text, NULL::int, NULL::jsonb,
        NULL::jsonb, NULL::int, NULL::int, NULL::bigint, NULL::int, NULL::bigint, NULL::timestamptz,
        NULL::jsonb, NULL::jsonb, NULL::jsonb
    FROM t
    WHERE t.marker OR (v_open AND t.n < p_max
        -- Index: key_waiting primary key (queue, ...)
        AND EXISTS (SELECT 1 FROM __SCHEMA__.key_waiting w WHERE w.queue = p_queue AND w.run_at <= now()));
END $$;

---------------------------------------------------------------------------
-- Set (or with NULL remove) a queue's key_max_running. Removing it
-- releases the queue's waiting jobs: due ones into the lane, scheduled ones
-- into deferred_jobs, and forgets the admissions.
---------------------------------------------------------------------------
CREATE FUNCTION __SCHEMA__.queue_key_limit_set(p_queue text, p_kmax int) RETURNS int
LANGUAGE plpgsql AS $$
DECLARE
    n int := 0;
BEGIN
    PERFORM __SCHEMA__.queue_ensure(p_queue);
    INSERT INTO __SCHEMA__.queue_limits AS l (queue, key_max_running) VALUES (p_queue, p_kmax)
    ON CONFLICT (queue) DO UPDATE SET key_max_running = EXCLUDED.key_max_running, updated_at = now();
    IF p_kmax IS NULL THEN
        PERFORM pg_advisory_xact_lock(__SCHEMA__.lock_key('limit'), hashtext(p_queue));
        n := __SCHEMA__.key_admit(p_queue, NULL);
        WITH gone AS (
            DELETE FROM __SCHEMA__.key_waiting w WHERE w.queue = p_queue RETURNING w.*
        )
        INSERT INTO __SCHEMA__.deferred_jobs (job_id, queue, priority, kind, args, metadata, attempt,
            max_attempts, lease_base, state, run_at, created_at)
        SELECT g.job_id, g.queue, g.priority, g.kind, g.args, g.metadata, 0, g.max_attempts, 0, 1, g.run_at,
            g.created_at
        FROM gone g;
        DELETE FROM __SCHEMA__.key_admits a WHERE a.queue = p_queue;
    END IF;
    RETURN n;
END $$;

---------------------------------------------------------------------------
-- Cancel, knowing key_waiting: a waiting job is removed and recorded
-- cancelled (as a cancelled scheduled job is); anything else is job_cancel.
---------------------------------------------------------------------------
CREATE FUNCTION __SCHEMA__.job_cancel_keyed(p_job_id bigint) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    w __SCHEMA__.key_waiting%ROWTYPE;
BEGIN
    -- Index: key_waiting_job
    DELETE FROM __SCHEMA__.key_waiting x WHERE x.job_id = p_job_id RETURNING * INTO w;
    IF FOUND THEN
        INSERT INTO __SCHEMA__.done_entries (ready_slot, job_id, run_lease, attempt, state, queue, kind, error,
            args, metadata)
        VALUES (__SCHEMA__.ring_current('ready'), w.job_id, 0, 0, 3, w.queue, w.kind, 'cancelled', w.args,
            w.metadata);
        RETURN 'cancelled';
    END IF;
    RETURN __SCHEMA__.job_cancel(p_job_id);
END $$;

---------------------------------------------------------------------------
-- Load, knowing key_waiting: a waiting job is 'available' (due: it runs
-- once its key has room) or 'scheduled', with its concurrency_key;
-- anything else is job_load_v2.
---------------------------------------------------------------------------
CREATE FUNCTION __SCHEMA__.job_load_keyed(p_job_id bigint) RETURNS jsonb
LANGUAGE plpgsql STABLE
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    v jsonb;
BEGIN
    -- Index: key_waiting_job
    SELECT jsonb_build_object('state', CASE WHEN w.run_at > now() THEN 'scheduled' ELSE 'available' END,
        'job_id', w.job_id, 'queue', w.queue, 'kind', w.kind, 'priority', w.priority, 'args', w.args,
        'metadata', w.metadata, 'attempt', 0, 'max_attempts', w.max_attempts, 'run_lease', 0, 'errors', NULL,
        'run_at', w.run_at, 'created_at', w.created_at, 'progress', NULL, 'result', NULL,
        'concurrency_key', w.ckey)
    INTO v FROM __SCHEMA__.key_waiting w WHERE w.job_id = p_job_id;
    IF v IS NOT NULL THEN RETURN v; END IF;
    RETURN __SCHEMA__.job_load_v2(p_job_id);
END $$;

---------------------------------------------------------------------------
-- Per queue with a key limit (or jobs waiting on a key): the limit, jobs
-- waiting on a key, distinct keys waiting, jobs admitted (in the lane or
-- running; a job that just finished counts until the next claim call).
---------------------------------------------------------------------------
CREATE FUNCTION __SCHEMA__.queue_key_status()
RETURNS TABLE (queue text, key_max_running int, waiting bigint, keys_waiting bigint, admitted bigint)
LANGUAGE sql STABLE AS $$
    SELECT q.queue, l.key_max_running,
        (SELECT count(*) FROM __SCHEMA__.key_waiting w WHERE w.queue = q.queue),
        (SELECT count(DISTINCT w.ckey) FROM __SCHEMA__.key_waiting w WHERE w.queue = q.queue),
        (SELECT count(*) FROM __SCHEMA__.key_admits a WHERE a.queue = q.queue)
    FROM (SELECT l2.queue FROM __SCHEMA__.queue_limits l2 WHERE l2.key_max_running IS NOT NULL
          UNION SELECT DISTINCT w2.queue FROM __SCHEMA__.key_waiting w2) q
    LEFT JOIN __SCHEMA__.queue_limits l ON l.queue = q.queue
    ORDER BY q.queue
$$;

-- Generic plans (as 0003 pins for every PL/pgSQL function), and no JIT
-- (the probes over every ring partition cost enough to cross jit_above_cost).
ALTER FUNCTION __SCHEMA__.lane_claim_keyed(text, int, int, int)
    SET plan_cache_mode = force_generic_plan SET jit = off;
ALTER FUNCTION __SCHEMA__.key_admit(text, int) SET plan_cache_mode = force_generic_plan SET jit = off;
ALTER FUNCTION __SCHEMA__.job_enqueue_keyed(text, int, text, jsonb, jsonb, int, timestamptz, text)
    SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION __SCHEMA__.job_enqueue_keyed_many(text, int, text, jsonb[], jsonb, int, text[])
    SET plan_cache_mode = force_generic_plan;

-- Roles an earlier runtime_grant covered get EXECUTE on the functions above
-- (and rights on the new tables) from the migrator, which grants every such
-- role again after it applies migrations (awa_fast/storage/migrate.py).
