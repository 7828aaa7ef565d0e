"""The planner: which parallel degrees and run settings to train a model with. It ranks
candidates (:class:`Candidate`: a :class:`~tp_ext.ParallelDims` and the run settings) by a
memory, communication and time model of tp_ext's own layers (:mod:`.cost`: a step
(:mod:`.step`; a 2D grid's model in :mod:`.cost_2d`) and its :mod:`.memory`, :mod:`.traffic`
and :mod:`.timing`; from the counts of :mod:`.counts`) on a hardware table or this machine
measured (:mod:`.hardware`), every candidate with a reason (:mod:`.search`).

    from tp_ext.planner import plan
    for est in plan(config, gpus=64, gpus_per_node=8, gpu_memory="80GiB", seq_len=4096,
                    global_batch=512):
        print(est.candidate.describe(), est.memory_bytes["total"], est.step_time_s, est.reason)
"""

from tp_ext.planner.candidate import Candidate, Estimate
from tp_ext.planner.cost import bubble_fraction, estimate
from tp_ext.planner.hardware import HARDWARE, Hardware, calibrate, load_hardware
from tp_ext.planner.search import parse_bytes, plan, plan_dims

__all__ = [
    "plan",
    "plan_dims",
    "estimate",
    "Candidate",
    "Estimate",
    "Hardware",
    "HARDWARE",
    "calibrate",
    "load_hardware",
    "bubble_fraction",
    "parse_bytes",
]
