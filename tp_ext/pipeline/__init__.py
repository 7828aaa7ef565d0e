"""Pipeline parallelism on torch.distributed.pipelining: a model's stages as PipelineStages,
its data-parallel wrapping (DDP or FSDP2 on the DP mesh dimension), and the named schedules.

A model that can be pipelined provides ``stage_split`` (:class:`tp_ext.sharding.StageSplit`),
``stage_ids`` (the stages this rank holds), ``stage_modules()`` (one module per held stage, in
order) and ``parallel`` (its :class:`tp_ext.ParallelState`); tp_ext's Qwen2 does.
"""

from tp_ext.pipeline.data_parallel import DATA_PARALLEL, wrap_data_parallel
from tp_ext.pipeline.schedules import SCHEDULES, PipelineRunner, check_schedule

__all__ = ["SCHEDULES", "DATA_PARALLEL", "PipelineRunner", "check_schedule", "wrap_data_parallel"]
