"""The package's import structure, measured from its source (benchmarks/import_structure.py; nothing imported):
no import circle, no module-level import from a lower layer into a higher one, and every function-local import of
dasspec's own modules says why it is one (``# optional: ...`` / ``# lazy: ...``).

dasspec/engine and dasspec/methods are held to the circle rule only where a circle reaches outside them (their
own structure is checked where they are refactored)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "import_structure.py"
EXEMPT = ("dasspec.engine", "dasspec.methods")


def _exempt(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in EXEMPT)


@pytest.fixture(scope="module")
def measure():
    spec = importlib.util.spec_from_file_location("import_structure", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod            # (dataclasses look their module up there)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def structure(measure):
    return measure.scan()


def test_the_scan_sees_the_package(structure):
    assert "dasspec.model.config" in structure.modules and "dasspec.serve.app" in structure.modules
    assert ("dasspec.model.layers", "dasspec.model.config") in structure.edges()


@pytest.mark.parametrize("scopes", [("module",), ("module", "function")], ids=["module-level", "with-function-local"])
def test_no_import_circle(structure, scopes):
    circles = [c for c in structure.circles(scopes) if not all(_exempt(m) for m in c)]
    assert not circles, f"import circles ({' + '.join(scopes)} imports): {circles}"


def test_no_upward_module_level_import(structure):
    upward = [f"{i.source} -> {i.target} (line {i.line})" for i in structure.upward() if not _exempt(i.source)]
    assert not upward, f"module-level imports into a higher layer: {upward}"


def test_function_local_imports_of_dasspec_say_why(structure):
    bare = [f"{i.source}:{i.line} -> {i.target}" for i in structure.function_local(own=True)
            if not i.commented and not _exempt(i.source)]
    assert not bare, ("function-local imports of dasspec's own modules without an '# optional:' / '# lazy:' comment "
                      f"(import at module level, or say why not): {bare}")


def test_the_measure_finds_a_circle_and_a_bare_local_import(measure, tmp_path):
    pkg = tmp_path / "dasspec"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import a\n")
    (pkg / "sub" / "a.py").write_text("from .b import x\n")
    (pkg / "sub" / "b.py").write_text("x = 1\n\ndef f():\n    from .a import y\n\n"
                                      "def g():\n    # lazy: a reason\n    from . import a\n    from .a import z\n")
    s = measure.scan(pkg)
    assert s.circles() == []
    assert s.circles(("module", "function")) == [["dasspec.sub.a", "dasspec.sub.b"]]
    assert [(i.line, i.commented) for i in s.function_local(own=True)] == [(4, False), (8, True), (9, True)]
