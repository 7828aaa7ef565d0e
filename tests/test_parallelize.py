"""tp_ext.parallelize on Hugging Face transformers' Qwen2ForCausalLM: the parallelised model gives
the unsharded model's logits, loss, gradients and greedy generation at TP = 1, 2, 3 and 4
(2 KV heads: replicated at 3 and 4 ranks; vocabulary 1001 and MLP 20: uneven)."""

import copy

import pytest
import torch
import transformers  # noqa: E402  (requirements-dev.txt: missing fails, never skips)

import tp_ext
from tp_ext.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    local_shards,
)

from .dist_utils import rank, run_distributed, world_size
from .test_layers import assert_rel


def _tiny_qwen2():
    config = transformers.Qwen2Config(
        vocab_size=1001,
        hidden_size=32,
        intermediate_size=20,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)  # the same weights on every rank
    return transformers.Qwen2ForCausalLM(config).float()


def _check_qwen2_auto(sequence_parallel):
    reference = _tiny_qwen2()
    model, plan = tp_ext.parallelize(
        copy.deepcopy(reference), "auto", sequence_parallel=sequence_parallel, return_report=True
    )
    if sequence_parallel and world_size() > 1:
        assert plan["model.layers.0.input_layernorm"].startswith("sequence_parallel")
        assert "reduce-scattered" in plan["model.layers.0.mlp.down_proj"]
    assert plan["model.layers.0.self_attn.q_proj"].startswith("colwise: column-parallel by heads")
    assert plan["model.layers.1.mlp.down_proj"].startswith("rowwise")
    assert plan["lm_head"].startswith("vocab") and plan["model.embed_tokens"].startswith("vocab")
    assert isinstance(model.model.embed_tokens, VocabParallelEmbedding)

    ids = torch.randint(0, 1001, (2, 9), generator=torch.Generator().manual_seed(1))  # 9: uneven
    out = model(ids, labels=ids)
    ref_out = reference(ids, labels=ids)
    assert_rel(out.logits, ref_out.logits, "logits")
    assert_rel(out.loss, ref_out.loss, "loss")
    out.loss.backward()
    ref_out.loss.backward()
    expected = local_shards(model, {n: p.grad for n, p in reference.named_parameters()})
    for name, p in model.named_parameters():
        assert_rel(p.grad, expected[name], f"gradient of {name}")

    with torch.no_grad():
        generated = model.generate(ids[:, :4], max_new_tokens=6, do_sample=False)
        ref_generated = reference.generate(ids[:, :4], max_new_tokens=6, do_sample=False)
    assert torch.equal(generated, ref_generated), (generated, ref_generated)


@pytest.mark.parametrize("ws", [1, 2, 3, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_parallelize_auto_on_hf_qwen2_matches_unsharded(ws, sequence_parallel):
    run_distributed(_check_qwen2_auto, ws, sequence_parallel, timeout=300)


def _check_explicit_plan_and_errors():
    reference = _tiny_qwen2()
    plan = {
        "model.layers.*.self_attn.[qkv]_proj": "colwise",
        "model.layers.*.self_attn.o_proj": "rowwise",
        "model.layers.*.mlp.gate_proj": "colwise",
        "model.layers.*.mlp.up_proj": "colwise",
        "model.layers.*.mlp.down_proj": "rowwise",
        "lm_head": "replicate",
    }
    model = tp_ext.parallelize(copy.deepcopy(reference), plan)
    assert isinstance(model.model.layers[1].self_attn.k_proj, ColumnParallelLinear)
    assert isinstance(model.model.layers[1].mlp.down_proj, RowParallelLinear)
    assert isinstance(model.lm_head, torch.nn.Linear)  # replicated
    ids = torch.randint(0, 1001, (1, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert_rel(model(ids).logits, reference(ids).logits, "logits with an explicit plan")

    with pytest.raises(ValueError, match="matches no module"):
        tp_ext.parallelize(copy.deepcopy(reference), {"model.decoder.*": "colwise"})
    with pytest.raises(ValueError, match="is not a style"):
        tp_ext.parallelize(copy.deepcopy(reference), {"lm_head": "columnwise"})
    with pytest.raises(ValueError, match="applies to nn.Linear"):
        tp_ext.parallelize(copy.deepcopy(reference), {"model.norm": "rowwise"})
    if world_size() > 1:
        with pytest.raises(ValueError, match="applies to norm modules"):
            tp_ext.parallelize(
                copy.deepcopy(reference),
                {
                    "model.layers.*.input_layernorm": "sequence_parallel",
                    "model.layers.0.mlp.up_proj": "sequence_parallel",
                },
            )
    return rank()


@pytest.mark.parametrize("ws", [1, 3])
def test_parallelize_explicit_plan_and_bad_plans(ws):
    assert run_distributed(_check_explicit_plan_and_errors, ws) == list(range(ws))


def test_parallelize_refuses_what_is_not_a_module():
    for given in ("model", None):
        with pytest.raises(TypeError, match="parallelize: module must be a torch.nn.Module"):
            tp_ext.parallelize(given, "auto")
