"""The checks of the ``weir`` command line that take more than one option, run once the options are parsed and
before anything starts (`launcher.cli.main`): what one option may be is its argparse type (`launcher.arguments`);
what options may be together, whether the ports a stack binds are free (and who holds one that is not), and
whether a Ray cluster answers at ``--address``, are here. A refusal is one line, said on stderr with exit status 2.

`train_refusal` is the rest of `weir train`'s checks, those that read the model or the GPUs (slower: they import
torch) and the trackers' settings (`launcher.trackers.tracker_refusal`); `launcher.training.run_training` runs
it, still before any stack or rank starts.
"""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING

from .config import LAUNCHED_RANK_ENV, TrainConfig
from .stack import port_holder

if TYPE_CHECKING:
    from services.cluster.autoscaling import EngineAutoscaling

__all__ = ["autoscaling", "hints", "port_holder", "ray_address_refusal", "refusal", "train_config", "train_refusal"]


def refusal(args: argparse.Namespace) -> str | None:
    """Why these parsed options cannot run together (one line, without the ``weir COMMAND:`` prefix), or None."""
    check = {"train": _train, "up": _up, "engines": _engines, "serve": _serve}.get(args.command)
    return check(args) if check is not None else None


def _own_rollout() -> bool:
    """Whether the stack runs a rollout function of the user's (``WEIR_ROLLOUT_FUNCTION``, which the roles inherit):
    it may score its samples itself, so rows without a reward spec are not refused."""
    return bool(os.environ.get("WEIR_ROLLOUT_FUNCTION"))


def train_config(args: argparse.Namespace) -> TrainConfig:
    """`weir train`'s run from its options, those left unset taking the task's defaults."""
    given = {f.name: getattr(args, f.name) for f in fields(TrainConfig) if f.name != "argv"}
    given["role_url"] = tuple(given["role_url"])
    return TrainConfig.with_defaults(**given, argv=tuple(getattr(args, "argv", ())))


def autoscaling(spec: str) -> EngineAutoscaling:
    """Serve's autoscaling config for engines from ``MIN:MAX[:TARGET]`` (a `SettingsError` when it is not one)."""
    from services.cluster.autoscaling import engine_autoscaling
    from services.settings import SettingsError

    try:
        low, high, *target = (float(x) for x in spec.split(":"))
        if len(target) > 1:
            raise ValueError("too many fields")
        return engine_autoscaling(int(low), int(high), *target)
    except ValueError as error:
        raise SettingsError(f"engine autoscaling {spec!r}: give MIN:MAX[:TARGET] ({error})") from None


def hints(config: TrainConfig) -> list[str]:
    """Valid settings that are likely not what was meant, said before the run (not refused)."""
    if config.mode == "async" and config.max_staleness == 0:
        return [
            "--mode async --max-staleness 0: every sample still generating when a step ends goes stale "
            "(dropped or regenerated, --staleness-policy), so the engines redo most of their work (measured on the "
            "demo: 0.2 samples/s); --mode colocate is the on-policy mode"
        ]
    return []


def _train(args: argparse.Namespace) -> str | None:
    config = train_config(args)
    if config.role_url and (not config.attach or config.ray):
        return "--role-url names the roles of a running stack: use it with --attach (and without --ray)"
    if config.role_url:
        from .stack import remote_refusal

        said = remote_refusal(config.role_url)
        if said:
            return said
    if config.warmup_steps and not config.demo:
        return "--warmup-steps is the demo task's format warm-up: use it with --demo"
    if config.eval_dataset is not None and not config.eval_every:
        return "--eval-dataset needs --eval-every N (steps between evaluations)"
    if config.eval_every and config.eval_dataset is None and not config.demo:
        return "--eval-every needs --eval-dataset F (held-out rows; --demo has its own)"
    if config.eval_dataset is not None and not config.eval_dataset.is_file():
        return f"--eval-dataset {config.eval_dataset}: no such file"
    if config.eval_dataset is not None:  # its rows are read (and scored) as --dataset's are: a bad row said here
        from preprocess.rows import dataset_refusal

        said = dataset_refusal(config.eval_dataset, option="--eval-dataset", scored_elsewhere=_own_rollout())
        if said:
            return said
    if config.rollout_correction == "mis" and config.correction_floor > config.correction_cap:
        return f"--correction-floor {config.correction_floor} is above --correction-cap {config.correction_cap}"
    if config.cpu_offload and (config.trainer != "fsdp" or config.nproc < 2):
        return "--cpu-offload is FSDP2's: use it with --trainer fsdp and --nproc 2 or more"
    if config.trainer == "fsdp" and any(size != 1 for size in (config.tp, config.pp, config.cp, config.ep)):
        return "--tp/--pp/--cp/--ep are megatron's model-parallel sizes: use them with --trainer megatron"
    if config.trainer == "megatron":
        if config.ray:
            return "--trainer megatron on Ray is not wired yet: use --nproc (torchrun's ranks) on one node"
        if config.r3:
            return "--r3 with --trainer megatron is not wired into `weir train` yet (trainer.megatron.RouterReplaySpec)"
        from trainer.model_parallel import check_model_parallel

        try:
            check_model_parallel(tp=config.tp, pp=config.pp, cp=config.cp, ep=config.ep, world=config.nproc)
        except ValueError as error:
            return str(error)
    if config.split is not None and config.dataset is None:
        return "--split picks a split of --dataset's: use it with --dataset"
    if config.dataset is not None:  # reads every row once: a dataset, split or row Weir cannot read is said here
        from preprocess.rows import dataset_refusal

        said = dataset_refusal(config.dataset, config.split, scored_elsewhere=_own_rollout())
        if said:
            return said
    if config.ray:
        return _ray_refusal(config.address or ("auto" if config.attach else None), config.serve_port)  # as RayStack
    return None  # the local stack's ports: the last check of all (`train_refusal`)


def _up(args: argparse.Namespace) -> str | None:
    if not args.ray:
        given = [name for name in ("address", "write_config", "engine_autoscale") if getattr(args, name) is not None]
        if given:
            return f"--{given[0].replace('_', '-')} is for the Ray stack: add --ray"
        return _stack_ports_refusal(args.base_port, args.engines)
    if args.engine_autoscale is not None:
        said = _autoscaling_refusal(args.engine_autoscale)
        if said:
            return said
    if args.write_config is not None:
        return None  # writes a file, starts nothing
    return _ray_refusal(args.address, args.serve_port)


def _ray_refusal(address: str | None, serve_port: int) -> str | None:
    """`weir up --ray` / `weir train --ray`: with no ``--address`` Ray starts here (Serve's proxy on
    ``serve_port``, which must be free), unless Ray would join a cluster it finds (`_joined_address`); with one,
    a cluster must answer there."""
    if address is not None:
        return ray_address_refusal(address)
    joined = _joined_address()
    if joined is not None:  # ray.init() with no address joins it, and refuses the resources a local start gives
        found, where = joined
        other = "unset RAY_ADDRESS" if where == "RAY_ADDRESS" else "stop it (`ray stop`)"
        return (
            f"--ray without --address starts Ray here, but Ray would join the cluster at {found} ({where}): give "
            f"--address {found} to use that cluster, or {other}"
        )
    return _ports_refusal("127.0.0.1", [("Serve's HTTP proxy", serve_port)], "--serve-port")


def _engines(args: argparse.Namespace) -> str | None:
    if args.action == "autoscale":
        said = _autoscaling_refusal(args.count)
    elif not args.count.isdigit() or int(args.count) < 1:
        said = f"{args.action} {args.count}: give how many engines, a whole number 1 or more"
    else:
        said = None
    return said or ray_address_refusal(args.address)


def _serve(args: argparse.Namespace) -> str | None:
    from services.roles import ROLES

    port = args.port or ROLES[args.role].port
    host = args.host or os.environ.get("WEIR_HOST", "127.0.0.1")
    return _ports_refusal(host, [(f"the {args.role} role", port)], "--port")


def _autoscaling_refusal(spec: str) -> str | None:
    from services.settings import SettingsError

    try:
        autoscaling(spec)
    except SettingsError as error:
        return str(error)
    return None


def _stack_ports_refusal(base_port: int, engines: int) -> str | None:
    """Why a local stack at ``base_port`` cannot start: a port outside 1-65535, or one held already (by whom)."""
    from .stack import stack_ports

    plan = stack_ports(base_port, engines)
    outside = [f"{name} :{port}" for name, _, port in plan if not 0 < port <= 65535]
    if outside:
        return f"--base-port {base_port} puts {', '.join(outside)} outside 1-65535: give a lower --base-port"
    wanted = [(f"the {role} role", port) for _, role, port in plan]
    return _ports_refusal("127.0.0.1", wanted, f"--base-port {base_port}")


def _ports_refusal(host: str, wanted: list[tuple[str, int]], option: str) -> str | None:
    """Which of the (who wants it, port) pairs are held already on ``host``, and by whom; None if all are free."""
    from .stack import _port_in_use

    busy = []
    for who, port in wanted:
        try:
            if _port_in_use(host, port):
                busy.append(f"port {port} ({who}) is held by {port_holder(port)}")
        except OSError as error:  # not "in use": the host is no address to listen on here
            why = error.strerror or type(error).__name__
            return (
                f"--host {host}: cannot listen there ({why}): give an address of this machine (127.0.0.1, ::, 0.0.0.0)"
            )
    if not busy:
        return None
    other = "another --base-port (and --home)" if option.startswith("--base-port") else f"another {option}"
    return f"{option}: {'; '.join(busy)}: stop it, or give {other}"


def _ray_tmp() -> Path:
    """Ray's temporary folder (where `ray start` records the cluster it started), as Ray's own
    ``ray._common.utils.get_default_ray_temp_dir`` finds it."""
    return Path(os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp") / "ray"


def _running_gcs() -> str | None:
    """The ``--gcs-address`` of a Ray GCS process running here (Ray's own fallback for "auto")."""
    for process in Path("/proc").iterdir():
        try:
            words = (process / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        for i, word in enumerate(words):
            if word.startswith("--gcs-address=") or word.startswith("--gcs_address="):
                return word.split("=", 1)[1]
            if word in ("--gcs-address", "--gcs_address") and i + 1 < len(words):
                return words[i + 1]
    return None


def _joined_address() -> tuple[str, str] | None:
    """The cluster ``ray.init()`` with no address joins, and where it was found: RAY_ADDRESS, else the one `ray
    start` recorded (Ray's ``worker.init`` then ``services.get_ray_address_from_environment``: no address
    takes RAY_ADDRESS, then the recorded cluster; only "auto" goes on to any GCS running here); None: Ray
    starts here."""
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"], "RAY_ADDRESS"
    try:
        recorded = (_ray_tmp() / "ray_current_cluster").read_text().strip()
    except OSError:
        return None
    return (recorded, f"recorded by `ray start` in {_ray_tmp()}") if recorded else None


def _auto_address() -> str | None:
    """What Ray connects to for ``address="auto"`` (`ray._private.services.get_ray_address_from_environment`):
    RAY_ADDRESS, else the cluster `ray start` recorded in Ray's temporary folder, else a GCS running here."""
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"]
    try:
        recorded = (_ray_tmp() / "ray_current_cluster").read_text().strip()
    except OSError:
        recorded = ""
    return recorded or _running_gcs()


def ray_address_refusal(address: str | None) -> str | None:
    """Why no Ray cluster answers at ``address`` (HOST:PORT, ray://HOST:PORT or auto), said in seconds, before
    ``ray.init`` retries it for minutes; None when something listens there (or there is no address: Ray starts
    here). The address checked is the one Ray uses: an explicit HOST:PORT as given (``ray.init`` lets
    RAY_ADDRESS replace only no address or "auto"), "auto" as `_auto_address` finds it."""
    if address is None:
        return None
    target = _auto_address() if address == "auto" else address
    if not target:
        return (
            f"--address auto: no Ray cluster runs here (no RAY_ADDRESS, nothing recorded in {_ray_tmp()}, no GCS "
            "process): start one (`weir up --ray`, `ray start --head`) or give --address HOST:PORT"
        )
    scheme, _, rest = target.rpartition("://")
    host, _, port = rest.rstrip("/").rpartition(":")
    try:
        number = int(port) if port else (10001 if scheme == "ray" else 6379)
        with socket.create_connection((host.strip("[]") or "127.0.0.1", number), timeout=3):
            return None
    except ValueError:
        return f"--address {address}: give HOST:PORT, ray://HOST:PORT or auto"
    except OSError as error:
        why = error.strerror or type(error).__name__
        seen = f" (auto: {target})" if address == "auto" else ""
        return f"--address {address}{seen}: no Ray cluster answers there ({why}); is it running? (`ray status`)"


def train_refusal(config: TrainConfig) -> str | None:
    """What this run asks that its model, GPUs or trainer cannot do (they are read: torch is imported), said
    before any stack or rank starts; the options' own checks ran already (`refusal`)."""
    from services.settings import SettingsError

    from .model import demo_refusal, engine_refusal, model_refusal, run_model, trains_moe
    from .placement import PlacementError, training_plan

    if config.model is not None:
        try:  # a hub id not in the cache (offline) or a folder with no model: one line, before anything starts
            run_model(config)
        except SettingsError as error:
            return str(error)
    said = model_refusal(config) or engine_refusal(config) or demo_refusal(config)
    if said:
        return said
    try:
        training_plan(config)  # too few GPUs for the engines and the ranks: said before anything starts
    except PlacementError as error:
        return str(error)
    try:
        config.loss_config()
    except ValueError as error:  # bounds the loss refuses
        return f"--loss {config.loss}: {error}"
    if os.environ.get(LAUNCHED_RANK_ENV) != "1":  # the launcher checked them (a rank's are opened by rank 0)
        from .trackers import parse_report_to, tracker_refusal

        said = tracker_refusal(parse_report_to(config.report_to))
        if said:
            return said
    if config.trainer == "megatron" and config.ep > 1 and not trains_moe(config):
        return (
            f"--ep {config.ep}: expert parallelism needs a mixture-of-experts model "
            "(--arch qwen3-moe, qwen3-vl-moe or qwen3-omni-moe)"
        )
    # Last: what this machine holds at the moment, after everything the run itself gets wrong (a run refused for
    # its model says so whatever holds its ports). A rank attaches to the stack its launcher started.
    if not config.ray and not config.attach and "WORLD_SIZE" not in os.environ:
        return _stack_ports_refusal(config.base_port, config.engines)
    return None
