"""`weir up`: every role as a local process with embedded defaults, started in order, stopped together.

Roles run as ``weir serve ROLE`` children on localhost at the ports of the role table
(`services.roles`: rollout 8100, preprocess 8101, encoder 8102, data 8103, engines from 30000),
shifted together by ``base_port`` so two stacks can share a host; they share one cache folder, and
the tiny model is created on first run (roles never create a model themselves). Every role requires
the stack's API token (`ensure_token`: the one given, or the one kept in ``home/api-token``, or a new
one written there, mode 0600); callers send `LocalStack.token`. Ctrl-C (or SIGTERM) stops every
child: SIGTERM first, SIGKILL after a grace period. A role that exits meanwhile is started again by
`launcher.supervisor.Supervisor` (`relaunch`), the others serving on.

Not here: the roles themselves (``services/<role>``), the clients that call them (`services.http`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from services.model_ref import ModelRefError, model_folder
from services.roles import BASE_PORT, ROLES
from services.settings import SettingsError

from .cpu_threads import THREADS_ENV, thread_share, user_threads

__all__ = [
    "LocalStack",
    "RoleProcess",
    "StackRefusal",
    "ensure_token",
    "port_holder",
    "poll_ready",
    "stack_model",
    "stack_ports",
]

TOKEN_FILE = "api-token"  # under the stack's home
_log = logging.getLogger("weir.stack")


def ephemeral_ports(path: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> range | None:
    """The ports the kernel hands to outgoing connections (Linux), or None where it does not say.

    A role bound in this range can find its port taken by any client's connection of the moment
    (CI saw ``engine :41200`` busy at start-up this way), so `LocalStack.start` warns about it."""
    try:
        low, high = (int(v) for v in path.read_text().split())
    except (OSError, ValueError):
        return None
    return range(low, high + 1)


def _read_token(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except FileNotFoundError:
        return None


def ensure_token(path: Path, given: str | None = None) -> tuple[str, bool]:
    """The API token kept in ``path`` (mode 0600), and whether this call wrote it.

    ``given`` (a token chosen by the caller) is written there unless it is already what the file
    holds; without one the token already there is kept, or a new ``secrets.token_urlsafe(32)`` is
    written. The file is created complete or not at all (written aside, then linked into place), so
    two processes racing to create it agree on the token.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    existing = _read_token(path)
    if existing is not None and (not given or given == existing):
        if path.stat().st_mode & 0o077:
            with contextlib.suppress(PermissionError):  # not ours to tighten: still usable
                path.chmod(0o600)
        return existing, False
    token = given or secrets.token_urlsafe(32)
    aside = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    descriptor = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(descriptor, "w") as out:
            out.write(token + "\n")
            out.flush()
            os.fsync(out.fileno())
        if given or path.exists():  # replace what is there (an empty file, or another token)
            os.replace(aside, path)
        else:
            try:
                os.link(aside, path)  # fails if another process created it meanwhile: use theirs
            except FileExistsError:
                return ensure_token(path, given)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(aside)
    return token, True


def stack_ports(base_port: int = BASE_PORT, engines: int = 1) -> list[tuple[str, str, int]]:
    """``(name, role, port)`` of every process of a stack, in start-up order (the role table's).

    Engines are named by port (``engine-30000``, ``engine-30001``, …); every other process by its role.
    """
    plan: list[tuple[str, str, int]] = []
    for role in ROLES.values():
        if role.name == "engine":
            for i in range(engines):
                port = role.port_at(base_port, i)
                plan.append((f"engine-{port}", "engine", port))
        else:
            plan.append((role.name, role.name, role.port_at(base_port)))
    return plan


def remote_urls(roles: Iterable[tuple[str, str]]) -> dict[str, str]:
    """The stack names of (role, URL) pairs given by hand (`weir train --role-url`): engines ``engine-1``,
    ``engine-2``… in order, every other role by its name."""
    urls: dict[str, str] = {}
    engines = 0
    for role, url in roles:
        if role == "engine":
            engines += 1
            urls[f"engine-{engines}"] = url
        else:
            urls[role] = url
    return urls


def remote_refusal(roles: Iterable[tuple[str, str]]) -> str | None:
    """Why (role, URL) pairs cannot be a stack to attach to: a role given twice (engines excepted), or one the
    RL loop needs (rollout, data, an engine) missing; None when they can."""
    named = [role for role, _ in roles]
    twice = sorted({role for role in named if role != "engine" and named.count(role) > 1})
    if twice:
        return f"--role-url: {', '.join(twice)} given more than once (only engine may be, once per engine)"
    missing = [role for role in ("rollout", "data", "engine") if role not in named]
    if missing:
        return f"--role-url: the RL loop needs the stack's rollout, data and an engine; missing: {', '.join(missing)}"
    return None


def gpus_per_engine(env: Mapping[str, str]) -> int:
    """GPUs one engine takes under these settings: on SGLang ``WEIR_ENGINE_GPUS``, else tp × pp × dp of
    ``WEIR_SGLANG_ARGS``; 1 for the other backends (a GPU when there is one)."""
    if env.get("WEIR_BACKEND") != "sglang":
        return 1
    if env.get("WEIR_ENGINE_GPUS"):
        return int(env["WEIR_ENGINE_GPUS"])
    from engines.sglang_args import engine_gpus, parse_server_args

    return engine_gpus(parse_server_args(env.get("WEIR_SGLANG_ARGS", "")))


def engine_devices(index: int, env: Mapping[str, str]) -> dict[str, str]:
    """The GPUs of engine ``index`` of a local stack on SGLang: engine i gets the i-th run of k GPUs (of
    ``CUDA_VISIBLE_DEVICES`` when set), k = `gpus_per_engine`; nothing for other backends, whose engines
    share what they see."""
    if env.get("WEIR_BACKEND") != "sglang":
        return {}
    k = gpus_per_engine(env)
    visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    devices = visible or [str(i) for i in range((index + 1) * k)]
    mine = devices[index * k : (index + 1) * k]
    if len(mine) < k:
        raise SettingsError(
            f"engine {index} takes {k} GPUs ({index * k}..{(index + 1) * k - 1}) but CUDA_VISIBLE_DEVICES lists "
            f"{len(devices)}: fewer --engines, or a smaller tp_size"
        )
    return {"CUDA_VISIBLE_DEVICES": ",".join(mine), "WEIR_ENGINE_GPUS": str(k)}


def encoder_devices(env: Mapping[str, str]) -> dict[str, str]:
    """The encoder role's device in a local stack: its planned GPU (``WEIR_ENCODER_GPU``,
    `launcher.placement.DevicePlan.encoder_env`) as the only one it sees; nothing without one (the CPU)."""
    gpu = env.get("WEIR_ENCODER_GPU")
    return {"CUDA_VISIBLE_DEVICES": gpu, "WEIR_DEVICE": "cuda:0"} if gpu else {}


def stack_model(home: Path, model: Path | str | None = None) -> Path:
    """The folder a stack's roles serve: ``model`` (a folder, or a hub id's snapshot: `services.model_ref`),
    else the tiny model in ``home/model``, made there on first use. Absolute, so a trainer attached from
    another folder compares it with its own (`launcher.model`)."""
    if model is None:
        from encoders.embedded_model import ensure_model

        return ensure_model(home / "model").absolute()  # the stack's own default: made once
    try:  # a model the user named: a typo must not quietly become a random model
        return model_folder(model).absolute()
    except ModelRefError as error:
        raise SettingsError(f"--model {error}") from None


def poll_ready(url: str, deadline: float, alive: Callable[[], bool] = lambda: True) -> bool:
    """True once ``url/readyz`` (open: no token needed) answers 200; False at the deadline or when
    ``alive()`` turns false."""
    while alive():
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(0.3)
    return False


def _port_in_use(host: str, port: int) -> bool:
    """Whether TCP ``port`` on ``host`` is held (bound as a server binds it, in the family ``host`` resolves to:
    ``::`` is IPv6). Only EADDRINUSE is "held"; any other error (``host`` no address of this machine:
    EADDRNOTAVAIL, or no address at all: `socket.gaierror`) is raised, an `OSError` to say as it is."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                return True
            raise
    return False


def port_holder(port: int) -> str:
    """Who holds TCP ``port`` on this host: ``pid 1234 (python3)`` from ``/proc`` (Linux: the socket's inode in
    ``/proc/net/tcp``, then the process with a descriptor on it), else another user's process (whose descriptors
    only root may read), else a process out of sight."""
    owners: dict[str, int] = {}  # the socket's inode → its owner's uid; listening sockets first
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in sorted((r.split() for r in rows), key=lambda f: len(f) > 3 and f[3] != "0A"):
            if len(row) > 9 and row[9] != "0" and int(row[1].rsplit(":", 1)[1], 16) == port:
                owners.setdefault(row[9], int(row[7]))
    if not owners:
        return "another process (/proc does not list its socket)"
    sockets = {f"socket:[{inode}]" for inode in owners}
    for process in Path("/proc").iterdir():
        if not process.name.isdigit():
            continue
        try:
            if any(os.readlink(fd) in sockets for fd in (process / "fd").iterdir()):
                return f"pid {process.name} ({(process / 'comm').read_text().strip()})"
        except OSError:  # gone meanwhile, or not ours to read
            continue
    uid = next(iter(owners.values()))
    if uid != os.getuid():
        return f"another user's process (uid {uid}, whose pid only root may see)"
    return "a process not visible from here (another container's, or in another pid namespace)"


class StackRefusal(RuntimeError):
    """Why a local stack cannot start, in one line (a port held since the options were checked, or a role that
    refused its own options): the command says it on stderr and exits 2, with no traceback."""


def _refusal_in(log: Path) -> str | None:
    """The one-line refusal a role's ``weir serve`` ended its log with (``weir serve ROLE: …``), else None."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    last = lines[-1] if lines else ""
    return last.split(": ", 1)[1] if last.startswith("weir serve") and ": " in last else None


@dataclass(slots=True)
class RoleProcess:
    """One role's child process: its name in the stack (``engine-1``), URL, process and log file."""

    role: str
    url: str
    process: subprocess.Popen[bytes]
    log: Path


@dataclass(slots=True)
class LocalStack:
    home: Path = Path(".weir")
    model: Path | str | None = None  # a model folder or a hub id; None: the tiny model in home/model
    engines: int = 1
    host: str = "127.0.0.1"
    base_port: int = BASE_PORT  # the rollout role's port; every other port moves with it (`services.roles`)
    env: dict[str, str] = field(default_factory=dict)  # extra WEIR_* settings for every role (e.g. WEIR_MAX_STALENESS)
    # (role, URL) of a stack off this host's ports (compose, another host), for attach(); empty: this host's
    remote: tuple[tuple[str, str], ...] = ()
    token: str | None = None  # the API token; set by start() / attach() when not given
    children: list[RoleProcess] = field(default_factory=list)
    launched_env: dict[str, str] = field(default_factory=dict)  # what the roles were started with
    trainer_ranks: int = 0  # trainer processes beside the stack on this host: they share its cores (`cpu_threads`)

    @property
    def urls(self) -> dict[str, str]:
        return {c.role: c.url for c in self.children}

    @property
    def token_path(self) -> Path:
        """Where the stack's API token is kept (mode 0600)."""
        return self.home / TOKEN_FILE

    def _given_token(self) -> str | None:
        """A token chosen by the caller: the ``token`` field, else ``WEIR_API_TOKEN`` (or the file
        ``WEIR_API_TOKEN_FILE`` names) in ``env`` or the environment."""
        if self.token:
            return self.token
        variables = {**os.environ, **self.env}
        if variables.get("WEIR_API_TOKEN"):
            return variables["WEIR_API_TOKEN"]
        if variables.get("WEIR_API_TOKEN_FILE"):
            return _read_token(Path(variables["WEIR_API_TOKEN_FILE"]))
        return None

    def _url(self, port: int) -> str:
        return f"http://{self.host}:{port}"

    def _env(self, model: Path, plan: list[tuple[str, str, int]]) -> dict[str, str]:
        port = {name: p for name, _, p in plan}
        # With trainer ranks beside it, each engine and rank gets its share of the cores (the other roles the
        # same: they compute between the engines' steps); a stack alone keeps torch's default.
        threads = {}
        if self.trainer_ranks and not user_threads({**os.environ, **self.env}):
            threads = {THREADS_ENV: str(thread_share(self.engines + self.trainer_ranks))}
        return {
            **os.environ,
            "WEIR_MODEL": str(model),
            "WEIR_CACHE_DIR": str(self.home / "cache"),
            "WEIR_EMBEDDING_CACHE_DIR": str(self.home / "embeddings"),
            "WEIR_MEDIA_ROOTS": str((self.home / "media").resolve()),
            "WEIR_ENGINE_URLS": ",".join(self._url(p) for _, role, p in plan if role == "engine"),
            "WEIR_PREPROCESS_URL": self._url(port["preprocess"]),
            "WEIR_ENCODER_URL": self._url(port["encoder"]),
            "WEIR_DATA_URL": self._url(port["data"]),
            "WEIR_DATA_DIR": str(self.home / "data"),
            "WEIR_EXPERIENCE_PATH": str(self.home / "experience.jsonl"),
            # A recorded rollout is answered once its group is fsync'd here, and shipped to the data role behind
            # the answer (`rollout.spool`): one round trip less per rollout. WEIR_SPOOL_DIR= (empty) turns it off.
            "WEIR_SPOOL_DIR": os.environ.get("WEIR_SPOOL_DIR", str(self.home / "spool")),
            **threads,
            **self.env,
            "WEIR_API_TOKEN": self.token or "",
        }

    def start(self, timeout_s: float = 180.0) -> dict[str, str]:
        """Start every role (creating the tiny model and the token first when missing); their URLs."""
        plan = stack_ports(self.base_port, self.engines)
        outside = [f"{name} :{port}" for name, _, port in plan if not 0 < port <= 65535]
        if outside:
            raise ValueError(f"base port {self.base_port} puts {', '.join(outside)} outside 1-65535")
        ephemeral = ephemeral_ports() or range(0)
        exposed = [f"{name} :{port}" for name, _, port in plan if port in ephemeral]
        if exposed:
            _log.warning(
                "%s in the kernel's range for outgoing connections (%d-%d): a client may hold the port at any "
                "moment; a lower --base-port keeps every role below %d",
                ", ".join(exposed),
                ephemeral.start,
                ephemeral.stop - 1,
                ephemeral.start,
            )
        busy = [f"{name} :{port} ({port_holder(port)})" for name, _, port in plan if _port_in_use(self.host, port)]
        if busy:
            raise StackRefusal(
                f"ports already in use on {self.host}: {', '.join(busy)} — another stack? "
                "Stop it, or start this one elsewhere (--base-port 9100 --home .weir-2)"
            )
        model = self.model_folder()
        (self.home / "logs").mkdir(parents=True, exist_ok=True)
        (self.home / "media").mkdir(parents=True, exist_ok=True)
        self.token, _ = ensure_token(self.token_path, self._given_token())
        env = self._env(model, plan)
        self.launched_env = env
        try:
            engine_index = 0
            for name, role, port in plan:
                if role == "engine":
                    self._launch(name, role, port, {**env, **engine_devices(engine_index, env)})
                    engine_index += 1
                elif role == "encoder":
                    self._launch(name, role, port, {**env, **encoder_devices(env)})
                else:
                    self._launch(name, role, port, env)
            for child in self.children:
                self._wait_ready(child, timeout_s)
        except BaseException:
            self.stop()
            raise
        return self.urls

    def model_folder(self) -> Path:
        """The folder every role serves (`stack_model`)."""
        return stack_model(self.home, self.model)

    def _launch(self, name: str, role: str, port: int, env: dict[str, str]) -> None:
        self.children.append(self._spawn(name, role, port, env))

    def _spawn(self, name: str, role: str, port: int, env: dict[str, str]) -> RoleProcess:
        log = self.home / "logs" / f"{name}.log"
        command = [sys.executable, "-m", "launcher.cli", "serve", role, "--host", self.host, "--port", str(port)]
        # info: one line per request, with its request id, so a rollout can be followed through logs/
        command += ["--log-level", env.get("WEIR_LOG_LEVEL", "info")]
        with open(log, "ab") as out:  # appended: a restarted role's log follows its predecessor's last lines
            process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        return RoleProcess(name, self._url(port), process, log)

    def attach(self, timeout_s: float = 10.0) -> dict[str, str]:
        """The URLs of a stack already running on this host at ``base_port`` (`weir up`, same
        ``home``), once each role answers ``/readyz``; its token is read from ``home/api-token``.
        Nothing is started or stopped."""
        self.token = self._given_token() or _read_token(self.token_path)
        if self.remote:
            urls, hint = remote_urls(self.remote), "is the stack up, and are the --role-url addresses its roles'?"
        else:
            urls = {name: self._url(port) for name, _, port in stack_ports(self.base_port, self.engines)}
            hint = "start the stack with `weir up` first (same --home and --base-port)"
        deadline = time.monotonic() + timeout_s
        for role, url in urls.items():
            if not poll_ready(url, deadline):
                raise RuntimeError(f"no ready {role} at {url}: {hint}")
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        if httpx.get(f"{urls['rollout']}/metrics", headers=headers, timeout=5).status_code == 401:
            raise RuntimeError(f"the stack at {urls['rollout']} refused the token in {self.token_path}")
        return urls

    def restart(self, role: str, timeout_s: float = 180.0) -> None:
        """Start a role again on its port (after it died or was killed), and wait until it is ready."""
        self._wait_ready(self.relaunch(role), timeout_s)

    def relaunch(self, role: str, extra_env: dict[str, str] | None = None) -> RoleProcess:
        """Start ``role`` (a stack name: ``engine-1``) again on its port with the settings it was started with
        (plus ``extra_env``), once its old process has exited; what is left of that process's group (a child it
        started) is killed first, so nothing holds the port. Does not wait for readiness."""
        index, child = next((i, c) for i, c in enumerate(self.children) if c.role == role)
        if child.process.poll() is None:
            raise RuntimeError(f"{role} is still running")
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.process.pid, signal.SIGKILL)
        port = int(child.url.rsplit(":", 1)[1])
        env = {**self.launched_env, **(extra_env or {})}
        if role.startswith("engine"):  # its own GPUs again: the engines' start-up order
            engines = [c.role for c in self.children if c.role.startswith("engine")]
            env.update(engine_devices(engines.index(role), env))
        replacement = self._spawn(role, role.split("-", 1)[0], port, env)
        self.children[index] = replacement
        return replacement

    def kill(self, role: str) -> None:
        """SIGKILL ``role``'s process group (a role that did not become ready) and reap it."""
        child = next(c for c in self.children if c.role == role)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.process.pid, signal.SIGKILL)
        child.process.wait()

    @staticmethod
    def _wait_ready(child: RoleProcess, timeout_s: float) -> None:
        if not poll_ready(child.url, time.monotonic() + timeout_s, alive=lambda: child.process.poll() is None):
            if child.process.poll() is not None:
                said = _refusal_in(child.log) if child.process.returncode == 2 else None
                if said:  # its own one-line refusal (`weir serve`'s checks): a port taken since start() checked
                    raise StackRefusal(f"{child.role} did not start: {said} (see {child.log})")
                raise RuntimeError(f"{child.role} exited ({child.process.returncode}); see {child.log}")
            raise TimeoutError(f"{child.role} was not ready after {timeout_s:.0f} s; see {child.log}")

    def stop(self, grace_s: float = 10.0) -> None:
        for child in self.children:
            if child.process.poll() is None:
                os.killpg(child.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in self.children:
            try:
                child.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(child.process.pid, signal.SIGKILL)
                child.process.wait()
        self.children.clear()
