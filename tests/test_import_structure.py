"""The package's import structure, measured from its source (benchmarks/import_structure.py; nothing imported),
for the whole package: no import circle between modules or between packages (each layer of dasspec/engine a
package of its own), counting function-local imports too; no module-level import from a lower layer into a higher
one; and every function-local import of dasspec's own modules says why it is one (``# optional: ...`` /
``# lazy: ...``), none of them to dodge a circle.  The engine's layers - base < drafting (the drafter interface) <
the methods < core < api (the user API) - are checked in their order, and the methods reach the engine through
the drafter interface alone."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "import_structure.py"


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
    assert {"dasspec.engine", "dasspec.engine.base", "dasspec.engine.drafting", "dasspec.engine.core",
            "dasspec.engine.api"} <= set(structure.modules)


@pytest.mark.parametrize("scopes", [("module",), ("module", "function")], ids=["module-level", "with-function-local"])
def test_no_import_circle(structure, scopes):
    circles = structure.circles(scopes)
    assert not circles, f"import circles ({' + '.join(scopes)} imports): {circles}"


@pytest.mark.parametrize("scopes", [("module",), ("module", "function")], ids=["module-level", "with-function-local"])
def test_no_package_circle(structure, scopes):
    circles = structure.package_circles(scopes)
    assert not circles, f"package circles ({' + '.join(scopes)} imports): {circles}"


def test_no_upward_module_level_import(structure):
    upward = [f"{i.source} -> {i.target} (line {i.line})" for i in structure.upward()]
    assert not upward, f"module-level imports into a higher layer: {upward}"


def test_function_local_imports_of_dasspec_say_why(structure):
    bare = [f"{i.source}:{i.line} -> {i.target}" for i in structure.function_local(own=True) if not i.commented]
    assert not bare, ("function-local imports of dasspec's own modules without an '# optional:' / '# lazy:' comment "
                      f"(import at module level, or say why not): {bare}")


def test_no_function_local_import_dodges_a_circle(structure):
    """A function-local import defers an optional dependency or a heavy one (torch, FastAPI) - never a circle:
    code that two modules need lives below both."""
    dodging = [f"{i.source}:{i.line} -> {i.target} ({i.reason})" for i in structure.function_local(own=True)
               if "circle" in i.reason.lower()]
    assert not dodging, f"function-local imports that dodge an import circle: {dodging}"


def test_the_engine_imports_its_own_modules_at_module_level(structure):
    local = [f"{i.source}:{i.line} -> {i.target}" for i in structure.function_local(own=True)
             if i.source == "dasspec.engine" or i.source.startswith("dasspec.engine.")]
    assert not local, f"function-local imports of dasspec's modules in the engine: {local}"


def test_the_engine_layers_in_order(measure):
    order = ["dasspec.model.looped", "dasspec.engine.base.request", "dasspec.engine.drafting.draft",
             "dasspec.methods.wave", "dasspec.engine.core.executor", "dasspec.engine.api.engine", "dasspec.cli"]
    ranks = [measure.layer(m) for m in order]
    assert ranks == sorted(ranks) and len(set(ranks)) == len(ranks), dict(zip(order, ranks))
    assert measure.package_of("dasspec.engine.core.executor") == "dasspec.engine.core"
    assert measure.package_of("dasspec.model.families.ouro") == "dasspec.model"


def test_the_methods_reach_the_engine_through_the_drafter_interface(structure):
    other = sorted({f"{i.source} -> {i.target}" for i in structure.imports
                    if i.own and i.source.startswith("dasspec.methods") and i.target.startswith("dasspec.engine")
                    and not (i.target == "dasspec.engine.drafting" or i.target.startswith("dasspec.engine.drafting."))})
    assert not other, f"methods importing the engine beside dasspec.engine.drafting: {other}"


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
    assert [(i.line, i.commented, i.reason) for i in s.function_local(own=True)] == [
        (4, False, ""), (8, True, "lazy: a reason"), (9, True, "lazy: a reason")]
