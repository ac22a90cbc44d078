"""Static checks of the container files: docker-compose.yml, Dockerfile and pyproject.toml agree.

No Docker engine runs on the CI machines, so nothing here builds or starts a container. The compose file is
validated against the Compose Specification schema from ../shared/schemas, each service's command is parsed
by the project's own CLI parser, and the Dockerfile is read as text.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from jsonschema import Draft7Validator

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "Dockerfile"
PYPROJECT = REPO / "pyproject.toml"
COMPOSE_SCHEMA = REPO.parent / "shared" / "schemas" / "compose-spec.json"


def load_compose() -> dict[str, Any]:
    compose = yaml.safe_load(COMPOSE_FILE.read_text())
    assert isinstance(compose, dict), "docker-compose.yml must be a mapping"
    return compose


def services() -> dict[str, dict[str, Any]]:
    found = load_compose().get("services")
    assert isinstance(found, dict) and found, "docker-compose.yml declares no services"
    return found


def command_of(name: str, service: dict[str, Any]) -> list[str]:
    command = service.get("command")
    assert isinstance(command, list), f"service {name!r}: command must be a list (exec form), got {command!r}"
    return [str(part) for part in command]


def option_value(command: list[str], option: str) -> str:
    assert option in command, f"{option} missing from command {command}"
    return command[command.index(option) + 1]


def dockerfile_instructions(keyword: str) -> list[str]:
    """The arguments of every `keyword` instruction, with backslash-continued lines joined."""
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    pattern = rf"^\s*{keyword}\s+(.+?)\s*$"
    return re.findall(pattern, text, flags=re.MULTILINE | re.IGNORECASE)


def test_compose_file_matches_compose_spec() -> None:
    if not COMPOSE_SCHEMA.is_file():
        pytest.skip(f"Compose schema not found at {COMPOSE_SCHEMA}")
    schema = json.loads(COMPOSE_SCHEMA.read_text())
    Draft7Validator.check_schema(schema)
    errors = sorted(Draft7Validator(schema).iter_errors(load_compose()), key=lambda error: list(error.path))
    messages = [f"{'/'.join(map(str, error.path)) or '<root>'}: {error.message}" for error in errors]
    assert not messages, "docker-compose.yml does not match the Compose spec:\n" + "\n".join(messages)


def test_service_commands_are_accepted_by_the_cli() -> None:
    from services.cli import build_parser

    for name, service in services().items():
        command = command_of(name, service)
        assert command[0] == "weir", f"service {name!r}: command must start with 'weir', got {command}"
        try:
            build_parser().parse_args(command[1:])
        except SystemExit as exc:
            pytest.fail(f"service {name!r}: `weir` rejects the arguments {command[1:]} (exit {exc.code})")


def test_healthcheck_probes_readyz_on_the_served_port() -> None:
    for name, service in services().items():
        port = int(option_value(command_of(name, service), "--port"))
        test = service.get("healthcheck", {}).get("test")
        assert test, f"service {name!r} has no healthcheck"
        text = test if isinstance(test, str) else " ".join(test)
        urls = re.findall(r"https?://\S+", text)
        assert len(urls) == 1, f"service {name!r}: expected one URL in the healthcheck, found {urls}"
        url = urlsplit(urls[0])
        assert (url.path, url.port) == ("/readyz", port), f"service {name!r}: healthcheck probes {urls[0]}"
        published = [str(mapping).rsplit(":", 1)[-1] for mapping in service.get("ports", [])]
        assert str(port) in published, f"service {name!r}: port {port} is not published ({service.get('ports')})"


def test_dockerfile_default_command_is_the_preprocess_service_command() -> None:
    cmds = dockerfile_instructions("CMD")
    assert cmds, "Dockerfile has no CMD"
    assert json.loads(cmds[-1]) == command_of("preprocess", services()["preprocess"])


def test_dockerfile_copies_every_package() -> None:
    find = tomllib.loads(PYPROJECT.read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = {pattern.rstrip("*") for pattern in find["include"] if "." not in pattern}  # top-level ones only
    copied: set[str] = set()
    for args in dockerfile_instructions("COPY"):
        sources = [arg for arg in args.split() if not arg.startswith("--")][:-1]
        copied.update(source.strip("./") for source in sources)
    missing = sorted(packages - copied)
    assert not missing, f"Dockerfile does not COPY the packages {missing} listed in pyproject.toml"
    assert {"pyproject.toml", "README.md"} <= copied, "Dockerfile must COPY pyproject.toml and README.md"
