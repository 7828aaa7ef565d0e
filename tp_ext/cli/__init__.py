"""``tp-ext`` (also ``python -m tp_ext``): the command-line applications on top of the library.
Each command is a module with ``add_arguments(parser)`` and ``main(args) -> int`` (``plan``,
``run``, ``train``, ``generate``, ``demo``, ``doctor``); this one builds the parser from them
and dispatches.

    torchrun --standalone --nproc-per-node 8 -m tp_ext run configs/qwen2-72b.yaml
    torchrun --standalone --nproc-per-node 4 --max-restarts 3 -m tp_ext train \
        configs/train-tiny.yaml --data tokens.bin --steps 100 --checkpoint-dir ckpt
    tp-ext plan configs/qwen2-72b.yaml --tp 8 --pp 4
    torchrun --standalone --nproc-per-node 4 -m tp_ext generate --model DIR --tp 2 --pp 2 \
        --prompt-file prompts.txt --max-new-tokens 64
    torchrun --standalone --nproc-per-node 4 -m tp_ext demo
    torchrun --standalone --nproc-per-node 2 -m tp_ext serve --model DIR --tp 2 --port 8000
    tp-ext tokenize --tokenizer DIR --input corpus.jsonl --output tokens.bin --append-eos
"""

from __future__ import annotations

import argparse
import sys

from tp_ext.cli import demo, doctor, generate, plan, run, serve, tokenize, train
from tp_ext.cli.launch import refuse, run_command
from tp_ext.cli.logs import add_log_level, configure

__all__ = ["main", "COMMANDS"]

# name -> module, in the order --help lists them
COMMANDS = {
    "demo": demo,
    "plan": plan,
    "run": run,
    "doctor": doctor,
    "train": train,
    "generate": generate,
    "serve": serve,
    "tokenize": tokenize,
}
_STARTS_PROCESS_GROUPS = ("demo", "run", "train", "generate", "serve")


def _check_variables(command: str) -> int:
    """Before a command that starts process groups: TP_EXT_* variables that the first
    collective would refuse stop it here, with one line per rank rather than a traceback.
    Returns the exit status to stop with, or 0 to go on."""
    from tp_ext import ops

    error = ops._C._env_error()
    for line in error.splitlines() if error else ():
        refuse(command, line.removeprefix("tp_ext: "))
    return 2 if error else 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tp-ext",
        description="tp_ext's commands: footprints and ranked candidates (plan), the main job, "
        "training, the collectives and the environment (launch run, train and demo with "
        "torchrun)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in COMMANDS.items():
        command = sub.add_parser(name, help=module.HELP)
        module.add_arguments(command)
        add_log_level(command)
    return parser


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    configure(args.log_level)
    if args.command in _STARTS_PROCESS_GROUPS:
        status = _check_variables(args.command)
        if status:
            return status
    return run_command(args.command, COMMANDS[args.command].main, args)


if __name__ == "__main__":
    sys.exit(main())
