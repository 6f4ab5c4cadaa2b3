-- awa-fast schema compatibility ledger, for rolling upgrades.
-- compatible-with-previous: yes
-- Immutable once landed, like every migration.
--
-- Every migration from 0005 on declares in its header, on a line of its
-- own, whether the previous release's runtime may keep running against the
-- schema it produces:
--     -- compatible-with-previous: yes     (additive: new tables, columns with
--                                          defaults, new versioned functions)
--     -- compatible-with-previous: no      (anything an older runtime would
--                                          misread, miss or break on)
-- The migrator records each migration's flag here (awa_fast.storage.compat),
-- because an older runtime does not ship the newer files: it reads this table
-- to decide whether a schema newer than itself is one it may run against
-- (every migration past its own version flagged yes) or SchemaTooNew.
-- Migrations 1-4 predate the declaration and have no row; 5-7 declare it
-- and are recorded when this one is applied. No runtime that reads this
-- table is older than version 8.
-- One narrow row per migration, written once: never updated.
CREATE TABLE __SCHEMA__.schema_compat (
    version                   int PRIMARY KEY,
    compatible_with_previous  boolean     NOT NULL,
    recorded_at               timestamptz NOT NULL DEFAULT now()
);
