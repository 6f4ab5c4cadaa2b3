-- awa-fast queue storage engine, version 1.
-- Follows Awa ADR-019 (queue plane, lease ring, lane heads) with the ADR-023
-- receipt plane (lease_claims + closures, reclaimed by ring rotation).
--
-- __SCHEMA__ is replaced by the migrator with the validated, quoted schema
-- identifier; it is the only template token. Ring children are created by
-- ring_install() with the slot counts chosen at install time.
-- Immutable once landed: change behaviour in a new numbered migration.

CREATE SCHEMA IF NOT EXISTS __SCHEMA__;

---------------------------------------------------------------------------
-- Control plane
---------------------------------------------------------------------------

-- Slot count per ring, fixed at install.
CREATE TABLE __SCHEMA__.ring_config (
    ring        text PRIMARY KEY CHECK (ring IN ('ready', 'claim', 'lease')),
    slot_count  int  NOT NULL CHECK (slot_count BETWEEN 4 AND 64)
);

-- Append-only rotation ledger: the current slot of a ring is its row with
-- the highest generation. Rotation inserts; nothing is updated, so a pinned
-- reader cannot make it bloat. Old generations are trimmed by the leader.
CREATE TABLE __SCHEMA__.ring_rotations (
    ring        text        NOT NULL,
    generation  bigint      NOT NULL,
    slot        int         NOT NULL,
    rotated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (ring, generation)
);

-- One row per ring slot: the lock target that prune takes FOR UPDATE.
CREATE TABLE __SCHEMA__.ring_slots (
    ring  text NOT NULL,
    slot  int  NOT NULL,
    PRIMARY KEY (ring, slot)
);

-- Per-queue settings. Cold: updated only by operators (pause, tuning).
CREATE TABLE __SCHEMA__.queue_meta (
    queue              text PRIMARY KEY,
    paused             boolean  NOT NULL DEFAULT false,
    stripes            int      NOT NULL DEFAULT 1 CHECK (stripes BETWEEN 1 AND 64),
    enqueue_shards     int      NOT NULL DEFAULT 8 CHECK (enqueue_shards BETWEEN 1 AND 64),
    dlq_enabled        boolean  NOT NULL DEFAULT true,
    deadline           interval,                                  -- NULL: no per-attempt deadline
    heartbeat_timeout  interval NOT NULL DEFAULT interval '30 seconds',
    aging_interval     interval NOT NULL DEFAULT interval '60 seconds',
    dlq_retention      interval NOT NULL DEFAULT interval '14 days',
    created_at         timestamptz NOT NULL DEFAULT now()
);

-- Stable lane identity: a lane is (queue, priority, shard). Never updated.
CREATE TABLE __SCHEMA__.queue_lanes (
    lane_id     int GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    queue       text     NOT NULL,
    priority    smallint NOT NULL CHECK (priority BETWEEN 1 AND 4),
    shard       smallint NOT NULL CHECK (shard BETWEEN 0 AND 63),
    created_at  timestamptz NOT NULL DEFAULT now(),
    UNIQUE (queue, priority, shard)
);

-- Enqueue heads: the lane's enqueue cursor is the sequence enqueue_seq.
-- Ranges are reserved under a transaction-scoped advisory lock on the lane,
-- so a later range never becomes visible while an earlier one may commit.
CREATE TABLE __SCHEMA__.queue_enqueue_heads (
    lane_id      int      PRIMARY KEY REFERENCES __SCHEMA__.queue_lanes,
    queue        text     NOT NULL,
    priority     smallint NOT NULL,
    shard        smallint NOT NULL,
    enqueue_seq  regclass NOT NULL,
    UNIQUE (queue, priority, shard)
);

-- Claim heads: the row is locked FOR UPDATE SKIP LOCKED by a claim; the
-- cursor itself lives in the sequence claim_seq (last_value = highest spent
-- lane_seq), so advancing it writes no tuple.
CREATE TABLE __SCHEMA__.queue_claim_heads (
    lane_id    int      PRIMARY KEY REFERENCES __SCHEMA__.queue_lanes,
    queue      text     NOT NULL,
    priority   smallint NOT NULL,
    shard      smallint NOT NULL,
    claim_seq  regclass NOT NULL
);
CREATE INDEX queue_claim_heads_queue ON __SCHEMA__.queue_claim_heads (queue, priority, shard);

-- Receipt ids and deferred-born job ids. Lane-born job ids are
-- (lane_id << 40) | lane_seq, always >= 2^40, so the two never collide.
CREATE SEQUENCE __SCHEMA__.claim_id_seq;
CREATE SEQUENCE __SCHEMA__.job_id_seq MAXVALUE 1099511627775;

-- Completed-history rollups written by ready prune (cold; one row per
-- queue and terminal state) so exact counts survive TRUNCATE.
CREATE TABLE __SCHEMA__.queue_terminal_rollups (
    queue  text     NOT NULL,
    state  smallint NOT NULL,
    count  bigint   NOT NULL,
    PRIMARY KEY (queue, state)
);

---------------------------------------------------------------------------
-- Queue plane: LIST-partitioned by ready_slot, truncated a slot at a time.
---------------------------------------------------------------------------

-- Immutable runnable rows. Narrow: queue and priority come from the lane.
-- attempt = attempts consumed before this row; the claim returns attempt+1
-- and run_lease = lease_base + 1 (so a claim increments run_lease without
-- rewriting anything).
CREATE TABLE __SCHEMA__.ready_entries (
    ready_slot       smallint    NOT NULL,
    lane_id          int         NOT NULL,
    lane_seq         bigint      NOT NULL,
    job_id           bigint      NOT NULL,
    kind             text        NOT NULL,
    args             jsonb       NOT NULL,
    metadata         jsonb,
    attempt          smallint    NOT NULL DEFAULT 0,
    max_attempts     smallint    NOT NULL,
    lease_base       int         NOT NULL DEFAULT 0,
    created_at       timestamptz NOT NULL DEFAULT now(),
    ready_at         timestamptz NOT NULL DEFAULT now(),
    errors           jsonb,
    callback_result  jsonb,
    PRIMARY KEY (ready_slot, lane_id, lane_seq)
) PARTITION BY LIST (ready_slot);
-- load_job / cancel find a job by id (one probe per child).
CREATE INDEX ready_entries_job ON __SCHEMA__.ready_entries (job_id);

-- Compact map of committed lane ranges to their slot: claim resolves the
-- slot holding the next rows of a lane here, and ready prune proves a slot
-- has nothing left at or ahead of a lane cursor from it.
CREATE TABLE __SCHEMA__.ready_segments (
    ready_slot  smallint    NOT NULL,
    lane_id     int         NOT NULL,
    first_seq   bigint      NOT NULL,
    last_seq    bigint      NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (ready_slot, lane_id, first_seq)
) PARTITION BY LIST (ready_slot);
CREATE INDEX ready_segments_lane ON __SCHEMA__.ready_segments (lane_id, last_seq);

-- "Do not claim" evidence for unclaimed ready rows (cancel). Claim treats a
-- tombstoned row as spent; it goes away with its ready slot.
CREATE TABLE __SCHEMA__.ready_tombstones (
    ready_slot  smallint    NOT NULL,
    lane_id     int         NOT NULL,
    lane_seq    bigint      NOT NULL,
    job_id      bigint      NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (ready_slot, lane_id, lane_seq)
) PARTITION BY LIST (ready_slot);

-- Terminal history, appended by completion (binary COPY from the claim
-- snapshot) in the ready slot of the job's last ready row, whose body it
-- references by (lane_id, lane_seq); args is filled only where no ready
-- row holds the body (e.g. a cancelled deferred job).
-- state: 1 completed, 2 failed, 3 cancelled.
CREATE TABLE __SCHEMA__.done_entries (
    ready_slot   smallint    NOT NULL,
    job_id       bigint      NOT NULL,
    lane_id      int,
    lane_seq     bigint,
    run_lease    int         NOT NULL,
    attempt      smallint    NOT NULL,
    state        smallint    NOT NULL CHECK (state BETWEEN 1 AND 3),
    queue        text        NOT NULL,
    kind         text        NOT NULL,
    error        text,
    args         jsonb,
    metadata     jsonb,
    finished_at  timestamptz NOT NULL DEFAULT now()
) PARTITION BY LIST (ready_slot);
CREATE INDEX done_entries_job ON __SCHEMA__.done_entries (job_id);

---------------------------------------------------------------------------
-- Claim (receipt) plane: LIST-partitioned by claim_slot, rotated fast.
-- "Currently open" = receipt jobs anti-joined with closure evidence.
---------------------------------------------------------------------------

-- One receipt per claim of one lane range in one ready slot. It covers
-- lane_seq (first_seq-1, last_seq]: every row there is claimed by it or was
-- tombstoned. Arrays keep the receipt one row however large the batch.
CREATE TABLE __SCHEMA__.lease_claims (
    claim_slot   smallint    NOT NULL,
    claim_id     bigint      NOT NULL,
    lane_id      int         NOT NULL,
    ready_slot   smallint    NOT NULL,
    first_seq    bigint      NOT NULL,
    last_seq     bigint      NOT NULL,
    job_ids      bigint[]    NOT NULL,
    run_leases   int[]       NOT NULL,
    lane_seqs    bigint[]    NOT NULL,
    claimed_at   timestamptz NOT NULL DEFAULT now(),
    deadline_at  timestamptz,
    PRIMARY KEY (claim_slot, claim_id)
) PARTITION BY LIST (claim_slot);
-- Claim advances a lagging cursor across committed receipts with it.
CREATE INDEX lease_claims_lane ON __SCHEMA__.lease_claims (lane_id, last_seq);

-- Per-attempt closure evidence. The primary key is the per-attempt guard:
-- a second closure of the same (job_id, run_lease) conflicts (an attempt
-- belongs to exactly one receipt); leading with claim_id it also finds a
-- receipt's closures for the completion guard.
-- outcome: 1 completed 2 failed 3 cancelled 4 retried 5 snoozed 6 dlq
--          7 rescued 8 materialized (moved to the lease plane)
CREATE TABLE __SCHEMA__.lease_claim_closures (
    claim_slot  smallint    NOT NULL,
    claim_id    bigint      NOT NULL,
    job_id      bigint      NOT NULL,
    run_lease   int         NOT NULL,
    outcome     smallint    NOT NULL,
    closed_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (claim_slot, claim_id, job_id, run_lease)
) PARTITION BY LIST (claim_slot);

-- Compact closure of a whole receipt (every job completed in one flush).
CREATE TABLE __SCHEMA__.lease_claim_closure_batches (
    claim_slot  smallint    NOT NULL,
    claim_id    bigint      NOT NULL,
    outcome     smallint    NOT NULL,
    closed_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (claim_slot, claim_id)
) PARTITION BY LIST (claim_slot);

---------------------------------------------------------------------------
-- Execution plane: created lazily, only when an attempt needs mutable state.
---------------------------------------------------------------------------

-- Materialized attempts (callback wait). LIST-partitioned by lease_slot and
-- rotated; an emptied sealed slot is truncated to drop its dead tuples.
CREATE TABLE __SCHEMA__.leases (
    lease_slot           smallint    NOT NULL,
    job_id               bigint      NOT NULL,
    run_lease            int         NOT NULL,
    claim_slot           smallint    NOT NULL,
    claim_id             bigint      NOT NULL,
    ready_slot           smallint    NOT NULL,
    lane_id              int         NOT NULL,
    lane_seq             bigint      NOT NULL,
    queue                text        NOT NULL,
    kind                 text        NOT NULL,
    attempt              smallint    NOT NULL,
    max_attempts         smallint    NOT NULL,
    callback_token       uuid        NOT NULL,
    callback_timeout_at  timestamptz NOT NULL,
    heartbeat_at         timestamptz NOT NULL DEFAULT now(),
    created_at           timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (lease_slot, job_id, run_lease)
) PARTITION BY LIST (lease_slot);
CREATE INDEX leases_token ON __SCHEMA__.leases (callback_token);
CREATE INDEX leases_job ON __SCHEMA__.leases (job_id);

-- Mutable per-attempt state, created on first heartbeat, progress or cancel
-- request, deleted when the attempt ends. Short jobs never touch it.
CREATE TABLE __SCHEMA__.attempt_state (
    job_id            bigint      NOT NULL,
    run_lease         int         NOT NULL,
    claim_slot        smallint,
    claim_id          bigint,
    heartbeat_at      timestamptz,
    progress          jsonb,
    cancel_requested  boolean     NOT NULL DEFAULT false,
    updated_at        timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (job_id, run_lease)
);

---------------------------------------------------------------------------
-- Backlog and hold tables (plain).
---------------------------------------------------------------------------

-- Scheduled (state 1), retryable (2) and snoozed (3) jobs; promoted back
-- into ready_entries by the leader when due.
CREATE TABLE __SCHEMA__.deferred_jobs (
    job_id           bigint      PRIMARY KEY,
    queue            text        NOT NULL,
    priority         smallint    NOT NULL,
    kind             text        NOT NULL,
    args             jsonb       NOT NULL,
    metadata         jsonb,
    attempt          smallint    NOT NULL,
    max_attempts     smallint    NOT NULL,
    lease_base       int         NOT NULL,
    state            smallint    NOT NULL CHECK (state BETWEEN 1 AND 3),
    run_at           timestamptz NOT NULL,
    created_at       timestamptz NOT NULL,
    errors           jsonb,
    callback_result  jsonb
);
CREATE INDEX deferred_jobs_due ON __SCHEMA__.deferred_jobs (run_at);

CREATE TABLE __SCHEMA__.dlq_entries (
    job_id        bigint      PRIMARY KEY,
    queue         text        NOT NULL,
    priority      smallint    NOT NULL,
    kind          text        NOT NULL,
    args          jsonb       NOT NULL,
    metadata      jsonb,
    attempt       smallint    NOT NULL,
    max_attempts  smallint    NOT NULL,
    lease_base    int         NOT NULL,
    errors        jsonb,
    reason        text        NOT NULL,
    created_at    timestamptz NOT NULL,
    failed_at     timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX dlq_entries_queue ON __SCHEMA__.dlq_entries (queue, failed_at);
