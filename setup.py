"""Build logic for awa-fast's optional C extension; the metadata is in pyproject.toml.

``awa_fast._codec`` is compiled from ``cext/codec.pyx`` with Cython (a build
requirement only: nothing needs Cython at run time). It is optional, in the
asyncpg/msgspec style: without Cython or a working C compiler the install
still succeeds on the pure-Python twin ``awa_fast._pycodec`` and prints a
warning saying so (``awa_fast._impl`` warns again at import).

Environment knobs:

``AWA_FAST_NO_EXT=1``       do not build the extension (pure-Python install).
``AWA_FAST_REQUIRE_EXT=1``  fail the install if the extension cannot be built
                            (CI sets it, so a broken build cannot hide).
``AWA_FAST_DEBUG_EXT=1``    build with ``-O0 -g`` and Cython bounds checks on.
"""

from __future__ import annotations

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CCompilerError, CompileError, ExecError, PlatformError

BUILD_ERRORS = (CCompilerError, CompileError, ExecError, PlatformError, OSError)


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


NO_EXT = _env_flag("AWA_FAST_NO_EXT")
REQUIRE_EXT = _env_flag("AWA_FAST_REQUIRE_EXT")
DEBUG_EXT = _env_flag("AWA_FAST_DEBUG_EXT")

if NO_EXT and REQUIRE_EXT:
    sys.exit("AWA_FAST_NO_EXT=1 and AWA_FAST_REQUIRE_EXT=1 contradict each other; unset one")


def _warn_pure_python(reason: str) -> None:
    bar = "*" * 78
    print(
        f"\n{bar}\n"
        "WARNING: awa-fast is being installed WITHOUT its C extension (awa_fast._codec).\n"
        f"Reason: {reason}\n"
        "It will run on the pure-Python implementation, which is slower. To get the\n"
        "extension, install a C compiler and the Python headers (e.g. gcc and\n"
        "python3-dev), unset AWA_FAST_NO_EXT, and reinstall:\n"
        "    pip install --force-reinstall --no-cache-dir awa-fast\n"
        f"{bar}\n",
        file=sys.stderr,
        flush=True,
    )


class OptionalBuildExt(build_ext):
    """build_ext that cythonizes late and falls back to pure Python on failure."""

    _cythonized = False

    def finalize_options(self) -> None:
        if self.distribution.ext_modules and not self._cythonized:
            self._cythonized = True
            self.distribution.ext_modules = self._cythonize(self.distribution.ext_modules)
        super().finalize_options()

    def _cythonize(self, extensions: list[Extension]) -> list[Extension]:
        try:
            from Cython.Build import cythonize
        except ImportError as exc:
            return self._give_up(f"Cython is not installed ({exc})")
        directives = {
            "language_level": 3,
            "boundscheck": DEBUG_EXT,
            "wraparound": False,
            "cdivision": not DEBUG_EXT,
            "initializedcheck": DEBUG_EXT,
            "embedsignature": True,
        }
        try:
            return cythonize(
                extensions,
                compiler_directives=directives,
                build_dir=os.path.join("build", "cython"),
                quiet=True,
            )
        except Exception as exc:  # Cython raises plain Exception subclasses on bad sources
            return self._give_up(f"Cython could not translate cext/codec.pyx ({exc})")

    def build_extensions(self) -> None:
        msvc = self.compiler.compiler_type == "msvc"
        release, debug = (["/O2"], ["/Od", "/Zi"]) if msvc else (["-O2"], ["-O0", "-g"])
        flags = debug if DEBUG_EXT else release
        for ext in self.extensions:
            ext.extra_compile_args = [*ext.extra_compile_args, *flags]
        super().build_extensions()

    def run(self) -> None:
        try:
            super().run()
        except BUILD_ERRORS as exc:
            self._give_up(f"no working C compiler ({exc})")

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except BUILD_ERRORS as exc:
            self._give_up(f"compiling {ext.name} failed ({exc})")

    def _give_up(self, reason: str) -> list[Extension]:
        if REQUIRE_EXT:
            raise RuntimeError(f"AWA_FAST_REQUIRE_EXT=1 but the C extension cannot be built: {reason}")
        _warn_pure_python(reason)
        return []


if NO_EXT:
    _warn_pure_python("AWA_FAST_NO_EXT=1 is set")
    EXTENSIONS: list[Extension] = []
else:
    EXTENSIONS = [
        Extension(
            "awa_fast._codec",
            sources=["cext/codec.pyx"],
            depends=[
                os.path.join("cext", name)
                for name in sorted(os.listdir("cext"))
                if name.endswith((".pyx", ".pxd"))
            ]
            if os.path.isdir("cext")
            else [],
        )
    ]

setup(ext_modules=EXTENSIONS, cmdclass={"build_ext": OptionalBuildExt})
