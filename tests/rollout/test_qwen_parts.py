"""Qwen-style content parts (``{"type": "image", "image": url}``), as Qwen's examples and many datasets write
them, are the rollout role's media parts too: read as the OpenAI part of their kind (`rollout.prompts`)."""

from __future__ import annotations

import pytest

from rollout.errors import InvalidPrompt
from rollout.prompts import parse_messages

QWEN = [
    {"type": "image", "image": "data:image/png;base64,AAAA"},
    {"type": "video", "video": "file://clips/a.mp4", "fps": 2.0},  # Qwen's frame options are not Weir's: ignored
    {"type": "audio", "audio": "https://example.com/a.wav"},
    {"type": "text", "text": "what is this?"},
]
OPENAI = [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    {"type": "video_url", "video_url": {"url": "file://clips/a.mp4"}},
    {"type": "audio_url", "audio_url": {"url": "https://example.com/a.wav"}},
    {"type": "text", "text": "what is this?"},
]


def test_qwen_parts_read_as_the_openai_parts_of_their_kind() -> None:
    qwen = parse_messages([{"role": "user", "content": QWEN}])
    assert qwen == parse_messages([{"role": "user", "content": OPENAI}])
    template, items = qwen
    assert [i.model_dump(exclude_unset=True) for i in items] == [
        {"type": "image", "data": "data:image/png;base64,AAAA"},
        {"type": "video", "path": "clips/a.mp4"},
        {"type": "audio", "url": "https://example.com/a.wav"},
    ]
    assert [p["type"] for p in template[0]["content"]] == ["image", "video", "audio", "text"]


@pytest.mark.parametrize("part", [{"type": "image"}, {"type": "audio", "audio": 3}, {"type": "video", "video": ""}])
def test_a_qwen_part_without_a_source_is_refused_by_name(part: dict[str, object]) -> None:
    with pytest.raises(InvalidPrompt) as refused:
        parse_messages([{"role": "user", "content": [part]}], "prompts[0].messages")
    assert refused.value.code == "invalid_messages" and "prompts[0].messages[0].content[0]" in str(refused.value)
