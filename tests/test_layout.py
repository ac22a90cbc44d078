"""The layout is the architecture: libraries never speak HTTP, roles never import each other, nothing below
the launcher imports it, and no import runs in a circle.

Read from the source with `ast` (no imports executed), so a violation names its file and line.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LIBRARIES = ("preprocess", "encoders", "engines", "rollout", "experience", "trainer")
PACKAGES = (*LIBRARIES, "services", "launcher")  # every package of the project
ROLE_PACKAGES = ("preprocess", "encoder", "engine", "rollout", "data")
WEB = ("fastapi", "starlette", "uvicorn")


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in ``path``; relative imports resolved against its package."""
    package = path.relative_to(REPO).with_suffix("").parts[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = list(package[: len(package) - node.level + 1]) if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            found.append((node.lineno, module))
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return found


@pytest.mark.parametrize("library", LIBRARIES)
def test_libraries_do_not_speak_http_or_import_services(library: str) -> None:
    bad = [
        f"{path.relative_to(REPO)}:{line} imports {module}"
        for path in sorted((REPO / library).rglob("*.py"))
        for line, module in imports(path)
        if module.split(".")[0] in (*WEB, "services")
    ]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("role", ROLE_PACKAGES)
def test_no_role_imports_another_role(role: str) -> None:
    others = [f"services.{other}" for other in ROLE_PACKAGES if other != role]
    bad = [
        f"{path.relative_to(REPO)}:{line} imports {module}"
        for path in sorted((REPO / "services" / role).rglob("*.py"))
        for line, module in imports(path)
        if any(module == o or module.startswith(f"{o}.") for o in others)
    ]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("role", ROLE_PACKAGES)
def test_every_role_has_the_template_files(role: str) -> None:
    folder = REPO / "services" / role
    assert {"settings.py", "schemas.py", "app.py"} <= {p.name for p in folder.glob("*.py")}
    app = folder / "app.py"
    assert any(module == "services.template.build_app" for _, module in imports(app)), f"{app} skips the template"


def test_every_role_is_in_the_table() -> None:
    from services.roles import ROLES

    assert set(ROLES) == set(ROLE_PACKAGES)


@pytest.mark.parametrize("package", ("services", *LIBRARIES))
def test_roles_and_libraries_never_import_the_launcher(package: str) -> None:
    """Imports run one way: launcher → services → libraries."""
    bad = [
        f"{path.relative_to(REPO)}:{line} imports {module}"
        for path in sorted((REPO / package).rglob("*.py"))
        for line, module in imports(path)
        if module.split(".")[0] == "launcher"
    ]
    assert not bad, "\n".join(bad)


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import that runs — at module level or inside a function, since an import moved into a function
    to dodge a circle is still a circle — except those under ``if TYPE_CHECKING:``."""
    found: list[ast.Import | ast.ImportFrom] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in {
            getattr(node.test, "id", None),
            getattr(node.test, "attr", None),
        }:
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return found


def import_graph() -> dict[str, dict[str, int]]:
    """module → {project module it imports: line}, over every package of the project. ``from a import b``
    is an edge to ``a.b`` when that is a module, else to ``a``; a package's own ``__init__`` is a module."""
    modules = {_module_name(path): path for package in PACKAGES for path in sorted((REPO / package).rglob("*.py"))}
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: dict[str, int] = {}
        for node in _runtime_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                parts = package.split(".")
                base = parts[: len(parts) - node.level + 1] if node.level else []
                module = ".".join([*base, *([node.module] if node.module else [])])
                targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in modules else module for a in node.names]
            for target in targets:
                while target and target not in modules:  # `import a.b.c` of a name in a.b: the module a.b
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges[target] = min(edges.get(target, node.lineno), node.lineno)
        graph[name] = edges
    return graph


def import_circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    circles: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


def test_import_circles_are_found() -> None:
    """The check below finds a circle, and one kept out of sight in a function too."""
    graph = {"a": {"b": 1}, "b": {"c": 3}, "c": {"a": 9}, "d": {"a": 2}}
    assert import_circles(graph) == [["a", "b", "c"]]
    lazy = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import x\ndef f():\n    import y\n")
    found = {node.module if isinstance(node, ast.ImportFrom) else node.names[0].name for node in _runtime_imports(lazy)}
    assert found == {"typing", "y"}


def test_no_import_circles() -> None:
    graph = import_graph()
    assert {"launcher.cli", "services.roles", "rollout.group"} <= set(graph)
    found = [
        "; ".join(
            f"{module}:{line} imports {other}"
            for module in circle
            for other, line in graph[module].items()
            if other in circle
        )
        for circle in import_circles(graph)
    ]
    assert not found, "import circles (one a line):\n" + "\n".join(found)


def project_modules() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (REPO / package).rglob("*.py"))


def test_no_module_is_over_600_lines() -> None:
    """A module that long is asking to be split along a real seam (the house style says ~500)."""
    long = {str(p.relative_to(REPO)): n for p in project_modules() if (n := len(p.read_text().splitlines())) > 600}
    assert not long, long


def test_records_are_typed() -> None:
    """Records and wire shapes are dataclasses and TypedDicts; ``dict[str, Any]`` stays for free-form JSON only
    (a dataset row, a Hugging Face config, a tool's arguments): fewer than 100 in the project."""
    count = sum(p.read_text().count("dict[str, Any]") for p in project_modules())
    assert count < 100, count
