"""Settings of the engine role (``WEIR_*``), checked at start-up.

``WEIR_MODEL`` must name a model folder (a ``config.json`` in it): a mistyped path is an error,
never a quietly created random model — ``weir up`` and ``weir init-model`` make the tiny one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import NoDecode

from engines.sglang_args import (
    check_server_args,
    engine_gpus,
    parse_server_args,
    served_architectures,
    unserved_refusal,
)

from ..media_roots import MediaRoots
from ..media_urls import MediaUrls
from ..settings import ModelFolder, RoleSettings, ServedModelNames, served_or_own

__all__ = ["EngineSettings"]


class EngineSettings(RoleSettings, MediaUrls):
    """Every field is ``WEIR_<NAME>``; the media URL rule's (``WEIR_ALLOW_URLS``, ``WEIR_ALLOW_PRIVATE_URLS``,
    ``WEIR_MEDIA_URL_HOSTS``, ``WEIR_MEDIA_URL_TIMEOUT_S``) come from `MediaUrls`, as in every role."""

    model: ModelFolder = Field(
        Path(".weir/model"), description="the model folder served (a Qwen2.5-Omni thinker for transformers)"
    )
    served_model_name: ServedModelNames = Field(
        [],
        description="the model's names, comma-separated: GET /v1/models and /model_info give the first, as SGLang "
        "gives its --served-model-name (default: the model's own name, its folder's name or owner/name for a hub id)",
    )
    backend: Literal["transformers", "sglang", "sim"] = Field(
        "transformers",
        description="transformers (CPU, or a GPU without SGLang), sglang (in-process, CUDA) or sim (a simulated "
        "engine: no weights, times from WEIR_SIM_PROFILE's cost model)",
    )
    sim_profile: Path | None = Field(
        None, description="the sim backend's profile (YAML or JSON: vocabulary, context, cost model); needed for sim"
    )
    sim_compression: float | None = Field(
        None, gt=0, description="the sim backend's simulated seconds per wall second (default: the profile's)"
    )
    weights_group_timeout_s: float = Field(
        600.0,
        gt=0,
        le=86400,
        description="how long /init_weights_update_group and /update_weights_from_distributed wait for the "
        "trainer's rank (transformers backend); past it they answer success: false",
    )
    device: str | None = Field(
        None, description="torch device; default cpu for transformers, SGLang's own choice for sglang"
    )
    max_running: int | None = Field(
        None, gt=0, description="requests generated at once; default 8 for transformers, SGLang's own for sglang"
    )
    return_routed_experts: bool = Field(
        False,
        description="MoE models (R3): start SGLang with enable_return_routed_experts so requests may ask for each "
        "token's experts (the transformers backend answers them without it); the same variable makes the rollout "
        "role ask for them",
    )
    sglang_args: Annotated[dict[str, Any], NoDecode] = Field(
        default_factory=dict,
        description="SGLang's server arguments as a JSON object of ServerArgs fields by SGLang's name, e.g. "
        '\'{"tp_size": 2, "mem_fraction_static": 0.8, "context_length": 32768, "chunked_prefill_size": 8192}\'; '
        "names are checked against the installed SGLang (WEIR_BACKEND=sglang only)",
    )
    engine_gpus: int | None = Field(
        None,
        gt=0,
        description="GPUs this engine is given (compose's reservation, Ray's num_gpus); with sglang, tp_size "
        "defaults to it and tp × pp × dp must equal it",
    )
    cache_dir: Path = Field(Path(".weir/cache"), description="the feature cache shared with the preprocess role")
    embedding_cache_dir: Path = Field(
        Path(".weir/embeddings"), description="the embedding cache shared with the encoder role"
    )
    cache_max_bytes: int = Field(10 << 30, gt=0, description="byte budget of each of the two caches")
    request_timeout_s: float = Field(
        600.0, gt=0, description="a /generate that has not finished by then is aborted (504 generation_timeout)"
    )
    media_roots: MediaRoots = Field(
        [],
        description="folders image_data / video_data / audio_data paths (and file:// URLs) may name, "
        "':'-separated; none: paths are refused",
    )
    max_media_bytes: int = Field(
        128 << 20, gt=0, description="the largest media item /generate decodes (or reads from a media URL)"
    )

    @field_validator("sglang_args", mode="before")
    @classmethod
    def _sglang_args_json(cls, value: Any) -> Any:
        # read here, not by the settings source, so that compose's empty ${WEIR_SGLANG_ARGS:-} means none
        return parse_server_args(value) if isinstance(value, str) else value

    @field_validator("sglang_args")
    @classmethod
    def _no_reserved_sglang_args(cls, args: dict[str, Any]) -> dict[str, Any]:
        return check_server_args(args, fields=None)  # names: against the installed SGLang, when the engine starts

    @model_validator(mode="after")
    def _served_name_default(self) -> EngineSettings:
        self.served_model_name = served_or_own(self.served_model_name, self.model)
        return self

    @model_validator(mode="after")
    def _sglang_args_for_sglang(self) -> EngineSettings:
        if self.sglang_args and self.backend != "sglang":
            raise ValueError(f"WEIR_SGLANG_ARGS is for WEIR_BACKEND=sglang, not {self.backend}")
        if self.backend == "sglang" and self.engine_gpus is not None:
            if "tp_size" not in self.sglang_args:
                self.sglang_args = {**self.sglang_args, "tp_size": self.engine_gpus}
            needed = engine_gpus(self.sglang_args)
            if needed != self.engine_gpus:
                raise ValueError(
                    f"WEIR_SGLANG_ARGS needs {needed} GPUs per engine (tp_size × pp_size × dp_size) but "
                    f"WEIR_ENGINE_GPUS gives it {self.engine_gpus}"
                )
        return self

    @model_validator(mode="after")
    def _a_model_sglang_serves(self) -> EngineSettings:
        """On SGLang, a model it has no model for is refused here, in one line, not as its traceback."""
        if self.backend == "sglang":
            config = json.loads((Path(self.model) / "config.json").read_text())
            why = unserved_refusal(list(config.get("architectures") or []), self.sglang_args, served_architectures())
            if why:
                raise ValueError(f"WEIR_MODEL: {why}")
        return self

    @model_validator(mode="after")
    def _sim_needs_a_profile(self) -> EngineSettings:
        if self.backend == "sim":
            if self.sim_profile is None:
                raise ValueError("WEIR_BACKEND=sim needs WEIR_SIM_PROFILE (a profile file, e.g. profiles/*.yaml)")
            if not self.sim_profile.is_file():
                raise ValueError(f"WEIR_SIM_PROFILE: {self.sim_profile} is not a file")
        return self
