"""Tensor-parallelise an existing model in place: a plan (``"auto"`` or name patterns -> styles)
decides each module's style (:mod:`.plan`), the styles (classes such as :class:`Colwise`, or their
string aliases) swap modules for tp_ext layers keeping each rank's slice of the weights
(:mod:`.styles`), and sequence parallelism is added by hooks (:mod:`.sequence_parallel`).
:func:`parallelize` (:mod:`.api`) applies them; with pipeline parallelism it returns this rank's
stages of a Hugging Face causal LM (:class:`StagedCausalLM`, :mod:`.stages`).

``tp_ext.parallelize`` at the top level is the function; import this package's pieces by their
module paths (``from tp_ext.parallelize.plan import auto_plan``)."""

from tp_ext.parallelize import sequence_parallel, stages, styles
from tp_ext.parallelize.api import parallelize
from tp_ext.parallelize.plan import STYLES, auto_plan, resolve_plan
from tp_ext.parallelize.stages import StagedCausalLM
from tp_ext.parallelize.styles import (
    ALIASES,
    Colwise,
    Experts,
    Heads,
    ParallelStyle,
    Replicate,
    Rowwise,
    SequenceParallel,
    SharedInput,
    StyleTarget,
    VocabParallel,
)

__all__ = [
    "parallelize",
    "StagedCausalLM",
    "auto_plan",
    "resolve_plan",
    "STYLES",
    "ALIASES",
    "ParallelStyle",
    "StyleTarget",
    "Colwise",
    "Rowwise",
    "VocabParallel",
    "Experts",
    "Heads",
    "SequenceParallel",
    "SharedInput",
    "Replicate",
    "sequence_parallel",
    "stages",
    "styles",
]
