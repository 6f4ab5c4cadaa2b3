"""Start a chaos cluster inside a private mount namespace that holds a small tmpfs.

    unshare -m --propagation private -- python -m tests.chaos.chaos_mountns DATADIR BINDIR MOUNTPOINT SIZE SETTINGS_JSON

Mounts a tmpfs of SIZE (e.g. ``24m``) on MOUNTPOINT, visible only in this
namespace, then starts PostgreSQL on DATADIR (pg_ctl daemonizes the
postmaster, which inherits the namespace and keeps it, and the tmpfs,
alive). Used by test_disk_full.py for a real ENOSPC on a tablespace; when
the server stops, the namespace and the tmpfs go away with it.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys


def main(argv: list[str]) -> int:
    datadir, bindir, mountpoint, size, settings = argv
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "chaos-tmpfs", mountpoint], check=True)
    from awa_fast.embedded import PostgresCluster

    PostgresCluster(pathlib.Path(datadir), pathlib.Path(bindir), settings=json.loads(settings)).start()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
