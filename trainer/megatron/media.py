"""Media for Megatron: the towers' embeddings spliced into the word embeddings (`QwenMedia`,
`decoder_input`), a DeepStack model's visual maps beside them (`MediaRows`), and Qwen's 3-D (mrope)
positions (`mrope_section`), for every media family (Qwen2.5-Omni, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, Qwen3-Omni-MoE,
Qwen3.5). The batch layout that
carries them is `trainer.megatron.batch`; adding the DeepStack maps during a forward is
`trainer.megatron.deepstack`; the towers themselves are `encoders.towers`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..feed import FeedBatch

__all__ = ["MediaRows", "QwenMedia", "decoder_input", "mrope_section"]


def mrope_section(config: Any) -> list[int]:
    """The rotary channels (pairs) given to time, height and width in Qwen's 3-D RoPE, from a Hugging
    Face config (``rope_parameters``, or ``rope_scaling`` in older ones): ``TransformerConfig``'s
    ``mrope_section``, with ``GPTModel(position_embedding_type="mrope")``."""
    config = getattr(config, "thinker_config", config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in ("rope_parameters", "rope_scaling"):
        params = getattr(text, name, None) or {}
        if "mrope_section" in params:
            return [int(x) for x in params["mrope_section"]]
    raise ValueError("the config has no mrope_section (not a Qwen multimodal model?)")


class _RopeIndex:
    """The model's own ``get_rope_index`` (and the helpers it calls), run over its config alone, without
    building the model: the very code Hugging Face's forward uses for its 3-D positions — a vision-language
    model's (``Qwen2_5_VLModel``, ``Qwen3VLModel``, ``Qwen3VLMoeModel``, ``Qwen3_5Model``: token types, and
    Qwen2.5-VL's per-video seconds) or Qwen2.5-Omni's."""

    # model_type → the module and class whose get_rope_index (and get_vision_position_ids) a vision-language
    # model's forward calls
    _VL = {
        "qwen2_5_vl": ("qwen2_5_vl.modeling_qwen2_5_vl", "Qwen2_5_VLModel"),
        "qwen3_vl": ("qwen3_vl.modeling_qwen3_vl", "Qwen3VLModel"),
        "qwen3_vl_moe": ("qwen3_vl_moe.modeling_qwen3_vl_moe", "Qwen3VLMoeModel"),
        "qwen3_5": ("qwen3_5.modeling_qwen3_5", "Qwen3_5Model"),
    }

    def __init__(self, config: Any) -> None:
        import importlib

        self.config = config
        self.spatial_merge_size = config.vision_config.spatial_merge_size
        model_type = str(getattr(config, "model_type", ""))
        self.vl = model_type in self._VL
        self.video_seconds = model_type == "qwen2_5_vl"  # its mRoPE takes each video's seconds per grid
        if self.vl:
            module, name = self._VL[model_type]
            owner = getattr(importlib.import_module(f"transformers.models.{module}"), name)
            self.get_vision_position_ids = owner.get_vision_position_ids.__get__(self)
            self.get_rope_index = owner.get_rope_index.__get__(self)
            return
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
            Qwen2_5OmniPreTrainedModelForConditionalGeneration as Owner,
        )

        self.get_llm_pos_ids_for_vision = Owner.get_llm_pos_ids_for_vision.__get__(self)
        self.get_chunked_index = Owner.get_chunked_index.__get__(self)
        self.get_rope_index = Owner.get_rope_index.__get__(self)

    def positions(self, ids: torch.Tensor, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """(3, L) positions of one sequence ``ids`` (L,) with its media inputs (`trainer.reference.media_inputs`),
        called with the arguments the model's forward gives ``get_rope_index``."""
        ids = ids.long()[None]
        if self.vl:
            types = torch.zeros_like(ids, dtype=torch.int)  # the processor's mm_token_type_ids
            types[ids == self.config.image_token_id] = 1
            types[ids == self.config.video_token_id] = 2
            videos = inputs.get("video_grid_thw")
            seconds = inputs.get("video_second_per_grid") if self.video_seconds else None
            positions, _ = self.get_rope_index(
                ids,
                mm_token_type_ids=types,
                image_grid_thw=inputs.get("image_grid_thw"),
                video_grid_thw=None if videos is None else videos.clone(),  # it edits its argument
                attention_mask=torch.ones_like(ids),
                **({"second_per_grid_ts": seconds} if seconds is not None else {}),
            )
            return positions[:, 0]
        mask = inputs.get("feature_attention_mask")
        positions, _ = self.get_rope_index(
            ids,
            inputs.get("image_grid_thw"),
            inputs.get("video_grid_thw"),
            torch.ones_like(ids),
            False,
            None if mask is None else mask.sum(1),
            inputs.get("video_second_per_grid"),
        )
        return positions[:, 0]


@dataclass(frozen=True, slots=True, kw_only=True)
class MediaRows:
    """What `QwenMedia.embeddings` gives a pack: the rows `decoder_input` splices in, and — for a DeepStack
    model (Qwen3-VL, Qwen3-Omni) — the visual tokens' DeepStack maps, which `deepstack` adds after the first
    decoder layers."""

    embeds: torch.Tensor  # [M, H]: every media placeholder's row (the merged output for visual items)
    index: torch.Tensor  # [M]: their pack positions
    deepstack: torch.Tensor | None = None  # [n_deepstack, V, H]: the visual placeholders' maps
    deepstack_index: torch.Tensor | None = None  # [V]: the visual placeholders' pack positions


Encode = Callable[[Sequence[Any]], list[torch.Tensor]]


class QwenMedia:
    """What a Megatron GPTModel needs beyond token ids for samples with media: the towers' embeddings
    at the placeholder positions, Qwen's 3-D (mrope) positions and, for a DeepStack model (Qwen3-VL,
    Qwen3-Omni-MoE), the visual tokens' DeepStack maps. Pass it to `megatron_batch` /
    `MegatronBatchIterator` (``media=``); `forward_step` then hands GPTModel ``decoder_input``
    (`decoder_input`) and the 3-D ``position_ids``, and adds the DeepStack maps (`deepstack`).
    Families: a Qwen2.5-Omni thinker (vision + audio), Qwen3-VL (vision with DeepStack), a Qwen3-Omni-MoE
    thinker (vision with DeepStack + audio).

    ``encode`` maps a sequence's media items (``preprocess`` features, in prompt order) to one
    embedding per item, (placeholder tokens, hidden): `encoders.towers.Towers.encode` (the default
    of `from_folder` / `from_thinker`: the Hugging Face towers of the thinker, exactly what the
    reference trainer's model runs). A user with a Megatron vision / audio encoder passes its own
    callable here (its outputs after the merger/projection, one tensor per item; for a DeepStack model a
    visual item's tensor is the merged output and its DeepStack maps side by side, (tokens, hidden ·
    (1 + n_deepstack)), as `encoders.architectures.pack_visual` lays them). Media come by
    feature key from ``features`` (the feature cache) or inline from ``FeedBatch.media``, as for the
    reference trainer. The towers run without gradient, when the batch is made (on the leasing rank,
    whose tensor-parallel peers receive the embeddings): only the language model trains in the
    Megatron path (`export_hf` takes the towers' weights from the base model). To train an encoder
    too, compute ``media_embeds`` inside the forward step instead: `decoder_input` splices whatever
    tensor it is given, gradients included.
    """

    def __init__(self, config: Any, encode: Encode, *, features: Any = None) -> None:
        from encoders.positions import OmniRope

        self.config = getattr(config, "thinker_config", config)
        self.encode, self.features = encode, features
        self._rope = _RopeIndex(self.config)
        self._omni = OmniRope.of(self.config)  # an Omni model's positions, per media item
        self.hidden = int(self.config.get_text_config().hidden_size)
        # DeepStack maps per visual token (0: none, Qwen2.5-Omni): the vision tower's deepstack layers.
        layers = getattr(self.config.vision_config, "deepstack_visual_indexes", None) or []
        self.n_deepstack = len(layers)

    @classmethod
    def from_folder(
        cls, model_dir: str | Path, *, features: Any = None, device: str = "cpu", dtype: torch.dtype = torch.float32
    ) -> QwenMedia:
        """The towers of a thinker (or whole Omni, or Qwen3-VL) folder, loaded alone (`encoders.towers.Towers`)."""
        from transformers import AutoConfig

        from encoders.towers import Towers

        towers = Towers(model_dir, device=device, dtype=dtype)
        return cls(AutoConfig.from_pretrained(model_dir), towers.encode, features=features)

    @classmethod
    def from_thinker(
        cls,
        thinker: Any,
        *,
        features: Any = None,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> QwenMedia:
        """The towers of a loaded thinker (shared, not copied): ``Qwen2_5OmniThinkerForConditionalGeneration``,
        ``Qwen3VLForConditionalGeneration`` (vision tower at ``model.visual``, no audio tower) or
        ``Qwen3OmniMoeThinkerForConditionalGeneration``; moved to ``device`` in ``dtype`` when given (the
        trainer's: towers left on the host in fp32 ran every image through the CPU on a GPU trainer)."""
        from encoders.towers import Towers

        visual = getattr(thinker, "visual", None)
        if visual is None:
            visual = getattr(getattr(thinker, "model", None), "visual", None)
        if visual is None:
            raise ValueError(f"{type(thinker).__name__} has no vision tower (at .visual or .model.visual)")
        audio = getattr(thinker, "audio_tower", None)
        for tower in (visual, audio):
            if tower is not None and (device is not None or dtype is not None):
                tower.to(device=device, dtype=dtype)
        towers = Towers.from_modules(visual, audio, "thinker")
        return cls(thinker.config, towers.encode, features=features)

    def sequence_media(self, batch: FeedBatch) -> list[list[Any]]:
        """Each sequence's media items, in prompt order (inline ``batch.media``, else the cache)."""
        from ..reference import sequence_features

        return [
            sequence_features(keys, None if batch.media is None else batch.media[i], self.features)
            for i, keys in enumerate(batch.feature_keys)
        ]

    def sequence_positions(self, input_ids: torch.Tensor, media: list[Any]) -> torch.Tensor:
        """(3, L) positions of one sequence. An Omni thinker's per media item (`encoders.positions`: a video
        laid out with its own audio track — the audio item after it — gets the interleaved positions of
        ``get_rope_index(use_audio_in_video=True)``, others the plain ones), as the engine and the reference
        trainer compute them; otherwise (Qwen3-VL) the model's ``get_rope_index`` with the arguments its forward
        gives it (`_RopeIndex`)."""
        from ..reference import media_inputs

        if self._omni is not None:
            from encoders.positions import feature_items

            positions, _ = self._omni.positions(input_ids.tolist(), feature_items(media))
            return positions
        return self._rope.positions(input_ids, media_inputs(media))

    def position_ids(self, batch: FeedBatch) -> torch.Tensor:
        """(3, T): every sequence's 3-D positions (each from 0), concatenated as the pack is."""
        ids, cu = batch.tensors["input_ids"], batch.tensors["cu_seqlens"].tolist()
        media = self.sequence_media(batch)
        spans = zip(cu[:-1], cu[1:], strict=True)
        parts = [self.sequence_positions(ids[a:b], media[i]) for i, (a, b) in enumerate(spans)]
        return torch.cat(parts, dim=-1) if parts else torch.zeros(3, 0, dtype=torch.long)

    def embeddings(self, batch: FeedBatch) -> MediaRows:
        """The towers' outputs and the pack positions of the placeholder tokens they replace — per
        sequence, images fill the image placeholders in order, videos the video ones, audio the audio ones,
        as the thinker's forward does; an item several sequences share is encoded once. A DeepStack model's
        visual rows are split (`encoders.architectures.split_visual`): the merged output goes into ``embeds``,
        the maps into ``deepstack`` (empty, [n_deepstack, 0, H], for a pack without images or videos)."""
        from encoders.architectures import split_visual
        from preprocess import AudioFeatures, ImageFeatures, VideoFeatures

        token = {
            ImageFeatures: self.config.image_token_id,
            VideoFeatures: self.config.video_token_id,
            AudioFeatures: getattr(self.config, "audio_token_id", None),  # Qwen3-VL: none
        }
        ids, cu = batch.tensors["input_ids"], batch.tensors["cu_seqlens"].tolist()
        rows: list[torch.Tensor] = []
        where: list[torch.Tensor] = []
        maps: list[list[torch.Tensor]] = []  # per visual item: its n_deepstack maps
        visual_where: list[torch.Tensor] = []
        media = self.sequence_media(batch)
        # Each distinct item through the towers once, all in one call: they are frozen here, and a group's n
        # samples, packed together, share their prompt's media (a key names an item's content).
        distinct = {item.key: item for items in media for item in items}
        by_key = dict(zip(distinct, self.encode(list(distinct.values())), strict=True)) if distinct else {}
        for i, items in enumerate(media):
            if not items:
                continue
            encoded = [by_key[item.key] for item in items]
            sequence = ids[cu[i] : cu[i + 1]]
            for kind, token_id in token.items():
                mine = [e for item, e in zip(items, encoded, strict=True) if isinstance(item, kind)]
                if token_id is None:
                    if mine:
                        raise ValueError(f"sequence {i}: {kind.__name__} for a model without that tower")
                    continue
                slots = torch.nonzero(sequence == token_id)[:, 0]
                count = sum(int(e.shape[0]) for e in mine)
                if count != slots.numel():
                    raise ValueError(
                        f"sequence {i}: {slots.numel()} {kind.__name__} placeholders, {count} embedding rows"
                    )
                if not mine:
                    continue
                where.append(slots + cu[i])
                if kind is AudioFeatures or not self.n_deepstack:
                    rows += mine
                    continue
                for e in mine:
                    merged, item_maps = split_visual(e, self.hidden)
                    if len(item_maps) != self.n_deepstack:
                        raise ValueError(
                            f"sequence {i}: a {kind.__name__} embedding of width {e.shape[-1]}, not hidden "
                            f"{self.hidden} · (1 + {self.n_deepstack} DeepStack maps)"
                        )
                    rows.append(merged)
                    maps.append(item_maps)
                visual_where.append(slots + cu[i])
        empty = torch.zeros(0, self.hidden)
        embeds = torch.cat(rows).float().detach() if rows else empty
        index = torch.cat(where) if where else torch.zeros(0, dtype=torch.long)
        if not self.n_deepstack:
            return MediaRows(embeds=embeds, index=index)
        deepstack = torch.stack(
            [torch.cat([m[k] for m in maps]).float().detach() if maps else empty for k in range(self.n_deepstack)]
        )
        deepstack_index = torch.cat(visual_where) if visual_where else torch.zeros(0, dtype=torch.long)
        return MediaRows(embeds=embeds, index=index, deepstack=deepstack, deepstack_index=deepstack_index)


def decoder_input(model: Any, batch: Mapping[str, Any]) -> torch.Tensor | None:
    """GPTModel's ``decoder_input`` for a `megatron_batch` built with ``media``: the language model's
    word embeddings of the tokens (``model.embedding.word_embeddings``, so they train as usual) with
    ``media_embeds`` in place of the placeholder rows, as [T, 1, H] (sequence first), then what
    megatron's ``LanguageModelEmbedding`` does after the lookup (fp32 residual, dropout). ``None``
    on a pipeline stage without the embedding (it takes the previous stage's output)."""
    from megatron.core.utils import get_attr_wrapped_model

    embedding = get_attr_wrapped_model(model, "embedding", allow_none=True)
    if embedding is None:
        return None
    if embedding.config.sequence_parallel:
        raise NotImplementedError("decoder_input with sequence parallelism: splice before the reduce-scatter")
    tokens = batch["tokens"]
    words = embedding.word_embeddings(tokens)  # [1, T, H]
    index = batch["media_index"].to(words.device)
    rows = torch.zeros_like(index)
    words = words.index_put((rows, index), batch["media_embeds"].to(words.device, words.dtype))
    out = words.transpose(0, 1).contiguous()
    if embedding.config.fp32_residual_connection:
        out = out.float()
    return embedding.embedding_dropout(out)
