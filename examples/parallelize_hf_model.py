"""Tensor-parallelise a Hugging Face model you already have, and check it against the original.

torchrun --nproc-per-node 2 examples/parallelize_hf_model.py
"""

import copy

import torch
import transformers

import tp_ext


def main() -> None:
    state = tp_ext.init_parallel(tp=2)
    config = transformers.Qwen2Config(
        vocab_size=1001,
        hidden_size=64,
        intermediate_size=44,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)  # the same full weights on every rank
    reference = transformers.Qwen2ForCausalLM(config)
    model, report = tp_ext.parallelize(copy.deepcopy(reference), "auto", return_report=True)

    ids = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (model(ids).logits - reference(ids).logits).abs().max().item()
    if state.rank == 0:
        for name in ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj", "lm_head"):
            print(f"{name}: {report[name]}")
        print(f"max |logits - unsharded logits| = {diff:.2e}")
        print("ok" if diff < 1e-4 else "MISMATCH")


if __name__ == "__main__":
    main()
