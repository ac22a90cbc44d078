"""A plain PyTorch trainer for the embedded model (CPU): log-probs, the RL loss, AdamW, checkpoints.

`ReferenceTrainer.step(batch)` recomputes the policy's log-probs for every sequence of a fed
micro-batch (media from the feature cache by key, through the model's own towers), applies
`trainer.losses.policy_loss` with the rollout log-probs as the importance reference, clips the
gradient norm and takes an AdamW step. Checkpoints hold the model, the optimizer, the policy
version and whatever feed state the caller passes (the acknowledged batch ids), written to a
temporary folder and renamed into place so a crash never leaves half a checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, Qwen2_5OmniThinkerForConditionalGeneration

import preprocess as pp

from .feed import FeedBatch
from .losses import LossConfig, policy_loss

__all__ = ["ReferenceTrainer", "StepResult", "media_inputs"]


def media_inputs(features: list[pp.Features]) -> dict[str, torch.Tensor]:
    """The thinker's keyword inputs for one sequence's media, in prompt order."""
    images = [f for f in features if isinstance(f, pp.ImageFeatures)]
    videos = [f for f in features if isinstance(f, pp.VideoFeatures)]
    audios = [f for f in features if isinstance(f, pp.AudioFeatures)]
    out: dict[str, torch.Tensor] = {}
    if images:
        out["pixel_values"] = torch.cat([torch.from_numpy(f.pixel_values) for f in images])
        out["image_grid_thw"] = torch.tensor([f.grid_thw for f in images])
    if videos:
        out["pixel_values_videos"] = torch.cat([torch.from_numpy(f.pixel_values) for f in videos])
        out["video_grid_thw"] = torch.tensor([f.grid_thw for f in videos])
        out["video_second_per_grid"] = torch.tensor([f.second_per_grid_t for f in videos])
    if audios:
        longest = max(f.num_frames for f in audios)
        batch = torch.zeros(len(audios), audios[0].input_features.shape[0], longest)
        mask = torch.zeros(len(audios), longest, dtype=torch.long)
        for i, f in enumerate(audios):
            batch[i, :, : f.num_frames] = torch.tensor(f.input_features)
            mask[i, : f.num_frames] = 1
        out["input_features"], out["feature_attention_mask"] = batch, mask
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class StepResult:
    loss: float
    grad_norm: float
    metrics: dict[str, float]


class ReferenceTrainer:
    def __init__(
        self,
        model_dir: str | Path,
        *,
        features: pp.FeatureStore | None = None,
        lr: float = 1e-5,
        max_grad_norm: float = 1.0,
        loss: LossConfig | None = None,
        seed: int = 0,
    ) -> None:
        torch.manual_seed(seed)
        self.model = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
        self.model.train()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.features = features
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        self.max_grad_norm = max_grad_norm
        self.loss_config = loss or LossConfig()
        self.policy_version = 0
        self._units, self._loss = 0.0, 0.0
        self._metrics: dict[str, float] = {}  # what `accumulate` gathered for `apply`

    def sequence_logprobs(
        self, input_ids: torch.Tensor, feature_keys: list[str], media: list[pp.Features] | None = None
    ) -> torch.Tensor:
        """log p(token_t | prefix) for t ≥ 1 of one sequence; 0 at t = 0 (nothing predicts it).

        The media are ``media`` when given (fetched inline with the batch), else read by key from the
        feature cache.
        """
        keys = feature_keys if media is None else []
        media = list(media or [])
        for key in keys:
            item = self.features.get(key) if self.features is not None else None
            if item is None:
                raise KeyError(f"no cached features {key} (give the trainer the feature cache)")
            media.append(item)
        ids = input_ids[None]
        logits = self.model(input_ids=ids, attention_mask=torch.ones_like(ids), **media_inputs(media)).logits[0]
        picked = torch.log_softmax(logits[:-1].float(), dim=-1).gather(1, input_ids[1:, None])[:, 0]
        return torch.cat([torch.zeros(1), picked])

    def accumulate(self, batch: FeedBatch) -> dict[str, float]:
        """Forward and backward one micro-batch, adding to the gradients of the current step.

        Each micro-batch's loss is weighted by its share of the step's normalisation units (loss
        tokens for ``token_mean``, sequences for ``sequence_mean``), so a step over micro-batches
        streamed in any split equals one loss over all of them (`apply` divides by the total).
        """
        t = batch.tensors
        cu = t["cu_seqlens"].tolist()
        logprobs = torch.cat(
            [
                self.sequence_logprobs(
                    t["input_ids"][cu[i] : cu[i + 1]],
                    batch.feature_keys[i],
                    None if batch.media is None else batch.media[i],
                )
                for i in range(len(cu) - 1)
            ]
        )
        out = policy_loss(
            logprobs,
            logprobs.detach(),
            t["advantages"],
            t["loss_mask"],
            self.loss_config,
            rollout_logprobs=t["rollout_logprobs"],
            sequence_ids=t["sequence_ids"],
        )
        # A mean over the step is a weighted mean of the micro-batches' means; a sum is a plain sum.
        units = {"token_mean": float(t["loss_mask"].sum()), "sequence_mean": float(len(cu) - 1), "sum": 1.0}
        weight = units[self.loss_config.aggregation]
        (out.loss * weight).backward()
        self._units += weight
        self._loss += float(out.loss.detach()) * weight
        for name, value in out.metrics.items():
            self._metrics[name] = self._metrics.get(name, 0.0) + value * weight
        return out.metrics

    def apply(self) -> StepResult:
        """The optimizer step over everything accumulated since the last one."""
        units = max(self._units, 1e-9)
        divisor = 1.0 if self.loss_config.aggregation == "sum" else units
        norm = self._optimizer_step(grad_scale=1.0 / divisor)
        result = StepResult(
            loss=self._loss / divisor,
            grad_norm=norm,
            metrics={name: value / units for name, value in self._metrics.items()},  # per-unit means
        )
        self._units, self._loss, self._metrics = 0.0, 0.0, {}
        return result

    def _optimizer_step(self, grad_scale: float = 1.0, lr: float | None = None) -> float:
        """Scale the gradients, clip their norm, step (at ``lr`` if given, just this once), clear them."""
        if grad_scale != 1.0:
            for parameter in self.model.parameters():
                if parameter.grad is not None:
                    parameter.grad.mul_(grad_scale)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        saved = [group["lr"] for group in self.optimizer.param_groups]
        if lr is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        self.optimizer.step()
        for group, value in zip(self.optimizer.param_groups, saved, strict=True):
            group["lr"] = value
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def step(self, batch: FeedBatch) -> StepResult:
        """One optimizer step on one micro-batch."""
        self.accumulate(batch)
        return self.apply()

    def answer_ids(self, answer: str) -> list[int]:
        """A response as an engine would produce it: the answer's tokens, then end-of-turn."""
        return self.tokenizer.encode(answer, add_special_tokens=False) + [
            self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        ]

    def chat_pair(self, messages: list[dict[str, Any]], answer: str) -> tuple[list[int], list[int], list[str]]:
        """A text-only supervised example: (prompt ids, response ids, no media)."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer.encode(str(text), add_special_tokens=False), self.answer_ids(answer), []

    def supervised_step(self, pairs: list[tuple[list[int], list[int], list[str]]], *, lr: float | None = None) -> float:
        """One cross-entropy step on (prompt ids, response ids, feature keys) — the warm-up before RL."""
        losses = []
        for prompt, response, keys in pairs:
            logprobs = self.sequence_logprobs(torch.tensor(prompt + response), keys)
            losses.append(-logprobs[len(prompt) :].mean())
        loss = torch.stack(losses).mean()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self._optimizer_step(lr=lr)
        return float(loss.detach())

    # -- checkpoints and export -----------------------------------------------------------------
    def save(self, folder: str | Path, feed_state: dict[str, Any] | None = None) -> Path:
        final = Path(folder)
        staging = final.parent / f".{final.name}.tmp-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        self.model.save_pretrained(staging, safe_serialization=True)
        torch.save(
            {"optimizer": self.optimizer.state_dict(), "rng": torch.random.get_rng_state()},
            staging / "trainer_state.pt",
        )
        (staging / "trainer.json").write_text(
            json.dumps({"policy_version": self.policy_version, "feed": feed_state or {}})
        )
        shutil.rmtree(final, ignore_errors=True)
        os.rename(staging, final)
        return final

    def load(self, folder: str | Path) -> dict[str, Any]:
        """Restore a checkpoint written by `save`; returns the feed state stored with it."""
        root = Path(folder)
        state = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(root, dtype=torch.float32).state_dict()
        self.model.load_state_dict(state)
        saved = torch.load(root / "trainer_state.pt", weights_only=False)
        self.optimizer.load_state_dict(saved["optimizer"])
        torch.random.set_rng_state(saved["rng"])
        meta = json.loads((root / "trainer.json").read_text())
        self.policy_version = int(meta["policy_version"])
        return dict(meta["feed"])

    def export(self, folder: str | Path) -> Path:
        """Hugging Face weights (safetensors) an engine can load with update_weights_from_disk."""
        root = Path(folder)
        self.model.save_pretrained(root, safe_serialization=True)
        return root
