"""What the package imports is what pyproject.toml declares, and an install carries what the code reads.

Every third-party module imported by the project's packages comes from a distribution named in the base
dependencies or in an extra; an import at module level (it runs whenever the module is imported) comes from
the base dependencies, so an optional feature's library is imported where the feature runs. Read with `ast`
from the source, as `tests/test_layout.py` reads the layout; the import names map to distributions through the
installed metadata. The wheel carries the sim profiles and each package's ``py.typed``.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import re
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Mapping
from pathlib import Path

import pytest

from .test_layout import PACKAGES, REPO, _runtime_imports

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
SHIPPED = (*PACKAGES, "profiles")
# Import names whose distribution is not installed in the dev environment (sglang has its own: .venv-sglang).
NOT_INSTALLED = {  # fla: GPU only (the megatron-gpu extra); sglang and its kernels: .venv-sglang
    "sglang": "sglang",
    "sgl_kernel": "sglang-kernel",
    "fla": "flash-linear-attention",
}


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared(requirements: list[str]) -> set[str]:
    """The distribution names of requirement strings (``name[extra]>=1; marker`` → ``name``)."""
    found = set()
    for requirement in requirements:
        match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
        assert match, requirement
        found.add(_canonical(match.group(1)))
    return found


BASE = _declared(PYPROJECT["project"]["dependencies"])
EXTRAS = {name: _declared(reqs) for name, reqs in PYPROJECT["project"]["optional-dependencies"].items()}


def _third_party_imports() -> list[tuple[str, int, str, bool]]:
    """(file, line, top-level module, at module level) for every third-party import that runs."""
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    found = []
    for package in SHIPPED:
        for path in sorted((REPO / package).rglob("*.py")):
            tree = ast.parse(path.read_text())
            top_level = {id(node) for node in tree.body}
            for node in _runtime_imports(tree):
                if isinstance(node, ast.ImportFrom):
                    if node.level or not node.module:
                        continue
                    names = [node.module]
                else:
                    names = [alias.name for alias in node.names]
                for name in names:
                    top = name.split(".")[0]
                    if top not in stdlib and top not in SHIPPED:
                        found.append((str(path.relative_to(REPO)), node.lineno, top, id(node) in top_level))
    return found


@functools.cache
def _installed() -> Mapping[str, list[str]]:
    return importlib.metadata.packages_distributions()  # reads every installed RECORD: once


def _distributions(module: str) -> set[str]:
    if module in NOT_INSTALLED:
        return {NOT_INSTALLED[module]}
    names = _installed().get(module)
    assert names, f"{module}: no installed distribution provides it (add it to NOT_INSTALLED with its name)"
    return {_canonical(name) for name in names}


def test_the_scan_sees_the_imports_it_must() -> None:
    modules = {module for _, _, module, _ in _third_party_imports()}
    assert {"torch", "fastapi", "yaml", "openai", "megatron", "ray", "sglang"} <= modules


def test_every_third_party_import_is_declared() -> None:
    everywhere = BASE.union(*EXTRAS.values())
    bad = [
        f"{file}:{line} imports {module} ({' or '.join(sorted(_distributions(module)))}): not in pyproject.toml"
        for file, line, module, _ in _third_party_imports()
        if not _distributions(module) & everywhere
    ]
    assert not bad, "\n".join(bad)


def test_module_level_imports_need_only_the_base_install() -> None:
    """An extra's library is imported inside the function that uses it, so the base install imports every
    module; `weir --help` and the roles work without the extras."""
    bad = [
        f"{file}:{line} imports {module} at module level, but it is only in an extra"
        for file, line, module, top in _third_party_imports()
        if top and not _distributions(module) & BASE
    ]
    assert not bad, "\n".join(bad)


def test_dev_is_run_plus_the_tools_and_every_feature() -> None:
    dev = PYPROJECT["project"]["optional-dependencies"]["dev"]
    assert "weir[run]" in dev
    for extra in ("megatron", "ray", "trackers", "trl"):
        assert EXTRAS[extra] <= EXTRAS["dev"], extra


def test_decord_is_only_asked_for_where_it_has_wheels() -> None:
    (decord,) = [r for r in PYPROJECT["project"]["optional-dependencies"]["dev"] if r.startswith("decord")]
    assert "platform_machine == 'x86_64'" in decord and "sys_platform == 'linux'" in decord


def test_profiles_are_found_by_name_and_by_the_checkout_path(tmp_path: Path) -> None:
    from profiles import FOLDER, names, resolve

    assert {"relax-qwen3-4b-h800", "qwen3-vl-8b-h800"} <= set(names())
    shipped = FOLDER / "relax-qwen3-4b-h800.yaml"
    for given in ("relax-qwen3-4b-h800", "relax-qwen3-4b-h800.yaml", "profiles/relax-qwen3-4b-h800.yaml"):
        assert resolve(given).resolve() == shipped.resolve()
    own = tmp_path / "mine.yaml"
    own.write_text("constants: {}\n")
    assert resolve(own) == own
    with pytest.raises(ValueError, match="relax-qwen3-4b-h800"):
        resolve("no-such-profile")


@pytest.mark.slow
def test_the_wheel_carries_profiles_and_type_markers(tmp_path: Path) -> None:
    """Build the wheel (no dependencies, no isolation: the installed setuptools) and look inside."""
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path)]
    subprocess.run([*command, str(REPO)], check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("weir-*.whl")
    files = set(zipfile.ZipFile(wheel).namelist())
    assert {f"{package}/py.typed" for package in SHIPPED} <= files
    assert {f"profiles/{name}" for name in ("relax-qwen3-4b-h800.yaml", "qwen3-vl-8b-h800.yaml")} <= files
