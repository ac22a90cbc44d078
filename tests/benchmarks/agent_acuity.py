"""Acuity probe for the visual-search demo: can the tiny model learn, *supervised*, the colour of
`visual_search`'s square from the crop the agent sees (56×56, the quarter holding it)? If it cannot, RL on the
agent task cannot reach it either; if it can, a miss of the agent demo is RL's, not the model's eyes.

Starts a stack, writes 10 crops per colour for training and 4 per colour held out (other seeds), runs supervised
steps on (crop + question → colour) pairs, and every 50 steps publishes the weights and prints greedy accuracy on
training and held-out crops as a JSON line. Run from the repo root::

    .venv/bin/python tests/benchmarks/agent_acuity.py --patch 12 --steps 200

Measured (2026-12-02, patch 12, the embedded Qwen2.5-Omni-shaped model): held-out 17 % at 50 steps, 100 % at 100,
150 and 200 — while the agent demo's trajectories that showed the square named its colour 0 % of the time.
This is a script, not a pytest module: nothing in it is named ``test_*``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import preprocess as pp  # noqa: E402
from launcher.demo.task import AGENT_QUESTION, AGENT_SIZE  # noqa: E402
from launcher.stack import LocalStack  # noqa: E402
from rollout.environments import COLOURS, PromptInfo, VisualSearch  # noqa: E402
from trainer.loop import evaluate  # noqa: E402
from trainer.policy_version import PolicyOwner, WeightRecipients  # noqa: E402
from trainer.publish import PAUSE_MODE  # noqa: E402
from trainer.reference import ReferenceTrainer  # noqa: E402


def crop_rows(start: int, per_colour: int, patch: int, folder: Path) -> list[dict[str, Any]]:
    """Rows asking the square's colour in the quarter that holds it whole, ``per_colour`` per colour."""
    half = AGENT_SIZE // 2
    buckets: dict[str, list[dict[str, Any]]] = {c: [] for c in sorted(COLOURS)}
    seed = start
    while any(len(b) < per_colour for b in buckets.values()):
        env = VisualSearch(seed=seed, size=AGENT_SIZE, patch=patch)
        env.reset(PromptInfo(messages=[], group_id="", sample_index=0, prompt_index=0))
        x, y = env.state["patch_xy"]
        qx, qy = x // half, y // half
        whole = (x + patch - 1) // half == qx and (y + patch - 1) // half == qy
        if whole and len(buckets[env.answer]) < per_colour:
            path = folder / f"p{patch}-{seed}.png"
            env.state["image"].crop((qx * half, qy * half, (qx + 1) * half, (qy + 1) * half)).save(path)
            image = {"type": "image_url", "image_url": {"url": str(path)}}
            buckets[env.answer].append(
                {
                    "messages": [{"role": "user", "content": [image, {"type": "text", "text": AGENT_QUESTION}]}],
                    "reward": {"type": "exact_match", "answer": env.answer},
                }
            )
        seed += 1
    return [buckets[c][i] for i in range(per_colour) for c in buckets]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--patch", type=int, default=12, help="the square's side in pixels (default: 12)")
    parser.add_argument("--steps", type=int, default=200, help="supervised steps (default: 200)")
    parser.add_argument("--home", type=Path, default=None, help="the stack's home (default: a temporary folder)")
    parser.add_argument("--base-port", type=int, default=9900, help="the stack's base port (default: 9900)")
    args = parser.parse_args()
    home = args.home or Path(tempfile.mkdtemp(prefix="weir-acuity-"))
    stack = LocalStack(home=home, base_port=args.base_port)
    urls = stack.start()
    try:
        media = (home / "media" / "acuity").resolve()
        media.mkdir(parents=True, exist_ok=True)
        train, held_out = crop_rows(0, 10, args.patch, media), crop_rows(100_000, 4, args.patch, media)
        trainer = ReferenceTrainer(home / "model", features=pp.FeatureStore(home / "cache", 1 << 30), lr=1e-3)
        body = {
            "prompts": [{**row, "n": 1} for row in train],
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "record": False,
        }
        headers = {"Authorization": f"Bearer {stack.token}"}
        groups = httpx.post(f"{urls['rollout']}/v1/rollouts", json=body, headers=headers, timeout=600).json()["groups"]
        pairs = [
            (g["prompt_ids"], trainer.answer_ids(row["reward"]["answer"]), g["feature_keys"])
            for g, row in zip(groups, train, strict=True)
        ]
        recipients = WeightRecipients(
            engines=[u for k, u in urls.items() if k.startswith("engine")],
            data_url=urls["data"],
            encoder_url=urls.get("encoder"),
            token=stack.token,
            pause_mode=PAUSE_MODE,
            weights="disk",
        )
        policy = PolicyOwner(trainer, weights=home / "weights", main=True, recipients=recipients)
        start = time.time()
        for step in range(1, args.steps + 1):
            loss = trainer.supervised_step(pairs, lr=1e-3)
            if step % 50 == 0 or step == args.steps:
                policy.publish()
                line = {
                    "patch": args.patch,
                    "step": step,
                    "loss": round(loss, 3),
                    "train_accuracy": evaluate(urls["rollout"], train[:24], token=stack.token),
                    "held_out_accuracy": evaluate(urls["rollout"], held_out, token=stack.token),
                    "seconds": round(time.time() - start),
                }
                print(json.dumps(line), flush=True)
    finally:
        stack.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
