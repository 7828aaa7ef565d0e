"""How a command that starts process groups runs when it was not launched by torchrun."""

from __future__ import annotations

import contextlib
import os
import socket
import sys

__all__ = ["one_process_unless_launched", "launch_variables_restored"]

_LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_SET_HERE = (*_LAUNCH_VARIABLES, "LOCAL_RANK", "LOCAL_WORLD_SIZE")


@contextlib.contextmanager
def launch_variables_restored():
    """The variables one_process_unless_launched sets, as they were before, once a command is
    done: a second command in the same process is not taken for one torchrun launched."""
    before = {k: os.environ.get(k) for k in _SET_HERE}
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def one_process_unless_launched(command: str) -> None:
    """Outside torchrun (none of its variables set), set the environment of the one process
    `torchrun --standalone --nproc-per-node 1` would start, on a free local port. Called just
    before init_parallel, so a command refused earlier leaves the environment as it was."""
    if any(v in os.environ for v in _LAUNCH_VARIABLES):
        return
    with socket.socket() as s:  # free now; torchrun --standalone takes the same small risk
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    one = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    os.environ.update(one, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    print(
        f"tp-ext {command}: not under torchrun, so one process (for N ranks: torchrun "
        f"--standalone --nproc-per-node N -m tp_ext {command} ...)",
        file=sys.stderr,
    )
