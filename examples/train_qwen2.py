"""Train a small Qwen2 (configs/qwen2-mini.yaml) with tensor parallelism over every rank.

torchrun --nproc-per-node 2 examples/train_qwen2.py
"""

import os

import torch

import tp_ext
from tp_ext.config import JobConfig
from tp_ext.models import Qwen2ForCausalLM
from tp_ext.training import Trainer, build_optimizer

CONFIG = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "configs", "qwen2-mini.yaml"
)


def main() -> None:
    job = JobConfig.from_file(CONFIG)
    state = tp_ext.init_parallel(tp=int(os.environ["WORLD_SIZE"]))
    torch.manual_seed(job.parallel.seed)  # the same full weights at any TP size
    model = Qwen2ForCausalLM(job.model, tp_group=state.tp_group)
    trainer = Trainer(model, build_optimizer(model, job.optimizer), max_grad_norm=1.0)

    g = torch.Generator().manual_seed(1)  # a learnable toy language: counting by 1 to 3
    start = torch.randint(0, job.model.vocab_size, (8, 1), generator=g)
    ids = start + torch.randint(1, 4, (8, 1), generator=g) * torch.arange(32)
    ids = ids % job.model.vocab_size
    losses = [trainer.step(list(ids.chunk(2))) for _ in range(5)]  # 2 micro-batches a step
    if state.rank == 0:
        print("loss: " + " -> ".join(f"{x:.3f}" for x in losses))
        print("ok" if losses[-1] < losses[0] else "LOSS DID NOT FALL")


if __name__ == "__main__":
    main()
