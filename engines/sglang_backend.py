"""`SGLangEngine`: the engine protocol on SGLang's in-process `sglang.Engine` (GPU), on one owned event loop.

**Loop rules** (read from sglang 0.5.23, ``srt/entrypoints/engine.py`` and ``srt/managers/tokenizer_manager.py``;
``tests/engines/sglang_standin.py`` keeps them in ``make test``, ``make sglang-check`` confirms them on the
installed package): ``Engine.__init__`` keeps the thread's loop, and every sync method is
``run_until_complete`` on it, so two sync calls at once from two threads fail ("This event loop is already
running"); the tokenizer manager receives every scheduler output on the loop of its first request, so an
``await`` from another loop never sees its results. This backend therefore builds the Engine on one thread
of its own (`engines.sglang_loop.EngineLoop`), whose loop runs for the engine's life, and hands that loop every
call as a coroutine: generation (``Engine.async_generate``, streamed when a caller wants each token),
pause and continue with their modes, weight updates (from disk, from tensors, from a distributed group, and
the group itself), abort and flush (the tokenizer manager's coroutines that the Engine's sync methods wrap,
with SGLang's request records from ``sglang.srt.managers.io_struct``). Nothing on Weir's side serialises
requests: whatever is in flight is SGLang's scheduler's to batch.

**Inputs** are built and read by `engines.sglang_request` (``build_request`` / ``result_from``).

**Streaming.** With ``on_token`` the request is streamed: SGLang's chunks are cumulative (its intermediate
chunks even hand over its own live ``output_ids`` list), so each chunk's tokens past those already reported
go to ``on_token`` — with their top log-probs, and the prompt's log-probs on the first, for a `StepCallback`.
Chunks may coalesce several tokens (SGLang keeps only the latest undelivered one); none is skipped.

**Aborts.** SGLang answers an aborted request with the output so far and its own message ("Aborted" for a
running request, "Abort in waiting queue" for a queued one). This backend knows why it aborted one and says
so as every Weir backend does (`engines.protocol.ABORT_PAUSED` for a pause in ``abort`` mode —
``ABORT_BEFORE_PREFILL`` when nothing was generated — and ``ABORT_BY_REQUEST`` for a client's abort), so a
partial rollout continues running samples too (`rollout.partial`).

**Log-probs** are the model's own distribution's, before temperature and top-p / top-k / min-p, as the engine
protocol says and the trainer recomputes: SGLang reports those of the temperature-scaled distribution unless
``SGLANG_RETURN_ORIGINAL_LOGPROB`` is set (0.5.23, ``srt/layers/sampler.py``: read once when its scheduler
process imports it), so the backend sets it before the Engine spawns its schedulers (`ORIGINAL_LOGPROBS`), over
any value the environment had. A linear-attention model's convolution windows (Qwen3.5's gated delta-net layers) sit
in SGLang's state pool in bf16 whatever the model's dtype (``SGLANG_MAMBA_CONV_DTYPE``, 0.5.23's default): an engine
given a dtype keeps them in it (`conv_state_dtype`, set the same way), so each decoded token is computed from the
inputs the trainer sees (a float32 engine with bf16 windows: log-probs 8e-4 off on the tiny Qwen3.5).
What still differs from the protocol: SGLang takes them after its logit bias
(the structural tokens' -inf: `engines.sglang_request.build_request`), penalties and grammar masks.

``busy_s`` counts the time any request was in flight, not forward steps (SGLang keeps its own scheduler
metrics behind ``--enable-metrics``).
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Unpack

import torch

from .errors import InvalidEnginePrompt, WeightsError
from .limits import ModelLimits
from .protocol import (
    ABORT_BEFORE_PREFILL,
    ABORT_BY_REQUEST,
    ABORT_PAUSED,
    GenerateRequest,
    GenerateResult,
    PauseMode,
    TokenCallback,
    WeightsGroupArgs,
    with_rid,
)
from .sglang_args import check_server_args
from .sglang_loop import EngineLoop
from .sglang_request import (
    GenerateKwargs,
    ModelLayout,
    SGLangMeta,
    SGLangOutput,
    build_request,
    output_logprob,
    refuse_video_tracks,
    result_from,
    token_step,
)
from .weights import check_lengths

__all__ = ["SGLangEngine", "build_request", "result_from"]  # the request mapping re-exported for its callers

# SGLang's switch for log-probs before temperature scaling (see the module's docstring), set for its schedulers
ORIGINAL_LOGPROBS = ("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")
# and its dtype for the convolution windows of linear-attention layers (the docstring)
CONV_STATE_DTYPE = "SGLANG_MAMBA_CONV_DTYPE"
_DTYPE_NAMES = {
    "float": "float32",
    "float32": "float32",
    "half": "float16",
    "float16": "float16",
    "bfloat16": "bfloat16",
}


def conv_state_dtype(server_args: Mapping[str, object]) -> str | None:
    """SGLang's name for the engine's dtype (``dtype`` of its server arguments); None for ``auto`` or none given."""
    return _DTYPE_NAMES.get(str(server_args.get("dtype")))


class SGLangEngine:
    """`sglang.Engine` behind the engine protocol (``pip install -e '.[sglang]'``, a CUDA GPU).

    ``server_args`` are SGLang's `ServerArgs` fields (`engines.sglang_args`), passed to the Engine as they are,
    with ``weight_version`` "0" unless given (Weir's publisher counts versions in decimals). ``engine_class``
    and ``io_struct`` stand in for ``sglang.Engine`` and ``sglang.srt.managers.io_struct`` (tests on CPU)."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        server_args: Mapping[str, Any] | None = None,
        engine_class: Callable[..., Any] | None = None,
        io_struct: Any = None,
        start_timeout_s: float | None = None,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.limits = ModelLimits.read(self.model_dir)
        self._layout = ModelLayout.of(json.loads((self.model_dir / "config.json").read_text()))
        args = {
            "weight_version": "0",
            # names are checked against the installed SGLang by load_engine; here only Weir's own are refused
            **check_server_args(server_args or {}, fields=None),
        }
        name, value = ORIGINAL_LOGPROBS
        os.environ[name] = value  # before the Engine spawns its scheduler processes, which inherit it
        if (dtype := conv_state_dtype(args)) is not None:
            os.environ[CONV_STATE_DTYPE] = dtype  # as the log-probs' switch: the engine's own, whatever was there
        if engine_class is None or io_struct is None:
            # the GPU extra; imported here so the CPU install never needs it
            import sglang
            from sglang.srt.managers import io_struct as sglang_io

            engine_class = engine_class or sglang.Engine
            io_struct = io_struct or sglang_io
        self._io = io_struct
        self._loop = EngineLoop("sglang-engine")
        self.engine = self._loop.start(lambda: engine_class(model_path=str(self.model_dir), **args), start_timeout_s)
        self._tokenizer_manager = self.engine.tokenizer_manager
        self.weight_version = str(args["weight_version"])
        self._parallel = {name: int(args.get(name, 1)) for name in ("pp_size", "dp_size")}
        self._drafted = bool(args.get("speculative_algorithm"))  # a draft model beside the target (`_drain`)
        self._renames: dict[str, str] | None = None  # `_checkpoint_names`, on the first update by name
        self._unloadable: frozenset[str] | None = None  # `_converted`, on the first broadcast group
        self._stored: dict[str, tuple[int, ...]] | None = None  # `_check_stored`, on the first such update
        self._in_checkpoint_layout: set[str] = set()  # the groups whose trainer sends the files' layout
        self.started = time.monotonic()
        self._lock = threading.Lock()
        self._inflight: set[str] = set()  # rids; changed on the loop thread only
        self._busy = 0.0  # closed busy intervals; the open one is added on read
        self._busy_since = 0.0
        self._paused = False
        self._closed = False
        # why this backend aborted a request (rid → Weir's abort message); read when its answer comes
        self._abort_causes: dict[str, str] = {}
        self._pause_aborting = False

    # -- state -------------------------------------------------------------------------------------

    @property
    def busy_s(self) -> float:
        with self._lock:
            return self._busy + (time.monotonic() - self._busy_since if self._inflight else 0.0)

    @property
    def running(self) -> int:
        return len(self._inflight)

    @property
    def paused(self) -> bool:
        return self._paused

    def healthy(self) -> bool:
        return not self._closed and self._loop.alive

    # -- generation --------------------------------------------------------------------------------

    def submit(self, request: GenerateRequest, on_token: TokenCallback | None = None) -> Future[GenerateResult]:
        """Check ``request`` and hand it to SGLang; cancelling the future aborts it there."""
        self.limits.check(request)
        refuse_video_tracks(request.input_ids, self._layout.video_tracks)
        return self._loop.submit(self._generate(with_rid(request), on_token))

    def generate(self, request: GenerateRequest, timeout: float | None = None) -> GenerateResult:
        return self.submit(request).result(timeout)

    async def _generate(self, request: GenerateRequest, on_token: TokenCallback | None) -> GenerateResult:
        kwargs = build_request(request, self._layout)
        rid = kwargs["rid"]
        self._enter(rid)
        try:
            if on_token is None:
                output = await self.engine.async_generate(**kwargs)
            else:
                output = await self._stream(kwargs, request, on_token)
        except asyncio.CancelledError:  # the caller gave up (a timeout, a client gone): free SGLang's slot
            self._tokenizer_manager.abort_request(rid=rid)
            raise
        except ValueError as error:  # SGLang's own input checks (length, vocabulary, media)
            raise InvalidEnginePrompt(str(error)) from error
        finally:
            self._leave(rid)
        return result_from(self._with_cause(output, rid), request)

    async def _stream(self, kwargs: GenerateKwargs, request: GenerateRequest, on_token: TokenCallback) -> SGLangOutput:
        chunks = await self.engine.async_generate(**kwargs, stream=True)
        step = getattr(on_token, "step", None)  # a StepCallback takes each step's TokenStep
        reported = 0
        last: SGLangOutput | None = None
        try:
            async for chunk in chunks:
                meta: SGLangMeta = chunk["meta_info"]
                ids: list[int] = chunk["output_ids"]
                for position in range(reported, len(ids)):
                    token, logprob = int(ids[position]), output_logprob(meta, position)
                    if step is None:
                        on_token(token, logprob)
                    else:
                        step(token_step(meta, request, position, token, logprob))
                reported = len(ids)
                # SGLang's intermediate chunks share its live list: keep a copy
                last = {**chunk, "output_ids": list(ids), "meta_info": meta.copy()}
        except BaseException:
            self._tokenizer_manager.abort_request(rid=kwargs["rid"])
            raise
        finally:
            await chunks.aclose()
        if last is None:
            raise RuntimeError(f"SGLang's stream of {kwargs['rid']} ended without a chunk")
        return last

    def _with_cause(self, output: SGLangOutput, rid: str) -> SGLangOutput:
        """SGLang's answer, its abort message replaced by Weir's where this backend caused the abort."""
        cause = self._abort_causes.pop(rid, ABORT_PAUSED if self._pause_aborting else None)
        meta = output.get("meta_info") or {}
        reason = meta.get("finish_reason")
        if cause is None or not isinstance(reason, Mapping) or reason.get("type") != "abort":
            return output
        if cause == ABORT_PAUSED and not output.get("output_ids"):
            cause = ABORT_BEFORE_PREFILL
        return {**output, "meta_info": {**meta, "finish_reason": {"type": "abort", "message": cause}}}

    def _enter(self, rid: str) -> None:
        with self._lock:
            if not self._inflight:
                self._busy_since = time.monotonic()
            self._inflight.add(rid)

    def _leave(self, rid: str) -> None:
        with self._lock:
            self._inflight.discard(rid)
            if not self._inflight:
                self._busy += time.monotonic() - self._busy_since

    # -- abort, pause, flush -----------------------------------------------------------------------

    def abort(self, rid: str) -> bool:
        return self._loop.run(self._abort, rid)

    def _abort(self, rid: str) -> bool:
        if rid not in self._inflight:
            return False
        self._abort_causes.setdefault(rid, ABORT_BY_REQUEST)
        self._tokenizer_manager.abort_request(rid=rid)
        return True

    def abort_all(self) -> None:
        self._loop.run(self._abort_all)

    def _abort_all(self) -> None:
        for rid in self._inflight:
            self._abort_causes.setdefault(rid, ABORT_BY_REQUEST)
        self._tokenizer_manager.abort_request(abort_all=True)

    def pause(self, mode: PauseMode = "in_place") -> None:
        """SGLang's pause_generation in ``mode``; in ``abort`` mode it returns once every request it
        aborted has answered (SGLang waits for them)."""
        self._loop.call(self._pause(mode))
        self._paused = True

    async def _pause(self, mode: PauseMode) -> None:
        if mode == "abort":
            for rid in self._inflight:
                self._abort_causes.setdefault(rid, ABORT_PAUSED)
            self._pause_aborting = True
        try:
            await self._tokenizer_manager.pause_generation(self._io.PauseGenerationReqInput(mode=mode))
        finally:
            self._pause_aborting = False

    def resume(self) -> None:
        self._loop.call(self._tokenizer_manager.continue_generation(self._io.ContinueGenerationReqInput()))
        self._paused = False

    def flush_cache(self) -> bool:
        outcome = self._loop.call(self._tokenizer_manager.flush_cache())
        return bool(getattr(outcome, "success", outcome))

    # -- weights -----------------------------------------------------------------------------------

    def _weights(self, method: str, record: str, *, session: bool = False, **fields: Any) -> None:
        """The tokenizer manager's ``method`` with an ``io_struct.<record>``; its refusal (``success``
        false, SGLang's message) is `WeightsError` ``weights_rejected``.

        ``session``: inside a weight-update session of its own. sglang 0.5.23 loads tensors (the caller's or a
        broadcast's) only between ``begin_weight_update`` and ``end_weight_update`` (its scheduler's weight
        updater refuses them otherwise; a disk update needs none), so each such update here is one whole
        session, opened and closed on the engine's loop with nothing in between, for the models the update's
        ``selector`` picks (the session restores them before and finalizes them after; by default all)."""
        manager, io = self._tokenizer_manager, self._io

        async def on_loop() -> Any:
            if not session:
                return await getattr(manager, method)(getattr(io, record)(**fields), None)
            runners = io.BeginWeightUpdateReqInput(selector=fields.get("selector", "all"))
            opened = await manager.begin_weight_update(runners, None)
            if not _succeeded(opened)[0]:
                return opened
            try:
                outcome = await getattr(manager, method)(getattr(io, record)(**fields), None)
            finally:
                closed = await manager.end_weight_update(io.EndWeightUpdateReqInput(), None)
            return outcome if not _succeeded(outcome)[0] or _succeeded(closed)[0] else closed  # the first failure

        ok, message = _succeeded(self._loop.call(on_loop()))
        if not ok:
            raise WeightsError(message, code="weights_rejected")

    def update_weights(self, path: str, version: str | None = None) -> str:
        self._weights(
            "update_weights_from_disk", "UpdateWeightFromDiskReqInput", model_path=path, weight_version=version
        )
        self.weight_version = version or self.weight_version
        return self.weight_version

    def update_weights_from_tensor(
        self, named_tensors: Sequence[tuple[str, torch.Tensor]], version: str | None = None
    ) -> str:
        """SGLang's in-process tensor update (a trainer in the same process): the tensors serialised per
        tensor-parallel rank by the Engine's own helper, then loaded between two decode steps."""
        names = self._checkpoint_names([name for name, _ in named_tensors])
        named = [(name, tensor) for name, (_, tensor) in zip(names, named_tensors, strict=True)]
        serialized = self._loop.run(self.engine._serialize_tensors_per_rank, named, None)
        self._weights(
            "update_weights_from_tensor",
            "UpdateWeightsFromTensorReqInput",
            session=True,
            serialized_named_tensors=serialized,
            weight_version=version,
        )
        self.weight_version = version or self.weight_version
        return self.weight_version

    def init_weights_update_group(self, *, checkpoint_layout: bool = False, **group: Unpack[WeightsGroupArgs]) -> None:
        """Join the trainer's broadcast group. Refused by name for an engine with pp_size or dp_size over 1:
        sglang 0.5.23 ranks each scheduler in the group as ``rank_offset + tp_rank`` (pipeline stages would
        share ranks) and asserts one data-parallel replica for the broadcast update.

        ``checkpoint_layout``: the trainer sends the tensors as the model folder's files hold them, which is
        what SGLang's loaders read (a MoE model's experts too); each update is then checked against the files
        (`_check_stored`) and goes to SGLang as it comes. Without it the tensors are the module's: renamed here
        (`_checkpoint_names`), and a model whose module holds tensors its files do not (MoE experts) is refused
        before the group forms."""
        split = {name: size for name, size in self._parallel.items() if size > 1}
        if split:
            sizes = ", ".join(f"{name} {size}" for name, size in split.items())
            raise WeightsError(
                f"weights by broadcast need pp_size 1 and dp_size 1 on this SGLang (this engine has {sizes}: its "
                "group ranks are rank_offset + tp_rank); publish from disk instead (weir train --weights disk)",
                code="weights_rejected",
            )
        if checkpoint_layout and self._drafted:
            raise WeightsError(
                "weights by broadcast in the checkpoint's layout need an engine without a draft model (its "
                "speculative_algorithm): a refused update is drained into the draft's loader; publish from disk",
                code="weights_rejected",
            )
        if not checkpoint_layout and (converted := self._converted()):
            raise WeightsError(
                f"weights by broadcast would send {len(converted)} tensors as transformers holds them (e.g. "
                f"{min(converted)}), which the checkpoint SGLang loaded stores as other tensors or in another "
                "shape (a MoE model's experts), which SGLang's loader cannot take: send them as the model's "
                "files hold them (checkpoint_layout: true; Weir's trainers do) or publish from disk "
                "(weir train --weights disk)",
                code="weights_rejected",
            )
        self._weights("init_weights_update_group", "InitWeightsUpdateGroupReqInput", **group)
        with self._lock:  # a name joined again is in the layout said now
            if checkpoint_layout:
                self._in_checkpoint_layout.add(group["group_name"])
            else:
                self._in_checkpoint_layout.discard(group["group_name"])

    def update_weights_from_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], *, group_name: str, version: str | None
    ) -> str:
        # Nothing SGLang could receive (no drain possible): lists that do not pair up, a dtype torch does not name.
        check_lengths(names, dtypes, shapes)
        unknown = [d for d in dtypes if not isinstance(getattr(torch, d, None), torch.dtype)]
        if unknown:
            raise WeightsError(f"dtype {unknown[0][:32]!r} is not a torch dtype", code="weights_mismatch")
        if group_name in self._in_checkpoint_layout:
            try:
                self._check_stored(names, shapes)
            except WeightsError as refused:
                self._drain(names, dtypes, shapes, group_name, refused)
                raise
        else:
            names = self._checkpoint_names(names)
        self._receive(names, dtypes, shapes, group_name, weight_version=version)
        self.weight_version = version or self.weight_version
        return self.weight_version

    def _receive(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str, **fields: Any
    ) -> None:
        """SGLang's ``update_weights_from_distributed`` in a session of its own: the broadcast received, then loaded
        into the models ``fields``' ``selector`` picks."""
        self._weights(
            "update_weights_from_distributed",
            "UpdateWeightsFromDistributedReqInput",
            session=True,
            names=names,
            dtypes=dtypes,
            shapes=shapes,
            group_name=group_name,
            **fields,
        )

    def _checkpoint_names(self, names: list[str]) -> list[str]:
        """Weights named as a trainer's model names them (transformers' module), renamed as the checkpoint SGLang
        loaded names them (`encoders.architectures.checkpoint_names`): SGLang's loader knows only those, and a
        name it does not know stops its scheduler (Qwen2.5-VL's ``model.visual.*``, measured: a KeyError, the
        engine gone). A folder of no family Weir loads keeps its names."""
        if self._renames is None:
            from encoders.architectures import checkpoint_names

            try:
                self._renames = checkpoint_names(self.model_dir)
            except ValueError:  # not a family Weir loads: the names as they come
                self._renames = {}
        return [self._renames.get(name, name) for name in names]

    def _converted(self) -> frozenset[str]:
        """The trainer's names no tensor of SGLang's checkpoint answers to (`encoders.architectures.converted_names`):
        refused before a broadcast group forms, since a name SGLang's loader does not know stops its scheduler."""
        if self._unloadable is None:
            from encoders.architectures import converted_names

            try:
                self._unloadable = converted_names(self.model_dir)
            except ValueError:  # not a family Weir loads: nothing known to convert
                self._unloadable = frozenset()
        return self._unloadable

    def _check_stored(self, names: list[str], shapes: list[list[int]]) -> None:
        """Tensors said to be laid out as the model's files hold them must be tensors of those files, in their
        shapes: depending on the model, SGLang's loader skips a name it does not know without a word (Qwen3-MoE's,
        Qwen3-VL-MoE's: the update half done) or stops its scheduler on it, and copies one in another shape into a
        parameter it does not fit. `WeightsError` ``weights_mismatch`` before SGLang loads anything."""
        if self._stored is None:
            from encoders.architectures import stored_shapes

            self._stored = stored_shapes(self.model_dir)
        wrong = [
            f"{name} {tuple(shape)}"
            for name, shape in zip(names, shapes, strict=True)
            if self._stored.get(name) != tuple(shape)
        ]
        if wrong:
            raise WeightsError(
                f"{len(wrong)} tensors are not tensors of the model's files in their shapes (e.g. {wrong[0]}): "
                "SGLang's loader would skip them or stop on them; nothing of the update loaded",
                code="weights_mismatch",
            )

    def _drain(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str, refused: WeightsError
    ) -> None:
        """Receive a refused update's tensors and load none: the trainer broadcasts them whatever the answer, and
        a broadcast nobody receives holds the trainer until the group's timeout. SGLang receives them for its
        target model and loads them into the runners ``selector`` picks (its session's too: those it restores
        before and finalizes after): ``draft`` picks none on an engine without a draft model
        (`init_weights_update_group` refuses one). No version, no cache flush. A drain SGLang refuses (the group
        unknown to it, a session left open) is said in ``refused``, whose reason stays the first."""
        try:
            self._receive(names, dtypes, shapes, group_name, flush_cache=False, selector="draft")
        except WeightsError as error:
            refused.args = (f"{refused}; and its broadcast could not be drained: {error}",)

    def destroy_weights_update_group(self, group_name: str) -> None:
        try:
            self._weights("destroy_weights_update_group", "DestroyWeightsUpdateGroupReqInput", group_name=group_name)
        finally:  # SGLang forgets the name before it destroys the group: gone here too, whatever its answer
            with self._lock:
                self._in_checkpoint_layout.discard(group_name)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._loop.run(self.engine.shutdown)
        finally:
            self._loop.stop()


def _succeeded(outcome: Any) -> tuple[bool, str]:
    """``(success, message)`` of a tokenizer manager's answer to a control call: a tuple led by them (weight
    updates), or a record with ``success`` (flush)."""
    if isinstance(outcome, tuple):
        return bool(outcome[0]), str(outcome[1])
    return bool(getattr(outcome, "success", outcome)), str(getattr(outcome, "message", ""))
