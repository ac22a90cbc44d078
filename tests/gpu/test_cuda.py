"""The CPU-tested paths on a CUDA GPU: the transformers engine, the towers and the data-parallel trainer
(FSDP2 over NCCL) give what they give on the CPU. Run by `tests/gpu/run.sh` (`make gpu-check`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import preprocess as pp
from encoders.embedded_model import init_model
from engines.protocol import GenerateRequest, MediaInput, SamplingParams
from engines.transformers_backend import TransformersEngine
from preprocess import samples
from tests.trainer.conftest import free_port
from tests.trainer.test_data_parallel import batches_for, sgd
from trainer.losses import LossConfig
from trainer.reference import ReferenceTrainer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("gpu-model"))


@pytest.mark.parametrize("arch", ["qwen2.5-omni", "qwen3-vl"])
def test_the_engine_generates_on_cuda_as_on_cpu(arch: str, tmp_path: Path) -> None:
    model = init_model(tmp_path / arch, arch=arch)
    spec = pp.ProcessorSpec.from_pretrained(model)
    image = pp.process_image(samples.encode_image(samples.test_pattern(64, 64), "PNG"), spec)
    cpu, cuda = TransformersEngine(model), TransformersEngine(model, device="cuda")
    try:
        placeholder = cpu.placeholders["image"]
        ids = [1, 2, *([placeholder] * image.num_tokens), 3]
        request = GenerateRequest(
            input_ids=ids,
            media=(MediaInput.of(image),),
            sampling=SamplingParams(max_new_tokens=8, temperature=0.0),
        )
        on_cpu, on_cuda = cpu.generate(request), cuda.generate(request)
        assert on_cuda.output_ids == on_cpu.output_ids
        torch.testing.assert_close(
            torch.tensor(on_cuda.output_logprobs), torch.tensor(on_cpu.output_logprobs), atol=1e-3, rtol=1e-3
        )
    finally:
        cpu.close()
        cuda.close()


def test_a_data_parallel_step_over_nccl_equals_the_cpu_step(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """FSDP2 on one CUDA rank (NCCL) steps as the CPU reference trainer on the same micro-batches."""
    from trainer.data_parallel import DataParallel

    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    parallel = DataParallel.from_env()
    try:
        loss = LossConfig(rollout_correction="none")
        gpu = ReferenceTrainer(model, max_grad_norm=1e9, loss=loss, parallel=parallel)
        cpu = ReferenceTrainer(model, max_grad_norm=1e9, loss=loss)
        gpu.optimizer, cpu.optimizer = sgd(gpu), sgd(cpu)
        for batch in batches_for(str(model), 0, 1):
            gpu.accumulate(batch)
            cpu.accumulate(batch)
        on_gpu, on_cpu = gpu.apply(), cpu.apply()
        assert on_gpu.loss == pytest.approx(on_cpu.loss, rel=1e-3, abs=1e-5)
        whole = gpu.full_state_dict()
        for name, value in cpu.model.state_dict().items():
            torch.testing.assert_close(whole[name], value, atol=1e-4, rtol=1e-3, msg=name)
    finally:
        parallel.close()
