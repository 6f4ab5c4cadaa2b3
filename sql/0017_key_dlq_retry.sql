-- awa-fast: a DLQ retry of a keyed job waits for its key's room again (per-key concurrency, 0012).
-- compatible-with-previous: yes
-- Immutable once landed, like every migration.
--
-- The gap. A keyed job's key lived only in its admission (key_admits) while
-- it was in the lane or running. When the job was dead-lettered, the next
-- claim of its queue retired the admission (the job is terminal), and the
-- key was gone with it: dlq_retry put the job straight back into the lane,
-- where it ran outside its key's limit once (docs/flow-control.md listed it
-- under "Not covered").
--
-- The fix (bodies only; same arguments, same results, same lock order):
-- - key_dlq (job_id, queue, ckey): when the retire step of key_admit_v2
--   removes an admission because its job is in dlq_entries, it keeps the
--   key there. One row per dead-lettered keyed job; a statement trigger on
--   dlq_entries deletes the rows of the entries any DELETE removes (retry,
--   purge, retention prune, or a user's own DELETE), so the table is never
--   larger than the keyed part of the DLQ.
-- - key_waiting gains lease_base and errors, so a job that re-enters through
--   the gate keeps its run_lease numbering (promise 2: a lease of an earlier
--   attempt must never be handed out again) and its error history;
--   key_admit_v2 and queue_key_limit_set_v2 carry both into the lane or
--   deferred_jobs (0 and NULL for a job enqueued with a key, as before).
-- - dlq_retry: on a queue with key_max_running it takes the queue's limit
--   lock (the one the keyed claim takes) before it reads the keys, so a
--   retire running at the same time and this retry see each other. A job
--   whose admission is still there (no claim has retired it yet) goes back
--   to the lane and keeps that admission, as before. A job with a kept key
--   goes to key_waiting and is admitted when its key has room. Everything
--   else is unchanged.
-- - job_load_keyed_v2 shows a waiting job's errors and last lease; job_cancel_keyed records
--   that lease on the cancelled row.
--
-- Cost: nothing for a queue without key_max_running (dlq_retry reads one
-- more primary key of queue_limits per distinct queue, the statement trigger
-- is one join with an empty key_dlq per DELETE of dlq_entries, never on the
-- claim or completion path). On a keyed queue: one dlq_entries probe per
-- retired admission, which the retire already made.
--
-- Compatibility: a previous runtime calls the same functions and gets the
-- fixed bodies; its keyed enqueue leaves the new columns at their defaults.

CREATE TABLE __SCHEMA__.key_dlq (
    job_id  bigint PRIMARY KEY,
    queue   text   NOT NULL,
    ckey    text   NOT NULL
);

ALTER TABLE __SCHEMA__.key_waiting
    ADD COLUMN lease_base int NOT NULL DEFAULT 0,
    ADD COLUMN errors jsonb;

CREATE FUNCTION __SCHEMA__.key_dlq_forget() RETURNS trigger
 LANGUAGE plpgsql
AS $function$
BEGIN
    -- Index: key_dlq primary key
    DELETE FROM __SCHEMA__.key_dlq k USING gone g WHERE k.job_id = g.job_id;
    RETURN NULL;
END $function$;

CREATE TRIGGER dlq_entries_forget_keys AFTER DELETE ON __SCHEMA__.dlq_entries
    REFERENCING OLD TABLE AS gone FOR EACH STATEMENT EXECUTE FUNCTION __SCHEMA__.key_dlq_forget();

CREATE OR REPLACE FUNCTION __SCHEMA__.key_admit_v2(p_queue text, p_kmax integer)
 RETURNS integer
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
 SET jit TO 'off'
AS $function$
DECLARE
    v_jobs bigint[]; v_prios smallint[]; v_seqs bigint[]; v_kinds text[]; v_args jsonb[]; v_metas jsonb[];
    v_maxs smallint[]; v_created timestamptz[]; v_ckeys text[]; v_bases int[]; v_errors jsonb[];
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
    -- A dead-lettered job's key is kept in key_dlq (0017), for its DLQ retry.
    v_phase := floor(random() * 8)::int;
    WITH retired AS (
        DELETE FROM __SCHEMA__.key_admits a
        WHERE a.queue = p_queue
          AND (EXISTS (SELECT 1 FROM __SCHEMA__.done_entries x WHERE x.ready_slot = a.ready_slot AND x.job_id = a.job_id)
               -- completed by a compact done row (0015), probed like the done row: the admitted slot
               -- every call (index ready_entries_job in one partition, then done_receipts_lane)
               OR __SCHEMA__.job_done_compact(a.job_id, a.ready_slot)
               OR EXISTS (SELECT 1 FROM __SCHEMA__.dlq_entries x WHERE x.job_id = a.job_id)
               OR (a.job_id % 8 = v_phase
                   AND (EXISTS (SELECT 1 FROM __SCHEMA__.done_entries x WHERE x.job_id = a.job_id)
                        OR __SCHEMA__.job_done_compact(a.job_id)))
               OR (a.admitted_at < now() - interval '5 minutes'
                   AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.ready_entries x WHERE x.job_id = a.job_id)
                   AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.deferred_jobs x WHERE x.job_id = a.job_id)
                   AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.leases x WHERE x.job_id = a.job_id)))
        RETURNING a.queue, a.ckey, a.job_id
    )
    INSERT INTO __SCHEMA__.key_dlq (job_id, queue, ckey)
    SELECT r.job_id, r.queue, r.ckey FROM retired r
    WHERE EXISTS (SELECT 1 FROM __SCHEMA__.dlq_entries x WHERE x.job_id = r.job_id)
    ON CONFLICT (job_id) DO NOTHING;
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
           array_agg(g.ckey ORDER BY g.priority, g.seq), array_agg(g.lease_base ORDER BY g.priority, g.seq),
           array_agg(g.errors ORDER BY g.priority, g.seq)
    INTO v_jobs, v_prios, v_seqs, v_kinds, v_args, v_metas, v_maxs, v_created, v_ckeys, v_bases, v_errors
    FROM gone g;
    IF v_jobs IS NULL THEN
        RETURN 0;
    END IF;
    FOR v_prio, v_cnt IN SELECT u.p, count(*) FROM unnest(v_prios) AS u(p) GROUP BY u.p ORDER BY u.p LOOP
        SELECT * INTO v_rng FROM __SCHEMA__.lane_reserve(p_queue, v_prio, v_cnt, pg_backend_pid());
        INSERT INTO __SCHEMA__.ready_entries (ready_slot, lane_id, lane_seq, job_id, kind, args, metadata,
            attempt, max_attempts, lease_base, created_at, errors)
        SELECT v_rng.ready_slot, v_rng.lane_id, v_rng.first_seq + (row_number() OVER (ORDER BY u.s)) - 1,
            u.j, u.k, u.a, u.m, 0, u.x, u.b, u.c, u.e
        FROM unnest(v_jobs, v_prios, v_seqs, v_kinds, v_args, v_metas, v_maxs, v_created, v_bases, v_errors)
            AS u(j, p, s, k, a, m, x, c, b, e)
        WHERE u.p = v_prio;
        IF p_kmax IS NOT NULL THEN
            INSERT INTO __SCHEMA__.key_admits (queue, ckey, job_id, ready_slot)
            SELECT p_queue, u.ck, u.j, v_rng.ready_slot
            FROM unnest(v_jobs, v_prios, v_ckeys) AS u(j, p, ck) WHERE u.p = v_prio;
        END IF;
    END LOOP;
    RETURN cardinality(v_jobs);
END $function$;

CREATE OR REPLACE FUNCTION __SCHEMA__.queue_key_limit_set_v2(p_queue text, p_kmax integer)
 RETURNS integer
 LANGUAGE plpgsql
AS $function$
DECLARE
    n int := 0;
BEGIN
    PERFORM __SCHEMA__.queue_ensure(p_queue);
    INSERT INTO __SCHEMA__.queue_limits AS l (queue, key_max_running) VALUES (p_queue, p_kmax)
    ON CONFLICT (queue) DO UPDATE SET key_max_running = EXCLUDED.key_max_running, updated_at = now();
    IF p_kmax IS NULL THEN
        PERFORM pg_advisory_xact_lock(__SCHEMA__.lock_key('limit'), hashtext(p_queue));
        n := __SCHEMA__.key_admit_v2(p_queue, NULL);
        WITH gone AS (
            DELETE FROM __SCHEMA__.key_waiting w WHERE w.queue = p_queue RETURNING w.*
        )
        INSERT INTO __SCHEMA__.deferred_jobs (job_id, queue, priority, kind, args, metadata, attempt,
            max_attempts, lease_base, state, run_at, created_at, errors)
        SELECT g.job_id, g.queue, g.priority, g.kind, g.args, g.metadata, 0, g.max_attempts, g.lease_base, 1,
            g.run_at, g.created_at, g.errors
        FROM gone g;
        DELETE FROM __SCHEMA__.key_admits a WHERE a.queue = p_queue;
        -- the queue has no key limit any more: a DLQ retry of its jobs goes to the lane
        DELETE FROM __SCHEMA__.key_dlq k WHERE k.queue = p_queue;
    END IF;
    RETURN n;
END $function$;

CREATE OR REPLACE FUNCTION __SCHEMA__.dlq_retry(p_job_ids bigint[])
 RETURNS SETOF bigint
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
DECLARE
    d record;
    v_queue text;
    v_ids bigint[];
    v_keys text[];
    v_key text;
    v_quiet boolean;
BEGIN
    -- The keyed queues among the entries, each under its limit lock (the keyed claim's; in queue
    -- order, so two retries never wait on each other in a cycle). After the lock, a retire that
    -- ran before has kept its key in key_dlq, and one that runs after sees no dlq_entries row.
    -- Index: dlq_entries primary key, queue_limits primary key.
    FOR v_queue IN SELECT DISTINCT x.queue FROM __SCHEMA__.dlq_entries x
                   JOIN __SCHEMA__.queue_limits l ON l.queue = x.queue AND l.key_max_running IS NOT NULL
                   WHERE x.job_id = ANY (p_job_ids) ORDER BY x.queue LOOP
        PERFORM pg_advisory_xact_lock(__SCHEMA__.lock_key('limit'), hashtext(v_queue));
    END LOOP;
    -- Read the kept keys before the DELETE: its statement trigger forgets them.
    -- Index: key_dlq primary key.
    SELECT array_agg(k.job_id), array_agg(k.ckey) INTO v_ids, v_keys
    FROM __SCHEMA__.key_dlq k WHERE k.job_id = ANY (p_job_ids);
    FOR d IN DELETE FROM __SCHEMA__.dlq_entries x WHERE x.job_id = ANY (p_job_ids) RETURNING * LOOP
        v_key := NULL;
        IF v_ids IS NOT NULL THEN
            v_key := v_keys[array_position(v_ids, d.job_id)];
        END IF;
        IF v_key IS NOT NULL AND EXISTS (SELECT 1 FROM __SCHEMA__.queue_limits l
                                         WHERE l.queue = d.queue AND l.key_max_running IS NOT NULL) THEN
            -- Index: key_waiting primary key (queue, ckey, seq)
            v_quiet := NOT EXISTS (SELECT 1 FROM __SCHEMA__.key_waiting w WHERE w.queue = d.queue AND w.ckey = v_key);
            INSERT INTO __SCHEMA__.key_waiting (queue, ckey, job_id, priority, kind, args, metadata, max_attempts,
                run_at, created_at, lease_base, errors)
            VALUES (d.queue, v_key, d.job_id, d.priority, d.kind, d.args, d.metadata, d.max_attempts, now(),
                d.created_at, d.lease_base, d.errors);
            IF v_quiet THEN
                PERFORM pg_notify(__SCHEMA__.notify_channel(), d.queue);
            END IF;
        ELSE
            PERFORM __SCHEMA__.ready_append(d.queue, d.priority, d.job_id, d.kind, d.args, d.metadata, 0,
                d.max_attempts, d.lease_base, d.created_at, d.errors, NULL);
        END IF;
        RETURN NEXT d.job_id;
    END LOOP;
END $function$;

CREATE OR REPLACE FUNCTION __SCHEMA__.job_load_keyed_v2(p_job_id bigint)
 RETURNS jsonb
 LANGUAGE plpgsql
 STABLE
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
DECLARE
    v jsonb;
BEGIN
    -- Index: key_waiting_job
    SELECT jsonb_build_object('state', CASE WHEN w.run_at > now() THEN 'scheduled' ELSE 'available' END,
        'job_id', w.job_id, 'queue', w.queue, 'kind', w.kind, 'priority', w.priority, 'args', w.args,
        'metadata', w.metadata, 'attempt', 0, 'max_attempts', w.max_attempts, 'run_lease', w.lease_base,
        'errors', w.errors, 'run_at', w.run_at, 'created_at', w.created_at, 'progress', NULL, 'result', NULL,
        'concurrency_key', w.ckey)
    INTO v FROM __SCHEMA__.key_waiting w WHERE w.job_id = p_job_id;
    IF v IS NOT NULL THEN RETURN v; END IF;
    RETURN __SCHEMA__.job_load_v3(p_job_id);
END $function$;

CREATE OR REPLACE FUNCTION __SCHEMA__.job_cancel_keyed(p_job_id bigint)
 RETURNS text
 LANGUAGE plpgsql
AS $function$
DECLARE
    w __SCHEMA__.key_waiting%ROWTYPE;
BEGIN
    -- Index: key_waiting_job
    DELETE FROM __SCHEMA__.key_waiting x WHERE x.job_id = p_job_id RETURNING * INTO w;
    IF FOUND THEN
        -- run_lease: the job's last lease (0 unless it came back from the DLQ), as job_load shows it
        INSERT INTO __SCHEMA__.done_entries (ready_slot, job_id, run_lease, attempt, state, queue, kind, error,
            args, metadata)
        VALUES (__SCHEMA__.ring_current('ready'), w.job_id, w.lease_base, 0, 3, w.queue, w.kind, 'cancelled',
            w.args, w.metadata);
        RETURN 'cancelled';
    END IF;
    RETURN __SCHEMA__.job_cancel(p_job_id);
END $function$;
