"""The model's vision and audio towers, loaded alone from a model folder, as an encoder stage.

Only the tower weights are read (`safetensors` lets us open just those tensors), so an encoder
process holds a few hundred MB of a 7B checkpoint, not all of it. Inputs are the preprocess
library's features; outputs are exactly the embeddings the language model splices in at the
placeholder positions: the vision tower's merged output (``pooler_output``) for images and videos,
the audio tower's ``last_hidden_state`` for audio. The towers are built from the folder's config
(`encoders.architectures`): a Qwen2.5-Omni thinker's vision and audio towers, Qwen3-VL's vision
tower, or a Qwen3-Omni-MoE thinker's vision (DeepStack) and audio towers; a DeepStack tower's
embedding of an item is its merged output and its DeepStack feature maps side by side
(`architectures.pack_visual`: ``(tokens, hidden · (1 + deepstack layers))``) — everything the language
model takes from the tower, so the split path equals the whole model's forward.

Batches are packed by patch / frame count under a budget, not by item count: one forward over
several images costs what their patches cost. This module does not cache (see `embeddings.py`).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
    Qwen2_5OmniAudioEncoder,
    Qwen2_5OmniVisionEncoder,
)
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeAudioEncoder,
    Qwen3OmniMoeVisionEncoder,
)
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeVisionModel

import preprocess as pp

from .architectures import FAMILIES, Family, FamilyName, audio_tokens, family_of, pack_visual, thinker_config
from .errors import NoTower, TowerWeightsError

__all__ = ["Towers", "check_processor", "pack_by_cost"]

logger = logging.getLogger(__name__)

# Where the towers live in the checkpoints we load: the thinker alone, or the full Omni model; a vision-language
# model's (transformers 5 writes ``model.visual.``; older checkpoints ``visual.``).
_PREFIXES = {"visual": ("visual.", "thinker.visual."), "audio": ("audio_tower.", "thinker.audio_tower.")}
_VL_PREFIXES = {"visual": ("model.visual.", "visual.")}
# Each family's tower classes (vision, audio), built from its config's ``vision_config`` / ``audio_config``.
_TOWERS: dict[FamilyName, tuple[type[torch.nn.Module], type[torch.nn.Module] | None]] = {
    "qwen2_5_omni": (Qwen2_5OmniVisionEncoder, Qwen2_5OmniAudioEncoder),
    "qwen2_5_vl": (Qwen2_5_VisionTransformerPretrainedModel, None),
    "qwen3_vl": (Qwen3VLVisionModel, None),
    "qwen3_vl_moe": (Qwen3VLMoeVisionModel, None),
    "qwen3_omni_moe": (Qwen3OmniMoeVisionEncoder, Qwen3OmniMoeAudioEncoder),
    "qwen3_5": (Qwen3_5VisionModel, None),
}


def pack_by_cost(costs: Sequence[int], budget: int) -> Iterator[list[int]]:
    """Indices grouped in input order so each group's summed cost stays within ``budget``
    (an item costlier than the budget goes alone)."""
    group: list[int] = []
    total = 0
    for index, cost in enumerate(costs):
        if group and total + cost > budget:
            yield group
            group, total = [], 0
        group.append(index)
        total += cost
    if group:
        yield group


# The processor's numbers (`ProcessorSpec` field) that must be the vision tower's (its config's field): features cut
# into other patches, merged in other blocks or other temporal pairs would not fit the tower at all, or worse, fit
# its shapes and mean something else.
_MUST_AGREE = (
    ("patch_size", "patch_size"),
    ("merge_size", "spatial_merge_size"),
    ("temporal_patch_size", "temporal_patch_size"),
)


def check_processor(model_dir: str | Path, vision_config: object | None = None) -> None:
    """Refuse a folder whose processor config disagrees with its model's vision tower, naming the field and both
    values. A folder without processor files, or a text model, has nothing to disagree with."""
    folder = Path(model_dir)
    try:
        spec = pp.ProcessorSpec.from_pretrained(folder)
    except FileNotFoundError:
        return
    if vision_config is None:
        vision_config = getattr(thinker_config(folder), "vision_config", None)
    if vision_config is None:
        return
    for field, model_field in _MUST_AGREE:
        ours, theirs = getattr(spec, field), getattr(vision_config, model_field, None)
        if theirs is not None and ours != theirs:
            raise ValueError(
                f"{folder}: the processor config's {field} {ours} disagrees with the model's "
                f"vision_config.{model_field} {theirs} (features made with it would not fit the vision tower)"
            )


class _AudioConfig:
    """A thinker-like view of an audio tower's config (what `architectures.audio_tokens` reads)."""

    def __init__(self, audio_config: object) -> None:
        self.audio_config = audio_config


def _weight_files(root: Path) -> list[Path]:
    index = root / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [root / n for n in names]
    return sorted(root.glob("*.safetensors"))


class Towers:
    """Vision and audio towers of a Qwen2.5-Omni thinker folder (or the vision tower of a Qwen3-VL
    folder: ``audio`` is None), in eval mode on one device."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        max_patches_per_batch: int = 16384,
        max_frames_per_batch: int = 30000,
    ) -> None:
        self.model_dir = Path(model_dir)
        config = thinker_config(self.model_dir)
        self.device, self.dtype = torch.device(device), dtype
        self.max_patches_per_batch = max_patches_per_batch
        self.max_frames_per_batch = max_frames_per_batch
        self.audio: torch.nn.Module | None
        self.family: Family = family_of(self.model_dir)
        self._config = config
        # A text model (Qwen3, Qwen3-MoE) has no towers: the stage still starts (a stack is the same for every
        # model) and refuses any item by name; the rollout role never sends it one.
        vision, audio = _TOWERS.get(self.family.name, (None, None))
        if vision:  # before any weights are read: features of another processor are refused at the start
            check_processor(self.model_dir, config.vision_config)
        self.visual: torch.nn.Module | None = vision._from_config(config.vision_config).eval() if vision else None  # type: ignore[attr-defined]
        self.audio = audio._from_config(config.audio_config).eval() if audio else None  # type: ignore[attr-defined]
        self._prefixes = _PREFIXES if self.family.layout == "omni" else _VL_PREFIXES
        self.version = self.load_weights(self.model_dir)
        self.forward_passes = 0

    @classmethod
    def from_modules(cls, visual: torch.nn.Module, audio: torch.nn.Module | None, version: str) -> Towers:
        """Towers over modules that already exist (a whole model's own towers, in an engine; no audio
        tower for a vision-language model)."""
        towers = cls.__new__(cls)
        parameter = next(visual.parameters())
        towers.model_dir, towers.device, towers.dtype = Path("."), parameter.device, parameter.dtype
        towers.max_patches_per_batch, towers.max_frames_per_batch = 16384, 30000
        towers.visual, towers.audio, towers.version, towers.forward_passes = visual, audio, version, 0
        owner = next((name for name, (v, _) in _TOWERS.items() if type(visual) is v), None)
        if owner is None:
            raise TowerWeightsError(f"{type(visual).__name__} is no vision tower of a family Weir loads")
        towers.family = FAMILIES[owner]
        towers._prefixes = _PREFIXES if towers.family.layout == "omni" else _VL_PREFIXES
        towers._config = None if audio is None else _AudioConfig(audio.config)
        return towers

    def load_weights(self, folder: str | Path) -> str:
        """Load the towers' tensors from ``folder``; returns the new weights version."""
        files = _weight_files(Path(folder))
        if not files:
            raise TowerWeightsError(f"no safetensors files in {folder}")
        states: dict[str, dict[str, torch.Tensor]] = {tower: {} for tower in self._prefixes}
        try:
            for path in files:
                with safe_open(str(path), framework="pt") as handle:
                    for name in handle.keys():  # noqa: SIM118 - safe_open is not a Mapping
                        for tower, prefixes in self._prefixes.items():
                            prefix = next((p for p in prefixes if name.startswith(p)), None)
                            if prefix is not None:
                                states[tower][name[len(prefix) :]] = handle.get_tensor(name)
                                break
        except (OSError, SafetensorError) as error:
            raise TowerWeightsError(f"cannot read the weights in {folder}: {error}") from None
        modules = [(t, m) for t, m in (("visual", self.visual), ("audio", self.audio)) if m is not None]
        # All or nothing: every name and shape of both towers is checked before either changes, so a
        # refused folder leaves the towers (and the version their embeddings are cached under) as they were.
        for tower, module in modules:
            own = module.state_dict()
            missing = sorted(set(own) - set(states[tower]))
            unexpected = sorted(set(states[tower]) - set(own))
            reshaped = sorted(k for k, v in states[tower].items() if k in own and v.shape != own[k].shape)
            if missing or unexpected or reshaped:
                raise TowerWeightsError(
                    f"{tower} tower weights in {folder} do not fit: missing {missing[:3]}, "
                    f"unexpected {unexpected[:3]}, other shapes {reshaped[:3]}"
                )
        for tower, module in modules:
            module.load_state_dict(states[tower], strict=True)
            module.to(self.device, self.dtype)
        # The version names the weights, not the process: same files, same version, everywhere.
        stamp = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
        return hashlib.sha256(json.dumps([str(Path(folder).resolve()), stamp]).encode()).hexdigest()[:16]

    @torch.no_grad()
    def encode_visual(self, items: Sequence[pp.ImageFeatures | pp.VideoFeatures]) -> list[torch.Tensor]:
        """(tokens, hidden) per item; items are packed into forwards by patch count."""
        out: list[torch.Tensor] = [torch.empty(0)] * len(items)
        visual = self.visual
        if items and visual is None:
            raise NoTower(f"this model ({self.family.name}) has no vision tower: it takes text only")
        for group in pack_by_cost([it.num_patches for it in items], self.max_patches_per_batch):
            pixels = torch.cat([torch.from_numpy(items[i].pixel_values) for i in group]).to(self.device, self.dtype)
            grids = torch.tensor([items[i].grid_thw for i in group], device=self.device)
            assert visual is not None  # a group has items
            output = visual(pixels, grid_thw=grids)
            merged = pack_visual(output.pooler_output, getattr(output, "deepstack_features", None))
            self.forward_passes += 1
            sizes = [items[i].num_tokens for i in group]
            for i, chunk in zip(group, torch.split(merged, sizes), strict=True):
                out[i] = chunk
        return out

    @torch.no_grad()
    def encode_audio(self, items: Sequence[pp.AudioFeatures]) -> list[torch.Tensor]:
        """(tokens, hidden) per clip; clips are packed into forwards by mel-frame count."""
        out: list[torch.Tensor] = [torch.empty(0)] * len(items)
        if items and self.audio is None:
            raise NoTower(f"this model ({self.family.name}) has no audio tower")
        for group in pack_by_cost([it.num_frames for it in items], self.max_frames_per_batch):
            features = torch.cat([torch.tensor(items[i].input_features) for i in group], dim=1)
            lengths = torch.tensor([items[i].num_frames for i in group], device=self.device)
            assert self.audio is not None
            if self.family.name == "qwen3_omni_moe":  # windowed: the tower cuts and pads its windows itself
                hidden = self.audio(features.to(self.device, self.dtype), feature_lens=lengths).last_hidden_state
            else:
                after_cnn, _ = self.audio._get_feat_extract_output_lengths(lengths)  # type: ignore[operator]
                hidden = self.audio(
                    features.to(self.device, self.dtype), feature_lens=lengths, aftercnn_lens=after_cnn
                ).last_hidden_state
            self.forward_passes += 1
            # The tower's own token counts (an item's num_tokens must agree: the prompt was expanded by it).
            sizes = [audio_tokens(self.family.name, self._config, items[i].num_frames) for i in group]
            for i, size in zip(group, sizes, strict=True):
                if items[i].num_tokens != size:
                    raise ValueError(
                        f"audio item {items[i].key}: {items[i].num_tokens} tokens planned, but this model's audio "
                        f"tower makes {size} of {items[i].num_frames} frames (features made for another model?)"
                    )
            for i, chunk in zip(group, torch.split(hidden, sizes), strict=True):
                out[i] = chunk
        return out

    def encode(self, items: Sequence[pp.Features]) -> list[torch.Tensor]:
        """Embeddings for a mixed list, in input order."""
        visual = [i for i, it in enumerate(items) if not isinstance(it, pp.AudioFeatures)]
        audio = [i for i, it in enumerate(items) if isinstance(it, pp.AudioFeatures)]
        out: list[torch.Tensor] = [torch.empty(0)] * len(items)
        for i, emb in zip(visual, self.encode_visual([items[i] for i in visual]), strict=True):  # type: ignore[misc]
            out[i] = emb
        for i, emb in zip(audio, self.encode_audio([items[i] for i in audio]), strict=True):  # type: ignore[misc]
            out[i] = emb
        return out
