-- awa-fast: dlq_retry finds each entry's kept key by a join, not by searching an array per entry.
-- compatible-with-previous: yes
-- Immutable once landed, like every migration.
--
-- 0017's dlq_retry read the kept keys of the retried entries into two arrays
-- and looked each entry up with array_position: linear per entry, so a retry
-- of a whole keyed queue's DLQ was quadratic in its size (50,000 entries:
-- ~10^9 comparisons). The body now reads the key beside each deleted entry in
-- the DELETE's own statement (a LEFT JOIN of its RETURNING rows with key_dlq
-- by primary key); the statement trigger that forgets kept keys fires at the
-- end of that statement, after the join has read them, as it did after the
-- arrays were read.
--
-- Body only (rule 3 of docs/storage.md): same argument, same rows returned
-- in the same cases, the same limit locks in the same order, the same writes.

CREATE OR REPLACE FUNCTION __SCHEMA__.dlq_retry(p_job_ids bigint[])
 RETURNS SETOF bigint
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
DECLARE
    d record;
    v_queue text;
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
    -- Each entry with its kept key, read in the DELETE's statement (its trigger forgets the keys
    -- at the statement's end). Index: dlq_entries primary key, key_dlq primary key.
    FOR d IN WITH gone AS (
                 DELETE FROM __SCHEMA__.dlq_entries x WHERE x.job_id = ANY (p_job_ids) RETURNING x.*
             )
             SELECT g.*, k.ckey AS kept_key FROM gone g LEFT JOIN __SCHEMA__.key_dlq k ON k.job_id = g.job_id LOOP
        IF d.kept_key IS NOT NULL AND EXISTS (SELECT 1 FROM __SCHEMA__.queue_limits l
                                              WHERE l.queue = d.queue AND l.key_max_running IS NOT NULL) THEN
            -- Index: key_waiting primary key (queue, ckey, seq)
            v_quiet := NOT EXISTS (SELECT 1 FROM __SCHEMA__.key_waiting w
                                   WHERE w.queue = d.queue AND w.ckey = d.kept_key);
            INSERT INTO __SCHEMA__.key_waiting (queue, ckey, job_id, priority, kind, args, metadata, max_attempts,
                run_at, created_at, lease_base, errors)
            VALUES (d.queue, d.kept_key, d.job_id, d.priority, d.kind, d.args, d.metadata, d.max_attempts, now(),
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
