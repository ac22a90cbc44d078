"""`TransformersEngine`: the engine protocol on plain transformers (CPU, or a GPU without SGLang).

The engine loads the model and checks a request when it is submitted (`ModelLimits`: vocabulary and
context; placeholders against the media's tokens; a grammar that does not compile is `InvalidSampling`), so
a bad prompt is `InvalidEnginePrompt` / `InvalidMedia` from `submit`, before any stream starts. Its requests run
on an `engines.scheduler.Scheduler` (one thread: the queue, admission up to ``max_running``, the pause modes,
aborts and their messages) driven by a `TransformersStepper` (one request's prefill or decode, its sampling
and its stop: `engines.transformers_stepper`), so concurrent requests interleave token by token and an
abort lands within one step — no lock is held for a whole generation.

A prompt sent again — a group's samples — starts from the state its first prefill left, as SGLang's radix cache
shares it (`engines.prefill_cache`: whole prompts, content-keyed, bounded by bytes); a weight update drops them,
and so does `flush_cache`, which answers as SGLang does, False while a request holds KV (running, or frozen in
place).

Weights change from a folder (`update_weights`) or by broadcast from a trainer (SGLang's distributed
update: `init_weights_update_group` joins a process group of its own — gloo on CPU, NCCL on CUDA — and
`update_weights_from_distributed` receives each named tensor from rank 0); both are checked against the
model's parameters by `engines.weights` and loaded all at once between two decode steps.

Constrained decoding (``json_schema`` / ``regex`` / ``ebnf``) is `engines.grammar` over xgrammar, as
SGLang's default backend: the grammar is compiled at submit, each sample walks its own matcher, and the
grammar's end ends the request.
"""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import Future
from pathlib import Path
from typing import Unpack

import torch
from transformers import AutoTokenizer

from encoders.architectures import family_of_model, load_thinker, towers_of
from encoders.positions import OmniRope
from encoders.routing import RoutingCapture, is_moe
from encoders.towers import Towers

from .checkpoint_layout import CheckpointLayout
from .errors import InvalidMedia
from .grammar import Grammars
from .limits import ModelLimits
from .prefill_cache import DEFAULT_PREFILL_CACHE_BYTES
from .protocol import ABORT_BEFORE_PREFILL as ABORT_BEFORE_PREFILL  # the messages, as every backend's
from .protocol import ABORT_BY_REQUEST as ABORT_BY_REQUEST
from .protocol import ABORT_PAUSED as ABORT_PAUSED
from .protocol import FinishReason, GenerateRequest, GenerateResult, SamplingParams, TokenCallback, WeightsGroupArgs
from .scheduler import Req, ScheduledEngine, Scheduler, new_future
from .transformers_stepper import TransformersState, TransformersStepper
from .weights import WeightGroups, read_folder
from .weights_group import WEIGHTS_GROUP_TIMEOUT_S

__all__ = ["TransformersEngine"]


class TransformersEngine(ScheduledEngine):
    """A model folder served through the engine protocol: a Qwen2.5-Omni thinker, a Qwen3-VL model or a
    Qwen3-Omni-MoE thinker, loaded in the class its config names (`encoders.architectures.load_thinker`).

    DeepStack (Qwen3-VL, Qwen3-Omni): an item's visual embedding (from the encoder stage's cache, or the
    model's own tower here) carries the merged output and the DeepStack maps side by side; the merged
    output is spliced into the input embeddings and the maps are added after the first decoder layers
    at the visual positions, as the whole model's forward does.

    Omni models (Qwen2.5-Omni, Qwen3-Omni): the 3-D positions are computed per media item
    (`encoders.positions`), so a video laid out with its own audio track (``use_audio_in_video``; its track
    is the audio item right after it in ``media``) gets the model's interleaved positions, next to videos
    without one.

    Mixture-of-experts models: with ``return_routed_experts`` a request's result carries the experts each
    token was routed to, as SGLang returns them (`encoders.routing`: base64 int32
    ``[seqlen - 1, num_hidden_layers, top_k]``; the prompt's rows from its prefill, one row per decode
    step; a retracted request's prefill starts them again)."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        device: str = "cpu",
        max_running: int = 8,
        weight_version: str = "0",
        weights_group_timeout_s: float = WEIGHTS_GROUP_TIMEOUT_S,
        dtype: torch.dtype = torch.float32,
        prefill_cache_bytes: int = DEFAULT_PREFILL_CACHE_BYTES,
    ) -> None:
        """``dtype``: the weights' and activations' dtype (float32 by default; bfloat16 serves as a GPU
        engine does, e.g. to measure the rollout/training mismatch R3 removes). ``prefill_cache_bytes``: the
        prompts kept prefilled for the next request with the same prompt (`engines.prefill_cache`; 0: none)."""
        self.model_dir = Path(model_dir)
        self.weights_group_timeout_s = weights_group_timeout_s
        self.device = torch.device(device)
        model = load_thinker(self.model_dir, dtype=dtype)
        self.model = model.to(self.device).eval()  # type: ignore[arg-type]
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        config = self.model.config
        self.family = family_of_model(self.model)
        self.deepstack = self.family.deepstack
        self.omni = OmniRope.of(config)  # an Omni model's positions, per media item
        self.placeholders = (
            {"image": config.image_token_id, "video": config.video_token_id} if self.family.media else {}
        )
        if self.family.audio:
            self.placeholders["audio"] = config.audio_token_id
        self.hidden_size = int(config.get_text_config().hidden_size)
        # DeepStack: a visual embedding is the merged output and one DeepStack map per entry.
        self.visual_width = self.hidden_size * (
            1 + len(config.vision_config.deepstack_visual_indexes) if self.deepstack else 1
        )
        self.routing = RoutingCapture(self.model) if is_moe(self.model) else None
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.max_context = int(config.get_text_config().max_position_embeddings)
        vocab_size = int(self.model.get_input_embeddings().num_embeddings)
        self.limits = ModelLimits(vocab_size=vocab_size, max_context=self.max_context)
        # Media structure tokens are never generated: a placeholder or a media bos/eos in a response is
        # read as a media slot when the trainer recomputes the sequence (the model's 3-D positions
        # count them). They keep their probability mass in the reported log-probs.
        structural = set(self.placeholders.values()) | {
            getattr(config, name)
            for name in ("vision_start_token_id", "vision_end_token_id", "audio_start_token_id", "audio_end_token_id")
            if isinstance(getattr(config, name, None), int)
        }
        self.banned_ids = torch.tensor(sorted(structural), dtype=torch.long, device=self.device)
        # A grammar ends on the model's EOS ids; its width is the logits', which may exceed the tokenizer's.
        self.grammars = Grammars(self.tokenizer, vocab_size=vocab_size, stop_token_ids=self.eos_ids)
        self.weight_version = weight_version
        visual, audio = towers_of(self.model)
        self.towers = Towers.from_modules(visual, audio, weight_version) if visual is not None else None
        self.model_lock = threading.Lock()  # held per forward step, never across a generation
        self._groups = WeightGroups(self.device, timeout_s=weights_group_timeout_s)
        self._layout: CheckpointLayout | None = None  # the checkpoint's tensors, once a broadcast names them
        self._layout_lock = threading.Lock()
        self.started = time.monotonic()
        self._stepper = TransformersStepper(self, prefill_cache_bytes=prefill_cache_bytes)
        self._scheduler = Scheduler(self._stepper, max_running=max_running, name="transformers")
        self._scheduler.start()

    # -- the protocol --------------------------------------------------------------------------
    def submit(self, request: GenerateRequest, on_token: TokenCallback | None = None) -> Future[GenerateResult]:
        """Check and queue a request; ``on_token(token_id, logprob)`` is called from the engine thread per token
        (a `StepCallback`'s ``step`` with the token's `TokenStep`)."""
        request = self._accepted(request)
        self._check_media(request)
        grammar = self.grammars.constraint(request.sampling)
        seed = request.sampling.sampling_seed
        generator = torch.Generator().manual_seed(seed if seed is not None else int(uuid.uuid4().int % 2**63))
        state = TransformersState(generator=generator, grammar=grammar)
        req = Req(request=request, future=new_future(), state=state, on_token=on_token)
        self._scheduler.submit(req)
        return req.future

    @property
    def busy_s(self) -> float:
        """Wall time spent in forward steps: the engine-idle share is 1 - busy / uptime."""
        return self._stepper.busy_s

    @property
    def _by_rid(self) -> dict[str, Req[TransformersState]]:
        """The requests not finished, by rid (a test watches one's tokens)."""
        return self._scheduler.by_rid

    def update_weights(self, path: str, version: str | None = None) -> str:
        """Load every ``*.safetensors`` of ``path`` into the model between two decode steps.

        All or nothing: names and shapes are checked against the model before any tensor is copied."""
        return self._load(read_folder(self.model, path), version)

    def _load(self, state: dict[str, torch.Tensor], version: str | None) -> str:
        with self.model_lock:
            self.model.load_state_dict(state, strict=False)
            # As SGLang: without a version the weights change and the version stays (a timestamp here
            # would read as a huge policy version). The towers' version still changes, so nothing
            # cached against the old towers is reused.
            self.weight_version = version or self.weight_version
            self._stepper.prefilled.clear()  # prefilled by the old weights
            if self.towers is not None:
                self.towers.version = version or f"{self.weight_version}@{time.strftime('%Y%m%d%H%M%S')}"
        return self.weight_version

    def init_weights_update_group(self, *, checkpoint_layout: bool = False, **group: Unpack[WeightsGroupArgs]) -> None:
        """Join ``group_name`` as rank ``rank_offset`` (one rank: no tensor parallelism here). ``gloo`` on a
        CPU engine, ``nccl`` on a CUDA one — NCCL cannot move CPU tensors, so it is refused on CPU.
        ``checkpoint_layout`` changes nothing here: each update takes either layout, tensor by tensor
        (`update_weights_from_distributed`)."""
        self._groups.join(**group)

    def update_weights_from_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], *, group_name: str, version: str | None
    ) -> str:
        """Receive every tensor (in order, as rank 0 broadcasts them), then load them all or none
        (`engines.weights.WeightGroups.receive`). Names the module lacks are read as the checkpoint names them,
        as SGLang reads them (`engines.checkpoint_layout`); of a converted tensor some pieces only may be sent: the
        others stay as the module holds them, as SGLang's loaders leave them."""
        own = self.model.state_dict()
        layout = self._checkpoint_layout() if any(name not in own for name in names) else None
        received = self._groups.receive(own, names, dtypes, shapes, group_name=group_name, layout=layout)
        return self._load(received, version)

    def _checkpoint_layout(self) -> CheckpointLayout:
        with self._layout_lock:  # built once, on the first update that names a checkpoint's tensors
            if self._layout is None:
                self._layout = CheckpointLayout(self.model)
            return self._layout

    def flush_cache(self) -> bool:
        """Drop the prefilled prompts (`engines.prefill_cache`); False, nothing dropped, while a request holds KV."""
        if not super().flush_cache():
            return False
        with self.model_lock:
            self._stepper.prefilled.clear()
        return True

    def destroy_weights_update_group(self, group_name: str) -> None:
        self._groups.leave(group_name)

    def close(self) -> None:
        super().close()
        self._groups.close()

    def text_of(self, ids: list[int], params: SamplingParams, reason: FinishReason | None = None) -> str:
        """The returned text, as SGLang's detokenizer makes it (`TransformersStepper.text_of`)."""
        return self._stepper.text_of(ids, params, reason)

    # -- checks at submission ------------------------------------------------------------------
    def _check_media(self, request: GenerateRequest) -> None:
        if any(m.embedding is None and m.features is None for m in request.media):
            raise InvalidMedia("a media item has neither features nor an embedding")
        if self.family.video_seconds and any(m.kind == "video" and m.second_per_grid_t is None for m in request.media):
            # Qwen2.5-VL's video positions advance with the seconds each grid spans: none given is no video of it
            raise InvalidMedia(f"{self.family.name}: a video without its seconds per temporal patch")
        for m in request.media:
            if m.kind not in self.placeholders:
                raise InvalidMedia(f"this model takes no {m.kind} (it takes {', '.join(self.placeholders)})")
            width = self.visual_width if m.kind != "audio" else self.hidden_size
            if m.embedding is not None and (m.embedding.ndim != 2 or int(m.embedding.shape[1]) != width):
                raise InvalidMedia(
                    f"{m.kind}: an embedding of shape {list(m.embedding.shape)}; this model takes (tokens, {width})"
                )
        for kind, placeholder in self.placeholders.items():
            count = sum(1 for t in request.input_ids if t == placeholder)
            supplied = sum(m.num_tokens for m in request.media if m.kind == kind)
            if count != supplied:
                raise InvalidMedia(f"{kind}: the prompt has {count} placeholder tokens but the media give {supplied}")
