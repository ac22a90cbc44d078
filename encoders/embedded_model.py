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

import itertools
import json
import logging
import os
import shutil
import uuid
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    PreTrainedTokenizerFast,
    Qwen3VLMoeForConditionalGeneration,
)

from .architectures import FUSED_EXPERTS
from .file_modes import as_umask_allows
from .tiny_configs import MEDIA_TOKENS, QWEN3_OMNI_MEDIA_TOKENS, QWEN3_VL_MEDIA_TOKENS, TINY_ARCHITECTURES

__all__ = [
    "ARCHITECTURES",
    "CHAT_TEMPLATE",
    "MODEL_CLASSES",
    "QWEN3_OMNI_CHAT_TEMPLATE",
    "QWEN3_VL_CHAT_TEMPLATE",
    "TEXT_CHAT_TEMPLATE",
    "build_tokenizer",
    "ensure_model",
    "init_model",
    "released_layout",
    "save_released",
]

# re-exported: the tokens each tiny model's tokenizer names (tests and callers read them from here)
__all__ += ["MEDIA_TOKENS", "QWEN3_OMNI_MEDIA_TOKENS", "QWEN3_VL_MEDIA_TOKENS"]
ARCHITECTURES = tuple(TINY_ARCHITECTURES)
# the class each tiny model is (its config.json's "architectures"), known before it is made
MODEL_CLASSES = {arch: tiny.model_class for arch, tiny in TINY_ARCHITECTURES.items()}

CHAT_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


# Qwen-style ChatML; each media part becomes <bos><placeholder><eos>, the placeholder later
# expanded to the item's exact token count.
def _chat_template(image: str | None, video: str | None, audio: str | None) -> str:
    """Qwen-style ChatML; each media part becomes ``image`` / ``video`` / ``audio`` (its bos, one
    placeholder, its eos), the placeholder later expanded to the item's exact token count. A medium the
    model does not take (None) is an error in the template, never dropped from the prompt."""
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
    refused = "' }}{{ raise_exception('this model takes no @') }}{{ '"
    return (
        template.replace("@IMAGE@", image if image is not None else refused.replace("@", "image"))
        .replace("@VIDEO@", video if video is not None else refused.replace("@", "video"))
        .replace("@AUDIO@", audio_part)
    )


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

# A text model's (Qwen3, Qwen3-MoE): an image or a video part is refused by the template itself.
TEXT_CHAT_TEMPLATE = _chat_template(None, None, None)
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
    """A byte-level BPE tokenizer (any text encodes) with Qwen's chat special tokens and ``arch``'s media tokens
    (none for a text model), and its chat template."""
    tiny = TINY_ARCHITECTURES[arch]
    media = tiny.media_tokens
    if not media:
        template = TEXT_CHAT_TEMPLATE
    elif media is MEDIA_TOKENS:  # the Qwen2.5-Omni thinker's own token names
        template = CHAT_TEMPLATE
    else:  # Qwen3-VL's names: with an audio tower, Qwen3-Omni's
        template = QWEN3_OMNI_CHAT_TEMPLATE if tiny.audio else QWEN3_VL_CHAT_TEMPLATE
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


def init_model(folder: str | Path, *, seed: int = 0, arch: str = "qwen2.5-omni") -> Path:
    """Write the tiny model folder (deterministic for a given seed); returns its path.

    ``arch``: one of `ARCHITECTURES` (the default: a Qwen2.5-Omni thinker)."""
    if arch not in TINY_ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}: one of {', '.join(ARCHITECTURES)}")
    tiny = TINY_ARCHITECTURES[arch]
    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(arch)
    config = tiny.config(tokenizer)
    loader = AutoModelForImageTextToText if tiny.media_tokens else AutoModelForCausalLM
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        if tiny.model_class.endswith("ThinkerForConditionalGeneration"):  # no Auto class builds a thinker alone
            import transformers

            model = getattr(transformers, tiny.model_class)(config).eval()
        else:
            model = loader.from_config(config).eval()
    finally:
        torch.random.set_rng_state(generator_state)
    assert type(model).__name__ == tiny.model_class, (type(model).__name__, tiny.model_class)
    model.generation_config.eos_token_id = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    save_released(model, root)
    as_umask_allows(root)  # safetensors writes 0600: the roles serving it may run as another user
    tokenizer.save_pretrained(root)
    for name, content in tiny.processor_files().items():
        (root / name).write_text(json.dumps(content, indent=2) + "\n")
    return root


def released_layout(
    model: torch.nn.Module, state: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor] | None:
    """``state`` (default: the model's) as the model's released checkpoints store it, where transformers 5.19 saves
    another: Qwen3-VL-MoE's fused experts (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``) are (experts,
    in, out) in its checkpoints, (experts, out, in) in transformers' module, which loads either (it transposes by
    shape) but saves its own; SGLang and Megatron-Bridge read the released one. None (save as transformers does)
    for every other model: transformers itself writes the MoE thinker's and Qwen3-MoE's experts one by one, as
    their checkpoints do."""
    if not isinstance(model, Qwen3VLMoeForConditionalGeneration):  # FSDP2 wraps it in a subclass: still one
        return None
    state = state if state is not None else model.state_dict()
    return {name: t.transpose(1, 2).contiguous() if name.endswith(FUSED_EXPERTS) else t for name, t in state.items()}


def save_released(model: torch.nn.Module, folder: str | Path, state: dict[str, torch.Tensor] | None = None) -> None:
    """``model.save_pretrained(folder)`` (of ``state``, when given) in the layout its released checkpoints have
    (`released_layout`); transformers' own reverse conversion would transpose Qwen3-VL-MoE's experts back to its
    module's layout, so a released state is written as given."""
    released = released_layout(model, state)
    if released is None:
        model.save_pretrained(folder, state_dict=state, safe_serialization=True)  # type: ignore[operator]
    else:
        model.save_pretrained(  # type: ignore[operator]
            folder, state_dict=released, safe_serialization=True, save_original_format=False
        )


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
