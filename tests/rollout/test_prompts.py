"""Messages → preprocess items and template messages; the chat template with exact placeholder expansion."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rollout.errors import InvalidPrompt
from rollout.prompts import PromptBuilder, parse_messages


def test_text_and_media_parts() -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                {"type": "video_url", "video_url": {"url": "file://clips/a.mp4"}},
                {"type": "audio_url", "audio_url": {"url": "https://example.com/a.wav"}},
                {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
                {"type": "image_url", "image_url": "pictures/b.png"},  # a bare URL string is accepted too
                {"type": "text", "text": "what is this?"},
            ],
        },
    ]
    template, items = parse_messages(messages)
    assert [i.model_dump(exclude_unset=True) for i in items] == [  # what the preprocess role is sent
        {"type": "image", "data": "data:image/png;base64,AAAA"},
        {"type": "video", "path": "clips/a.mp4"},
        {"type": "audio", "url": "https://example.com/a.wav"},
        {"type": "audio", "data": "UklGRg=="},
        {"type": "image", "path": "pictures/b.png"},
    ]
    assert template[0] == {"role": "system", "content": "be brief"}
    assert [p["type"] for p in template[1]["content"]] == ["image", "video", "audio", "audio", "image", "text"]


@pytest.mark.parametrize(
    "messages,code,where",
    [
        ([], "invalid_messages", "prompts[0].messages:"),
        ("hi", "invalid_messages", "prompts[0].messages:"),
        ([{"role": "wizard", "content": "x"}], "invalid_messages", "prompts[0].messages[0].role"),
        (["not a dict"], "invalid_messages", "prompts[0].messages[0].role"),
        ([{"role": "user", "content": 5}], "invalid_messages", "prompts[0].messages[0].content"),
        ([{"role": "user", "content": [{"type": "hologram"}]}], "unknown_part_type", "content[0].type"),
        ([{"role": "user", "content": [{"type": "text", "text": 5}]}], "unknown_part_type", "content[0].type"),
        ([{"role": "user", "content": ["text"]}], "unknown_part_type", "content[0].type"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "invalid_messages", "image_url.url"),
        (
            [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"format": "wav"}}]}],
            "invalid_messages",
            "input_audio.data",
        ),
    ],
)
def test_bad_messages_name_the_field(messages: Any, code: str, where: str) -> None:
    with pytest.raises(InvalidPrompt) as refused:
        parse_messages(messages, "prompts[0].messages")
    assert refused.value.code == code and where in str(refused.value)


def test_placeholders_expand_to_each_items_count(model: Path) -> None:
    builder = PromptBuilder(model)
    template, _ = parse_messages(
        [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": "a.png"}},
                    {"type": "text", "text": "and"},
                    {"type": "audio_url", "audio_url": {"url": "a.wav"}},
                ],
            }
        ]
    )
    ids = builder.build(template, [("image", 7), ("audio", 3)])
    assert ids.count(builder.placeholders["image"]) == 7 and ids.count(builder.placeholders["audio"]) == 3
    plain = builder.build([{"role": "user", "content": "hi"}], [])
    assert builder.placeholders["image"] not in plain and builder.decode(plain).strip()
    assert builder.context_length > len(ids)


def test_text_that_spells_a_placeholder_is_refused(model: Path) -> None:
    builder = PromptBuilder(model)
    image_token = str(builder.tokenizer.image_token)
    template, items = parse_messages([{"role": "user", "content": f"look: {image_token}"}])
    assert items == []
    with pytest.raises(InvalidPrompt) as refused:
        builder.build(template, [])
    assert refused.value.code == "placeholder_mismatch"
