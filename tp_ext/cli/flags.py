"""Command-line flags made from the rules of the config fields they set
(:data:`tp_ext.config.PARALLEL_FIELDS`, :data:`tp_ext.training.optimizer.OPTIMIZER_FIELDS`, ...):
each flag's type, bounds, choices and help text come from its field's
:class:`~tp_ext.validation.Field`, so they are written once. Plus the rules of the commands' own
flags (``RUN_FIELDS``, ``TRAIN_FIELDS``)."""

from __future__ import annotations

import argparse

from tp_ext.config import PARALLEL_FIELDS
from tp_ext.training.optimizer import OPTIMIZER_FIELDS
from tp_ext.validation import Field

__all__ = [
    "RUN_FIELDS",
    "TRAIN_FIELDS",
    "SERVE_FIELDS",
    "TOKENIZE_FIELDS",
    "BETA",
    "OVERRIDE_FIELDS",
    "flag_type",
    "add_field_flag",
    "add_override_flags",
    "overrides_of",
]

# tp-ext run's own flags (its parallel ones, --micro-batches included, are config fields:
# PARALLEL_FIELDS). Bounds keep a typo from running for hours or filling memory: the toy batch
# is 4 x micro-batches x dp sequences of 32 tokens, and a step takes about a second.
RUN_FIELDS = {
    "steps": Field("int", 1, 100_000, help="training steps"),
    "max-new-tokens": Field("int", 1, 2**20, help="tokens to generate per sequence"),
    "max-grad-norm": Field("float", 0, low_open=True, help="clip gradients to this norm"),
}
TRAIN_FIELDS = {"steps": Field("int", 1, 10**9, help="train up to this step")}
# tp-ext serve's own flags. The engine's bounds keep one step's tensors (max_num_batched_tokens
# x the vocabulary slice) and the block tables of a typo's size out of memory.
_CHUNK_HELP = "tokens a step computes (prompts are read in chunks of at most it)"
SERVE_FIELDS = {
    "port": Field("int", 1, 65535, help="port to listen on"),
    "max_queue_len": Field("int", 1, 2**20, help="waiting requests beyond which one gets 429"),
    "timeout": Field(
        "float", 0, 86400, low_open=True,
        help="seconds any collective may take before the job fails (a dead rank)",
    ),
    "drain_timeout": Field("float", 0, 86400, help="seconds SIGTERM lets running requests finish"),
    "max_num_seqs": Field("int", 1, 4096, help="requests running at once"),
    "max_num_batched_tokens": Field("int", 1, 2**20, help=_CHUNK_HELP),
    "block_size": Field("int", 1, 1024, help="positions a KV block holds"),
    "max_model_len": Field("int", 1, 2**24, help="prompt + output tokens"),
}  # fmt: skip
TOKENIZE_FIELDS = {"workers": Field("int", 1, 256, help="tokenizing processes")}
BETA = Field("float", 0, 1, high_open=True)  # one of --betas' two values

# The config fields that tp-ext run and train take as flags, in the order --help lists them
# (--auto, which is no field, comes after micro_batches and activation_checkpointing).
_PARALLEL_OVERRIDES = ("tp", "pp", "dp", "ep", "cp", "cp_mode", "schedule", "virtual_stages")
_PARALLEL_OVERRIDES += ("data_parallel", "grad_reduce_dtype", "overlap_param_gather")
_PARALLEL_OVERRIDES += ("micro_batches", "activation_checkpointing")
OVERRIDE_FIELDS = {
    **{name: PARALLEL_FIELDS[name] for name in (*_PARALLEL_OVERRIDES, "dtype", "seed")},
    **{name: OPTIMIZER_FIELDS[name] for name in ("lr", "weight_decay", "betas")},
}


def flag_type(rule: Field):
    """An argparse ``type`` for a flag with this rule: argparse then exits with status 2 and a
    message naming the flag, before torch.distributed starts."""
    parse = int if rule.kind == "int" else float

    def convert(text: str):
        try:
            value = parse(text)
        except ValueError:
            value = None
        if value is None or not rule.ok(value):
            raise argparse.ArgumentTypeError(f"must be {rule.allowed()}, got {text!r}")
        return value

    return convert


def add_field_flag(parser, name: str, rule: Field, default_help: str = "", **options) -> None:
    """``--name`` (underscores as dashes), checked and described by ``rule``: ints and floats
    by its bounds, choices by its choices, a bool as --name / --no-name (None: not given), betas
    as two floats. ``default_help`` says what not giving the flag means for this command;
    ``options`` go to ``add_argument`` as they are (``default=``, ``metavar=``, ...)."""
    kinds = {
        "int": {"type": flag_type(rule)},
        "float": {"type": flag_type(rule)},
        "choice": {"choices": rule.choices},
        "bool": {"action": argparse.BooleanOptionalAction, "default": None},
        "betas": {"type": flag_type(BETA), "nargs": 2},
    }
    text = rule.help + (f" (default: {default_help})" if default_help else "")
    kwargs = {**kinds[rule.kind], "help": text.replace("%", "%%") or None, **options}
    parser.add_argument("--" + name.replace("_", "-"), **kwargs)


def add_override_flags(parser, defaults_help: dict[str, str]) -> None:
    """The flags that override the config's parallel and optimizer sections (run and train),
    with ``--auto``; ``defaults_help``: what a field left out means for this command."""
    group = parser.add_argument_group("overrides of the config's parallel and optimizer settings")
    for name, rule in OVERRIDE_FIELDS.items():
        add_field_flag(group, name, rule, defaults_help.get(name, ""))
        if name == "activation_checkpointing":
            group.add_argument(
                "--auto",
                action="store_true",
                help="take the planner's best candidate that fits these ranks and devices (tp-ext "
                "plan --auto ranks them all); no other dims flag with it",
            )


def overrides_of(args) -> dict:
    """The parallel and optimizer fields the flags set (None: as the config has them)."""
    return {name: getattr(args, name) for name in OVERRIDE_FIELDS}
