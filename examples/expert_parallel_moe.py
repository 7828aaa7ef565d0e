"""Expert parallelism on a Hugging Face mixture-of-experts model: each rank keeps half of the
experts, tokens travel to their experts' rank and back; checked against the unsharded model,
then trained a few steps with the Trainer.

torchrun --nproc-per-node 2 examples/expert_parallel_moe.py
"""

import copy

import torch
import transformers

import tp_ext
from tp_ext.layers import ExpertParallelMoE


def main() -> None:
    state = tp_ext.init_parallel(tp=1, dp=2, ep=2)  # 2 data-parallel ranks share out the experts
    config = transformers.MixtralConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)  # the same full weights on every rank
    reference = transformers.MixtralForCausalLM(config)
    model = tp_ext.parallelize(copy.deepcopy(reference), "auto", parallel=state)

    # each data-parallel rank has its own batch
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(state.rank))
    with torch.no_grad():
        diff = (model(ids).logits - reference(ids).logits).abs().max().item()
    moe = next(m for m in model.modules() if isinstance(m, ExpertParallelMoE))

    trainer = tp_ext.training.Trainer(
        model, optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-3), parallel=state
    )
    losses = [trainer.step([ids]) for _ in range(5)]
    if state.rank == 0:
        print(f"layer 0: {moe.extra_repr()}")
        print(f"tokens per expert (this rank's batch): {moe.tokens_per_expert.tolist()}")
        print(f"max |logits - unsharded logits| = {diff:.2e}")
        print("losses: " + " ".join(f"{x:.3f}" for x in losses))
        print("ok" if diff < 1e-4 and losses[-1] < losses[0] else "MISMATCH")


if __name__ == "__main__":
    main()
