"""The table of roles: name, app factory, settings, default port — read by ``weir serve``, ``weir up``
and the compose test, so a port or a factory is written in one place.

A second stack on one host shifts every port by the same offset (`Role.port_at`): ``weir up
--base-port 9100`` puts the rollout role on 9100, preprocess on 9101, …, the first engine on 31000.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastapi import FastAPI
    from pydantic_settings import BaseSettings

__all__ = ["BASE_PORT", "ROLES", "Role", "role"]

BASE_PORT = 8100  # the rollout role's port; every default port is relative to it


@dataclass(frozen=True, slots=True, kw_only=True)
class Role:
    name: str
    app: str  # "module:create_app"; create_app(settings) -> FastAPI
    settings: str  # "module:Class", a RoleSettings subclass
    port: int  # the default port (with the default base port)
    summary: str

    def port_at(self, base_port: int = BASE_PORT, index: int = 0) -> int:
        """This role's port when the stack's base port is ``base_port`` (``index``: the i-th engine)."""
        return self.port + (base_port - BASE_PORT) + index

    def settings_class(self) -> type[BaseSettings]:
        return _load(self.settings)  # type: ignore[no-any-return]

    def create_app(self, settings: Any) -> FastAPI:
        return _load(self.app)(settings)  # type: ignore[no-any-return]


def _load(target: str) -> Any:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


# In start-up order: a role starts after the roles it calls.
ROLES: dict[str, Role] = {
    r.name: r
    for r in (
        Role(
            name="preprocess",
            app="services.preprocess.app:create_app",
            settings="services.preprocess.settings:PreprocessSettings",
            port=8101,
            summary="media → token-budgeted features in the feature cache",
        ),
        Role(
            name="encoder",
            app="services.encoder.app:create_app",
            settings="services.encoder.settings:EncoderSettings",
            port=8102,
            summary="features → embeddings, once per unique item per weights version",
        ),
        Role(
            name="data",
            app="services.data.app:create_app",
            settings="services.data.settings:DataSettings",
            port=8103,
            summary="durable experience in, token-budgeted micro-batches out",
        ),
        Role(
            name="engine",
            app="services.engine.app:create_app",
            settings="services.engine.settings:EngineSettings",
            port=30000,
            summary="one generation engine behind SGLang's HTTP API",
        ),
        Role(
            name="rollout",
            app="services.rollout.app:create_app",
            settings="services.rollout.settings:RolloutSettings",
            port=8100,
            summary="rollout requests and OpenAI-compatible chat",
        ),
    )
}


def role(name: str) -> Role:
    return ROLES[name]
