"""The tiny models' configs: each architecture Weir makes at toy size (`init_model`'s ``--arch``), with the
media tokens its tokenizer names and the processor files its released checkpoints carry.

Every structural feature of the real architecture is kept (windowed vision attention, DeepStack mergers,
interleaved mRoPE, sparse MoE blocks, gated delta-net layers); only the widths are toy. The numbers a
processor reads (patch, merge and temporal patch sizes) are the released checkpoints', so Weir's
`ProcessorSpec` features fit the tiny towers as they fit the real ones.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypedDict

from transformers import (
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5OmniThinkerConfig,
    Qwen3_5Config,
    Qwen3Config,
    Qwen3MoeConfig,
    Qwen3OmniMoeThinkerConfig,
    Qwen3VLConfig,
    Qwen3VLMoeConfig,
)

from preprocess.spec import ProcessorSpec

__all__ = [
    "MEDIA_TOKENS",
    "QWEN3_OMNI_MEDIA_TOKENS",
    "QWEN3_VL_MEDIA_TOKENS",
    "TINY_ARCHITECTURES",
    "TinyArchitecture",
    "tiny_config",
    "tiny_qwen3_omni_moe_config",
    "tiny_qwen3_vl_config",
]

# Named as in the released Qwen2.5-Omni tokenizer (its tokenizer_config's model-specific tokens).
MEDIA_TOKENS = {
    "image_token": "<|IMAGE|>",
    "video_token": "<|VIDEO|>",
    "audio_token": "<|AUDIO|>",
    "vision_bos_token": "<|vision_bos|>",
    "vision_eos_token": "<|vision_eos|>",
    "audio_bos_token": "<|audio_bos|>",
    "audio_eos_token": "<|audio_eos|>",
}
# Named as in the released Qwen3-VL tokenizer (the names its processor reads: image_token, video_token,
# vision_start_token, vision_end_token).
QWEN3_VL_MEDIA_TOKENS = {
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
    "vision_start_token": "<|vision_start|>",
    "vision_end_token": "<|vision_end|>",
}
# Named as in the released Qwen3-Omni tokenizer (the names Qwen3OmniMoeProcessor reads from it).
QWEN3_OMNI_MEDIA_TOKENS = {
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
    "audio_token": "<|audio_pad|>",
    "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>",
    "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
}


def _token_ids(tokenizer: PreTrainedTokenizerFast, tokens: Mapping[str, str]) -> dict[str, int]:
    """Name → the id of its special token (one token: one id)."""
    ids: dict[str, int] = {}
    for name, token in tokens.items():
        token_id = tokenizer.convert_tokens_to_ids(token)
        assert isinstance(token_id, int), token
        ids[name] = token_id
    return ids


def _text_config(
    tokenizer: PreTrainedTokenizerFast, *, layers: int, rope: Mapping[str, Any], **own: Any
) -> dict[str, Any]:
    """A language model's config at the toy sizes every tiny model shares (64 wide, 4 attention heads over
    2 KV heads, mRoPE sections 2/3/3, the tokenizer's vocabulary, EOS ``<|im_end|>``); ``rope`` and
    ``own`` are the architecture's own keys."""
    return {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        **own,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], **rope},
        "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"),
        "pad_token_id": tokenizer.pad_token_id,
    }


def _audio_config(**own: Any) -> dict[str, Any]:
    """The Whisper-style audio tower at toy sizes (128 mel bins, as both Omni thinkers'); ``own`` is its
    windowing, which differs between Qwen2.5-Omni and Qwen3-Omni."""
    return {
        "encoder_layers": 2,
        "encoder_attention_heads": 2,
        "encoder_ffn_dim": 64,
        "d_model": 32,
        "output_dim": 64,
        "num_mel_bins": 128,
        "max_source_positions": 1500,
        **own,
    }


def _omni_marker_ids(ids: Mapping[str, int]) -> dict[str, int]:
    """The ids of the tokens around each medium, as both Omni thinkers' configs name them (``ids``: from
    their media tokens). The vision ones are not declared by the config classes, but read by the models'
    rotary-position code (and the engines)."""
    return {
        "audio_start_token_id": ids["audio_bos_token"],
        "audio_end_token_id": ids["audio_eos_token"],
        "vision_start_token_id": ids["vision_bos_token"],
        "vision_end_token_id": ids["vision_eos_token"],
    }


def tiny_config(tokenizer: PreTrainedTokenizerFast) -> Qwen2_5OmniThinkerConfig:
    """Toy dimensions; every structural feature of the real thinker kept (windowed vision
    attention with a full-attention block, chunked audio attention, mRoPE sections)."""
    ids = _token_ids(tokenizer, MEDIA_TOKENS)
    fields: dict[str, Any] = dict(
        text_config=_text_config(tokenizer, layers=2, rope={"rope_theta": 1000000.0}),
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": 64,
            "fullatt_block_indexes": [1],
            "window_size": 112,
        },
        audio_config=_audio_config(n_window=100),
        image_token_index=ids["image_token"],
        video_token_index=ids["video_token"],
        audio_token_index=ids["audio_token"],
        **_omni_marker_ids(ids),
    )
    return Qwen2_5OmniThinkerConfig(**fields)


def _omni_processor_config(spec: ProcessorSpec, processor_class: str) -> dict[str, Any]:
    """The keys a released Qwen2.5-Omni (``Qwen2_5OmniProcessor``) or Qwen3-Omni (``Qwen3OmniMoeProcessor``)
    checkpoint's preprocessor_config.json carries, the numbers from ``spec``."""
    return {
        "processor_class": processor_class,
        "image_processor_type": "Qwen2VLImageProcessor",
        "feature_extractor_type": "WhisperFeatureExtractor",
        "min_pixels": spec.min_pixels,
        "max_pixels": spec.max_pixels,
        "patch_size": spec.patch_size,
        "temporal_patch_size": spec.temporal_patch_size,
        "merge_size": spec.merge_size,
        "image_mean": list(spec.image_mean),
        "image_std": list(spec.image_std),
        "feature_size": spec.n_mels,
        "sampling_rate": spec.sampling_rate,
        "hop_length": spec.hop_length,
        "n_fft": spec.n_fft,
        "chunk_length": int(spec.max_audio_seconds),
        "n_samples": spec.max_audio_samples,
        "return_attention_mask": True,
    }


def _qwen3_vision_config(deepstack_visual_indexes: list[int]) -> dict[str, Any]:
    """Qwen3-VL's vision tower (Qwen3-Omni's too) at toy sizes: the checkpoints' patch 16 / merge 2 / temporal
    patch 2, learned position embeddings, DeepStack mergers after the blocks ``deepstack_visual_indexes``."""
    return {
        "depth": 3,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": 64,
        "num_position_embeddings": 256,
        "deepstack_visual_indexes": deepstack_visual_indexes,
    }


class _VLTokenIds(TypedDict):
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int


def _vl_token_ids(ids: Mapping[str, int]) -> _VLTokenIds:
    """A vision-language config's media token ids (``ids``: from Qwen3-VL's media tokens, which Qwen2.5-VL's,
    Qwen3-VL-MoE's and Qwen3.5's tokenizers name alike)."""
    return {
        "image_token_id": ids["image_token"],
        "video_token_id": ids["video_token"],
        "vision_start_token_id": ids["vision_start_token"],
        "vision_end_token_id": ids["vision_end_token"],
    }


def tiny_qwen3_vl_config(tokenizer: PreTrainedTokenizerFast) -> Qwen3VLConfig:
    """Qwen3-VL at toy dimensions, every structural feature kept: patch 16 / merge 2 / temporal patch 2
    (the checkpoints' numbers, so Weir's `ProcessorSpec.qwen3_vl` features fit), learned position
    embeddings resampled per grid, DeepStack mergers after vision blocks 0 and 1 (injected after text
    layers 0 and 1), interleaved mRoPE."""
    ids = _token_ids(tokenizer, QWEN3_VL_MEDIA_TOKENS)
    return Qwen3VLConfig(
        text_config=_text_config(
            tokenizer, layers=3, rope={"rope_theta": 5000000.0, "mrope_interleaved": True}, head_dim=16
        ),
        vision_config=_qwen3_vision_config([0, 1]),
        **_vl_token_ids(ids),
        tie_word_embeddings=False,
    )


def tiny_qwen3_omni_moe_config(tokenizer: PreTrainedTokenizerFast) -> Qwen3OmniMoeThinkerConfig:
    """The Qwen3-Omni thinker at toy dimensions, every structural feature kept: patch 16 / merge 2 /
    temporal patch 2 with DeepStack mergers after vision blocks 0 and 1; the windowed audio tower (128 mel
    bins, 100-frame windows, 13 tokens each); a text model whose every layer is a sparse MoE block of 8
    experts with 2 routed per token (top-k weights renormalised, as the checkpoint), interleaved mRoPE."""
    ids = _token_ids(tokenizer, QWEN3_OMNI_MEDIA_TOKENS)
    fields: dict[str, Any] = dict(
        text_config=_text_config(
            tokenizer,
            layers=3,
            rope={"rope_theta": 1000000.0, "interleaved": True},
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            head_dim=16,
        ),
        # three, as every released Qwen3-VL-MoE / Qwen3-Omni checkpoint: SGLang 0.5.23's MoE language model
        # adds exactly three DeepStack maps whatever the config says (`qwen3_vl_moe.py`), and crashed on two
        vision_config=_qwen3_vision_config([0, 1, 2]),
        audio_config=_audio_config(n_window=50, n_window_infer=800, downsample_hidden_size=16),
        image_token_id=ids["image_token"],
        video_token_id=ids["video_token"],
        audio_token_id=ids["audio_token"],
        **_omni_marker_ids(ids),
        # The released thinker's (and `ProcessorSpec.qwen3_omni_moe`'s): 13 temporal positions per second.
        position_id_per_seconds=int(ProcessorSpec.qwen3_omni_moe().position_id_per_seconds),
        tie_word_embeddings=False,
    )
    return Qwen3OmniMoeThinkerConfig(**fields)


def _qwen3_vl_processor_configs(spec: ProcessorSpec) -> tuple[dict[str, Any], dict[str, Any]]:
    """``preprocessor_config.json`` and ``video_preprocessor_config.json`` as a released Qwen3-VL
    checkpoint writes them (the numbers from ``spec``)."""
    shared = {
        "patch_size": spec.patch_size,
        "temporal_patch_size": spec.temporal_patch_size,
        "merge_size": spec.merge_size,
        "image_mean": list(spec.image_mean),
        "image_std": list(spec.image_std),
        "processor_class": "Qwen3VLProcessor",
    }
    image = {
        **shared,
        "image_processor_type": "Qwen2VLImageProcessorFast",
        "size": {"shortest_edge": spec.min_pixels, "longest_edge": spec.max_pixels},
    }
    video = {
        **shared,
        "video_processor_type": "Qwen3VLVideoProcessor",
        "size": {"shortest_edge": 4096, "longest_edge": 25165824},
        "fps": spec.video_fps,
        "min_frames": spec.video_min_frames,
        "max_frames": spec.video_max_frames,
        "do_sample_frames": True,
    }
    return image, video


def tiny_qwen2_5_vl_config(tokenizer: PreTrainedTokenizerFast) -> Qwen2_5_VLConfig:
    """Qwen2.5-VL at toy dimensions, every structural feature kept: patch 14 / merge 2 / temporal patch 2 (the
    checkpoints' numbers, so `ProcessorSpec.qwen2_5_vl` features fit), windowed vision attention with a
    full-attention block, the checkpoints' 2 temporal positions per second of video, mRoPE sections."""
    ids = _token_ids(tokenizer, QWEN3_VL_MEDIA_TOKENS)  # Qwen2.5-VL's tokenizer names them as Qwen3-VL's does
    return Qwen2_5_VLConfig(
        # bos None: the class's default is the released vocabulary's
        text_config=_text_config(tokenizer, layers=2, rope={"rope_theta": 1000000.0}, bos_token_id=None),
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": 64,
            "fullatt_block_indexes": [1],
            "window_size": 112,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "tokens_per_second": 2,
        },
        **_vl_token_ids(ids),
        tie_word_embeddings=False,
    )


_MOE = {"moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True}


def tiny_qwen3_vl_moe_config(tokenizer: PreTrainedTokenizerFast) -> Qwen3VLMoeConfig:
    """Qwen3-VL-MoE at toy dimensions: Qwen3-VL's tower with three DeepStack mergers (SGLang's MoE language
    model adds exactly three), and a text model whose every layer is a sparse MoE block of 8 experts, 2 routed."""
    ids = _token_ids(tokenizer, QWEN3_VL_MEDIA_TOKENS)
    return Qwen3VLMoeConfig(
        text_config=_text_config(
            tokenizer,
            layers=3,
            rope={"rope_theta": 5000000.0, "mrope_interleaved": True},
            head_dim=16,
            decoder_sparse_step=1,
            # 2 · 48 ≠ 64: the fused expert tensors are not square, so their layout (released (E, in, out) or the
            # transformers module's (E, out, in)) is told by shape, as transformers' own loader tells it
            **{**_MOE, "moe_intermediate_size": 48},
        ),
        vision_config=_qwen3_vision_config([0, 1, 2]),
        **_vl_token_ids(ids),
        tie_word_embeddings=False,
    )


def tiny_qwen3_5_config(tokenizer: PreTrainedTokenizerFast) -> Qwen3_5Config:
    """Qwen3.5 (the vision-language model) at toy dimensions: Qwen3-VL's vision tower without DeepStack, and the
    hybrid text model — three gated delta-net (linear attention) layers, then one full-attention layer with
    an output gate and partial rotary, interleaved mRoPE."""
    ids = _token_ids(tokenizer, QWEN3_VL_MEDIA_TOKENS)
    # no DeepStack, said as the released checkpoints' configs say it (an empty list): SGLang's Qwen3.5 vision config
    # otherwise takes Qwen3-VL's default, three DeepStack layers
    vision = _qwen3_vision_config([])
    return Qwen3_5Config(
        text_config=_text_config(
            tokenizer,
            layers=4,
            rope={"rope_theta": 10000000.0, "mrope_interleaved": True, "partial_rotary_factor": 0.5},
            head_dim=16,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            # beside layer_types and rope_parameters, as the released checkpoints' configs carry them: SGLang's
            # Qwen3.5 reads the layer kinds from the interval (every 4th layer full attention) and its rotary
            # fraction from the top-level factor (transformers from rope_parameters: the two must agree)
            full_attention_interval=4,
            partial_rotary_factor=0.5,
        ),
        vision_config=vision,
        **_vl_token_ids(ids),
        tie_word_embeddings=False,
    )


def _text_only(config: dict[str, Any]) -> dict[str, Any]:
    """A text model's config from `_text_config`'s: 1-D rotary positions (no mRoPE sections)."""
    rope = {k: v for k, v in config["rope_parameters"].items() if k != "mrope_section"}
    return {**config, "rope_parameters": rope, "tie_word_embeddings": False}


def tiny_qwen3_config(tokenizer: PreTrainedTokenizerFast) -> Qwen3Config:
    """Qwen3 dense (the text model of Qwen3-4B / 8B) at toy dimensions: per-head q/k norms, 1-D rotary."""
    return Qwen3Config(**_text_only(_text_config(tokenizer, layers=2, rope={"rope_theta": 1000000.0}, head_dim=16)))


def tiny_qwen3_moe_config(tokenizer: PreTrainedTokenizerFast) -> Qwen3MoeConfig:
    """Qwen3-MoE (Qwen3-30B-A3B's architecture) at toy dimensions: every layer a sparse MoE block of 8
    experts, 2 routed per token, top-k weights renormalised."""
    text = _text_config(tokenizer, layers=2, rope={"rope_theta": 1000000.0}, head_dim=16, decoder_sparse_step=1, **_MOE)
    return Qwen3MoeConfig(**_text_only(text))


def _vl_processor_files(spec: ProcessorSpec) -> dict[str, dict[str, Any]]:
    image, video = _qwen3_vl_processor_configs(spec)
    return {"preprocessor_config.json": image, "video_preprocessor_config.json": video}


def _qwen2_5_vl_processor_files(spec: ProcessorSpec) -> dict[str, dict[str, Any]]:
    """A released Qwen2.5-VL checkpoint's ``preprocessor_config.json`` (the numbers from ``spec``)."""
    return {
        "preprocessor_config.json": {
            "processor_class": "Qwen2_5_VLProcessor",
            "image_processor_type": "Qwen2VLImageProcessor",
            "min_pixels": spec.min_pixels,
            "max_pixels": spec.max_pixels,
            "patch_size": spec.patch_size,
            "temporal_patch_size": spec.temporal_patch_size,
            "merge_size": spec.merge_size,
            "image_mean": list(spec.image_mean),
            "image_std": list(spec.image_std),
        }
    }


@dataclass(frozen=True)
class TinyArchitecture:
    """One ``--arch``: its class (config.json's ``architectures``), config, tokens and processor files."""

    model_class: str
    config: Callable[[PreTrainedTokenizerFast], PretrainedConfig]
    media_tokens: Mapping[str, str]  # empty: a text model
    audio: bool
    processor_files: Callable[[], dict[str, dict[str, Any]]]  # file name → its JSON


TINY_ARCHITECTURES: dict[str, TinyArchitecture] = {
    "qwen2.5-omni": TinyArchitecture(
        "Qwen2_5OmniThinkerForConditionalGeneration",
        tiny_config,
        MEDIA_TOKENS,
        True,
        lambda: {
            "preprocessor_config.json": _omni_processor_config(ProcessorSpec.qwen2_5_omni(), "Qwen2_5OmniProcessor")
        },
    ),
    "qwen2.5-vl": TinyArchitecture(
        "Qwen2_5_VLForConditionalGeneration",
        tiny_qwen2_5_vl_config,
        QWEN3_VL_MEDIA_TOKENS,
        False,
        lambda: _qwen2_5_vl_processor_files(ProcessorSpec.qwen2_5_vl()),
    ),
    "qwen3-vl": TinyArchitecture(
        "Qwen3VLForConditionalGeneration",
        tiny_qwen3_vl_config,
        QWEN3_VL_MEDIA_TOKENS,
        False,
        lambda: _vl_processor_files(ProcessorSpec.qwen3_vl()),
    ),
    "qwen3-vl-moe": TinyArchitecture(
        "Qwen3VLMoeForConditionalGeneration",
        tiny_qwen3_vl_moe_config,
        QWEN3_VL_MEDIA_TOKENS,
        False,
        lambda: _vl_processor_files(ProcessorSpec.qwen3_vl()),
    ),
    "qwen3-omni-moe": TinyArchitecture(
        "Qwen3OmniMoeThinkerForConditionalGeneration",
        tiny_qwen3_omni_moe_config,
        QWEN3_OMNI_MEDIA_TOKENS,
        True,
        lambda: {
            "preprocessor_config.json": _omni_processor_config(ProcessorSpec.qwen3_omni_moe(), "Qwen3OmniMoeProcessor")
        },
    ),
    "qwen3.5": TinyArchitecture(
        "Qwen3_5ForConditionalGeneration",
        tiny_qwen3_5_config,
        QWEN3_VL_MEDIA_TOKENS,
        False,
        lambda: _vl_processor_files(ProcessorSpec.qwen3_vl()),  # transformers maps qwen3_5 to Qwen3VLProcessor
    ),
    "qwen3": TinyArchitecture("Qwen3ForCausalLM", tiny_qwen3_config, {}, False, dict),
    "qwen3-moe": TinyArchitecture("Qwen3MoeForCausalLM", tiny_qwen3_moe_config, {}, False, dict),
}
