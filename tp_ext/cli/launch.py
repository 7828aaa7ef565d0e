"""How a command runs: its errors (:func:`run_command`), and what it does when it was not
launched by torchrun (:func:`one_process_unless_launched`)."""

from __future__ import annotations

import contextlib
import os
import socket
import sys

__all__ = [
    "one_process_unless_launched",
    "launch_variables_restored",
    "job_started",
    "refuse",
    "run_command",
]

# Configuration errors a command finds before its job starts: the ones a user fixes by editing
# a flag, a config file or a path.
CONFIG_ERRORS = (ValueError, FileNotFoundError)  # ConfigError is a ValueError
_started = False  # whether the running command reached its job (one_process_unless_launched)


def job_started() -> bool:
    """Whether the command running now has passed its checks and is starting its job."""
    return _started


def refuse(command: str, message) -> int:
    """A configuration error as one line on stderr, on every rank (torchrun stops the others
    once the first exits, so one rank alone could be killed before saying it); exit status 2."""
    print(f"tp-ext {command}: {message}", file=sys.stderr)
    return 2


def run_command(command: str, main, args) -> int:
    """``main(args)``: a configuration error found before the job starts is one line and exit
    status 2; an error in the job itself keeps its traceback (raised: exit status 1)."""
    global _started
    _started = False
    with launch_variables_restored():  # in-process callers (tests, notebooks) get theirs back
        try:
            return main(args)
        except CONFIG_ERRORS as e:
            if _started:
                raise
            return refuse(command, e)
        finally:
            _started = False


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
    before init_parallel, so a command refused earlier leaves the environment as it was; from
    here on, an error is the job's, not a configuration error (see :func:`run_command`)."""
    global _started
    _started = True
    if any(v in os.environ for v in _LAUNCH_VARIABLES):
        return
    with socket.socket() as s:  # free now; torchrun --standalone takes the same small risk
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    one = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    os.environ.update(one, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # printed, not logged: the one process is rank 0, and the note must show at any log level
    print(
        f"tp-ext {command}: not under torchrun, so one process (for N ranks: torchrun "
        f"--standalone --nproc-per-node N -m tp_ext {command} ...)",
        file=sys.stderr,
    )
