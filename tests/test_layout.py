"""The layout is the architecture: libraries never speak HTTP, roles never import each other.

Read from the source with `ast` (no imports executed), so a violation names its file and line.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LIBRARIES = ("preprocess", "encoders", "engines", "rollout", "experience", "trainer")
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
