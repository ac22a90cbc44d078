"""Experiment trackers fed from the step records `weir train` writes to ``metrics.jsonl``
(`trainer.step_record.StepRecord.as_dict`): W&B, TensorBoard and MLflow, chosen by a ``--report-to`` value
(`parse_report_to`). Also `eta`, the "step 3/10, ETA 1m 05s" text of a progress line.

A record's numeric fields (nested dicts flattened to ``mismatch/image/kl``) are logged at its ``step``; None,
booleans, strings and non-finite numbers are not. The run's config (`launcher.run_config`: what ``config.json``
holds) is logged once: W&B's run config, MLflow's params plus ``config.json`` as an artifact, TensorBoard's
HParams session plus the JSON as the text ``config``.

Where each goes is each tool's own environment, read by the tool itself; Weir only fills what it leaves unset:

- W&B: whatever wandb resolves from its ``WANDB_*`` variables and settings files (``WANDB_MODE``,
  ``WANDB_PROJECT``, ``WANDB_ENTITY``, ``WANDB_DIR``, ``WANDB_NAME``, ``WANDB_BASE_URL``, ``WANDB_INIT_TIMEOUT``…).
  Left unset: project "weir", the run's name, the run's folder (``RUN/wandb``), quiet, no console capture, no
  code, git or system-metrics sampling; and mode offline (``wandb sync`` uploads later) unless ``WANDB_MODE`` or
  ``WANDB_API_KEY`` is set (a key with no mode: wandb's own default, online).
- MLflow: ``MLFLOW_TRACKING_URI`` (a server, a file store…) as MLflow reads it, else the file store
  ``RUN/mlruns``; the experiment ``MLFLOW_EXPERIMENT_NAME``, else ``MLFLOW_EXPERIMENT_ID``, else "weir".
- TensorBoard: ``TENSORBOARD_DIR`` (verl's name for it; TensorBoard and torch's writer read none), else
  ``RUN/tensorboard``.

What can be known before the run is checked before anything starts (`tracker_refusal`, run by
`launcher.checks.train_refusal`): the package, the settings (``WANDB_MODE``; online W&B needs a key; MLflow knows
the tracking URI's scheme), one cheap request to the server (W&B online, an MLflow http(s) server, a short
timeout). A run that still cannot start raises `services.settings.SettingsError` naming the variable:
``weir train`` says it in one line.
Usage telemetry and error reports stay off unless their own variables say otherwise
(``MLFLOW_DISABLE_TELEMETRY``, ``WANDB_ERROR_REPORTING``); MLflow's file store is allowed
(``MLFLOW_ALLOW_FILE_STORE``, an opt-in since MLflow 3). These defaults are set only while a tracker call runs,
and the environment is put back as it was after each call, including what the trackers' own code added there
(wandb's ``WANDB_SERVICE``); another thread that changes the environment during one of those calls loses its
change.

Not here: printing progress lines (`launcher.training` does), deciding when to log, reading
``metrics.jsonl`` back, serving the results (``tensorboard --logdir``, ``mlflow ui``; the MLflow file store
needs ``MLFLOW_ALLOW_FILE_STORE=true`` there).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import numbers
import os
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

from services.settings import SettingsError

if TYPE_CHECKING:
    from types import TracebackType

__all__ = [
    "REPORTERS",
    "Trackers",
    "config_json",
    "eta",
    "hyperparameters",
    "parse_report_to",
    "scalars",
    "tracker_refusal",
]

logger = logging.getLogger(__name__)

REPORTERS = ("wandb", "tensorboard", "mlflow")
_INSTALL = "pip install -e '.[trackers]'"

# Set while a tracker call runs (`_environment`), each only where the user's environment leaves it unset.
_DEFAULT_ENV = {
    "WANDB_ERROR_REPORTING": "false",  # wandb-core starts with --no-observability: no error reports sent
    "MLFLOW_DISABLE_TELEMETRY": "true",  # MLflow sends usage events to its servers otherwise
    "MLFLOW_ALLOW_FILE_STORE": "true",  # MLflow 3 refuses a file store without this opt-in
}
# W&B settings Weir chooses where wandb's own resolution (its variables, its settings files) leaves them unset:
# the progress lines stay the only output, the console is the launcher's, the step records are the only data.
_WANDB_DEFAULTS: dict[str, str | bool] = {
    "silent": True,
    "console": "off",
    "disable_git": True,
    "save_code": False,
    "x_disable_stats": True,  # no system-metrics sampler process
    "x_save_requirements": False,
}
TENSORBOARD_DIR = "TENSORBOARD_DIR"  # verl's variable for the event files' folder (and SageMaker examples')

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


def config_json(config: Mapping[str, object]) -> str:
    """A run's config as the text of ``config.json`` (paths as text), as the trackers store it too."""
    return json.dumps(config, indent=2, default=str) + "\n"


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
def _environment() -> Iterator[None]:
    """`_DEFAULT_ENV` where unset for the duration; afterwards the environment exactly as before."""
    before = dict(os.environ)
    for key, value in _DEFAULT_ENV.items():
        os.environ.setdefault(key, value)
    try:
        yield
    finally:
        for key in set(os.environ) - set(before):
            del os.environ[key]
        for key, value in before.items():
            if os.environ.get(key) != value:
                os.environ[key] = value


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


def _missing(name: str, package: str) -> ImportError:
    return ImportError(f"--report-to {name} needs the {package} package: {_INSTALL}")


@dataclass(frozen=True, slots=True, kw_only=True)
class _Run:
    """What each tracker is opened with: the run's folder and name, its config flat and as JSON text."""

    dir: Path
    name: str
    params: dict[str, HyperParameter]
    config_text: str


class _Tracker(Protocol):
    where: str  # where the run goes, as the log line says it

    def log(self, step: int, values: Mapping[str, float]) -> None: ...

    def close(self, *, failed: bool) -> None: ...


class _Wandb:
    """A W&B run: offline in ``RUN/wandb/offline-run-*`` (``run-ID.wandb``: its records) unless the user's
    environment says otherwise."""

    def __init__(self, run: _Run) -> None:
        try:
            import wandb
            from wandb.errors import Error
        except ImportError as error:
            raise _missing("wandb", "wandb") from error
        what = "a run"  # until wandb has read the user's settings
        try:
            resolved = wandb.setup().settings  # the user's WANDB_* variables and settings files, as wandb reads them
            chosen = resolved.model_fields_set
            defaults = {"project": "weir", "run_name": run.name, "root_dir": str(run.dir), **_WANDB_DEFAULTS}
            if not chosen & {"mode", "api_key"}:
                defaults["mode"] = "offline"
            # the user's mode, or with only a key wandb's own default (online), else Weir's (offline)
            what = f"its {defaults.get('mode', resolved.mode)} run"
            settings = wandb.Settings(**{key: value for key, value in defaults.items() if key not in chosen})
            self.run = wandb.init(config=run.params, settings=settings, reinit="create_new")
        except (Error, ValueError) as error:  # ValueError: a WANDB_* value wandb's settings refuse (pydantic's)
            raise SettingsError(
                f"--report-to wandb: W&B could not start {what} ({_wandb_source()}): {_one_line(error)} — "
                "WANDB_MODE=offline writes it to files instead (`wandb sync` uploads them later)"
            ) from error
        mode = self.run.settings.mode
        if mode == "disabled":
            self.where = "W&B disabled"
        elif mode == "offline":
            self.where = f"W&B offline: {self.run.settings.sync_dir}"
        else:
            self.where = f"W&B {mode}: {self.run.url}"

    def log(self, step: int, values: Mapping[str, float]) -> None:
        self.run.log(dict(values), step=step)

    def close(self, *, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


def _wandb_source() -> str:
    """Which of the user's variables chose W&B's mode, for an error message."""
    if "WANDB_MODE" in os.environ:
        return f"WANDB_MODE={os.environ['WANDB_MODE']}"
    return "WANDB_API_KEY set" if "WANDB_API_KEY" in os.environ else "no WANDB_MODE, no WANDB_API_KEY"


class _TensorBoard:
    """Event files in ``$TENSORBOARD_DIR``, else ``RUN/tensorboard``; the config as the HParams plugin's session
    and as the text ``config``."""

    def __init__(self, run: _Run) -> None:
        try:
            import tensorboard  # noqa: F401  (torch's writer needs it, and says so less clearly)
            from torch.utils.tensorboard import SummaryWriter
            from torch.utils.tensorboard.summary import hparams
        except ImportError as error:
            raise _missing("tensorboard", "tensorboard") from error
        log_dir = os.environ.get(TENSORBOARD_DIR) or str(run.dir / "tensorboard")
        self.writer = SummaryWriter(log_dir=log_dir)
        self.where = f"TensorBoard: {log_dir}"
        # `SummaryWriter.add_hparams` would write them to a sub-run of its own: these go with the scalars.
        writer = self.writer.file_writer
        assert writer is not None  # made by SummaryWriter's constructor
        for summary in hparams(dict(run.params), {}):
            writer.add_summary(summary)
        indented = "".join(f"    {line}" for line in run.config_text.splitlines(keepends=True))  # Markdown: code
        self.writer.add_text("config", indented, global_step=0)

    def log(self, step: int, values: Mapping[str, float]) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, global_step=step)

    def close(self, *, failed: bool) -> None:
        self.writer.close()


class _MLflow:
    """A run in MLflow's tracking store (``MLFLOW_TRACKING_URI``, else the file store ``RUN/mlruns``), through
    the client (no global active run): its params, ``config.json`` as an artifact, the metrics."""

    def __init__(self, run: _Run) -> None:
        try:
            from mlflow.entities import Param
            from mlflow.environment_variables import MLFLOW_EXPERIMENT_ID, MLFLOW_EXPERIMENT_NAME, MLFLOW_TRACKING_URI
            from mlflow.exceptions import MlflowException
            from mlflow.tracking import MlflowClient
            from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH
        except ImportError as error:
            raise _missing("mlflow", "mlflow-skinny") from error
        if MLFLOW_TRACKING_URI.defined:  # MLflow's own reading of it
            self.client = MlflowClient()
        else:
            store = run.dir / "mlruns"
            store.mkdir(parents=True, exist_ok=True)
            self.client = MlflowClient(tracking_uri=store.resolve().as_uri())
        given_id = MLFLOW_EXPERIMENT_ID.get()  # used when no name is given, as MLflow's own runs do
        name = MLFLOW_EXPERIMENT_NAME.get() or (None if given_id else "weir")
        try:
            if name is None:
                experiment_id = self.client.get_experiment(given_id).experiment_id
            else:
                experiment = self.client.get_experiment_by_name(name)
                experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
            self.run_id = self.client.create_run(experiment_id, run_name=run.name).info.run_id
        except MlflowException as error:
            uri = self.client.tracking_uri
            where = f"MLFLOW_TRACKING_URI={uri}" if MLFLOW_TRACKING_URI.defined else f"the file store {uri}"
            raise SettingsError(f"--report-to mlflow: {where}: {_one_line(error)}") from error
        self.where = f"MLflow: {self.client.tracking_uri}, experiment {name or given_id}, run {self.run_id}"
        logged = [Param(name, str(value)[:MAX_PARAM_VAL_LENGTH]) for name, value in run.params.items()]
        for start in range(0, len(logged), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, params=logged[start : start + MAX_PARAMS_TAGS_PER_BATCH])
        try:
            self.client.log_text(self.run_id, run.config_text, "config.json")  # the artifact store may refuse it
        except MlflowException as error:
            raise SettingsError(f"--report-to mlflow: config.json as an artifact: {_one_line(error)}") from error

    def log(self, step: int, values: Mapping[str, float]) -> None:
        from mlflow.entities import Metric
        from mlflow.utils.validation import MAX_METRICS_PER_BATCH

        now = int(time.time() * 1000)
        metrics = [Metric(_MLFLOW_UNSAFE.sub("_", name), value, now, step) for name, value in values.items()]
        for start in range(0, len(metrics), MAX_METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[start : start + MAX_METRICS_PER_BATCH])

    def close(self, *, failed: bool) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


def tracker_refusal(names: Sequence[str], *, timeout_s: float = 5.0) -> str | None:
    """Why a tracker of ``names`` could not open its run, in one line, said before anything starts (None when
    each may): its package missing, its settings not resolving (an unknown ``WANDB_MODE``; W&B online with no
    key; an ``MLFLOW_TRACKING_URI`` scheme MLflow has no store for), its server not answering one cheap request
    within ``timeout_s`` (W&B online, an MLflow http(s) server). The run's own opening (`Trackers.open`) may
    still fail for what only it sees (a key the server refuses)."""
    checks: dict[str, Callable[[float], str | None]] = {
        "wandb": _wandb_refusal,
        "tensorboard": _tensorboard_refusal,
        "mlflow": _mlflow_refusal,
    }
    with _environment():
        for name in names:
            said = checks[name](timeout_s)
            if said:
                return f"--report-to {name}: {said}"
    return None


def _tensorboard_refusal(timeout_s: float) -> str | None:
    try:
        import tensorboard  # noqa: F401
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError:
        return f"needs the tensorboard package: {_INSTALL}"
    return None


def _wandb_refusal(timeout_s: float) -> str | None:
    try:
        import httpx
        import wandb
        from wandb.errors import Error
    except ImportError:
        return f"needs the wandb package: {_INSTALL}"
    offline = "WANDB_MODE=offline writes the run to files instead (`wandb sync` uploads them later)"
    try:  # as wandb's own setup resolves them (`wandb_setup._WandbSetup._load_settings`), no service started
        settings = wandb.Settings()
        config_dir = os.environ.get("WANDB_CONFIG_DIR")
        system = Path(config_dir).expanduser() if config_dir else Path("~", ".config", "wandb").expanduser()
        settings.settings_system = str(system / "settings")
        settings.update_from_system_settings()
        settings.update_from_env_vars(dict(os.environ))
    except (Error, ValueError) as error:  # ValueError: a WANDB_* value wandb's settings refuse (pydantic's)
        return f"W&B's settings ({_wandb_source()}): {_one_line(error)}"
    mode = settings.mode if settings.model_fields_set & {"mode", "api_key"} else "offline"  # as `_Wandb` opens it
    if mode in ("offline", "dryrun", "disabled"):
        return None
    if not _wandb_key(settings):
        return f"W&B {mode} ({_wandb_source()}) needs an API key (WANDB_API_KEY, or `wandb login`); {offline}"
    try:
        httpx.get(settings.base_url, timeout=timeout_s)  # any answer will do: the key is wandb's to check
    except (httpx.HTTPError, httpx.InvalidURL) as error:
        return f"W&B {mode}: {settings.base_url} does not answer ({_one_line(error)}); {offline}"
    return None


def _wandb_key(settings: Any) -> bool:
    """Whether wandb has credentials for ``settings.base_url``: its variables, its settings, ``.netrc``."""
    if any(os.environ.get(name) for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE")):
        return True
    if settings.api_key or settings.identity_token_file:
        return True
    try:
        from wandb.sdk.lib.wbauth.wbnetrc import read_netrc_auth

        return read_netrc_auth(host=settings.base_url) is not None
    except Exception:  # noqa: BLE001 — wandb's own reading of it moved or refuses it: wandb.init says which
        return True


def _mlflow_refusal(timeout_s: float) -> str | None:
    try:
        from mlflow.environment_variables import MLFLOW_TRACKING_URI
        from mlflow.exceptions import MlflowException
        from mlflow.tracking._tracking_service.utils import _tracking_store_registry
    except ImportError:
        return f"needs the mlflow-skinny package: {_INSTALL}"
    if not MLFLOW_TRACKING_URI.defined:
        return None  # the run's own file store
    uri = str(MLFLOW_TRACKING_URI.get())
    try:
        _tracking_store_registry.get_store_builder(uri)  # what MlflowClient(uri) picks its store by
    except MlflowException:
        known = ", ".join(sorted(scheme for scheme in getattr(_tracking_store_registry, "_registry", {}) if scheme))
        return f"MLFLOW_TRACKING_URI={uri}: MLflow has no tracking store for that scheme (it knows {known})"
    if urlsplit(uri).scheme not in ("http", "https"):
        return None
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import http_request

    try:  # MLflow's own request (its TLS and auth variables), once: any answer will do
        http_request(get_default_host_creds(uri), "/health", "GET", max_retries=0, timeout=timeout_s)
    except (MlflowException, OSError) as error:  # requests' errors are OSErrors
        return f"MLFLOW_TRACKING_URI={uri}: the server does not answer ({_one_line(error)})"
    return None


# MLflow refuses metric names outside alphanumerics and ``_-. :/`` (``eval/pass@1`` becomes ``eval/pass_1``).
_MLFLOW_UNSAFE = re.compile(r"[^A-Za-z0-9_\-. :/]")

_OPENERS: dict[str, Callable[[_Run], _Tracker]] = {
    "wandb": _Wandb,
    "tensorboard": _TensorBoard,
    "mlflow": _MLflow,
}


class Trackers:
    """The run's open trackers (maybe none): `log` each step record, `close` once (or use ``with``)."""

    def __init__(self, trackers: Mapping[str, _Tracker]) -> None:
        self._trackers = dict(trackers)

    @property
    def destinations(self) -> dict[str, str]:
        """Where each open tracker's run goes ("W&B offline: RUN/wandb/offline-run-…", "MLflow: URI, …")."""
        return {name: tracker.where for name, tracker in self._trackers.items()}

    @classmethod
    def open(cls, names: Sequence[str], *, run_dir: Path, run_name: str, config: Mapping[str, Any]) -> Trackers:
        """A run named ``run_name`` in each of ``names`` (`REPORTERS`), where each tool's environment says, else
        under ``run_dir``, with ``config`` as its hyper-parameters. A missing package raises ImportError naming
        the extra to install, a run that cannot start `SettingsError`; the trackers opened before are closed."""
        unknown = [name for name in names if name not in _OPENERS]
        if unknown:
            raise ValueError(f"unknown tracker {unknown[0]!r}: choose from {', '.join(REPORTERS)}")
        run = _Run(dir=run_dir, name=run_name, params=hyperparameters(config), config_text=config_json(config))
        opened: dict[str, _Tracker] = {}
        try:
            with _environment():
                for name in names:
                    opened[name] = _OPENERS[name](run)
        except BaseException:
            Trackers(opened).close(failed=True)
            raise
        trackers = cls(opened)
        if opened:
            logger.info("tracking to %s", "; ".join(trackers.destinations.values()))
        return trackers

    def log(self, record: Mapping[str, Any]) -> None:
        """``record``'s numeric fields (`scalars`) at its ``step``."""
        if not self._trackers:
            return
        values, step = scalars(record), int(record["step"])
        with _environment():
            for tracker in self._trackers.values():
                tracker.log(step, values)

    def close(self, *, failed: bool = False) -> None:
        """Finish every run (``failed``: marked so where the tracker has a status); each is closed even when
        another fails to, and the first error is raised after."""
        trackers, self._trackers = self._trackers, {}
        errors: list[BaseException] = []
        with _environment():
            for tracker in trackers.values():
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
