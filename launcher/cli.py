"""The ``weir`` command line, built from the role table (`services.roles`).

Commands::

    weir serve ROLE [--host H] [--port P] [--workers N] [--log-level L] [--model DIR|HUB_ID] [--backend B] [--profile F]
                    [--sglang-args JSON]
                                   # one role: preprocess | encoder | data | engine | rollout, at the
                                   # table's port; its settings are WEIR_* variables, checked first
    weir up [--engines N] [--home DIR] [--base-port P] [--model DIR|HUB_ID] [--backend B] [--sglang-args JSON] [--demo]
                                   # every role on localhost behind a generated API token
    weir up --ray [--address ADDR] [--serve-port P] [--write-config FILE]
                                   # every role as a Ray Serve application (a local Ray, or a cluster)
    weir engines add|remove N [--address ADDR]   # engines join or leave a running Ray stack
    weir engines autoscale MIN:MAX[:TARGET]      # … or Serve scales them on what they generate
    weir train (--demo | --dataset F [--split S]) [--mode async|colocate] [--steps N] [--attach] [--ray] …
                                   # the RL loop against a stack it starts (or attaches to)
    weir twin [--profile F] [--gpus N | --nodes 1 2 4 8] [--steps N] [--compression C1 C2] [--modes colocate async-1 …]
                                   # capacity twin: sim engines + sim trainer, real control plane
    weir twin plan --gpus N [--profile F]   # the best engine:trainer split and staleness bound, from the cost model
    weir twin calibrate [--profile F]       # fit the one knob on the profile's published colocate step
    weir prep DATASET --out DIR [--spec FAMILY|MODEL_DIR] [--split S] [budget options]
    weir demo [--out DIR]          # generate a media set, prep it twice (cold, then cached)
    weir export-hf CHECKPOINT OUT [--base MODEL_DIR] [--max-shard-size 2GB]
                                   # a checkpoint of `weir train` (either trainer) as a Hugging Face folder
    weir init-model DIR [--if-missing] [--arch ARCH]
                                   # write a tiny real model folder (eight families)
    weir token --out FILE [--uid UID]    # the API token file the roles share (compose's `token` service)
    weir --version

Every option's default is shown by ``--help``. This module parses and dispatches; each command's options are
declared in `launcher.options` (the twin's in `launcher.twin_command`), the types that check them in
`launcher.arguments`. The roles live in ``services/<role>``, the local stack in `launcher.stack`, the training
run in `launcher.training` (its typed configuration, built from the options, in `launcher.config`), the twin in
the `twin` package; what each command does with its options is `launcher.commands`. The parsed options
(`argparse.Namespace`) never leave this module and `launcher.commands`: each command gets a typed configuration or
plain values.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from services import __version__

from . import options
from .arguments import Parser
from .checks import refusal
from .commands import HANDLERS
from .options import DEFAULT_MAX_SHARD_SIZE
from .twin_command import twin_arguments

# DEFAULT_MAX_SHARD_SIZE: still read here, where tests/trainer/test_export.py checks it is the library's
__all__ = ["DEFAULT_MAX_SHARD_SIZE", "build_parser", "main"]


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends each option's default, unless the help already says it, or the option is a flag or required."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.nargs == 0 or action.required or not action.option_strings:
            return text
        return super()._get_help_string(action) or text


# Each command: its name, the function declaring its options and what it does (its line in `weir --help` and its
# own help's description); in the order `weir --help` lists them. A row a command, its text wrapped below it.
_COMMANDS: tuple[tuple[str, Callable[[argparse.ArgumentParser], None], str], ...] = (
    ("serve", options.serve_arguments,
        "serve one role over HTTP (its settings: WEIR_* variables, checked before it starts)"),
    ("prep", options.prep_arguments, "preprocess a dataset (JSONL/Parquet rows referencing media) into the cache"),
    ("up", options.up_arguments,
        "start every role locally (embedded defaults, a generated API token); Ctrl-C stops them"),
    ("engines", options.engines_arguments, "engines join or leave a running Ray stack (`weir up --ray`)"),
    ("train", options.train_arguments, "start the stack and run the RL loop on a dataset, or on the demo task"),
    ("twin", twin_arguments,
        "capacity twin: the real control plane and RL loop against sim engines and a sim trainer, per mode, at two "
        "compression factors; prints simulated s/step, tokens/s per GPU, speed-up, idle shares, drops"),
    ("export-hf", options.export_hf_arguments,
        "write a checkpoint of `weir train` (--trainer fsdp, one rank or several, or megatron) as a Hugging Face "
        "model folder: sharded safetensors with their index, and the base model's config, tokenizer and processor "
        "files"),
    ("init-model", options.init_model_arguments, "write a tiny real model folder of a supported family"),
    ("demo", options.demo_arguments, "generate a media set and preprocess it (what `make run` runs)"),
    ("token", options.token_arguments,
        "write the API token file the roles share (WEIR_API_TOKEN_FILE): WEIR_API_TOKEN when set, else an existing "
        "file is kept, else a new random token"),
)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="weir", description="Weir: multimodal data pipeline for RL post-training", formatter_class=_HelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"weir {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, declare_options, summary in _COMMANDS:
        declare_options(sub.add_parser(name, help=summary, description=summary, formatter_class=_HelpFormatter))
    return parser


def main(argv: list[str] | None = None) -> int:
    from services.settings import SettingsError

    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # `weir train --nproc N` runs it again per rank
    from preprocess.errors import DatasetError

    from .stack import StackRefusal

    try:
        refused = refusal(args)  # options that cannot go together, ports held, no Ray there: before anything starts
        if refused:
            print(f"weir {args.command}: {refused}", file=sys.stderr)
            return 2
        # `serve` configures its own logging, from the role's settings
        if args.command in ("up", "train", "prep", "demo", "twin", "engines"):
            from services.logs import configure_logging

            configure_logging(os.environ.get("WEIR_LOG_LEVEL", "info"))
        return HANDLERS[args.command](args)
    except SettingsError as error:  # a bad WEIR_* variable: its name and why, no traceback
        print(f"weir {args.command} {getattr(args, 'role', '')}".rstrip() + f": {error}", file=sys.stderr)
        return 2
    except DatasetError as error:  # a dataset (or a row) none of the readers can read, from any command: one line
        print(f"weir {args.command}: {' '.join(str(error).split())} [{error.code}]", file=sys.stderr)
        return 2
    except StackRefusal as error:  # a port taken after the checks, or checked by no one (a rank under torchrun)
        print(f"weir {args.command}: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C (or the supervisor giving up): every role is stopped on the way out
        print(f"weir {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
