"""`POST /generate` with ``stream``: SGLang's server-sent events for the requests of one body.

The requests are submitted before the response starts (`submit_streamed`), so a bad prompt is a plain
4xx; `GenerateStream` then turns the engine's token steps into cumulative chunks. What a request is and
how a result is shaped are `service`'s; the non-streamed answer is `generation`'s.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future

import engines
from engines import GenerateRequest, GenerateResult
from engines.api import GenerateResponse, StreamError
from engines.protocol import StepCallback, TokenStep

from .service import EngineRole, refuse, sse

__all__ = ["GenerateStream", "Shaper"]

logger = logging.getLogger(__name__)

Shaper = Callable[[GenerateRequest, GenerateResult, float], GenerateResponse]


class GenerateStream:
    """SGLang's default SSE: cumulative chunks, the finished one, then ``[DONE]``. A batch or n > 1
    streams every request at once, as SGLang does: each chunk is one request's cumulative output with
    its ``index`` (its place in the JSON list the same body would get), the requests' chunks
    interleaved as they come, one ``[DONE]`` after the last finishes. The requests are submitted
    before the response starts, so a bad prompt is a plain 4xx, not an event; a client that goes
    away aborts every request still running. As SGLang's, every chunk carries what was asked for so
    far, cumulatively like the text: the output log-probs, the output top log-probs
    (``top_logprobs_num``), and from the first chunk the prompt's log-probs (``logprob_start_len``),
    as the engine reports them per token (every backend does; one that did not would send them with
    the finished chunk). A request that fails while generating is an error event
    (with its ``index`` in a list); the others go on."""

    def __init__(
        self, role: EngineRole, requests: list[GenerateRequest], listed: bool, shaped: Shaper, start: float
    ) -> None:
        self.role, self.engine = role, role.engine
        self.requests, self.listed, self.shaped, self.start = requests, listed, shaped, start
        self.loop = asyncio.get_running_loop()
        # (request index, step) as tokens come; (request index, None) when it is done
        self.events: asyncio.Queue[tuple[int, TokenStep | None]] = asyncio.Queue()
        self.futures: list[Future[GenerateResult]] = []

    def submit(self) -> None:
        """Every request to the engine, or none (a refused prompt aborts those already submitted)."""
        try:
            for index, request in enumerate(self.requests):
                try:
                    self.futures.append(self.engine.submit(request, on_token=self._pusher(index)))
                except engines.EngineError as error:
                    raise refuse(error, item=index if self.listed else None) from None
        except BaseException:
            for request in self.requests[: len(self.futures)]:
                self.engine.abort(request.rid)
            raise
        for index, future in enumerate(self.futures):
            future.add_done_callback(self._finisher(index))

    def _pusher(self, index: int) -> StepCallback:
        def push(step: TokenStep) -> None:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (index, step))

        return StepCallback(push)

    def _finisher(self, index: int) -> Callable[[Future[GenerateResult]], None]:
        def finish(_: Future[GenerateResult]) -> None:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (index, None))

        return finish

    def _tagged(self, index: int, chunk: GenerateResponse | StreamError) -> bytes:
        if self.listed:  # every chunk is a fresh dict: tagging it in place is safe
            chunk["index"] = index
        return sse(chunk)

    def _partial(self, request: GenerateRequest, so_far: GenerateResult) -> GenerateResponse:
        params = request.sampling
        so_far.weight_version = self.engine.weight_version
        so_far.text = str(
            self.role.tokenizer.decode(
                so_far.output_ids,
                skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
            )
        )
        chunk = self.shaped(request, so_far, 0.0)
        chunk["meta_info"]["finish_reason"] = None
        return chunk

    def _finished(self, index: int) -> GenerateResponse | StreamError:
        request = self.requests[index]
        try:
            result = self.role.counted(self.futures[index].result())
            return self.shaped(request, result, time.perf_counter() - self.start)
        except engines.EngineError as error:  # the request's fault, found while generating
            return {"error": {"code": error.code, "message": str(error)}}
        except Exception:  # noqa: BLE001 - the status line is sent: the failure can only be an event
            logger.exception("request %s failed while streaming", request.rid)
            return {"error": {"code": "internal_error", "message": "the engine failed; see its log"}}

    async def chunks(self) -> AsyncIterator[bytes]:
        results = [
            GenerateResult(
                rid=request.rid,
                output_ids=[],
                output_logprobs=[],
                finish_reason={"type": "stop"},  # never sent: a partial chunk's is null (`_partial`)
                prompt_tokens=len(request.input_ids),
                weight_version=self.engine.weight_version,
            )
            for request in self.requests
        ]
        running = len(self.requests)
        try:
            while running:
                index, step = await self.events.get()
                if step is None:
                    running -= 1
                    yield self._tagged(index, self._finished(index))
                    continue
                _accumulate(results[index], step)
                yield self._tagged(index, self._partial(self.requests[index], results[index]))
            yield b"data: [DONE]\n\n"
        finally:
            for request, future in zip(self.requests, self.futures, strict=True):
                if not future.done():  # the client went away: stop generating for it
                    self.engine.abort(request.rid)


def _accumulate(so_far: GenerateResult, step: TokenStep) -> None:
    """One step into a request's result so far (its lists only grow: a chunk is serialised at once)."""
    so_far.output_ids.append(step.token_id)
    so_far.output_logprobs.append(step.logprob)
    if step.top is not None:
        if so_far.output_top_logprobs is None:
            so_far.output_top_logprobs = []
        so_far.output_top_logprobs.append(step.top)
    if step.input_logprobs is not None:
        so_far.input_logprobs = step.input_logprobs
        so_far.input_logprob_start = step.input_logprob_start
    if step.input_top_logprobs is not None:
        so_far.input_top_logprobs = step.input_top_logprobs
