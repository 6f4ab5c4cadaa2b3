#!/usr/bin/env python3
"""Set up and run awa-fast on a fresh machine, with the standard library only.

    python3 tools/dev.py demo     # the main job, on the embedded PostgreSQL
    python3 tools/dev.py test     # the whole test suite under each implementation (C and Python, at once)
    python3 tools/dev.py setup    # only create .venv and install
    python3 tools/dev.py lint     # ruff on the checkout, mypy --strict on the package

It creates ``.venv`` beside this checkout (with ``venv``, or ``virtualenv``
where ``venv`` is missing), installs the package in editable mode with the
extras it needs (psycopg's C implementation built against the system libpq
when ``pg_config`` and the libpq headers exist, the prebuilt binary wheel
otherwise), and runs. Re-running skips the install when nothing changed.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"
PY = VENV / "bin" / "python"
STAMP = VENV / ".awa-fast-install"
IMPLEMENTATIONS = ("c", "python")  # the C extension, then the pure-Python twin


def run(cmd: list[str], **kw: object) -> int:
    print("+ " + " ".join(str(c) for c in cmd), flush=True)
    return subprocess.call([str(c) for c in cmd], **kw)  # type: ignore[arg-type]


def check(cmd: list[str], **kw: object) -> None:
    code = run(cmd, **kw)
    if code != 0:
        sys.exit(f"dev.py: command failed with exit code {code}: {' '.join(str(c) for c in cmd)}")


def has_libpq_headers() -> bool:
    pg_config = shutil.which("pg_config")
    if not pg_config:
        return False
    try:
        inc = subprocess.run([pg_config, "--includedir"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return False
    return (Path(inc) / "libpq-fe.h").exists()


def make_venv() -> None:
    if PY.exists():
        return
    print(f"dev.py: creating {VENV}", flush=True)
    if run([sys.executable, "-m", "venv", VENV]) != 0 or not PY.exists():
        shutil.rmtree(VENV, ignore_errors=True)
        print("dev.py: the venv module is unavailable; trying virtualenv", flush=True)
        if run([sys.executable, "-m", "virtualenv", "--version"]) != 0:
            check([sys.executable, "-m", "pip", "install", "--user", "virtualenv"])
        check([sys.executable, "-m", "virtualenv", VENV])


def install_fingerprint(psycopg_extra: str) -> str:
    h = hashlib.sha256(psycopg_extra.encode())
    for rel in ("pyproject.toml", "setup.py"):
        h.update((ROOT / rel).read_bytes())
    for path in sorted((ROOT / "cext").glob("*.p*")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def install() -> None:
    make_venv()
    extra = "c" if has_libpq_headers() else "binary"
    fingerprint = install_fingerprint(extra)
    if STAMP.exists() and STAMP.read_text() == fingerprint:
        return
    check([PY, "-m", "pip", "install", "--quiet", "--upgrade", "pip", "setuptools", "wheel", "Cython>=3.0"])
    # psycopg[c] compiles against the system libpq (pg_config); [binary] needs nothing.
    pip_env = dict(os.environ)
    if os.environ.get("CI"):
        pip_env["AWA_FAST_REQUIRE_EXT"] = "1"  # a broken extension build must fail CI, not fall back
    extras = f".[{extra},test,lint,perf,metrics,web,browser-test,cron,otel,proctitle]"
    print(f"dev.py: installing awa-fast{extras[1:]} into {VENV} (the first run takes a few minutes: it builds the "
          "Cython extension" + (" and psycopg's C implementation" if extra == "c" else "") + "; pip shows each step)",
          flush=True)
    # No --quiet: a cold install is long, and a silent one looks hung.
    check([PY, "-m", "pip", "install", "--progress-bar", "off", "-e", extras], cwd=ROOT, env=pip_env)
    code = subprocess.run([PY, "-c", "import psycopg, awa_fast; print(psycopg.pq.__impl__, awa_fast.__impl__)"],
                          capture_output=True, text=True, cwd="/")
    print(f"dev.py: installed (psycopg implementation, awa_fast implementation): {code.stdout.strip()}",
          flush=True)
    if code.returncode != 0:
        sys.exit(f"dev.py: the installed package does not import:\n{code.stderr}")
    STAMP.write_text(fingerprint)


def env_without_venv_leaks() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


class _Pass:
    """One pytest session of the default run, its output copied to ours behind ``[impl] ``."""

    def __init__(self, impl: str, cmd: list[str], env: dict[str, str]) -> None:
        self.impl = impl
        self.started = time.monotonic()
        self.seconds = 0.0
        self.last = "(no output)"
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, text=True, bufsize=1, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT)
        self.reader = threading.Thread(target=self._copy, name=f"dev.py [{impl}]", daemon=True)
        self.reader.start()

    def _copy(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:  # whole lines, so the two passes interleave line by line only
            print(f"[{self.impl}] {line}", end="", flush=True)
            if line.strip():
                self.last = line.strip()
        self.proc.wait()
        self.seconds = time.monotonic() - self.started

    def wait(self) -> int:
        self.reader.join()
        return self.proc.wait()


def cmd_test(extra: list[str]) -> int:
    env = env_without_venv_leaks()
    if extra:
        return run([PY, "-m", "pytest", *extra], cwd=ROOT, env=env)
    # The whole default suite once per implementation (see docs/testing.md, "The Python twin"): every
    # test, so a new test file can never drop out of the twin's pass. The two passes run at the same
    # time, each its own pytest session with its own PostgreSQL and temporary directories: one pass
    # alone leaves most of two cores idle (it waits on heartbeats, timers and subprocesses), so the
    # pair finishes in little more than the time of one (docs/testing.md, "How the suite runs").
    cmd = [str(PY), "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    passes: list[_Pass] = []
    try:
        for impl in IMPLEMENTATIONS:
            print(f"dev.py: the test suite with AWA_FAST_IMPL={impl}, its lines behind [{impl}]", flush=True)
            print("+ " + " ".join(cmd), flush=True)
            passes.append(_Pass(impl, cmd, dict(env, AWA_FAST_IMPL=impl, PYTHONUNBUFFERED="1")))
        codes = [p.wait() for p in passes]
    except KeyboardInterrupt:
        for p in passes:
            if p.proc.poll() is None:
                p.proc.send_signal(signal.SIGINT)
        for p in passes:
            p.proc.wait()
        raise
    for p, code in zip(passes, codes, strict=True):
        print(f"dev.py: AWA_FAST_IMPL={p.impl}: exit {code} after {p.seconds:.0f} s: {p.last}", flush=True)
    return next((code for code in codes if code), 0)


def cmd_lint(extra: list[str]) -> int:
    """``ruff check .`` and ``mypy`` (the package, strict), both configured in pyproject.toml.

    Both run even when the first fails, so one run lists every error; non-zero when either found one.
    Extra arguments go to ruff (``lint --statistics``).
    """
    env = env_without_venv_leaks()
    ruff = run([PY, "-m", "ruff", "check", *extra, "."], cwd=ROOT, env=env)
    mypy = run([PY, "-m", "mypy"], cwd=ROOT, env=env)
    if ruff or mypy:
        print(f"dev.py: lint failed (ruff exit {ruff}, mypy exit {mypy})", flush=True)
        return 1
    return 0


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("demo", "test", "setup", "lint"):
        print(__doc__)
        return 2
    install()
    if argv[0] == "setup":
        return 0
    if argv[0] == "demo":
        return run([PY, "-m", "awa_fast.demo", *argv[1:]], cwd=ROOT, env=env_without_venv_leaks())
    if argv[0] == "lint":
        return cmd_lint(argv[1:])
    return cmd_test(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
