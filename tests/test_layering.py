"""The package's import structure: no cycles, imports only downward, no ``_private`` name across modules.

Read statically with ``ast`` from the source files (every ``import`` statement, including those inside
functions), so a cycle hidden behind a function-level import is still a cycle. Layers, lowest first,
follow docs/DESIGN (see docs/architecture.md).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = "hf_posext"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

#: Module-name prefix -> layer (longest prefix wins). Lower layers never import higher ones.
LAYERS = {
    "hf_posext.user_warnings": 0,
    "hf_posext.methods": 1,
    "hf_posext.core": 2,
    "hf_posext.backends": 3,
    "hf_posext.api": 4,
    "hf_posext.models": 4,
    # Below training and evaluation, which apply adapters: it imports neither (its checksums and fingerprints are core's).
    "hf_posext.adapters": 4,
    "hf_posext.text_sources": 4,
    "hf_posext.lm": 5,
    "hf_posext.search": 5,
    "hf_posext.wavelengths": 5,
    "hf_posext.evaluation": 5,
    "hf_posext.training": 5,
    "hf_posext.integrations": 5,
    # The suite (eval suite): its parts sit beside evaluation and integrations; its run calls the task runners
    # (integrations.lm_eval.ruler among them), which never call back into it.
    "hf_posext.card": 5,
    "hf_posext.card.run": 6,
    "hf_posext.demo": 5,
    "hf_posext.export": 5,
    "hf_posext.family_sweep": 5,
    # The package itself only re-exports the public API (api + search): it sits above them.
    "hf_posext": 5,
    # Deprecated import paths kept as re-exports of integrations/lm_eval/ (they warn on import).
    "hf_posext.lm_eval": 5,
    "hf_posext.lm_eval_plugin": 5,
    "hf_posext.cli": 6,
    "hf_posext.evaluation.cli": 6,
    "hf_posext.training.cli": 6,
    "hf_posext.integrations.lm_eval.cli": 6,
}

#: Known violations still to remove, as (importer, imported) pairs; empty now, keep it that way.
ALLOWED: set[tuple[str, str]] = set()


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_modules(root: Path = ROOT) -> dict[str, Path]:
    return {module_name(path, root): path for path in sorted(root.rglob("*.py"))}


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _is_dynamic_import(node: ast.AST) -> bool:
    """``importlib.import_module("hf_posext....")`` / ``find_spec("hf_posext....")`` with a constant name."""
    if not isinstance(node, ast.Call) or not node.args:
        return False
    func = node.func
    called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    first = node.args[0]
    return (
        called in ("import_module", "find_spec")
        and isinstance(first, ast.Constant)
        and isinstance(first.value, str)
        and first.value.split(".")[0] == PACKAGE
    )


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, str | None]]:
    """(imported module, imported name or None) for every import statement in ``path`` into the package."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if _is_dynamic_import(node):
            found.append((node.args[0].value, None))
        elif isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names if alias.name.split(".")[0] == PACKAGE]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(name, path.name == "__init__.py", node)
            if target.split(".")[0] != PACKAGE:
                continue
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                if submodule in modules:
                    found.append((submodule, None))
                else:
                    found.append((target, alias.name))
    return found


def import_graph(modules: dict[str, Path]) -> dict[str, dict[str, list[str | None]]]:
    graph: dict[str, dict[str, list[str | None]]] = {}
    for name, path in modules.items():
        edges: dict[str, list[str | None]] = {}
        for target, imported in imports_of(name, path, modules):
            while target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            if target != name:
                edges.setdefault(target, []).append(imported)
        graph[name] = edges
    return graph


def layer_of(name: str) -> int:
    prefixes = [p for p in LAYERS if name == p or (p != PACKAGE and name.startswith(p + "."))]
    best = max(prefixes, key=len, default=None)
    if best is None:
        raise AssertionError(f"{name} is in no layer: add it to LAYERS in tests/test_layering.py")
    return LAYERS[best]


def find_cycles(graph: dict[str, dict[str, list]]) -> list[list[str]]:
    """Every strongly connected component with more than one module (Tarjan), as sorted name lists."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, {}):
            if (node, target) in ALLOWED:
                continue
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return components


def layering_violations(graph: dict[str, dict[str, list]]) -> list[str]:
    problems = []
    for importer, edges in graph.items():
        for target in edges:
            if (importer, target) in ALLOWED:
                continue
            if layer_of(target) > layer_of(importer) and not target.startswith(importer + "."):
                problems.append(f"{importer} (layer {layer_of(importer)}) imports {target} (layer {layer_of(target)})")
    return problems


def private_imports(graph: dict[str, dict[str, list]]) -> list[str]:
    return [
        f"{importer} imports {name} from {target}"
        for importer, edges in graph.items()
        for target, names in edges.items()
        for name in names
        if name and name.startswith("_") and not name.startswith("__") and (importer, target) not in ALLOWED
    ]


@pytest.fixture(scope="module")
def graph():
    return import_graph(source_modules())


def test_no_import_cycles(graph):
    assert find_cycles(graph) == []


def test_imports_only_go_down(graph):
    assert layering_violations(graph) == []


def test_no_private_names_across_modules(graph):
    assert private_imports(graph) == []


def test_no_module_imports_the_package_face(graph):
    """``hf_posext/__init__`` only re-exports (the public API, ``__version__``): modules import the layer that
    defines a name (``hf_posext.api``, ``hf_posext.core.version``), never the face above them."""
    assert [importer for importer, edges in graph.items() if PACKAGE in edges] == []


def test_tests_import_no_private_package_names():
    """Tests use the names a user can import: a test importing ``_LayerSettings`` pins a private name."""
    modules = source_modules()
    found = [
        f"{path.name} imports {imported} from {target}"
        for path in sorted(Path(__file__).resolve().parent.glob("*.py"))
        for target, imported in imports_of(f"tests.{path.stem}", path, modules)
        if imported and imported.startswith("_") and not imported.startswith("__")
    ]
    assert found == []


def test_the_checks_catch_a_deliberate_cycle_and_upward_import(tmp_path):
    package = tmp_path / PACKAGE
    (package / "methods").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "methods" / "__init__.py").write_text("import importlib\ndef f():\n    importlib.import_module('hf_posext.api')\n")
    (package / "api.py").write_text("from hf_posext.methods import _helper\n")
    modules = source_modules(package)
    fake = import_graph(modules)
    assert find_cycles(fake) == [["hf_posext.api", "hf_posext.methods"]]
    assert layering_violations(fake) == ["hf_posext.methods (layer 1) imports hf_posext.api (layer 4)"]
    assert private_imports(fake) == ["hf_posext.api imports _helper from hf_posext.methods"]
