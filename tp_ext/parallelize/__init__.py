"""Tensor-parallelise an existing model in place: a plan (``"auto"`` or name patterns -> styles)
decides each module's style (:mod:`.plan`), the styles swap modules for tp_ext layers keeping
each rank's slice of the weights (:mod:`.styles`), and sequence parallelism is added by hooks
(:mod:`.sequence_parallel`). :func:`parallelize` (:mod:`.api`) does all three.

``tp_ext.parallelize`` at the top level is the function; import this package's pieces by their
module paths (``from tp_ext.parallelize.plan import auto_plan``)."""

from tp_ext.parallelize import sequence_parallel, styles
from tp_ext.parallelize.api import parallelize
from tp_ext.parallelize.plan import STYLES, auto_plan, resolve_plan

__all__ = ["parallelize", "auto_plan", "resolve_plan", "STYLES", "sequence_parallel", "styles"]
