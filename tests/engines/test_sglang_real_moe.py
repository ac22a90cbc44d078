"""A mixture-of-experts model on the real SGLang engine (sglang 0.5.23 in this process, under
`tests.engines.sglang_cpu`): a tiny Qwen3-MoE (``Qwen3MoeForCausalLM``, an architecture SGLang serves natively;
made here from transformers' own class, random weights).

On the CPU it generates, greedy tokens equal to transformers', and R3's routes come back with every sample in the
layout Weir's micro-batches store, the routers' own choices (the top-k of transformers' router logits for the same
tokens). SGLang's routed-expert capture (``enable_return_routed_experts``) pins its host buffer with
``cudaHostRegister`` (``srt/state_capturer/base.py``), which needs CUDA: the scaffolding leaves that buffer unpinned
(`tests.engines.sglang_cpu.patch_on_import`), the capture itself SGLang's.

Runs where sglang is installed (``make test`` runs it in ``.venv-sglang``; skipped, with the reason, elsewhere).
"""

from __future__ import annotations

import importlib.util
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engines.protocol import GenerateRequest, SamplingParams
from experience.microbatch import token_routes

if importlib.util.find_spec("sglang") is None:
    pytest.skip("needs sglang: `make test` builds .venv-sglang and runs this module there", allow_module_level=True)

from . import sglang_cpu  # noqa: E402 — only where sglang is installed

sglang_cpu.prepare()  # before sglang (and its torch threads) start

from engines.factory import load_engine  # noqa: E402

pytestmark = pytest.mark.integration

LAYERS, EXPERTS, TOP_K = 2, 8, 2


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3-MoE with the tokenizer of Weir's tiny models (a Qwen chat tokenizer)."""
    import shutil

    from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from encoders.embedded_model import init_model

    donor = init_model(tmp_path_factory.mktemp("donor") / "model", arch="qwen3-vl")
    folder = tmp_path_factory.mktemp("qwen3-moe") / "model"
    tokenizer = AutoTokenizer.from_pretrained(donor)
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=True,
        max_position_embeddings=4096,
        initializer_range=0.2,  # a random tiny model with the default range repeats one token forever
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
    )
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    shutil.copy(donor / "generation_config.json", folder / "generation_config.json")
    return folder


def _engine(model: Path, *, routed_experts: bool) -> object:
    return load_engine(model, backend="sglang", server_args=sglang_cpu.SERVER_ARGS, routed_experts=routed_experts)


def _chat(model: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    return list(tokenizer.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"))


def test_the_moe_model_generates_transformers_greedy_tokens(model: Path) -> None:
    from transformers import Qwen3MoeForCausalLM

    engine = _engine(model, routed_experts=False)
    try:
        hf = Qwen3MoeForCausalLM.from_pretrained(model).eval()
        for text in ("Route me.", "Which experts?"):
            ids = _chat(model, text)
            request = GenerateRequest(
                input_ids=ids, sampling=SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=0.0)
            )
            ours = engine.generate(request, timeout=300).output_ids  # type: ignore[attr-defined]
            with torch.no_grad():
                theirs = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, min_new_tokens=8)
            assert ours == theirs[0, len(ids) :].tolist(), text
    finally:
        engine.close()  # type: ignore[attr-defined]


def _router_choices(model: Path, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """transformers' routers on ``ids``: each token's top-k experts per layer, ``(tokens, layers, k)``, and the
    router logits, ``(tokens, layers, experts)``."""
    from transformers import Qwen3MoeForCausalLM

    hf = Qwen3MoeForCausalLM.from_pretrained(model).eval()
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_router_logits=True)
    logits = torch.stack(out.router_logits, dim=1)  # (tokens, layers, experts)
    return logits.topk(TOP_K, dim=-1).indices.numpy(), logits.numpy()


def test_routes_come_back_for_every_token_and_are_the_routers_choices(model: Path) -> None:
    engine = _engine(model, routed_experts=True)
    try:
        _check_routes(engine, model)
    finally:
        engine.close()  # type: ignore[attr-defined]


def _check_routes(engine: object, model: Path) -> None:
    for text in ("Route me.", "Which experts?"):
        ids = _chat(model, text)
        request = GenerateRequest(
            input_ids=ids,
            sampling=SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=0.0),
            return_routed_experts=True,
        )
        result = engine.generate(request, timeout=300)  # type: ignore[attr-defined]
        sequence = ids + result.output_ids
        # Weir's micro-batch column: SGLang's rows [0, tokens - 1), then a row of -1 for the last token
        routes = token_routes(result.routed_experts, len(sequence)).reshape(len(sequence), LAYERS, TOP_K)
        assert (routes[-1] == -1).all() and (routes[:-1] >= 0).all() and (routes[:-1] < EXPERTS).all()
        chosen, logits = _router_choices(model, sequence)
        ours, theirs = np.sort(routes[:-1], axis=-1), np.sort(chosen[:-1], axis=-1)
        for token, layer in zip(*np.nonzero((ours != theirs).any(axis=-1)), strict=True):
            # a choice may differ only where two experts' logits tie to float precision
            row = logits[token, layer]
            differing = set(ours[token, layer]) ^ set(theirs[token, layer])
            spread = max(row[e] for e in differing) - min(row[e] for e in differing)
            assert spread < 1e-5, (
                f"{text!r}, token {token}, layer {layer}: {ours[token, layer]} vs {theirs[token, layer]}"
            )
    without = engine.generate(GenerateRequest(input_ids=ids, sampling=request.sampling), timeout=300)  # type: ignore[attr-defined]
    assert without.routed_experts is None  # only when asked


def test_experts_sent_as_the_files_hold_them_load_and_a_refused_bucket_is_drained(model: Path) -> None:
    """Weights by broadcast in the files' layout (``checkpoint_layout``, as Weir's trainers send): Qwen3-MoE's
    experts one by one, loaded by SGLang's own loader — the engine then gives transformers' greedy tokens with the
    same change. A bucket holding one tensor the files do not have (beside every expert's new weights: SGLang's
    loader would skip the unknown name and load the rest) is refused by name and its broadcast drained — SGLang
    receives it and loads it into no model: the tokens are the unchanged model's, the version kept, the group
    usable."""
    import torch.distributed as dist
    from transformers import Qwen3MoeForCausalLM

    from engines.errors import WeightsError
    from engines.weights_group import join_weights_group
    from tests.ports import free_port

    engine: Any = _engine(model, routed_experts=False)
    pool = ThreadPoolExecutor(1)
    port = free_port()
    try:
        joined = pool.submit(
            engine.init_weights_update_group,
            **{"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2},
            group_name="files",
            backend="gloo",
            checkpoint_layout=True,
        )
        group = join_weights_group("127.0.0.1", port, 0, 2, "files", "gloo")
        joined.result(timeout=300)

        def send(named: list[tuple[str, torch.Tensor]], version: str) -> str:
            names, shapes = [n for n, _ in named], [list(t.shape) for _, t in named]
            answer = pool.submit(
                engine.update_weights_from_distributed,
                names,
                ["float32"] * len(named),
                shapes,
                group_name="files",
                version=version,
            )
            for _, tensor in named:
                dist.broadcast(tensor, group=group, group_src=0)
            return str(answer.result(timeout=300))

        hf = Qwen3MoeForCausalLM.from_pretrained(model).eval()

        def same_greedy_tokens(version: str) -> None:
            for text in ("Route me.", "Which experts?"):
                ids = _chat(model, text)
                request = GenerateRequest(
                    input_ids=ids, sampling=SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=0.0)
                )
                ours = engine.generate(request, timeout=300)
                with torch.no_grad():
                    theirs = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, min_new_tokens=8)
                assert ours.output_ids == theirs[0, len(ids) :].tolist() and ours.weight_version == version, text

        fused = hf.model.layers[0].mlp.experts.gate_up_proj  # (experts, gate's rows then up's, hidden)
        generator = torch.Generator().manual_seed(3)
        half = fused.shape[1] // 2
        name = "model.layers.0.mlp.experts.{}.up_proj.weight"
        ups = [(name.format(e), torch.randn(half, fused.shape[2], generator=generator)) for e in range(EXPERTS)]
        with pytest.raises(WeightsError, match="not tensors of the model's files") as refused:
            send([*((n, 5 * t) for n, t in ups), ("model.layers.0.mlp.experts.gate_up_proj", fused.detach())], "1")
        assert refused.value.code == "weights_mismatch" and engine.weight_version == "0"
        same_greedy_tokens("0")  # nothing of the refused bucket loaded

        assert send(ups, "2") == "2"
        with torch.no_grad():
            for e, (_, up) in enumerate(ups):
                fused[e, half:] = up
        same_greedy_tokens("2")
        engine.destroy_weights_update_group("files")
        dist.destroy_process_group(group)
    finally:
        pool.shutdown(wait=False)
        engine.close()
