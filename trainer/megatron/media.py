"""Media for Megatron: the towers' embeddings spliced into the word embeddings (`QwenMedia`,
`decoder_input`) and Qwen's 3-D (mrope) positions (`mrope_section`). The batch layout that carries them is
`trainer.megatron.batch`; the towers themselves are `encoders.towers`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ..feed import FeedBatch

__all__ = ["QwenMedia", "decoder_input", "mrope_section"]


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
    """The thinker's own ``get_rope_index`` (and the two helpers it calls), run over its config alone,
    without building the model: the very code Hugging Face's forward uses for its 3-D positions."""

    def __init__(self, config: Any) -> None:
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
            Qwen2_5OmniPreTrainedModelForConditionalGeneration as Owner,
        )

        self.config = config
        self.spatial_merge_size = config.vision_config.spatial_merge_size
        self.get_llm_pos_ids_for_vision = Owner.get_llm_pos_ids_for_vision.__get__(self)
        self.get_chunked_index = Owner.get_chunked_index.__get__(self)
        self.get_rope_index = Owner.get_rope_index.__get__(self)


Encode = Callable[[Sequence[Any]], list[torch.Tensor]]


class QwenMedia:
    """What a Megatron GPTModel needs beyond token ids for samples with media: the towers' embeddings
    at the placeholder positions and Qwen's 3-D (mrope) positions. Pass it to `megatron_batch` /
    `MegatronBatchIterator` (``media=``); `forward_step` then hands GPTModel ``decoder_input``
    (`decoder_input`) and the 3-D ``position_ids``.

    ``encode`` maps a sequence's media items (``preprocess`` features, in prompt order) to one
    embedding per item, (placeholder tokens, hidden): `encoders.towers.Towers.encode` (the default
    of `from_folder` / `from_thinker`: the Hugging Face towers of the thinker, exactly what the
    reference trainer's model runs). A user with a Megatron vision / audio encoder passes its own
    callable here (its outputs after the merger/projection, one tensor per item). Media come by
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

    @classmethod
    def from_folder(
        cls, model_dir: str | Path, *, features: Any = None, device: str = "cpu", dtype: torch.dtype = torch.float32
    ) -> QwenMedia:
        """The towers of a thinker (or whole Omni) folder, loaded alone (`encoders.towers.Towers`)."""
        from transformers import AutoConfig

        from encoders.towers import Towers

        towers = Towers(model_dir, device=device, dtype=dtype)
        return cls(AutoConfig.from_pretrained(model_dir), towers.encode, features=features)

    @classmethod
    def from_thinker(cls, thinker: Any, *, features: Any = None) -> QwenMedia:
        """The towers of a loaded ``Qwen2_5OmniThinkerForConditionalGeneration`` (shared, not copied)."""
        from encoders.towers import Towers

        towers = Towers.from_modules(thinker.visual, thinker.audio_tower, "thinker")
        return cls(thinker.config, towers.encode, features=features)

    def sequence_media(self, batch: FeedBatch) -> list[list[Any]]:
        """Each sequence's media items, in prompt order (inline ``batch.media``, else the cache)."""
        out = []
        for i, keys in enumerate(batch.feature_keys):
            if batch.media is not None and batch.media[i] is not None:
                out.append(list(batch.media[i]))
                continue
            items = []
            for key in keys:
                item = self.features.get(key) if self.features is not None else None
                if item is None:
                    raise KeyError(f"no cached features {key} (give QwenMedia the feature cache)")
                items.append(item)
            out.append(items)
        return out

    def sequence_positions(self, input_ids: torch.Tensor, media: list[Any]) -> torch.Tensor:
        """(3, L) positions of one sequence. An Omni thinker's per media item (`encoders.positions`: a video
        laid out with its own audio track — the audio item after it — gets the interleaved positions of
        ``get_rope_index(use_audio_in_video=True)``, others the plain ones), as the engine and the reference
        trainer compute them; otherwise the thinker's ``get_rope_index`` with the arguments its forward gives it."""
        from ..reference import media_inputs

        if self._omni is not None:
            from encoders.positions import feature_items

            positions, _ = self._omni.positions(input_ids.tolist(), feature_items(media))
            return positions
        inputs = media_inputs(media)
        mask = inputs.get("feature_attention_mask")
        ids = input_ids.long()[None]
        positions, _ = self._rope.get_rope_index(
            ids,
            inputs.get("image_grid_thw"),
            inputs.get("video_grid_thw"),
            torch.ones_like(ids),
            False,
            None if mask is None else mask.sum(1),
            inputs.get("video_second_per_grid"),
        )
        return positions[:, 0]

    def position_ids(self, batch: FeedBatch) -> torch.Tensor:
        """(3, T): every sequence's 3-D positions (each from 0), concatenated as the pack is."""
        ids, cu = batch.tensors["input_ids"], batch.tensors["cu_seqlens"].tolist()
        media = self.sequence_media(batch)
        spans = zip(cu[:-1], cu[1:], strict=True)
        parts = [self.sequence_positions(ids[a:b], media[i]) for i, (a, b) in enumerate(spans)]
        return torch.cat(parts, dim=-1) if parts else torch.zeros(3, 0, dtype=torch.long)

    def embeddings(self, batch: FeedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(``media_embeds`` [M, H], ``media_index`` [M]): the towers' outputs and the pack positions
        of the placeholder tokens they replace — per sequence, images fill the image placeholders in
        order, videos the video ones, audio the audio ones, as the thinker's forward does."""
        from preprocess import AudioFeatures, ImageFeatures, VideoFeatures

        token = {
            ImageFeatures: self.config.image_token_id,
            VideoFeatures: self.config.video_token_id,
            AudioFeatures: self.config.audio_token_id,
        }
        ids, cu = batch.tensors["input_ids"], batch.tensors["cu_seqlens"].tolist()
        rows: list[torch.Tensor] = []
        where: list[torch.Tensor] = []
        for i, items in enumerate(self.sequence_media(batch)):
            if not items:
                continue
            encoded = self.encode(items)
            sequence = ids[cu[i] : cu[i + 1]]
            for kind, token_id in token.items():
                mine = [e for item, e in zip(items, encoded, strict=True) if isinstance(item, kind)]
                slots = torch.nonzero(sequence == token_id)[:, 0]
                count = sum(int(e.shape[0]) for e in mine)
                if count != slots.numel():
                    raise ValueError(
                        f"sequence {i}: {slots.numel()} {kind.__name__} placeholders, {count} embedding rows"
                    )
                if mine:
                    rows += mine
                    where.append(slots + cu[i])
        hidden = self.config.get_text_config().hidden_size
        if not rows:
            return torch.zeros(0, hidden), torch.zeros(0, dtype=torch.long)
        return torch.cat(rows).float().detach(), torch.cat(where)


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
