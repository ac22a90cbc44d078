"""A packed micro-batch with an image, for any of Weir's tiny vision models: the trainers' checks that media
reach the model (`tests/trainer/test_megatron_qwen3_vl.py`, `tests/gpu/test_gpu_paths.py`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa

from trainer.feed import FeedBatch, pack


def image_prompt(model: Path) -> tuple[list[int], object]:
    import preprocess as pp
    from preprocess import samples

    spec = pp.ProcessorSpec.from_pretrained(model)
    image = pp.process_image(samples.encode_image(samples.test_pattern(64, 64), "PNG"), spec)
    config = json.loads((model / "config.json").read_text())
    ids = [1, 2, config["vision_start_token_id"], *[config["image_token_id"]] * image.num_tokens]
    return [*ids, config["vision_end_token_id"], 3, 4], image


def pair_batch(
    prompts: list[list[int]],
    responses: list[list[int]],
    feature_keys: list[list[str]],
    *,
    media: list[list[Any]] | None = None,
    batch_id: str = "b",
) -> FeedBatch:
    """Two (prompt, response) sequences packed as the feed packs them: the responses are the loss tokens, the
    first sequence rewarded (advantage +1), the second not (-1)."""
    table = pa.table(
        {
            "input_ids": [p + r for p, r in zip(prompts, responses, strict=True)],
            "loss_mask": [[0] * len(p) + [1] * len(r) for p, r in zip(prompts, responses, strict=True)],
            "rollout_logprobs": [[-1.0] * (len(p) + len(r)) for p, r in zip(prompts, responses, strict=True)],
            "advantage": [1.0, -1.0],
            "reward": [1.0, 0.0],
            "policy_version": [0, 0],
        }
    )
    ids = [f"{batch_id}/{i}" for i in range(len(prompts))]
    return FeedBatch(
        batch_id=batch_id, tensors=pack(table), sample_ids=ids, feature_keys=feature_keys, meta={}, media=media
    )


def image_batch(model: Path, store: object) -> FeedBatch:
    """One packed micro-batch: an image sequence and a text one, each with a response."""
    import preprocess as pp
    from preprocess import samples

    spec = pp.ProcessorSpec.from_pretrained(model)
    item = pp.process_bytes(samples.encode_image(samples.test_pattern(64, 64), "PNG"), "image", spec, store=store)
    prompt, _ = image_prompt(model)
    return pair_batch([prompt, [5, 6, 7]], [[10, 11, 12], [13, 14]], [[item.key], []], batch_id="gpu")
