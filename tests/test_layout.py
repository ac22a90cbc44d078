"""The layout is the architecture: libraries never speak HTTP, roles never import each other, nothing below
the launcher imports it, and no import runs in a circle.

Read from the source with `ast` (no imports executed), so a violation names its file and line.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LIBRARIES = ("preprocess", "encoders", "engines", "rollout", "experience", "trainer", "wire", "twin")
PACKAGES = (*LIBRARIES, "services", "launcher")  # every package of the project
ROLE_PACKAGES = ("preprocess", "encoder", "engine", "rollout", "data")
ROLE_LIBRARY = {
    "preprocess": "preprocess",
    "encoder": "encoders",
    "engine": "engines",
    "rollout": "rollout",
    "data": "experience",
}
WEB = ("fastapi", "starlette", "uvicorn")
ANY_CAP = 574  # `Any` in the project's modules (lowered as it falls; 569 before the clients, which added 5)


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
    """A role is its routes and wiring (`services/<role>/`: settings, app); its records and its client are the
    library's behind it (`<library>/api.py`, `<library>/client.py`), where callers import them from."""
    folder = REPO / "services" / role
    assert {"settings.py", "app.py"} <= {p.name for p in folder.glob("*.py")}
    assert not (folder / "schemas.py").exists(), f"{role}'s records belong in {ROLE_LIBRARY[role]}/api.py"
    assert {"api.py", "client.py"} <= {p.name for p in (REPO / ROLE_LIBRARY[role]).glob("*.py")}
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
    """Every import that runs (`tests/test_packaging.py`: what a wheel must bring) — at module level or inside a
    function — except those under ``if TYPE_CHECKING:``."""
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


def _all_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import — at module level, inside a function (an import moved into a function to dodge a circle is
    still a circle) and under ``if TYPE_CHECKING:`` (a type-only import is a dependency all the same: the two
    modules cannot be understood, tested or moved apart)."""
    return [node for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)]


def import_graph() -> dict[str, dict[str, int]]:
    """module → {project module it imports: line}, over every package of the project. ``from a import b``
    is an edge to ``a.b`` when that is a module, else to ``a``; a package's own ``__init__`` is a module."""
    modules = {_module_name(path): path for package in PACKAGES for path in sorted((REPO / package).rglob("*.py"))}
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: dict[str, int] = {}
        for node in _all_imports(ast.parse(path.read_text())):
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
    """The check below finds a circle, and one kept out of sight in a function or under TYPE_CHECKING too."""
    graph = {"a": {"b": 1}, "b": {"c": 3}, "c": {"a": 9}, "d": {"a": 2}}
    assert import_circles(graph) == [["a", "b", "c"]]
    lazy = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import x\ndef f():\n    import y\n")
    found = {node.module if isinstance(node, ast.ImportFrom) else node.names[0].name for node in _all_imports(lazy)}
    assert found == {"typing", "x", "y"}


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


# -- records once ---------------------------------------------------------------------------------------------
# A record that crosses a role boundary is declared once, in the library behind the role (`<library>/api.py`),
# and read by that role's client (`<library>/client.py`); the server validates with the same classes.
CLIENT_MODULES = {"wire/client.py"} | {f"{library}/client.py" for library in LIBRARIES}
# Modules that read JSON from HTTP answers that are not a Weir role's (each says whose).
FOREIGN_JSON = {
    "rollout/environments.py": "a user's HTTP environment server",
}


def definitions(sources: dict[str, str]) -> dict[str, list[str]]:
    """Public name → ``module:line`` of each definition: every class, and every module-level type alias (``Name =
    Literal[...]`` / ``Annotated[...]`` / ``A | B``; a plain re-binding ``Name = other`` is an import's alias)."""
    found: dict[str, list[str]] = {}
    for module, text in sources.items():
        for node in ast.parse(text).body:
            if isinstance(node, ast.ClassDef):
                name = node.name
            elif (
                isinstance(node, ast.Assign | ast.AnnAssign)
                and isinstance(target := node.targets[0] if isinstance(node, ast.Assign) else node.target, ast.Name)
                and isinstance(node.value, ast.Subscript | ast.BinOp)
                and target.id[:1].isupper()
                and not target.id.isupper()
            ):
                name = target.id
            else:
                continue
            if not name.startswith("_"):
                found.setdefault(name, []).append(f"{module}:{node.lineno}")
    return found


def _sources() -> dict[str, str]:
    return {str(p.relative_to(REPO)): p.read_text() for p in project_modules()}


def test_a_record_defined_twice_is_found() -> None:
    """The check below on the shape of the flaw it replaced: the server's pydantic model and a caller's TypedDict."""
    server = "class MediaItem(BaseModel):\n    type: str\nMediaKind = Literal['image', 'video']\n"
    caller = "class MediaItem(TypedDict):\n    type: str\nMediaKind = Literal['image']\nKind = kinds.MediaKind\n"
    twice = {n: w for n, w in definitions({"server.py": server, "caller.py": caller}).items() if len(w) > 1}
    assert twice == {"MediaItem": ["server.py:1", "caller.py:1"], "MediaKind": ["server.py:3", "caller.py:3"]}


def test_every_public_class_and_type_is_defined_once() -> None:
    """One name, one definition, project-wide: a wire record is never declared again by a caller, and two
    different things never share a name (the reader would take one for the other)."""
    twice = {name: where for name, where in definitions(_sources()).items() if len(where) > 1}
    assert not twice, "\n".join(f"{name}: {', '.join(where)}" for name, where in sorted(twice.items()))


def json_reads(sources: dict[str, str]) -> list[str]:
    """``module:line`` of every ``<answer>.json()`` call (an HTTP answer's JSON read by hand)."""
    return [
        f"{module}:{node.lineno}"
        for module, text in sources.items()
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "json"
        and not node.args
        and not node.keywords
    ]


def test_a_json_read_by_hand_is_found() -> None:
    caller = 'r = client.get("/v1/admission")\nallowed = r.json()["groups"]\nbody = await request.json()\n'
    assert json_reads({"driver.py": caller}) == ["driver.py:2", "driver.py:3"]


def test_no_module_reads_a_roles_json_by_hand() -> None:
    """Outside the clients, no module reads an answer's JSON: it calls the role's client, which reads the answer
    through its record (a field renamed on a server is an `AnswerMismatch` naming it, not a KeyError in a
    caller). Servers read their requests through their records too (FastAPI), never ``request.json()``."""
    sources = {m: t for m, t in _sources().items() if m not in CLIENT_MODULES and m not in FOREIGN_JSON}
    sources |= {str(p.relative_to(REPO)): p.read_text() for p in sorted((REPO / "examples").rglob("*.py"))}
    assert not json_reads(sources), json_reads(sources)


def test_any_is_capped() -> None:
    """``Any`` stays for what is really untyped (free-form JSON, a third-party object): a cap, lowered as it
    falls, as for ``dict[str, Any]``."""
    count = sum(len(re.findall(r"\bAny\b", text)) for text in _sources().values())
    assert count <= ANY_CAP, count
