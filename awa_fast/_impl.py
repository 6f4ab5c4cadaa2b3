"""The one place that picks the codec implementation: compiled C or pure Python.

``AWA_FAST_IMPL`` chooses:

* unset (or empty): the C extension ``awa_fast._codec`` if it imports, else the
  pure-Python twin ``awa_fast._pycodec``, with one warning on the
  ``awa_fast`` logger saying so;
* ``c``: the C extension, or :class:`~awa_fast.errors.ImplementationUnavailable`
  if it is not there (never a silent fallback);
* ``python``: the pure-Python twin (the C extension is not even imported);
* anything else: :class:`~awa_fast.errors.ConfigError`.

``IMPL`` says which one is live (``awa_fast.__impl__`` repeats it); the codec
functions are bound here from the chosen module, so callers import them from
this module and never from ``_codec``/``_pycodec`` directly.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from types import ModuleType
from typing import Any, Protocol, cast

from awa_fast.errors import ConfigError, ImplementationUnavailable
from awa_fast.jobs import AttemptClosed, ClaimSnapshot, Job

__all__ = [
    "IMPL",
    "Codec",
    "check_payload",
    "claim_summary",
    "decode_snapshots",
    "dump_payloads",
    "encode_closure_rows",
    "encode_done_rows",
    "encode_ready_rows",
    "flush_tally",
    "new_jobs",
    "raw_jsonb",
]

ENV_VAR = "AWA_FAST_IMPL"
_CHOICES = ("c", "python")

_log = logging.getLogger("awa_fast")


class Codec(Protocol):
    """What ``awa_fast._codec`` and ``awa_fast._pycodec`` both provide."""

    COPY_HEADER: bytes
    COPY_TRAILER: bytes
    MAX_DEPTH_LIMIT: int

    def check_payload(self, obj: object, max_depth: int = 32) -> None: ...

    def dump_payloads(self, objs: list[Any], start: int, out: list[bytes], max_depth: int, limit: int,
                      dumps: Callable[[Any], Any]) -> int: ...

    def encode_ready_rows(
        self,
        ready_slot: int,
        lane_id: int,
        first_seq: int,
        kind: str,
        payloads: Sequence[bytes],
        metadata: bytes | None,
        attempt: int,
        max_attempts: int,
    ) -> bytes: ...

    def encode_done_rows(self, snapshots: Sequence[ClaimSnapshot]) -> bytes: ...

    def encode_closure_rows(self, snapshots: Sequence[ClaimSnapshot], outcome: int) -> bytes: ...

    def decode_snapshots(self, rows: Iterable[Sequence[Any]]) -> list[ClaimSnapshot]: ...

    def new_jobs(self, snapshots: Sequence[ClaimSnapshot], args_types: dict[str, type | None],
                 runtime: Any) -> list[Job[Any]]: ...

    def flush_tally(self, pairs: Sequence[tuple[Job[Any], Any]], stale: set[tuple[int, int]], offset: float,
                    committed: float, closed: list[AttemptClosed] | None,
                    ) -> tuple[list[tuple[int, int]], int, dict[str, int], list[float], list[float], list[float]]: ...

    def raw_jsonb(self, data: bytes | bytearray | memoryview) -> bytes: ...

    def claim_summary(self, snapshots: Iterable[ClaimSnapshot]) -> tuple[dict[int, int], set[str]]: ...


def _load_c() -> ModuleType:
    # import_module, not "from awa_fast import _codec": during the package's own
    # import that form reports a missing extension as a circular import
    return importlib.import_module("awa_fast._codec")


def _select() -> tuple[str, ModuleType]:
    wanted = os.environ.get(ENV_VAR, "").strip()
    if wanted not in ("", *_CHOICES):
        raise ConfigError(f"{ENV_VAR}={wanted!r} is not valid; use one of: c, python (or leave it unset)")
    if wanted == "python":
        from awa_fast import _pycodec

        return "python", _pycodec
    try:
        return "c", _load_c()
    except ImportError as exc:
        if wanted == "c":
            raise ImplementationUnavailable(
                f"{ENV_VAR}=c but the compiled extension awa_fast._codec cannot be imported ({exc}); "
                "reinstall awa-fast where a C compiler and the Python headers are available "
                "(pip install --force-reinstall --no-cache-dir awa-fast, without AWA_FAST_NO_EXT), "
                f"or set {ENV_VAR}=python to run on the pure-Python implementation"
            ) from exc
        from awa_fast import _pycodec

        _log.warning(
            "awa_fast: the C extension awa_fast._codec is not available (%s); using the slower "
            "pure-Python implementation. Reinstall with a C compiler to get it, or set "
            "%s=python to silence this warning.",
            exc,
            ENV_VAR,
            extra={"action": "impl_fallback"},
        )
        return "python", _pycodec


IMPL: str
_module: ModuleType
IMPL, _module = _select()
_codec_api = cast(Codec, _module)

check_payload = _codec_api.check_payload
dump_payloads = _codec_api.dump_payloads
encode_ready_rows = _codec_api.encode_ready_rows
encode_done_rows = _codec_api.encode_done_rows
encode_closure_rows = _codec_api.encode_closure_rows
decode_snapshots = _codec_api.decode_snapshots
new_jobs = _codec_api.new_jobs
flush_tally = _codec_api.flush_tally
raw_jsonb = _codec_api.raw_jsonb
claim_summary = _codec_api.claim_summary
