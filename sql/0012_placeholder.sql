-- Placeholder for migration 0012, which another branch adds; p-enqueue needs 1..n numbering to
-- test its 0016. Delete this file when the real 0012 lands (merge of main).
-- compatible-with-previous: yes
SELECT 1;
