"""The embedded default model: a tiny Qwen2.5-Omni "thinker", made locally, never downloaded.

`init_model(folder)` writes a complete Hugging Face model folder — the real
`Qwen2_5OmniThinkerForConditionalGeneration` architecture (vision tower, audio tower, language
model with 3-D rotary positions) at toy dimensions with random weights from a fixed seed, a
byte-level BPE tokenizer trained here on a small built-in corpus with Qwen's chat and media special
tokens, a chat template, and the checkpoint's `preprocessor_config.json`. It loads with the
ordinary `from_pretrained` calls, so everything downstream treats it exactly like a real checkpoint.

``init_model(folder, arch="qwen3-vl")`` writes a tiny `Qwen3VLForConditionalGeneration` instead (vision
tower with DeepStack mergers, Qwen3 text model with interleaved mRoPE), with Qwen3-VL's media tokens and
chat template, and its ``preprocessor_config.json`` / ``video_preprocessor_config.json`` (read back by
`ProcessorSpec.from_pretrained` as `ProcessorSpec.qwen3_vl`).

``init_model(folder, arch="qwen3-omni-moe")`` writes a tiny `Qwen3OmniMoeThinkerForConditionalGeneration`:
vision tower with DeepStack (as Qwen3-VL), Qwen3-Omni's windowed audio tower, and a sparse
mixture-of-experts text model (8 experts, 2 routed per token, in every decoder layer) with interleaved
mRoPE — the model R3 (routing replay) is measured on. Its tokens and chat template are Qwen3-Omni's
(``<|vision_start|><|image_pad|><|vision_end|>``, ``<|audio_start|><|audio_pad|><|audio_end|>``), and
its ``preprocessor_config.json`` names Qwen3-Omni's processor.

This module knows nothing about serving; it only builds the folder.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    PreTrainedTokenizerFast,
    Qwen2_5OmniThinkerConfig,
    Qwen2_5OmniThinkerForConditionalGeneration,
    Qwen3OmniMoeThinkerConfig,
    Qwen3OmniMoeThinkerForConditionalGeneration,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)

from preprocess.spec import ProcessorSpec

from .file_modes import as_umask_allows

__all__ = [
    "ARCHITECTURES",
    "CHAT_TEMPLATE",
    "MEDIA_TOKENS",
    "QWEN3_OMNI_CHAT_TEMPLATE",
    "QWEN3_OMNI_MEDIA_TOKENS",
    "QWEN3_VL_CHAT_TEMPLATE",
    "QWEN3_VL_MEDIA_TOKENS",
    "build_tokenizer",
    "ensure_model",
    "init_model",
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
CHAT_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ARCHITECTURES = ("qwen2.5-omni", "qwen3-vl", "qwen3-omni-moe")
# the class each tiny model is (its config.json's "architectures"), known before it is made
MODEL_CLASSES = {
    "qwen2.5-omni": "Qwen2_5OmniThinkerForConditionalGeneration",
    "qwen3-vl": "Qwen3VLForConditionalGeneration",
    "qwen3-omni-moe": "Qwen3OmniMoeThinkerForConditionalGeneration",
}


# Qwen-style ChatML; each media part becomes <bos><placeholder><eos>, the placeholder later
# expanded to the item's exact token count.
def _chat_template(image: str, video: str, audio: str | None) -> str:
    """Qwen-style ChatML; each media part becomes ``image`` / ``video`` / ``audio`` (its bos, one
    placeholder, its eos), the placeholder later expanded to the item's exact token count."""
    audio_part = (
        "{%- elif part['type'] in ('audio', 'audio_url', 'input_audio') -%}{{ '" + audio + "' }}" if audio else ""
    )
    template = (
        # With tools (OpenAI function tools), as Qwen2.5's own template renders them: one system turn (the
        # first system message's text, then the tools as JSON inside <tools></tools> and how to call one);
        # assistant tool calls as <tool_call> blocks; tool results as <tool_response> blocks in a user turn.
        # Without tools, messages without tool calls render exactly as before tools were supported.
        "{%- if tools -%}"
        "{{ '<|im_start|>system\\n' }}"
        "{%- if messages[0]['role'] == 'system' -%}"
        "{%- if messages[0]['content'] is string -%}{{ messages[0]['content'] }}"
        "{%- else -%}{%- for part in messages[0]['content'] -%}"
        "{%- if part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
        "{%- endfor -%}{%- endif -%}{{ '\\n\\n' }}"
        "{%- endif -%}"
        "{{ '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
        "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
        "{%- for tool in tools -%}{{ '\\n' }}{{ tool | tojson }}{%- endfor -%}"
        "{{ '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
        'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, '
        '"arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
        "{%- endif -%}"
        "{%- for message in messages -%}"
        "{%- if tools and loop.first and message['role'] == 'system' -%}"
        "{%- elif message['role'] == 'tool' -%}"
        "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}{{ '<|im_start|>user' }}{%- endif -%}"
        "{{ '\\n<tool_response>\\n' }}"
        "{%- if message['content'] is string -%}{{ message['content'] }}"
        "{%- else -%}{%- for part in message['content'] -%}"
        "{%- if part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
        "{%- endfor -%}{%- endif -%}"
        "{{ '\\n</tool_response>' }}"
        "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}{{ '<|im_end|>\\n' }}{%- endif -%}"
        "{%- elif message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] -%}"
        "{{ '<|im_start|>assistant' }}"
        "{%- if message['content'] -%}{{ '\\n' + message['content'] }}{%- endif -%}"
        "{%- for call in message['tool_calls'] -%}"
        "{%- if call['function'] is defined -%}{%- set call = call['function'] -%}{%- endif -%}"
        "{{ '\\n<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}"
        "{%- if call['arguments'] is string -%}{{ call['arguments'] }}{%- else -%}{{ call['arguments'] | tojson }}"
        "{%- endif -%}{{ '}\\n</tool_call>' }}"
        "{%- endfor -%}"
        "{{ '<|im_end|>\\n' }}"
        "{%- else -%}"
        "{{ '<|im_start|>' + message['role'] + '\\n' }}"
        "{%- if message['content'] is string -%}{{ message['content'] }}"
        "{%- else -%}{%- for part in message['content'] -%}"
        "{%- if part['type'] == 'text' -%}{{ part['text'] }}"
        "{%- elif part['type'] in ('image', 'image_url') -%}{{ '@IMAGE@' }}"
        "{%- elif part['type'] in ('video', 'video_url') -%}{{ '@VIDEO@' }}"
        "@AUDIO@"
        "{%- endif -%}{%- endfor -%}{%- endif -%}"
        "{{ '<|im_end|>\\n' }}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
    )
    return template.replace("@IMAGE@", image).replace("@VIDEO@", video).replace("@AUDIO@", audio_part)


CHAT_TEMPLATE = _chat_template(
    "<|vision_bos|><|IMAGE|><|vision_eos|>",
    "<|vision_bos|><|VIDEO|><|vision_eos|>",
    "<|audio_bos|><|AUDIO|><|audio_eos|>",
)
# Qwen3-VL's own template renders an image as <|vision_start|><|image_pad|><|vision_end|> and a video
# as <|vision_start|><|video_pad|><|vision_end|> (the processor then puts the per-frame timestamps,
# vision_start / pads / vision_end inside); it has no audio.
QWEN3_VL_CHAT_TEMPLATE = _chat_template(
    "<|vision_start|><|image_pad|><|vision_end|>", "<|vision_start|><|video_pad|><|vision_end|>", None
)

QWEN3_OMNI_CHAT_TEMPLATE = _chat_template(
    "<|vision_start|><|image_pad|><|vision_end|>",
    "<|vision_start|><|video_pad|><|vision_end|>",
    "<|audio_start|><|audio_pad|><|audio_end|>",
)

_VOCAB = 512
logger = logging.getLogger(__name__)


def _corpus() -> list[str]:
    """A small fixed corpus: chat roles, the demo task's words, numbers, punctuation."""
    colours = ["red", "green", "blue", "yellow", "purple", "orange", "black", "white"]
    shapes = ["circle", "square", "triangle", "star", "line", "tone", "image", "video", "audio", "picture"]
    words = [
        "what",
        "which",
        "how",
        "many",
        "is",
        "the",
        "a",
        "in",
        "of",
        "colour",
        "color",
        "shape",
        "answer",
        "describe",
        "you",
        "see",
        "hear",
        "frequency",
        "high",
        "low",
        "left",
        "right",
        "top",
        "bottom",
        "yes",
        "no",
        "user",
        "assistant",
        "system",
        "helpful",
        "The",
        "There",
        "are",
        "and",
    ]
    lines = [f"{w} {c} {s}." for w, c, s in itertools.product(words, colours, shapes)]
    lines += [f"{a} + {b} = {a + b}" for a in range(30) for b in range(30)]
    return lines


def build_tokenizer(arch: str = "qwen2.5-omni") -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (any text encodes) with Qwen's chat and media special tokens (the
    Qwen2.5-Omni thinker's, Qwen3-VL's with ``arch="qwen3-vl"``, Qwen3-Omni's with ``"qwen3-omni-moe"``)."""
    media, template = {
        "qwen3-vl": (QWEN3_VL_MEDIA_TOKENS, QWEN3_VL_CHAT_TEMPLATE),
        "qwen3-omni-moe": (QWEN3_OMNI_MEDIA_TOKENS, QWEN3_OMNI_CHAT_TEMPLATE),
    }.get(arch, (MEDIA_TOKENS, CHAT_TEMPLATE))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = CHAT_TOKENS + list(media.values())
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB - len(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer)
    tokenizer.add_special_tokens(specials)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=template,
        extra_special_tokens=dict(media),
        model_max_length=32768,
    )


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
        image_token_id=ids["image_token"],
        video_token_id=ids["video_token"],
        vision_start_token_id=ids["vision_start_token"],
        vision_end_token_id=ids["vision_end_token"],
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
        position_id_per_seconds=int(getattr(qwen3_omni_spec(), "position_id_per_seconds", 13)),
        tie_word_embeddings=False,
    )
    return Qwen3OmniMoeThinkerConfig(**fields)


def qwen3_omni_spec() -> ProcessorSpec:
    """`ProcessorSpec.qwen3_omni_moe` once the preprocess library has it; until then Qwen3-VL's vision
    numbers (patch 16, mean = std = 0.5) with Qwen2.5-Omni's audio settings."""
    factory = getattr(ProcessorSpec, "qwen3_omni_moe", None)
    if callable(factory):
        return factory()  # type: ignore[no-any-return]
    vision = ProcessorSpec.qwen3_vl()
    return dataclasses.replace(
        ProcessorSpec.qwen2_5_omni(),
        patch_size=vision.patch_size,
        image_mean=vision.image_mean,
        image_std=vision.image_std,
        min_pixels=vision.min_pixels,
        max_pixels=vision.max_pixels,
    )


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


def init_model(folder: str | Path, *, seed: int = 0, arch: str = "qwen2.5-omni") -> Path:
    """Write the tiny model folder (deterministic for a given seed); returns its path.

    ``arch``: ``qwen2.5-omni`` (the default: a Qwen2.5-Omni thinker), ``qwen3-vl`` or ``qwen3-omni-moe``."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}: one of {', '.join(ARCHITECTURES)}")
    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(arch)
    config: Any
    model_class: Any
    if arch == "qwen3-vl":
        config, model_class = tiny_qwen3_vl_config(tokenizer), Qwen3VLForConditionalGeneration
    elif arch == "qwen3-omni-moe":
        config, model_class = tiny_qwen3_omni_moe_config(tokenizer), Qwen3OmniMoeThinkerForConditionalGeneration
    else:
        config, model_class = tiny_config(tokenizer), Qwen2_5OmniThinkerForConditionalGeneration
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = model_class(config).eval()
    finally:
        torch.random.set_rng_state(generator_state)
    model.generation_config.eos_token_id = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(root, safe_serialization=True)
    as_umask_allows(root)  # safetensors writes 0600: the roles serving it may run as another user
    tokenizer.save_pretrained(root)
    if arch == "qwen3-vl":
        image, video = _qwen3_vl_processor_configs(ProcessorSpec.qwen3_vl())
        (root / "preprocessor_config.json").write_text(json.dumps(image, indent=2) + "\n")
        (root / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2) + "\n")
        return root
    if arch == "qwen3-omni-moe":
        processor = _omni_processor_config(qwen3_omni_spec(), "Qwen3OmniMoeProcessor")
    else:
        processor = _omni_processor_config(ProcessorSpec.qwen2_5_omni(), "Qwen2_5OmniProcessor")
    (root / "preprocessor_config.json").write_text(json.dumps(processor, indent=2) + "\n")
    return root


def ensure_model(folder: str | Path, *, seed: int = 0, arch: str = "qwen2.5-omni") -> Path:
    """The folder if it holds a model; otherwise the tiny model is made there first — for the places
    that own a default model folder (`weir init-model --if-missing`, `weir up`'s ``HOME/model``), never
    for a folder a user named (a typo there must be an error, not a random model).

    Safe when several processes start at once on one volume: each builds in a private sibling folder
    and renames it into place; the losers discard theirs.
    """
    root = Path(folder)
    if (root / "config.json").is_file():
        return root
    logger.info("no model at %s: creating the tiny embedded model there", root)
    root.parent.mkdir(parents=True, exist_ok=True)
    staging = root.parent / f".{root.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    init_model(staging, seed=seed, arch=arch)
    try:
        os.rename(staging, root)
    except OSError:  # another process got there first (or the folder exists but is not a model)
        shutil.rmtree(staging, ignore_errors=True)
        if not (root / "config.json").is_file():
            raise
    return root
