"""The one exception tree of the engines library.

Every error the caller caused is an `EngineError` with a stable ``code`` that the engine role
maps to a 4xx JSON body (the codes are those SGLang-compatible clients of Weir already see).
Errors that are the engine's own fault (a failed forward, a dead scheduler thread) are never
`EngineError`: they reach the caller as a 500.

    EngineError                 code
    ├── InvalidSampling         unknown_sampling_param      a key SGLang does not have (a typo)
    │                           unsupported_sampling_param  an SGLang key this engine does not implement
    │                           bad_sampling_params         a value of the wrong type or out of range
    ├── InvalidPrompt           invalid_prompt              empty, out-of-vocabulary ids, longer than the context
    ├── InvalidMedia            invalid_media               a reference naming neither or both keys, a kind
    │                                                       mismatch, placeholders that do not fit the media
    ├── MediaNotFound           features_not_found          no such key in the feature cache
    │                           embedding_not_found         no such key in the encoder's embedding cache
    └── WeightsError            weights_not_found           no safetensors files at the path
                                weights_mismatch            tensors the model does not have, or of another shape
                                weights_rejected            the backend refused them (SGLang's message)

`EngineError` is a `ValueError`, as `preprocess.MediaError` is: bad input, with a code.
"""

from __future__ import annotations

__all__ = [
    "EngineError",
    "InvalidMedia",
    "InvalidPrompt",
    "InvalidSampling",
    "MediaNotFound",
    "WeightsError",
]


class EngineError(ValueError):
    """Base of every bad-input error of the engines library; ``code`` is stable and machine-readable.

    ``item`` is the index of the media reference (or batch item) at fault, when there is one; ``field``
    names the request field at fault (``sampling_params.min_p``, ``custom_params.return_top_p_token_ids``)
    when one is."""

    code = "invalid_request"

    def __init__(
        self, message: str, *, code: str | None = None, item: int | None = None, field: str | None = None
    ) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        self.item = item
        self.field = field

    @property
    def message(self) -> str:
        return str(self)


class InvalidSampling(EngineError):
    code = "bad_sampling_params"


class InvalidPrompt(EngineError):
    code = "invalid_prompt"


class InvalidMedia(EngineError):
    code = "invalid_media"


class MediaNotFound(EngineError):
    code = "features_not_found"


class WeightsError(EngineError):
    code = "weights_not_found"
