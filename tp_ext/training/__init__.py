"""Training a tp_ext model: AdamW with Megatron's parameter groups and the LR schedule
(:mod:`.optimizer`), the TP-aware gradient norm and clipping (:mod:`.grad_norm`), the
:class:`Trainer` (:mod:`.trainer`) composed of a step strategy per parallel form
(:mod:`.steps`), its loop :meth:`Trainer.fit` (:mod:`.loop`), its checkpoints (:mod:`.state`)
and a directory of them (:mod:`.checkpoint_dir`)."""

from tp_ext.training.checkpointer import CheckpointManager
from tp_ext.training.grad_norm import clip_grad_norm_, grad_norm
from tp_ext.training.optimizer import OptimizerSettings, build_lr_scheduler, build_optimizer
from tp_ext.training.trainer import Trainer

__all__ = [
    "OptimizerSettings",
    "build_optimizer",
    "build_lr_scheduler",
    "grad_norm",
    "clip_grad_norm_",
    "Trainer",
    "CheckpointManager",
]
