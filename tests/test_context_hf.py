"""Context parallelism for Hugging Face decoders (tp_ext/parallelize/context.py): Qwen2, Llama,
Mistral, Qwen3, GPT-2 (learned positions) and Gemma 2 (sliding windows shorter than the
sequence, attention logit soft-capping, query_pre_attn_scalar, final-logit soft-capping) converted
by ``parallelize(model, "auto", parallel=state, cp_mode=...)`` give the logits of this rank's
positions and, summed over CP, every gradient of the unsharded transformers model, at cp 2, 3, 4
and (tp, cp) = (2, 2), ring and all-to-all, at a length (11) that no 2C divides, with sequence
parallelism and inside pipeline stages, on padded batches too; the Trainer trains them (and
Mixtral with expert parallelism, and padded micro-batches) as one process does; what is not
supported is refused by name."""

import copy
from typing import Optional

import pytest
import torch
import torch.nn.functional as F
import transformers

import tp_ext
from tp_ext.parallelize.context import context_of
from tp_ext.parallelize.modules import fuse_rms_norms
from tp_ext.parallelize.transformers_names import cache_argument
from tp_ext.training.zero import ShardedOptimizer

from .dist_utils import run_distributed
from .test_context import assert_same_weights
from .test_parallelize_models import COMMON, VOCAB

SEQ = 11
ARCHS = {  # architecture: (config class, model class, extra config)
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 16}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 8}),
    # sliding windows shorter than the sequence: every layer's, or every other layer's (Gemma 2:
    # attention logit soft-capping, query_pre_attn_scalar's scaling, the final logits capped)
    "mistral_window": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 4}),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        # a small cap and scale, so that the capping bends the scores (at the defaults, 50 and
        # 256, it changes these tiny models' logits by less than 1e-7)
        {
            "head_dim": 8,
            "sliding_window": 4,
            "query_pre_attn_scalar": 2,
            "attn_logit_softcapping": 0.05,
            "final_logit_softcapping": 1.0,
        },
    ),
}
# learned absolute positions, Conv1D projections, a tied head; its own config fields
GPT2 = dict(
    vocab_size=VOCAB, n_embd=48, n_layer=2, n_head=6, n_positions=64,
    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
)  # fmt: skip
OTHERS = {"gpt2": ("GPT2Config", "GPT2LMHeadModel", GPT2)}


def _model(arch: str, dtype=torch.float64, **extra):
    if arch in OTHERS:
        config_class, model_class, fields = OTHERS[arch]
    else:
        config_class, model_class, arch_extra = ARCHS[arch]
        fields = {**COMMON, **arch_extra}
    config = getattr(transformers, config_class)(**{**fields, **extra})
    torch.manual_seed(0)  # the same full weights on every rank
    return getattr(transformers, model_class)(config).to(dtype)


def _ids(batch=2, seed=1):
    return torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


def _padding(ids: torch.Tensor, right_only: bool = False) -> torch.Tensor:
    """A padding mask for ``ids`` (2 rows): row 0 left-padded (its first positions see no key),
    row 1 right-padded; ``right_only``: both rows right-padded by 3, fewer than a window of 4
    (Gemma 2: transformers' eager attention gives a query that sees no key NaN in fp64)."""
    mask = torch.ones_like(ids)
    if right_only:
        mask[:, SEQ - 3 :] = 0
        return mask
    mask[0, :3] = 0
    mask[1, SEQ - 4 :] = 0
    return mask


def _inputs(ids: torch.Tensor, padding: Optional[str]) -> dict:
    """What the model is called with: the ids, and for a padded batch its mask ("mask"; "right":
    right-padded only), and the position ids generation derives from it ("mask+positions")."""
    if padding is None:
        return {}
    mask = _padding(ids, padding == "right")
    if padding in ("mask", "right"):
        return {"attention_mask": mask}
    return {"attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)}


def _check_exact(arch, tp, cp, mode, sp=False, padding=None):
    import torch.distributed as dist

    reference = _model(arch)
    state = tp_ext.init_parallel(tp=tp, cp=cp)
    model, report = tp_ext.parallelize(
        copy.deepcopy(reference),
        "auto",
        parallel=state,
        cp_mode=mode,
        sequence_parallel=sp,
        return_report=True,
    )
    assert report[""].startswith(f"context parallel over {cp} ranks ({mode})"), report[""]
    assert context_of(model).group.size == cp
    ids = _ids()
    extra = _inputs(ids, padding)
    mine = tp_ext.cp_positions(SEQ, parallel=state)
    logits = model(ids, **extra).logits
    expected = reference(ids, **extra).logits
    tol, grad_tol = _tolerances(arch)
    torch.testing.assert_close(logits, expected[:, mine].detach(), **tol)
    targets = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    if padding is not None:  # a padded position predicts nothing and is not predicted
        real = extra["attention_mask"].bool()
        targets = targets.masked_fill(~(real & torch.cat([real[:, 1:], real[:, :1]], 1)), -100)
    F.cross_entropy(logits.flatten(0, 1), targets[:, mine].flatten(), reduction="sum").backward()
    F.cross_entropy(expected.flatten(0, 1), targets.flatten(), reduction="sum").backward()
    want = tp_ext.layers.local_shards(model, {n: p.grad for n, p in reference.named_parameters()})
    for name, param in model.named_parameters():
        grad = param.grad.clone()
        dist.all_reduce(grad, group=state.cp_group)  # the CP ranks' shares of the gradient
        err = (grad - want[name]).abs().max().item() / want[name].abs().max().item()
        assert err < grad_tol, (name, err)
    return mine.tolist()


def _tolerances(arch: str) -> tuple:
    """(logits' assert_close tolerances, gradients' largest relative error): fp64's, or for
    Gemma 2 fp32's (its eager attention, the one that soft-caps, takes the softmax in fp32
    whatever the model's dtype: the reference itself is exact to fp32 only)."""
    if arch == "gemma2":
        return dict(rtol=1e-5, atol=1e-6), 1e-5
    return dict(rtol=1e-9, atol=1e-9), 1e-6


def cp_matrix(dims_cases, subset) -> list:
    """pytest params ``(arch, tp, cp, mode)``: the ``subset`` (make test), then every other
    architecture x ``dims_cases`` ((tp, cp) pairs) x mode case, marked full_matrix."""
    every = [
        (arch, tp, cp, mode)
        for arch in [*ARCHS, *OTHERS]
        for tp, cp in dims_cases
        for mode in ("ring", "all_to_all")
    ]
    return [pytest.param(*case, id="-".join(map(str, case))) for case in subset] + [
        pytest.param(*c, marks=pytest.mark.full_matrix, id=f"{c[0]}-tp{c[1]}-cp{c[2]}-{c[3]}")
        for c in every
        if c not in subset
    ]


# make test: every architecture and dims, both modes
SUBSET = [
    ("llama", 1, 2, "ring"),
    ("qwen3", 1, 3, "all_to_all"),
    ("mistral", 1, 4, "ring"),
    ("qwen2", 2, 2, "all_to_all"),
    ("llama", 2, 2, "ring"),
    ("gpt2", 1, 2, "all_to_all"),
    ("gpt2", 1, 3, "ring"),
    ("gemma2", 1, 2, "ring"),
    ("gemma2", 1, 3, "all_to_all"),
    ("mistral_window", 2, 2, "all_to_all"),
]


@pytest.mark.parametrize("arch, tp, cp, mode", cp_matrix([(1, 2), (1, 3), (1, 4), (2, 2)], SUBSET))
def test_hugging_face_decoders_under_context_parallelism_are_exact(arch, tp, cp, mode):
    held = run_distributed(_check_exact, tp * cp, arch, tp, cp, mode, timeout=300)
    assert sorted(p for positions in held[::tp] for p in positions) == list(range(SEQ))


@pytest.mark.parametrize(
    "arch, tp, cp, mode, padding",
    [
        ("llama", 1, 2, "ring", "mask"),
        ("qwen3", 1, 3, "all_to_all", "mask+positions"),
        ("gpt2", 1, 3, "ring", "mask+positions"),  # learned positions at the given ids
        ("gpt2", 1, 2, "all_to_all", "mask"),
        ("mistral_window", 1, 3, "all_to_all", "mask"),  # windows of padded keys only
        ("gemma2", 1, 2, "ring", "right"),
        pytest.param("gemma2", 1, 3, "all_to_all", "right", marks=pytest.mark.full_matrix),
        pytest.param("mistral_window", 1, 2, "ring", "mask", marks=pytest.mark.full_matrix),
        pytest.param("mistral", 2, 2, "ring", "mask", marks=pytest.mark.full_matrix),
        pytest.param("qwen2", 1, 4, "all_to_all", "mask", marks=pytest.mark.full_matrix),
        pytest.param("llama", 1, 3, "ring", "mask+positions", marks=pytest.mark.full_matrix),
        pytest.param("gpt2", 2, 2, "all_to_all", "mask", marks=pytest.mark.full_matrix),
    ],
    ids=lambda v: str(v),
)
def test_padded_batches_under_context_parallelism_are_exact(arch, tp, cp, mode, padding):
    """A padded batch (left and right padding): no query of any rank sees a padded key; the
    position ids are the model's own, or the ones given (here generation's, from the mask)."""
    run_distributed(_check_exact, tp * cp, arch, tp, cp, mode, False, padding, timeout=300)


@pytest.mark.parametrize("arch, mode", [("llama", "ring"), ("qwen3", "all_to_all")])
def test_sequence_parallelism_composes_with_context_parallelism(arch, mode):
    """tp2 x cp2 with sequence parallelism: each TP rank's share of its CP positions between
    the norms, the same logits and gradients."""
    run_distributed(_check_exact, 4, arch, 2, 2, mode, True, timeout=300)


def _padded(ids: torch.Tensor, gen: torch.Generator, sides: str) -> tuple:
    """``(ids, labels, attention_mask)``: each row padded by 1 to SEQ // 2 positions, on the left
    or the right (``sides`` "both"), or on the right only by 1 to 3 ("right": see
    :func:`_padding`)."""
    mask = torch.ones_like(ids)
    for row in range(ids.size(0)):
        most = 3 if sides == "right" else SEQ // 2
        n = int(torch.randint(1, most + 1, (1,), generator=gen))
        left = sides == "both" and bool(torch.randint(0, 2, (1,), generator=gen))
        mask[row, :n] = 0 if left else 1
        mask[row, SEQ - n :] = 1 if left else 0
    return ids, ids, mask


def _masked_loss(model, batches) -> float:
    """transformers' own mean token loss of padded micro-batches (padding never a target)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for ids, labels, mask in batches:
            logits = model(ids, attention_mask=mask).logits[:, :-1]
            targets = labels.masked_fill(mask == 0, -100)[:, 1:]
            total += F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
            count += int((targets != -100).sum())
    return float(total) / count


def _three_steps(trainer, ref_trainer, state, padding=None, reference=None) -> list:
    """Three steps: each DP replica its two micro-batches of the step's global batch, the
    reference all of them; their losses, step by step. ``padding``: padded micro-batches
    (``(ids, labels, attention_mask)``, see :func:`_padded`), the first step's loss checked
    against ``reference``'s own forward with the masks."""
    gen = torch.Generator().manual_seed(5)
    losses = []
    for step in range(3):
        batches = [torch.randint(0, VOCAB, (2, SEQ), generator=gen) for _ in range(state.dp * 2)]
        if padding is not None:
            batches = [_padded(ids, gen, padding) for ids in batches]
        direct = _masked_loss(reference, batches) if padding is not None and step == 0 else None
        mine = batches[2 * state.dp_rank : 2 * state.dp_rank + 2]
        losses.append((trainer.step(mine), ref_trainer.step(batches)))
        if direct is not None:
            assert abs(losses[0][1] - direct) <= 1e-6 * abs(direct), (losses[0][1], direct)
    return losses


def _train(arch, tp, cp, dp, mode, pp=1, sp=False, padding=None):
    """Three SGD steps at (tp, cp, dp), each DP replica its own micro-batches (whole sequences
    on every CP rank), against one process training the unsharded model on all of them."""
    from tp_ext.training import Trainer

    reference = _model(arch)
    state = tp_ext.init_parallel(tp=tp, cp=cp, dp=dp, pp=pp)
    model = tp_ext.parallelize(
        copy.deepcopy(reference), "auto", parallel=state, cp_mode=mode, sequence_parallel=sp
    )

    # SGD, not Adam: the norms compute fp64 in fp32 (as Hugging Face's do), so a gradient entry
    # near zero can differ in its fp32 rounding, which Adam's division by sqrt(v) would blow up
    def sgd(params):
        return torch.optim.SGD(params, lr=0.5, momentum=0.9, weight_decay=0.1)

    trainer = Trainer(model, optimizer=sgd, parallel=state, max_grad_norm=1.0)
    ref_trainer = Trainer(reference, optimizer=sgd, max_grad_norm=1.0)
    losses = _three_steps(trainer, ref_trainer, state, padding, reference)
    assert_same_weights(tp_ext.layers.full_state_dict(model), reference.state_dict())
    return losses


@pytest.mark.parametrize(
    "arch, tp, cp, dp, mode, pp, sp",
    [
        ("llama", 1, 2, 1, "ring", 1, False),
        ("qwen3", 1, 3, 1, "all_to_all", 1, False),
        ("qwen2", 1, 2, 2, "ring", 1, False),
        ("mistral", 2, 2, 1, "all_to_all", 1, False),
        ("llama", 1, 2, 1, "ring", 2, False),  # inside pipeline stages
        ("qwen2", 2, 2, 1, "ring", 1, True),  # with sequence parallelism
        ("gpt2", 1, 2, 1, "ring", 1, False),  # learned positions, tied head
        ("gpt2", 1, 3, 1, "all_to_all", 1, False),
        ("gemma2", 1, 2, 1, "ring", 1, False),  # sliding windows
        ("gemma2", 1, 3, 1, "all_to_all", 1, False),
        pytest.param("llama", 2, 2, 2, "ring", 1, False, marks=pytest.mark.full_matrix),
        pytest.param("qwen3", 2, 2, 2, "all_to_all", 1, False, marks=pytest.mark.full_matrix),
        pytest.param("qwen3", 1, 2, 1, "all_to_all", 2, False, marks=pytest.mark.full_matrix),
        pytest.param("mistral", 2, 2, 1, "ring", 2, False, marks=pytest.mark.full_matrix),
        pytest.param("llama", 2, 2, 1, "all_to_all", 2, True, marks=pytest.mark.full_matrix),
        pytest.param("gpt2", 2, 2, 1, "ring", 2, False, marks=pytest.mark.full_matrix),
        pytest.param("gemma2", 2, 2, 1, "all_to_all", 2, True, marks=pytest.mark.full_matrix),
        pytest.param("mistral_window", 1, 2, 2, "ring", 1, False, marks=pytest.mark.full_matrix),
    ],
    ids=[
        "llama-cp2",
        "qwen3-cp3-a2a",
        "qwen2-cp2-dp2",
        "mistral-tp2-cp2-a2a",
        "llama-pp2-cp2",
        "qwen2-tp2-cp2-sp",
        "gpt2-cp2",
        "gpt2-cp3-a2a",
        "gemma2-cp2",
        "gemma2-cp3-a2a",
        "llama-222",
        "qwen3-222-a2a",
        "qwen3-pp2-cp2-a2a",
        "mistral-tp2-pp2-cp2",
        "llama-tp2-pp2-cp2-sp-a2a",
        "gpt2-tp2-pp2-cp2",
        "gemma2-tp2-pp2-cp2-sp-a2a",
        "mistral_window-cp2-dp2",
    ],  # fmt: skip
)
def test_the_trainer_trains_hugging_face_decoders_under_cp_like_one_process(
    arch, tp, cp, dp, mode, pp, sp
):
    world = tp * cp * dp * pp
    for losses in run_distributed(_train, world, arch, tp, cp, dp, mode, pp, sp, timeout=600):
        for got, want in losses:
            assert abs(got - want) <= 1e-6 * abs(want), (got, want)


@pytest.mark.parametrize(
    "arch, tp, cp, dp, mode, pp, sp, sides",
    [
        ("llama", 1, 2, 1, "ring", 1, False, "both"),
        ("gpt2", 1, 3, 1, "all_to_all", 1, False, "both"),
        ("qwen2", 1, 2, 1, "ring", 2, False, "both"),  # every pipeline stage given the masks
        ("gemma2", 1, 3, 1, "ring", 1, False, "right"),  # windows, soft-capping, padding
        pytest.param(
            "qwen3", 1, 2, 2, "all_to_all", 1, False, "both", marks=pytest.mark.full_matrix
        ),
        pytest.param(
            "llama", 2, 2, 1, "all_to_all", 1, True, "both", marks=pytest.mark.full_matrix
        ),
        pytest.param("gpt2", 1, 2, 1, "ring", 2, False, "both", marks=pytest.mark.full_matrix),
        pytest.param("mistral", 2, 1, 1, "ring", 2, False, "both", marks=pytest.mark.full_matrix),
        pytest.param(
            "gemma2", 1, 2, 1, "all_to_all", 2, False, "right", marks=pytest.mark.full_matrix
        ),
    ],
    ids=[
        "llama-cp2",
        "gpt2-cp3-a2a",
        "qwen2-pp2-cp2",
        "gemma2-cp3",
        "qwen3-cp2-dp2-a2a",
        "llama-tp2-cp2-sp-a2a",
        "gpt2-pp2-cp2",
        "mistral-tp2-pp2",
        "gemma2-pp2-cp2-a2a",
    ],  # fmt: skip
)
def test_the_trainer_trains_padded_batches_like_one_process(arch, tp, cp, dp, mode, pp, sp, sides):
    """Micro-batches as (input_ids, labels, attention_mask), padded on either side (Gemma 2: on
    the right, see :func:`_padding`): the mask reaches the model's forward (every pipeline
    stage's), labels at padding are ignored."""
    world = tp * cp * dp * pp
    args = (arch, tp, cp, dp, mode, pp, sp, sides)
    for losses in run_distributed(_train, world, *args, timeout=600):
        for got, want in losses:
            assert abs(got - want) <= 1e-6 * abs(want), (got, want)


def _train_moe(tp, cp, dp, ep, mode, data_parallel="ddp"):
    """Mixtral (4 experts, top 2; fp32, which its grouped GEMMs need) with expert and context
    parallelism: three SGD steps against one process on every micro-batch (``data_parallel``:
    ZeRO's state in rows over the DP x CP ranks, the experts' over theirs)."""
    from tp_ext.training import Trainer

    config = transformers.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    reference = transformers.MixtralForCausalLM(config).float()
    # its norms on the fused op, as parallelize runs them in fp32 (their equality with Hugging
    # Face's is tested in test_parallelize_models): what differs is EP and CP
    fuse_rms_norms(reference)
    state = tp_ext.init_parallel(tp=tp, cp=cp, dp=dp, ep=ep)
    model = tp_ext.parallelize(copy.deepcopy(reference), "auto", parallel=state, cp_mode=mode)

    def sgd(params):
        return torch.optim.SGD(params, lr=0.5, momentum=0.9)

    trainer = Trainer(
        model, optimizer=sgd, parallel=state, max_grad_norm=None, data_parallel=data_parallel
    )
    ref_trainer = Trainer(reference, optimizer=sgd, max_grad_norm=None)
    losses = _three_steps(trainer, ref_trainer, state)
    if data_parallel != "ddp":  # each rank steps its rows of the state
        assert isinstance(trainer.optimizer, ShardedOptimizer)
        assert trainer.optimizer.dp.size == dp * cp
    full = tp_ext.layers.full_state_dict(model)
    assert set(full) == set(reference.state_dict())  # pp = 1: every tensor, experts included
    assert_same_weights(full, reference.state_dict(), tol=1e-5)
    return losses


@pytest.mark.parametrize(
    "tp, cp, dp, ep, mode, data_parallel",
    [
        (1, 2, 2, 2, "ring", "ddp"),
        (2, 2, 1, 2, "all_to_all", "ddp"),
        (1, 2, 2, 2, "ring", "zero1"),
        (1, 2, 2, 2, "all_to_all", "zero2"),
    ],
    ids=["cp2-dp2-ep2", "tp2-cp2-ep2-a2a", "cp2-dp2-ep2-zero1", "cp2-dp2-ep2-a2a-zero2"],
)
def test_expert_parallelism_composes_with_context_parallelism(tp, cp, dp, ep, mode, data_parallel):
    world = tp * cp * dp
    args = (tp, cp, dp, ep, mode, data_parallel)
    for losses in run_distributed(_train_moe, world, *args, timeout=600):
        for got, want in losses:
            assert abs(got - want) <= 1e-5 * abs(want), (got, want)


def _refusals():
    state = tp_ext.init_parallel(tp=1, cp=2)
    errors = []

    def refused(call, kind=ValueError):
        with pytest.raises(kind) as error:
            call()
        errors.append(str(error.value))

    gemma = transformers.GemmaForCausalLM(
        transformers.GemmaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        )
    )  # fmt: skip
    refused(lambda: tp_ext.parallelize(gemma, "auto", parallel=state))
    assert not any(isinstance(m, tp_ext.layers.ParallelModule) for m in gemma.modules())
    refused(lambda: tp_ext.parallelize(_model("llama"), "auto", parallel=state, cp_mode="ulysses"))
    refused(
        lambda: tp_ext.parallelize(_model("llama", attention_dropout=0.1), "auto", parallel=state)
    )
    refused(lambda: tp_ext.parallelize(_model("gpt2", attn_pdrop=0.1), "auto", parallel=state))
    model = tp_ext.parallelize(_model("llama"), "auto", parallel=state)
    ids = _ids()
    refused(lambda: model(ids, labels=ids))
    refused(lambda: model(ids, attention_mask=torch.ones(2, 1, SEQ, SEQ)))  # padding masks only
    refused(lambda: model(ids, use_cache=True))  # generation's forwards: inference only
    refused(lambda: model(ids, logits_to_keep=2))
    with torch.no_grad():  # a filled cache takes one token per forward; a foreign one none
        name = cache_argument()  # past_key_values before transformers 5.24, then cache
        cache = getattr(model(ids[:, :5], use_cache=True), name)
        refused(lambda: model(ids[:, 5:7], **{name: cache}))
        filled = getattr(_model("llama")(ids, use_cache=True), name)
        refused(lambda: model(ids, **{name: filled}))
    model(ids, attention_mask=torch.ones_like(ids))  # no padding: fine
    from tp_ext.models import Qwen2ForCausalLM
    from tp_ext.training import Trainer

    from .test_pipeline import _config

    native = Qwen2ForCausalLM.from_config(_config(1, False), parallel=state)
    trainer = Trainer(native, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), parallel=state)
    refused(lambda: trainer.step([(ids, ids, torch.ones_like(ids))]))
    return errors


def test_what_cp_does_not_run_on_hugging_face_models_is_refused_by_name():
    errors = run_distributed(_refusals, 2)[0]
    expected = [
        "cp=2 (context parallelism) supports Hugging Face qwen2, llama, mistral, qwen3, "
        "gpt2, gemma2, mixtral, qwen2_moe, qwen3_moe decoders; "
        "GemmaForCausalLM (model_type 'gemma') is not one of them",
        "cp_mode must be 'ring' or 'all_to_all', got 'ulysses'",
        "attention dropout (0.1) under context parallelism is not supported yet; set "
        "config.attention_dropout=0",
        "attention dropout (0.1) under context parallelism is not supported yet; set "
        "config.attn_pdrop=0",
        "labels= is not supported: the loss spans the CP ranks",
        "attention_mask of shape (2, 1, 11, 11) is not supported: pass a padding mask",
        f"a forward with a KV cache (use_cache=True, {cache_argument()}=) is inference only: run "
        "it under torch.no_grad()",
        "logits_to_keep=2 is not supported",
        "a filled KV cache (5 positions) takes one new token per forward (decoding), got 2",
        f"{cache_argument()}=DynamicCache is not supported: pass an empty transformers Cache",
        "a padded micro-batch (input_ids, labels, attention_mask): Qwen2ForCausalLM's stages "
        "take no attention mask",
    ]
    assert len(errors) == len(expected), errors
    for got, want in zip(errors, expected):
        assert want in got, (want, got)


def _pipelined_logits(arch, mode):
    """(pp, cp) = (2, 2): model(ids) runs the stages for inference; every rank of a pipeline
    gets the logits of its CP positions, equal to the unsharded model's there."""
    reference = _model(arch)
    state = tp_ext.init_parallel(tp=1, cp=2, pp=2)
    model = tp_ext.parallelize(copy.deepcopy(reference), "auto", parallel=state, cp_mode=mode)
    ids = _ids()
    mine = tp_ext.cp_positions(SEQ, parallel=state)
    with torch.no_grad():
        got, expected = model(ids), reference(ids).logits[:, mine]
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-9)
    return mine.tolist()


@pytest.mark.parametrize("arch, mode", [("llama", "all_to_all"), ("qwen3", "ring")])
def test_pipelined_inference_of_hugging_face_decoders_under_cp(arch, mode):
    held = run_distributed(_pipelined_logits, 4, arch, mode)
    assert sorted(held[0] + held[1]) == list(range(SEQ))  # ranks (pp, cp) = (0, 0), (0, 1)


def test_a_cache_passed_under_either_name_reaches_the_installed_transformers_name():
    from tp_ext.parallelize.transformers_names import take_cache

    name, cache = cache_argument(), object()
    for given in ("past_key_values", name):
        call = {given: cache, "use_cache": True}
        assert take_cache(call) is cache
        assert call == {name: cache, "use_cache": True}
    assert take_cache({"use_cache": True}) is None
