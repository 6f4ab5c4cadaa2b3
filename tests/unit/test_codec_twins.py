"""The codec is described four times, and the descriptions must agree.

- the ``Codec`` Protocol in ``awa_fast/_impl.py``, the contract;
- the stub ``awa_fast/_codec.pyi``, read with ``ast``;
- the Cython sources ``cext/*.pyx``, from their ``def`` headers: the shape
  the next build will have, even when the installed extension is stale;
- the compiled module ``awa_fast._codec``, through ``inspect.signature``
  (Cython 3 compiles with ``binding=True``, so its functions carry real
  signatures);
- the Python twin ``awa_fast/_pycodec.py``, through ``inspect.signature``.

Each of the last four is compared with the Protocol: the public names
(``__all__``, the functions, the constants), and for every function its
parameters in order, with their kinds and defaults. The stub and the Python
twin also carry annotations, and those must match the Protocol's word for
word. A parameter added, dropped or renamed in any one of them fails here.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import pathlib
import re
from typing import Any

import pytest

import awa_fast
from awa_fast import _impl, _pycodec

PKG = pathlib.Path(awa_fast.__file__).resolve().parent
STUB = PKG / "_codec.pyi"
PYX_DIR = PKG.parent / "cext"

Param = tuple[str, str, str]  # name, kind, default ("" when there is none)


class Shape:
    """One description of the codec: its ``__all__``, constants and functions."""

    def __init__(self, all_names: list[str] | None, constants: dict[str, str | None],
                 functions: dict[str, list[Param]], annotations: dict[str, dict[str, str]] | None) -> None:
        self.all_names = all_names
        self.constants = constants  # name -> annotation (None where the source has none)
        self.functions = functions
        self.annotations = annotations  # function -> {param or "return": annotation}, None: not annotated

    @property
    def public(self) -> set[str]:
        return set(self.constants) | set(self.functions)


def _norm(annotation: str) -> str:
    return re.sub(r"\s+", "", annotation)


def _default_text(value: Any) -> str:
    return "" if value is inspect.Parameter.empty else repr(value)


def _from_signature(sig: inspect.Signature, drop_self: bool = False) -> tuple[list[Param], dict[str, str]]:
    params = list(sig.parameters.values())[1 if drop_self else 0:]
    out = [(p.name, p.kind.name, _default_text(p.default)) for p in params]
    ann = {p.name: _norm(str(p.annotation)) for p in params if p.annotation is not inspect.Parameter.empty}
    if sig.return_annotation is not inspect.Signature.empty:
        ann["return"] = _norm(str(sig.return_annotation))
    return out, ann


def _ast_default(node: ast.expr) -> str:
    try:
        return repr(ast.literal_eval(node))
    except ValueError:
        return ast.unparse(node)


def _from_ast(fn: ast.FunctionDef) -> tuple[list[Param], dict[str, str]]:
    a = fn.args
    positional = [(x, "POSITIONAL_ONLY") for x in a.posonlyargs] + [(x, "POSITIONAL_OR_KEYWORD") for x in a.args]
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    out: list[Param] = [(arg.arg, kind, _ast_default(d) if d is not None else "")
                        for (arg, kind), d in zip(positional, defaults)]
    everything = [arg for arg, _ in positional]
    if a.vararg:
        out.append((a.vararg.arg, "VAR_POSITIONAL", ""))
        everything.append(a.vararg)
    for arg, d in zip(a.kwonlyargs, a.kw_defaults):
        out.append((arg.arg, "KEYWORD_ONLY", _ast_default(d) if d is not None else ""))
        everything.append(arg)
    if a.kwarg:
        out.append((a.kwarg.arg, "VAR_KEYWORD", ""))
        everything.append(a.kwarg)
    ann = {arg.arg: _norm(ast.unparse(arg.annotation)) for arg in everything if arg.annotation is not None}
    if fn.returns is not None:
        ann["return"] = _norm(ast.unparse(fn.returns))
    return out, ann


def _literal_all(tree: ast.Module) -> list[str] | None:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    return None


def _public(name: str) -> bool:
    return not name.startswith("_")


@functools.cache
def protocol_shape() -> Shape:
    codec = _impl.Codec
    constants = {k: _norm(v if isinstance(v, str) else v.__name__)
                 for k, v in codec.__annotations__.items() if _public(k)}
    functions: dict[str, list[Param]] = {}
    annotations: dict[str, dict[str, str]] = {}
    for name, member in vars(codec).items():
        if _public(name) and inspect.isfunction(member):
            functions[name], annotations[name] = _from_signature(inspect.signature(member), drop_self=True)
    return Shape(None, constants, functions, annotations)


@functools.cache
def stub_shape() -> Shape:
    tree = ast.parse(STUB.read_text(encoding="utf-8"), filename=str(STUB))
    constants: dict[str, str | None] = {}
    functions: dict[str, list[Param]] = {}
    annotations: dict[str, dict[str, str]] = {}
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and _public(node.target.id):
            constants[node.target.id] = _norm(ast.unparse(node.annotation))
        elif isinstance(node, ast.FunctionDef) and _public(node.name):
            functions[node.name], annotations[node.name] = _from_ast(node)
    return Shape(_literal_all(tree), constants, functions, annotations)


_PYX_DEF = re.compile(r"^(?:cp)?def\s+(\w+)\s*\((.*?)\)\s*(?:->[^:]*)?:", re.M | re.S)
_PYX_CONST = re.compile(r"^([A-Z][A-Z0-9_]*)\s*=", re.M)
_PYX_ALL = re.compile(r"^__all__\s*=\s*(\[.*?\])", re.M | re.S)


def _pyx_param(text: str) -> str:
    """``int max_depth=32`` -> ``max_depth=32``: Cython's C type in front of a name is dropped."""
    head, eq, default = text.partition("=")
    words = head.split()
    return (words[-1] if words else head) + (eq + default if eq else "")


@functools.cache
def pyx_shape() -> Shape:
    sources = sorted(PYX_DIR.glob("*.pyx"))
    if not sources:
        pytest.skip(f"no Cython sources at {PYX_DIR} (an installed package, not a checkout)")
    constants: dict[str, str | None] = {}
    functions: dict[str, list[Param]] = {}
    all_names: list[str] | None = None
    for path in sources:
        text = path.read_text(encoding="utf-8")
        for m in _PYX_DEF.finditer(text):
            name, params = m.group(1), m.group(2)
            if not _public(name):
                continue
            cleaned = ", ".join(_pyx_param(p) for p in params.split(",") if p.strip())
            fn = ast.parse(f"def {name}({cleaned}): pass").body[0]
            assert isinstance(fn, ast.FunctionDef)
            functions[name], _ = _from_ast(fn)
        for m in _PYX_CONST.finditer(text):
            constants[m.group(1)] = None
        found = _PYX_ALL.search(text)
        if found:
            all_names = list(ast.literal_eval(found.group(1)))
    return Shape(all_names, constants, functions, None)


def _module_shape(mod: Any, annotated: bool) -> Shape:
    names = list(getattr(mod, "__all__", None) or [n for n in vars(mod) if _public(n)])
    constants: dict[str, str | None] = {}
    functions: dict[str, list[Param]] = {}
    annotations: dict[str, dict[str, str]] = {}
    for name in names:
        assert hasattr(mod, name), f"{mod.__name__}.__all__ names {name!r}, which it does not define"
        value = getattr(mod, name)
        if callable(value):
            functions[name], annotations[name] = _from_signature(inspect.signature(value))
        else:
            constants[name] = type(value).__name__
    return Shape(getattr(mod, "__all__", None), constants, functions, annotations if annotated else None)


@functools.cache
def compiled_shape() -> Shape:
    try:
        mod = importlib.import_module("awa_fast._codec")
    except ImportError as exc:
        pytest.skip(f"the C extension is not built: {exc}")
    return _module_shape(mod, annotated=False)


@functools.cache
def python_shape() -> Shape:
    return _module_shape(_pycodec, annotated=True)


SOURCES = {"stub": stub_shape, "pyx": pyx_shape, "compiled": compiled_shape, "python": python_shape}
FUNCTIONS = sorted(protocol_shape().functions)


def test_protocol_is_not_empty() -> None:
    # the comparisons below are only as good as the contract they compare with
    assert FUNCTIONS, "the Codec Protocol declares no functions"
    assert protocol_shape().constants, "the Codec Protocol declares no constants"


@pytest.mark.parametrize("source", SOURCES)
def test_public_names(source: str) -> None:
    shape, contract = SOURCES[source](), protocol_shape()
    missing, extra = contract.public - shape.public, shape.public - contract.public
    assert not missing and not extra, f"{source}: missing {sorted(missing)}, not in the Protocol {sorted(extra)}"
    if shape.all_names is not None:
        assert sorted(shape.all_names) == sorted(contract.public), f"{source}: __all__ differs from the Protocol"


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("function", FUNCTIONS)
def test_signature(source: str, function: str) -> None:
    shape, contract = SOURCES[source](), protocol_shape()
    assert function in shape.functions, f"{source} has no {function}"
    got, want = shape.functions[function], contract.functions[function]
    assert got == want, f"{source}.{function}: parameters (name, kind, default) {got} differ from the Protocol's {want}"


@pytest.mark.parametrize("source", ["stub", "python"])
@pytest.mark.parametrize("function", FUNCTIONS)
def test_annotations(source: str, function: str) -> None:
    shape, contract = SOURCES[source](), protocol_shape()
    assert shape.annotations is not None
    got, want = shape.annotations[function], contract.annotations[function]  # type: ignore[index]
    assert got == want, f"{source}.{function}: annotations {got} differ from the Protocol's {want}"


def test_constant_annotations() -> None:
    contract = protocol_shape().constants
    assert stub_shape().constants == contract, "the stub's constant annotations differ from the Protocol's"
    assert python_shape().constants == contract, "the Python twin's constant types differ from the Protocol's"


def test_constant_values() -> None:
    compiled = pytest.importorskip("awa_fast._codec")
    for name in protocol_shape().constants:
        assert getattr(compiled, name) == getattr(_pycodec, name), name


def test_pyx_parser_reads_typed_headers() -> None:
    # the .pyx functions are untyped today; a typed header must read the same
    fn = ast.parse("def f(" + ", ".join(_pyx_param(p) for p in "object obj, int max_depth=32".split(",")) + "): pass")  # noqa: SIM905
    assert _from_ast(fn.body[0])[0] == [  # type: ignore[arg-type]
        ("obj", "POSITIONAL_OR_KEYWORD", ""), ("max_depth", "POSITIONAL_OR_KEYWORD", "32")]
