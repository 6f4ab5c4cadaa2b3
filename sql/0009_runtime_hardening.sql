-- awa-fast: a default per-attempt deadline of one hour.
-- compatible-with-previous: yes
-- Immutable once landed, like every migration (rule: docs/storage.md,
-- "Migrations").
--
-- What changed: queue_meta.deadline defaults to one hour instead of NULL,
-- and every existing queue whose deadline is NULL gets that hour.
--
-- Why: with no deadline a hung handler that keeps heartbeating (a sync
-- handler blocked on a socket with no timeout, an await that never
-- returns) holds its job forever; nothing ever rescues it. One hour bounds
-- that while leaving ordinary long jobs alone. The deadline is fixed per
-- claim (lease_claims.deadline_at = claim time + deadline), so a change
-- applies to attempts claimed after it.
--
-- Existing rows: before this migration NULL was the column default, and
-- nothing but Storage.queue_configure(deadline=None) could set NULL on
-- purpose (no CLI, no documented API), where it only restated the default.
-- A NULL row cannot tell "never set" from "removed on purpose", so every
-- NULL row is treated as never set and gets the new default. An operator
-- who had removed the deadline on purpose removes it again after upgrading
-- with Storage.queue_configure(conn, queue, deadline=0) (0 or None: no
-- deadline, stored as NULL from now on). From this migration on NULL
-- always means "no deadline, chosen".
--
-- Cost: none on the hot path. The claim function already computes
-- now() + deadline for every receipt; rescue already tests deadline_at.
--
-- Previous runtimes: no function, table shape or named query changes, so a
-- runtime from before this migration keeps running against it unchanged
-- (its attempts just get the deadline too). Only its Storage.queue_configure
-- still stores deadline=0 as a zero interval (rescue at once) instead of "none".
-- Regenerate sql/schema.sql with tools/schema_dump.py in the same commit.
ALTER TABLE __SCHEMA__.queue_meta ALTER COLUMN deadline SET DEFAULT interval '1 hour';

UPDATE __SCHEMA__.queue_meta SET deadline = interval '1 hour' WHERE deadline IS NULL;

COMMENT ON COLUMN __SCHEMA__.queue_meta.deadline IS
    'per-attempt deadline from claim time; default 1 hour; NULL: none (set with deadline=0 or None)';
