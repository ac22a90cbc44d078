"""Routing replay (R3) on the tiny Qwen3-Omni-MoE thinker: the rollout/training routing mismatch and log-prob
mismatch with and without R3, and what R3 costs per training step.

The engine (`TransformersEngine`) samples ``--prompts`` × ``--samples`` responses with
``return_routed_experts``; the rollouts go through the data role's row builder (`group_table`) and the feed's
packing (`pack`), then the reference trainer recomputes their log-probs with its routers hooked
(`RoutingCapture`, registered after the replay hooks, so it records the routing the forward used). Sources of
mismatch, each a scenario:

* ``bf16-engine`` — the engine serves bfloat16 (as SGLang on a GPU), the trainer computes in float32;
* ``stale-1`` — both float32, the trainer one optimizer step (AdamW at ``--stale-lr`` over every group)
  ahead of the engine (async, one version stale);
* ``padded-batch`` — both float32, same weights; the engine prefills and decodes one request at a time, the
  trainer runs the whole micro-batch as one right-padded forward.

Figures per scenario and R3 setting: ``tokens_mismatched`` — share of routed tokens whose top-k experts differ
in at least one layer; ``routings_mismatched`` — share of (token, layer) pairs that differ;
``logprob_abs_diff_mean`` / ``_max`` — |trainer − engine| log-prob of the response tokens. Then the overhead:
seconds per training step (`ReferenceTrainer.step` on one packed micro-batch) without and with R3, the
trainers starting from the same weights, their steps interleaved. Run from the repo root::

    .venv/bin/python tests/benchmarks/bench_r3.py            # about a minute on 2 cores

This is a script, not a pytest module: nothing in it is named ``test_*``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from encoders.embedded_model import init_model  # noqa: E402
from encoders.routing import RoutingCapture, decode_routed_experts, routing_shape  # noqa: E402
from engines.protocol import GenerateRequest, GenerateResult, SamplingParams  # noqa: E402
from engines.transformers_backend import TransformersEngine  # noqa: E402
from experience import Group, Sample, SampleStatus  # noqa: E402
from experience.microbatch import group_table  # noqa: E402
from trainer.feed import FeedBatch, pack  # noqa: E402
from trainer.losses import LossConfig  # noqa: E402
from trainer.reference import ReferenceTrainer  # noqa: E402

QUESTIONS = ["what colour is the {} star?", "how many {} circles are there?", "describe the {} picture.", "{} + 3 ="]
WORDS = ["red", "green", "blue", "yellow", "purple", "orange", "black", "white"]


def prompts(model_dir: Path, count: int) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    out = []
    for i in range(count):
        question = QUESTIONS[i % len(QUESTIONS)].format(WORDS[i % len(WORDS)])
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
        out.append(tokenizer.encode(str(text), add_special_tokens=False))
    return out


def rollouts(engine: TransformersEngine, prompts_: list[list[int]], samples: int, tokens: int) -> list[GenerateResult]:
    """Every prompt's samples, submitted together (the engine interleaves them token by token)."""
    futures = [
        engine.submit(
            GenerateRequest(
                input_ids=prompt,
                sampling=SamplingParams(
                    temperature=1.0, max_new_tokens=tokens, ignore_eos=True, sampling_seed=1000 * p + s
                ),
                return_routed_experts=True,
            )
        )
        for p, prompt in enumerate(prompts_)
        for s in range(samples)
    ]
    return [f.result() for f in futures]


def batches(prompts_: list[list[int]], results: list[GenerateResult], samples: int) -> list[FeedBatch]:
    """One micro-batch per prompt group, as the data role stores and the feed packs it."""
    out = []
    for p, prompt in enumerate(prompts_):
        group = results[p * samples : (p + 1) * samples]
        records = [
            Sample(
                index=i,
                status=SampleStatus.OK,
                response_ids=r.output_ids,
                logprobs=r.output_logprobs,
                reward=float(i % 2),
                policy_version=0,
                routed_experts=r.routed_experts,
            )
            for i, r in enumerate(group)
        ]
        advantages = [0.5 if i % 2 else -0.5 for i in range(len(group))]
        table = group_table(Group(group_id=f"g{p}", prompt_ids=prompt, samples=records), advantages)
        ids = [f"g{p}/{i}" for i in range(len(group))]
        out.append(
            FeedBatch(batch_id=f"b{p}", tensors=pack(table), sample_ids=ids, feature_keys=[[] for _ in ids], meta={})
        )
    return out


def measure(
    trainer: ReferenceTrainer, feed: list[FeedBatch], results: list[GenerateResult], *, padded: bool
) -> dict[str, float]:
    """Routing and log-prob mismatch of the trainer's forwards against the engine's rollouts."""
    layers, top_k = routing_shape(trainer.model)
    capture = RoutingCapture(trainer.model)
    tokens = tokens_differ = pairs_differ = 0
    diffs: list[torch.Tensor] = []
    index = 0
    try:
        for batch in feed:
            t = batch.tensors
            cu = t["cu_seqlens"].tolist()
            with torch.no_grad(), capture.recording() as rows:
                if padded:
                    logprobs = trainer.batch_logprobs(batch)
                else:
                    logprobs = torch.cat(
                        [
                            trainer.sequence_logprobs(
                                t["input_ids"][cu[i] : cu[i + 1]], [], routes=t["routed_experts"][cu[i] : cu[i + 1]]
                            )
                            for i in range(len(cu) - 1)
                        ]
                    )
            width = max(b - a for a, b in zip(cu, cu[1:], strict=False))
            for i in range(len(cu) - 1):
                result = results[index]
                index += 1
                engine = torch.from_numpy(decode_routed_experts(result.routed_experts or "", layers, top_k).copy())
                n = engine.shape[0]
                own = rows[0].view(len(cu) - 1, width, layers, top_k)[i, :n] if padded else rows[i][:n]
                differ = own.sort(-1).values != engine.sort(-1).values
                tokens += n
                tokens_differ += int(differ.any(-1).any(-1).sum())
                pairs_differ += int(differ.any(-1).sum())
                response = logprobs[cu[i + 1] - len(result.output_ids) : cu[i + 1]]
                diffs.append((response - torch.tensor(result.output_logprobs)).abs())
    finally:
        capture.close()
    every = torch.cat(diffs)
    return {
        "tokens_mismatched": tokens_differ / tokens,
        "routings_mismatched": pairs_differ / (tokens * layers),
        "logprob_abs_diff_mean": float(every.mean()),
        "logprob_abs_diff_max": float(every.max()),
        "routed_tokens": tokens,
    }


def step_times(model_dir: Path, feed: list[FeedBatch], steps: int) -> dict[str, Any]:
    """Seconds per `ReferenceTrainer.step` without and with R3 (same start weights, interleaved)."""
    plain = ReferenceTrainer(model_dir, lr=1e-4, loss=LossConfig(rollout_correction="none"))
    replay = ReferenceTrainer(model_dir, lr=1e-4, loss=LossConfig(rollout_correction="none"), routing_replay=True)
    times: dict[str, list[float]] = {"off": [], "on": []}
    for s in range(steps + 1):
        batch = feed[s % len(feed)]
        for name, trainer in (("off", plain), ("on", replay)):
            began = time.perf_counter()
            trainer.step(batch)
            if s:  # the first step of each warms up
                times[name].append(time.perf_counter() - began)
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    return {
        "step_s_without_r3": off,
        "step_s_with_r3": on,
        "overhead": on / off - 1,
        "steps": steps,
        "tokens_per_step": int(feed[0].tensors["input_ids"].numel()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=24, help="new tokens per sample")
    parser.add_argument("--steps", type=int, default=30, help="timed training steps per R3 setting")
    parser.add_argument("--stale-lr", type=float, default=1e-4, help="stale-1: the learning rate of the step ahead")
    args = parser.parse_args()
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = init_model(Path(tmp) / "omni", arch="qwen3-omni-moe")
        prompts_ = prompts(model_dir, args.prompts)
        engines = {
            "bf16-engine": TransformersEngine(model_dir, dtype=torch.bfloat16),
            "fp32-engine": TransformersEngine(model_dir),
        }
        try:
            results = {name: rollouts(e, prompts_, args.samples, args.tokens) for name, e in engines.items()}
        finally:
            for engine in engines.values():
                engine.close()
        feeds = {name: batches(prompts_, r, args.samples) for name, r in results.items()}
        scenarios = {
            "bf16-engine": ("bf16-engine", False, False),
            "stale-1": ("fp32-engine", False, True),
            "padded-batch": ("fp32-engine", True, False),
        }
        ahead = ReferenceTrainer(model_dir, lr=args.stale_lr, loss=LossConfig(rollout_correction="none"))
        for batch in feeds["fp32-engine"]:  # one optimizer step over every group, R3 off
            ahead.accumulate(batch)
        ahead.apply()
        for scenario, (source, padded, stale) in scenarios.items():
            for r3 in (False, True):
                trainer = ReferenceTrainer(model_dir, routing_replay=r3)
                if stale:  # one version ahead of the engine that generated the rollouts
                    trainer.model.load_state_dict(ahead.model.state_dict())
                figures = measure(trainer, feeds[source], results[source], padded=padded)
                print(json.dumps({"bench": "r3", "scenario": scenario, "r3": r3, **figures}), flush=True)
        print(json.dumps({"bench": "r3", "overhead": step_times(model_dir, feeds["bf16-engine"], args.steps)}))


if __name__ == "__main__":
    main()
