"""Media through the families `init_model` added besides Qwen3-VL: Qwen2.5-VL (plain video placeholders, mRoPE
advanced by the video's seconds per grid), Qwen3-VL-MoE (three DeepStack maps) and Qwen3.5 (Qwen3-VL's tower
without DeepStack, hybrid text model). An image + video prompt's log-probs from the engine (its own towers, or
the encoder stage's embeddings) and from the reference trainer equal the whole model's forward; each folder's
processor files read back as the family's spec and as the family's own transformers processor; `weir prep
--spec` takes every media family; a processor config that disagrees with the model is refused by name."""

from __future__ import annotations

import dataclasses
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor, AutoTokenizer

import preprocess as pp
from encoders.architectures import FAMILIES, family_of, load_thinker
from encoders.embedded_model import QWEN3_VL_MEDIA_TOKENS, init_model
from encoders.errors import TowerWeightsError
from encoders.towers import Towers, check_processor
from engines.protocol import GenerateRequest, MediaInput, SamplingParams
from engines.transformers_backend import TransformersEngine
from launcher.arguments import SPEC_NAMES, processor_spec
from launcher.arguments import TEXT_FAMILIES as TEXT_NAMES
from launcher.cli import main
from launcher.commands import _spec
from launcher.model import family_name
from preprocess import samples
from preprocess.placeholders import expand_placeholders, timestamped_video_ids
from preprocess.spec import SPEC_FAMILIES, TEXT_FAMILIES
from trainer.reference import ReferenceTrainer

NEW_TOKENS = 5
# arch → (its family's spec, DeepStack maps its encoder stage appends to each visual embedding)
ARCHS = {
    "qwen2.5-vl": (pp.ProcessorSpec.qwen2_5_vl(), 0),
    "qwen3-vl-moe": (pp.ProcessorSpec.qwen3_vl(), 3),
    "qwen3.5": (pp.ProcessorSpec.qwen3_vl(), 0),
}


@dataclass
class Case:
    arch: str
    folder: Path
    spec: pp.ProcessorSpec
    deepstack: int
    ids: list[int]
    features: tuple[pp.ImageFeatures, pp.VideoFeatures]
    engine: TransformersEngine
    plain: torch.nn.Module  # the whole model, in its own class

    def whole_model_logprobs(self, output: list[int]) -> torch.Tensor:
        """One forward of the whole model over prompt + output, fed what the family's processor returns."""
        image, video = self.features
        config = self.plain.config
        full = torch.tensor([self.ids + output])
        types = torch.zeros_like(full, dtype=torch.int)
        types[full == config.image_token_id] = 1
        types[full == config.video_token_id] = 2
        extra = {}
        if self.arch == "qwen2.5-vl":  # its processor returns the video's seconds per temporal grid step
            extra["second_per_grid_ts"] = torch.tensor([video.second_per_grid_t])
        with torch.no_grad():
            logits = self.plain(
                input_ids=full,
                attention_mask=torch.ones_like(full),
                pixel_values=torch.from_numpy(image.pixel_values),
                image_grid_thw=torch.tensor([image.grid_thw]),
                pixel_values_videos=torch.from_numpy(video.pixel_values),
                video_grid_thw=torch.tensor([video.grid_thw]),
                mm_token_type_ids=types,
                **extra,
            ).logits[0]
        positions = torch.arange(len(self.ids) - 1, len(self.ids) + len(output) - 1)
        rows = torch.log_softmax(logits[positions].float(), dim=-1)
        return rows[torch.arange(len(output)), torch.tensor(output)]


def _prompt(folder: Path, spec: pp.ProcessorSpec) -> tuple[list[int], tuple[pp.ImageFeatures, pp.VideoFeatures]]:
    """An image + video prompt: the video expanded as the family's processor does (Qwen3-VL's timestamped
    blocks, or Qwen2.5-VL's one run of pads)."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    image = pp.process_image(samples.encode_image(samples.test_pattern(96, 80), "PNG"), spec)
    video = pp.process_video(samples.make_video(64, 64, 10, 8), spec)
    assert isinstance(image, pp.ImageFeatures) and isinstance(video, pp.VideoFeatures)
    content = [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "What colour is the star?"}]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    token = {k: tokenizer.convert_tokens_to_ids(v) for k, v in QWEN3_VL_MEDIA_TOKENS.items()}
    video_ids: int | list[int] = video.num_tokens
    if spec.video_timestamps:
        video_ids = timestamped_video_ids(
            lambda s: tokenizer.encode(s, add_special_tokens=False),
            frame_indices=video.frame_indices,
            video_fps=video.video_fps,
            grid_thw=video.grid_thw,
            merge_size=spec.merge_size,
            temporal_patch_size=spec.temporal_patch_size,
            video_id=token["video_token"],
            vision_start_id=token["vision_start_token"],
            vision_end_id=token["vision_end_token"],
        )
    ids = expand_placeholders(
        tokenizer.encode(text, add_special_tokens=False),
        {"image": token["image_token"], "video": token["video_token"]},
        [("image", image.num_tokens), ("video", video_ids)],
    )
    return ids, (image, video)


@pytest.fixture(scope="module", params=list(ARCHS))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Case]:
    arch: str = request.param
    spec, deepstack = ARCHS[arch]
    folder = init_model(tmp_path_factory.mktemp(arch), arch=arch)
    ids, features = _prompt(folder, spec)
    engine = TransformersEngine(folder)
    try:
        yield Case(arch, folder, spec, deepstack, ids, features, engine, load_thinker(folder).eval())
    finally:
        engine.close()


def _generate(case: Case, media: tuple[MediaInput, ...]) -> tuple[list[int], torch.Tensor]:
    sampling = SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS, ignore_eos=True, sampling_seed=7)
    result = case.engine.generate(GenerateRequest(input_ids=case.ids, media=media, sampling=sampling))
    assert len(result.output_ids) == NEW_TOKENS
    return list(result.output_ids), torch.tensor(result.output_logprobs)


def test_the_folder_reads_back_as_the_familys_spec(case: Case) -> None:
    assert family_of(case.folder).name == family_name(case.arch)
    assert pp.ProcessorSpec.from_pretrained(case.folder) == case.spec
    assert type(case.plain) is family_of(case.folder).model_class


def test_engine_fed_features_equals_the_whole_model(case: Case) -> None:
    output, logprobs = _generate(case, tuple(MediaInput.of(f) for f in case.features))
    torch.testing.assert_close(logprobs, case.whole_model_logprobs(output), atol=1e-4, rtol=0)
    if family_of(case.folder).video_seconds:
        # Qwen2.5-VL's mRoPE reads the video's seconds: other seconds, other log-probs (so the equality above
        # checks that the engine passes them on).
        image, video = case.features
        slower = MediaInput(kind="video", features=video, grid_thw=video.grid_thw, second_per_grid_t=4.0)
        assert video.second_per_grid_t != 4.0
        _, moved = _generate(case, (MediaInput.of(image), slower))
        assert (moved - logprobs).abs().max() > 1e-3


def test_engine_fed_the_encoder_stages_embeddings_equals_the_whole_model(case: Case) -> None:
    towers = Towers(case.folder)
    assert towers.audio is None
    embeddings = towers.encode(list(case.features))
    width = case.engine.hidden_size * (1 + case.deepstack)  # merged output + each DeepStack map
    assert [tuple(e.shape) for e in embeddings] == [(f.num_tokens, width) for f in case.features]
    media = tuple(
        MediaInput(
            kind=f.kind,
            embedding=e,
            grid_thw=f.grid_thw,
            second_per_grid_t=f.second_per_grid_t if isinstance(f, pp.VideoFeatures) else None,
        )
        for f, e in zip(case.features, embeddings, strict=True)
    )
    output, logprobs = _generate(case, media)
    torch.testing.assert_close(logprobs, case.whole_model_logprobs(output), atol=1e-4, rtol=0)


def test_reference_trainer_equals_the_whole_model(case: Case) -> None:
    output, engine_logprobs = _generate(case, tuple(MediaInput.of(f) for f in case.features))
    trainer = ReferenceTrainer(case.folder)
    assert type(trainer.model) is type(case.plain)
    with torch.no_grad():
        logprobs = trainer.sequence_logprobs(torch.tensor(case.ids + output), [], list(case.features))
    torch.testing.assert_close(logprobs[len(case.ids) :], case.whole_model_logprobs(output), atol=1e-4, rtol=0)
    torch.testing.assert_close(logprobs[len(case.ids) :], engine_logprobs, atol=1e-4, rtol=0)


def _images() -> list[bytes]:
    """A few images of other sizes and aspect ratios (each resized differently)."""
    rng = np.random.default_rng(0)
    noisy = rng.integers(0, 256, (123, 77, 3), dtype=np.uint8)
    return [
        samples.encode_image(samples.test_pattern(96, 80), "PNG"),
        samples.encode_image(samples.test_pattern(300, 41, checker=False), "JPEG", quality=90),
        samples.encode_image(noisy, "PNG"),
    ]


@pytest.mark.parametrize(
    ("arch", "processor", "video_processor"),
    [
        ("qwen2.5-vl", "Qwen2_5_VLProcessor", "Qwen2VLVideoProcessor"),
        ("qwen3.5", "Qwen3VLProcessor", "Qwen3VLVideoProcessor"),
    ],
)
def test_the_familys_own_processor_gives_weirs_features(
    tmp_path: Path, arch: str, processor: str, video_processor: str
) -> None:
    """transformers resolves the folder to its family's processor classes; its image features equal Weir's
    (Weir's Qwen2-VL image / Qwen3-VL video preprocessing is compared at length in tests/preprocess)."""
    folder = init_model(tmp_path / arch, arch=arch)
    hf = AutoProcessor.from_pretrained(folder)
    assert type(hf).__name__ == processor
    assert type(hf.image_processor).__name__ == "Qwen2VLImageProcessor"
    assert type(hf.video_processor).__name__ == video_processor
    # transformers 5's Qwen2VLImageProcessor is the torchvision one (the PIL one is Qwen2VLImageProcessorPil):
    # Weir's torchvision backend is its bit-exact twin
    spec = dataclasses.replace(pp.ProcessorSpec.from_pretrained(folder), image_backend="torchvision")
    for data in _images():
        ours = pp.process_image(data, spec)
        assert isinstance(ours, pp.ImageFeatures)
        theirs = hf.image_processor(images=[Image.open(io.BytesIO(data)).convert("RGB")])
        assert tuple(theirs["image_grid_thw"][0].tolist()) == ours.grid_thw
        np.testing.assert_array_equal(np.asarray(theirs["pixel_values"]), ours.pixel_values)


def test_prep_spec_takes_every_media_family(tmp_path: Path) -> None:
    # every family: the media ones by name (the launcher spells them without importing preprocess), the text ones
    # refused
    assert SPEC_NAMES == SPEC_FAMILIES and TEXT_NAMES == TEXT_FAMILIES
    assert set(SPEC_FAMILIES) | set(TEXT_FAMILIES) == set(FAMILIES)
    assert not set(SPEC_FAMILIES) & set(TEXT_FAMILIES)
    for name in SPEC_NAMES:
        assert processor_spec(name) == name
        assert _spec(name) == pp.ProcessorSpec.named(name)  # what `weir prep --spec NAME` prepares with
    folder = init_model(tmp_path / "vl", arch="qwen2.5-vl")
    assert processor_spec(str(folder)) == str(folder)


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])
def test_prep_spec_refuses_a_text_family(name: str, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "rows.jsonl").write_text("")  # the dataset is there: the spec alone is refused
    with pytest.raises(SystemExit) as refused:
        main(["prep", str(tmp_path / "rows.jsonl"), "--out", str(tmp_path / "out"), "--spec", name])
    assert refused.value.code == 2
    assert "a text model has no media to prepare" in capsys.readouterr().err


def test_prep_spec_refuses_an_unknown_name_with_the_list(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "rows.jsonl").write_text("")
    with pytest.raises(SystemExit) as refused:
        main(["prep", str(tmp_path / "rows.jsonl"), "--out", str(tmp_path / "out"), "--spec", "llava"])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert all(name in err for name in SPEC_NAMES)


@pytest.mark.parametrize(
    ("arch", "key", "model_field"),
    [
        ("qwen3.5", "patch_size", "patch_size"),
        ("qwen2.5-vl", "merge_size", "spatial_merge_size"),
        ("qwen3-vl-moe", "temporal_patch_size", "temporal_patch_size"),
    ],
)
def test_a_processor_that_disagrees_with_the_model_is_refused(
    tmp_path: Path, arch: str, key: str, model_field: str
) -> None:
    folder = init_model(tmp_path / arch, arch=arch)
    path = folder / "preprocessor_config.json"
    config = json.loads(path.read_text())
    config[key] = config[key] + 2
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"{key}.*{config[key]}.*{model_field}.*{config[key] - 2}") as refused:
        check_processor(folder)
    assert not isinstance(refused.value, TowerWeightsError)  # the processor is wrong, not the weights
    with pytest.raises(ValueError, match=key):  # the encoder stage refuses to start on it
        Towers(folder)
