"""What every role's settings share: ``WEIR_*`` variables read by pydantic-settings, checked at start-up.

`RoleSettings` is the base of each role's ``settings.py``; `ModelFolder` is a model folder that must
exist, given as a folder or a Hugging Face hub id (``owner/name[@revision]``, its snapshot in the cache:
`services.model_ref`); a mistyped ``WEIR_MODEL`` is an error, never a quietly created random model.
`ServedModelNames` is ``WEIR_SERVED_MODEL_NAME``, the names the OpenAI routes give the model (`served_or_own`:
the model's own name when none is given). Settings are
built in a function (`load_settings`), never at import; a bad value raises `SettingsError` naming
the variable.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, TypeVar

from pydantic import BeforeValidator, Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from .model_ref import model_folder, model_name, served_names

__all__ = ["ModelFolder", "RoleSettings", "ServedModelNames", "SettingsError", "load_settings", "served_or_own"]


def _model_folder(value: object) -> object:
    # A hub id is not a path to check: it becomes its snapshot folder first (`services.model_ref`).
    return model_folder(value) if isinstance(value, str | Path) else value


ModelFolder = Annotated[Path, BeforeValidator(_model_folder)]


def _served_names(value: object) -> object:
    # compose's empty ${WEIR_SERVED_MODEL_NAME:-} means none given, as an unset variable does
    if isinstance(value, list | tuple) and all(isinstance(name, str) for name in value):
        value = ",".join(value)
    return served_names(value) if isinstance(value, str) else value


# ``a,b``: the model answers to both; the first is the one its answers report (`services.model_ref.served_names`)
ServedModelNames = Annotated[list[str], NoDecode, BeforeValidator(_served_names)]


def served_or_own(names: list[str], model: Path) -> list[str]:
    """The names given, else the model's own (`services.model_ref.model_name`: the folder's name, ``owner/name``
    for a hub snapshot), as SGLang's and vLLM's served name defaults to the model they were given."""
    return names or [model_name(model)]


class RoleSettings(BaseSettings):
    """Settings every role has. Defaults serve the embedded (laptop) mode."""

    model_config = SettingsConfigDict(env_prefix="WEIR_", extra="ignore", validate_default=True)

    api_token: SecretStr | None = Field(
        None, description="when set, every request but the health checks needs 'Authorization: Bearer <token>'"
    )
    api_token_file: Path | None = Field(None, description="a file holding the token (compose's shared secret)")
    log_level: str = Field("info", pattern=r"^(?i:debug|info|warning|error|critical)$")
    max_body_bytes: int = Field(256 << 20, gt=0, description="larger request bodies get 413")
    role_restarts: int = Field(
        0, ge=0, description="times the local stack's supervisor restarted this role (weir_role_restarts_total)"
    )

    @field_validator("api_token", mode="before")
    @classmethod
    def _blank_is_unset(cls, value: object) -> object:
        # WEIR_API_TOKEN= (as `${WEIR_API_TOKEN:-}` in compose gives) means "no token here", never
        # "the empty token": the file, when one is named, is then read; otherwise the role is open.
        if isinstance(value, str) and not value.strip():
            return None
        if isinstance(value, str) and value != value.strip():
            raise ValueError("WEIR_API_TOKEN has leading or trailing whitespace")
        return value

    @model_validator(mode="after")
    def _token_from_file(self) -> RoleSettings:
        if self.api_token is None and self.api_token_file is not None:
            try:
                token = self.api_token_file.read_text().strip()
            except OSError as error:
                raise ValueError(f"WEIR_API_TOKEN_FILE={self.api_token_file} cannot be read: {error}") from None
            if not token:
                raise ValueError(f"WEIR_API_TOKEN_FILE={self.api_token_file} is empty")
            self.api_token = SecretStr(token)
        return self

    @property
    def token(self) -> str | None:
        """The token as a string, for the clients this role calls other roles with."""
        return self.api_token.get_secret_value() if self.api_token is not None else None


class SettingsError(ValueError):
    """A ``WEIR_*`` variable has a bad value; the message names it."""


S = TypeVar("S", bound=BaseSettings)


def load_settings(cls: type[S], **overrides: Any) -> S:
    """``cls`` from the environment (and ``overrides``), or a `SettingsError` that names each variable."""
    try:
        return cls(**overrides)
    except ValidationError as error:
        prefix = str(cls.model_config.get("env_prefix", ""))
        lines = []
        for problem in error.errors():
            name = f"{prefix}{'_'.join(str(p) for p in problem['loc']).upper()}"
            message = str(problem["msg"]).removeprefix("Value error, ")
            lines.append(message if not problem["loc"] or message.startswith(name) else f"{name}: {message}")
        raise SettingsError(f"bad {cls.__name__}: " + "; ".join(lines)) from None
