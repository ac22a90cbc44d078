"""The rollout role's settings: code is chosen here, checked at construction; bad values name their variable."""

from __future__ import annotations

from pathlib import Path

import pytest

from encoders.embedded_model import init_model
from services.rollout.settings import RolloutSettings
from services.settings import RoleSettings, SettingsError, load_settings


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("settings") / "model")


def not_async(ctx: object, prompt: object, /, **_: object) -> None:
    return None


async def an_async_rollout(ctx: object, prompt: object, /, **_: object) -> None:
    return None


def test_from_the_environment(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEIR_MODEL", str(model))
    monkeypatch.setenv("WEIR_ENGINE_URLS", "http://a:1, sglang+http://b:2,")
    monkeypatch.setenv("WEIR_ENCODER_URL", "")
    monkeypatch.setenv("WEIR_SPOOL_DIR", "")  # empty: no spool, as an unset variable
    monkeypatch.setenv("WEIR_REWARD_FUNCTIONS", "flaky=tests.services.rewards_for_tests:flaky, mine=builtins:len")
    monkeypatch.setenv("WEIR_ROLLOUT_FUNCTION", f"{__name__}:an_async_rollout")
    settings = load_settings(RolloutSettings)
    assert settings.engine_urls == ["http://a:1", "sglang+http://b:2"] and settings.encoder_url is None
    assert settings.spool_dir is None
    assert settings.reward_functions == {"flaky": "tests.services.rewards_for_tests:flaky", "mine": "builtins:len"}
    assert settings.rollout_function == f"{__name__}:an_async_rollout"
    assert load_settings(RolloutSettings, rollout_function="rollout.group:rollout_group")


@pytest.mark.parametrize(
    "variable,value,problem",
    [
        ("WEIR_REWARD_FUNCTIONS", "flaky", "is not 'name=package.module:function'"),
        ("WEIR_REWARD_FUNCTIONS", "r=no_such_package.anywhere:f", "does not import"),
        ("WEIR_REWARD_FUNCTIONS", "r=tests.services.rewards_for_tests:nothing", "has no attribute"),
        ("WEIR_REWARD_FUNCTIONS", "math=tests.services.rewards_for_tests:flaky", "built-in reward type"),
        ("WEIR_REWARD_FUNCTIONS", "a=builtins:len,a=builtins:abs", "given twice"),
        ("WEIR_ROLLOUT_FUNCTION", f"{__name__}:not_async", "not an async function"),
        ("WEIR_ROLLOUT_FUNCTION", "rollout.group:no_such_function", "has no attribute"),
        ("WEIR_ROLLOUT_FUNCTION", "rollout.group.rollout_group", "is not 'package.module:function'"),
        ("WEIR_ENGINE_URLS", "127.0.0.1:30000", "is not http(s)://host:port"),
        ("WEIR_ENGINE_URLS", "", "at least 1 item"),
        ("WEIR_MAX_N", "0", "greater than 0"),
    ],
)
def test_a_bad_value_names_its_variable(
    variable: str, value: str, problem: str, model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WEIR_MODEL", str(model))
    monkeypatch.setenv(variable, value)
    with pytest.raises(SettingsError) as refused:
        load_settings(RolloutSettings)
    assert variable in str(refused.value) and problem in str(refused.value), str(refused.value)


def test_a_missing_model_folder_is_an_error_never_a_new_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEIR_MODEL", str(tmp_path / "typo"))
    with pytest.raises(SettingsError, match="WEIR_MODEL"):
        load_settings(RolloutSettings)
    assert not (tmp_path / "typo").exists()


def test_every_setting_is_described() -> None:
    own = set(RolloutSettings.model_fields) - set(RoleSettings.model_fields)  # the shared ones are not ours
    assert {"reward_functions", "rollout_function", "engine_urls", "model"} <= own
    undocumented = [name for name in sorted(own) if not RolloutSettings.model_fields[name].description]
    assert undocumented == []
    assert "async def f(ctx: rollout.RolloutContext" in str(
        RolloutSettings.model_fields["rollout_function"].description
    )
