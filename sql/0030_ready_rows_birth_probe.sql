-- awa-fast: a job's row at its birth position is found by one primary-key probe per ready slot on every PostgreSQL version (issue 16).
-- compatible-with-previous: yes
-- Immutable once landed, like every migration.
--
-- The problem. ready_rows_of(job_id) (0019) finds a lane-born job's ready
-- row by its position: lane_id and lane_seq come from the id, but the slot
-- does not, so the primary key (ready_slot, lane_id, lane_seq) of each ready
-- child is searched without its leading column. PostgreSQL 18 does that by a
-- skip scan (a few index pages per child). PostgreSQL 15 to 17 have no skip
-- scan and read each child's primary-key index whole: on PostgreSQL 15 with
-- 200,000 ready rows in one slot, one ready_rows_of read 772 buffers
-- (4.1 ms), against 8 for the form below. Every reader of a job by id goes
-- through it: App.get_job, App.wait and `awa-fast job show` (job_load_v3),
-- App.cancel (job_cancel), and the done checks of job_done_compact.
--
-- The fix (body only, rule 3 of docs/storage.md: same arguments, same rows).
-- The birth branch takes the ready slots from ring_slots and, for each,
-- probes that slot's child by its whole primary key. The probe is a LATERAL
-- subquery with LIMIT 1 (a position holds at most one row), which the planner
-- cannot flatten into a join: whatever the ring's statistics say when a
-- session makes its generic plan, the plan stays one lookup per slot, and
-- run-time pruning keeps each lookup to its one child. (As before, a child
-- whose statistics said empty when the plan was made may be read by a
-- sequential scan in that plan, unless the caller runs with sequential
-- scans off, as job_load_v3 does since 0029.)
-- The re-entered branch (partial ready_entries_job) is unchanged. Still an
-- SQL function without SET, so the planner inlines it into its callers.
--
-- Compatibility: the previous runtime calls the same functions, whose plans
-- are invalidated by the replacement and made again with this body.

CREATE OR REPLACE FUNCTION __SCHEMA__.ready_rows_of(p_job_id bigint) RETURNS SETOF __SCHEMA__.ready_entries
LANGUAGE sql STABLE AS $function$
    SELECT e.* FROM __SCHEMA__.ring_slots s
    CROSS JOIN LATERAL (
        SELECT x.* FROM __SCHEMA__.ready_entries x
        WHERE x.ready_slot = s.slot AND x.lane_id = (p_job_id >> 40)::int
          AND x.lane_seq = (p_job_id & 1099511627775) AND x.job_id = p_job_id
        LIMIT 1) e
    WHERE p_job_id >= 1099511627776 AND s.ring = 'ready'
    UNION ALL
    SELECT e.* FROM __SCHEMA__.ready_entries e
    WHERE e.job_id = p_job_id AND e.job_id <> ((e.lane_id::bigint << 40) | e.lane_seq)
$function$;
