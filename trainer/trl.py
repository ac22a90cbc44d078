"""TRL's `GRPOTrainer`, unmodified, generating through Weir: its ``rollout_func`` (`WeirRollout`) and a
`transformers.TrainerCallback` (`PublishWeights`) that puts the trainer's weights on Weir's engines after
every optimizer step.

    from trl import GRPOConfig, GRPOTrainer
    from trainer.trl import PublishWeights, WeirRollout

    trainer = GRPOTrainer(
        model=folder,  # the model the stack serves
        reward_funcs=my_reward,
        args=GRPOConfig(..., temperature=1.0),
        train_dataset=dataset,  # conversational prompts; images in an "image" / "images" column
        rollout_func=WeirRollout(rollout_url, token=token),
        callbacks=[PublishWeights(engine_urls, token=token)],
    )
    trainer.train()

`WeirRollout` receives the prompts of one generation batch as TRL's repeat sampler lays them out (each prompt
``num_generations`` times in a row), sends each run of equal prompts to the rollout role as one
``POST /v1/rollouts`` prompt with ``n`` = the run's length (media items go through the preprocess role and
its feature cache), and answers what TRL asks of a rollout function: ``prompt_ids`` (the rollout role's chat
template, media placeholders expanded to their exact token counts), ``completion_ids`` and ``logprobs`` (the
engines' log-probs of the sampled tokens), plus ``weir_policy_version`` (the weights version that generated
each sample), which TRL forwards to the reward functions.

The log-probs are the model's own distribution (temperature 1, before penalties and filters): TRL's
recomputed ``old_per_token_logps`` divide the logits by ``temperature``, so the two agree at
``temperature=1.0`` only (`WeirRollout` warns otherwise). TRL 1.16 reads them as ``sampling_per_token_logps``
in its off-policy sequence mask (``off_policy_mask_threshold``); its truncated importance sampling
(``vllm_importance_sampling_correction``) runs only with ``use_vllm=True``, which needs vLLM installed.

`PublishWeights` publishes the model's weights as version ``state.global_step`` at the start of training and
after every optimizer step — through a folder of safetensors (``update_weights_from_disk``, the default) or by
broadcast over gloo / NCCL (``via="broadcast"``, no files) — so the next generation batch is sampled from the
weights TRL just produced. Only the main process publishes; tested on one process (`tests/trainer/test_trl.py`).

This module imports neither TRL nor FastAPI: the trainer object is TRL's, read through its public attributes.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal, Protocol, TypedDict

import torch
from PIL import Image
from transformers import PreTrainedModel, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from encoders.embedded_model import save_released
from encoders.file_modes import as_umask_allows
from engines.client import EngineClient
from experience.records import Group, Sample
from rollout.api import RolloutRequest
from rollout.client import RolloutClient

from .hf_folder import WeightInfo, as_files_hold, base_weights, weight_files
from .publish import BroadcastWeightSync, publish_weights

__all__ = ["PublishWeights", "TrlRollout", "TrlTrainer", "WeirRollout", "engine_weight_versions", "weir_messages"]

logger = logging.getLogger(__name__)


class TrlTrainer(Protocol):
    """What `WeirRollout` reads of TRL's `GRPOTrainer` (its public attributes)."""

    max_completion_length: int
    temperature: float
    top_p: float
    top_k: int | None
    min_p: float | None
    repetition_penalty: float | None
    state: TrainerState


class TrlRollout(TypedDict):
    """What a TRL ``rollout_func`` returns: one entry per prompt it was given (``weir_policy_version`` goes to
    TRL's reward functions as a keyword)."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    logprobs: list[list[float]]
    weir_policy_version: list[int | None]


def _image_url(image: object) -> str:
    """A PIL image (TRL's ``{"type": "image", "image": <Image>}``), or a path / URL string, as an ``image_url``:
    a PNG data URI for a picture in memory, the string as given otherwise (a path under the preprocess role's
    media roots, a data URI)."""
    if isinstance(image, str):
        return image
    if not isinstance(image, Image.Image):
        raise TypeError(f"an image part holds a PIL image or a string, not {type(image).__name__}")
    out = io.BytesIO()
    image.save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def _part(part: object) -> object:
    if isinstance(part, Mapping) and part.get("type") == "image":
        return {"type": "image_url", "image_url": {"url": _image_url(part.get("image") or part.get("url"))}}
    return part


def weir_messages(prompt: str | Sequence[Mapping[str, object]]) -> list[dict[str, object]]:
    """One of TRL's conversational prompts (a list of messages, images as TRL's ``{"type": "image"}`` parts)
    as the rollout role's messages (images as ``image_url`` parts)."""
    if isinstance(prompt, str):
        raise ValueError(
            "WeirRollout takes conversational prompts (a list of messages): the rollout role applies the "
            "model's chat template itself; got a string"
        )
    messages = []
    for message in prompt:
        content = message.get("content")
        if isinstance(content, list):
            content = [_part(part) for part in content]
        messages.append({**message, "content": content})
    return messages


def _runs(keys: Sequence[str]) -> list[tuple[int, int]]:
    """(start, length) of every run of equal consecutive keys."""
    runs: list[tuple[int, int]] = []
    for i, key in enumerate(keys):
        if runs and keys[runs[-1][0]] == key:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


class WeirRollout:
    """TRL's ``rollout_func``: ``rollout(prompts, trainer) -> {"prompt_ids", "completion_ids", "logprobs",
    "weir_policy_version"}``, every sample generated by the rollout role at ``rollout_url``.

    Sampling follows the trainer's settings (``max_completion_length``, ``temperature``, ``top_p``, ``top_k``,
    ``min_p``, ``repetition_penalty``); ``sampling_params`` adds or overrides SGLang sampling keys. ``seed``:
    each group's ``sampling_seed`` is drawn from (seed, step, group), so a run repeats; None leaves sampling
    unseeded. ``budget``: the request's media token budget (`rollout.api.Budget` fields). ``record``: also
    record the groups as experience (the data role); TRL trains on what it is returned, so off by default.
    """

    def __init__(
        self,
        rollout_url: str,
        *,
        token: str | None = None,
        timeout_s: float = 600.0,
        seed: int | None = None,
        sampling_params: Mapping[str, object] | None = None,
        budget: Mapping[str, object] | None = None,
        record: bool = False,
    ) -> None:
        self.client = RolloutClient(rollout_url, token=token, timeout_s=timeout_s)
        self.seed, self.record = seed, record
        self.sampling_params = dict(sampling_params or {})
        self.budget = dict(budget) if budget else None
        self.calls = 0
        self.versions: list[int | None] = []  # the weights version of each sample of the last call
        self._warned = False

    def sampling(self, trainer: TrlTrainer) -> dict[str, object]:
        """The SGLang sampling parameters of ``trainer``'s settings, then ``sampling_params``."""
        params: dict[str, object] = {
            "max_new_tokens": int(trainer.max_completion_length),
            "temperature": float(trainer.temperature),
            "top_p": float(trainer.top_p),
        }
        if trainer.top_k:
            params["top_k"] = int(trainer.top_k)
        if trainer.min_p:
            params["min_p"] = float(trainer.min_p)
        if trainer.repetition_penalty not in (None, 1.0):
            params["repetition_penalty"] = float(trainer.repetition_penalty)
        params.update(self.sampling_params)
        if params["temperature"] != 1.0 and not self._warned:
            self._warned = True
            logger.warning(
                "temperature %s: Weir's log-probs are the model's at temperature 1, TRL's recomputed ones at %s",
                params["temperature"],
                params["temperature"],
            )
        return params

    def request(
        self, prompts: Sequence[str | Sequence[Mapping[str, object]]], trainer: TrlTrainer
    ) -> tuple[RolloutRequest, list[tuple[int, int]]]:
        """The rollout request for ``prompts`` (one prompt per run of equal prompts) and the runs."""
        messages = [weir_messages(prompt) for prompt in prompts]
        runs = _runs([json.dumps(m, sort_keys=True, default=str) for m in messages])
        sampling = self.sampling(trainer)
        step = int(trainer.state.global_step)
        body: dict[str, object] = {
            "prompts": [
                {
                    "messages": messages[start],
                    "n": count,
                    **(
                        {"sampling_params": {"sampling_seed": (self.seed * 1_000_003 + step * 4_099 + i) % 2**31}}
                        if self.seed is not None
                        else {}
                    ),
                }
                for i, (start, count) in enumerate(runs)
            ],
            "sampling_params": sampling,
            "record": self.record,
        }
        if self.budget:
            body["budget"] = self.budget
        return RolloutRequest.model_validate(body), runs

    def __call__(self, prompts: Sequence[str | Sequence[Mapping[str, object]]], trainer: TrlTrainer) -> TrlRollout:
        request, runs = self.request(prompts, trainer)
        groups = self.client.rollouts(request).groups
        self.calls += 1
        out = TrlRollout(prompt_ids=[], completion_ids=[], logprobs=[], weir_policy_version=[])
        for (_, count), group in zip(runs, groups, strict=True):
            samples = sorted(group.samples, key=lambda s: s.index)
            if len(samples) != count:
                raise RuntimeError(f"group {group.group_id}: {len(samples)} samples for {count} asked")
            for sample in samples:
                _check(group, sample)
                out["prompt_ids"].append(list(group.prompt_ids))
                out["completion_ids"].append(list(sample.response_ids))
                out["logprobs"].append(list(sample.logprobs))
                out["weir_policy_version"].append(sample.policy_version)
        self.versions = list(out["weir_policy_version"])
        return out

    def close(self) -> None:
        self.client.close()


def _check(group: Group, sample: Sample) -> None:
    """A sample TRL can train on: generated (``ok``), at least one token, every token from the policy."""
    if sample.status != "ok":
        raise RuntimeError(f"group {group.group_id} sample {sample.index} is {sample.status}: {sample.error}")
    if not sample.response_ids:
        raise RuntimeError(f"group {group.group_id} sample {sample.index} generated nothing")
    if sample.loss_mask is not None and not all(sample.loss_mask):
        raise RuntimeError("multi-turn samples (tools, environments) carry observations: use TRL's own tools")


def engine_weight_versions(engine_urls: Sequence[str], *, token: str | None = None) -> list[str]:
    """Every engine's ``/get_weight_version``, in order."""
    versions = []
    for url in engine_urls:
        with EngineClient(url, token=token) as engine:
            versions.append(engine.get_weight_version().weight_version)
    return versions


class PublishWeights(TrainerCallback):  # type: ignore[misc]
    """After every optimizer step (``on_step_end``), and once at the start of training, the trainer's weights
    to every engine as version ``state.global_step``.

    ``via="disk"``: written as safetensors under ``folder`` (a temporary folder when None) and loaded with
    ``update_weights_from_disk`` (`trainer.publish.publish_weights`: engines paused meanwhile, an unreachable
    one skipped). ``via="broadcast"``: the tensors broadcast from this process (`trainer.publish.BroadcastWeightSync`:
    gloo on the CPU, NCCL on CUDA) to engines that join a group at ``master_address:master_port`` — as the model's
    files hold them (and said so at the join: what SGLang's loaders read, a MoE model's experts included) when the
    model was read from a local folder of safetensors, else as transformers' module holds them.

    ``encoder_url``: the encoder role, pointed at the new weights (a folder, either way) while the engines are
    paused — needed for a model with media whose towers TRL trains (it does unless they are frozen): the encoder
    role caches the towers' embeddings per weights version, and the engines read them. ``data_url``: the data role
    told the new policy version. ``published``: every version sent, in order.
    """

    def __init__(
        self,
        engine_urls: Sequence[str],
        *,
        token: str | None = None,
        via: Literal["disk", "broadcast"] = "disk",
        folder: str | Path | None = None,
        data_url: str | None = None,
        encoder_url: str | None = None,
        master_address: str = "127.0.0.1",
        master_port: int | None = None,
        timeout_s: float = 300.0,
    ) -> None:
        if via not in ("disk", "broadcast"):
            raise ValueError(f"via is 'disk' or 'broadcast', not {via!r}")
        self.engine_urls, self.token, self.via = list(engine_urls), token, via
        self.data_url, self.encoder_url, self.timeout_s = data_url, encoder_url, timeout_s
        self.master_address, self.master_port = master_address, master_port
        files = via == "disk" or encoder_url is not None
        self._temporary = tempfile.TemporaryDirectory(prefix="weir-trl-") if folder is None and files else None
        self.folder = Path(folder) if folder is not None else Path(self._temporary.name) if self._temporary else None
        self.sync: BroadcastWeightSync | None = None
        self._files: dict[str, WeightInfo] | None = None  # the model folder's weights, when broadcast in its layout
        self.published: list[int] = []

    def publish(self, model: torch.nn.Module, version: int) -> None:
        """``model``'s weights (unwrapped from DDP) to every engine as ``version``."""
        model = getattr(model, "module", model)
        if self.via == "broadcast":
            if self.sync is None:
                self._files = _files_of(model)  # read once a group: the model and its folder stay
                self.sync = BroadcastWeightSync(
                    self.engine_urls,
                    master_address=self.master_address,
                    master_port=self.master_port or _free_port(),
                    data_url=self.data_url,
                    encoder_url=self.encoder_url,
                    timeout_s=self.timeout_s,
                    token=self.token,
                    checkpoint_layout=self._files is not None,
                )
                self.sync.connect()
            state = {name: tensor.detach() for name, tensor in model.state_dict().items()}
            if self._files is not None and isinstance(model, PreTrainedModel):
                state = as_files_hold(model, state, self._files)
            self.sync.publish(state.items(), version, towers=self._written(model) if self.encoder_url else None)
        else:
            root = self._written(model)
            publish_weights(
                root,
                version,
                engine_urls=self.engine_urls,
                data_url=self.data_url,
                encoder_url=self.encoder_url,
                timeout_s=self.timeout_s,
                token=self.token,
            )
        self.published.append(version)
        logger.info("published weights version %d to %d engine(s)", version, len(self.engine_urls))

    def _written(self, model: torch.nn.Module) -> Path:
        """``model``'s weights as a model folder of safetensors (replaced at every publish)."""
        assert self.folder is not None
        root = self.folder / "weights"
        save_released(model, root)
        as_umask_allows(root)
        return root

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: torch.nn.Module | None = None,
        **kwargs: object,
    ) -> None:
        if model is not None and state.is_world_process_zero:
            self.publish(model, int(state.global_step))

    on_step_end = on_train_begin  # the same publish, as version global_step, after each optimizer step

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: object
    ) -> None:
        if self.sync is not None:  # the group is left; a later train() forms a new one
            self.sync.close()
            self.sync = None

    def close(self) -> None:
        if self.sync is not None:
            self.sync.close()
            self.sync = None
        if self._temporary is not None:
            self._temporary.cleanup()
            self._temporary = None


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _files_of(model: torch.nn.Module) -> dict[str, WeightInfo] | None:
    """The weights (headers) of the local folder ``model`` was read from, or None (a hub id, no safetensors)."""
    where = str(getattr(model, "name_or_path", "") or "")
    if not where or not isinstance(model, PreTrainedModel) or not Path(where).is_dir() or not weight_files(Path(where)):
        return None  # ("" would be the working directory)
    return base_weights(where)
