"""Publishing weights to engines: by broadcast (`BroadcastWeightSync`, gloo on CPU) vs through disk
(`ReferenceTrainer.export` + `publish_weights`), side by side in one run.

Two models: the tiny one (`encoders.embedded_model.init_model`) and a larger one made here from it — the
same folder (tokenizer, processor, generation config), its thinker's text model widened and deepened
(``--hidden``, ``--layers``, ``--intermediate``; a few hundred MB of float32), never committed. For each,
two engine role processes (``weir serve engine``) and a trainer in this process: ``--rounds`` publishes
each way, each of new weights (the trainer's parameters plus noise). After every publish both engines'
greedy log-probs must agree with each other (they serve the same weights).

Figures (seconds): ``state`` — the trainer's full state dict gathered; ``export`` — it written as
safetensors; ``disk`` — pause, ``update_weights_from_disk`` on every engine, continue; ``disk total`` =
export + disk; ``connect`` — the broadcast group joined (once); ``broadcast`` — pause, every tensor
broadcast into every engine and loaded, continue. Run from the repo root::

    .venv/bin/python tests/benchmarks/bench_weight_sync.py            # about 2 min on 2 cores

This is a script, not a pytest module: nothing in it is named ``test_*``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch
from transformers import GenerationConfig, Qwen2_5OmniThinkerConfig, Qwen2_5OmniThinkerForConditionalGeneration

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from encoders.embedded_model import init_model  # noqa: E402
from trainer.publish import BroadcastWeightSync, publish_weights  # noqa: E402
from trainer.reference import ReferenceTrainer  # noqa: E402

GREEDY = {
    "input_ids": [1, 2, 3, 4, 5],
    "return_logprob": True,
    "sampling_params": {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True},
}
HEAD_DIM = 16  # the tiny model's: its mRoPE sections [2, 3, 3] cover half of it


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def larger_model(folder: Path, *, hidden: int, layers: int, intermediate: int) -> Path:
    """The tiny model's folder with a wider, deeper text model (towers as they are)."""
    init_model(folder)
    config = Qwen2_5OmniThinkerConfig.from_pretrained(folder)
    text = config.text_config
    text.hidden_size, text.num_hidden_layers, text.intermediate_size = hidden, layers, intermediate
    text.num_attention_heads, text.num_key_value_heads = hidden // HEAD_DIM, max(1, hidden // HEAD_DIM // 4)
    if getattr(text, "layer_types", None) is not None:
        text.layer_types = [text.layer_types[0]] * layers
    config.vision_config.out_hidden_size = config.audio_config.output_dim = hidden  # towers feed the text model
    torch.manual_seed(0)
    model = Qwen2_5OmniThinkerForConditionalGeneration(config).eval()
    model.generation_config = GenerationConfig.from_pretrained(folder)
    for old in folder.glob("*.safetensors"):
        old.unlink()
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def start_engines(model: Path, root: Path, count: int) -> list[tuple[subprocess.Popen[bytes], str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WEIR_")}
    root.mkdir(parents=True, exist_ok=True)
    engines = []
    for i in range(count):
        port = free_port()
        cache = root / f"engine-{i}"
        run_env = {
            **env,
            "WEIR_MODEL": str(model),
            "WEIR_CACHE_DIR": str(cache / "cache"),
            "WEIR_EMBEDDING_CACHE_DIR": str(cache / "emb"),
            "WEIR_LOG_LEVEL": "warning",
            "WEIR_REQUEST_TIMEOUT_S": "600",
        }
        command = [sys.executable, "-m", "launcher.cli", "serve", "engine", "--host", "127.0.0.1", "--port", str(port)]
        log = (root / f"engine-{i}.log").open("wb")
        engines.append(
            (subprocess.Popen(command, env=run_env, stdout=log, stderr=subprocess.STDOUT), f"http://127.0.0.1:{port}")
        )
    for process, url in engines:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the engine at {url} did not start; see {root}")
            time.sleep(0.5)
    return engines


def same_weights(urls: list[str]) -> None:
    outputs = [httpx.post(f"{u}/generate", json=GREEDY, timeout=600).json()["meta_info"] for u in urls]
    logprobs = [o["output_token_logprobs"] for o in outputs]
    assert all(lp == logprobs[0] for lp in logprobs), "the engines serve different weights"


def noise(trainer: ReferenceTrainer, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in trainer.model.parameters():
            parameter.add_(1e-3 * torch.randn(parameter.shape, generator=generator))


def bench(name: str, model: Path, root: Path, *, engines: int, rounds: int) -> dict[str, Any]:
    processes = start_engines(model, root, engines)
    urls = [url for _, url in processes]
    try:
        trainer = ReferenceTrainer(model)
        size = sum(t.numel() * t.element_size() for t in trainer.full_state_dict().values())
        rows: dict[str, list[float]] = {k: [] for k in ("state", "export", "disk", "disk total", "broadcast")}
        sync = BroadcastWeightSync(urls, master_address="127.0.0.1", master_port=free_port(), bucket_bytes=256 << 20)
        start = time.perf_counter()
        sync.connect()
        connect_s = time.perf_counter() - start
        version = 0
        try:
            for r in range(rounds):
                noise(trainer, seed=2 * r)
                version += 1
                start = time.perf_counter()
                folder = trainer.export(root / f"v{version}")
                rows["export"].append(time.perf_counter() - start)
                start = time.perf_counter()
                publish_weights(folder, version, engine_urls=urls, timeout_s=600)
                rows["disk"].append(time.perf_counter() - start)
                rows["disk total"].append(rows["export"][-1] + rows["disk"][-1])
                same_weights(urls)
                for old in folder.glob("*.safetensors"):
                    old.unlink()

                noise(trainer, seed=2 * r + 1)
                version += 1
                start = time.perf_counter()
                state = trainer.full_state_dict()
                rows["state"].append(time.perf_counter() - start)
                start = time.perf_counter()
                sync.publish(state.items(), version)
                rows["broadcast"].append(time.perf_counter() - start)
                same_weights(urls)
                del state
        finally:
            sync.close()
    finally:
        for process, _ in processes:
            process.terminate()
        for process, _ in processes:
            process.wait(30)
    return {
        "model": name,
        "mb": round(size / 2**20, 1),
        "tensors": len(trainer.full_state_dict()),
        "engines": engines,
        "connect_s": round(connect_s, 3),
        **{f"{k}_s": [round(v, 3) for v in vs] for k, vs in rows.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--intermediate", type=int, default=3072)
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="weir-bench-sync-") as tmp:
        root = Path(tmp)
        tiny = init_model(root / "tiny")
        results.append(bench("tiny", tiny, root / "run-tiny", engines=args.engines, rounds=args.rounds))
        print(json.dumps(results[-1]), flush=True)
        large = larger_model(root / "large", hidden=args.hidden, layers=args.layers, intermediate=args.intermediate)
        results.append(bench("large", large, root / "run-large", engines=args.engines, rounds=args.rounds))
        print(json.dumps(results[-1]), flush=True)
    print()
    header = (
        f"{'model':<6} {'MB':>8} {'tensors':>7} {'export':>8} {'disk':>8} {'disk total':>10} {'state':>7} "
        f"{'broadcast':>9} {'speed-up':>8}"
    )
    print(header)
    print("-" * len(header))
    for row in results:
        best = {k: min(row[f"{k}_s"]) for k in ("export", "disk", "disk total", "state", "broadcast")}
        speedup = best["disk total"] / (best["state"] + best["broadcast"])
        print(
            f"{row['model']:<6} {row['mb']:>8} {row['tensors']:>7} {best['export']:>8.3f} {best['disk']:>8.3f} "
            f"{best['disk total']:>10.3f} {best['state']:>7.3f} {best['broadcast']:>9.3f} {speedup:>7.2f}x"
        )
    print(f"(seconds, best of {args.rounds} rounds; {args.engines} engines;", end=" ")
    print("speed-up = disk total / (state + broadcast))")


if __name__ == "__main__":
    main()
