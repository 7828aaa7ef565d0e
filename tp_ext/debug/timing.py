"""comm_share: the fraction of a step spent communicating, per tag; trace: a torch.profiler trace
(Chrome / Perfetto JSON) per rank, where tp_ext's tags are ranges beside the ops.

What "time" is depends on the device. On CPU (gloo, the shared-memory channel) tp_ext's
collectives block until done, so :func:`tp_ext.comm.track`'s seconds are the communication's
duration, and the share is measured. On CUDA (NCCL) a collective returns once enqueued:
comm_share then times the step with CUDA events and takes the communication's time from the
profiler's device kernels (NCCL's), and reports the per-tag host seconds as enqueue time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from typing import Callable, Optional

import torch

from tp_ext.distributed import comm

__all__ = ["comm_share", "CommShare", "trace"]


@dataclasses.dataclass
class CommShare:
    step_seconds: float
    comm_seconds: float
    by_tag: dict[str, float]  # seconds per tag (CUDA: host enqueue time)
    device_time: bool  # True: comm_seconds are device (kernel) time, by_tag enqueue time

    @property
    def share(self) -> float:
        return self.comm_seconds / self.step_seconds if self.step_seconds > 0 else 0.0

    def __str__(self) -> str:
        kind = "device time of NCCL kernels" if self.device_time else "measured"
        lines = [
            f"communication {self.comm_seconds * 1e3:.2f} ms of a {self.step_seconds * 1e3:.2f} "
            f"ms step: {self.share * 100:.1f}% ({kind})"
        ]
        label = "ms enqueued" if self.device_time else "ms"
        for tag, seconds in sorted(self.by_tag.items(), key=lambda kv: -kv[1]):
            lines.append(f"  {tag:<20} {seconds * 1e3:9.3f} {label}")
        return "\n".join(lines)


def comm_share(fn: Callable[[], object], device: Optional[torch.device] = None) -> CommShare:
    """Run ``fn`` (one step) once and measure the share of it spent in tp_ext's collectives."""
    if device is None:  # the CUDA path whenever a GPU is in use
        device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = torch.device(device).type == "cuda"
    if not cuda:
        with comm.track() as stats:
            t0 = time.perf_counter()
            fn()
            total = time.perf_counter() - t0
        tags = {r.tag for r in stats.records}
        by_tag = {t: stats.seconds(tag=t) for t in tags}
        return CommShare(total, stats.seconds(), by_tag, device_time=False)
    from torch.profiler import ProfilerActivity, profile

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with comm.track() as stats, profile(activities=[ProfilerActivity.CUDA]) as prof:
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if "nccl" in e.name.lower()]
    # (device_time_total; cuda_time_total in older torch)
    device_us = sum(getattr(e, "device_time_total", None) or e.cuda_time_total for e in kernels)
    tags = {r.tag for r in stats.records}
    return CommShare(
        start.elapsed_time(end) / 1e3,
        device_us / 1e6,
        {t: stats.seconds(tag=t) for t in tags},
        device_time=True,
    )


@contextlib.contextmanager
def trace(directory: str):
    """Profile the block with torch.profiler and write ``<directory>/trace_rank<r>.json``
    (open it in chrome://tracing or ui.perfetto.dev): tp_ext's ops (``tp_ext::...``) and tags
    (``tp_ext.tag:<name>`` ranges) beside every other op; CUDA kernels too on GPUs."""
    from torch.profiler import ProfilerActivity, profile

    os.makedirs(directory, exist_ok=True)
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    with profile(activities=activities, record_shapes=True) as prof:
        yield prof
    prof.export_chrome_trace(os.path.join(directory, f"trace_rank{rank}.json"))
