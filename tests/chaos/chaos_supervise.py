"""``awa-fast supervise`` with maintenance intervals the command line does not expose.

    python -m tests.chaos.chaos_supervise --rotate claim=1 --rotate ready=2 --prune-interval 0.5 \
        -- --log-level INFO supervise tests.chaos.chaos_app:app --schema S --dsn D ...

Everything after ``--`` goes to ``awa_fast.cli.main`` unchanged; the extra
settings are merged into the supervisor's ``maintenance_config`` (the
pinned-reader soak needs the ready ring to rotate in seconds, not the
default 30 s, to show reclaim within one rotation cycle in a short run).
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    from awa_fast import cli
    from awa_fast.runtime import supervisor as sup_mod

    rotate: dict[str, float] = {}
    extra: dict[str, object] = {}
    while argv and argv[0] != "--":
        opt = argv.pop(0)
        value = argv.pop(0)
        if opt == "--rotate":
            ring, _, secs = value.partition("=")
            rotate[ring] = float(secs)
        elif opt == "--prune-interval":
            extra["prune_interval"] = float(value)
        elif opt == "--promote-interval":
            extra["promote_interval"] = float(value)
        else:
            raise SystemExit(f"unknown option {opt}")
    if argv:
        argv.pop(0)
    if rotate:
        extra["rotate_intervals"] = {"claim": 1.0, "ready": 30.0, "lease": 30.0, **rotate}
    original = sup_mod.SupervisorConfig

    def config(*args: object, **kwargs: object) -> object:
        merged = dict(kwargs.get("maintenance_config") or {})  # type: ignore[call-overload]
        merged.update(extra)
        kwargs["maintenance_config"] = merged
        return original(*args, **kwargs)

    sup_mod.SupervisorConfig = config  # type: ignore[assignment,misc]
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
