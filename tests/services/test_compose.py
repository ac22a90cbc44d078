"""Static checks of the container files: docker-compose.yml, .env, Dockerfile and pyproject.toml agree
with each other and with the role table (services/roles.py).

Nothing here builds or starts a container (tests/services/test_compose_up.py does, where a Docker engine
answers). The compose file is validated against the Compose Specification schema from ../shared/schemas, each
service's command is parsed by the project's own CLI parser (ports, roles and backends are read from the
parsed commands), and the Dockerfile is read as text.
"""

from __future__ import annotations

import argparse
import json
import re
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from jsonschema import Draft7Validator

from services.roles import ROLES

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "docker-compose.yml"
DOTENV = REPO / ".env"
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
    """What the service runs: its entrypoint (when it sets one), then its command."""
    command = service.get("command")
    assert isinstance(command, list), f"service {name!r}: command must be a list (exec form), got {command!r}"
    entrypoint = service.get("entrypoint", [])
    assert isinstance(entrypoint, list), f"service {name!r}: entrypoint must be a list (exec form)"
    return [str(part) for part in [*entrypoint, *command]]


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
    from launcher.cli import build_parser

    for name, service in services().items():
        command = command_of(name, service)
        assert command[0] == "weir", f"service {name!r}: command must start with 'weir', got {command}"
        try:
            build_parser().parse_args(command[1:])
        except SystemExit as exc:
            pytest.fail(f"service {name!r}: `weir` rejects the arguments {command[1:]} (exit {exc.code})")


def role_services() -> dict[str, tuple[str, argparse.Namespace]]:
    """Every service that serves a role: name → (role, its parsed `weir serve` command)."""
    from launcher.cli import build_parser

    found = {}
    for name, service in services().items():
        args = build_parser().parse_args(command_of(name, service)[1:])
        if args.command == "serve":
            found[name] = (args.role, args)
    return found


def one_shot(command: str) -> tuple[str, dict[str, Any], argparse.Namespace]:
    """The one service running ``weir COMMAND``: (name, service, parsed command)."""
    from launcher.cli import build_parser

    found = []
    for name, service in services().items():
        args = build_parser().parse_args(command_of(name, service)[1:])
        if args.command == command:
            found.append((name, service, args))
    assert len(found) == 1, f"expected one service running `weir {command}`, found {[f[0] for f in found]}"
    return found[0]


def interpolate(value: str, env: dict[str, str] | None = None) -> str:
    """Compose's ``${VAR:-default}`` (the default when unset or empty), ``${VAR-default}`` (only when unset) and
    ``${VAR}`` with ``env`` (empty: the defaults)."""
    env = env or {}

    def one(match: re.Match[str]) -> str:
        name, how, default = match[1], match[2], match[3] or ""
        if how == "-":
            return env.get(name, default)
        return env.get(name) or default

    return re.sub(r"\$\{(\w+)(?:(:?-)([^}]*))?\}", one, value)


def mounts(service: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """target → (source, mode) of the service's short-syntax volumes."""
    out = {}
    for entry in service.get("volumes", []):
        source, target, *mode = str(entry).split(":")
        out[target] = (source, mode[0] if mode else "rw")
    return out


def test_every_role_is_served_at_its_table_port() -> None:
    served = role_services()
    assert {role for role, _ in served.values()} == set(ROLES), "every role of services/roles.py, and only those"
    for name, (role, args) in served.items():
        assert name == role or name.startswith(f"{role}-"), f"service {name!r} serves {role}: name it after the role"
        assert args.port == ROLES[role].port, f"service {name!r}: --port {args.port}, the table says {ROLES[role].port}"
        assert args.host == "0.0.0.0", f"service {name!r} must listen on the container's network"


def test_healthcheck_probes_readyz_on_the_served_port() -> None:
    for name, (_, args) in role_services().items():
        test = services()[name].get("healthcheck", {}).get("test")
        assert test, f"service {name!r} has no healthcheck"
        text = test if isinstance(test, str) else " ".join(test)
        urls = re.findall(r"https?://\S+", text)
        assert len(urls) == 1, f"service {name!r}: expected one URL in the healthcheck, found {urls}"
        url = urlsplit(urls[0])
        assert (url.path, url.port) == ("/readyz", args.port), f"service {name!r}: healthcheck probes {urls[0]}"


def test_only_rollout_and_data_are_published_and_on_loopback_by_default() -> None:
    published = {name for name, service in services().items() if service.get("ports")}
    assert published == {"rollout", "data"}, f"published: {sorted(published)}; the other roles stay on the network"
    for name in published:
        port = ROLES[name].port
        for mapping in services()[name]["ports"]:
            assert isinstance(mapping, str), f"service {name!r}: ports as 'HOST_IP:HOST_PORT:PORT' strings"
            assert interpolate(mapping) == f"127.0.0.1:{port}:{port}", f"service {name!r} publishes {mapping}"
            assert interpolate(mapping, {"WEIR_BIND": "0.0.0.0"}) == f"0.0.0.0:{port}:{port}", "WEIR_BIND overrides"
            variable = f"WEIR_{name.upper()}_PORT"  # another host port: a second stack, or one in use
            assert interpolate(mapping, {variable: "9"}) == f"127.0.0.1:9:{port}", f"{variable} moves {name!r}"
    for name, (_, args) in role_services().items():
        if name not in published:
            assert [str(p) for p in services()[name].get("expose", [])] == [str(args.port)], f"{name!r}: expose it"


def test_role_urls_name_a_service_at_its_table_port() -> None:
    served = role_services()
    names = {name: role for name, (role, _) in served.items()}
    for name, (role, _) in served.items():  # network aliases answer for a role too (the cpu engine: `engine`)
        for alias in (services()[name].get("networks") or {}).get("default", {}).get("aliases", []):
            names[alias] = role
    environment = services()["rollout"]["environment"]
    for variable, role in (
        ("WEIR_ENGINE_URLS", "engine"),
        ("WEIR_PREPROCESS_URL", "preprocess"),
        ("WEIR_ENCODER_URL", "encoder"),
        ("WEIR_DATA_URL", "data"),
    ):
        for url in str(environment[variable]).split(","):
            parts = urlsplit(url)
            assert names.get(parts.hostname or "") == role, f"{variable}={url}: no {role} service of that name"
            assert parts.port == ROLES[role].port, f"{variable}={url}: the table's {role} port is {ROLES[role].port}"


def test_every_role_reads_the_shared_token_made_first() -> None:
    name, service, args = one_shot("token")
    folder, file = str(args.out.parent), str(args.out)
    volume, mode = mounts(service)[folder]
    assert mode == "rw" and volume in load_compose()["volumes"], "the token service writes a named volume"
    assert "restart" not in service and not service.get("ports"), "a one-shot service"
    assert str(service.get("environment", {}).get("WEIR_API_TOKEN", "")).startswith("${WEIR_API_TOKEN"), (
        "a token given on the host (WEIR_API_TOKEN) reaches the token service"
    )
    for role_service in role_services():
        spec = services()[role_service]
        assert spec["environment"]["WEIR_API_TOKEN_FILE"] == file, f"{role_service!r}: WEIR_API_TOKEN_FILE={file}"
        assert "WEIR_API_TOKEN" not in spec["environment"], f"{role_service!r}: the token comes from the file only"
        assert mounts(spec).get(folder) == (volume, "ro"), f"{role_service!r}: mount {volume} at {folder} read-only"
        assert spec["depends_on"][name] == {"condition": "service_completed_successfully"}, role_service


def test_the_rollout_role_spools_on_a_volume_of_its_own() -> None:
    """Acknowledged groups wait for the data role on a named volume only the rollout role mounts (durable across a
    restart of its container; never the shared cache), in a folder the image makes for its user; an empty
    WEIR_SPOOL_DIR on the host turns the spool off."""
    rollout = services()["rollout"]
    setting = rollout["environment"]["WEIR_SPOOL_DIR"]
    folder = interpolate(setting)
    volume, mode = mounts(rollout)[folder]
    assert mode == "rw" and volume in load_compose()["volumes"]
    others = [name for name, service in services().items() if name != "rollout"]
    assert not [name for name in others if volume in {source for source, _ in mounts(services()[name]).values()}]
    assert interpolate(setting, {"WEIR_SPOOL_DIR": ""}) == ""
    lines = DOCKERFILE.read_text().splitlines()
    made = next(line for line in lines if "mkdir -p /cache" in line)
    owned = next(line for line in lines if "chown weir:weir /cache" in line)
    assert folder in made.split() and folder in owned.split()


def test_the_model_is_made_before_the_roles_that_read_it() -> None:
    name, service, args = one_shot("init-model")
    assert args.if_missing, "a model already in the volume (a real checkpoint) is never overwritten"
    for role_service in role_services():
        spec = services()[role_service]
        model = spec["environment"].get("WEIR_MODEL")
        if model is None:
            continue
        assert interpolate(str(model)) == str(args.folder), f"{role_service!r}: WEIR_MODEL defaults to {args.folder}"
        assert mounts(spec)["/models"][0] == mounts(service)["/models"][0], f"{role_service!r} mounts the models"
        assert spec["depends_on"][name] == {"condition": "service_completed_successfully"}, role_service


def test_the_cpu_profile_runs_the_engine_and_encoder_on_the_cpu_under_their_names() -> None:
    served = role_services()
    engines = {name: args for name, (role, args) in served.items() if role == "engine"}
    encoders = {name for name, (role, _) in served.items() if role == "encoder"}
    assert set(engines) == {"engine", "engine-cpu"} and encoders == {"encoder", "encoder-gpu"}
    assert (services()["engine"]["profiles"], engines["engine"].backend) == (["gpu"], "sglang")
    assert (services()["engine-cpu"]["profiles"], engines["engine-cpu"].backend) == (["cpu"], "transformers")
    assert services()["engine-cpu"]["networks"]["default"]["aliases"] == ["engine"]
    assert (services()["encoder"]["profiles"], services()["encoder-gpu"]["profiles"]) == (["cpu"], ["gpu"])
    assert services()["encoder-gpu"]["networks"]["default"]["aliases"] == ["encoder"]
    assert services()["encoder-gpu"]["environment"]["WEIR_DEVICE"] == "cuda"
    assert services()["trainer"]["profiles"] == ["train"]
    for name, service in services().items():
        if name not in {*engines, *encoders, "trainer"}:
            assert "profiles" not in service, f"{name!r} runs in every profile"
    depends = services()["rollout"]["depends_on"]
    for name in (*engines, *encoders):  # one of each pair is always left out by the profile: none is required
        assert depends[name] == {"condition": "service_healthy", "required": False}, name
    # `docker compose up` runs the GPU engine: the default profile comes from .env, which `--profile cpu`
    # replaces (compose-go cli.WithDefaultProfiles reads COMPOSE_PROFILES only when no --profile is given).
    dotenv = dict(line.split("=", 1) for line in DOTENV.read_text().splitlines() if line and not line.startswith("#"))
    assert dotenv == {"COMPOSE_PROFILES": "gpu"}


def test_dockerfile_default_command_is_the_preprocess_service_command() -> None:
    cmds = dockerfile_instructions("CMD")
    assert cmds, "Dockerfile has no CMD"
    assert json.loads(cmds[-1]) == command_of("preprocess", services()["preprocess"])


def test_every_cpu_service_runs_the_one_image_built_once() -> None:
    """One `build:` makes weir:dev; every other service of that image only names it (compose builds it first;
    a `build:` on each would build and export it once per service). The GPU profile's engine and encoder run
    weir:sglang, which the engine builds."""
    built = {name: service["image"] for name, service in services().items() if "build" in service}
    assert built == {"token": "weir:dev", "engine": "weir:sglang"}
    assert services()["token"]["build"]["args"] == {"TORCH_INDEX_URL": "${WEIR_TORCH_INDEX_URL:-}"}
    images = {name: service.get("image") for name, service in services().items()}
    assert {name for name, image in images.items() if image == "weir:sglang"} == {"engine", "encoder-gpu"}
    assert all(image in ("weir:dev", "weir:sglang") for image in images.values()), images


def test_dockerfile_installs_the_dependencies_before_the_source() -> None:
    """A source change rebuilds only the layers after the first package is copied: the dependencies (read from
    pyproject.toml alone) are installed before it, and Weir itself without them after it."""
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    first_package = next(i for i, line in enumerate(lines) if line.startswith("COPY launcher/"))
    dependencies = next(i for i, line in enumerate(lines) if "-r /tmp/requirements.txt" in line)
    project = next(i for i, line in enumerate(lines) if line.startswith("RUN pip install") and "--no-deps" in line)
    assert dependencies < first_package < project
    assert [line for line in lines[:dependencies] if line.startswith("COPY")] == ["COPY pyproject.toml ./"]
    assert "ARG TORCH_INDEX_URL=" in lines and '--extra-index-url "$TORCH_INDEX_URL"' in lines[dependencies]


def test_the_trainer_attaches_to_the_stack_by_its_service_names() -> None:
    from launcher.arguments import role_url
    from launcher.cli import build_parser
    from launcher.stack import remote_refusal

    trainer = services()["trainer"]
    args = build_parser().parse_args(command_of("trainer", trainer)[1:])
    assert args.command == "train" and args.attach and args.demo and args.weights == "disk"
    assert remote_refusal(args.role_url) is None
    names = {name: role for name, (role, _) in role_services().items()}
    for name, service in services().items():
        for alias in (service.get("networks") or {}).get("default", {}).get("aliases", []):
            names[alias] = names[name]
    assert {role for role, _ in args.role_url} == set(ROLES)
    for role, url in args.role_url:
        assert role_url(f"{role}={url}") == (role, url)
        assert names.get(urlsplit(url).hostname or "") == role and urlsplit(url).port == ROLES[role].port, url
    # Its home is the volume the roles read the published weights (engine, encoder) and the demo's media
    # (preprocess) from, read-only; it reads the preprocess role's feature cache.
    home = mounts(trainer)[str(args.home)]
    assert home[1] == "rw" and interpolate(str(args.model)) == "/models/tiny"
    for role in ("preprocess", "encoder", "encoder-gpu", "engine", "engine-cpu"):
        assert mounts(services()[role])[str(args.home)] == (home[0], "ro"), role
    assert str(args.home / "media") in services()["preprocess"]["environment"]["WEIR_MEDIA_ROOTS"].split(":")
    assert str(args.cache_dir) == services()["preprocess"]["environment"]["WEIR_CACHE_DIR"]
    assert mounts(trainer)["/cache"][0] == mounts(services()["preprocess"])["/cache"][0]
    assert trainer["depends_on"] == {"rollout": {"condition": "service_healthy"}}


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


def test_the_sglang_engine_reserves_the_gpus_its_server_arguments_take() -> None:
    """One knob: WEIR_ENGINE_GPUS is both compose's device count and the engine's setting (its tp_size unless
    WEIR_SGLANG_ARGS says otherwise; the engine refuses a tp × pp × dp that differs)."""
    engine = services()["engine"]
    (reservation,) = engine["deploy"]["resources"]["reservations"]["devices"]
    assert reservation["count"] == "${WEIR_ENGINE_GPUS:-1}" and reservation["capabilities"] == ["gpu"]
    assert reservation["driver"] == "nvidia"
    (towers,) = services()["encoder-gpu"]["deploy"]["resources"]["reservations"]["devices"]
    assert towers == {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}
    assert engine["environment"]["WEIR_ENGINE_GPUS"] == "${WEIR_ENGINE_GPUS:-1}"
    assert engine["environment"]["WEIR_SGLANG_ARGS"] == "${WEIR_SGLANG_ARGS:-}"
    assert engine["environment"]["WEIR_MODEL"] == services()["rollout"]["environment"]["WEIR_MODEL"]
