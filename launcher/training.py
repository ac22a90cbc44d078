"""`weir train`: start the stack, (warm up), run the RL loop, check, plot and summarise.

With ``--demo`` the task is generated locally (`launcher.demo.task`): pictures of four colours and
"What colour is the picture?", rewarded by exact match. The random-weight model first gets a short
supervised warm-up on text-only prompts that teaches the answer format (a colour name), never the
picture → name mapping; greedy accuracy on held-out pictures is measured before and after RL.
``--demo-task visual-search`` trains multi-turn instead: the ``visual_search`` environment (crop, then name
the small square's colour), warmed up on scripted crop-then-answer trajectories (`launcher.demo.task`).
``--demo-task video-audio`` (Omni models) asks the colour of short clips sent with their own audio track.

``--nproc N``: N trainer ranks (`trainer.data_parallel`; megatron's ``--tp`` / ``--ep`` groups inside them).
This process starts the stack, then runs the same command N times under torchrun's elastic agent
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``… set; ``--max-restarts R``: after a failed rank every rank starts
again and resumes from the last checkpoint), so running ``weir train`` under ``torchrun`` works the same way.
Rank 0 evaluates, prints and plots; the other ranks attach to the stack once rank 0 has it ready (their
output: HOME/logs/ranks).

The run is a `launcher.config.TrainConfig`, built once by the command line (options it left unset take the
task's defaults there). On Ray (``--ray``) the ranks are Ray tasks (`launcher.cluster.training`), each running
`run_training` again, attached to the stack.

New weights reach the engines by broadcast on a local stack (``--weights broadcast``, the default), through a
folder per version with ``--weights disk`` and always on Ray (`trainer.policy_version`).
"""

from __future__ import annotations

import _thread
import contextlib
import dataclasses
import functools
import json
import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypedDict

import torch
from rich.progress import Progress
from rich.table import Table

import preprocess as pp
from preprocess.rows import iter_prompt_rows
from trainer.data_parallel import DataParallel, restarted, run_ranks
from trainer.evaluation import EvalSpec
from trainer.loop import LoopConfig, evaluate, run_loop
from trainer.losses import LossConfig
from trainer.memory import Precision
from trainer.policy_version import PolicyOwner, WeightRecipients
from trainer.protocol import Ranks
from trainer.publish import PAUSE_MODE, data_policy_version
from trainer.reference import ReferenceTrainer

if TYPE_CHECKING:
    from trainer.megatron.trainer import MegatronTrainer

from .checks import hints, train_refusal
from .cluster.stack import RayStack
from .cluster.training import cluster_engines, in_trainer_task, record_weights, run_on_ray, trainer_features
from .config import HELD_OUT, LAUNCHED_RANK_ENV, TrainConfig
from .console import console
from .cpu_threads import THREADS_ENV, thread_share, user_threads
from .demo.plot import plot_runs
from .model import (
    attach_refusal,
    engine_env,
    engines_report_routes,
    ensure_arch,
    run_model,
)
from .placement import single_rank_device, training_plan
from .run_config import save_run_config
from .stack import LocalStack
from .supervisor import Supervisor
from .trackers import Trackers, eta, parse_report_to

__all__ = ["run_training"]

_WARMUP_LR = 3e-3


def _show(record: dict[str, Any], *, total: int, resumed_at: int = 0) -> None:
    idle = record["engine_idle_share"]
    console.print(
        f"{eta(record['step'], total, record['time_s'], resumed_at=resumed_at)}  "
        f"reward {record['mean_reward']:.3f}  loss {record['loss']:+.4f}  "
        f"{record['samples_per_s']:5.1f} samples/s  {record['tokens_per_s']:5.0f} tok/s  "
        f"stale {record['staleness']}  queue {record['queue_samples']:>3}  "
        f"idle: trainer {record['trainer_idle_share']:.0%} engines {'-' if idle is None else f'{idle:.0%}'}"
        + (f"  eval pass@1 {record['eval']['pass@1']:.0%}" if record.get("eval") else ""),
        soft_wrap=True,  # one line per step, however narrow the terminal
    )


def _summary(
    records: list[dict[str, Any]], before: float | None, after: float | None, plot: Path, what: str = "pictures"
) -> None:
    k = max(1, len(records) // 10)
    first = sum(r["mean_reward"] for r in records[:k]) / k
    last = sum(r["mean_reward"] for r in records[-k:]) / k
    end = records[-1]
    table = Table(title="Training summary", title_justify="left")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_row("steps / samples trained", f"{end['step']} / {sum(r['samples'] for r in records)}")
    table.add_row("RL wall time", f"{end['time_s']:.0f} s")
    table.add_row(f"mean reward, first {k} steps → last {k}", f"{first:.3f} → {last:.3f}")
    if before is not None and after is not None:
        table.add_row(f"greedy accuracy on held-out {what}", f"{before:.0%} → {after:.0%}")
    table.add_row("samples / s, tokens / s", f"{end['samples_per_s']:.1f}, {end['tokens_per_s']:.0f}")
    idle = end["engine_idle_share"]
    table.add_row(
        "idle share: trainer, engines", f"{end['trainer_idle_share']:.0%}, {'-' if idle is None else f'{idle:.0%}'}"
    )
    table.add_row(
        "policy version, dropped stale, regenerated",
        f"{end['policy_version']}, {end['dropped_stale']}, {end['regenerated']}",
    )
    table.add_row("plot", str(plot))
    console.print(table)


def _warm_up(
    trainer: ReferenceTrainer | MegatronTrainer, config: TrainConfig, urls: dict[str, str], out: Path, token: str | None
) -> None:
    """Supervised steps that teach the answer format — text-only prompts, or for the visual tool task scripted
    crop-then-answer trajectories (`launcher.demo.task.agent_warmup_pairs`); then the engines and the encoder
    get the weights."""
    from .demo.task import (
        AgentWarmup,
        Pair,
        agent_warmup_pairs,
        agent_warmup_rows,
        clip_warmup_pairs,
        warmup_prompts,
    )

    pairs: list[Pair] = []
    agent: AgentWarmup | None = None  # the agent's examples change from step to step
    if config.demo_task == "visual-search":  # scripted trajectories: crop the square's quarter, then answer
        agent = agent_warmup_pairs(agent_warmup_rows(), trainer.answer_ids, rollout_url=urls["rollout"], token=token)
        what = f"{len(agent.calls)} scripted crop-then-answer trajectories (the crop, the answer's format)"
    elif config.demo_task == "video-audio":  # the format with a clip in context; every clip gets every answer
        pairs = clip_warmup_pairs(config.home / "media", trainer.answer_ids, rollout_url=urls["rollout"], token=token)
        what = f"{len(pairs)} clip prompts, each clip with every colour's name (answer format)"
    else:
        pairs = [trainer.chat_pair(messages, answer) for messages, answer in warmup_prompts()]
        what = "text-only prompts (answer format)"
    main = trainer.parallel is None or trainer.parallel.is_main
    with Progress(console=console, transient=True, disable=not main) as progress:
        task = progress.add_task(f"warm-up on {what}", total=config.warmup_steps)
        for step in range(config.warmup_steps):
            loss = trainer.supervised_step(agent.pairs(step) if agent is not None else pairs, lr=_WARMUP_LR)
            progress.update(task, advance=1, description=f"warm-up, loss {loss:.3f}")
    if main:
        console.print(f"Warm-up: {config.warmup_steps} supervised steps on {what}, loss {loss:.3f}")
    _reference_from_policy(trainer)
    # An attached data role may already hold a policy: versions only go up from it; then the warmed-up
    # weights are the next version, published through the policy version's one owner as the loop does.
    recipients = WeightRecipients(
        engines=[u for k, u in urls.items() if k.startswith("engine")],
        current=cluster_engines if config.ray else None,  # engines come and go: the registry's at the time
        data_url=urls["data"],
        encoder_url=urls.get("encoder"),
        token=token,
        pause_mode=PAUSE_MODE,
        on_weights=record_weights if config.ray else None,  # joining engines load these weights
        weights=_weights(config),
    )
    policy = PolicyOwner(trainer, weights=out / "weights", main=main, recipients=recipients)
    policy.join(data_policy_version(urls["data"], token=token))
    try:
        policy.publish()  # collective (export or state dict) with several ranks; rank 0 tells the recipients
    finally:
        policy.close()  # the engines leave the warm-up's broadcast group; the loop joins its own


def _reference_from_policy(trainer: ReferenceTrainer | MegatronTrainer) -> None:
    """The KL penalty's frozen reference becomes the warmed-up weights: the penalty keeps RL near where RL
    starts, not near the model folder's random weights (which the warm-up left behind)."""
    if trainer.reference is None:
        return
    if isinstance(trainer, ReferenceTrainer):  # the reference is whole on every rank: the full state (collective)
        trainer.reference.load_state_dict(trainer.full_state_dict())
    else:  # megatron: the reference is sharded as the policy, so each rank copies its own shards
        trainer.reference.load_state_dict(getattr(trainer.model, "module", trainer.model).state_dict())


def _show_diagnosis(diagnosis: dict[str, float]) -> None:
    """The agent's held-out trajectories, decision by decision (`launcher.demo.task.crop_diagnosis`)."""
    if diagnosis:
        console.print(
            f"  crop shows the square {diagnosis['crop_hit']:.0%}; colour right when it does "
            f"{diagnosis['colour_given_hit']:.0%}, when it does not {diagnosis['colour_given_miss']:.0%} (chance 17%)"
        )


def _interrupt(fatal: str) -> None:
    """The supervisor gave up on a role: the run ends as Ctrl-C ends it (the stack stopped on the way out)."""
    console.print(fatal, style="red", markup=False, highlight=False)
    _thread.interrupt_main()


def _weights(config: TrainConfig) -> Literal["broadcast", "disk"]:
    """How weights reach the engines: ``--weights``, but disk on Ray for now (engines come and go there, and
    one that joins later loads the recorded folder)."""
    return "disk" if config.ray else config.weights


def _runs(root: Path) -> dict[str, list[dict[str, Any]]]:
    """Every mode's metrics under ``root`` (``root/MODE/metrics.jsonl``)."""
    return {
        path.parent.name: [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        for path in sorted(root.glob("*/metrics.jsonl"))
    }


def _forget_earlier_run(config: TrainConfig) -> None:
    """A new run: no experience (unless the stack is attached: its data role keeps its own) or metrics
    of an earlier one."""
    if not config.attach:
        shutil.rmtree(config.home / "data", ignore_errors=True)
    shutil.rmtree(config.home / "train" / config.mode, ignore_errors=True)


def _stack(config: TrainConfig) -> LocalStack | RayStack:
    """The stack this run starts or attaches to, with the run's staleness settings for its data role."""
    settings: dict[str, str] = {"WEIR_STALENESS_POLICY": config.staleness_policy}
    if config.max_staleness is not None:
        settings["WEIR_MAX_STALENESS"] = str(config.max_staleness)
    # The rollout role asks the engines for each token's experts: R3 replays them; without R3 the mismatch
    # monitor compares the trainer's routers with them (routing agreement, R3 on and off; not SGLang on the CPU).
    # Said both ways: a WEIR_RETURN_ROUTED_EXPERTS=true left in the shell would stop SGLang on the CPU at start.
    settings["WEIR_RETURN_ROUTED_EXPERTS"] = "true" if engines_report_routes(config) else "false"
    settings.update(engine_env(config))
    if config.engine_gpus is not None:  # engine i takes the i-th run of them (`launcher.stack.engine_devices`)
        settings["CUDA_VISIBLE_DEVICES"] = config.engine_gpus
    plan = training_plan(config)  # checked already (`_refusal`): the encoder's GPU, if one is left
    settings.update(plan.encoder_env() if plan is not None else {})
    from trainer.losses import PRESET_ADVANTAGE_ESTIMATOR  # the advantages the objective's paper pairs it with

    settings["WEIR_ADVANTAGE_ESTIMATOR"] = PRESET_ADVANTAGE_ESTIMATOR[config.loss]
    settings["WEIR_ADVANTAGE_STD"] = config.adv_std
    if config.ray:
        return RayStack(
            home=config.home,
            model=config.model,
            engines=config.engines,
            address=config.address,
            port=config.serve_port,
            env=settings,
        )
    return LocalStack(
        home=config.home,
        model=config.model,
        engines=config.engines,
        base_port=config.base_port,
        env=settings,
        remote=config.role_url,
        trainer_ranks=config.nproc,
    )


def _launch_ranks(config: TrainConfig) -> int:
    """This command once per rank, as torchrun runs it (rank 0 prints); the stack runs here, so it
    outlives rank restarts: after a failed rank, every rank starts again with ``--resume``."""
    if not config.resume:
        _forget_earlier_run(config)
    if not config.attach:
        ensure_arch(config)  # before the stack starts on HOME/model (the ranks attach to it)
    stack = _stack(config)
    if config.attach:
        refusal = attach_refusal(stack.attach(), stack.token, run_model(config))
        if refusal:
            print(f"weir train: {refusal}", file=sys.stderr)
            return 2
    else:
        console.print(f"[bold]Starting the stack[/bold] (logs in {config.home}/logs)")
        stack.start()
    command = [sys.executable, "-m", "launcher.cli", *config.argv, *([] if config.attach else ["--attach"])]
    supervisor = Supervisor(stack, on_fatal=_interrupt).start() if isinstance(stack, LocalStack) else None
    plan = training_plan(config)
    if plan is not None and plan.trainer:
        console.print(plan.describe(), markup=False, highlight=False)
    try:  # a rank started again after a failed one resumes (`run_training`)
        return run_ranks(
            command,
            config.nproc,
            max_restarts=config.max_restarts,
            log_dir=config.home / "logs" / "ranks",
            env={**(plan.trainer_env() if plan is not None else {}), **_rank_threads(config), LAUNCHED_RANK_ENV: "1"},
        )
    finally:
        if supervisor is not None:
            supervisor.close()
        stack.stop()  # an attached stack has no children here: nothing is stopped


def _rank_threads(config: TrainConfig) -> dict[str, str]:
    """The ranks' share of this host's cores, beside the stack's engines (`launcher.cpu_threads`)."""
    if config.attach or config.ray or user_threads():  # the engines are not (all) on this host
        return {}
    return {THREADS_ENV: str(thread_share(config.engines + config.nproc))}


def run_training(config: TrainConfig) -> int:
    refusal = train_refusal(config)  # before any stack or rank starts (the options' own checks ran already)
    if refusal:
        print(f"weir train: {refusal}", file=sys.stderr)
        return 2
    if config.ray and not in_trainer_task():
        if not config.attach:
            ensure_arch(config)  # the stack it starts serves HOME/model: the demo's (or --arch's) tiny model
        return run_on_ray(config, train=run_training, forget_earlier_run=_forget_earlier_run, stack_for=_stack)
    if config.nproc > 1 and "WORLD_SIZE" not in os.environ:
        return _launch_ranks(config)
    if restarted() and not config.resume:  # torchrun's agent started every rank again: from the checkpoint
        config = dataclasses.replace(config, resume=True)
    parallel = _ranks(config)
    main = parallel is None or parallel.is_main
    try:
        return _run(config, parallel, main)
    finally:
        if config.trainer == "megatron":
            from trainer.megatron.ranks import close_megatron_ranks

            close_megatron_ranks()
        elif parallel is not None:
            parallel.close()


def _evaluation(config: TrainConfig, held_out: list[dict[str, Any]]) -> EvalSpec | None:
    """``--eval-every``'s evaluation: ``--eval-dataset``'s rows, else the demo's held-out ones."""
    if not config.eval_every:
        return None
    rows = list(iter_prompt_rows(config.eval_dataset)) if config.eval_dataset is not None else held_out
    return EvalSpec(rows=rows, every=config.eval_every, k=config.eval_k, max_new_tokens=config.max_new_tokens)


def _ranks(config: TrainConfig) -> Ranks | None:
    """This process's data-parallel place (torchrun's environment), or None alone; megatron joins its own
    parallel state (and a process group even alone)."""
    if config.trainer == "megatron":
        from trainer.megatron.ranks import megatron_ranks

        return megatron_ranks(tp=config.tp, pp=config.pp, cp=config.cp, ep=config.ep)
    return DataParallel.from_env() if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None


class _SharedTrainerArgs(TypedDict):
    """What both trainers take alike (typed, so mypy checks each keyword against both constructors)."""

    features: pp.FeatureStore | None
    lr: float
    loss: LossConfig
    precision: Precision
    activation_checkpointing: bool
    ppo_epochs: int
    mini_batches: int


def _trainer(
    config: TrainConfig, features: pp.FeatureStore, parallel: Ranks | None
) -> ReferenceTrainer | MegatronTrainer:
    model = run_model(config)
    # The options both trainers take alike, read once (typed Any: each constructor checks them when called).
    shared = _SharedTrainerArgs(
        features=features,
        lr=config.lr,
        loss=config.loss_config(),
        precision=config.precision,
        activation_checkpointing=config.activation_checkpointing,
        ppo_epochs=config.ppo_epochs,
        mini_batches=config.mini_batches,
    )
    trainer: ReferenceTrainer | MegatronTrainer
    if config.trainer == "megatron":
        from trainer.megatron.trainer import MegatronTrainer

        trainer = MegatronTrainer(model, tp=config.tp, ep=config.ep, **shared)
    else:
        assert parallel is None or isinstance(parallel, DataParallel)
        trainer = ReferenceTrainer(
            model,
            parallel=parallel,
            routing_replay=config.r3,
            cpu_offload=config.cpu_offload,
            device=single_rank_device(config) if parallel is None else None,
            **shared,
        )
    # Megatron joins its own parallel state (`trainer.parallel`); the reference trainer keeps the one it was given.
    if trainer.parallel is None or trainer.parallel.is_main:  # before the first step: what a rank will hold
        console.print(str(trainer.memory_estimate(config.max_tokens_per_batch)), markup=False, highlight=False)
    return trainer


def _run(config: TrainConfig, parallel: Ranks | None, main: bool) -> int:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a bar per weight export would drown the progress lines
    agent, clips = config.agent, config.clips
    for hint in hints(config):  # valid settings, likely not what was meant
        console.print(hint, style="yellow", markup=False, highlight=False)
    out = config.home / "train" / config.mode
    if main and not config.resume:
        _forget_earlier_run(config)
    held_out: list[dict[str, Any]] = []
    if agent:
        from .demo.task import agent_curriculum

        rows, held_out = agent_curriculum(config.steps, config.groups_per_step)  # each picture drawn from its seed
    elif clips:
        from .demo.task import write_video_audio_task

        rows, held_out = write_video_audio_task(config.home / "media")
    elif config.demo and config.demo_task == "colour-words":
        from .demo.task import write_colour_word_task

        rows, held_out = write_colour_word_task()
    elif config.demo:
        from .demo.task import write_demo_task

        rows, held_out = write_demo_task(config.home / "media")  # deterministic: every rank writes the same
    else:
        assert config.dataset is not None  # the command line takes --dataset or --demo
        rows = list(iter_prompt_rows(config.dataset, config.split))  # Weir's rows, or verl's / slime's made into them
    if main and not config.attach:
        ensure_arch(config)
    stack = _stack(config)
    if config.attach or not main:  # its data role keeps its own settings (staleness) and experience
        if parallel is not None and not main:
            parallel.barrier()  # rank 0 has the stack ready
        urls = stack.attach()
    else:
        console.print(f"[bold]Starting the stack[/bold] (logs in {config.home}/logs)")
        urls = stack.start()
        if isinstance(stack, LocalStack) and config.nproc == 1 and not user_threads():  # beside the stack's engines
            torch.set_num_threads(thread_share(config.engines + 1))
    if parallel is not None and main:
        parallel.barrier()
    refusal = attach_refusal(urls, stack.token, run_model(config)) if config.attach or not main else None
    if refusal:  # every rank attached, past the barrier: each says no alike (it has nothing to stop)
        print(f"weir train: {refusal}", file=sys.stderr)
        return 2
    closing = contextlib.ExitStack()
    if isinstance(stack, LocalStack) and stack.children:  # started here: a role that exits is started again
        supervisor = Supervisor(stack, on_fatal=_interrupt).start()
        closing.callback(supervisor.close)  # before the stack stops (below): a stopped role stays stopped
    try:
        if config.ray:  # features from the node that made them, through this node's cache
            features = trainer_features(config.home, stack.token)
        else:
            features = pp.FeatureStore(config.cache_dir or config.home / "cache", 10 << 30)
        trainer = _trainer(config, features, parallel)
        closing.callback(getattr(trainer, "close", lambda: None))  # megatron's: its CPU adaptations, its ranks
        if config.warmup_steps and not config.resume:
            _warm_up(trainer, config, urls, out, stack.token)
        check = evaluate
        diagnosis: dict[str, float] = {}  # the agent's: where its held-out trajectories go wrong
        if agent:  # greedy trajectories in the environment, under the whole response's budget
            from .demo.task import evaluate_agent

            decode = getattr(trainer, "tokenizer", None)
            check = functools.partial(
                evaluate_agent,
                max_new_tokens=config.max_new_tokens,
                decode=decode.decode if decode is not None else None,
                report=diagnosis,
            )
        before = check(urls["rollout"], held_out, token=stack.token) if held_out and main else None
        if before is not None:
            what = HELD_OUT[config.demo_task]
            console.print(f"Greedy accuracy on {len(held_out)} held-out {what} before RL: {before:.0%}")
            _show_diagnosis(diagnosis)
        loop = LoopConfig(
            mode=config.mode,
            steps=config.steps,
            n=config.n,
            groups_per_step=config.groups_per_step,
            max_new_tokens=config.max_new_tokens,
            max_tokens_per_batch=config.max_tokens_per_batch,
            urls=urls,
            token=stack.token,
            out=out,
            checkpoint_every=config.checkpoint_every,
            resume=config.resume,
            # On Ray: publish to the engines there are at the time, and record each weights folder first.
            engines=cluster_engines if config.ray else None,
            on_weights=record_weights if config.ray else None,
            weights=_weights(config),
            evaluation=_evaluation(config, held_out),
        )
        ranks = f", {parallel.world_size} data-parallel ranks" if parallel is not None else ""
        model_parallel = [f"{name} {size}" for name, size in (("tensor", config.tp), ("expert", config.ep)) if size > 1]
        if model_parallel:
            ranks += f" ({config.nproc} ranks: {', '.join(model_parallel)} parallel)"
        if main:
            console.print(f"[bold]RL ({config.mode})[/bold]: {config.steps} steps, n={config.n}, lr={config.lr}{ranks}")
        names, settings = (parse_report_to(config.report_to), save_run_config(config, out)) if main else ([], {})
        trackers = Trackers.open(names, run_dir=out, run_name=f"{config.mode}-{config.trainer}", config=settings)
        closing.callback(trackers.close)
        first_step: list[int] = []  # this run's first step (after a checkpoint's when resumed): where the ETA starts

        def on_step(record: dict[str, Any]) -> None:
            if not first_step:
                first_step.append(record["step"])
            _show(record, total=config.steps, resumed_at=first_step[0] - 1)
            trackers.log(record)

        records = run_loop(trainer, rows, loop, on_step=on_step if main else None)
        if not main:
            return 0
        after = check(urls["rollout"], held_out, token=stack.token) if held_out else None
        _show_diagnosis(diagnosis)
        plot = plot_runs({config.mode: records}, out / "reward.png")
        if records:
            _summary(records, before, after, plot, HELD_OUT[config.demo_task])
        console.print(f"metrics: {out / 'metrics.jsonl'}", soft_wrap=True)
        console.print(f"plot: {plot}", soft_wrap=True)
        if any("mismatch/all/kl" in r for r in records):  # the trainer's monitor (trainer.mismatch)
            from trainer.mismatch import plot_mismatch

            console.print(f"train-inference mismatch: {plot_mismatch(records, out / 'mismatch.png')}", soft_wrap=True)
        runs = _runs(config.home / "train")
        if len(runs) > 1:  # the other mode ran here before: compare them on one plot
            console.print(f"compared ({', '.join(runs)}): {plot_runs(runs, config.home / 'train' / 'compare.png')}")
        return 0
    finally:
        if parallel is not None:
            parallel.barrier()  # every rank is done with the stack before rank 0 stops it
        closing.close()
        stack.stop()  # an attached stack has no children here: nothing is stopped
