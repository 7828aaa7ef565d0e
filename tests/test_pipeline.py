"""3D training (TP x PP x DP) on torch's pipelining and DDP/FSDP2, against single-process
transformers training: five AdamW steps with clipping give the same losses, gradient norms and
weights at all dims and schedules (fp32, 1e-5 relative); tied embeddings across stages, bf16
and fp16 (an overflow on one rank skips the step everywhere), per-layer recompute with dropout,
generation under TP x PP, and the errors of impossible combinations.

``make test`` runs a subset of the dims x schedule matrix that covers every path (each
schedule, each data-parallel kind, TP inside PP, uneven layer splits, tied and untied, 8 ranks);
``make test-all`` (``pytest --full-matrix``) runs all of it.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

import tp_ext
from tp_ext.models import Qwen2ForCausalLM, hf_to_tp_ext_names
from tp_ext.training import Trainer

from .dist_utils import run_distributed
from .reference import hf_qwen2, train_in_one_process
from .test_training import CONFIG

STEPS = 5
LR = 1e-3
MAX_NORM = 0.5  # below the first steps' norms: clipping acts
MICRO_BATCH, SEQ = 2, 9
RTOL = 1e-5
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
MULTI_SCHEDULES = ("Interleaved1F1B", "InterleavedZeroBubble")
SCHEDULES = ("GPipe", "1F1B") + MULTI_SCHEDULES + V_SCHEDULES
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def _config(layers: int, tie: bool, dropout: float = 0.0):
    return CONFIG.replace(
        num_hidden_layers=layers, tie_word_embeddings=tie, attention_dropout=dropout
    )


def _micro_batches(config, count: int, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, config.vocab_size, (MICRO_BATCH, SEQ), generator=g) for _ in range(count)
    ]


def _optimizer(params):
    # eps 1e-6 (in both runs): with 1e-8, gradients near eps (rows of unseen tokens) turn
    # summation-order rounding into lr-sized moves, hiding real differences in noise
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.0, eps=1e-6)


@functools.lru_cache(maxsize=None)
def _reference(layers: int, tie: bool, total_micro_batches: int):
    """transformers' Qwen2 trained in one process on every replica's micro-batches: losses,
    norms before clipping, and the weights after (under tp_ext's names)."""
    config = _config(layers, tie)
    hf = hf_qwen2(config)
    batches = _micro_batches(config, total_micro_batches)
    losses, norms = train_in_one_process(hf, batches, STEPS, _optimizer(hf.parameters()), MAX_NORM)
    return losses, norms, hf_to_tp_ext_names(hf.state_dict(), config)


def _stage_order(schedule: str) -> str:
    return "v" if schedule in V_SCHEDULES else "loop"


def _virtual(schedule: str) -> int:
    return 2 if schedule in V_SCHEDULES + MULTI_SCHEDULES else 1


def _build(config, tp, pp, dp, schedule, split=None):
    state = tp_ext.init_parallel(tp=tp, pp=pp, dp=dp)
    hf = hf_qwen2(config)
    model = Qwen2ForCausalLM.from_config(  # a grid tp=(P, Q): the 2D model
        config,
        parallel=state,
        virtual_stages=_virtual(schedule),
        pipeline_split=split,
        stage_order=_stage_order(schedule),
    )
    full = hf.state_dict()  # the 2D model keeps transformers' names; the 1D one fuses some
    full = full if isinstance(tp, tuple) else hf_to_tp_ext_names(full, config)
    model.load_full_state_dict(full, strict=False)
    return state, model


def _train(tp, pp, dp, schedule, data_parallel, layers, tie, micro, split=None):
    config = _config(layers, tie)
    state, model = _build(config, tp, pp, dp, schedule, split)
    trainer = Trainer(
        model,
        optimizer=_optimizer,
        parallel=state,
        schedule=schedule,
        max_grad_norm=MAX_NORM,
        data_parallel=data_parallel,
    )
    zero2 = data_parallel == "zero2" and dp > 1
    if zero2:  # buckets of a few parameters: several reduce-scatters during the backward
        trainer.optimizer.bucket_bytes = ZERO2_BUCKET_BYTES
    batches = _micro_batches(config, micro * dp)
    mine = batches[state.dp_rank * micro : (state.dp_rank + 1) * micro]
    losses, norms = [], []
    for _ in range(STEPS):
        losses.append(trainer.step(mine))
        norms.append(trainer.last_grad_norm)
        if zero2:
            _check_zero2_overlap(trainer.optimizer, schedule)
    weights = model.full_state_dict()  # every stage's, gathered over TP (and FSDP's DP shards)
    if state.tp_rank or state.dp_rank:
        weights = {}
    return losses, norms, {k: v for k, v in weights.items() if not _is_tied_copy(model, k)}


ZERO2_BUCKET_BYTES = 8192


def _check_zero2_overlap(optimizer, schedule: str) -> None:
    """Every ZeRO-2 bucket's reduce-scatter went during the backward, except under the split
    weight backward (ZERO_BUBBLE), which writes weight gradients outside autograd's accumulation:
    there they all go after the schedule."""
    buckets = optimizer.bucket_count
    assert buckets > 2, buckets
    sent = optimizer.buckets_sent_in_backward
    assert sent == (0 if schedule in ZERO_BUBBLE else buckets), (schedule, sent, buckets)


def _is_tied_copy(model, name: str) -> bool:
    return model.config.tie_word_embeddings and name == "lm_head.weight"


# (tp, pp, dp), schedule, data_parallel, layers, tied, micro-batches per replica, split
SUBSET = [
    ((1, 1, 1), "1F1B", "ddp", 4, False, 2, None),
    ((1, 2, 1), "GPipe", "ddp", 5, False, 2, None),  # 3 + 2 layers
    ((1, 2, 1), "1F1B", "ddp", 4, False, 3, [1, 3]),  # an explicit uneven split
    ((2, 2, 1), "1F1B", "ddp", 4, True, 2, None),  # tied across ranks, TP inside PP
    ((1, 2, 2), "1F1B", "ddp", 4, False, 2, None),
    ((1, 2, 2), "1F1B", "fsdp", 5, True, 2, None),
    ((3, 1, 1), "1F1B", "ddp", 4, False, 2, None),  # TP 3: uneven vocabulary and MLP
    ((1, 4, 1), "1F1B", "ddp", 5, False, 4, None),  # 2 + 1 + 1 + 1 layers
    ((2, 2, 2), "1F1B", "fsdp", 4, False, 2, None),  # 8 ranks
    ((1, 2, 1), "Interleaved1F1B", "ddp", 5, False, 4, None),
    ((2, 2, 1), "InterleavedZeroBubble", "ddp", 4, False, 4, None),
    ((1, 2, 1), "ZBVZeroBubble", "ddp", 4, True, 4, None),  # tied, both copies on rank 0
    ((1, 2, 2), "ZBVZeroBubble", "ddp", 4, False, 4, None),  # DP averaged after the step
    ((1, 2, 1), "DualPipeV", "ddp", 4, False, 4, None),
    # the distributed optimizer (ZeRO): each DP rank steps its rows of every parameter
    ((1, 1, 2), "1F1B", "zero2", 4, False, 2, None),
    ((1, 1, 3), "1F1B", "zero2", 4, False, 2, None),  # DP 3: uneven rows
    ((1, 1, 4), "GPipe", "zero1", 4, False, 2, None),
    ((2, 1, 2), "1F1B", "zero2", 4, False, 2, None),  # TP inside
    ((1, 2, 2), "1F1B", "zero1", 4, True, 2, None),  # PP, tied across ranks
    ((1, 2, 2), "ZBVZeroBubble", "zero2", 4, True, 4, None),  # weight split, both ties on rank 0
    ((1, 2, 3), "ZBVZeroBubble", "zero2", 4, False, 4, None),  # weight split at DP 3: one sum
]
DIMS = [(1, 1, 1), (1, 2, 1), (2, 2, 1), (1, 2, 2), (2, 2, 2), (3, 1, 1), (1, 4, 1)]
FULL = [
    (dims, schedule, data_parallel, 8, tie, 8, None)
    for dims, schedule, data_parallel, tie in itertools.product(
        DIMS, SCHEDULES, ("ddp", "fsdp", "zero1", "zero2"), (False, True)
    )
    if (dims, schedule, data_parallel, 8, tie, 8, None) not in SUBSET
    and (dims[2] > 1 or data_parallel == "ddp")  # without DP the kinds are one case
    and not (dims[2] > 1 and data_parallel == "fsdp" and schedule in ZERO_BUBBLE)  # refused
]


def _case_id(case):
    (tp, pp, dp), schedule, data_parallel, layers, tie, micro, split = case
    return (
        f"tp{tp}-pp{pp}-dp{dp}-{schedule}-{data_parallel}-L{layers}"
        f"{'-tied' if tie else ''}-m{micro}{'-split' if split else ''}"
    )


def _check_case(case):
    (tp, pp, dp), schedule, data_parallel, layers, tie, micro, split = case
    results = run_distributed(
        _train,
        tp * pp * dp,
        tp,
        pp,
        dp,
        schedule,
        data_parallel,
        layers,
        tie,
        micro,
        split,
        timeout=300,
    )
    ref_losses, ref_norms, ref_weights = _reference(layers, tie, micro * dp)
    expected = {k: v for k, v in ref_weights.items() if not (tie and k == "lm_head.weight")}
    assert_training_matches(results, ref_losses, ref_norms, expected)


def assert_training_matches(results, ref_losses, ref_norms, ref_weights, max_norm=MAX_NORM):
    """Every rank's ``(losses, norms, weights part)`` against the one-process reference: the
    same losses and norms on every rank, equal to the reference's (clipping acted), and the
    ranks' parts together the reference's weights."""
    losses, norms, _ = results[0]
    for rank, (other_losses, other_norms, _) in enumerate(results):
        assert other_losses == losses, f"rank {rank}'s losses differ from rank 0's"
        assert other_norms == norms, f"rank {rank}'s norms differ from rank 0's"
    torch.testing.assert_close(losses, ref_losses, rtol=RTOL, atol=0)
    torch.testing.assert_close(norms, ref_norms, rtol=RTOL, atol=0)
    assert norms[0] > max_norm, "clipping never acted"
    weights = {}
    for _, _, part in results:
        weights.update(part)
    assert sorted(weights) == sorted(ref_weights), "the stages together hold the whole model"
    for name, tensor in ref_weights.items():
        # 1e-5 relative, and 1e-2 x lr absolute near zero: the k bias's gradient is
        # analytically zero (softmax ignores a shift of every score), and Adam's normalised
        # update turns its rounding noise into moves of ~1e-3 x lr; a real error moves by ~lr
        torch.testing.assert_close(
            weights[name],
            tensor,
            rtol=RTOL,
            atol=1e-2 * LR,
            msg=lambda m, name=name: f"{name}: {m}",
        )


@pytest.mark.parametrize("case", SUBSET, ids=_case_id)
def test_3d_training_matches_transformers(case):
    _check_case(case)


@pytest.mark.full_matrix
@pytest.mark.parametrize("case", FULL, ids=_case_id)
def test_3d_training_matrix(case):
    _check_case(case)
