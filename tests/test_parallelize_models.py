"""parallelize(model, "auto") on tiny random configs of the decoders users bring from transformers,
at TP 2, 3 and 4: logits, loss and every gradient equal to the unsharded model's, or a clear
refusal naming the module before anything runs. The decisions are listed in
docs/layers.md ("parallelize")."""

import contextlib
import copy
import io
import os

import pytest
import torch
import transformers

import tp_ext
from tp_ext.layers import local_shards
from tp_ext.parallelize.styles import is_conv1d

from .dist_utils import rank, run_distributed
from .test_layers import assert_rel

VOCAB = 101  # not divisible by 2 or 3
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    intermediate_size=44,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def _cfg(name, **extra):
    cls = getattr(transformers, name)
    return cls(**{**COMMON, **extra})


# (architecture, config factory, model class, expected: "exact" or a fragment of the refusal)
CASES = [
    ("llama", lambda: _cfg("LlamaConfig"), "LlamaForCausalLM", "exact"),
    ("mistral", lambda: _cfg("MistralConfig"), "MistralForCausalLM", "exact"),
    ("qwen2", lambda: _cfg("Qwen2Config"), "Qwen2ForCausalLM", "exact"),
    (
        "qwen2 tied",
        lambda: _cfg("Qwen2Config", tie_word_embeddings=True),
        "Qwen2ForCausalLM",
        "exact",
    ),
    ("qwen3", lambda: _cfg("Qwen3Config", head_dim=8), "Qwen3ForCausalLM", "exact"),
    ("gemma", lambda: _cfg("GemmaConfig", head_dim=8), "GemmaForCausalLM", "exact"),
    ("gemma2", lambda: _cfg("Gemma2Config", head_dim=8), "Gemma2ForCausalLM", "exact"),
    ("gemma3", lambda: _cfg("Gemma3TextConfig", head_dim=8), "Gemma3ForCausalLM", "exact"),
    (
        "mixtral",
        lambda: _cfg("MixtralConfig", num_local_experts=4),
        "MixtralForCausalLM",
        "exact",
    ),
    (
        "qwen2-moe",  # routed experts and a gated shared expert
        lambda: _cfg(
            "Qwen2MoeConfig",
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=20,
            shared_expert_intermediate_size=28,
        ),
        "Qwen2MoeForCausalLM",
        "exact",
    ),
    ("phi3", lambda: _cfg("Phi3Config", pad_token_id=0), "Phi3ForCausalLM", "exact"),
    (
        "gpt2",
        lambda: transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=48, n_layer=2, n_head=6, n_positions=64
        ),
        "GPT2LMHeadModel",
        "exact",
    ),
    (
        "gpt2 cross-attention",  # c_attn is [k | v] there, q in q_attn: not split by auto
        lambda: transformers.GPT2Config(
            vocab_size=VOCAB,
            n_embd=48,
            n_layer=2,
            n_head=6,
            n_positions=64,
            add_cross_attention=True,
        ),
        "GPT2LMHeadModel",
        "crossattention.c_attn",
    ),
    (
        "opt",
        lambda: transformers.OPTConfig(
            vocab_size=VOCAB,
            hidden_size=48,
            ffn_dim=44,
            num_hidden_layers=2,
            num_attention_heads=6,
            max_position_embeddings=64,
            word_embed_proj_dim=48,
        ),
        "OPTForCausalLM",
        "exact",
    ),
    (
        "falcon",
        lambda: transformers.FalconConfig(
            vocab_size=VOCAB, hidden_size=48, num_hidden_layers=2, num_attention_heads=6
        ),
        "FalconForCausalLM",
        "exact",
    ),
    (
        "falcon classic",  # one KV head per query head, fused per head as [q, k, v]
        lambda: transformers.FalconConfig(
            vocab_size=VOCAB,
            hidden_size=48,
            num_hidden_layers=2,
            num_attention_heads=6,
            multi_query=False,
            bias=True,
        ),
        "FalconForCausalLM",
        "exact",
    ),
    (
        "falcon new",  # new_decoder_architecture: fused per KV group as [q, q, k, v]
        lambda: transformers.FalconConfig(
            vocab_size=VOCAB,
            hidden_size=48,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_kv_heads=4,
            new_decoder_architecture=True,
        ),
        "FalconForCausalLM",
        "exact",
    ),
    (
        "gpt-neox",
        lambda: transformers.GPTNeoXConfig(
            vocab_size=VOCAB,
            hidden_size=48,
            intermediate_size=44,
            num_hidden_layers=2,
            num_attention_heads=6,
        ),
        "GPTNeoXForCausalLM",
        "exact",
    ),
    ("starcoder2", lambda: _cfg("Starcoder2Config"), "Starcoder2ForCausalLM", "exact"),
]


def _build(config_fn, model_name):
    config = config_fn()
    config._attn_implementation = "eager"  # every architecture has it (sdpa not all)
    torch.manual_seed(0)  # the same full weights on every rank
    return getattr(transformers, model_name)(config).float().eval()


def _check_architectures(sequence_parallel=False):
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    seen = {}
    for arch, config_fn, model_name, expected in CASES:
        reference = _build(config_fn, model_name)
        model = copy.deepcopy(reference)
        if sequence_parallel and arch in SP_REFUSED:
            with pytest.raises(ValueError, match="sequence_parallel"):
                tp_ext.parallelize(model, "auto", sequence_parallel=True)
            seen[arch] = "refused"
            continue
        if expected != "exact":
            with pytest.raises(ValueError, match=expected) as info:
                tp_ext.parallelize(model, "auto")
            assert "Pass a plan" in str(info.value), (arch, str(info.value))
            assert not any(isinstance(m, tp_ext.layers.ParallelModule) for m in model.modules())
            seen[arch] = "refused"
            continue
        model, report = tp_ext.parallelize(
            model, "auto", return_report=True, sequence_parallel=sequence_parallel
        )
        if sequence_parallel:  # the residual stream is split along the sequence in every layer
            splits = [n for n, what in report.items() if what.startswith("sequence parallel")]
            assert len(splits) == 1, (arch, splits)
            reduce_scattered = [n for n, what in report.items() if "reduce-scattered" in what]
            assert len(reduce_scattered) == 4, (arch, reduce_scattered)  # 2 per layer
        if not sequence_parallel and arch in ("llama", "mixtral"):
            # q, k and v alone read the norm's output: their input gradients all-reduced once
            assert report["model.layers.0.input_layernorm"].startswith("shared_input"), report
            # gate and up too, but Mixtral's replicated router reads its second norm as well
            shared_mlp = report.get("model.layers.0.post_attention_layernorm", "")
            shared_mlp = shared_mlp.startswith("shared_input")
            assert shared_mlp == (arch == "llama"), (arch, report)
        # Llama's RMSNorm formula runs through the fused op; Gemma's (1 + weight) does not
        fused = [n for n, what in report.items() if what.endswith("fused rms_norm op")]
        if arch in ("llama", "mixtral", "qwen3"):
            assert "model.norm" in fused, (arch, report)
        if arch.startswith("gemma"):
            assert not fused, (arch, fused)
        with torch.no_grad():
            assert_rel(model(ids).logits, reference(ids).logits, f"{arch}: logits")
        seen[arch] = "exact"
        if arch in ("qwen2 tied", "gemma3", "opt", "gpt2"):  # ties kept: one parameter
            head, embed = model.lm_head, model.get_input_embeddings()
            assert head.weight is embed.weight, f"{arch}: the tie was broken"
            assert "tied" in report["lm_head"], report["lm_head"]
        # Loss and every parameter's gradient (eval mode: no dropout, the same on every rank).
        loss = model(ids, labels=ids).loss
        expected_loss = reference(ids, labels=ids).loss
        assert_rel(loss.detach(), expected_loss.detach(), f"{arch}: loss")
        loss.backward()
        expected_loss.backward()
        # full tensors in the original modules' layout (GPT-2's Conv1D: [in, out])
        grads = {n: p.grad for n, p in reference.named_parameters()}
        expected_grads = local_shards(model, grads)
        for name, p in model.named_parameters():
            if name.endswith("k_proj.bias"):
                # softmax ignores a bias on every key alike: the true gradient is 0 and both
                # sides hold rounding noise, so measure it against the weight's gradient
                scale = expected_grads[name.replace(".bias", ".weight")].abs().max()
                err = ((p.grad - expected_grads[name]).abs().max() / scale).item()
                assert err <= 1e-5, f"{arch}: gradient of {name}: error {err:.3g}"
                continue
            assert_rel(p.grad, expected_grads[name], f"{arch}: gradient of {name}")
    return seen


@pytest.mark.parametrize("ws", [2, 3, 4])  # 4: more ranks than KV heads (replicated)
def test_auto_on_the_decoders_users_bring(ws):
    seen = run_distributed(_check_architectures, ws, timeout=600)[0]
    assert seen == {arch: ("exact" if e == "exact" else "refused") for arch, _, _, e in CASES}


# OPT flattens batch and sequence before its MLP's norm: refused with the reason
SP_REFUSED = ("opt",)


@pytest.mark.parametrize("ws", [2, 3])  # 3: 7 tokens split unevenly along the sequence
def test_auto_with_sequence_parallelism_on_the_decoders_users_bring(ws):
    seen = run_distributed(_check_architectures, ws, True, timeout=600)[0]
    assert seen == {
        arch: ("exact" if e == "exact" and arch not in SP_REFUSED else "refused")
        for arch, _, _, e in CASES
    }


def _check_frozen_parameters_with_sequence_parallel(arch):
    config = (
        (lambda: _cfg("Qwen3Config", head_dim=8))
        if arch == "qwen3"
        else (lambda: _cfg("Qwen2Config"))
    )
    reference = _build(config, f"{'Qwen3' if arch == 'qwen3' else 'Qwen2'}ForCausalLM").train()
    for name, p in reference.named_parameters():  # fine-tuning: freeze everything but the MLPs
        p.requires_grad_("mlp" in name)
    model = tp_ext.parallelize(copy.deepcopy(reference), "auto", sequence_parallel=True)
    frozen = {n for n, p in reference.named_parameters() if not p.requires_grad}
    assert {n for n, p in model.named_parameters() if not p.requires_grad} == frozen
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))
    model(ids, labels=ids).loss.backward()
    reference(ids, labels=ids).loss.backward()
    grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    expected = local_shards(model, grads)
    for name, p in model.named_parameters():
        if name in frozen:
            assert p.grad is None, name
        else:
            assert_rel(p.grad, expected[name], f"gradient of {name}")


@pytest.mark.parametrize("ws", [2, 3])
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])  # qwen3: per-head norms stay head-local
def test_frozen_parameters_with_sequence_parallel(ws, arch):
    run_distributed(_check_frozen_parameters_with_sequence_parallel, ws, arch)


def _check_misuse():
    model = _build(lambda: _cfg("Qwen2Config"), "Qwen2ForCausalLM")
    with pytest.raises(ValueError, match="plan must be 'auto' or a dict"):
        tp_ext.parallelize(model, "Auto")
    tp_ext.parallelize(model, "auto")
    with pytest.raises(ValueError, match="already holds tp_ext layers"):
        tp_ext.parallelize(model, "auto")
    tied = _build(lambda: _cfg("Qwen2Config", tie_word_embeddings=True), "Qwen2ForCausalLM")
    with pytest.raises(ValueError, match="share a parameter"):
        tp_ext.parallelize(tied, {"model.embed_tokens": "vocab", "lm_head": "replicate"})
    heads = _build(
        lambda: _cfg("Qwen2Config", num_attention_heads=2, num_key_value_heads=1, hidden_size=16),
        "Qwen2ForCausalLM",
    )
    with pytest.raises(ValueError, match="cannot be split over 3 ranks"):
        tp_ext.parallelize(heads, "auto")
    llama = _build(lambda: _cfg("LlamaConfig"), "LlamaForCausalLM")
    with pytest.raises(TypeError, match="fused_norms must be True or False, got 'yes'"):
        tp_ext.parallelize(llama, "auto", fused_norms="yes")
    tp_ext.parallelize(llama, "auto", fused_norms=False)  # the norms stay Hugging Face's
    assert type(llama.model.norm).__name__ == "LlamaRMSNorm"


def test_misuse_is_refused_clearly():
    run_distributed(_check_misuse, 3)


def _check_explain():
    model = _build(lambda: _cfg("Qwen2MoeConfig", num_experts=4), "Qwen2MoeForCausalLM")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        _, report = tp_ext.parallelize(model, "auto", explain=True, return_report=True)
    printed = out.getvalue()
    why = report["model.layers.0.self_attn.q_proj"]
    assert why.startswith("colwise") and "reads the residual stream" in why, why
    assert "writes the residual stream" in report["model.layers.0.self_attn.o_proj"]
    assert "MoE experts" in report["model.layers.0.mlp.experts"]
    assert "kept whole" in report["model.layers.0.mlp.shared_expert_gate"]
    return printed


def test_explain_prints_each_decision_and_why():
    printed = run_distributed(_check_explain, 2)
    assert "model.layers.0.mlp.experts" in printed[0] and "[why: " in printed[0], printed[0]
    assert printed[1] == ""  # rank 0 only


class _TiedWithBias(torch.nn.Module):
    """PyTorch's weight-tying test model: a head with a bias whose weight is the embedding's."""

    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(16, 8)
        self.fc = torch.nn.Linear(8, 16)
        self.fc.weight = self.embedding.weight

    def forward(self, ids):
        return self.fc(self.embedding(ids))


def _check_tied_head_with_bias():
    torch.manual_seed(0)
    reference = _TiedWithBias()
    model = copy.deepcopy(reference)
    tp_ext.parallelize(model, {"embedding": "vocab", "fc": "vocab"})
    assert model.fc.weight is model.embedding.weight, "the tie was kept"
    ids = torch.tensor([[1, 5, 15, 0], [7, 7, 3, 12]])
    out, expected = model(ids), reference(ids)
    assert_rel(out, expected, "logits of a tied head with a bias")
    out.pow(2).sum().backward()
    expected.pow(2).sum().backward()
    # this rank's blocks of the reference's gradients (the tied weight once, with both uses)
    full = {name: p.grad for name, p in reference.named_parameters()}
    expected_grads = tp_ext.layers.local_shards(model, full)
    grads = {name: p.grad for name, p in model.named_parameters()}
    assert set(grads) == set(expected_grads) == {"embedding.weight", "fc.bias"}
    for name, grad in grads.items():
        assert_rel(grad, expected_grads[name], f"gradient of {name}")
    assert set(tp_ext.layers.full_state_dict(model)) == set(reference.state_dict())


@pytest.mark.parametrize("ws", [1, 2, 3])
def test_a_tied_head_with_a_bias_splits_the_bias_with_the_vocabulary(ws):
    run_distributed(_check_tied_head_with_bias, ws)


def _check_gpt2_export_round_trip(directory):
    """A converted GPT-2's full state is transformers' own (Conv1D weights [in, out]): equal
    to the unsharded model's, loadable back, and a save_pretrained export of it loads in
    transformers with equal logits."""
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=48, n_layer=2, n_head=6, n_positions=64
    )
    reference = _build(lambda: config, "GPT2LMHeadModel")
    model = tp_ext.parallelize(copy.deepcopy(reference), "auto")
    assert any(is_conv1d(m) for m in reference.modules())
    full = tp_ext.layers.full_state_dict(model)
    expected = reference.state_dict()
    assert set(full) == set(expected)
    for name, tensor in full.items():
        assert tensor.shape == expected[name].shape, (name, tensor.shape, expected[name].shape)
        assert torch.equal(tensor, expected[name]), name
    assert tp_ext.layers.full_shapes(model) == {n: tuple(t.shape) for n, t in expected.items()}
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = reference(ids).logits
        blank = tp_ext.parallelize(copy.deepcopy(reference), "auto")
        for p in blank.parameters():
            p.zero_()
        tp_ext.layers.load_full_state_dict(blank, expected)  # transformers' layout goes in
        assert_rel(blank(ids).logits, logits, "logits after load_full_state_dict")
    if rank() == 0:
        reference.save_pretrained(directory, state_dict=full)
        loaded = transformers.GPT2LMHeadModel.from_pretrained(directory).float().eval()
        with torch.no_grad():
            assert_rel(loaded(ids).logits, logits, "logits of the export, read by transformers")
    # tp_ext's own merged save and its sliced load, in the same layout
    from safetensors.torch import load_file

    from tp_ext import checkpoint

    merged = os.path.join(directory, "merged")
    checkpoint.save_hf_checkpoint(model, merged)
    saved = load_file(os.path.join(merged, "model.safetensors"))
    assert saved, "nothing saved"
    for name, tensor in saved.items():
        assert torch.equal(tensor, expected[name]), name
    if rank() == 0:
        loaded = transformers.GPT2LMHeadModel.from_pretrained(merged).float().eval()
        with torch.no_grad():
            assert_rel(loaded(ids).logits, logits, "logits of tp_ext's merged save in transformers")
    with torch.no_grad():
        for p in blank.parameters():
            p.zero_()
        checkpoint.load_hf_checkpoint(blank, merged, progress=False)
        assert_rel(blank(ids).logits, logits, "logits after tp_ext's merged save and load")


@pytest.mark.parametrize("ws", [1, 2, 3])
def test_a_converted_gpt2_exports_transformers_layout(ws, tmp_path):
    run_distributed(_check_gpt2_export_round_trip, ws, str(tmp_path))


def test_fused_norms_compute_what_hugging_face_norms_compute():
    """The norms parallelize runs through the fused op: Llama's formula only (Gemma's 1 + weight
    and OLMo 2's single rounding left alone, and fp64 weights, which Hugging Face multiplies in
    fp64), the same Parameter under the same name, forward equal (bitwise in bf16) and gradients
    equal up to the last bit of the reference's extra bf16 roundings."""
    from tp_ext.layers import FusedRMSNorm
    from tp_ext.parallelize.modules import fuse_rms_norms

    torch.manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 2**-7)):
        reference = _build(lambda: _cfg("LlamaConfig"), "LlamaForCausalLM").to(dtype)
        for name, param in reference.named_parameters():
            if "norm" in name:
                param.data.normal_(1.0, 0.3)
        fused = copy.deepcopy(reference)
        weights = {n: p for n, p in fused.named_parameters()}
        names = fuse_rms_norms(fused, keep=["model.layers.1.input_layernorm"])
        assert names == [
            "model.layers.0.input_layernorm",
            "model.layers.0.post_attention_layernorm",
            "model.layers.1.post_attention_layernorm",
            "model.norm",
        ], names
        assert isinstance(fused.model.norm, FusedRMSNorm)
        assert type(fused.model.layers[1].input_layernorm).__name__ == "LlamaRMSNorm"
        assert {n: p for n, p in fused.named_parameters()} == weights  # same objects, same names
        x = torch.randn(2, 5, 48, dtype=dtype)
        norm_ref, norm_fused = reference.model.norm, fused.model.norm
        x_ref, x_fused = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_ref, out_fused = norm_ref(x_ref), norm_fused(x_fused)
        if dtype == torch.bfloat16:
            assert torch.equal(out_ref, out_fused)
        grad = torch.randn_like(out_ref)
        out_ref.backward(grad)
        out_fused.backward(grad)
        for got, want in ((out_fused, out_ref), (x_fused.grad, x_ref.grad)):
            assert_rel(got.float(), want.float(), f"{dtype}", rtol=tol)
        assert_rel(
            norm_fused.weight.grad.float(), norm_ref.weight.grad.float(), f"{dtype}", rtol=tol
        )
    assert fuse_rms_norms(_build(lambda: _cfg("LlamaConfig"), "LlamaForCausalLM").double()) == []
    for arch in ("GemmaConfig", "Gemma2Config"):
        gemma = _build(lambda: _cfg(arch, head_dim=8), arch.replace("Config", "ForCausalLM"))
        assert fuse_rms_norms(gemma) == [], arch
    olmo = _build(lambda: _cfg("Olmo2Config"), "Olmo2ForCausalLM")
    assert fuse_rms_norms(olmo) == []
    with pytest.raises(ValueError, match="must be > 0, got 0"):
        FusedRMSNorm(torch.nn.Parameter(torch.ones(4)), 0)
