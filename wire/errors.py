"""The one error base of the project: a caller's mistake, with a stable, machine-readable ``code``.

Each library keeps its own tree below it (`preprocess.MediaError`, `engines.EngineError`,
`rollout.RolloutError`, `experience.ExperienceError`, `encoders.EncoderError`) and each role maps its tree to
4xx statuses; errors that are a library's own fault are never a `WeirError` (they reach a caller as a 500).
The trees that are bad input (`MediaError`, `EngineError`, `EncoderError`) are `ValueError`s too; the others
keep to `Exception`, so no ``except ValueError`` elsewhere catches them by accident.
"""

from __future__ import annotations

__all__ = ["WeirError"]


class WeirError(Exception):
    """A caller's mistake: ``code`` is stable; ``item`` the index of the item at fault (a media item, a batch item) and
    ``field`` the request field at fault (``sampling_params.min_p``), when there is one."""

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
