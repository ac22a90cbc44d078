"""Which model a folder holds, read from its ``config.json``; one place that knows each family's classes.

Weir serves and trains these families (`FAMILIES`), each recognised by its config's ``architectures``, then
``model_type``:

* ``qwen2_5_omni`` — `Qwen2_5OmniThinkerForConditionalGeneration` (a thinker folder, or a full Omni folder
  whose ``thinker_config`` is read): vision and audio towers, media spliced into the input embeddings.
* ``qwen2_5_vl`` — `Qwen2_5_VLForConditionalGeneration`: a vision tower (windowed attention), mRoPE whose
  video positions advance with each grid's seconds (``second_per_grid_ts``).
* ``qwen3_vl`` / ``qwen3_vl_moe`` — `Qwen3VLForConditionalGeneration` / `Qwen3VLMoeForConditionalGeneration`:
  a vision tower only, and DeepStack: besides its merged output (spliced into the input embeddings) the
  tower gives one more feature map per ``deepstack_visual_indexes`` entry, each *added* to the hidden
  states of the visual positions after decoder layer 0, 1, … ; the MoE one's text model is sparse.
* ``qwen3_omni_moe`` — `Qwen3OmniMoeThinkerForConditionalGeneration` (a thinker folder, or a full
  Qwen3-Omni folder): vision tower with DeepStack (as Qwen3-VL), audio tower, and a sparse
  mixture-of-experts language model (its routers are what `encoders.routing` captures and replays).
* ``qwen3_5`` — `Qwen3_5ForConditionalGeneration`: Qwen3-VL's vision tower without DeepStack, and a hybrid
  text model (gated delta-net linear attention in three layers of four, full attention in the fourth).
* ``qwen3`` / ``qwen3_moe`` — `Qwen3ForCausalLM` / `Qwen3MoeForCausalLM`: text only, no towers, 1-D rotary
  positions; the media roles and the encoder stage are never called for them.

Where a family keeps its parts (`Family.layout`): an Omni thinker has its towers and text model at the top
(``visual``, ``audio_tower``, ``model``); a vision-language model nests them (``model.visual``,
``model.language_model``); a text model is ``model`` alone.

An encoder stage's embedding of a DeepStack (Qwen3-VL, Qwen3-Omni) visual item is therefore the merged output
and the DeepStack maps side by side, ``(tokens, hidden · (1 + deepstack))`` (`pack_visual`), so one cached tensor
per item still carries everything the language model takes from the tower; `split_visual` takes it apart again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import (
    AutoConfig,
    PreTrainedModel,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5OmniThinkerForConditionalGeneration,
    Qwen3_5ForConditionalGeneration,
    Qwen3ForCausalLM,
    Qwen3MoeForCausalLM,
    Qwen3OmniMoeThinkerForConditionalGeneration,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMoeForConditionalGeneration,
)
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    _get_feat_extract_output_lengths as _qwen3_omni_audio_lengths,
)

__all__ = [
    "FAMILIES",
    "FUSED_EXPERTS",
    "Family",
    "FamilyName",
    "audio_tokens",
    "checkpoint_names",
    "converted_names",
    "decoder_layers",
    "drop_language_model",
    "experts_laid_out_as",
    "family_of",
    "family_of_model",
    "has_deepstack",
    "text_model",
    "load_thinker",
    "mm_token_type_ids",
    "model_inputs",
    "pack_visual",
    "rope_index",
    "split_visual",
    "stored_shapes",
    "supported",
    "thinker_class",
    "thinker_config",
    "towers_of",
    "transposed_experts",
]

FamilyName = Literal[
    "qwen2_5_omni", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_omni_moe", "qwen3_5", "qwen3", "qwen3_moe"
]
FamilyLayout = Literal["omni", "vl", "text"]


@dataclass(frozen=True)
class Family:
    """What Weir needs to know of one model family; everything else is read from the model's own config."""

    name: FamilyName
    model_class: type[PreTrainedModel]
    architectures: tuple[str, ...]  # config.json's "architectures" this family loads (its whole model's too)
    model_types: tuple[str, ...]
    layout: FamilyLayout  # where the towers and the text model are (see the module's docstring)
    deepstack: bool = False  # the vision tower's DeepStack maps are added after the first decoder layers
    audio: bool = False  # an audio tower
    video_seconds: bool = False  # mRoPE takes each video's seconds per grid (Qwen2.5-VL's ``second_per_grid_ts``)
    moe: bool = False  # a sparse mixture-of-experts text model (routing replay, expert parallelism)

    @property
    def media(self) -> bool:
        """Whether the model takes media at all (a text model's media roles are never called)."""
        return self.layout != "text"


FAMILIES: dict[FamilyName, Family] = {
    f.name: f
    for f in (
        Family(
            "qwen2_5_omni",
            Qwen2_5OmniThinkerForConditionalGeneration,
            ("Qwen2_5OmniThinkerForConditionalGeneration", "Qwen2_5OmniForConditionalGeneration"),
            ("qwen2_5_omni_thinker", "qwen2_5_omni"),
            "omni",
            audio=True,
        ),
        Family(
            "qwen2_5_vl",
            Qwen2_5_VLForConditionalGeneration,
            ("Qwen2_5_VLForConditionalGeneration",),
            ("qwen2_5_vl",),
            "vl",
            video_seconds=True,
        ),
        Family(
            "qwen3_vl",
            Qwen3VLForConditionalGeneration,
            ("Qwen3VLForConditionalGeneration",),
            ("qwen3_vl",),
            "vl",
            deepstack=True,
        ),
        Family(
            "qwen3_vl_moe",
            Qwen3VLMoeForConditionalGeneration,
            ("Qwen3VLMoeForConditionalGeneration",),
            ("qwen3_vl_moe",),
            "vl",
            deepstack=True,
            moe=True,
        ),
        Family(
            "qwen3_omni_moe",
            Qwen3OmniMoeThinkerForConditionalGeneration,
            ("Qwen3OmniMoeThinkerForConditionalGeneration", "Qwen3OmniMoeForConditionalGeneration"),
            ("qwen3_omni_moe_thinker", "qwen3_omni_moe"),
            "omni",
            deepstack=True,
            audio=True,
            moe=True,
        ),
        Family("qwen3_5", Qwen3_5ForConditionalGeneration, ("Qwen3_5ForConditionalGeneration",), ("qwen3_5",), "vl"),
        Family("qwen3", Qwen3ForCausalLM, ("Qwen3ForCausalLM",), ("qwen3",), "text"),
        Family("qwen3_moe", Qwen3MoeForCausalLM, ("Qwen3MoeForCausalLM",), ("qwen3_moe",), "text", moe=True),
    )
}
_ARCHITECTURES = {name: family for family in FAMILIES.values() for name in family.architectures}
_MODEL_TYPES = {name: family for family in FAMILIES.values() for name in family.model_types}


def supported() -> list[str]:
    """The ``architectures`` names Weir loads, for a refusal's message."""
    return sorted(_ARCHITECTURES)


def family_of(model_dir: str | Path) -> Family:
    """The family of a model folder, by its config's ``architectures`` then ``model_type``."""
    path = Path(model_dir) / "config.json"
    try:
        config: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"no readable config.json in {model_dir}: {error}") from None
    for name in config.get("architectures") or []:
        if name in _ARCHITECTURES:
            return _ARCHITECTURES[name]
    model_type = config.get("model_type")
    if model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type]
    raise ValueError(
        f"{model_dir}: unsupported model (architectures {config.get('architectures')}, model_type {model_type}); "
        f"Weir loads {', '.join(supported())}"
    )


def family_of_model(model: torch.nn.Module) -> Family:
    """The family of a loaded model, by its class."""
    for family in FAMILIES.values():
        if isinstance(model, family.model_class):
            return family
    raise ValueError(f"{type(model).__name__} is not a model of a family Weir loads ({', '.join(supported())})")


def thinker_config(model_dir: str | Path) -> Any:
    """The thinker's config (a full Qwen2.5-Omni / Qwen3-Omni folder's ``thinker_config``)."""
    config = AutoConfig.from_pretrained(model_dir)
    return getattr(config, "thinker_config", config)


def thinker_class(model_dir: str | Path) -> type[PreTrainedModel]:
    """The class `load_thinker` loads a folder's model in."""
    return family_of(model_dir).model_class


def load_thinker(model_dir: str | Path, *, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """The folder's model, in the class its config names (not a hard-coded one)."""
    model = thinker_class(model_dir).from_pretrained(model_dir, dtype=dtype)
    return model  # type: ignore[no-any-return]


def checkpoint_names(model_dir: str | Path) -> dict[str, str]:
    """Each parameter's name in the folder's model class (a trainer's state dict, its weight broadcast) → its name
    in the checkpoint the folder stores, which is what SGLang's weight loader reads: transformers renames on load
    (Qwen2.5-VL's ``visual.*`` is its module's ``model.visual.*``, ``model.*`` its ``model.language_model.*``) and
    renames back on save; transformers' own reverse renaming, on the meta device (no weights read). A name whose
    tensor transformers converts on load (a MoE model's experts fused one way, stored another) maps to itself:
    `converted_names` lists those."""
    return _reverse_renaming(model_dir)[0]


def converted_names(model_dir: str | Path) -> frozenset[str]:
    """The parameters of the folder's model class that its checkpoint stores as other tensors: converted, not
    renamed (transformers fuses a MoE model's per-expert weights on load), or stored in another shape (Qwen3-VL-MoE's
    fused experts, (experts, in, out) in its checkpoint, (experts, out, in) in transformers' module). A loader of the
    checkpoint's tensors, as SGLang's is, knows no tensor by these names, or not in this shape."""
    return _reverse_renaming(model_dir)[1]


def _meta_model(model_dir: str | Path) -> Any:
    """The folder's model class on the meta device: its parameters' names and shapes, no weights."""
    with torch.device("meta"):
        return thinker_class(model_dir)._from_config(thinker_config(model_dir))


def stored_shapes(model_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape in the folder's safetensors files (their headers: no weights read)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), "pt") as weights:
            for key in weights.keys():  # noqa: SIM118 - a safetensors handle is not a mapping
                shapes[key] = tuple(weights.get_slice(key).get_shape())
    return shapes


def _reverse_renaming(model_dir: str | Path) -> tuple[dict[str, str], frozenset[str]]:
    """(`checkpoint_names`, `converted_names`) from one model on the meta device."""
    from transformers.core_model_loading import revert_weight_conversion

    model = _meta_model(model_dir)
    state = model.state_dict()
    renamed = {id(tensor): name for name, tensor in revert_weight_conversion(model, dict(state)).items()}
    names = {name: renamed.get(id(tensor), name) for name, tensor in state.items()}  # renamed: the same tensor
    stored = stored_shapes(Path(model_dir))
    converted = {
        name
        for name, tensor in state.items()
        if id(tensor) not in renamed or stored.get(names[name], tuple(tensor.shape)) != tuple(tensor.shape)
    }
    return names, frozenset(converted)


def has_deepstack(model: torch.nn.Module) -> bool:
    """Whether the model's visual embeddings carry DeepStack maps (Qwen3-VL, Qwen3-VL-MoE, Qwen3-Omni)."""
    return family_of_model(model).deepstack


def audio_tokens(family: FamilyName, config: Any, num_frames: int) -> int:
    """The tokens the family's audio tower makes of ``num_frames`` mel frames (``config``: the thinker's).

    Qwen2.5-Omni: two stride-2 steps over the whole clip. Qwen3-Omni: its tower cuts the clip into
    windows of ``2 · n_window`` frames, 13 tokens per full window plus the remainder's three stride-2
    convolutions (transformers' ``_get_feat_extract_output_lengths``)."""
    if num_frames <= 0:
        return 0
    if family == "qwen3_omni_moe":
        return int(_qwen3_omni_audio_lengths(torch.tensor(num_frames), config.audio_config.n_window))
    if family == "qwen2_5_omni":
        return max(0, ((num_frames - 1) // 2 + 1 - 2) // 2 + 1)
    raise ValueError(f"{family} has no audio tower")


def text_model(model: torch.nn.Module) -> Any:
    """The language model inside a loaded model (its layers, embeddings and final norm)."""
    inner: Any = getattr(model, "model", model)
    return getattr(inner, "language_model", inner)  # a vision-language model nests its text model; the others not


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The language model's decoder layers (the units data-parallel training shards one by one)."""
    return list(text_model(model).layers)


def drop_language_model(thinker: torch.nn.Module) -> None:
    """Take the language model out of a (meta-device) thinker, for a trainer whose own model is it (megatron's
    GPTModel): its layers, embeddings, final norm and head are then not read; towers, config and buffers stay."""
    text = text_model(thinker)
    text.layers = torch.nn.ModuleList()
    text.embed_tokens = torch.nn.Identity()
    text.norm = torch.nn.Identity()
    thinker.lm_head = torch.nn.Identity()


def towers_of(model: torch.nn.Module) -> tuple[torch.nn.Module | None, torch.nn.Module | None]:
    """A loaded model's own vision tower and audio tower (None: the family has none)."""
    layout = family_of_model(model).layout
    if layout == "text":
        return None, None
    if layout == "vl":
        return model.model.visual, None  # type: ignore[union-attr,return-value]
    return model.visual, model.audio_tower  # type: ignore[return-value]


def pack_visual(pooled: torch.Tensor, deepstack: list[torch.Tensor] | None) -> torch.Tensor:
    """One (tokens, hidden · (1 + deepstack)) tensor: the merged output, then each DeepStack map."""
    return torch.cat([pooled, *deepstack], dim=-1) if deepstack else pooled


def split_visual(packed: torch.Tensor, hidden: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """`pack_visual` taken apart: the merged output and the DeepStack maps."""
    if packed.shape[-1] % hidden:
        raise ValueError(f"a visual embedding of width {packed.shape[-1]} does not split into rows of {hidden}")
    parts = list(torch.split(packed, hidden, dim=-1))
    return parts[0], parts[1:]


def mm_token_type_ids(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """A vision-language model's token types (text 0, image 1, video 2), as its processor returns them."""
    config: Any = model.config
    types = torch.zeros_like(ids, dtype=torch.int)
    types[ids == config.image_token_id] = 1
    types[ids == config.video_token_id] = 2
    return types


def rope_index(
    model: torch.nn.Module,
    ids: torch.Tensor,
    *,
    attention_mask: torch.Tensor,
    image_grid_thw: torch.Tensor | None,
    video_grid_thw: torch.Tensor | None,
    second_per_grid_ts: torch.Tensor | None = None,
    **omni: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's own rotary positions and deltas: 3-D for a media model (``omni``: Qwen2.5-Omni's extra
    arguments; ``second_per_grid_ts``: Qwen2.5-VL's per-video seconds), 1-D and delta 0 for a text model."""
    family = family_of_model(model)
    if family.layout == "text":
        positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        return positions, torch.zeros(ids.shape[0], 1, dtype=torch.long, device=ids.device)
    if family.layout == "vl":
        extra = {"second_per_grid_ts": second_per_grid_ts} if family.video_seconds else {}
        return model.model.get_rope_index(  # type: ignore[union-attr,operator,no-any-return]
            ids,
            mm_token_type_ids=mm_token_type_ids(model, ids),
            image_grid_thw=image_grid_thw,
            video_grid_thw=None if video_grid_thw is None else video_grid_thw.clone(),  # it edits its argument
            attention_mask=attention_mask,
            **extra,
        )
    return model.get_rope_index(  # type: ignore[operator,no-any-return]
        ids, attention_mask=attention_mask, image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw, **omni
    )


def model_inputs(model: torch.nn.Module, ids: torch.Tensor, media: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A forward's media keyword inputs for this model: a vision-language model takes the token types; Qwen3-VL's
    family no per-video seconds (its temporal positions come from the timestamps in the prompt), Qwen2.5-VL
    its ``second_per_grid_ts``; a text model none."""
    family = family_of_model(model)
    if family.layout == "text":
        if media:
            raise ValueError(f"a {family.name} model takes no media ({sorted(media)} given)")
        return {}
    if family.layout != "vl":
        return media
    out = dict(media)
    seconds = out.pop("video_second_per_grid", None)
    if family.video_seconds and seconds is not None:
        out["second_per_grid_ts"] = seconds
    if "image_grid_thw" in out or "video_grid_thw" in out:
        out["mm_token_type_ids"] = mm_token_type_ids(model, ids)
    return out


# Qwen3-VL-MoE's fused expert tensors: (experts, in, out) in its released checkpoints, (experts, out, in) in
# transformers 5's module (and megatron's order); transformers' loader tells the two apart by shape.
FUSED_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def experts_laid_out_as(
    tensors: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]], *, copy: bool = True
) -> dict[str, torch.Tensor]:
    """``tensors`` with each fused expert tensor whose shape is ``shapes[name]`` transposed (1, 2) turned to it; every
    other tensor as it is (a shape that fits neither way is left for the caller to refuse by name). ``copy``: each
    turned tensor made contiguous; else a view (no second copy of a model's experts at once)."""
    out = dict(tensors)
    for name, tensor in tensors.items():
        want = shapes.get(name)
        if want is not None and transposed_experts(name, tuple(tensor.shape), want):
            out[name] = tensor.transpose(1, 2).contiguous() if copy else tensor.transpose(1, 2)
    return out


def transposed_experts(name: str, shape: tuple[int, ...], want: tuple[int, ...]) -> bool:
    """Whether ``name`` is a fused expert tensor of ``shape`` that is ``want``'s (1, 2) transpose and not ``want``
    itself (the released (experts, in, out) layout against the module's (experts, out, in), or the reverse)."""
    return name.endswith(FUSED_EXPERTS) and len(shape) == 3 and shape != want and (shape[0], shape[2], shape[1]) == want
