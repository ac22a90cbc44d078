"""The experience library's one exception tree; each error carries a stable ``code``.

::

    ExperienceError                 base of everything this package raises on purpose
    ├── InvalidRequest              invalid_request: an argument out of range (rank ≥ world_size, …); a ValueError
    │   └── InvalidGroup            invalid_request: a group the micro-batch schema cannot hold (a token id
    │                               over int32, a reward over float32); ``item`` is its index in the call
    ├── UnknownBatch                not_found: no micro-batch was ever delivered under that id
    ├── LeaseExpired                lease_expired: acknowledged after its lease, and its samples went out again
    ├── PolicyRegression            policy_regression: a policy version lower than the one already announced
    ├── FeatureMissing              feature_missing: a micro-batch's media is no longer in the feature cache
    └── StoreNotWritable            not_writable: the store's database or directory refuses writes

Records that fail their own invariants raise pydantic's ``ValidationError`` when built (see
`experience.records`), never one of these. The data role maps each class to an HTTP status; this
module knows nothing of HTTP.
"""

from __future__ import annotations

from wire.errors import WeirError

__all__ = [
    "ExperienceError",
    "FeatureMissing",
    "InvalidGroup",
    "InvalidRequest",
    "LeaseExpired",
    "PolicyRegression",
    "StoreNotWritable",
    "UnknownBatch",
]


class ExperienceError(WeirError):
    """Base of the experience library's errors."""

    code = "experience_error"


class InvalidRequest(ExperienceError, ValueError):
    """An argument the store cannot act on."""

    code = "invalid_request"


class InvalidGroup(InvalidRequest):
    """A valid `Group` whose values do not fit the micro-batch schema; ``item``: its index in the call."""

    def __init__(self, message: str, *, group_id: str, item: int | None = None) -> None:
        super().__init__(f"group {group_id}: {message}")
        self.group_id, self.item = group_id, item


class _BatchRefused(ExperienceError):
    """An acknowledgement (or a lookup) of micro-batch ``batch_id`` refused; ``says`` is the message."""

    says = "micro-batch {batch_id}"

    def __init__(self, batch_id: str) -> None:
        super().__init__(self.says.format(batch_id=batch_id))
        self.batch_id = batch_id


class UnknownBatch(_BatchRefused):
    """No delivery has that batch id."""

    code = "not_found"
    says = "no micro-batch {batch_id}"


class LeaseExpired(_BatchRefused):
    """The batch's lease ran out and its samples were delivered (or trained) again: this ack is refused."""

    code = "lease_expired"
    says = "the lease of micro-batch {batch_id} expired and its samples were delivered again"


class PolicyRegression(ExperienceError):
    """A policy version lower than the current one was announced: versions only go up (announcing the
    current one again is not an error). Rewinding would make stale samples look fresh."""

    code = "policy_regression"

    def __init__(self, version: int, current: int) -> None:
        super().__init__(f"policy version {version} is lower than the current policy version {current}")
        self.version, self.current = version, current


class FeatureMissing(ExperienceError):
    """A feature key a micro-batch names is not in the feature cache (evicted, or never there)."""

    code = "feature_missing"

    def __init__(self, key: str) -> None:
        super().__init__(f"feature {key} is no longer in the cache")
        self.key = key


class StoreNotWritable(ExperienceError):
    """The store cannot write now (read-only or missing directory, a full disk, a locked database)."""

    code = "not_writable"
