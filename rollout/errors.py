"""The one exception tree of the rollout library.

Every error a caller can cause or a neighbour role can cause is a :class:`RolloutError` with a stable
``code``; the rollout role maps each class to a status (most specific class wins). A failure of one
*sample* (an engine that never answered, a reward that raised) is not an exception at all: it is
carried as data, a `experience.Sample` with status ``failed``.

    RolloutError                     code
    ├── InvalidPrompt                invalid_messages, unknown_part_type,     400  the request is wrong
    │   │                            max_tokens_beyond_context, n_out_of_range
    │   └── WorkTooLarge             work_too_large                           413  over the in-flight bound alone
    ├── UnknownReward                unknown_reward_function                  400  not a registered reward
    ├── MediaRefused                 the preprocess role's code (or           its status (5xx → 502)
    │                                preprocess_failed: an unreadable answer)
    ├── EngineRefused                the engine's code                        400  an engine called it bad input
    ├── Overloaded                   overloaded                               429  retry shortly (Retry-After)
    ├── EnginesUnavailable           engines_unavailable                      503  no engine could generate
    ├── UpstreamUnavailable          preprocess_unavailable, data_unavailable 503  a role did not answer
    ├── UpstreamUnauthorized         upstream_unauthorized                    502  a role refused this role's token
    └── ExperienceRefused            experience_refused                       502  the data role refused a group

A 401/403 from a role this one calls (preprocess, encoder, engine, data) is never passed on as it
came: the caller's own credentials were fine, this role's token was not; it is `UpstreamUnauthorized`
(naming the role), not a ``media_refused``, an ``engine_refused`` or a failed sample
(`wire.client` tells them apart: a 403 that names a reason of the request's own, as the preprocess role's
``path_not_allowed`` does, stays the request's refusal).

Errors that are this library's own fault are never ``RolloutError``.
"""

from __future__ import annotations

from wire.errors import WeirError

__all__ = [
    "EngineRefused",
    "EnginesUnavailable",
    "ExperienceRefused",
    "InvalidPrompt",
    "MediaRefused",
    "Overloaded",
    "RolloutError",
    "UnknownReward",
    "UpstreamUnauthorized",
    "UpstreamUnavailable",
    "WorkTooLarge",
]


class RolloutError(WeirError):
    """Base of the tree; ``code`` is stable and machine-readable."""

    code = "rollout_error"


class InvalidPrompt(RolloutError):
    """A prompt (messages, n, max tokens) that cannot be rolled out as given; ``code`` says why."""

    code = "invalid_messages"


class WorkTooLarge(InvalidPrompt):
    """One request alone is over the in-flight bound: retrying cannot help, a smaller request can."""

    code = "work_too_large"


class UnknownReward(RolloutError):
    """The request names a reward function that was not registered when the role started."""

    code = "unknown_reward_function"

    def __init__(self, message: str, *, registered: list[str]) -> None:
        super().__init__(message)
        self.registered = registered


class MediaRefused(RolloutError):
    """The preprocess role refused a media item: its ``status``, ``code`` and item index are kept."""

    code = "media_refused"

    def __init__(self, message: str, *, status: int, code: str | None = None, item: int | None = None) -> None:
        super().__init__(message, code=code)
        self.status, self.item = status, item


class EngineRefused(RolloutError):
    """An engine answered 4xx: the request is bad for it (retrying elsewhere would not help)."""

    code = "engine_refused"


class Overloaded(RolloutError):
    """Too much multimodal work is in flight; ``retry_after_s`` is a hint for the caller."""

    code = "overloaded"

    def __init__(self, message: str, *, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EnginesUnavailable(RolloutError):
    """No engine could generate (every one tried failed, timed out or is cooling down)."""

    code = "engines_unavailable"


class UpstreamUnavailable(RolloutError):
    """A role this one calls (preprocess, data) did not answer; ``code`` names which."""

    code = "upstream_unavailable"


class ExperienceRefused(RolloutError):
    """The data role answered 4xx to a finished group: the group is not stored."""

    code = "experience_refused"


class UpstreamUnauthorized(RolloutError):
    """A role this one calls answered 401/403: it refuses *this role's* API token (a configuration
    error of the stack, not of the caller's request). ``role`` names it; ``status`` is its answer."""

    code = "upstream_unauthorized"

    def __init__(self, role: str, status: int, *, detail: str = "") -> None:
        at = f" ({detail})" if detail else ""
        super().__init__(f"the {role} role refused the rollout role's API token (HTTP {status}){at}")
        self.role, self.status = role, status
