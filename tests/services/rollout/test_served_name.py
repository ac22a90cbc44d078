"""The model's own name on the OpenAI routes (``--served-model-name``, ``WEIR_SERVED_MODEL_NAME``), driven by the
real ``openai`` package against rollout roles on loopback over the real preprocess, encoder and engine roles:
by default the model folder's name, or ``owner/name`` for a hub id; explicit names as vLLM takes them (each listed
and accepted, the first reported); Weir's old fixed id still served, not listed; another name 404
``model_not_found`` in OpenAI's shape. Then the option on its way from the command line to the settings."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

import services.settings
from engines.sglang_args import check_server_args
from launcher.checks import train_config
from launcher.cli import build_parser, main
from launcher.commands import _engine_env
from launcher.model import engine_env
from services.engine.settings import EngineSettings
from services.rollout.settings import LEGACY_MODEL_ID, RolloutSettings
from services.settings import SettingsError, load_settings
from tests.ports import free_port
from tests.services.conftest import RunningServer
from tests.services.rollout.test_e2e import Stack
from tests.services.test_model_ref import fake_hub_snapshot

HI: list[Any] = [{"role": "user", "content": "hi"}]
HUB_REPO = "acme/tiny-omni-7b"


class Roles:
    """One stack, three rollout roles over it: the model as the folder ``tiny-omni-7b`` (no name given), as the hub
    id ``acme/tiny-omni-7b`` (its snapshot in a hub cache here), and with two names given."""

    def __init__(self, root: Path) -> None:
        self.stack = Stack(root)
        folder = root / "tiny-omni-7b"
        folder.symlink_to(self.stack.model)  # the same model under a folder name of its own
        self.by_folder = self.stack.rollout(model=folder)
        cache = root / "hub"
        fake_hub_snapshot(cache, HUB_REPO, self.stack.model, "c" * 40, "main")
        with pytest.MonkeyPatch.context() as patch:  # the hub id resolves in this cache only, never online
            patch.setenv("HF_HUB_CACHE", str(cache))
            patch.setenv("HF_HUB_OFFLINE", "1")
            self.by_hub_id = self.stack.rollout(model=HUB_REPO)
        self.named = self.stack.rollout(served_model_name="acme/omni-rl, omni")


@pytest.fixture(scope="module")
def roles(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Roles]:
    roles = Roles(tmp_path_factory.mktemp("served"))
    yield roles
    roles.stack.close()


def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_by_default_the_model_is_served_under_its_folders_name(roles: Roles) -> None:
    chat = client(roles.by_folder)
    assert [m.id for m in chat.models.list()] == ["tiny-omni-7b"]
    card = chat.models.retrieve("tiny-omni-7b")
    assert card.id == "tiny-omni-7b" and card.object == "model"
    reply = chat.chat.completions.create(model="tiny-omni-7b", messages=HI, max_tokens=2)
    assert reply.model == "tiny-omni-7b"
    text = chat.completions.create(model="tiny-omni-7b", prompt="hi", max_tokens=2)
    assert text.model == "tiny-omni-7b"
    chunks = list(chat.chat.completions.create(model="tiny-omni-7b", messages=HI, max_tokens=2, stream=True))
    assert chunks and {chunk.model for chunk in chunks} == {"tiny-omni-7b"}


def test_a_hub_id_is_served_under_owner_and_name(roles: Roles) -> None:
    chat = client(roles.by_hub_id)
    assert [m.id for m in chat.models.list()] == [HUB_REPO]
    assert chat.models.retrieve(HUB_REPO).id == HUB_REPO  # a name with a slash: GET /v1/models/acme/tiny-omni-7b
    assert chat.chat.completions.create(model=HUB_REPO, messages=HI, max_tokens=2).model == HUB_REPO


def test_names_given_are_each_listed_and_served_the_first_reported(roles: Roles) -> None:
    chat = client(roles.named)
    assert [m.id for m in chat.models.list()] == ["acme/omni-rl", "omni"]  # vLLM lists each name, in order
    assert chat.models.retrieve("omni").id == "omni"
    assert chat.models.retrieve("acme/omni-rl").id == "acme/omni-rl"
    for name in ("acme/omni-rl", "omni"):  # as vLLM: any name is served, the answer reports the first
        assert chat.chat.completions.create(model=name, messages=HI, max_tokens=2).model == "acme/omni-rl"
        assert chat.completions.create(model=name, prompt="hi", max_tokens=2).model == "acme/omni-rl"
    with pytest.raises(openai.NotFoundError):  # the folder's own name is not one of those given
        chat.chat.completions.create(model="model", messages=HI, max_tokens=2)


def test_the_old_id_is_still_served_but_not_listed(roles: Roles) -> None:
    for server, served in ((roles.by_folder, "tiny-omni-7b"), (roles.named, "acme/omni-rl")):
        chat = client(server)
        assert LEGACY_MODEL_ID not in [m.id for m in chat.models.list()]
        assert chat.models.retrieve(LEGACY_MODEL_ID).id == LEGACY_MODEL_ID
        assert chat.chat.completions.create(model=LEGACY_MODEL_ID, messages=HI, max_tokens=2).model == served
        assert chat.completions.create(model=LEGACY_MODEL_ID, prompt="hi", max_tokens=2).model == served


def test_another_name_is_404_model_not_found_in_openais_shape(roles: Roles) -> None:
    chat = client(roles.by_folder)
    with pytest.raises(openai.NotFoundError) as missing:
        chat.models.retrieve("gpt-4o")
    assert missing.value.code == "model_not_found" and missing.value.type == "invalid_request_error"
    for create in (
        lambda: chat.chat.completions.create(model="gpt-4o", messages=HI, max_tokens=2),
        lambda: chat.chat.completions.create(model="gpt-4o", messages=HI, max_tokens=2, stream=True),
        lambda: chat.completions.create(model="gpt-4o", prompt="hi", max_tokens=2),
    ):
        with pytest.raises(openai.NotFoundError) as refused:
            create()
        assert refused.value.code == "model_not_found" and refused.value.param == "model"
    answer = httpx.post(
        f"{roles.by_folder.url}/v1/chat/completions", json={"model": "model", "messages": HI, "max_tokens": 2}
    )
    error = answer.json()["error"]
    assert answer.status_code == 404 and set(error) >= {"message", "type", "param", "code"}
    assert error["message"].startswith("The model `model` does not exist") and "`tiny-omni-7b`" in error["message"]
    assert httpx.get(f"{roles.by_folder.url}/v1/models/nothing/here").json()["error"]["code"] == "model_not_found"


def test_the_engine_role_names_the_model_as_the_rollout_role_does(roles: Roles) -> None:
    engine = roles.stack.engine_urls[0]
    assert [m["id"] for m in httpx.get(f"{engine}/v1/models").json()["data"]] == ["model"]
    assert httpx.get(f"{engine}/model_info").json()["served_model_name"] == "model"
    given = EngineSettings(model=roles.stack.model, served_model_name="acme/omni-rl,omni")
    assert given.served_model_name == ["acme/omni-rl", "omni"]


def test_the_names_are_checked_at_start_up(tmp_path: Path) -> None:
    folder = tmp_path / "Acme-Omni-7B"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert RolloutSettings(model=folder).served_model_name == ["Acme-Omni-7B"]
    assert RolloutSettings(model=folder, served_model_name="").served_model_name == ["Acme-Omni-7B"]  # compose's
    assert RolloutSettings(model=folder, served_model_name="a, b,a").served_model_name == ["a", "b"]
    with pytest.raises(SettingsError, match="WEIR_SERVED_MODEL_NAME"):
        load_settings(RolloutSettings, model=folder, served_model_name="two words")
    with pytest.raises(ValueError, match="WEIR_SERVED_MODEL_NAME"):  # SGLang's own option is Weir's setting here
        check_server_args({"served_model_name": "x"}, fields=None)


class _Built(Exception):
    """Stops `weir serve` once its settings are built (nothing is served)."""


def test_serve_passes_the_names_to_the_roles_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "Acme-Omni-7B"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    for variable in ("WEIR_MODEL", "WEIR_SERVED_MODEL_NAME"):  # `weir serve` sets them: put back after the test
        monkeypatch.setenv(variable, "")
        monkeypatch.delenv(variable)
    built: list[Any] = []
    real = services.settings.load_settings

    def load(cls: Any, **overrides: Any) -> Any:
        built.append(real(cls, **overrides))
        raise _Built

    monkeypatch.setattr(services.settings, "load_settings", load)
    serve = ["serve", "rollout", "--port", str(free_port()), "--model", str(folder)]
    with pytest.raises(_Built):
        main([*serve, "--served-model-name", "acme/omni-rl", "omni"])
    assert built[-1].served_model_name == ["acme/omni-rl", "omni"]
    monkeypatch.delenv("WEIR_SERVED_MODEL_NAME")
    with pytest.raises(_Built):
        main(serve)
    assert built[-1].served_model_name == ["Acme-Omni-7B"]
    with pytest.raises(SystemExit):  # a name with a space: refused by argparse, status 2
        build_parser().parse_args(["serve", "rollout", "--served-model-name", "two words"])


def test_up_and_train_give_the_names_to_every_role_of_the_stack(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    up = build_parser().parse_args(["up", "--served-model-name", "acme/omni-rl,omni"])
    assert _engine_env(up) == {"WEIR_SERVED_MODEL_NAME": "acme/omni-rl,omni"}
    assert "WEIR_SERVED_MODEL_NAME" not in _engine_env(build_parser().parse_args(["up"]))
    # The config `weir train` runs (`launcher.commands._train`), and the env of the stack it starts from it.
    train = build_parser().parse_args(["train", "--demo", "--home", str(tmp_path / "w"), "--served-model-name", "omni"])
    assert engine_env(train_config(train)) == {"WEIR_SERVED_MODEL_NAME": "omni"}
    attach = ["train", "--demo", "--attach", "--home", str(tmp_path / "a"), "--served-model-name", "omni"]
    assert main(attach) == 2
    said = capsys.readouterr()
    assert "with --attach the stack serves it under its own names" in " ".join((said.out + said.err).split())
