"""Command-line flags checked by the same rules as the config fields they override
(:data:`tp_ext.config.PARALLEL_FIELDS`, :data:`tp_ext.training.optimizer.OPTIMIZER_FIELDS`),
plus the rules of ``tp-ext run``'s own flags."""

from __future__ import annotations

import argparse

from tp_ext.validation import Field

__all__ = ["RUN_FIELDS", "TRAIN_FIELDS", "BETA", "flag_type"]

# tp-ext run's own flags (its parallel ones, --micro-batches included, are config fields:
# PARALLEL_FIELDS). Bounds keep a typo from running for hours or filling memory: the toy batch
# is 4 x micro-batches x dp sequences of 32 tokens, and a step takes about a second.
RUN_FIELDS = {
    "steps": Field("int", 1, 100_000),
    "max-new-tokens": Field("int", 1, 2**20),
    "max-grad-norm": Field("float", 0, low_open=True),
}
TRAIN_FIELDS = {"steps": Field("int", 1, 10**9)}
BETA = Field("float", 0, 1, high_open=True)  # one of --betas' two values


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
