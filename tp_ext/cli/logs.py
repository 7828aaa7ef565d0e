"""The commands' logging: ``logging.getLogger("tp_ext")`` and its children, set up once per
command by :func:`configure`.

- Rank 0 logs at ``--log-level`` (default info); every other rank at warning, so a job of N
  ranks prints its progress once, while a warning or an error still shows on whichever rank
  hits it.
- Notes, progress and warnings go to stderr as plain lines (the message only: each already says
  which command it comes from).
- A command's report (the checks of ``tp-ext run`` and ``tp-ext demo``) is its product: it goes
  to stdout through :data:`REPORT`, under the same levels (``--log-level warning`` leaves only
  the exit status and what went wrong).
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["LOG", "REPORT", "LEVELS", "add_log_level", "configure"]

LOG = logging.getLogger("tp_ext")
REPORT = logging.getLogger("tp_ext.cli.report")
LEVELS = ("debug", "info", "warning", "error", "critical")


class _Stream(logging.StreamHandler):
    """A handler writing to ``sys.stdout`` or ``sys.stderr`` as they are when a record comes,
    not when the handler was made (pytest's capsys and notebooks replace them)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self._name = name
        self.setFormatter(logging.Formatter("%(message)s"))

    @property
    def stream(self):
        return getattr(sys, self._name)

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ sets it; the property decides
        pass


def add_log_level(parser) -> None:
    parser.add_argument(
        "--log-level",
        choices=LEVELS,
        default="info",
        help="what rank 0 prints (default info); the other ranks print warnings and errors only",
    )


def configure(level: str = "info", rank: int | None = None) -> None:
    """Send tp_ext's records to stderr and the report to stdout, at ``level`` on rank 0 (RANK,
    as torchrun sets it) and warning on the others. Calling it again replaces what an earlier
    call set (tests and notebooks run several commands in one process)."""
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    chosen = getattr(logging, level.upper())
    LOG.setLevel(chosen if rank == 0 else max(chosen, logging.WARNING))
    for logger, stream in ((LOG, "stderr"), (REPORT, "stdout")):
        for handler in [h for h in logger.handlers if isinstance(h, _Stream)]:
            logger.removeHandler(handler)
        logger.addHandler(_Stream(stream))
    REPORT.propagate = False  # the report goes to stdout only
