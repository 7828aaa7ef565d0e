"""Pipeline parallelism for Hugging Face decoders: ``parallelize(model, "auto", parallel=state)``
at pp > 1 keeps this rank's stages, and the Trainer trains them with torch's schedules, DDP or
FSDP2: three AdamW steps with clipping give transformers' own losses, gradient norms and
weights at (tp, pp, dp) = (1,2,1), (2,2,1), (1,2,2), (2,2,2), (1,3,1) for Llama, Qwen3, Gemma 2
(sliding windows across stage boundaries, scaled embeddings, logit soft-capping) and GPT-2
(Conv1D, learned positions, tied embeddings); Mixtral with its experts split over TP, or over
EP=2 ranks of each stage (taken from DP, or across TP). What cannot be split is refused before
anything runs.

``make test`` runs a subset that covers every path (each architecture, all dims, the V order
with both ends of a tied model on one rank, FSDP2, recompute); ``make test-all`` all of it.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
import transformers

import tp_ext
from tp_ext.layers import full_state_dict
from tp_ext.training import Trainer

from .dist_utils import run_distributed
from .reference import train_in_one_process
from .test_parallelize_models import COMMON, VOCAB
from .test_pipeline import LR, MAX_NORM, assert_training_matches

STEPS = 3
MICRO_BATCH, SEQ = 2, 9


def _hf_config(arch: str):
    common = dict(COMMON, num_hidden_layers=4)
    if arch == "llama":
        return transformers.LlamaConfig(**common)
    if arch == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=8)
    if arch == "gemma2":  # layers alternate sliding (window 4 < SEQ) and full attention
        return transformers.Gemma2Config(**common, head_dim=8, sliding_window=4)
    if arch == "mixtral":  # experts over TP or EP inside the stages (no router loss)
        return transformers.MixtralConfig(**common, num_local_experts=4)
    if arch == "qwen2_moe":  # dense layers first: at pp=2 the first stage holds no experts
        return transformers.Qwen2MoeConfig(
            **common,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=32,
            mlp_only_layers=[0, 1],
        )
    if arch == "opt":  # decoder layers one level deeper, learned positions, tied embedding
        return transformers.OPTConfig(
            vocab_size=VOCAB,
            hidden_size=48,
            ffn_dim=44,
            num_hidden_layers=4,
            num_attention_heads=6,
            max_position_embeddings=64,
            word_embed_proj_dim=48,
            dropout=0.0,
        )
    if arch == "gpt2":
        return transformers.GPT2Config(
            vocab_size=VOCAB,
            n_embd=48,
            n_layer=4,
            n_head=6,
            n_positions=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            tie_word_embeddings=True,
        )
    raise AssertionError(arch)


def _hf_model(arch: str):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(_hf_config(arch)).float()


def _micro_batches(count: int):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=g) for _ in range(count)]


def _optimizer(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.0, eps=1e-6)


@functools.lru_cache(maxsize=None)
def _reference(arch: str, total_micro_batches: int):
    """transformers' model trained in one process on every replica's micro-batches."""
    model = _hf_model(arch)
    batches = _micro_batches(total_micro_batches)
    optimizer = _optimizer(model.parameters())
    losses, norms = train_in_one_process(model, batches, STEPS, optimizer, MAX_NORM)
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
MULTI = ("Interleaved1F1B", "InterleavedZeroBubble")


def _train(
    arch, tp, pp, dp, schedule, data_parallel, micro, recompute, compression=None, ep=1, sp=False
):
    state = tp_ext.init_parallel(tp=tp, pp=pp, dp=dp, ep=ep)
    stages = tp_ext.parallelize(
        _hf_model(arch),
        "auto",
        parallel=state,
        sequence_parallel=sp,
        virtual_stages=2 if schedule in V_SCHEDULES + MULTI else 1,
        stage_order="v" if schedule in V_SCHEDULES else "loop",
    )
    if sp:  # the stages send their sequence shards
        assert stages.sequence_parallel and stages.local_sequence(SEQ) < SEQ
    trainer = Trainer(
        stages,
        optimizer=_optimizer,
        parallel=state,
        schedule=schedule,
        max_grad_norm=MAX_NORM,
        data_parallel=data_parallel,
        activation_checkpointing=recompute,
        gradient_compression=compression,
    )
    batches = _micro_batches(micro * dp)
    mine = batches[state.dp_rank * micro : (state.dp_rank + 1) * micro]
    losses, norms = [], []
    for _ in range(STEPS):
        losses.append(trainer.step(mine))
        norms.append(trainer.last_grad_norm)
    weights = full_state_dict(stages)  # this rank's stages, gathered over TP (and FSDP2's DP)
    if state.tp_rank or state.dp_rank:
        weights = {}
    return losses, norms, weights


# arch, (tp, pp, dp[, ep]), schedule, data_parallel, micro-batches per replica, recompute
DIMS = [(1, 2, 1), (2, 2, 1), (1, 2, 2), (2, 2, 2), (1, 3, 1)]
ARCHS = ["llama", "qwen3", "gemma2", "gpt2"]
SUBSET = [
    ("llama", (2, 2, 1), "1F1B", "ddp", 2, False),
    ("qwen3", (1, 2, 2), "1F1B", "fsdp", 2, True),  # FSDP2 units, per-head norms, recompute
    ("gemma2", (1, 3, 1), "GPipe", "ddp", 3, False),  # 2 + 1 + 1 layers: sliding by global index
    ("gpt2", (1, 2, 1), "ZBVZeroBubble", "ddp", 4, False),  # tied; both ends on rank 0
    ("gpt2", (2, 2, 2), "1F1B", "ddp", 2, False),  # 8 ranks, tied across ranks
    # experts over EP inside the stages: from the DP ranks (a first stage of dense layers beside
    # one of experts and a shared expert), then across TP ranks
    ("qwen2_moe", (1, 2, 2, 2), "1F1B", "ddp", 2, True),
    ("mixtral", (2, 2, 1, 2), "Interleaved1F1B", "ddp", 4, False),
    # pp = 1: the converted model trains as one stage (tied on one rank, FSDP2, recompute)
    ("gpt2", (1, 1, 2), "1F1B", "fsdp", 2, True),
    # ZeRO-2 with experts in the stages: dense rows over DP, expert gradients summed
    ("mixtral", (1, 2, 2, 2), "1F1B", "zero2", 2, False),
]
FULL = [  # 1F1B needs a micro-batch per stage
    (arch, dims, "1F1B", "ddp", max(2, dims[1]), False)
    for arch, dims in itertools.product(ARCHS, DIMS)
    if (arch, dims, "1F1B", "ddp", max(2, dims[1]), False) not in SUBSET
] + [
    ("llama", (1, 2, 1), "Interleaved1F1B", "ddp", 4, False),
    ("gemma2", (1, 2, 1), "DualPipeV", "ddp", 4, False),
    ("gpt2", (1, 2, 2), "1F1B", "fsdp", 2, True),
    ("mixtral", (1, 2, 1), "1F1B", "ddp", 2, False),
    ("mixtral", (2, 2, 1), "GPipe", "ddp", 2, False),
    ("mixtral", (1, 3, 1), "1F1B", "ddp", 3, False),
    ("opt", (2, 2, 1), "1F1B", "ddp", 2, False),
    ("llama", (2, 1, 2), "1F1B", "ddp", 2, False),
    ("gpt2", (2, 1, 2), "1F1B", "fsdp", 2, True),
    ("gemma2", (3, 1, 1), "1F1B", "ddp", 2, False),
    ("mixtral", (2, 1, 1), "1F1B", "ddp", 2, False),
    ("mixtral", (1, 2, 2, 2), "1F1B", "ddp", 2, True),
    ("mixtral", (2, 2, 2, 2), "1F1B", "ddp", 2, False),  # EP from DP, experts split over TP
    ("mixtral", (1, 3, 2, 2), "GPipe", "ddp", 3, False),
    ("mixtral", (1, 2, 2, 2), "ZBVZeroBubble", "ddp", 4, False),
    # ZeRO with experts: expert rows over the 2 ranks holding the same experts (dp 4, ep 2)
    ("mixtral", (1, 2, 4, 2), "1F1B", "zero1", 2, False),
    ("mixtral", (1, 2, 4, 2), "GPipe", "zero2", 2, False),
    ("qwen2_moe", (1, 2, 2, 2), "ZBVZeroBubble", "zero2", 4, True),
]


def _case_id(case):
    arch, (tp, pp, dp, *ep), schedule, data_parallel, micro, recompute = case
    experts = f"-ep{ep[0]}" if ep else ""
    return (
        f"{arch}-tp{tp}-pp{pp}-dp{dp}{experts}-{schedule}-{data_parallel}"
        f"{'-recompute' if recompute else ''}"
    )


def _check(case):
    arch, (tp, pp, dp, *ep), schedule, data_parallel, micro, recompute = case
    results = run_distributed(
        _train,
        tp * pp * dp,
        arch,
        tp,
        pp,
        dp,
        schedule,
        data_parallel,
        micro,
        recompute,
        ep=ep[0] if ep else 1,
        timeout=300,
    )
    assert_training_matches(results, *_reference(arch, micro * dp))


@pytest.mark.parametrize("case", SUBSET, ids=_case_id)
def test_hf_pipeline_training_matches_transformers(case):
    _check(case)


@pytest.mark.full_matrix
@pytest.mark.parametrize("case", FULL, ids=_case_id)
def test_hf_pipeline_training_matrix(case):
    _check(case)


# sequence parallelism inside the stages: the stages send their sequence shard (9 tokens over
# 2 TP ranks: 5 and 4)
SP_CASES = [
    ("llama", (2, 2, 1), "1F1B", "ddp", 2, False),
    pytest.param(("gemma2", (2, 2, 1), "GPipe", "ddp", 2, True), marks=pytest.mark.full_matrix),
    pytest.param(("gpt2", (2, 2, 2), "1F1B", "ddp", 2, False), marks=pytest.mark.full_matrix),
    pytest.param(
        ("qwen3", (2, 2, 1), "Interleaved1F1B", "ddp", 4, False), marks=pytest.mark.full_matrix
    ),
]


@pytest.mark.parametrize("case", SP_CASES, ids=_case_id)
def test_sequence_parallel_inside_stages_matches_transformers(case):
    arch, (tp, pp, dp), schedule, data_parallel, micro, recompute = case
    results = run_distributed(
        _train, tp * pp * dp, arch, tp, pp, dp, schedule, data_parallel, micro, recompute,
        sp=True, timeout=300,
    )  # fmt: skip
    assert_training_matches(results, *_reference(arch, micro * dp))


def _train_then_run(arch, tp, dp):
    state = tp_ext.init_parallel(tp=tp, dp=dp)
    model = tp_ext.parallelize(_hf_model(arch), "auto", parallel=state)
    trainer = Trainer(model, optimizer=_optimizer, parallel=state, max_grad_norm=MAX_NORM)
    batches = _micro_batches(2 * dp)
    for _ in range(STEPS):
        trainer.step(batches[state.dp_rank * 2 : (state.dp_rank + 1) * 2])
    with torch.no_grad():
        return model(batches[0]).logits


def test_a_model_trained_at_pp1_still_runs_as_itself():
    """At pp = 1 the Trainer trains the converted model as one stage; the user's model keeps
    its layer list and its tie, and its own forward gives the trained weights' logits."""
    logits = run_distributed(_train_then_run, 2, "gpt2", 2, 1)
    reference = _hf_model("gpt2")
    reference.load_state_dict(_reference("gpt2", 2)[2])
    with torch.no_grad():
        expected = reference(_micro_batches(2)[0]).logits
    for got in logits:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def _router_loss_training(dp: int, cp: int, ep: int):
    """Mixtral with its load-balancing loss (config.output_router_logits, coefficient 0.1) at
    pp = 1: the Trainer adds it per micro-batch, its router statistics over the CP ranks'
    positions; three steps."""
    config = _hf_config("mixtral")
    config.output_router_logits, config.router_aux_loss_coef = True, 0.1
    state = tp_ext.init_parallel(tp=1, dp=dp, cp=cp, ep=ep)
    torch.manual_seed(0)
    model = tp_ext.parallelize(
        transformers.AutoModelForCausalLM.from_config(config).float(), "auto", parallel=state
    )
    trainer = Trainer(model, optimizer=_optimizer, parallel=state, max_grad_norm=MAX_NORM)
    batches = _micro_batches(2 * dp)
    mine = batches[state.dp_rank * 2 : (state.dp_rank + 1) * 2]
    return [trainer.step(mine) for _ in range(STEPS)]


@functools.lru_cache(maxsize=None)
def _router_loss_reference(dp: int) -> list:
    """transformers' own training: its loss adds coef x its aux loss (output_router_logits)."""
    config = _hf_config("mixtral")
    config.output_router_logits, config.router_aux_loss_coef = True, 0.1
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    optimizer = _optimizer(model.parameters())
    return train_in_one_process(model, _micro_batches(2 * dp), STEPS, optimizer, MAX_NORM)[0]


def _unconverted_refusal():
    state = tp_ext.init_parallel(tp=2)
    with pytest.raises(ValueError, match="holds no tp_ext layers; convert it first") as refusal:
        Trainer(_hf_model("llama"), optimizer=_optimizer, parallel=state)
    return str(refusal.value)


@pytest.mark.parametrize(
    "dp, cp, ep",
    [
        (1, 1, 1),
        pytest.param(2, 1, 2, marks=pytest.mark.full_matrix),
        pytest.param(1, 2, 1, marks=pytest.mark.full_matrix),
        (2, 2, 2),
    ],
    ids=lambda v: str(v),
)
def test_the_router_loss_trains_like_transformers(dp, cp, ep):
    """The load-balancing loss is kept (whole model, full logits and router logits), equal to
    transformers' own loss with it, also with its statistics over context-parallel ranks."""
    want = _router_loss_reference(dp)
    for losses in run_distributed(_router_loss_training, dp * cp, dp, cp, ep, timeout=600):
        torch.testing.assert_close(losses, want, rtol=1e-5, atol=0)


def test_an_unconverted_model_is_refused():
    assert "tp=2" in run_distributed(_unconverted_refusal, 2)[0]


def test_gradient_compression_trains_the_stages():
    """DDP's int8 hook (with error feedback) on every stage: the first step's loss is exact (no
    gradient was sent yet), the later ones stay within 1% of the uncompressed reference's."""
    results = run_distributed(_train, 4, "llama", 1, 2, 2, "1F1B", "ddp", 2, False, "int8")
    reference = _reference("llama", 4)[0]
    losses = results[0][0]
    torch.testing.assert_close(losses[0], reference[0], rtol=1e-5, atol=0)
    torch.testing.assert_close(losses, reference, rtol=1e-2, atol=0)
    assert losses[1:] != reference[1:], "the gradients were sent compressed (int8 rounds them)"
    assert all(r[0] == losses for r in results), "every rank reports the same losses"


def _logits_under_pipelining(arch, tp, pp, schedule, sp=False):
    state = tp_ext.init_parallel(tp=tp, pp=pp)
    stages = tp_ext.parallelize(
        _hf_model(arch),
        "auto",
        parallel=state,
        sequence_parallel=sp,
        virtual_stages=2 if schedule in V_SCHEDULES else 1,
        stage_order="v" if schedule in V_SCHEDULES else "loop",
    )
    ids = _micro_batches(1)[0]
    with torch.no_grad():
        full = stages(ids)
        local = stages(ids, local_logits=True)
    return full, local, state.tp_rank


@pytest.mark.parametrize(
    "arch, tp, pp, schedule, sp",
    [
        ("gemma2", 1, 3, "1F1B", False),
        ("gpt2", 2, 2, "1F1B", False),
        ("qwen3", 1, 2, "DualPipeV", False),
        ("opt", 1, 2, "1F1B", False),
        ("llama", 2, 2, "DualPipeV", True),  # sequence shards between stages, V order
    ],
)
def test_forward_under_pipelining_gives_transformers_logits(arch, tp, pp, schedule, sp):
    """Every rank of the pipeline gets the last stage's logits (full, or its vocabulary shard)."""
    with torch.no_grad():
        expected = _hf_model(arch)(_micro_batches(1)[0]).logits
    sizes = tp_ext.shard_sizes(VOCAB, tp)
    for full, local, tp_rank in run_distributed(
        _logits_under_pipelining, tp * pp, arch, tp, pp, schedule, sp
    ):
        torch.testing.assert_close(full, expected, rtol=1e-5, atol=1e-6)
        start = sum(sizes[:tp_rank])
        torch.testing.assert_close(local, expected[..., start : start + sizes[tp_rank]])


def _refusal(build, pp, ep=1, **options):
    state = tp_ext.init_parallel(tp=1, pp=pp, ep=ep, dp=ep)
    try:
        tp_ext.parallelize(build(), "auto", parallel=state, **options)
    except ValueError as e:
        return str(e)
    return None


def _two_layer_llama():
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**{**_hf_config("llama").to_dict(), "num_hidden_layers": 2})
    )


def _mixtral(router_loss: bool):
    config = transformers.MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=44,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        num_local_experts=4,
        output_router_logits=router_loss,
    )
    return transformers.MixtralForCausalLM(config)


def _not_a_causal_lm():
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB, 8), torch.nn.Linear(8, VOCAB))


def _an_encoder_decoder():  # two stacks of layers, not one list to split
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_heads=4,
        decoder_start_token_id=0,
    )  # fmt: skip
    return transformers.T5ForConditionalGeneration(config)


@pytest.mark.parametrize(
    "build, pp, ep, options, message",
    [
        (_two_layer_llama, 3, 1, {}, "2 decoder layers cannot fill 3 pipeline stages"),
        (_two_layer_llama, 2, 1, {"pipeline_split": [2, 1]}, "pipeline_split must list"),
        (functools.partial(_mixtral, True), 2, 1, {}, "config.output_router_logits=True"),
        (_not_a_causal_lm, 2, 1, {}, "Sequential is not one: use pp=1"),
        (_an_encoder_decoder, 2, 1, {}, "T5ForConditionalGeneration is an encoder-decoder"),
    ],
    ids=["too-few-layers", "bad-split", "router-loss", "not-an-lm", "encoder-decoder"],
)
def test_what_cannot_be_split_is_refused_by_name(build, pp, ep, options, message):
    for text in run_distributed(_refusal, pp * ep, build, pp, ep, **options):
        assert text is not None and message in text, text


def _wide_vocabulary_llama():
    """4 layers and an LM head worth about 8 of them (vocabulary 2048, hidden 48)."""
    return transformers.LlamaConfig(**{**_hf_config("llama").to_dict(), "vocab_size": 2048})


def _default_split(pp):
    state = tp_ext.init_parallel(tp=1, pp=pp)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_wide_vocabulary_llama())
    return tp_ext.parallelize(model, "auto", parallel=state).stage_split.layer_counts


def test_the_default_split_weighs_the_lm_head_and_the_planner_places_layers_alike():
    """Without pipeline_split the layers go where the costliest stage is cheapest: the last
    stage's LM head counts, so it keeps one layer of four; ``tp-ext plan``'s footprint and the
    planner's estimate place them the same way."""
    from tp_ext.models.hf.footprint import hf_pipeline_footprint
    from tp_ext.planner import estimate, load_hardware
    from tp_ext.planner.hf_model import HFModel

    from .test_plan_hf import _hf_candidate

    assert run_distributed(_default_split, 2, 2) == [[3, 1], [3, 1]]
    footprint = hf_pipeline_footprint(_wide_vocabulary_llama(), tp=1, pp=2)
    assert [s["num_layers"] for s in footprint["stages"]] == [3, 1]
    est = estimate(
        HFModel(_wide_vocabulary_llama()),
        _hf_candidate(1, 2, 1, 2),
        seq_len=SEQ,
        hardware=load_hardware("cpu"),
    )
    assert est.detail["layers_per_rank"] == 3


def _steps_with_checkpoint(arch, dims, path, steps, save: bool):
    """``steps`` steps at ``dims`` on the same global batch (after loading ``path`` unless
    ``save``; saving it after them if ``save``): the losses."""
    tp, pp, dp = dims
    state = tp_ext.init_parallel(tp=tp, pp=pp, dp=dp)
    stages = tp_ext.parallelize(_hf_model(arch), "auto", parallel=state)
    trainer = Trainer(stages, optimizer=_optimizer, parallel=state, max_grad_norm=MAX_NORM)
    per_replica = 4 // dp
    mine = _micro_batches(4)[state.dp_rank * per_replica : (state.dp_rank + 1) * per_replica]
    if not save:
        trainer.load_checkpoint(path)
    losses = [trainer.step(mine) for _ in range(steps)]
    if save:
        trainer.save_checkpoint(path)
    return losses


def test_a_checkpoint_of_the_stages_resumes_at_other_dims(tmp_path):
    """The Trainer's checkpoint of a Hugging Face model's stages (transformers' names, layers by
    global index) loads at another (tp, pp, dp) and training goes on as if never stopped."""
    path = str(tmp_path / "ckpt")
    straight = _reference("llama", 4)[0][:STEPS]
    first = run_distributed(_steps_with_checkpoint, 4, "llama", (1, 2, 2), path, 1, True)[0]
    rest = run_distributed(_steps_with_checkpoint, 4, "llama", (2, 2, 1), path, STEPS - 1, False)
    torch.testing.assert_close(first + rest[0], straight, rtol=1e-5, atol=0)


def _export_stages(arch, directory, dp, ep):
    from tp_ext.checkpoint import save_hf_checkpoint

    state = tp_ext.init_parallel(tp=1, pp=2, dp=dp, ep=ep)
    stages = tp_ext.parallelize(_hf_model(arch), "auto", parallel=state)
    save_hf_checkpoint(stages, directory)


@pytest.mark.parametrize("arch, dp, ep", [("opt", 1, 1), ("mixtral", 2, 2)])
def test_stages_export_a_checkpoint_transformers_loads(tmp_path, arch, dp, ep):
    """save_hf_checkpoint of a Hugging Face model's stages (pp = 2, its names its own): one
    merged checkpoint of the whole model, tied head included (OPT), each stage's experts
    gathered from its EP ranks (Mixtral), that from_pretrained loads."""
    run_distributed(_export_stages, 2 * dp, arch, str(tmp_path), dp, ep)
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids = _micro_batches(1)[0]
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, _hf_model(arch)(ids).logits)
