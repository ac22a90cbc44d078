"""The one exception tree of the engines library.

Every error the caller caused is an `EngineError` with a stable ``code`` that the engine role
maps to a 4xx JSON body (the codes are those SGLang-compatible clients of Weir already see).
Errors that are the engine's own fault (a failed forward, a dead scheduler thread) are never
`EngineError`: they reach the caller as a 500.

    EngineError                 code
    ├── InvalidSampling         unknown_sampling_param      a key SGLang does not have (a typo)
    │                           unsupported_sampling_param  an SGLang key this engine does not implement
    │                           bad_sampling_params         a value of the wrong type or out of range
    ├── InvalidEnginePrompt     invalid_prompt              empty, out-of-vocabulary ids, longer than the context
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

from wire.errors import WeirError

__all__ = [
    "EngineError",
    "InvalidMedia",
    "InvalidEnginePrompt",
    "InvalidSampling",
    "MediaNotFound",
    "WeightsError",
]


class EngineError(WeirError, ValueError):
    """Base of every bad-input error of the engines library; ``item`` is the index of the media reference
    (or batch item) at fault, ``field`` the request field (``sampling_params.min_p``,
    ``custom_params.return_top_p_token_ids``), when there is one."""


class InvalidSampling(EngineError):
    code = "bad_sampling_params"


class InvalidEnginePrompt(EngineError):
    code = "invalid_prompt"


class InvalidMedia(EngineError):
    code = "invalid_media"


class MediaNotFound(EngineError):
    code = "features_not_found"


class WeightsError(EngineError):
    code = "weights_not_found"
