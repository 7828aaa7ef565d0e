"""Experts with sequence parallelism: transformers' Mixtral, Qwen2-MoE (routed experts and a
gated shared expert) and Qwen3-MoE under ``parallelize("auto", sequence_parallel=True)``, their
experts split over TP (ep 1: the block's own forward between one gather and one
reduce-scatter) or spread over an EP group (ep > 1: ExpertParallelMoE, the EP group from DP
ranks or across TP ranks). In fp64: the logits, loss, the model's own load-balancing loss and
every gradient equal the unsharded model's, on sequences split unevenly too; and Trainer steps
(with DDP, FSDP2, ZeRO) equal one process training on every replica's micro-batches."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import tp_ext
from tp_ext.distributed import comm
from tp_ext.layers import full_state_dict
from tp_ext.layers.moe import ExpertParallelMoE

from .dist_utils import run_distributed
from .test_moe import _batch, _check_gradients, _micro_batches, _model, _reference_step

# fp64, but transformers' routers take the softmax of their logits in fp32: what flows back
# through it carries fp32 roundings (about 1e-7 of the largest gradient, the same without
# sequence parallelism); the forward's values are fp64's
EXACT, THROUGH_ROUTER = 1e-10, 1e-6


def _model64(kind):
    model = _model(kind)
    model.config._experts_implementation = "eager"  # torch's grouped_mm takes no fp64
    return model.double()


def _close(got, want, what, tol=EXACT):
    """``got`` equals ``want`` to ``tol`` of ``want``'s largest magnitude."""
    assert got.shape == want.shape, (what, got.shape, want.shape)
    scale = want.abs().max().clamp(min=1e-30) if want.numel() else 1.0
    err = float((got - want).abs().max() / scale) if want.numel() else 0.0
    assert err <= tol, f"{what}: error {err:.3g} of its largest element, over {tol:g}"


def _parity(kind, tp, dp, ep, length):
    state = tp_ext.init_parallel(tp=tp, dp=dp, ep=ep)
    model = _model64(kind)
    ref = copy.deepcopy(model)
    ids = _batch(seed=100 + state.dp_rank, tokens=(2, length))
    ref_out = ref(ids, labels=ids)
    ref_out.loss.backward()
    model, report = tp_ext.parallelize(
        model, "auto", parallel=state, sequence_parallel=True, return_report=True
    )
    with comm.track() as stats:
        out = model(ids, labels=ids)
    out.loss.backward()
    _close(out.logits, ref_out.logits, "logits")
    _close(out.loss, ref_out.loss, "loss")
    _close(out.aux_loss, ref_out.aux_loss, "aux loss (the model's own, every token's routing)")
    _check_gradients(model, ref, state, lambda *args: _close(*args, THROUGH_ROUTER))
    blocks = [m for m in model.modules() if isinstance(m, ExpertParallelMoE)]
    assert len(blocks) == (2 if ep > 1 else 0)
    norm = report["model.layers.0.post_attention_layernorm"]
    assert norm.startswith("sequence_parallel_local"), norm  # the block gathers for itself
    ops = ("gather_from_sp", "reduce_scatter_to_sp", "reduce_from_tp")
    return report["model.layers.0.mlp"], [stats.count(op=op) for op in ops]


# (tp, dp, ep): split experts (ep 1); EP across the TP ranks (tp2-ep2: each rank routes its own
# shard); EP from DP ranks (tp2-dp2-ep2: experts split over TP inside); across TP and DP
DIMS = [(2, 1, 1), (3, 1, 1), (2, 1, 2), (2, 2, 2), (3, 2, 2), (2, 2, 4), (3, 1, 3)]
# make test: each path once (the rest in make test-all)
SMALL = [("mixtral", (2, 1, 1)), ("qwen2_moe", (3, 1, 1)), ("qwen2_moe", (2, 1, 2)),
         ("mixtral", (2, 2, 2))]  # fmt: skip


def _cases():
    qwen3 = [("qwen3_moe", dims) for dims in [(2, 1, 1), (3, 1, 1), (2, 1, 2), (2, 2, 2)]]
    every = [(kind, dims) for kind in ("mixtral", "qwen2_moe") for dims in DIMS] + qwen3
    for kind, dims in every:
        marks = () if (kind, dims) in SMALL else (pytest.mark.full_matrix,)
        yield pytest.param(kind, dims, marks=marks, id="{}-tp{}-dp{}-ep{}".format(kind, *dims))


@pytest.mark.parametrize("kind,dims", _cases())
def test_experts_with_sequence_parallelism_equal_transformers(kind, dims):
    tp, dp, ep = dims
    # 9 positions: uneven over 2 ranks (5, 4); 10 over 3 (4, 3, 3)
    length = 9 if tp == 2 else 10
    results = run_distributed(_parity, tp * dp, kind, tp, dp, ep, length, timeout=300)
    report, counts = results[0]
    if ep == 1:
        assert "reduce-scattered on exit" in report, report
    else:
        assert "sequence shard in and out" in report, report
    # The forward's collectives over TP, with 2 layers: each layer's input norm gathers, its
    # attention reduce-scatters, and each MoE block gathers once and reduce-scatters once, but
    # not with an EP group across TP ranks and no shared expert (each rank's shard routed as it
    # is); the final norm gathers for the head. No all-reduce but the embedding's.
    per_block = 0 if ep > dp and kind != "qwen2_moe" else 1
    assert counts == [2 + 2 * per_block + 1, 2 + 2 * per_block, 1], counts


def _other_lengths(kind, ep):
    """An even split (12 over 2 and 3 ranks), a sequence as long as the TP group (3) and one
    shorter (2: over 3 ranks one holds no position)."""
    for length in (12, 3, 2):
        _parity(kind, dist.get_world_size(), 1, ep, length)


@pytest.mark.full_matrix
@pytest.mark.parametrize("ws", [2, 3])
@pytest.mark.parametrize("kind,ep", [("qwen2_moe", 1), ("mixtral", "tp")])
def test_even_short_and_empty_shards(kind, ep, ws):
    run_distributed(_other_lengths, ws, kind, ws if ep == "tp" else ep, timeout=300)


def _misuse():
    """A plan whose norm gathers the sequence for a sparse-MoE block (which gathers its own), or
    that keeps the experts whole: refused, naming the block and what would work."""
    from tp_ext.parallelize.plan import auto_plan

    tp_ext.init_parallel(tp=dist.get_world_size())
    model = _model64("mixtral")
    plan = auto_plan(model, sequence_parallel=True)
    gathering = {**plan, "model.layers.0.post_attention_layernorm": "sequence_parallel"}
    tp_ext.parallelize(model, gathering, sequence_parallel=True)
    ids = _batch(seed=1, tokens=(2, 9))
    with pytest.raises(ValueError, match="mlp .MixtralSparseMoeBlock.: expected this rank's seq"):
        model(ids)
    whole = {**plan, "model.layers.1.mlp.experts": "replicate"}
    with pytest.raises(ValueError, match=r"so model.layers.1.mlp.experts must be split over TP"):
        tp_ext.parallelize(_model64("mixtral"), whole, sequence_parallel=True)


def test_misuse_is_refused_by_name():
    run_distributed(_misuse, 2)


# ---- training with the Trainer -------------------------------------------------------------------


def _train(kind, tp, dp, ep, data_parallel):
    state = tp_ext.init_parallel(tp=tp, dp=dp, ep=ep)
    model = _model64(kind)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    tp_ext.parallelize(model, "auto", parallel=state, sequence_parallel=True)
    trainer = tp_ext.training.Trainer(
        model,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.5),
        parallel=state,
        max_grad_norm=0.5,
        data_parallel=data_parallel,
    )
    for step in range(3):
        loss = trainer.step(_micro_batches(state.dp_rank, step))
        every = [b for r in range(dp) for b in _micro_batches(r, step)]
        want, norm = _reference_step(ref, ref_opt, every, with_aux=True)
        assert abs(loss - want) <= THROUGH_ROUTER * abs(want), (step, loss, want)
        assert abs(trainer.last_grad_norm - norm) <= THROUGH_ROUTER * norm, (step, norm)
    with trainer.whole_parameters():
        weights = full_state_dict(model)  # gathered over TP, EP and FSDP2's shards
    for name, want in ref.state_dict().items():
        _close(weights[name], want, name, THROUGH_ROUTER)


TRAIN = [
    pytest.param("qwen2_moe", (2, 1, 1), "ddp", id="qwen2_moe-tp2"),
    pytest.param("mixtral", (2, 2, 2), "ddp", id="mixtral-tp2-dp2-ep2-ddp"),
    pytest.param("qwen2_moe", (2, 2, 1), "fsdp", id="qwen2_moe-tp2-dp2-fsdp"),
    pytest.param("mixtral", (3, 1, 3), "ddp", id="mixtral-tp3-ep3", marks=pytest.mark.full_matrix),
    pytest.param("qwen2_moe", (2, 2, 2), "zero2", id="qwen2_moe-tp2-dp2-ep2-zero2",
                 marks=pytest.mark.full_matrix),
    pytest.param("mixtral", (2, 2, 4), "fsdp", id="mixtral-tp2-dp2-ep4-fsdp",
                 marks=pytest.mark.full_matrix),
    pytest.param("qwen2_moe", (2, 2, 1), "zero1", id="qwen2_moe-tp2-dp2-zero1",
                 marks=pytest.mark.full_matrix),
    pytest.param("qwen3_moe", (2, 1, 2), "ddp", id="qwen3_moe-tp2-ep2",
                 marks=pytest.mark.full_matrix),
]  # fmt: skip


@pytest.mark.parametrize("kind,dims,data_parallel", TRAIN)
def test_trainer_steps_equal_one_process(kind, dims, data_parallel):
    tp, dp, ep = dims
    run_distributed(_train, tp * dp, kind, tp, dp, ep, data_parallel, timeout=400)
