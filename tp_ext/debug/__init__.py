"""Debug tools: is the model deterministic and its replicated activations equal on every TP rank
(:func:`check_determinism`), is the work shared out evenly (:func:`shard_balance`), how much of a
step is communication (:func:`comm_share`), a profiler trace with tp_ext's tags (:func:`trace`),
and the environment (:func:`doctor`, ``tp-ext doctor``)."""

from tp_ext.debug.balance import BalanceReport, RankShare, shard_balance
from tp_ext.debug.determinism import DeterminismReport, check_determinism
from tp_ext.debug.doctor import Check, doctor
from tp_ext.debug.memory import PeakMemory
from tp_ext.debug.timing import CommShare, comm_share, trace

__all__ = [
    "BalanceReport",
    "Check",
    "CommShare",
    "DeterminismReport",
    "PeakMemory",
    "RankShare",
    "check_determinism",
    "comm_share",
    "doctor",
    "shard_balance",
    "trace",
]
