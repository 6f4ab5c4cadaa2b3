-- awa-fast: compact done rows, one per receipt and flush (issue 16, step 1).
-- compatible-with-previous: no
-- Immutable once landed, like every migration.
--
-- Why: every plain completion wrote a done_entries row and its index entry
-- (done_entries_job), by binary COPY, one per job. Those rows were the
-- largest per-job write the completion made that a minimal queue does not
-- (docs/performance.md, "The limits"). A completion of many attempts of
-- one receipt now writes ONE done_receipts row for them instead: the
-- receipt's ready slot, lane and seq range, the queue, and the attempts it
-- completes as arrays (job_ids, run_leases), written in the completing
-- transaction after receipt_guard has locked the receipt and dropped every
-- attempt that is no longer open. The attempts' closure evidence is
-- written exactly as before (lease_claim_closure_batches for a receipt
-- whose every attempt completes in the flush, lease_claim_closures per
-- attempt otherwise), so promise 2 holds unchanged: a stale writer is
-- dropped by the guard and writes no done row of either shape, and the
-- closure primary keys make a second closure of one attempt impossible,
-- so no attempt is in two done rows. A receipt whose attempts complete
-- in several flushes gets one done_receipts row per flush (each row names
-- only the attempts it completes).
--
-- What keeps its per-job done_entries row: a completion with a stored
-- result, the low-latency one-statement path (receipt_complete_rows_v2),
-- lease-backed completions, and every failure, cancel and rescue.
--
-- done_receipts lives in the ready ring beside done_entries (the slot of
-- the receipt's ready rows, which hold the job bodies the row refers to
-- by (lane_id, lane_seq)), so prune reclaims it by TRUNCATE with the rest
-- of the slot and folds its counts into queue_terminal_rollups
-- (ring_prune_v3). Readers learn it through two helpers:
--   done_receipt_at(slot, lane, seq, job, run_lease): finished_at of the
--     compact row that completed this attempt of this ready row, or NULL
--     (index done_receipts_lane: min(last_seq) >= seq, then that receipt's
--     rows);
--   job_done_compact(job[, slot]): some ready row of the job (in that slot)
--     was completed by a compact row (ready_entries_job, then the above).
-- New versions of every reader that decided "completed" from done_entries
-- alone: job_load_v3 (and job_load_keyed_v2), queue_counts_exact_v2,
-- ring_prune_v3 (ring_prune's argument checks plus ring_prune_v2's
-- retention), unique_holds_v2 and unique_sweep_v2 (a completed job
-- releases its key; unique_take_v2, job_enqueue_unique_v2,
-- job_enqueue_unique_many_v2 and schedule_fire_v2 only call the new
-- holds), key_admit_v2 (a completed job frees its key's slot;
-- lane_claim_keyed_v2 and queue_key_limit_set_v2 only call it). job_cancel
-- needs nothing: a claimed job whose receipt is closed was already
-- answered 'terminal'.
--
-- Not compatible with the previous runtime: its readers (job_load_keyed,
-- unique_holds, key_admit, queue_counts_exact) do not see compact rows
-- written by a new batcher, so a mixed fleet would report completed jobs
-- as unknown, keep unique keys of completed jobs and keep per-key slots
-- of keyed queues full until history retention; and its leader's
-- ring_prune_v2 would leave a truncated slot's done_receipts behind.
-- Stop every previous-release process (supervisors, workers, admin tools)
-- before running this migration, then start the new release.

CREATE TABLE __SCHEMA__.done_receipts (
    ready_slot smallint NOT NULL,
    lane_id integer NOT NULL,
    claim_id bigint NOT NULL,
    first_seq bigint NOT NULL,   -- the receipt's lane range (lease_claims.first_seq .. last_seq)
    last_seq bigint NOT NULL,
    queue text NOT NULL,
    job_ids bigint[] NOT NULL,   -- the attempts this row completes (a subset of the receipt's)
    run_leases integer[] NOT NULL,
    finished_at timestamptz NOT NULL DEFAULT now()
) PARTITION BY LIST (ready_slot);
-- Like lease_claims' arrays: stored out of line uncompressed (no compression work per flush).
ALTER TABLE __SCHEMA__.done_receipts
    ALTER COLUMN job_ids SET STORAGE EXTERNAL,
    ALTER COLUMN run_leases SET STORAGE EXTERNAL;
-- The lookup of the receipt that covers a lane position (one entry per row, not per job).
CREATE INDEX done_receipts_lane ON __SCHEMA__.done_receipts (lane_id, last_seq);

DO $$
DECLARE
    i int;
BEGIN
    FOR i IN 0 .. (SELECT c.slot_count FROM __SCHEMA__.ring_config c WHERE c.ring = 'ready') - 1 LOOP
        EXECUTE format('CREATE TABLE __SCHEMA__.done_receipts_%s PARTITION OF __SCHEMA__.done_receipts '
                       'FOR VALUES IN (%s)', i, i);
    END LOOP;
END $$;

-- finished_at of the compact done row that completed attempt (p_job_id, p_run_lease) of the ready row
-- (p_ready_slot, p_lane_id, p_lane_seq); NULL when none did. Index: done_receipts_lane (the receipts of one
-- lane cover disjoint ranges, so the first last_seq at or after the position names the only candidate).
CREATE FUNCTION __SCHEMA__.done_receipt_at(p_ready_slot int, p_lane_id int, p_lane_seq bigint, p_job_id bigint,
    p_run_lease int)
RETURNS timestamptz
LANGUAGE sql
STABLE
AS $$
    SELECT d.finished_at FROM __SCHEMA__.done_receipts d
    WHERE d.ready_slot = p_ready_slot AND d.lane_id = p_lane_id
      AND d.last_seq = (SELECT min(x.last_seq) FROM __SCHEMA__.done_receipts x
                        WHERE x.ready_slot = p_ready_slot AND x.lane_id = p_lane_id AND x.last_seq >= p_lane_seq)
      AND d.first_seq <= p_lane_seq
      AND EXISTS (SELECT 1 FROM unnest(d.job_ids, d.run_leases) AS u(j, l) WHERE u.j = p_job_id AND u.l = p_run_lease)
    LIMIT 1
$$;

-- Was a ready row of this job (in p_ready_slot, when given) completed by a compact done row?
-- A completion is terminal, so any such row means the job completed. Index: ready_entries_job.
CREATE FUNCTION __SCHEMA__.job_done_compact(p_job_id bigint, p_ready_slot int DEFAULT NULL)
RETURNS boolean
LANGUAGE sql
STABLE
AS $$
    SELECT EXISTS (
        SELECT 1 FROM __SCHEMA__.ready_entries e
        WHERE e.job_id = p_job_id AND (p_ready_slot IS NULL OR e.ready_slot = p_ready_slot)
          AND __SCHEMA__.done_receipt_at(e.ready_slot, e.lane_id, e.lane_seq, e.job_id, e.lease_base + 1) IS NOT NULL)
$$;

CREATE FUNCTION __SCHEMA__.unique_holds_v2(p_job bigint, p_states integer, p_expires timestamp with time zone, p_exact boolean DEFAULT true)
 RETURNS boolean
 LANGUAGE plpgsql
 STABLE
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
DECLARE
    v_state smallint;
    v_name text;
BEGIN
    SELECT d.state INTO v_state FROM __SCHEMA__.done_entries d
    WHERE d.job_id = p_job ORDER BY d.run_lease DESC LIMIT 1;
    IF FOUND THEN
        RETURN (p_states & CASE v_state WHEN 1 THEN 64 WHEN 2 THEN 128 ELSE 256 END) <> 0;
    END IF;
    -- completed by a compact done row (0015): terminal, like a done_entries row
    IF __SCHEMA__.job_done_compact(p_job) THEN
        RETURN (p_states & 64) <> 0;
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
END $function$;

CREATE FUNCTION __SCHEMA__.unique_sweep_v2(p_after_key bytea, p_after_bucket bigint, p_limit integer, OUT swept integer, OUT scanned integer, OUT last_key bytea, OUT last_bucket bigint)
 RETURNS record
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
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
           OR ((u.states & 64) = 0 AND __SCHEMA__.job_done_compact(u.job_id))
           OR (NOT EXISTS (SELECT 1 FROM __SCHEMA__.done_entries d WHERE d.job_id = u.job_id)
               AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.dlq_entries q WHERE q.job_id = u.job_id)
               AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.deferred_jobs f WHERE f.job_id = u.job_id)
               AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.leases l WHERE l.job_id = u.job_id)
               AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.ready_entries e WHERE e.job_id = u.job_id)
               AND NOT ((u.states & (64 | 128 | 256 | 512)) <> 0 AND COALESCE(u.expires_at > now(), false)))
           OR ((u.states & 63) <> 63 AND NOT __SCHEMA__.unique_holds_v2(u.job_id, u.states, u.expires_at, false)));
    GET DIAGNOSTICS swept = ROW_COUNT;
    IF scanned < p_limit THEN
        last_key := NULL;
        last_bucket := NULL;
    END IF;
END $function$;

CREATE FUNCTION __SCHEMA__.key_admit_v2(p_queue text, p_kmax integer)
 RETURNS integer
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
 SET jit TO 'off'
AS $function$
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
END $function$;

CREATE FUNCTION __SCHEMA__.job_load_v3(p_job_id bigint)
 RETURNS jsonb
 LANGUAGE plpgsql
 STABLE
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
DECLARE
    v jsonb;
    r record;
    v_state text;
    v_progress jsonb;
    v_finished timestamptz;
BEGIN
    SELECT jsonb_build_object('state', CASE d.state WHEN 1 THEN 'completed' WHEN 2 THEN 'failed' ELSE 'cancelled' END,
        'job_id', d.job_id, 'queue', d.queue, 'kind', d.kind, 'attempt', d.attempt, 'run_lease', d.run_lease,
        'error', d.error, 'finished_at', d.finished_at,
        'args', COALESCE(d.args, e.args), 'metadata', COALESCE(d.metadata, e.metadata), 'errors', e.errors,
        'max_attempts', e.max_attempts, 'created_at', e.created_at, 'progress', NULL, 'result', d.result)
    INTO v
    FROM __SCHEMA__.done_entries d
    LEFT JOIN __SCHEMA__.ready_entries e
        ON e.ready_slot = d.ready_slot AND e.lane_id = d.lane_id AND e.lane_seq = d.lane_seq
    WHERE d.job_id = p_job_id ORDER BY d.run_lease DESC LIMIT 1;
    IF v IS NOT NULL THEN RETURN v; END IF;
    SELECT jsonb_build_object('state', 'dlq', 'job_id', x.job_id, 'queue', x.queue, 'kind', x.kind,
        'priority', x.priority, 'args', x.args, 'metadata', x.metadata, 'attempt', x.attempt,
        'max_attempts', x.max_attempts, 'run_lease', x.lease_base, 'errors', x.errors, 'error', x.reason,
        'created_at', x.created_at, 'finished_at', x.failed_at, 'progress', NULL, 'result', NULL)
    INTO v FROM __SCHEMA__.dlq_entries x WHERE x.job_id = p_job_id;
    IF v IS NOT NULL THEN RETURN v; END IF;
    SELECT jsonb_build_object('state', CASE x.state WHEN 1 THEN 'scheduled' WHEN 2 THEN 'retryable' ELSE 'snoozed' END,
        'job_id', x.job_id, 'queue', x.queue, 'kind', x.kind, 'priority', x.priority, 'args', x.args,
        'metadata', x.metadata, 'attempt', x.attempt, 'max_attempts', x.max_attempts, 'run_lease', x.lease_base,
        'errors', x.errors, 'run_at', x.run_at, 'created_at', x.created_at, 'progress', x.progress, 'result', NULL)
    INTO v FROM __SCHEMA__.deferred_jobs x WHERE x.job_id = p_job_id;
    IF v IS NOT NULL THEN RETURN v; END IF;
    SELECT jsonb_build_object('state', 'waiting_external', 'job_id', l.job_id, 'queue', l.queue, 'kind', l.kind,
        'attempt', l.attempt, 'max_attempts', l.max_attempts, 'run_lease', l.run_lease,
        'callback_timeout_at', l.callback_timeout_at, 'args', e.args, 'metadata', e.metadata,
        'errors', e.errors, 'created_at', e.created_at,
        'progress', COALESCE((SELECT a.progress FROM __SCHEMA__.attempt_state a
                              WHERE a.job_id = l.job_id AND a.run_lease = l.run_lease), e.progress),
        'result', NULL)
    INTO v FROM __SCHEMA__.leases l
    JOIN __SCHEMA__.ready_entries e ON e.ready_slot = l.ready_slot AND e.lane_id = l.lane_id AND e.lane_seq = l.lane_seq
    WHERE l.job_id = p_job_id;
    IF v IS NOT NULL THEN RETURN v; END IF;
    SELECT e.*, ql.queue, ql.priority, h.claim_seq INTO r
    FROM __SCHEMA__.ready_entries e
    JOIN __SCHEMA__.queue_lanes ql ON ql.lane_id = e.lane_id
    JOIN __SCHEMA__.queue_claim_heads h ON h.lane_id = e.lane_id
    WHERE e.job_id = p_job_id ORDER BY e.lease_base DESC LIMIT 1;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    IF EXISTS (SELECT 1 FROM __SCHEMA__.ready_tombstones t
               WHERE t.ready_slot = r.ready_slot AND t.lane_id = r.lane_id AND t.lane_seq = r.lane_seq) THEN
        v_state := 'cancelled';
    ELSIF EXISTS (
        -- the receipt that claimed this very row (not an older attempt's)
        SELECT 1 FROM __SCHEMA__.lease_claims c
        WHERE c.lane_id = r.lane_id AND c.ready_slot = r.ready_slot
          AND r.lane_seq BETWEEN c.first_seq AND c.last_seq AND r.job_id = ANY (c.job_ids)
          AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.lease_claim_closure_batches b
                          WHERE b.claim_slot = c.claim_slot AND b.claim_id = c.claim_id)
          AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.lease_claim_closures x
                          WHERE x.claim_slot = c.claim_slot AND x.claim_id = c.claim_id AND x.job_id = r.job_id
                            AND x.run_lease = r.lease_base + 1)) THEN
        v_state := 'running';
    ELSIF r.lane_seq > greatest(pg_sequence_last_value(r.claim_seq),
                                COALESCE((SELECT max(c.last_seq) FROM __SCHEMA__.lease_claims c
                                          WHERE c.lane_id = r.lane_id), 0)) THEN
        v_state := 'available';
    ELSE
        -- claimed and closed, and no per-job terminal, deferred or DLQ record:
        -- completed by a compact done row of its receipt (0015), else the record
        -- is gone (purged or pruned): unknown
        v_finished := __SCHEMA__.done_receipt_at(r.ready_slot, r.lane_id, r.lane_seq, r.job_id, r.lease_base + 1);
        IF v_finished IS NULL THEN
            RETURN NULL;
        END IF;
        RETURN jsonb_build_object('state', 'completed',
            'job_id', r.job_id, 'queue', r.queue, 'kind', r.kind, 'attempt', r.attempt + 1,
            'run_lease', r.lease_base + 1, 'error', NULL, 'finished_at', v_finished,
            'args', r.args, 'metadata', r.metadata, 'errors', r.errors,
            'max_attempts', r.max_attempts, 'created_at', r.created_at, 'progress', NULL, 'result', NULL);
    END IF;
    IF v_state = 'running' THEN
        SELECT a.progress INTO v_progress FROM __SCHEMA__.attempt_state a
        WHERE a.job_id = r.job_id AND a.run_lease = r.lease_base + 1;
    END IF;
    RETURN jsonb_build_object(
        'state', v_state,
        'job_id', r.job_id, 'queue', r.queue, 'kind', r.kind, 'priority', r.priority, 'args', r.args,
        'metadata', r.metadata,
        'attempt', CASE WHEN v_state = 'running' THEN r.attempt + 1 ELSE r.attempt END,
        'max_attempts', r.max_attempts,
        'run_lease', CASE WHEN v_state = 'running' THEN r.lease_base + 1 ELSE r.lease_base END,
        'errors', r.errors, 'created_at', r.created_at,
        'progress', CASE WHEN v_state = 'cancelled' THEN NULL ELSE COALESCE(v_progress, r.progress) END,
        'result', NULL);
END $function$;

CREATE FUNCTION __SCHEMA__.queue_counts_exact_v2()
 RETURNS TABLE(queue text, state text, count bigint)
 LANGUAGE sql
 STABLE
AS $function$
    WITH cursors AS (
        SELECT h.lane_id, h.queue,
               greatest(pg_sequence_last_value(h.claim_seq),
                        COALESCE((SELECT max(c.last_seq) FROM __SCHEMA__.lease_claims c WHERE c.lane_id = h.lane_id), 0)) AS cur
        FROM __SCHEMA__.queue_claim_heads h
    ), open_claims AS (
        SELECT ql.queue, u.j, u.l
        FROM __SCHEMA__.lease_claims c
        JOIN __SCHEMA__.queue_lanes ql ON ql.lane_id = c.lane_id
        CROSS JOIN LATERAL unnest(c.job_ids, c.run_leases) AS u(j, l)
        WHERE NOT EXISTS (SELECT 1 FROM __SCHEMA__.lease_claim_closure_batches b
                          WHERE b.claim_slot = c.claim_slot AND b.claim_id = c.claim_id)
          AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.lease_claim_closures x
                          WHERE x.claim_slot = c.claim_slot AND x.claim_id = c.claim_id AND x.job_id = u.j AND x.run_lease = u.l)
    )
    SELECT k.queue, 'available', count(*)
    FROM __SCHEMA__.ready_entries r JOIN cursors k ON k.lane_id = r.lane_id
    WHERE r.lane_seq > k.cur
      AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.ready_tombstones t
                      WHERE t.ready_slot = r.ready_slot AND t.lane_id = r.lane_id AND t.lane_seq = r.lane_seq)
    GROUP BY k.queue
    UNION ALL SELECT o.queue, 'running', count(*) FROM open_claims o GROUP BY o.queue
    UNION ALL SELECT l.queue, 'waiting', count(*) FROM __SCHEMA__.leases l GROUP BY l.queue
    UNION ALL SELECT d.queue, CASE d.state WHEN 1 THEN 'scheduled' WHEN 2 THEN 'retryable' ELSE 'snoozed' END,
                     count(*) FROM __SCHEMA__.deferred_jobs d GROUP BY 1, 2
    UNION ALL SELECT q.queue, CASE q.state WHEN 1 THEN 'completed' WHEN 2 THEN 'failed' ELSE 'cancelled' END,
                     sum(q.n)::bigint
              FROM (SELECT de.queue, de.state, count(*) AS n FROM __SCHEMA__.done_entries de GROUP BY 1, 2
                    UNION ALL SELECT dr.queue, 1::smallint, sum(cardinality(dr.job_ids))::bigint
                              FROM __SCHEMA__.done_receipts dr GROUP BY 1
                    UNION ALL SELECT tr.queue, tr.state, tr.count FROM __SCHEMA__.queue_terminal_rollups tr) q
              GROUP BY 1, 2
    UNION ALL SELECT x.queue, 'dlq', count(*) FROM __SCHEMA__.dlq_entries x GROUP BY x.queue
$function$;

CREATE FUNCTION __SCHEMA__.ring_prune_v3(p_ring text, p_slot integer, p_lock_timeout text DEFAULT '50ms'::text, p_retain_s double precision DEFAULT 0)
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
            PERFORM __SCHEMA__.lanes_cursor_advance(ARRAY(
                SELECT DISTINCT c.lane_id FROM __SCHEMA__.lease_claims c WHERE c.claim_slot = p_slot));
            v_gate := __SCHEMA__.claim_prune_gate(p_slot);
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

CREATE FUNCTION __SCHEMA__.unique_take_v2(p_key bytea, p_period double precision, p_states integer, p_job bigint)
 RETURNS bigint
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
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
        IF __SCHEMA__.unique_holds_v2(k.job_id, k.states, k.expires_at) THEN
            RETURN k.job_id;
        END IF;
        UPDATE __SCHEMA__.unique_keys u SET job_id = p_job, states = p_states, expires_at = v_expires,
            created_at = now()
        WHERE u.key = p_key AND u.bucket = v_bucket;
        RETURN p_job;
    END LOOP;
END $function$;

CREATE FUNCTION __SCHEMA__.job_enqueue_unique_v2(p_key bytea, p_period double precision, p_states integer, p_queue text, p_priority integer, p_kind text, p_args jsonb, p_metadata jsonb, p_max_attempts integer, p_run_at timestamp with time zone, p_delay double precision, OUT job_id bigint, OUT inserted boolean)
 RETURNS record
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
DECLARE
    v_job bigint := nextval('__SCHEMA__.job_id_seq');
BEGIN
    job_id := __SCHEMA__.unique_take_v2(p_key, p_period, p_states, v_job);
    inserted := job_id = v_job;
    IF inserted THEN
        PERFORM __SCHEMA__.job_write(v_job, p_queue, p_priority, p_kind, p_args, p_metadata, p_max_attempts,
            CASE WHEN p_delay IS NOT NULL AND p_delay > 0 THEN now() + make_interval(secs => p_delay)
                 ELSE p_run_at END);
    END IF;
END $function$;

CREATE FUNCTION __SCHEMA__.job_enqueue_unique_many_v2(p_keys bytea[], p_period double precision, p_states integer, p_queue text, p_priority integer, p_kind text, p_args jsonb[], p_metadata jsonb, p_max_attempts integer)
 RETURNS TABLE(job_id bigint, inserted boolean)
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
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
        v_got := __SCHEMA__.unique_take_v2(p_keys[i], p_period, p_states, v_job);
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
END $function$;

CREATE FUNCTION __SCHEMA__.schedule_fire_v2(p_name text, p_tick timestamp with time zone, p_prev timestamp with time zone, p_coalesced integer, p_cron text, p_timezone text, p_manual boolean DEFAULT false, OUT outcome text, OUT job_id bigint)
 RETURNS record
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
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
        v_holder := __SCHEMA__.unique_take_v2(s.unique_key, s.unique_period, s.unique_states, v_job);
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
END $function$;

CREATE FUNCTION __SCHEMA__.lane_claim_keyed_v2(p_queue text, p_max integer, p_stripe integer DEFAULT 0, p_stripes integer DEFAULT 1)
 RETURNS TABLE(job_id bigint, run_lease integer, attempt integer, max_attempts integer, queue text, kind text, priority integer, args jsonb, metadata jsonb, ready_slot integer, lane_id integer, lane_seq bigint, claim_slot integer, claim_id bigint, created_at timestamp with time zone, errors jsonb, callback_result jsonb, progress jsonb)
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
 SET jit TO 'off'
AS $function$
DECLARE
    v_kmax int;
    v_open boolean;
BEGIN
    SELECT l.key_max_running INTO v_kmax FROM __SCHEMA__.queue_limits l WHERE l.queue = p_queue;
    v_open := v_kmax IS NOT NULL AND p_max > 0
        AND NOT EXISTS (SELECT 1 FROM __SCHEMA__.queue_meta m WHERE m.queue = p_queue AND m.paused);
    IF v_open THEN
        PERFORM pg_advisory_xact_lock(__SCHEMA__.lock_key('limit'), hashtext(p_queue));
        PERFORM __SCHEMA__.key_admit_v2(p_queue, v_kmax);
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
END $function$;

CREATE FUNCTION __SCHEMA__.queue_key_limit_set_v2(p_queue text, p_kmax integer)
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
            max_attempts, lease_base, state, run_at, created_at)
        SELECT g.job_id, g.queue, g.priority, g.kind, g.args, g.metadata, 0, g.max_attempts, 0, 1, g.run_at,
            g.created_at
        FROM gone g;
        DELETE FROM __SCHEMA__.key_admits a WHERE a.queue = p_queue;
    END IF;
    RETURN n;
END $function$;

CREATE FUNCTION __SCHEMA__.job_load_keyed_v2(p_job_id bigint)
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
        'metadata', w.metadata, 'attempt', 0, 'max_attempts', w.max_attempts, 'run_lease', 0, 'errors', NULL,
        'run_at', w.run_at, 'created_at', w.created_at, 'progress', NULL, 'result', NULL,
        'concurrency_key', w.ckey)
    INTO v FROM __SCHEMA__.key_waiting w WHERE w.job_id = p_job_id;
    IF v IS NOT NULL THEN RETURN v; END IF;
    RETURN __SCHEMA__.job_load_v3(p_job_id);
END $function$;

