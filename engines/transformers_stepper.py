"""`TransformersStepper`: what a `TransformersEngine`'s scheduler steps — one request's prefill (media
embeddings spliced in at the placeholder positions; the model's own 3-D rotary positions computed from the
grids, as the model computes them) or decode, then SGLang's logit processing, the grammar's mask and one
sampled token, and whether it stops.

Requests are stepped one by one, each with its own KV cache, so concurrent requests interleave token by token
and an abort lands within one step; decode steps are not fused into one batched forward (a CPU reference
backend; throughput is SGLang's job on a GPU). A prompt sent again (a group's samples) starts from the state its
first prefill left (`engines.prefill_cache`). A forward runs outside the scheduler's lock and under the
engine's model lock (a weight update waits for it).

The queue, pause modes and aborts are the `engines.scheduler.Scheduler`'s; the model and its checks at submit
are the engine's (`engines.transformers_backend`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from transformers import DynamicCache

from encoders.architectures import Family, rope_index, text_model
from encoders.positions import OmniRope
from encoders.routing import RoutingCapture, encode_routed_experts
from encoders.towers import Towers
from preprocess.errors import MediaError
from preprocess.omni import OmniItem

from .errors import EngineError, InvalidMedia
from .grammar import Grammar
from .logits import penalize, sample_token, top_logprobs
from .prefill_cache import DEFAULT_PREFILL_CACHE_BYTES, PrefillCache, Prefilled, prefill_key
from .protocol import FinishReason, GenerateResult, MediaInput, SamplingParams
from .scheduler import Req, Scheduler

__all__ = ["ModelHost", "TransformersState", "TransformersStepper"]

logger = logging.getLogger(__name__)


@dataclass(slots=True, kw_only=True, eq=False)
class TransformersState:
    """One request's own: its generator, KV cache and next logits, and what it reports besides tokens."""

    generator: torch.Generator
    grammar: Grammar | None = None  # the request's own matcher (json_schema / regex / ebnf)
    cache: DynamicCache | None = None
    next_logits: torch.Tensor | None = None
    length: int = 0  # tokens in the cache
    rope_delta: int | float = 0  # Qwen3-Omni's temporal positions may be fractional
    routes: list[torch.Tensor] = field(default_factory=list)  # with return_routed_experts: per forward
    top_p_ids: list[int] = field(default_factory=list)
    top_p_offsets: list[int] = field(default_factory=lambda: [0])


class ModelHost(Protocol):
    """What a `TransformersStepper` reads of the engine that loaded the model and builds the stepper
    (`engines.transformers_backend.TransformersEngine`); declared here so that imports run one way, from the
    engine to its stepper."""

    model: Any  # the transformers model (`encoders.architectures.load_thinker`)
    tokenizer: Any
    device: torch.device
    model_lock: threading.Lock  # held per forward step: a weight update waits for it
    weight_version: str  # read when a request finishes (an update may change it between two steps)
    towers: Towers | None  # None: a text model
    routing: RoutingCapture | None  # a mixture-of-experts model's router hooks
    omni: OmniRope | None  # an Omni model's positions, per media item
    family: Family
    deepstack: bool
    placeholders: dict[str, int]  # media kind → its placeholder token id
    hidden_size: int
    visual_width: int  # a visual embedding's: the merged output, then (DeepStack) its maps side by side
    eos_ids: set[int]
    banned_ids: torch.Tensor  # never sampled: the media structure tokens
    max_context: int


class TransformersStepper:
    """The `engines.scheduler.Stepper` of ``engine``'s model (see the module)."""

    kv_capacity = math.inf  # each request its own cache: only max_running bounds admission

    def __init__(self, engine: ModelHost, *, prefill_cache_bytes: int = DEFAULT_PREFILL_CACHE_BYTES) -> None:
        self.engine = engine
        self.prefilled = PrefillCache(prefill_cache_bytes)  # read and changed under the engine's model lock
        self.busy_s = 0.0  # wall time spent in forward steps: the engine-idle share is 1 - busy / uptime

    def tokens(self, req: Req[TransformersState]) -> int:
        return 0

    def ready(self) -> bool:
        return True

    def idle(self) -> None:
        pass

    def drop(self, req: Req[TransformersState]) -> None:
        req.state.cache, req.state.next_logits = None, None  # recomputed with its tokens when admitted again

    def step(self, scheduler: Scheduler[TransformersState]) -> None:
        """One token for each req request in turn (its prefill first), until a pause or close."""
        for req in list(scheduler.running):
            if scheduler.stopping or scheduler.paused:
                break
            if req.aborted:
                scheduler.finish(req, {"type": "abort", "message": req.abort_message})
                continue
            began = time.monotonic()
            try:
                with scheduler.unlocked(), self.engine.model_lock:
                    reason = self._step(req)
            except EngineError as error:  # the request's own fault, found only in the forward
                logger.warning("request %s refused: %s", req.request.rid, error)
                scheduler.finish(req, error=error)
            except Exception as error:  # noqa: BLE001 - one bad request must not stop the engine
                logger.exception("request %s failed", req.request.rid)
                scheduler.finish(req, error=error)
            else:
                if reason is not None:
                    scheduler.finish(req, reason)
            self.busy_s += time.monotonic() - began

    def _step(self, req: Req[TransformersState]) -> FinishReason | None:
        """One token for ``req`` (delivered to its ``on_token``); its finish_reason if it ends here."""
        request = req.request
        params = request.sampling
        if req.state.cache is None:  # first admitted, or admitted again after a retraction
            self._prefill(req)
            if params.max_new_tokens == 0:
                return {"type": "length", "length": 0}
        else:
            self._decode(req)
        assert req.state.next_logits is not None
        logits = req.state.next_logits
        scores = logits.float()
        if params.penalized:
            scores = penalize(
                scores,
                params,
                prompt_ids=request.input_ids,
                output_ids=req.output_ids,
                stop_ids={*params.stop_token_ids, *self.engine.eos_ids},
            )
        allowed = scores.index_fill(0, self.engine.banned_ids, float("-inf"))
        if req.state.grammar is not None:  # after SGLang's logit processing, before temperature and the filters
            req.state.grammar.mask(allowed)
            if not bool(torch.isfinite(allowed).any()):
                # The penalties / bias / min_new_tokens left no token the grammar allows (min_new_tokens
                # masking the EOS a finished grammar needs): the grammar decides alone, so the output
                # still parses.
                allowed = req.state.grammar.mask(logits.float().index_fill(0, self.engine.banned_ids, float("-inf")))
        token, kept = sample_token(allowed, params, req.state.generator)
        if req.state.grammar is not None:
            req.state.grammar.accept(token)
        logprobs = torch.log_softmax(logits.float(), dim=-1)  # the model's own distribution (see protocol)
        if kept is not None:
            req.state.top_p_ids.extend(kept)
            req.state.top_p_offsets.append(len(req.state.top_p_ids))
        req.output_ids.append(token)
        req.logprobs.append(float(logprobs[token]))
        if request.return_logprob and request.top_logprobs_num:
            req.output_top.append(top_logprobs(logprobs, request.top_logprobs_num))
        req.deliver(len(req.output_ids) - 1)
        return self._stop_reason(req, token)

    def _stop_reason(self, req: Req[TransformersState], token: int) -> FinishReason | None:
        params = req.request.sampling
        if req.state.grammar is not None and req.state.grammar.done:  # SGLang's: the grammar's end token matched
            return {"type": "stop", "matched": token}
        stoppable = len(req.output_ids) >= params.min_new_tokens  # stop tokens were masked before
        if stoppable and (token in params.stop_token_ids or (not params.ignore_eos and token in self.engine.eos_ids)):
            return {"type": "stop", "matched": token}
        if params.stop and stoppable:
            # As SGLang: matched on the raw decoded output (special tokens included), trimmed when returned.
            text = str(self.engine.tokenizer.decode(req.output_ids, skip_special_tokens=False))
            hits = [(text.find(s), s) for s in params.stop if s and s in text]
            if hits:
                return {"type": "stop", "matched": min(hits)[1]}
        if len(req.output_ids) >= params.max_new_tokens:
            return {"type": "length", "length": params.max_new_tokens}
        if req.state.length + 1 >= self.engine.max_context:
            return {"type": "length", "length": len(req.output_ids)}
        return None

    def result(self, req: Req[TransformersState], reason: FinishReason) -> GenerateResult:
        return req.result(
            reason,
            weight_version=self.engine.weight_version,
            text=self.text_of(req.output_ids, req.request.sampling, reason),
            top_p=(req.state.top_p_ids, req.state.top_p_offsets),
            routed_experts=self._routed_experts(req),
        )

    def _routed_experts(self, req: Req[TransformersState]) -> str | None:
        """SGLang's ``routed_experts`` of a finished request: rows ``[0, seqlen - 1)``; None when not asked
        or the model has no routers."""
        if not req.request.return_routed_experts or self.engine.routing is None or not req.state.routes:
            return None
        seqlen = len(req.request.input_ids) + len(req.output_ids)
        return encode_routed_experts(torch.cat(req.state.routes)[: max(0, seqlen - 1)])

    def text_of(self, ids: list[int], params: SamplingParams, reason: FinishReason | None = None) -> str:
        """The returned text, as SGLang's detokenizer makes it: a matched stop token left out, the text cut
        before a matched stop string, unless ``no_stop_trim``; special tokens per ``skip_special_tokens``."""
        matched = reason.get("matched") if reason is not None else None
        trim = not params.no_stop_trim and reason is not None and reason["type"] == "stop"
        if trim and isinstance(matched, int) and not isinstance(matched, bool) and ids:
            ids = ids[:-1]
        text = str(
            self.engine.tokenizer.decode(
                ids,
                skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
            )
        )
        if trim and isinstance(matched, str) and matched in text:
            text = text[: text.find(matched)]
        return text

    @torch.no_grad()
    def _prefill(self, req: Req[TransformersState]) -> None:
        """The prompt (and, after a retraction, the tokens generated so far) into a fresh KV cache — or the
        state a request with the same prompt left (`engines.prefill_cache`)."""
        request = req.request
        tokens = request.input_ids + req.output_ids
        scored = request.return_logprob and req.input_logprobs is None
        key = None
        if self.prefilled.max_bytes:
            routes = request.return_routed_experts and self.engine.routing is not None
            key = prefill_key(tokens, request.media, routes=routes)
            # A hit has no logits of the prompt's positions: a request scoring them prefills.
            hit = None if scored and self._scores_prompt(req) else self.prefilled.get(key)
            if hit is not None:
                req.state.cache, req.state.next_logits = hit.cache, hit.next_logits
                req.state.length, req.state.rope_delta, req.state.routes = hit.length, hit.rope_delta, [*hit.routes]
                req.prefilled = True
                if scored:
                    self._input_logprobs(req, hit.next_logits[None])  # no prompt position is scored
                return
        ids = torch.tensor([tokens], device=self.engine.device)
        embeds = self.engine.model.get_input_embeddings()(ids)
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
        req.state.routes = []  # a retracted request's prefill routes its whole sequence again
        out = self._forward(embeds, mask, positions, DynamicCache(config=self.engine.model.config), deepstack, req)
        req.state.cache = out.past_key_values
        req.prefilled = True
        req.state.length = ids.shape[1]
        req.state.rope_delta = delta
        req.state.next_logits = out.logits[0, -1]
        if key is not None:
            self.prefilled.put(
                key,
                Prefilled(
                    cache=req.state.cache,
                    next_logits=req.state.next_logits,
                    length=req.state.length,
                    rope_delta=delta,
                    routes=tuple(req.state.routes),
                ),
            )
        if scored:
            self._input_logprobs(req, out.logits[0])

    @staticmethod
    def _scores_prompt(req: Req[TransformersState]) -> bool:
        """Whether ``req`` asks log-probs of prompt tokens (``logprob_start_len`` before its last position)."""
        request = req.request
        return 0 <= request.logprob_start_len < len(request.input_ids) - 1

    def _input_logprobs(self, req: Req[TransformersState], logits: torch.Tensor) -> None:
        """SGLang's ``input_token_logprobs`` from ``logprob_start_len`` (-1: the last prompt position): the
        first returned is null (SGLang pads it), each other is log p(token | the prompt before it)."""
        request = req.request
        ids = request.input_ids
        start = request.logprob_start_len if request.logprob_start_len >= 0 else len(ids) - 1
        rows = torch.log_softmax(logits[start : len(ids) - 1].float(), dim=-1)
        chosen = rows.gather(1, torch.tensor(ids[start + 1 :], device=rows.device)[:, None])[:, 0]
        req.input_start = start
        req.input_logprobs = [None, *(float(v) for v in chosen)]
        if request.top_logprobs_num:
            req.input_top = [None, *(top_logprobs(row, request.top_logprobs_num) for row in rows)]

    @torch.no_grad()
    def _decode(self, req: Req[TransformersState]) -> None:
        token = torch.tensor([[req.output_ids[-1]]], device=self.engine.device)
        embeds = self.engine.model.get_input_embeddings()(token)
        axes = (3,) if self.engine.family.media else ()  # a media model's 3-D rotary positions; a text model's 1-D
        position = torch.full((*axes, 1, 1), req.state.length + req.state.rope_delta, device=self.engine.device)
        mask = torch.ones(1, req.state.length + 1, dtype=torch.long, device=self.engine.device)
        out = self._forward(embeds, mask, position, req.state.cache, None, req)
        req.state.cache = out.past_key_values
        req.state.length += 1
        req.state.next_logits = out.logits[0, -1]

    def _forward(
        self,
        embeds: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        cache: DynamicCache | None,
        deepstack: tuple[torch.Tensor, list[torch.Tensor]] | None,
        req: Req[TransformersState],
    ) -> Any:
        """One forward of ``req`` from input embeddings, its routing recorded into it when it asked for it. With
        DeepStack the language model is called with the prompt's DeepStack maps (``(visual position mask, one
        (visual tokens, hidden) map per layer)``), as the whole model calls it, then the LM head."""
        routing = self.engine.routing if req.request.return_routed_experts else None
        recording: AbstractContextManager[list[torch.Tensor]] = (
            routing.recording() if routing is not None else nullcontext([])
        )
        inputs = {
            "inputs_embeds": embeds,
            "attention_mask": mask,
            "position_ids": positions,
            "past_key_values": cache,
            "use_cache": True,
        }
        with recording as rows:
            if not self.engine.deepstack:
                out = self.engine.model(**inputs)
            else:
                where, maps = deepstack if deepstack is not None else (None, None)
                model = self.engine.model
                out = text_model(model)(**inputs, visual_pos_masks=where, deepstack_visual_embeds=maps)
                out.logits = model.lm_head(out.last_hidden_state)
        req.state.routes.extend(rows)
        return out

    def _positions(
        self, ids: torch.Tensor, mask: torch.Tensor, media: tuple[MediaInput, ...]
    ) -> tuple[torch.Tensor, int | float]:
        """(3, 1, L) rotary positions of a prompt and the delta decoding continues from: an Omni model's per
        media item (`encoders.positions`: a video with its own track interleaved), Qwen3-VL's from the model's
        own ``get_rope_index`` (its temporal positions come from the prompt's timestamps)."""
        if self.engine.omni is not None:
            positions, omni_delta = self.engine.omni.positions(ids[0].tolist(), [_omni_item(m) for m in media])
            value = float(omni_delta)
            return positions[:, None].to(self.engine.device), int(value) if value.is_integer() else value
        images = [m.grid_thw for m in media if m.kind == "image"]
        videos = [m for m in media if m.kind == "video"]
        device = self.engine.device
        seconds = [float(m.second_per_grid_t or 0.0) for m in videos]
        positions, deltas = rope_index(
            self.engine.model,
            ids,
            attention_mask=mask,
            image_grid_thw=torch.tensor(images, device=device) if images else None,
            video_grid_thw=torch.tensor([m.grid_thw for m in videos], device=device) if videos else None,
            second_per_grid_ts=torch.tensor(seconds, device=device) if videos else None,
        )
        value = float(deltas.reshape(-1)[0])
        return positions, int(value) if value.is_integer() else value

    def _splice(
        self, ids: torch.Tensor, embeds: torch.Tensor, media: tuple[MediaInput, ...]
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, list[torch.Tensor]] | None]:
        """Media embeddings at their placeholder positions, each kind's items in prompt order; and, with
        DeepStack, the DeepStack maps of the visual positions (in sequence order) with their mask."""
        if not media:
            return embeds, None
        todo = [i for i, m in enumerate(media) if m.embedding is None]
        assert self.engine.towers is not None  # a text model takes no media (`_check_media`)
        computed = self.engine.towers.encode([media[i].features for i in todo]) if todo else []  # type: ignore[misc]
        vectors = {i: media[i].embedding for i in range(len(media))}
        vectors.update(dict(zip(todo, computed, strict=True)))
        maps: dict[int, torch.Tensor] = {}  # DeepStack: each visual item's maps, side by side
        if self.engine.deepstack:
            for i, vector in vectors.items():
                if vector is not None and media[i].kind != "audio":
                    vectors[i], maps[i] = vector[:, : self.engine.hidden_size], vector[:, self.engine.hidden_size :]
        stack_width = self.engine.visual_width - self.engine.hidden_size
        full = embeds.new_zeros(*ids.shape, stack_width)
        visual = torch.zeros_like(ids, dtype=torch.bool)
        for kind, placeholder in self.engine.placeholders.items():
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
        return embeds, (visual, list(torch.split(full[visual], self.engine.hidden_size, dim=-1)))


def _omni_item(media: MediaInput) -> OmniItem:
    """One media item as `encoders.positions` takes it (an audio item: its tokens; a picture or a video: its
    grid, and a video its seconds per temporal patch)."""
    if media.kind == "audio":
        return OmniItem(kind="audio", audio_tokens=media.num_tokens)
    if media.grid_thw is None or (media.kind == "video" and media.second_per_grid_t is None):
        raise MediaError(f"a {media.kind} item without its grid (and a video without its seconds per temporal patch)")
    t, h, w = (int(v) for v in media.grid_thw)
    return OmniItem(kind=media.kind, grid_thw=(t, h, w), second_per_grid=float(media.second_per_grid_t or 0.0))
