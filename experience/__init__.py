"""The experience library: typed rollout records and the durable store behind the data role; the data role's
wire records and its client (`api`, `client`: imported by name, never from here).

::

    records.py      Sample, Group, SampleStatus, PolicyVersion, MICROBATCH_SCHEMA: the contract
    advantages.py   GRPO / Dr. GRPO advantages and DAPO's uniform-group filter, computed only here
    microbatch.py   a group's rows in MICROBATCH_SCHEMA, MicroBatch, the IPC bytes, media inline
    packing.py      cutting token-budgeted shares balanced across ranks (pure)
    ledger.py       deliveries, leases, acks, release, expiry: exactly-once acknowledgement
    staleness.py    the policy version, the staleness filter (drop / regenerate), admission
    index.py        the SQLite index: durable opening, transactions (synced or not), counters
    journal.py      the groups' durable copy: append-only segments of checked records, one fsync each
    changes.py      Changes: the store's change counter, whose waiters (the long poll) it wakes
    store.py        ExperienceStore, the facade over one index and the Arrow entries; DataConfig
    errors.py       the exception tree (ExperienceError and its codes)
    wire.py         JSON on the roles' hot paths through orjson
    api.py          the data role's wire records (what its routes take and answer)
    client.py       DataClient / AsyncDataClient: the data role's routes, one typed method each
"""

from __future__ import annotations

from .advantages import AdvantageEstimator, drop_uniform_groups, group_advantages, has_signal
from .changes import Changes
from .errors import (
    ExperienceError,
    FeatureMissing,
    InvalidGroup,
    InvalidRequest,
    LeaseExpired,
    PolicyRegression,
    StoreNotWritable,
    UnknownBatch,
)
from .microbatch import MicroBatch, group_of, microbatch_to_arrow, with_media
from .records import (
    GROUP_ADAPTER,
    MICROBATCH_SCHEMA,
    Group,
    PolicyVersion,
    Sample,
    SampleStatus,
    policy_version_of,
    sample_id,
)
from .store import DataConfig, ExperienceStats, ExperienceStore, StalenessPolicy

__all__ = [
    "GROUP_ADAPTER",
    "MICROBATCH_SCHEMA",
    "AdvantageEstimator",
    "Changes",
    "DataConfig",
    "ExperienceError",
    "ExperienceStats",
    "ExperienceStore",
    "FeatureMissing",
    "Group",
    "InvalidGroup",
    "InvalidRequest",
    "LeaseExpired",
    "MicroBatch",
    "PolicyRegression",
    "PolicyVersion",
    "Sample",
    "SampleStatus",
    "StalenessPolicy",
    "StoreNotWritable",
    "UnknownBatch",
    "drop_uniform_groups",
    "group_advantages",
    "group_of",
    "has_signal",
    "microbatch_to_arrow",
    "policy_version_of",
    "sample_id",
    "with_media",
]
