"""Import structure of the dasspec package, measured from its source (stdlib ``ast`` only; nothing is imported).

Prints
  * the number of modules;
  * every module-level import edge between dasspec modules (``if TYPE_CHECKING:`` imports are listed apart: they
    never run);
  * the import circles (strongly connected components of more than one module, or a module importing itself) in
    two views: module-level imports only (what ``import`` actually executes), and module-level plus function-local
    imports (the circles the function-local ones only hide);
  * the same two views between packages (dasspec.model, dasspec.methods, ...; each layer of dasspec.engine -
    base, drafting, core, api - is a package of its own);
  * the upward imports: a module-level import from a lower layer into a higher one (``LAYERS`` below);
  * the function-local imports, in total and of dasspec's own modules, per package, and those of dasspec's own
    modules that carry no ``# optional:`` / ``# lazy:`` comment (on the statement or the comment lines just above);
    with ``--edges``, every function-local import of dasspec's own modules with the reason its comment gives.

    python benchmarks/import_structure.py                  # the report
    python benchmarks/import_structure.py --edges          # ... with every module-level edge listed
    python benchmarks/import_structure.py --json           # the figures as JSON

An edge goes to the most specific module named: ``from .model import config`` is an edge to dasspec.model.config,
``from .model import load_model`` one to dasspec.model (its __init__).  tests/test_import_structure.py runs
``scan()`` and asserts on the result.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "dasspec"

# Layers, lowest first: a module-level import may go to the same layer or a lower one, never to a higher one.
# A module is placed by the longest prefix listed.  The engine is four layers with the methods between them: its
# base (the plan / outcome contract, a request's state) < the drafter interface < the methods, written against
# that interface < the core (scheduler, executor, the drafter cache wired to the method registry) < the user API
# (Engine, generate).  ``dasspec`` itself (the package's __init__) is a facade whose exports resolve on first use
# and which imports none of them at run time: the command modules call through it (``dasspec.load_model``), so it
# sits just below them.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("dasspec.host",),
    ("dasspec.model",),
    ("dasspec.engine", "dasspec.engine.base"),
    ("dasspec.engine.drafting",),
    ("dasspec.methods",),
    ("dasspec.engine.core",),
    ("dasspec.engine.api",),
    ("dasspec", "dasspec.flags"),
    ("dasspec.eval", "dasspec.train", "dasspec.serve", "dasspec.testing", "dasspec.kernels_cli"),
    ("dasspec.cli",),
)

# Packages whose subpackages count as packages of their own (package circles are measured between them).
LAYERED_PACKAGES = ("dasspec.engine",)

COMMENT = re.compile(r"#\s*(optional|lazy)\s*:\s*(.*)")


@dataclass(frozen=True)
class Import:
    source: str            # the importing module
    target: str            # the imported module (a dasspec module, or the top-level name of another package)
    line: int
    scope: str             # "module", "type" (under if TYPE_CHECKING) or "function"
    own: bool              # target is a dasspec module
    commented: bool        # an "# optional:" / "# lazy:" comment on the statement or just above it
    reason: str = ""       # that comment's text ("optional: ray ..." / "lazy: torch ...")


@dataclass
class Structure:
    modules: list[str]
    imports: list[Import] = field(default_factory=list)

    def edges(self, scopes: tuple[str, ...] = ("module",)) -> set[tuple[str, str]]:
        return {(i.source, i.target) for i in self.imports if i.own and i.scope in scopes and i.source != i.target}

    def circles(self, scopes: tuple[str, ...] = ("module",)) -> list[list[str]]:
        return strongly_connected(self.modules, self.edges(scopes))

    def package_circles(self, scopes: tuple[str, ...] = ("module",)) -> list[list[str]]:
        """The circles between packages (dasspec.model, dasspec.engine.core, ...; a top-level module is its own)."""
        edges = {(package_of(a), package_of(b)) for a, b in self.edges(scopes)}
        return strongly_connected(sorted({package_of(m) for m in self.modules}), edges)

    def function_local(self, own: bool | None = None) -> list[Import]:
        return [i for i in self.imports if i.scope == "function" and (own is None or i.own == own)]

    def upward(self) -> list[Import]:
        seen, out = set(), []
        for i in self.imports:
            if i.own and i.scope == "module" and layer(i.target) > layer(i.source) and (i.source, i.target) not in seen:
                seen.add((i.source, i.target))
                out.append(i)
        return out


def layer(module: str) -> int:
    best, best_len = len(LAYERS), -1
    for rank, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best_len:
                best, best_len = rank, len(p)
    return best


def package_of(module: str) -> str:
    """dasspec.model.config -> dasspec.model; a top-level module (dasspec.cli) is its own package; in a layered
    package its subpackage: dasspec.engine.core.executor -> dasspec.engine.core."""
    parts = module.split(".")
    for p in LAYERED_PACKAGES:
        if module.startswith(p + "."):
            return ".".join(parts[: p.count(".") + 2])
    return ".".join(parts[:2])


def module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(node: ast.AST, scope: str):
    """(import statement, scope) for every import under node."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, scope
        elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from _walk(child, "function")
        elif isinstance(child, ast.If) and scope == "module" and _is_type_checking(child.test):
            for stmt in child.body:
                yield from _walk(ast.Module(body=[stmt], type_ignores=[]), "type")
            for stmt in child.orelse:
                yield from _walk(ast.Module(body=[stmt], type_ignores=[]), "module")
        else:
            yield from _walk(child, scope)


def _comment(stmt: ast.stmt, lines: list[str], import_lines: set[int]) -> str | None:
    """The marker comment ("lazy: ..." / "optional: ...") on the statement's lines, or in the comment lines
    directly above it (None when there is none); the import statements right above it are passed over (one
    comment may head a group of imports)."""
    first, last = stmt.lineno, getattr(stmt, "end_lineno", stmt.lineno) or stmt.lineno
    for n in range(first, last + 1):
        m = COMMENT.search(lines[n - 1])
        if m:
            return f"{m.group(1)}: {m.group(2).strip()}"
    n = first - 1
    while n >= 1 and (lines[n - 1].strip().startswith("#") or n in import_lines):
        m = COMMENT.search(lines[n - 1])
        if m:
            return f"{m.group(1)}: {m.group(2).strip()}"
        n -= 1
    return None


def _resolve(source: str, is_package: bool, stmt: ast.stmt, modules: set[str]) -> list[str]:
    """The modules a statement imports: dasspec modules by full name, others by their top-level name."""
    def deepest(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    out = []
    if isinstance(stmt, ast.Import):
        for alias in stmt.names:
            if alias.name == "dasspec" or alias.name.startswith("dasspec."):
                out.append(deepest(alias.name) or alias.name)
            else:
                out.append(alias.name.split(".")[0])
        return out
    assert isinstance(stmt, ast.ImportFrom)
    if stmt.level:
        base = source.split(".") if is_package else source.split(".")[:-1]
        base = base[: len(base) - (stmt.level - 1)]
        base_name = ".".join(base + ([stmt.module] if stmt.module else []))
    else:
        base_name = stmt.module or ""
        if not (base_name == "dasspec" or base_name.startswith("dasspec.")):
            return [base_name.split(".")[0]]
    for alias in stmt.names:
        sub = f"{base_name}.{alias.name}"
        out.append(sub if sub in modules else deepest(base_name) or base_name)
    return out


def scan(root: Path = ROOT) -> Structure:
    paths = sorted(p for p in root.rglob("*.py"))
    names = {module_name(p, root): p for p in paths}
    structure = Structure(modules=sorted(names))
    module_set = set(names)
    for name, path in sorted(names.items()):
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines()
        tree = ast.parse(text, filename=str(path))
        found = list(_walk(tree, "module"))
        import_lines = {n for stmt, _ in found for n in range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1)}
        for stmt, scope in found:
            reason = _comment(stmt, lines, import_lines)
            for target in dict.fromkeys(_resolve(name, path.name == "__init__.py", stmt, module_set)):
                structure.imports.append(Import(name, target, stmt.lineno, scope, target in module_set,
                                                reason is not None, reason or ""))
    return structure


def strongly_connected(nodes: list[str], edges: set[tuple[str, str]]) -> list[list[str]]:
    """Tarjan's algorithm (iterative); the components of more than one module, each sorted, largest first."""
    graph = defaultdict(list)
    for a, b in sorted(edges):
        graph[a].append(b)
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = 0
    for start in nodes:
        if start in index:
            continue
        work = [(start, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = counter
                counter += 1
                stack.append(node)
                on_stack.add(node)
            succ = graph[node]
            if i < len(succ):
                work.append((node, i + 1))
                nxt = succ[i]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            if low[node] == index[node]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return sorted(out, key=lambda c: (-len(c), c))


def figures(s: Structure) -> dict:
    per_package: dict[str, dict[str, int]] = defaultdict(lambda: {"total": 0, "own": 0, "own_uncommented": 0})
    for i in s.function_local():
        p = per_package[package_of(i.source)]
        p["total"] += 1
        p["own"] += i.own
        p["own_uncommented"] += i.own and not i.commented
    return {
        "modules": len(s.modules),
        "module_level_edges": len(s.edges()),
        "circles_module_level": s.circles(),
        "circles_with_function_local": s.circles(("module", "function")),
        "package_circles_module_level": s.package_circles(),
        "package_circles_with_function_local": s.package_circles(("module", "function")),
        "upward": [f"{i.source} -> {i.target} (line {i.line})" for i in s.upward()],
        "function_local_total": len(s.function_local()),
        "function_local_own": len(s.function_local(own=True)),
        "function_local_own_uncommented": sum(not i.commented for i in s.function_local(own=True)),
        "function_local_other_uncommented": sum(not i.commented for i in s.function_local(own=False)),
        "function_local_per_package": dict(sorted(per_package.items())),
    }


def report(s: Structure, edges: bool) -> str:
    f = figures(s)
    out = [f"modules: {f['modules']}", f"module-level import edges between dasspec modules: {f['module_level_edges']}"]
    if edges:
        by_source = defaultdict(list)
        for a, b in sorted(s.edges()):
            by_source[a].append(b)
        for a, targets in by_source.items():
            out.append(f"  {a} -> {', '.join(targets)}")
        types = sorted(s.edges(("type",)))
        out.append(f"TYPE_CHECKING-only edges (never executed): {len(types)}")
        out += [f"  {a} -> {b}" for a, b in types]
    for key, title in (("circles_module_level", "import circles, module-level imports"),
                       ("circles_with_function_local", "import circles, module-level + function-local imports"),
                       ("package_circles_module_level", "package circles, module-level imports"),
                       ("package_circles_with_function_local",
                        "package circles, module-level + function-local imports")):
        out.append(f"{title}: {len(f[key])}")
        out += [f"  [{len(c)}] " + ", ".join(c) for c in f[key]]
    out.append(f"upward module-level imports (against LAYERS): {len(f['upward'])}")
    out += [f"  {u}" for u in f["upward"]]
    out.append(f"function-local imports: {f['function_local_total']} total, {f['function_local_own']} of dasspec's own "
               f"modules ({f['function_local_own_uncommented']} of them without an '# optional:' / '# lazy:' "
               f"comment; other packages' without one: {f['function_local_other_uncommented']})")
    out.append(f"  {'package':28s} {'total':>6s} {'own':>5s} {'own, uncommented':>17s}")
    for pkg, c in f["function_local_per_package"].items():
        out.append(f"  {pkg:28s} {c['total']:6d} {c['own']:5d} {c['own_uncommented']:17d}")
    if edges:
        out.append("function-local imports of dasspec's own modules, and why:")
        out += [f"  {i.source}:{i.line} -> {i.target}  ({i.reason or 'no comment'})"
                for i in s.function_local(own=True)]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", type=Path, default=ROOT, help="the package folder (default: this checkout's dasspec)")
    ap.add_argument("--edges", action="store_true", help="list every module-level edge and uncommented import")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = ap.parse_args(argv)
    s = scan(args.root)
    print(json.dumps(figures(s), indent=2) if args.json else report(s, args.edges))
    return 0


if __name__ == "__main__":
    sys.exit(main())
