"""tp_ext.training against pure-PyTorch references, fp32: the Qwen2 model of
configs/qwen2-mini.yaml (vocabulary 1001, 8 heads, 2 KV heads: replicated at TP 3 and 4) trained
with AdamW, gradient accumulation and clipping gives the losses, gradient norms and weights of
TP=1 and of transformers' Qwen2ForCausalLM with torch.optim.AdamW and clip_grad_norm_."""

import math
import os

import pytest
import torch
import torch.distributed as dist

import tp_ext
from tp_ext import comm
from tp_ext.config import JobConfig
from tp_ext.layers import ResolvedGroup, local_shards, vocab_parallel_cross_entropy
from tp_ext.models import Qwen2ForCausalLM, hf_to_tp_ext_names
from tp_ext.training import Trainer, build_optimizer, clip_grad_norm_, grad_norm

from .dist_utils import rank, run_distributed
from .reference import hf_qwen2
from .test_layers import assert_rel

JOB = JobConfig.from_file(
    os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "qwen2-mini.yaml"
    )
)
CONFIG, OPTIMIZER = JOB.model, JOB.optimizer
STEPS = 5
MAX_NORM = 0.5  # below the first steps' norms, so clipping is active
RTOL = 1e-4
# Weights after training: the k bias's gradient is analytically zero (softmax ignores a shift of
# every score), so Adam turns rounding noise there into updates of ~1e-3 x lr, and a weight
# whose gradient is near zero can move by ~1e-2 x lr on rounding alone (GEMMs of other shapes sum
# in another order); a real error moves weights by ~lr.
WEIGHT_ATOL = 3e-2 * OPTIMIZER.lr


def _ids(batch=4, seq=17, seed=1):
    return torch.randint(
        0, CONFIG.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed)
    )


def _hf_model():
    return hf_qwen2(CONFIG)  # the same weights on every rank and at every TP size


def _model(tp_group=None):
    """The tp_ext model holding _hf_model()'s weights, and that model."""
    hf = _hf_model()
    model = Qwen2ForCausalLM(CONFIG, tp_group=tp_group)
    model.load_full_state_dict(hf_to_tp_ext_names(hf.state_dict(), CONFIG))
    return model, hf


def _record_grads(trainer):
    """Gradients by name as the optimizer sees them (after accumulation, DP sync, clipping)."""
    seen = []
    params = list(trainer.model.named_parameters())
    trainer.optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: seen.append({name: p.grad.clone() for name, p in params})
    )
    return seen


def _assert_states(actual, expected, what):
    assert sorted(actual) == sorted(expected), what
    for name in expected:
        torch.testing.assert_close(
            actual[name],
            expected[name],
            rtol=RTOL,
            atol=WEIGHT_ATOL,
            msg=lambda m, name=name: f"{what}: {name}: {m}",
        )


# ---- loss curves: TP=k == TP=1 == transformers --------------------------------------------------


def _train_tp():
    model, _ = _model()
    trainer = Trainer(model, build_optimizer(model, OPTIMIZER), max_grad_norm=MAX_NORM)
    ids = _ids()
    losses, norms = [], []
    for _ in range(STEPS):  # the same data every step: the loss must fall
        losses.append(trainer.step([ids[:2], ids[2:]]))
        norms.append(trainer.last_grad_norm)
    state = model.full_state_dict()
    return losses, norms, state if rank() == 0 else None


def _train_hf():
    """The same steps in plain PyTorch: accumulated mean loss, clip_grad_norm_, AdamW with the
    same parameter groups (decay on matrices only)."""
    hf = _hf_model()
    settings = OPTIMIZER
    params = list(hf.parameters())
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": settings.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=settings.lr,
        betas=settings.betas,
    )
    ids = _ids()
    losses, norms = [], []
    for _ in range(STEPS):
        total = 0.0
        for micro in (ids[:2], ids[2:]):  # equal token counts: the mean of the two means
            loss = hf(micro, labels=micro).loss / 2
            loss.backward()
            total += loss.item()
        norms.append(torch.nn.utils.clip_grad_norm_(params, MAX_NORM).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return losses, norms, hf_to_tp_ext_names(hf.state_dict(), CONFIG)


@pytest.fixture(scope="module")
def tp1_run():
    return run_distributed(_train_tp, 1)[0]


def test_tp1_matches_transformers_and_learns(tp1_run):
    losses, norms, state = tp1_run
    ref_losses, ref_norms, ref_state = _train_hf()
    torch.testing.assert_close(losses, ref_losses, rtol=RTOL, atol=0)
    # the norm before clipping: catches a wrongly scaled accumulated gradient (AdamW would not)
    torch.testing.assert_close(norms, ref_norms, rtol=RTOL, atol=0)
    assert norms[0] > MAX_NORM, f"clipping never acted: norms {norms}"
    assert losses[-1] < losses[0] - 0.1, f"the loss did not fall: {losses}"
    _assert_states(state, ref_state, "weights after training, against transformers")


@pytest.mark.parametrize("ws", [2, 3, 4])
def test_loss_curve_at_tp_k_matches_tp1(ws, tp1_run):
    results = run_distributed(_train_tp, ws, timeout=300)
    losses, norms, state = results[0]
    for r, (other_losses, other_norms, _) in enumerate(results):
        assert other_losses == losses and other_norms == norms, f"rank {r} disagrees with rank 0"
    ref_losses, ref_norms, ref_state = tp1_run
    torch.testing.assert_close(losses, ref_losses, rtol=RTOL, atol=0)
    torch.testing.assert_close(norms, ref_norms, rtol=RTOL, atol=0)
    _assert_states(state, ref_state, f"weights after training at TP={ws} against TP=1")


# ---- the gradient norm --------------------------------------------------------------------------


def _check_grad_norm():
    model, hf = _model()
    ids = _ids(2, 9)
    loss = vocab_parallel_cross_entropy(
        model(ids, local_logits=True)[:, :-1], ids[:, 1:], tp_group=model.tp
    )
    loss.backward()
    hf(ids, labels=ids).loss.backward()
    hf_grads = [p.grad for p in hf.parameters()]
    for p in (2.0, 1.0, 3.0, math.inf):
        expected = torch.nn.utils.get_total_norm(hf_grads, p)
        assert_rel(grad_norm(model, norm_type=p), expected, f"grad_norm(norm_type={p})", 1e-5)
    max_norm = grad_norm(model).item() / 3
    expected = torch.nn.utils.clip_grad_norm_(hf.parameters(), max_norm)
    assert_rel(clip_grad_norm_(model, max_norm), expected, "clip_grad_norm_'s total", 1e-5)
    clipped = local_shards(
        model, hf_to_tp_ext_names({n: p.grad for n, p in hf.named_parameters()}, CONFIG)
    )
    for name, param in model.named_parameters():
        assert_rel(param.grad, clipped[name], f"clipped gradient of {name}", 1e-5)
    return model.model.layers[0].self_attn.qkv_proj.partition.replicated


@pytest.mark.parametrize("ws", [1, 2, 3, 4])
def test_grad_norm_equals_the_unsharded_models(ws):
    replicated = run_distributed(_check_grad_norm, ws)
    assert replicated == [ws > CONFIG.num_key_value_heads] * ws  # KV rows on 2 ranks at 3, 4


# ---- accumulation, collectives, data parallelism ------------------------------------------------


def _labels(ids):
    """Some targets ignored, unevenly over the rows: the mean must weight by token count."""
    labels = ids.clone()
    labels[0, 1:12] = -100
    labels[3, 5:7] = -100
    return labels


def _check_accumulation():
    ids = _ids()
    labels = _labels(ids)
    results = []
    for micro_batches in (
        [(ids, labels)],
        [(ids[:1], labels[:1]), (ids[1:], labels[1:])],
    ):  # 1 + 3 rows
        model, _ = _model()
        trainer = Trainer(model, build_optimizer(model, OPTIMIZER), max_grad_norm=MAX_NORM)
        grads = _record_grads(trainer)
        loss = trainer.step(micro_batches)
        results.append((loss, grads[0], dict(model.named_parameters())))
    (loss_1, grads_1, params_1), (loss_2, grads_2, params_2) = results
    assert abs(loss_1 - loss_2) <= 1e-5 * abs(loss_1), (loss_1, loss_2)
    for name, grad in grads_1.items():
        assert_rel(grads_2[name], grad, f"accumulated gradient of {name}", 1e-5)
    _assert_states(params_2, params_1, "weights after the step")


@pytest.mark.parametrize("ws", [1, 2])
def test_two_micro_batches_equal_one_batch(ws):
    run_distributed(_check_accumulation, ws)


def _check_data_parallel():
    state = tp_ext.init_parallel(tp=2, dp=2)
    ids = _ids()
    labels = _labels(ids)  # DP rank 0's half has far fewer targets than rank 1's
    model, _ = _model(state.tp_group)
    trainer = Trainer(
        model, build_optimizer(model, OPTIMIZER), max_grad_norm=MAX_NORM, dp_group=state.dp_group
    )
    reference, _ = _model(ResolvedGroup.local())
    ref_trainer = Trainer(reference, build_optimizer(reference, OPTIMIZER), max_grad_norm=MAX_NORM)
    grads, ref_grads = _record_grads(trainer), _record_grads(ref_trainer)
    rows = slice(2 * state.dp_rank, 2 * state.dp_rank + 2)
    mine = [(ids[rows][i : i + 1], labels[rows][i : i + 1]) for i in range(2)]
    for step in range(3):
        loss = trainer.step(mine)
        ref_loss = ref_trainer.step([(ids, labels)])
        assert abs(loss - ref_loss) <= RTOL * abs(ref_loss), (step, loss, ref_loss)
        assert (
            abs(trainer.last_grad_norm - ref_trainer.last_grad_norm)
            <= RTOL * ref_trainer.last_grad_norm
        ), step
    expected = local_shards(model, ref_grads[0])
    for name, grad in grads[0].items():
        assert_rel(grad, expected[name], f"first step's gradient of {name}", RTOL)
    _assert_states(
        model.full_state_dict(),
        dict(reference.state_dict()),
        "weights after 3 steps at tp=2, dp=2 against TP=1 on the whole batch",
    )

    # The trainer's own collectives do not grow with the number of micro-batches.
    counts = []
    for n in (1, 4):
        with comm.track() as stats:
            trainer.step([(ids[rows][:, :9], labels[rows][:, :9])] * n)
        counts.append(
            {t: stats.count(tag=t) for t in ("train.dp_sync", "train.grad_norm", "train.compute")}
        )
    one, four = counts
    assert one["train.dp_sync"] == four["train.dp_sync"] == 1, counts
    assert one["train.grad_norm"] == four["train.grad_norm"] == 1, counts
    assert four["train.compute"] == 4 * one["train.compute"] > 0, counts
    return one["train.dp_sync"], one["train.grad_norm"]


def test_data_parallel_tp2_dp2_equals_tp1_on_the_whole_batch():
    counts = run_distributed(_check_data_parallel, 4, timeout=300)
    assert len(set(counts)) == 1, f"ranks issued different numbers of collectives: {counts}"


# ---- bf16 autocast, bad input -------------------------------------------------------------------


def _bf16_step():
    ids = _ids()
    losses = []
    for dtype in (None, torch.bfloat16):
        model, _ = _model()
        before = model.model.layers[0].mlp.down_proj.weight.detach().clone()
        trainer = Trainer(model, max_grad_norm=MAX_NORM, autocast_dtype=dtype)
        losses.append(trainer.step([ids[:2], ids[2:]]))
        weight = model.model.layers[0].mlp.down_proj.weight
        assert weight.dtype == torch.float32 and not torch.equal(weight, before), dtype
    return losses


def test_bf16_autocast_runs_close_to_fp32():
    fp32, bf16 = run_distributed(_bf16_step, 2)[0]
    assert math.isfinite(bf16) and abs(bf16 - fp32) <= 0.05 * fp32, (fp32, bf16)


def test_bad_input_gives_clear_errors():
    model = Qwen2ForCausalLM(CONFIG)  # no process group: a group of one
    with pytest.raises(ValueError, match=r"max_grad_norm must be a number > 0.*got 0"):
        Trainer(model, max_grad_norm=0)
    with pytest.raises(ValueError, match=r"max_grad_norm .*got -1\.0"):
        Trainer(model, max_grad_norm=-1.0)
    trainer = Trainer(model)
    with pytest.raises(ValueError, match=r"micro_batches must be a non-empty list.*got \[\]"):
        trainer.step([])
    ids = _ids(2, 9)
    with pytest.raises(ValueError, match=r"got one tensor of shape \(2, 9\); pass \[input_ids\]"):
        trainer.step(ids)
    with pytest.raises(
        ValueError,
        match=r"micro_batches\[1\]: labels must be .*\(2, 9\).*"
        r"shape \(2, 8\)",
    ):
        trainer.step([ids, (ids, ids[:, 1:])])
    with pytest.raises(ValueError, match=r"micro_batches\[0\]: input_ids must be .*\(9,\)"):
        trainer.step([ids[0]])
    with pytest.raises(TypeError, match=r"unknown setting\(s\) \['lrr'\]"):
        build_optimizer(model, lrr=1e-3)
    with pytest.raises(
        ValueError, match=r"optimizer.lr must be a finite number in \(0, 1\], got -0\.1"
    ):
        build_optimizer(model, lr=-0.1)
    with pytest.raises(ValueError, match=r"norm_type must be .*got -1"):
        grad_norm(model, norm_type=-1)
    with pytest.raises(ValueError, match=r"max_norm must be a number > 0, got 0"):
        clip_grad_norm_(model, 0)
    # the two parameter groups
    groups = build_optimizer(model, OPTIMIZER).param_groups
    assert [g["weight_decay"] for g in groups] == [OPTIMIZER.weight_decay, 0.0]
    assert all(p.dim() >= 2 for p in groups[0]["params"])
    assert {p.dim() for p in groups[1]["params"]} == {1}
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))


def _step_with_a_token_outside_the_vocabulary():
    state = tp_ext.init_parallel(tp=dist.get_world_size())
    model = Qwen2ForCausalLM(CONFIG, parallel=state)
    trainer = Trainer(model, build_optimizer(model, OPTIMIZER), parallel=state)
    try:
        trainer.step([_ids() + CONFIG.vocab_size])
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("ws", [1, 2])
def test_a_models_own_error_in_a_step_is_raised_as_itself(ws):
    """Not torch's pipeline wrapper ("[Stage 0] failed to run forward: args: ..."): the
    embedding's own ValueError, naming the token id."""
    for said in run_distributed(_step_with_a_token_outside_the_vocabulary, ws):
        assert said is not None and "is outside the vocabulary [0, 1001)" in said, said
