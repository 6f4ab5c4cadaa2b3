"""pyperf micro benchmarks of the codec: the C extension against its Python twin.

    python perf/micro_codec.py --fast -o codec.json     # rough numbers, JSON to compare later
    python perf/micro_codec.py --rigorous -o codec.json
    python perf/micro_codec.py --quick                  # tiny inputs, one value: proves it runs
    python -m pyperf compare_to old.json codec.json

Benchmarks come in pairs named ``<function>[c]`` / ``<function>[python]``:

* ``check_payload``        a typical 5-key job payload
* ``encode_ready_rows``    1024 payloads of ~100 bytes (bulk enqueue)
* ``encode_done_rows``     512 claim snapshots (completion flush)
* ``encode_closure_rows``  512 claim snapshots (completion flush)
* ``decode_snapshots``     1024 claim rows (claim result); the python twin is
  exactly ``[ClaimSnapshot(*row) for row in rows]``

The C pair is skipped (with a note) when the extension is not built. The
machine load and the implementations are printed and stored as metadata.
"""

from __future__ import annotations

import datetime as dt
import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pyperf
from quick import take_quick_flag

from awa_fast import _pycodec
from awa_fast.jobs import ClaimSnapshot

_codec: ModuleType | None
try:
    from awa_fast import _codec as _c_module
except ImportError as exc:  # pragma: no cover - depends on the install
    _codec = None
    _C_MISSING = str(exc)
else:
    _codec = _c_module
    _C_MISSING = ""

QUICK = take_quick_flag()

N_READY = 16 if QUICK else 1024
N_SNAPSHOTS = 8 if QUICK else 512
N_ROWS = 16 if QUICK else 1024

NOW = dt.datetime(2026, 11, 30, 12, 0, tzinfo=dt.UTC)
PAYLOAD = {
    "user_id": 123456,
    "email": "someone@example.com",
    "amount": 12.5,
    "tags": ["new", "eu"],
    "send": True,
}


def _payloads(n: int) -> list[bytes]:
    return [
        b'{"to":"user%07d@example.com","template":"welcome","locale":"en","n":%d,"send":true}' % (i, i)
        for i in range(n)
    ]


def _row(i: int) -> tuple[Any, ...]:
    return (
        (7 << 40) | (100_000 + i),  # job_id
        1,  # run_lease
        1,  # attempt
        25,  # max_attempts
        "default",  # queue
        "send_email",  # kind
        2,  # priority
        b'{"to":"user@example.com","n":1}',  # args
        None,  # metadata
        3,  # ready_slot
        7,  # lane_id
        100_000 + i,  # lane_seq
        4,  # claim_slot
        900_000 + i,  # claim_id
        NOW,  # created_at
        None,  # errors
        None,  # callback_result
    )


def _timer(fn: Callable[..., Any], *args: Any) -> Callable[[int], float]:
    def time_func(loops: int) -> float:
        it = range(loops)
        t0 = pyperf.perf_counter()
        for _ in it:
            fn(*args)
        return pyperf.perf_counter() - t0

    return time_func


def _loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return f.read().strip()
    except OSError:
        return ",".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    runner = pyperf.Runner()
    runner.metadata["loadavg"] = _loadavg()
    runner.metadata["awa_fast_impls"] = "c,python" if _codec is not None else "python"
    runner.metadata["quick"] = str(QUICK)
    args = runner.parse_args()
    if not args.worker:
        print(
            f"# load {runner.metadata['loadavg']}; cpus {os.cpu_count()}; "
            f"implementations: {runner.metadata['awa_fast_impls']}",
            flush=True,
        )
        if _codec is None:
            print(f"# C extension not built, C benchmarks skipped: {_C_MISSING}", flush=True)

    payloads = _payloads(N_READY)
    rows = [_row(i) for i in range(N_ROWS)]
    snapshots = [ClaimSnapshot(*_row(i)) for i in range(N_SNAPSHOTS)]
    impls: list[tuple[str, ModuleType]] = [("c", _codec)] if _codec is not None else []
    impls.append(("python", _pycodec))

    for name, mod in impls:
        runner.bench_time_func(f"check_payload[{name}]", _timer(mod.check_payload, PAYLOAD))
    for name, mod in impls:
        runner.bench_time_func(
            f"encode_ready_rows[{name}]",
            _timer(mod.encode_ready_rows, 3, 7, 100_000, "send_email", payloads, None, 0, 25),
        )
    for name, mod in impls:
        runner.bench_time_func(f"encode_done_rows[{name}]", _timer(mod.encode_done_rows, snapshots))
    for name, mod in impls:
        runner.bench_time_func(f"encode_closure_rows[{name}]", _timer(mod.encode_closure_rows, snapshots, 1))
    for name, mod in impls:
        runner.bench_time_func(f"decode_snapshots[{name}]", _timer(mod.decode_snapshots, rows))


if __name__ == "__main__":
    main()
