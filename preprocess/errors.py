"""The one exception tree of the preprocess library.

Every bad-input error is a :class:`MediaError` with a stable ``code`` that services map to a
4xx JSON body. Errors that are the library's own fault are never ``MediaError``.

    MediaError                      code
    ├── EmptyMediaError             empty_media          zero bytes
    ├── UnsupportedMediaError       unsupported_media    no decoder recognises the bytes
    ├── CorruptMediaError           corrupt_media        recognised but truncated / undecodable
    ├── MissingStreamError          no_video_stream / no_audio_stream
    ├── AspectRatioError            aspect_ratio         max(h, w) / min(h, w) > 200
    ├── DecompressionBombError      decompression_bomb   header declares too many pixels
    ├── MediaTooLargeError          media_too_large      more bytes than allowed
    ├── BudgetExceededError         over_budget          over a token budget with policy "refuse"
    └── DatasetError                invalid_dataset      a dataset row (or the dataset) Weir cannot read, by
                                    media_not_found / marker_mismatch / unsupported_media_value /
                                    unsupported_reward / invalid_row / url_not_supported; a row that cannot be
                                    read: invalid_utf8 / invalid_json / invalid_row / invalid_csv_row /
                                    invalid_csv; the dataset itself: dataset_not_found / unknown_file_type /
                                    unknown_split / invalid_dataset_card / multiple_configs (`preprocess.reading`)
"""

from __future__ import annotations

from wire.errors import WeirError

__all__ = [
    "AspectRatioError",
    "BudgetExceededError",
    "CorruptMediaError",
    "DatasetError",
    "DecompressionBombError",
    "EmptyMediaError",
    "MediaError",
    "MediaTooLargeError",
    "MissingStreamError",
    "UnsupportedMediaError",
]


class MediaError(WeirError, ValueError):
    """Base of every bad-input error; ``code`` is stable and machine-readable."""

    code = "media_error"


class EmptyMediaError(MediaError):
    code = "empty_media"


class UnsupportedMediaError(MediaError):
    code = "unsupported_media"


class CorruptMediaError(MediaError):
    code = "corrupt_media"


class MissingStreamError(MediaError):
    """A container without the stream asked for (``no_video_stream`` or ``no_audio_stream``)."""

    code = "missing_stream"


class AspectRatioError(MediaError):
    code = "aspect_ratio"


class DecompressionBombError(MediaError):
    code = "decompression_bomb"


class MediaTooLargeError(MediaError):
    code = "media_too_large"


class BudgetExceededError(MediaError):
    code = "over_budget"


class DatasetError(MediaError):
    """A dataset, or one of its rows, in a shape Weir cannot read; ``code`` says which way (see the tree)."""

    code = "invalid_dataset"
