"""The distributed optimizer (tp_ext/training/zero.py) beyond the exact-training matrix of
tests/test_pipeline.py (``zero1`` / ``zero2`` cases there: losses, norms and weights after 5 AdamW
steps equal one process's): each DP rank's optimizer state is its rows alone (the ranks' rows
together are DDP's state, exactly); checkpoints saved under ZeRO load at another DP degree and
into DDP and FSDP2 runs, and DDP's into ZeRO; the DP gradient sum in bfloat16 sends half the
bytes and trains as fp32 does; what is not supported is refused by name."""

from __future__ import annotations

import pytest
import torch

import tp_ext
from tp_ext import comm
from tp_ext.distributed import async_groups
from tp_ext.training import Trainer
from tp_ext.training.zero import ShardedOptimizer

from .dist_utils import run_distributed
from .test_pipeline import _build, _config, _micro_batches, _optimizer

LAYERS = 2
GLOBAL = 12  # micro-batches per step over all replicas (each of 2 rows; 2, 3 and 4 divide it)


def _trainer(dp, data_parallel, tp=1, pp=1, **options):
    config = _config(LAYERS, False)
    state, model = _build(config, tp, pp, dp, "1F1B")
    trainer = Trainer(
        model,
        optimizer=_optimizer,
        parallel=state,
        max_grad_norm=0.5,
        data_parallel=data_parallel,
        **options,
    )
    return state, model, trainer


def _mine(state, step: int):
    """This replica's micro-batches of the step's global batch (the same at every DP degree)."""
    batches = _micro_batches(_config(LAYERS, False), GLOBAL, seed=100 + step)
    per = GLOBAL // state.dp
    return batches[state.dp_rank * per : (state.dp_rank + 1) * per]


def _state_case(dp):
    state, model, trainer = _trainer(dp, "zero2")
    trainer.step(_mine(state, 0))
    optimizer = trainer.optimizer
    assert isinstance(optimizer, ShardedOptimizer)
    mine = {"exp_avg": 0, "exp_avg_sq": 0}
    whole = 0
    for param in model.parameters():
        state_of = optimizer.inner.state[optimizer._master[param]]
        rows = -(-param.shape[0] // dp)  # torch.chunk's split, as FSDP2's
        start = min(param.shape[0], state.dp_rank * rows)
        held = (min(param.shape[0], start + rows) - start) * param[0].numel()
        for key in mine:
            assert state_of[key].numel() == held, (key, tuple(param.shape))
            mine[key] += state_of[key].numel()
        whole += param.numel()
        # the checkpoint's view: this rank's rows of a tensor shaped like the parameter
        view = optimizer.state[param]["exp_avg"]
        assert tuple(view.shape) == tuple(param.shape) and view.to_local().numel() == held
    counts = torch.tensor([mine["exp_avg"], mine["exp_avg_sq"]], dtype=torch.float64)
    summed = comm.all_reduce(counts, "sum", group=state.dp_group)
    # the DP ranks' rows together: every element of DDP's state once
    assert summed.tolist() == [whole, whole], (summed, whole)
    return mine["exp_avg"], whole


@pytest.mark.parametrize("dp", [2, 3])
def test_optimizer_state_is_each_ranks_rows(dp):
    results = run_distributed(_state_case, dp, dp)
    per_rank = [r[0] for r in results]
    whole = results[0][1]
    assert sum(per_rank) == whole and max(per_rank) - min(per_rank) < whole / dp / 10


def _save_case(directory, dp, data_parallel):
    """Two steps, a checkpoint, two more: the last two losses."""
    state, _, trainer = _trainer(dp, data_parallel)
    for step in range(2):
        trainer.step(_mine(state, step))
    trainer.save_checkpoint(directory)
    return [trainer.step(_mine(state, step)) for step in (2, 3)]


def _load_case(directory, dp, data_parallel):
    state, _, trainer = _trainer(dp, data_parallel)
    trainer.load_checkpoint(directory)
    assert trainer.steps == 2
    return [trainer.step(_mine(state, step)) for step in (2, 3)]


@pytest.mark.parametrize(
    "saved,loaded",
    [
        ((2, "zero2"), (4, "zero1")),  # another DP degree and stage
        ((2, "zero2"), (2, "ddp")),  # into DDP
        ((2, "zero1"), (2, "fsdp")),  # into FSDP2
        ((2, "ddp"), (3, "zero2")),  # DDP's into ZeRO, at DP 3 (uneven rows)
    ],
    ids=lambda c: f"{c[1]}-dp{c[0]}",
)
def test_checkpoints_move_between_zero_ddp_and_fsdp(tmp_path, saved, loaded):
    directory = str(tmp_path / "ckpt")
    expected = run_distributed(_save_case, saved[0], directory, *saved)[0]
    got = run_distributed(_load_case, loaded[0], directory, *loaded)[0]
    # the weights (the first loss) and the optimizer state (the second) carried over
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)


def _reduce_dtype_case(data_parallel):
    sent, losses = {}, {}
    for dtype in (None, torch.bfloat16):
        state, model, trainer = _trainer(2, data_parallel, grad_reduce_dtype=dtype)
        losses[dtype] = []
        for step in range(4):
            with comm.track() as stats:
                losses[dtype].append(trainer.step(_mine(state, step)))
        sent[dtype] = stats.bus_bytes(2, tag="train.dp_sync")  # what each rank sends
    numel = sum(p.numel() for p in model.parameters())
    return sent, losses, numel


@pytest.mark.parametrize("data_parallel", ["ddp", "zero1", "zero2"])
def test_gradient_sum_in_bfloat16_sends_half_the_bytes(data_parallel):
    sent, losses, numel = run_distributed(_reduce_dtype_case, 2, data_parallel)[0]
    # one step's fp32 gradient sum at 2 ranks: an all-reduce sends 2 (w-1)/w x 4 bytes per
    # element (DDP's own, not tracked), a reduce-scatter (w-1)/w x 4 (ZeRO-2's, tracked)
    fp32 = 4 * numel if data_parallel != "zero2" else 2 * numel
    if data_parallel == "zero2":
        assert sent[None] == fp32, (sent, numel)
    assert sent[torch.bfloat16] * 2 == fp32, (sent, numel)  # half of it in bfloat16
    torch.testing.assert_close(losses[torch.bfloat16], losses[None], rtol=5e-3, atol=0)


def _refusals():
    state = tp_ext.init_parallel(tp=1, dp=2)
    config = _config(LAYERS, False)
    _, model = _build(config, 1, 1, 2, "1F1B")
    cases = [
        (dict(data_parallel="fsdp", grad_reduce_dtype=torch.bfloat16), "MixedPrecisionPolicy"),
        (dict(data_parallel="zero1", grad_reduce_dtype=torch.int8), "grad_reduce_dtype"),
        (dict(data_parallel="ddp", gradient_compression="int8", grad_reduce_dtype=torch.bfloat16),
         "gradient_compression"),
        (dict(data_parallel="zero3"), "data_parallel must be one of"),
        (dict(data_parallel="ddp", overlap_param_gather=True), "only the distributed optimizer"),
    ]  # fmt: skip
    for options, words in cases:
        with pytest.raises(ValueError, match=words):
            Trainer(model, optimizer=_optimizer, parallel=state, **options)
    with pytest.raises(ValueError, match="element-wise optimizers"):
        Trainer(
            model,
            optimizer=lambda params: torch.optim.LBFGS(params),
            parallel=state,
            data_parallel="zero2",
        )
    with pytest.raises(ValueError, match="pass parallel="):
        Trainer(model, optimizer=_optimizer, data_parallel="zero1")
    stepped = _optimizer(model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    stepped.step()
    with pytest.raises(ValueError, match="stepped already"):
        Trainer(model, optimizer=stepped, parallel=state, data_parallel="zero1")


def test_unsupported_combinations_are_refused():
    run_distributed(_refusals, 2)


def _bf16_masters_case():
    """bf16 parameters: fp32 master rows, the parameters their rounding; ZeRO-1 and ZeRO-2 agree."""
    results = {}
    for data_parallel in ("zero1", "zero2"):
        state, model, trainer = _trainer(2, data_parallel)
        model.to(torch.bfloat16)
        trainer = Trainer(model, optimizer=_optimizer, parallel=state, data_parallel=data_parallel)
        losses = [trainer.step(_mine(state, step)) for step in range(3)]
        optimizer = trainer.optimizer
        for param, master in optimizer._master.items():
            assert master.dtype == torch.float32 and param.dtype == torch.bfloat16
            start, count = optimizer._rows[param]
            rows = param.detach().view(-1, *param.shape[1:])[start : start + count]
            assert torch.equal(rows, master.view_as(rows).to(torch.bfloat16))
        results[data_parallel] = losses
    assert results["zero1"] == results["zero2"], results


def test_bfloat16_parameters_keep_fp32_master_rows():
    run_distributed(_bf16_masters_case, 2)


def _float16_case():
    """fp16 autocast with its loss scale: ZeRO-1 and ZeRO-2 take DDP's steps (the same skipped
    overflow steps, the same unscaled gradient norms, losses and weights)."""
    results = {}
    for data_parallel in ("ddp", "zero1", "zero2"):
        state, model, trainer = _trainer(2, data_parallel, autocast_dtype=torch.float16)
        trainer.scaler.update(2.0**23)  # overflows at first: the first steps are skipped
        losses, norms, skipped = [], [], []
        for step in range(6):
            losses.append(trainer.step(_mine(state, step)))
            norms.append(float(trainer.last_grad_norm))
            skipped.append(trainer.skipped_steps)
        weights = {k: v.clone() for k, v in model.state_dict().items()}
        results[data_parallel] = (losses, norms, skipped, weights)
    return results


def test_float16_autocast_with_zero_steps_as_ddp():
    from .test_pipeline import LR

    for results in run_distributed(_float16_case, 2):
        losses, norms, skipped, weights = results["ddp"]
        assert skipped[0] and skipped[-1] < 6, skipped  # both paths of the loss scale ran
        for data_parallel in ("zero1", "zero2"):
            other_losses, other_norms, other_skipped, other_weights = results[data_parallel]
            assert other_skipped == skipped, (data_parallel, other_skipped, skipped)
            # ZeRO-2's gradient norm adds its rows' squares in another order: fp32 rounding,
            # which the fp16 forward of the next steps magnifies to fp16's; a missed unscale
            # would be off by the scale (2**20 and more)
            torch.testing.assert_close(other_norms, norms, rtol=1e-4, atol=0, equal_nan=True)
            torch.testing.assert_close(other_losses, losses, rtol=1e-4, atol=0)
            for name, tensor in weights.items():  # Adam moves a near-zero gradient's by ~lr
                torch.testing.assert_close(other_weights[name], tensor, rtol=1e-3, atol=LR)


def _bf16_trainer(dp, data_parallel):
    state, model, _ = _trainer(dp, data_parallel)
    model.to(torch.bfloat16)
    trainer = Trainer(model, optimizer=_optimizer, parallel=state, data_parallel=data_parallel)
    return state, model, trainer


def _masters(model, trainer) -> dict:
    """Every bf16 parameter's whole fp32 master (gathered over DP), by name."""
    return {
        name: trainer.optimizer.master_weights(p).full_tensor()
        for name, p in model.named_parameters()
    }


def _bf16_save_case(directory, dp, data_parallel):
    state, model, trainer = _bf16_trainer(dp, data_parallel)
    for step in range(2):
        trainer.step(_mine(state, step))
    trainer.save_checkpoint(directory)
    masters = _masters(model, trainer)
    return masters, [trainer.step(_mine(state, step)) for step in (2, 3)]


def _bf16_load_case(directory, dp, data_parallel):
    state, model, trainer = _bf16_trainer(dp, data_parallel)
    trainer.load_checkpoint(directory)
    return _masters(model, trainer), [trainer.step(_mine(state, step)) for step in (2, 3)]


@pytest.mark.parametrize("loaded", [(2, "zero2"), (3, "zero1")], ids=lambda c: f"{c[1]}-dp{c[0]}")
def test_bfloat16_master_rows_are_saved_and_resume(tmp_path, loaded):
    directory = str(tmp_path / "ckpt")
    masters, losses = run_distributed(_bf16_save_case, 2, directory, 2, "zero2")[0]
    assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in masters.values())
    got_masters, got_losses = run_distributed(_bf16_load_case, loaded[0], directory, *loaded)[0]
    for name, master in masters.items():  # the fp32 rows themselves, not the bf16 weights'
        assert torch.equal(got_masters[name], master), name
    if loaded == (2, "zero2"):  # the same run, resumed: bitwise the uninterrupted one
        assert got_losses == losses, (got_losses, losses)
    else:
        torch.testing.assert_close(got_losses, losses, rtol=1e-2, atol=0)


def _overlap_case(data_parallel, pp, directory):
    """The same run with each bucket's parameter all-gather left in flight after the step (and
    waited for by the next forward), and without."""
    results = {}
    for overlap in (False, True):
        state, model, trainer = _trainer(2, data_parallel, pp=pp, overlap_param_gather=overlap)
        trainer.optimizer.bucket_bytes = 8192  # several buckets
        losses, in_flight = [], []
        for step in range(4):
            losses.append(trainer.step(_mine(state, step)))
            in_flight.append(trainer.optimizer.gathers_in_flight)
            if step == 1:  # a checkpoint between steps waits for the gathers
                trainer.save_checkpoint(f"{directory}/{int(overlap)}")
                in_flight.append(trainer.optimizer.gathers_in_flight)
        weights = {k: v.clone() for k, v in model.state_dict().items()}  # waits too
        results[overlap] = (losses, in_flight, weights, trainer.optimizer.gathers_in_flight)
    # the optimizer set up its gloo DP group's asynchronous collectives when built: a companion
    # group with one worker thread (tp_ext/distributed/async_groups.py)
    companion = async_groups.companion_of(trainer.optimizer.dp)
    results["threads"] = companion._get_backend(torch.device("cpu")).options._threads
    return results


@pytest.mark.parametrize("data_parallel, pp", [("zero1", 1), ("zero2", 1), ("zero2", 2)])
def test_parameter_gather_overlapped_with_the_next_forward(tmp_path, data_parallel, pp):
    results_of_ranks = run_distributed(_overlap_case, 2 * pp, data_parallel, pp, str(tmp_path))
    for results in results_of_ranks:
        losses, in_flight, weights, left = results[False]
        assert in_flight == [0] * 5 and left == 0
        got_losses, got_in_flight, got_weights, got_left = results[True]
        assert got_losses == losses  # the same numbers, only waited for later
        assert all(n > 1 for i, n in enumerate(got_in_flight) if i != 2), got_in_flight
        assert got_in_flight[2] == 0 and got_left == 0  # the checkpoint and state_dict waited
        for name, tensor in weights.items():
            assert torch.equal(got_weights[name], tensor), name
        assert results["threads"] == 1
