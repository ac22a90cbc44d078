"""`TransformersEngine`: the engine protocol on plain transformers (CPU, or a GPU without SGLang).

One scheduler thread owns the model. It admits requests, prefills each (media embeddings spliced
in at the placeholder positions; the model's own 3-D rotary positions computed from the grids, as
the model computes them), then advances every running request one token per round, so concurrent
requests interleave token by token and an abort lands within one step — no lock is held for a whole
generation. Each request has its own KV cache; decode steps are not fused into one batched forward
(a CPU reference backend; throughput is SGLang's job on a GPU).

A request is checked when it is submitted (`ModelLimits`: vocabulary and context; placeholders
against the media's tokens), so a bad prompt is `InvalidPrompt` / `InvalidMedia` from `submit`,
before any stream starts. While paused, the scheduler still finishes aborted requests.

Pause modes (SGLang's): ``abort`` finishes running and queued requests as aborted; ``retract`` puts
running requests back at the head of the queue with their tokens, their KV dropped (recomputed over
prompt + tokens so far when they are admitted again, counted in ``num_retractions``); ``in_place``
freezes them with their KV. This backend keeps no prefix cache across requests, so `flush_cache`
drops nothing; it answers as SGLang does, False while a request holds KV (running, or frozen in place).
An abort's finish_reason says its cause in its ``message``: ``paused (abort mode)`` (``Abort before
prefill`` for one the pause caught before it started) for a pause, ``aborted by request`` for a client's
abort — so a rollout can continue only what a pause cut short (`rollout.partial`).

Weights change from a folder (`update_weights`) or by broadcast from a trainer (SGLang's distributed
update: `init_weights_update_group` joins a process group of its own — gloo on CPU, NCCL on CUDA — and
`update_weights_from_distributed` receives each named tensor from rank 0, checks it against the
model's parameters, and loads them all at once between two decode steps, as a folder is loaded).

Constrained decoding (``json_schema`` / ``regex`` / ``ebnf``) is `engines.grammar` over xgrammar, as
SGLang's default backend: the grammar is compiled at submit (one that does not compile is
`InvalidSampling` from `submit`), each sample walks its own matcher, and the grammar's end ends the request.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import Collection
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from transformers import AutoTokenizer, DynamicCache

from encoders.architectures import has_deepstack, is_qwen3_vl, load_thinker, rope_index, towers_of
from encoders.positions import OmniRope
from encoders.routing import RoutingCapture, encode_routed_experts, is_moe
from encoders.towers import Towers
from preprocess.errors import MediaError
from preprocess.omni import OmniItem

from .errors import EngineError, InvalidMedia, WeightsError
from .grammar import Grammar, Grammars
from .limits import ModelLimits
from .protocol import (
    ABORT_BEFORE_PREFILL,
    ABORT_BY_REQUEST,
    ABORT_PAUSED,
    GenerateRequest,
    GenerateResult,
    MediaInput,
    PauseMode,
    SamplingParams,
    StepCallback,
    TokenCallback,
    TokenStep,
    TopLogprobs,
)
from .weights_group import WEIGHTS_GROUP_TIMEOUT_S, join_weights_group

__all__ = ["TransformersEngine", "penalize", "sample_token"]

PAUSE_ACK_TIMEOUT_S = 30.0

logger = logging.getLogger(__name__)


def penalize(
    logits: torch.Tensor,
    params: SamplingParams,
    *,
    prompt_ids: list[int],
    output_ids: list[int],
    stop_ids: Collection[int],
) -> torch.Tensor:
    """1-D logits after SGLang's logit processing, in its order: repetition penalty (HF's: tokens of the
    prompt and the output so far, a positive logit divided by it, a negative one multiplied), frequency
    and presence penalties (OpenAI's, over output tokens), the ``min_new_tokens`` mask over ``stop_ids``,
    then ``logit_bias``. Returns a new tensor (float32)."""
    scores = logits.float().clone()
    vocab = scores.numel()
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted({t for t in (*prompt_ids, *output_ids) if 0 <= t < vocab}), dtype=torch.long)
        if seen.numel():
            values = scores[seen]
            scores[seen] = torch.where(
                values > 0, values / params.repetition_penalty, values * params.repetition_penalty
            )
    if output_ids and (params.frequency_penalty or params.presence_penalty):
        counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long), minlength=vocab)[:vocab].float()
        scores -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
    if len(output_ids) < params.min_new_tokens:
        masked = [t for t in stop_ids if 0 <= t < vocab]
        if masked:
            scores[torch.tensor(masked, dtype=torch.long)] = float("-inf")
    for token, bias in params.logit_bias:
        if token < vocab:
            scores[token] += bias
    return scores


def sample_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> tuple[int, list[int] | None]:
    """One token from 1-D logits under temperature / top-k / top-p / min-p (greedy below 1e-6, as SGLang),
    and — with ``return_top_p_token_ids`` — the ids the filters kept, most likely first (the sampled one
    among them; greedy keeps only it)."""
    if params.temperature < 1e-6 or params.top_k == 1:
        token = int(torch.argmax(logits))
        return token, [token] if params.return_top_p_token_ids else None
    scores = logits.float() / params.temperature
    if params.top_k > 0:
        kth = torch.topk(scores, min(params.top_k, scores.numel())).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        ordered, order = torch.sort(scores, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        drop = probs.cumsum(-1) - probs > params.top_p  # keep the smallest prefix reaching top_p
        scores[order[drop]] = float("-inf")
    if params.min_p > 0:  # relative to the most likely token (its probability is unchanged by the filters above)
        probs = torch.softmax(logits.float() / params.temperature, dim=-1)
        scores = scores.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    token = int(torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=generator))
    if not params.return_top_p_token_ids:
        return token, None
    kept = torch.nonzero(torch.isfinite(scores)).flatten()
    kept = kept[torch.argsort(scores[kept], descending=True, stable=True)]
    return token, [int(t) for t in kept]


@dataclass(slots=True, kw_only=True, eq=False)  # identity: requests are compared as objects
class _Running:
    request: GenerateRequest
    future: Future[GenerateResult]
    generator: torch.Generator
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    cache: DynamicCache | None = None
    next_logits: torch.Tensor | None = None
    length: int = 0  # tokens in the cache
    rope_delta: int | float = 0  # Qwen3-Omni's temporal positions may be fractional
    routes: list[torch.Tensor] = field(default_factory=list)  # with return_routed_experts: per forward
    aborted: bool = False
    abort_message: str = ABORT_BY_REQUEST  # why it was aborted (the first cause wins)
    on_token: TokenCallback | None = None
    output_top: list[TopLogprobs] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    input_top: list[TopLogprobs | None] | None = None
    input_start: int = 0
    num_retractions: int = 0
    top_p_ids: list[int] = field(default_factory=list)
    top_p_offsets: list[int] = field(default_factory=lambda: [0])
    grammar: Grammar | None = None  # the request's own matcher (json_schema / regex / ebnf)


class TransformersEngine:
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
    ) -> None:
        """``dtype``: the weights' and activations' dtype (float32 by default; bfloat16 serves as a GPU
        engine does, e.g. to measure the rollout/training mismatch R3 removes)."""
        self.model_dir = Path(model_dir)
        self.weights_group_timeout_s = weights_group_timeout_s
        self.device = torch.device(device)
        model = load_thinker(self.model_dir, dtype=dtype)
        self.model = model.to(self.device).eval()  # type: ignore[arg-type]
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        config = self.model.config
        self.qwen3_vl = is_qwen3_vl(self.model)
        self.deepstack = has_deepstack(self.model)
        self.omni = OmniRope.of(config)  # an Omni model's positions, per media item
        self.placeholders = {"image": config.image_token_id, "video": config.video_token_id}
        if not self.qwen3_vl:
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
        self._banned = torch.tensor(sorted(structural), device=self.device)
        # A grammar ends on the model's EOS ids; its width is the logits', which may exceed the tokenizer's.
        self.grammars = Grammars(self.tokenizer, vocab_size=vocab_size, stop_token_ids=self.eos_ids)
        self.weight_version = weight_version
        self.towers = Towers.from_modules(*towers_of(self.model), weight_version)
        self.max_running = max_running
        self._inbox: queue.Queue[_Running] = queue.Queue()
        self._waiting: deque[_Running] = deque()  # the scheduler thread's own queue (retracted ones first)
        self._running: list[_Running] = []
        self._by_rid: dict[str, _Running] = {}
        self._model_lock = threading.Lock()  # held per forward step, never across a generation
        self._unpaused = threading.Event()
        self._unpaused.set()
        self._pause_mode: PauseMode = "in_place"
        self._pause_applied = threading.Event()
        self._stopping = False
        self._groups: dict[str, Any] = {}  # weights update groups joined (SGLang's group_name → process group)
        self._groups_lock = threading.Lock()
        self.started = time.monotonic()
        self.busy_s = 0.0  # wall time spent in forward steps: the engine-idle share is 1 - busy / uptime
        self._thread = threading.Thread(target=self._loop, name="transformers-engine", daemon=True)
        self._thread.start()

    # -- the protocol --------------------------------------------------------------------------
    def submit(self, request: GenerateRequest, on_token: TokenCallback | None = None) -> Future[GenerateResult]:
        """Check and queue a request; ``on_token(token_id, logprob)`` is called from the engine thread per token
        (a `StepCallback`'s ``step`` with the token's `TokenStep`)."""
        if self._stopping:
            raise RuntimeError("the engine is closed")
        self.limits.check(request)
        self._check_media(request)
        grammar = self.grammars.constraint(request.sampling)
        rid = request.rid or uuid.uuid4().hex
        future: Future[GenerateResult] = Future()
        future.set_running_or_notify_cancel()  # a caller's cancel must not break the engine's set_result
        seed = request.sampling.sampling_seed
        generator = torch.Generator().manual_seed(seed if seed is not None else int(uuid.uuid4().int % 2**63))
        request = request if request.rid == rid else replace(request, rid=rid)
        running = _Running(request=request, future=future, generator=generator, on_token=on_token, grammar=grammar)
        self._by_rid[rid] = running
        self._inbox.put(running)
        return future

    def generate(self, request: GenerateRequest, timeout: float | None = None) -> GenerateResult:
        return self.submit(request).result(timeout)

    def abort(self, rid: str, *, message: str = ABORT_BY_REQUEST) -> bool:
        running = self._by_rid.get(rid)
        if running is None:
            return False
        if not running.aborted:
            running.abort_message = message
        running.aborted = True
        return True

    def abort_all(self, *, message: str = ABORT_BY_REQUEST) -> None:
        for rid in list(self._by_rid):
            self.abort(rid, message=message)

    def pause(self, mode: PauseMode = "in_place") -> None:
        """Stop between two decode steps; returns once the scheduler has applied ``mode``."""
        self._pause_mode = mode
        self._pause_applied.clear()
        if mode == "abort":
            self.abort_all(message=ABORT_PAUSED)
        self._unpaused.clear()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._pause_applied.wait(PAUSE_ACK_TIMEOUT_S)

    def resume(self) -> None:
        self._unpaused.set()

    def flush_cache(self) -> bool:
        """No prefix cache to drop here; False while a request holds KV (SGLang refuses then too)."""
        return not self._running

    @property
    def paused(self) -> bool:
        return not self._unpaused.is_set()

    def update_weights(self, path: str, version: str | None = None) -> str:
        """Load every ``*.safetensors`` of ``path`` into the model between two decode steps.

        All or nothing: names and shapes are checked against the model before any tensor is copied."""
        state = _read_weights(path)
        own = self.model.state_dict()
        if any(k not in own for k in state) and (Path(path) / "config.json").is_file():
            # A checkpoint in another layout than the loaded model's (transformers 5 saves a MoE model's
            # fused experts one by one): loaded by its class, through transformers' own conversions.
            state = self._converted(path)
        unexpected = [k for k in state if k not in own]
        if unexpected:
            raise WeightsError(f"weights in {path} do not fit the model: {unexpected[:3]}", code="weights_mismatch")
        reshaped = [k for k, v in state.items() if tuple(v.shape) != tuple(own[k].shape)]
        if reshaped:
            raise WeightsError(
                f"weights in {path} have other shapes than the model's: {reshaped[:3]}", code="weights_mismatch"
            )
        return self._load(state, version)

    def _converted(self, path: str) -> dict[str, torch.Tensor]:
        parameter = next(self.model.parameters())
        try:
            model = type(self.model).from_pretrained(path, dtype=parameter.dtype)
        except (OSError, ValueError, SafetensorError) as error:
            raise WeightsError(f"cannot load the weights in {path}: {error}", code="weights_not_found") from None
        return dict(model.state_dict())

    def _load(self, state: dict[str, torch.Tensor], version: str | None) -> str:
        with self._model_lock:
            self.model.load_state_dict(state, strict=False)
            # As SGLang: without a version the weights change and the version stays (a timestamp here
            # would read as a huge policy version). The towers' version still changes, so nothing
            # cached against the old towers is reused.
            self.weight_version = version or self.weight_version
            self.towers.version = version or f"{self.weight_version}@{time.strftime('%Y%m%d%H%M%S')}"
        return self.weight_version

    def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> None:
        """Join ``group_name`` as rank ``rank_offset`` (one rank: no tensor parallelism here). ``gloo`` on a
        CPU engine, ``nccl`` on a CUDA one — NCCL cannot move CPU tensors, so it is refused on CPU."""
        if backend not in ("gloo", "nccl"):
            raise WeightsError(f"backend {backend!r}: give gloo or nccl", code="weights_group")
        if backend == "nccl" and self.device.type != "cuda":
            raise WeightsError(
                "backend 'nccl' needs a CUDA engine; this one runs on CPU: use 'gloo'", code="weights_group"
            )
        if not 1 <= rank_offset < world_size:
            raise WeightsError(
                f"rank_offset {rank_offset} is not in [1, world_size {world_size}): rank 0 is the trainer",
                code="weights_group",
            )
        with self._groups_lock:
            if group_name in self._groups:
                raise WeightsError(
                    f"already in a weights update group named {group_name!r}: destroy it first", code="weights_group"
                )
            self._groups[group_name] = None  # reserved while joining: a second init of the name is refused
        try:
            group = join_weights_group(
                master_address,
                master_port,
                rank_offset,
                world_size,
                group_name,
                backend,
                timeout_s=self.weights_group_timeout_s,
            )
        except Exception as error:  # noqa: BLE001 - a rendezvous fails in many ways (timeout, refused, bad address)
            with self._groups_lock:
                self._groups.pop(group_name, None)
            raise WeightsError(
                f"cannot join {group_name!r} at {master_address}:{master_port}: {type(error).__name__}: {error}",
                code="weights_group",
            ) from None
        with self._groups_lock:
            self._groups[group_name] = group

    def update_weights_from_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], *, group_name: str, version: str | None
    ) -> str:
        """Receive every tensor (in order, as rank 0 broadcasts them), then load them all or none.

        A name the model lacks, or a shape or dtype other than its parameter's, loads nothing — the
        tensors are still received, so the sender is not left waiting and the group can be used
        again. The dtype must be the parameter's own: a cast would make the engine serve other
        weights than the trainer sent. A dtype or shape that cannot be received at all (an unknown
        dtype, a negative size) leaves the group, as the sender's broadcasts can no longer be matched."""
        import torch.distributed as dist

        with self._groups_lock:
            group = self._groups.get(group_name)
        if group is None:
            raise WeightsError(
                f"not in a weights update group named {group_name!r}: call /init_weights_update_group first",
                code="weights_group",
            )
        if not len(names) == len(dtypes) == len(shapes):
            raise WeightsError(
                f"names, dtypes and shapes differ in length ({len(names)}, {len(dtypes)}, {len(shapes)})",
                code="weights_mismatch",
            )
        specs: list[tuple[torch.dtype, tuple[int, ...]]] = []
        for name, dtype_name, shape in zip(names, dtypes, shapes, strict=True):
            dtype = getattr(torch, dtype_name, None) if dtype_name.isidentifier() else None
            if not isinstance(dtype, torch.dtype) or any(size < 0 for size in shape):
                self.destroy_weights_update_group(group_name)
                raise WeightsError(
                    f"{name}: cannot receive dtype {dtype_name!r} of shape {shape}; left {group_name!r} (its "
                    "broadcasts can no longer be matched): join it again",
                    code="weights_mismatch",
                )
            specs.append((dtype, tuple(shape)))
        own = self.model.state_dict()
        problems = []
        for name, (dtype, dims) in zip(names, specs, strict=True):
            if name not in own:
                problems.append(f"{name}: not a parameter of the model")
            elif tuple(own[name].shape) != dims or own[name].dtype != dtype:
                problems.append(
                    f"{name}: sent {str(dtype).removeprefix('torch.')} {list(dims)}, the model's is "
                    f"{str(own[name].dtype).removeprefix('torch.')} {list(own[name].shape)}"
                )
        received = {}
        pending = []
        for name, (dtype, dims) in zip(names, specs, strict=True):
            tensor = torch.empty(dims, dtype=dtype, device=self.device)
            pending.append(dist.broadcast(tensor, group=group, group_src=0, async_op=True))
            received[name] = tensor
        for work in pending:
            if work is not None:  # async_op always gives one; None is only the synchronous call's
                work.wait()
        if problems:
            raise WeightsError(
                f"the weights do not fit the model ({len(problems)} of {len(names)}; none loaded): "
                + "; ".join(problems[:3]),
                code="weights_mismatch",
            )
        return self._load(received, version)

    def destroy_weights_update_group(self, group_name: str) -> None:
        with self._groups_lock:
            group = self._groups.pop(group_name, None)
        if group is None:
            raise WeightsError(f"not in a weights update group named {group_name!r}", code="weights_group")
        import torch.distributed as dist

        dist.destroy_process_group(group)

    @property
    def running(self) -> int:
        return len(self._running)

    def healthy(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        self._stopping = True
        self._unpaused.set()
        self._thread.join(10)
        for name in [n for n, g in list(self._groups.items()) if g is not None]:
            try:
                self.destroy_weights_update_group(name)
            except Exception:  # noqa: BLE001 - closing: a group already broken must not stop the rest
                logger.warning("could not leave weights update group %s", name, exc_info=True)

    # -- checks at submission ------------------------------------------------------------------
    def _check_media(self, request: GenerateRequest) -> None:
        if any(m.embedding is None and m.features is None for m in request.media):
            raise InvalidMedia("a media item has neither features nor an embedding")
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

    # -- the scheduler -------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stopping:
            if not self._unpaused.is_set():
                self._while_paused()
                self._unpaused.wait(0.05)
                continue
            self._admit(block=not self._running)
            for running in list(self._running):
                if self._stopping or not self._unpaused.is_set():
                    break
                began = time.monotonic()
                try:
                    with self._model_lock:
                        self._step(running)
                except EngineError as error:  # the request's own fault, found only in the forward
                    logger.warning("request %s refused: %s", running.request.rid, error)
                    if not running.future.done():
                        self._finish(running, error=error)
                except Exception as error:  # noqa: BLE001 - one bad request must not stop the engine
                    logger.exception("request %s failed", running.request.rid)
                    if not running.future.done():
                        self._finish(running, error=error)
                self.busy_s += time.monotonic() - began
        # Closed: whatever is left ends as aborted rather than leaving its caller waiting.
        self._drain(block=False)
        for running in [*self._running, *self._waiting]:
            self._finish(running, reason={"type": "abort", "message": "the engine closed"})

    def _while_paused(self) -> None:
        """Apply the pause's mode once, then finish aborted requests (running, frozen or queued) while paused."""
        self._drain(block=False)
        if not self._pause_applied.is_set():
            if self._pause_mode == "retract":
                for running in reversed(self._running):
                    running.cache, running.next_logits = None, None  # recomputed with its tokens when admitted
                    running.num_retractions += 1
                    self._waiting.appendleft(running)
                self._running.clear()
            self._reap_aborted()
            self._pause_applied.set()
            return
        self._reap_aborted()

    def _reap_aborted(self) -> None:
        for running in [*self._running, *self._waiting]:
            if running.aborted:
                # SGLang's message for a request a pause aborted before it started (AReaL resubmits those
                # as they are); a client's abort says so whenever it lands.
                never_started = running.cache is None and not running.output_ids
                paused = running.abort_message == ABORT_PAUSED
                reason = ABORT_BEFORE_PREFILL if never_started and paused else running.abort_message
                self._finish(running, reason={"type": "abort", "message": reason})

    def _drain(self, *, block: bool) -> None:
        """Move submitted requests into the scheduler's own queue (waiting up to 50 ms for one if ``block``)."""
        while True:
            try:
                running = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
            except queue.Empty:
                return
            block = False
            self._waiting.append(running)

    def _admit(self, *, block: bool) -> None:
        """Move queued requests into the running set, up to ``max_running``."""
        self._drain(block=block and not self._waiting)
        while self._waiting and len(self._running) < self.max_running:
            self._running.append(self._waiting.popleft())

    def _step(self, running: _Running) -> None:
        request = running.request
        if running.aborted:
            self._finish(running, reason={"type": "abort", "message": running.abort_message})
            return
        params = request.sampling
        if running.cache is None:  # first admitted, or admitted again after a retraction
            self._prefill(running)
            if params.max_new_tokens == 0:
                self._finish(running, reason={"type": "length", "length": 0})
                return
        else:
            self._decode(running)
        assert running.next_logits is not None
        logits = running.next_logits
        scores = logits.float()
        if params.penalized:
            scores = penalize(
                scores,
                params,
                prompt_ids=request.input_ids,
                output_ids=running.output_ids,
                stop_ids={*params.stop_token_ids, *self.eos_ids},
            )
        allowed = scores.index_fill(0, self._banned, float("-inf"))
        if running.grammar is not None:  # after SGLang's logit processing, before temperature and the filters
            running.grammar.mask(allowed)
            if not bool(torch.isfinite(allowed).any()):
                # The penalties / bias / min_new_tokens left no token the grammar allows (min_new_tokens
                # masking the EOS a finished grammar needs): the grammar decides alone, so the output
                # still parses.
                allowed = running.grammar.mask(logits.float().index_fill(0, self._banned, float("-inf")))
        token, kept = sample_token(allowed, params, running.generator)
        if running.grammar is not None:
            running.grammar.accept(token)
        logprobs = torch.log_softmax(logits.float(), dim=-1)  # the model's own distribution (see protocol)
        if kept is not None:
            running.top_p_ids.extend(kept)
            running.top_p_offsets.append(len(running.top_p_ids))
        running.output_ids.append(token)
        running.logprobs.append(float(logprobs[token]))
        if request.return_logprob and request.top_logprobs_num:
            running.output_top.append(_top(logprobs, request.top_logprobs_num))
        if isinstance(running.on_token, StepCallback):
            running.on_token.step(self._token_step(running))
        elif running.on_token is not None:
            running.on_token(token, running.logprobs[-1])
        reason = self._stop_reason(running, token)
        if reason is not None:
            self._finish(running, reason=reason)

    @staticmethod
    def _token_step(running: _Running) -> TokenStep:
        """The step just taken, as a `StepCallback` gets it: the prompt's log-probs with the first token."""
        request = running.request
        top = running.output_top[-1] if request.return_logprob and request.top_logprobs_num else None
        first = len(running.output_ids) == 1
        return TokenStep(
            token_id=running.output_ids[-1],
            logprob=running.logprobs[-1],
            top=top,
            input_logprobs=running.input_logprobs if first else None,
            input_logprob_start=running.input_start,
            input_top_logprobs=running.input_top if first else None,
        )

    def _stop_reason(self, running: _Running, token: int) -> dict[str, Any] | None:
        params = running.request.sampling
        if running.grammar is not None and running.grammar.done:  # SGLang's: the grammar's end token matched
            return {"type": "stop", "matched": token}
        stoppable = len(running.output_ids) >= params.min_new_tokens  # stop tokens were masked before
        if stoppable and (token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_ids)):
            return {"type": "stop", "matched": token}
        if params.stop and stoppable:
            # As SGLang: matched on the raw decoded output (special tokens included), trimmed when returned.
            text = str(self.tokenizer.decode(running.output_ids, skip_special_tokens=False))
            hits = [(text.find(s), s) for s in params.stop if s and s in text]
            if hits:
                return {"type": "stop", "matched": min(hits)[1]}
        if len(running.output_ids) >= params.max_new_tokens:
            return {"type": "length", "length": params.max_new_tokens}
        if running.length + 1 >= self.max_context:
            return {"type": "length", "length": len(running.output_ids)}
        return None

    def _finish(
        self, running: _Running, *, reason: dict[str, Any] | None = None, error: BaseException | None = None
    ) -> None:
        if running in self._running:
            self._running.remove(running)
        if running in self._waiting:
            self._waiting.remove(running)
        if self._by_rid.get(running.request.rid) is running:  # a later request may reuse the rid
            del self._by_rid[running.request.rid]
        running.cache = None
        if error is not None:
            running.future.set_exception(error)
            return
        reason = reason or {"type": "stop"}
        request = running.request
        running.future.set_result(
            GenerateResult(
                rid=request.rid,
                output_ids=running.output_ids,
                output_logprobs=running.logprobs,
                finish_reason=reason,
                prompt_tokens=len(request.input_ids),
                weight_version=self.weight_version,
                text=self.text_of(running.output_ids, request.sampling, reason),
                input_logprobs=running.input_logprobs,
                input_logprob_start=running.input_start,
                input_top_logprobs=running.input_top,
                output_top_logprobs=running.output_top if request.return_logprob and request.top_logprobs_num else None,
                top_p_token_ids=running.top_p_ids if request.sampling.return_top_p_token_ids else None,
                top_p_token_offsets=running.top_p_offsets if request.sampling.return_top_p_token_ids else None,
                num_retractions=running.num_retractions,
                routed_experts=self._routed_experts(running),
            )
        )

    def _routed_experts(self, running: _Running) -> str | None:
        """SGLang's ``routed_experts`` of a finished request: rows ``[0, seqlen - 1)``; None when not asked
        or the model has no routers."""
        if not running.request.return_routed_experts or self.routing is None or not running.routes:
            return None
        seqlen = len(running.request.input_ids) + len(running.output_ids)
        return encode_routed_experts(torch.cat(running.routes)[: max(0, seqlen - 1)])

    def text_of(self, ids: list[int], params: SamplingParams, reason: dict[str, Any] | None = None) -> str:
        """The returned text, as SGLang's detokenizer makes it: a matched stop token left out, the text cut
        before a matched stop string, unless ``no_stop_trim``; special tokens per ``skip_special_tokens``."""
        matched = (reason or {}).get("matched")
        trim = not params.no_stop_trim and (reason or {}).get("type") == "stop"
        if trim and isinstance(matched, int) and not isinstance(matched, bool) and ids:
            ids = ids[:-1]
        text = str(
            self.tokenizer.decode(
                ids,
                skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
            )
        )
        if trim and isinstance(matched, str) and matched in text:
            text = text[: text.find(matched)]
        return text

    @torch.no_grad()
    def _prefill(self, running: _Running) -> None:
        """The prompt (and, after a retraction, the tokens generated so far) into a fresh KV cache."""
        request = running.request
        ids = torch.tensor([request.input_ids + running.output_ids], device=self.device)
        embeds = self.model.get_input_embeddings()(ids)
        embeds, deepstack = self._splice(ids, embeds, request.media)
        mask = torch.ones_like(ids)
        try:
            positions, delta = self._positions(ids, mask, request.media)
        except (IndexError, RuntimeError, TypeError, ValueError) as error:  # MediaError is a ValueError
            # The rotary index walks the prompt's media structure (each item: its bos token, then its
            # placeholders); a prompt whose structure does not fit its media fails in there.
            raise InvalidMedia(
                "the prompt's media tokens do not fit its media (each item: its bos token, then exactly its "
                f"placeholders, in the order of the media): {type(error).__name__}: {error}"
            ) from error
        running.routes = []  # a retracted request's prefill routes its whole sequence again
        out = self._forward(embeds, mask, positions, DynamicCache(), deepstack, running)
        running.cache = out.past_key_values
        running.length = ids.shape[1]
        running.rope_delta = delta
        running.next_logits = out.logits[0, -1]
        if request.return_logprob and running.input_logprobs is None:
            self._input_logprobs(running, out.logits[0])

    def _input_logprobs(self, running: _Running, logits: torch.Tensor) -> None:
        """SGLang's ``input_token_logprobs`` from ``logprob_start_len`` (-1: the last prompt position): the
        first returned is null (SGLang pads it), each other is log p(token | the prompt before it)."""
        request = running.request
        ids = request.input_ids
        start = request.logprob_start_len if request.logprob_start_len >= 0 else len(ids) - 1
        rows = torch.log_softmax(logits[start : len(ids) - 1].float(), dim=-1)
        chosen = rows.gather(1, torch.tensor(ids[start + 1 :], device=rows.device)[:, None])[:, 0]
        running.input_start = start
        running.input_logprobs = [None, *(float(v) for v in chosen)]
        if request.top_logprobs_num:
            running.input_top = [None, *(_top(row, request.top_logprobs_num) for row in rows)]

    @torch.no_grad()
    def _decode(self, running: _Running) -> None:
        token = torch.tensor([[running.output_ids[-1]]], device=self.device)
        embeds = self.model.get_input_embeddings()(token)
        position = torch.full((3, 1, 1), running.length + running.rope_delta, device=self.device)
        mask = torch.ones(1, running.length + 1, dtype=torch.long, device=self.device)
        out = self._forward(embeds, mask, position, running.cache, None, running)
        running.cache = out.past_key_values
        running.length += 1
        running.next_logits = out.logits[0, -1]

    def _forward(
        self,
        embeds: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        cache: DynamicCache | None,
        deepstack: tuple[torch.Tensor, list[torch.Tensor]] | None,
        running: _Running | None = None,
    ) -> Any:
        """One forward from input embeddings (the routing recorded into ``running`` when it asked for it)."""
        if self.routing is None or running is None or not running.request.return_routed_experts:
            return self._forward_model(embeds, mask, positions, cache, deepstack)
        with self.routing.recording() as rows:
            out = self._forward_model(embeds, mask, positions, cache, deepstack)
        running.routes.extend(rows)
        return out

    def _forward_model(
        self,
        embeds: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        cache: DynamicCache | None,
        deepstack: tuple[torch.Tensor, list[torch.Tensor]] | None,
    ) -> Any:
        """One forward from input embeddings; with DeepStack the language model is called with the prompt's
        DeepStack maps (``(visual position mask, one (visual tokens, hidden) map per layer)``), as the
        whole model calls it, then the LM head."""
        if not self.deepstack:
            return self.model(
                inputs_embeds=embeds, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True
            )
        where, maps = deepstack if deepstack is not None else (None, None)
        # Qwen3-VL nests its text model in ``model.language_model``; the Qwen3-Omni thinker's is ``model``.
        text_model = self.model.model.language_model if self.qwen3_vl else self.model.model
        out = text_model(
            inputs_embeds=embeds,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            visual_pos_masks=where,
            deepstack_visual_embeds=maps,
        )
        out.logits = self.model.lm_head(out.last_hidden_state)
        return out

    def _positions(
        self, ids: torch.Tensor, mask: torch.Tensor, media: tuple[MediaInput, ...]
    ) -> tuple[torch.Tensor, int | float]:
        """(3, 1, L) rotary positions of a prompt and the delta decoding continues from: an Omni model's per
        media item (`encoders.positions`: a video with its own track interleaved), Qwen3-VL's from the model's
        own ``get_rope_index`` (its temporal positions come from the prompt's timestamps)."""
        if self.omni is not None:
            positions, omni_delta = self.omni.positions(ids[0].tolist(), [_omni_item(m) for m in media])
            value = float(omni_delta)
            return positions[:, None].to(self.device), int(value) if value.is_integer() else value
        images = [m.grid_thw for m in media if m.kind == "image"]
        videos = [m.grid_thw for m in media if m.kind == "video"]
        positions, deltas = rope_index(
            self.model,
            ids,
            attention_mask=mask,
            image_grid_thw=torch.tensor(images, device=self.device) if images else None,
            video_grid_thw=torch.tensor(videos, device=self.device) if videos else None,
        )
        value = float(deltas.reshape(-1)[0])
        return positions, int(value) if value.is_integer() else value

    def _splice(
        self, ids: torch.Tensor, embeds: torch.Tensor, media: tuple[MediaInput, ...]
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, list[torch.Tensor]] | None]:
        """Media embeddings at their placeholder positions, each kind's items in prompt order; and, with
        DeepStack, the DeepStack maps of the visual positions (in sequence order) with their mask."""
        todo = [i for i, m in enumerate(media) if m.embedding is None]
        computed = self.towers.encode([media[i].features for i in todo])  # type: ignore[misc]
        vectors = {i: media[i].embedding for i in range(len(media))}
        vectors.update(dict(zip(todo, computed, strict=True)))
        maps: dict[int, torch.Tensor] = {}  # DeepStack: each visual item's maps, side by side
        if self.deepstack:
            for i, vector in vectors.items():
                if vector is not None and media[i].kind != "audio":
                    vectors[i], maps[i] = vector[:, : self.hidden_size], vector[:, self.hidden_size :]
        stack_width = self.visual_width - self.hidden_size
        full = embeds.new_zeros(*ids.shape, stack_width)
        visual = torch.zeros_like(ids, dtype=torch.bool)
        for kind, placeholder in self.placeholders.items():
            items = [i for i, m in enumerate(media) if m.kind == kind]
            rows = [vectors[i] for i in items]
            where = ids == placeholder
            count = int(where.sum())
            supplied = sum(int(r.shape[0]) for r in rows if r is not None)
            if count != supplied:
                raise InvalidMedia(f"{kind}: the prompt has {count} placeholder tokens but the media give {supplied}")
            if rows:
                stacked = torch.cat([r for r in rows if r is not None]).to(embeds.device, embeds.dtype)
                embeds = embeds.masked_scatter(where.unsqueeze(-1).expand_as(embeds), stacked)
            if maps and items and kind != "audio":
                stacked = torch.cat([maps[i] for i in items]).to(embeds.device, embeds.dtype)
                full = full.masked_scatter(where.unsqueeze(-1).expand_as(full), stacked)
                visual |= where
        if not bool(visual.any()) or not stack_width:
            return embeds, None
        return embeds, (visual, list(torch.split(full[visual], self.hidden_size, dim=-1)))


def _top(logprobs: torch.Tensor, n: int) -> TopLogprobs:
    values, indices = torch.topk(logprobs, min(n, logprobs.numel()))
    return [(float(v), int(i)) for v, i in zip(values, indices, strict=True)]


def _omni_item(media: MediaInput) -> OmniItem:
    """One media item as `encoders.positions` takes it (an audio item: its tokens; a picture or a video: its
    grid, and a video its seconds per temporal patch)."""
    if media.kind == "audio":
        return OmniItem(kind="audio", audio_tokens=media.num_tokens)
    if media.grid_thw is None or (media.kind == "video" and media.second_per_grid_t is None):
        raise MediaError(f"a {media.kind} item without its grid (and a video without its seconds per temporal patch)")
    t, h, w = (int(v) for v in media.grid_thw)
    return OmniItem(kind=media.kind, grid_thw=(t, h, w), second_per_grid=float(media.second_per_grid_t or 0.0))


def _read_weights(path: str) -> dict[str, torch.Tensor]:
    try:
        files = sorted(Path(path).glob("*.safetensors"))
        state: dict[str, torch.Tensor] = {}
        for file in files:
            state.update(load_file(str(file)))
    except (OSError, ValueError, SafetensorError) as error:  # unreadable folder, null byte, corrupt file
        raise WeightsError(f"cannot read weights in {path}: {error}", code="weights_not_found") from None
    if not files:
        raise WeightsError(f"no safetensors files in {path}", code="weights_not_found")
    return state
