"""Settings of the rollout role (``WEIR_*``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

__all__ = ["RolloutSettings"]


class RolloutSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="WEIR_", extra="ignore")

    model: Path = Path(".weir/model")  # tokenizer and chat template come from here
    served_model_name: str = "weir-tiny-omni"
    engine_urls: Annotated[list[str], NoDecode] = ["http://127.0.0.1:30000"]
    preprocess_url: str = "http://127.0.0.1:8101"
    # The encoder role: media go to Weir engines as cached embeddings (one tower forward per unique
    # item per weights version). Empty: engines run the towers themselves, per sample.
    encoder_url: str = ""
    # Ask engines for the experts each token was routed to (MoE models; SGLang's R3 capture).
    return_routed_experts: bool = False
    experience_path: Path = Path(".weir/experience.jsonl")  # used when there is no data role
    data_url: str = ""  # the data role: finished groups are appended there
    request_timeout_s: float = Field(300.0, gt=0)
    max_n: int = Field(64, gt=0)
    max_inflight_media_tokens: int = Field(1_000_000, gt=0)
    max_inflight_bytes: int = Field(1 << 30, gt=0)
    default_max_tokens: int = Field(256, gt=0)

    @field_validator("engine_urls", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        return [u for u in value.split(",") if u] if isinstance(value, str) else value
