"""Training a tp_ext model: AdamW with Megatron's parameter groups (:mod:`.optimizer`), the
TP-aware gradient norm and clipping (:mod:`.grad_norm`), and the :class:`Trainer`
(:mod:`.trainer`)."""

from tp_ext.training.grad_norm import clip_grad_norm_, grad_norm
from tp_ext.training.optimizer import OptimizerSettings, build_optimizer
from tp_ext.training.trainer import Trainer

__all__ = ["OptimizerSettings", "build_optimizer", "grad_norm", "clip_grad_norm_", "Trainer"]
