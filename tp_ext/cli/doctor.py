"""``tp-ext doctor``: the environment (torch against the one tp_ext was built with, CUDA, NCCL,
backends, shared memory, launcher variables) and what would fail, from
:func:`tp_ext.debug.doctor`. Exit status 1 when a check fails."""

from __future__ import annotations

import dataclasses
import json

from tp_ext.debug import doctor

__all__ = ["add_arguments", "main"]

HELP = (
    "the environment: torch against the one tp_ext was built with, CUDA, NCCL, backends, "
    "shared memory, launcher variables, and what would fail"
)


def add_arguments(parser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def main(args) -> int:
    checks = doctor()
    if args.json:
        print(json.dumps([dataclasses.asdict(c) for c in checks], indent=2))
    else:
        for c in checks:
            print(f"[{c.status:>4}] {c.name:<18} {c.detail}")
    return 1 if any(c.status == "fail" for c in checks) else 0
