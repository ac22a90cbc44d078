"""Experiment trackers fed from the step records `weir train` writes to ``metrics.jsonl``
(`trainer.step_record.StepRecord.as_dict`): W&B, TensorBoard and MLflow, each writing under the run's folder
(``RUN/wandb``, ``RUN/tensorboard``, ``RUN/mlruns``), chosen by a ``--report-to`` value (`parse_report_to`).
Also `eta`, the "step 3/10, ETA 1m 05s" text of a progress line.

A record's numeric fields (nested dicts flattened to ``mismatch/image/kl``) are logged at its ``step``; None,
booleans, strings and non-finite numbers are not. The run's config is logged once, as its hyper-parameters.

Nothing here contacts the network: W&B runs offline (``wandb sync RUN/wandb/offline-run-*`` uploads later),
MLflow logs to a file store with its usage telemetry off. The environment variables that arrange this are set
only while a tracker call runs, and the environment is put back as it was after each call, including what
the trackers' own code added there (wandb's ``WANDB_SERVICE``); another thread that changes the environment
during one of those calls loses its change.

Not here: printing progress lines (`launcher.training` does), deciding when to log, reading
``metrics.jsonl`` back, serving the results (``tensorboard --logdir``, ``mlflow ui``; the MLflow file store
needs ``MLFLOW_ALLOW_FILE_STORE=true`` there, since MLflow 3 keeps it only as an opt-in).
"""

from __future__ import annotations

import contextlib
import logging
import math
import numbers
import os
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from types import TracebackType

__all__ = ["REPORTERS", "Trackers", "eta", "hyperparameters", "parse_report_to", "scalars"]

logger = logging.getLogger(__name__)

REPORTERS = ("wandb", "tensorboard", "mlflow")
_INSTALL = "pip install 'weir[trackers]'"

# Set while a tracker call runs (`_offline`): the trackers read these at the call, not at import.
_OFFLINE_ENV = {
    "WANDB_MODE": "offline",
    "WANDB_ERROR_REPORTING": "false",  # wandb-core starts with --no-observability: no error reports sent
    "MLFLOW_DISABLE_TELEMETRY": "true",  # MLflow sends usage events to its servers otherwise
    "MLFLOW_ALLOW_FILE_STORE": "true",  # MLflow 3 refuses a file store without this opt-in
}

HyperParameter = str | int | float | bool


def parse_report_to(text: str) -> list[str]:
    """The trackers a ``--report-to`` value names ("wandb,tensorboard"); "none" or "" names none."""
    names = [name.strip().lower() for name in text.split(",") if name.strip()]
    if names == ["none"]:
        return []
    for name in names:
        if name not in REPORTERS:
            raise ValueError(f"unknown tracker {name!r} in --report-to: choose from {', '.join(REPORTERS)} or none")
    return list(dict.fromkeys(names))  # each tracker once, in the order given


def _flatten(mapping: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in mapping.items():
        if isinstance(value, Mapping):
            out.update(_flatten(value, f"{prefix}{key}/"))
        else:
            out[f"{prefix}{key}"] = value
    return out


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The fields of a step record that a tracker plots: finite numbers (not booleans), nested dicts flattened
    with "/"; ``step`` is the x-axis, not a field."""
    return {
        name: float(value)
        for name, value in _flatten(record).items()
        if name != "step"
        and isinstance(value, numbers.Real)
        and not isinstance(value, bool)
        and math.isfinite(float(value))
    }


def hyperparameters(config: Mapping[str, Any]) -> dict[str, HyperParameter]:
    """A run's config as all three trackers take it: flat ("/"), plain values kept, the rest (paths, None,
    lists) as text."""
    return {
        name: value if isinstance(value, str | int | float | bool) else str(value)
        for name, value in _flatten(config).items()
    }


def _duration(seconds: float) -> str:
    rounded = round(seconds)
    hours, rest = divmod(rounded, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h {minutes:02d}m"
    if minutes:
        return f"{minutes}m {secs:02d}s"
    return f"{secs}s"


def eta(step: int, total: int, elapsed_s: float, *, resumed_at: int = 0) -> str:
    """The text "step 3/10, ETA 1m 05s": the steps left times the mean time of the ``step - resumed_at`` steps done in
    ``elapsed_s`` (``resumed_at``: the checkpoint's step when the clock started on a resumed run).
    "ETA -" before any step is done; with no ``total`` (0), only the step."""
    if total <= 0:
        return f"step {step}"
    done = step - resumed_at
    if done <= 0:
        return f"step {step}/{total}, ETA -"
    left = max(0, total - step)
    return f"step {step}/{total}, ETA {_duration(left * elapsed_s / done)}"


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """`_OFFLINE_ENV` for the duration; afterwards the environment exactly as before."""
    before = dict(os.environ)
    os.environ.update(_OFFLINE_ENV)
    try:
        yield
    finally:
        for key in set(os.environ) - set(before):
            del os.environ[key]
        for key, value in before.items():
            if os.environ.get(key) != value:
                os.environ[key] = value


def _missing(name: str, package: str) -> ImportError:
    return ImportError(f"--report-to {name} needs the {package} package: {_INSTALL}")


class _Tracker(Protocol):
    def log(self, step: int, values: Mapping[str, float]) -> None: ...

    def close(self, *, failed: bool) -> None: ...


class _Wandb:
    """An offline W&B run in ``RUN/wandb/offline-run-*`` (``run-ID.wandb``: its records)."""

    def __init__(self, run_dir: Path, run_name: str, params: dict[str, HyperParameter]) -> None:
        try:
            import wandb
        except ImportError as error:
            raise _missing("wandb", "wandb") from error
        settings = wandb.Settings(
            mode="offline",
            silent=True,  # the progress lines stay the only output
            console="off",  # no capture of stdout/stderr: the console belongs to the launcher
            disable_git=True,
            save_code=False,
            x_disable_stats=True,  # the step records only: no system-metrics sampler process
            x_save_requirements=False,
        )
        self.run = wandb.init(
            project="weir", name=run_name, dir=run_dir, config=params, settings=settings, reinit="create_new"
        )

    def log(self, step: int, values: Mapping[str, float]) -> None:
        self.run.log(dict(values), step=step)

    def close(self, *, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class _TensorBoard:
    """Event files in ``RUN/tensorboard``; the config as the HParams plugin's session."""

    def __init__(self, run_dir: Path, run_name: str, params: dict[str, HyperParameter]) -> None:
        try:
            import tensorboard  # noqa: F401  (torch's writer needs it, and says so less clearly)
            from torch.utils.tensorboard import SummaryWriter
            from torch.utils.tensorboard.summary import hparams
        except ImportError as error:
            raise _missing("tensorboard", "tensorboard") from error
        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        # `SummaryWriter.add_hparams` would write them to a sub-run of its own: these go with the scalars.
        writer = self.writer.file_writer
        assert writer is not None  # made by SummaryWriter's constructor
        for summary in hparams(dict(params), {}):
            writer.add_summary(summary)

    def log(self, step: int, values: Mapping[str, float]) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, global_step=step)

    def close(self, *, failed: bool) -> None:
        self.writer.close()


class _MLflow:
    """A run of experiment "weir" in the file store ``RUN/mlruns``, through the client (no global active run)."""

    def __init__(self, run_dir: Path, run_name: str, params: dict[str, HyperParameter]) -> None:
        try:
            from mlflow.entities import Param
            from mlflow.tracking import MlflowClient
            from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH
        except ImportError as error:
            raise _missing("mlflow", "mlflow-skinny") from error
        store = run_dir / "mlruns"
        store.mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(tracking_uri=store.resolve().as_uri())
        experiment = self.client.get_experiment_by_name("weir")
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment("weir")
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        logged = [Param(name, str(value)[:MAX_PARAM_VAL_LENGTH]) for name, value in params.items()]
        for start in range(0, len(logged), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, params=logged[start : start + MAX_PARAMS_TAGS_PER_BATCH])

    def log(self, step: int, values: Mapping[str, float]) -> None:
        from mlflow.entities import Metric
        from mlflow.utils.validation import MAX_METRICS_PER_BATCH

        now = int(time.time() * 1000)
        metrics = [Metric(_MLFLOW_UNSAFE.sub("_", name), value, now, step) for name, value in values.items()]
        for start in range(0, len(metrics), MAX_METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[start : start + MAX_METRICS_PER_BATCH])

    def close(self, *, failed: bool) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


# MLflow refuses metric names outside alphanumerics and ``_-. :/`` (``eval/pass@1`` becomes ``eval/pass_1``).
_MLFLOW_UNSAFE = re.compile(r"[^A-Za-z0-9_\-. :/]")

_OPENERS: dict[str, Callable[[Path, str, dict[str, HyperParameter]], _Tracker]] = {
    "wandb": _Wandb,
    "tensorboard": _TensorBoard,
    "mlflow": _MLflow,
}


class Trackers:
    """The run's open trackers (maybe none): `log` each step record, `close` once (or use ``with``)."""

    def __init__(self, trackers: Sequence[_Tracker]) -> None:
        self._trackers = list(trackers)

    @classmethod
    def open(cls, names: Sequence[str], *, run_dir: Path, run_name: str, config: Mapping[str, Any]) -> Trackers:
        """A run named ``run_name`` in each of ``names`` (`REPORTERS`), under ``run_dir``, with ``config`` as
        its hyper-parameters. A missing package raises ImportError naming the extra to install; the trackers
        opened before it are closed."""
        unknown = [name for name in names if name not in _OPENERS]
        if unknown:
            raise ValueError(f"unknown tracker {unknown[0]!r}: choose from {', '.join(REPORTERS)}")
        params = hyperparameters(config)
        opened: list[_Tracker] = []
        try:
            with _offline():
                for name in names:
                    opened.append(_OPENERS[name](run_dir, run_name, params))
        except BaseException:
            Trackers(opened).close(failed=True)
            raise
        if opened:
            logger.info("tracking %s under %s", ", ".join(names), run_dir)
        return cls(opened)

    def log(self, record: Mapping[str, Any]) -> None:
        """``record``'s numeric fields (`scalars`) at its ``step``."""
        if not self._trackers:
            return
        values, step = scalars(record), int(record["step"])
        with _offline():
            for tracker in self._trackers:
                tracker.log(step, values)

    def close(self, *, failed: bool = False) -> None:
        """Finish every run (``failed``: marked so where the tracker has a status); each is closed even when
        another fails to, and the first error is raised after."""
        trackers, self._trackers = self._trackers, []
        errors: list[BaseException] = []
        with _offline():
            for tracker in trackers:
                try:
                    tracker.close(failed=failed)
                except Exception as error:  # noqa: BLE001 (raised below, once the others are closed)
                    errors.append(error)
        if errors:
            raise errors[0]

    def __enter__(self) -> Trackers:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close(failed=error is not None)
