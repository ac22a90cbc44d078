"""What `weir up --demo` (and so `make run`) shows: a rollout request and an OpenAI chat on the stack,
both sent with the stack's API token."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from pathlib import Path

from rich.table import Table

from experience.records import Group
from preprocess import samples
from rollout.api import Message, RewardSpec, RolloutPrompt, RolloutRequest
from rollout.client import RolloutClient
from rollout.messages import ContentPart, TextPart

from ..console import console

__all__ = ["Showcase", "run_showcase"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Showcase:
    """What came back: the rollout groups, and the chat completion's text."""

    groups: list[Group]
    chat: str | None


def _data_uri(mime: str, data: bytes) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def run_showcase(urls: dict[str, str], media: Path, *, token: str | None = None) -> Showcase:
    """Send image, video and audio prompts (n=4) and a chat completion; print what came back."""
    import openai

    (media / "shapes.png").write_bytes(samples.encode_image(samples.test_pattern(320, 240), "PNG"))
    (media / "clip.mp4").write_bytes(samples.make_video(320, 180, 25, 75))
    (media / "tone.wav").write_bytes(samples.make_audio(2.0, 44100, 2))

    def ask(part: ContentPart, question: str, answer: str) -> RolloutPrompt:
        text: TextPart = {"type": "text", "text": question}
        return RolloutPrompt(
            messages=[Message(role="user", content=[dict(part), dict(text)])],
            n=4,
            reward=RewardSpec(type="exact_match", answer=answer),
        )

    prompts = [
        ask({"type": "image_url", "image_url": {"url": "shapes.png"}}, "Which colour is the square?", "white"),
        ask({"type": "video_url", "video_url": {"url": "clip.mp4"}}, "Which way does it move?", "left"),
        ask({"type": "audio_url", "audio_url": {"url": "tone.wav"}}, "Is the tone high or low?", "low"),
    ]
    request = RolloutRequest(prompts=prompts, sampling_params={"max_new_tokens": 16, "temperature": 1.0})
    with RolloutClient(urls["rollout"], token=token, timeout_s=300) as client:
        groups = client.rollouts(request).groups
    table = Table(title="POST /v1/rollouts: 3 prompts x n=4 (the tiny model is untrained: expect noise)")
    columns = ("prompt", "media tokens", "ids", "n", "status", "reward", "new", "logprob")
    for column in columns:
        table.add_column(column, no_wrap=True)
    for group in groups:
        media_tokens = ", ".join(f"{k} {v}" for k, v in group.token_counts.items() if k != "text")
        for s in group.samples:
            mean = sum(s.logprobs) / max(1, len(s.logprobs))
            cells = (
                group.prompt_index,
                media_tokens,
                len(group.prompt_ids),
                s.index,
                s.status.value,
                s.reward,
                len(s.response_ids),
                f"{mean:.2f}",
            )
            table.add_row(*(str(c) for c in cells))
    console.print(table)
    chat = openai.OpenAI(base_url=f"{urls['rollout']}/v1", api_key=token or "unused")  # sent as the Bearer token
    model = chat.models.list().data[0].id  # the name the stack serves the model under (--served-model-name)
    reply = chat.chat.completions.create(
        model=model,
        max_tokens=16,
        seed=0,
        messages=[
            {
                "role": "user",
                "content": [  # type: ignore[list-item]
                    {
                        "type": "image_url",
                        "image_url": {"url": _data_uri("image/png", (media / "shapes.png").read_bytes())},
                    },
                    {"type": "text", "text": "Describe the picture."},
                ],
            }
        ],
    )
    answer = (reply.choices[0].message.content or "")[:40]
    console.print(
        f"[bold]openai.chat.completions.create[/bold] (model {model!r}) → {answer!r} "
        f"(usage: {reply.usage.prompt_tokens if reply.usage else '?'} prompt tokens, "
        f"{reply.usage.completion_tokens if reply.usage else '?'} completion tokens)"
    )
    return Showcase(groups=groups, chat=reply.choices[0].message.content)
