"""tp_ext.compression: the quantisation ops (opcheck, parity with a pure-PyTorch reference, odd
sizes, errors), error feedback exact over many steps, the hooks under DDP at world sizes 1-4
(the average of every rank's gradients up to the residual, bytes on the DP group against an
fp32 all-reduce), the residuals' state_dict (a resumed run is the same run), the switch."""

from __future__ import annotations

import pytest
import torch

from tests.common import WORLD_SIZES
from tests.dist_utils import run_distributed
from tp_ext import ops
from tp_ext.pipeline.schedules import weight_split_supported

# ---- ops against a pure-PyTorch reference -------------------------------------------------------


def _reference(grad, residual, chunk, one_bit):
    """(values sent, new residual, scales) of the quantiser, in plain PyTorch."""
    v = grad.float() + residual
    n = v.numel()
    pad = (-n) % chunk
    blocks = torch.nn.functional.pad(v, (0, pad)).view(-1, chunk)
    lengths = torch.full((blocks.size(0),), chunk, dtype=torch.float32)
    if pad:
        lengths[-1] = chunk - pad
    if one_bit:
        scales = blocks.abs().sum(1) / lengths
        sent = torch.where(v >= 0, 1.0, -1.0) * scales.repeat_interleave(chunk)[:n]
    else:
        scales = blocks.abs().amax(1) / 127
        s = scales.repeat_interleave(chunk)[:n]
        q = torch.where(s > 0, torch.round(v / torch.where(s > 0, s, 1)), 0).clamp(-127, 127)
        sent = q * s
    return sent, v - sent, scales


@pytest.mark.parametrize("one_bit", [False, True], ids=["int8", "1bit"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("n, chunk", [(1000, 64), (7, 8), (4096, 512), (1, 8), (130, 16)])
def test_quantise_matches_the_reference(one_bit, dtype, n, chunk):
    torch.manual_seed(n)
    grad = (torch.randn(n) * torch.logspace(-3, 1, n)).to(dtype)
    residual = torch.randn(n) * 1e-3
    sent, new_residual, scales = _reference(grad, residual, chunk, one_bit)
    r = residual.clone()
    if one_bit:
        codes, got_scales = ops.quantize_1bit_ef(grad, r, chunk)
        got = ops.dequantize_1bit(codes, got_scales, chunk, n)
        assert codes.dtype == torch.uint8 and codes.numel() == -(-n // 8)
    else:
        codes, got_scales = ops.quantize_int8_ef(grad, r, chunk)
        got = ops.dequantize_int8(codes, got_scales, chunk)
        assert codes.dtype == torch.int8 and codes.numel() == n
        assert codes.abs().max() <= 127
    assert got_scales.dtype == torch.float32 and got_scales.numel() == -(-n // chunk)
    torch.testing.assert_close(got_scales, scales, rtol=1e-6, atol=0)
    torch.testing.assert_close(got, sent, rtol=1e-6, atol=1e-7)
    # v - sent rounds to fp32 at v's magnitude
    ulp = 2e-7 * (grad.float() + residual).abs().max().item()
    torch.testing.assert_close(r, new_residual, rtol=0, atol=4 * ulp)


def test_empty_and_zero_gradients():
    r = torch.zeros(0)
    codes, scales = ops.quantize_int8_ef(torch.zeros(0), r, 8)
    assert codes.numel() == 0 and scales.numel() == 0
    assert ops.dequantize_1bit(torch.zeros(0, dtype=torch.uint8), scales, 8, 0).numel() == 0
    r = torch.zeros(20)
    codes, scales = ops.quantize_int8_ef(torch.zeros(20), r, 8)
    assert (codes == 0).all() and (scales == 0).all() and (r == 0).all()


@pytest.mark.parametrize("one_bit", [False, True], ids=["int8", "1bit"])
def test_error_feedback_is_exact_over_many_steps(one_bit):
    """What was sent plus the residual is the running sum of the gradients, after any step."""
    torch.manual_seed(0)
    n, chunk = 3000, 256
    residual = torch.zeros(n)
    sent_sum = torch.zeros(n, dtype=torch.float64)
    grad_sum = torch.zeros(n, dtype=torch.float64)
    for step in range(50):
        grad = torch.randn(n) * (1 + step % 7)
        grad_sum += grad.double()
        if one_bit:
            sent = ops.dequantize_1bit(*ops.quantize_1bit_ef(grad, residual, chunk), chunk, n)
        else:
            sent = ops.dequantize_int8(*ops.quantize_int8_ef(grad, residual, chunk), chunk)
        sent_sum += sent.double()
        err = (sent_sum + residual.double() - grad_sum).abs().max().item()
        assert err < 1e-4 * (1 + step), (step, err)
    # and the residual stays bounded (it is the last step's error, not a growing sum)
    assert residual.abs().max() < 4 * grad_sum.abs().max() / 50 + 50


def test_opcheck():
    tests = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    grad = torch.randn(100)
    torch.library.opcheck(ops.quantize_int8_ef, (grad, torch.zeros(100), 16), test_utils=tests)
    torch.library.opcheck(ops.quantize_1bit_ef, (grad, torch.zeros(100), 16), test_utils=tests)
    codes, scales = ops.quantize_int8_ef(grad, torch.zeros(100), 16)
    torch.library.opcheck(ops.dequantize_int8, (codes, scales, 16), test_utils=tests)
    bits, scales = ops.quantize_1bit_ef(grad, torch.zeros(100), 16)
    torch.library.opcheck(ops.dequantize_1bit, (bits, scales, 16, 100), test_utils=tests)


def test_bad_arguments_are_refused_clearly():
    g = torch.randn(10)
    with pytest.raises(ValueError, match="chunk_size must be >= 1, got 0"):
        ops.quantize_int8_ef(g, torch.zeros(10), 0)
    with pytest.raises(ValueError, match="chunk_size must be a multiple of 8"):
        ops.quantize_1bit_ef(g, torch.zeros(10), 12)
    with pytest.raises(ValueError, match="residual has 9 elements but grad has 10"):
        ops.quantize_int8_ef(g, torch.zeros(9), 8)
    with pytest.raises(ValueError, match="residual must be a contiguous 1-D float32"):
        ops.quantize_int8_ef(g, torch.zeros(10, dtype=torch.float64), 8)
    with pytest.raises(ValueError, match="grad must be a dense 1-D tensor"):
        ops.quantize_int8_ef(g.view(2, 5), torch.zeros(10), 8)
    with pytest.raises(ValueError, match="grad must be floating point"):
        ops.quantize_int8_ef(torch.ones(10, dtype=torch.long), torch.zeros(10), 8)
    with pytest.raises(ValueError, match="scales has 1 entries; 10 elements in chunks of 8 need 2"):
        ops.dequantize_int8(torch.zeros(10, dtype=torch.int8), torch.zeros(1), 8)
    with pytest.raises(ValueError, match="codes has 1 entries; 10 elements need 2"):
        ops.dequantize_1bit(torch.zeros(1, dtype=torch.uint8), torch.zeros(2), 8, 10)
    from tp_ext.compression import CompressionState, register

    with pytest.raises(ValueError, match="method must be one of"):
        CompressionState(None, "int4")
    with pytest.raises(ValueError, match="chunk_size=12 with method='1bit'"):
        CompressionState(None, "1bit", chunk_size=12)
    with pytest.raises(ValueError, match="gradient compression must be one of"):
        register(object(), "fp8")


# ---- the hooks under DDP -------------------------------------------------------------------------


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(37, 300),
        torch.nn.Tanh(),
        torch.nn.Linear(300, 300),
        torch.nn.Linear(300, 5),
    )


def _ddp_steps(method, steps, state_in=None, start=0):
    """``steps`` backward passes of a DDP model with ``method``'s hook (tiny buckets: several
    per step), every rank on its own data. Returns per rank: the sum of what DDP left in .grad,
    the sum of the true mean gradients, the residuals (state_dict), the bus bytes per step and
    what an fp32 all-reduce of the same gradients moves."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import tp_ext
    from tp_ext.compression import register

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model()
    plain = _model()
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.1)
    state = register(ddp, method, dist.group.WORLD)
    if state_in is not None:
        state.load_state_dict(state_in[rank])
    numel = sum(p.numel() for p in model.parameters())
    sent = [torch.zeros_like(p, dtype=torch.float64) for p in model.parameters()]
    true = [torch.zeros_like(p, dtype=torch.float64) for p in model.parameters()]
    bus = []
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(8, 37, generator=g) * (1 + rank)
        ddp.zero_grad()
        with tp_ext.comm.track() as stats:
            ddp(x).pow(2).sum().backward()
        bus.append(stats.bus_bytes(world))
        plain.zero_grad()
        plain(x).pow(2).sum().backward()
        for s, t, p, q in zip(sent, true, model.parameters(), plain.parameters()):
            s += p.grad.double()
            mean = q.grad.clone()
            dist.all_reduce(mean)
            t += mean.double() / world
    residuals = state.state_dict()
    return {
        "sent": sent,
        "true": true,
        "residuals": residuals,
        "bus": bus,
        "fp32_bus": 2 * (world - 1) / world * numel * 4,
    }


def _unsent(out, name) -> torch.Tensor:
    """What the ranks hold back of ``name``'s average: their mean residual plus the server
    residuals (rank k's covers segment k; the segments follow one another)."""
    from tp_ext.compression.hooks import SERVER

    mean = sum(o["residuals"][name] for o in out).double() / len(out)
    server = torch.cat([o["residuals"][name + SERVER] for o in out]).double()
    return mean + server if len(out) > 1 else mean


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("method", ["int8", "1bit"])
def test_ddp_hook_averages_with_exact_error_feedback(world, method):
    steps = 6
    out = run_distributed(_ddp_steps, world, method, steps)
    names = [n for n, _ in _model().named_parameters()]
    for r, o in enumerate(out):
        for name, s, t in zip(names, o["sent"], o["true"]):
            # every rank holds the same averaged gradients
            torch.testing.assert_close(s, out[0]["sent"][names.index(name)], rtol=0, atol=0)
            # sent + the ranks' mean residual + the server residuals = the sum of the true
            # means, to fp32 rounding
            err = (s + _unsent(out, name).view_as(s) - t).abs().max().item()
            assert err <= 1e-5 * (1 + t.abs().max().item()), (r, name, err)
    # compression is not a no-op: one step alone differs from the true mean (world > 1 or not)
    assert any(not torch.equal(s, t) for s, t in zip(out[0]["sent"], out[0]["true"]))
    if world > 1:
        limit = 0.26 if method == "int8" else 0.04
        for o in out:
            ratios = [b / o["fp32_bus"] for b in o["bus"]]
            assert max(ratios) <= limit, ratios


def test_resumed_residuals_lose_nothing():
    """Three steps, the residuals saved and loaded into a fresh state, then three more: what
    both runs sent plus the final residuals is the sum of all six steps' true mean gradients,
    as if it had been one run. Without loading them, the first run's residuals are missing."""
    world = 2
    first = run_distributed(_ddp_steps, world, "int8", 3)
    saved = [o["residuals"] for o in first]
    second = run_distributed(_ddp_steps, world, "int8", 3, saved, 3)
    fresh = run_distributed(_ddp_steps, world, "int8", 3, None, 3)
    names = [n for n, _ in _model().named_parameters()]

    def error(after):
        worst = 0.0
        for i, name in enumerate(names):
            sent = first[0]["sent"][i] + after[0]["sent"][i]
            true = first[0]["true"][i] + after[0]["true"][i]
            residual = _unsent(after, name)
            worst = max(worst, (sent + residual.view_as(sent) - true).abs().max().item())
        return worst

    assert error(second) < 1e-5
    lost = max(_unsent(first, n).abs().max().item() for n in names)
    assert error(fresh) > 0.5 * lost > 0


@pytest.mark.parametrize("world", [2, 3])
def test_powersgd_error_is_saved_by_parameter_and_nothing_is_lost(world):
    """PowerSGD's error feedback: what the hook returned plus the ranks' mean error is the sum of
    the true mean gradients, over a run cut in two (4 steps, two of them compressed; saved by
    parameter; 4 more in a fresh DDP, whose buckets are numbered anew). Without the saved
    error the second run misses it."""
    from tp_ext.compression.powersgd import ERROR, ITER

    first = run_distributed(_ddp_steps, world, "powersgd", 4)
    saved = [o["residuals"] for o in first]
    assert all(int(s[ITER]) == 4 for s in saved)
    second = run_distributed(_ddp_steps, world, "powersgd", 4, saved, 4)
    fresh = run_distributed(_ddp_steps, world, "powersgd", 4, None, 4)
    names = [n for n, _ in _model().named_parameters()]

    def unsent(out, name):
        return sum(o["residuals"][name + ERROR] for o in out).double() / world

    def error(after):
        worst = 0.0
        for i, name in enumerate(names):
            sent = first[0]["sent"][i] + after[0]["sent"][i]
            true = first[0]["true"][i] + after[0]["true"][i]
            worst = max(worst, (sent + unsent(after, name).view_as(sent) - true).abs().max().item())
        return worst

    lost = max(unsent(first, n).abs().max().item() for n in names)
    assert lost > 0  # the 2-D weights were compressed and left an error
    assert error(second) < 1e-4 * (1 + lost)
    assert error(fresh) > 0.5 * lost


def _powersgd_state_of_a_submodule():
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from tp_ext.compression import register

    model = _model()
    ddp = DistributedDataParallel(model[0])  # one stage of the model, as a pipeline wraps it
    state = register(ddp, "powersgd", dist.group.WORLD, model.named_parameters())
    return sorted(state.state_dict())


def test_powersgd_state_holds_its_own_module_only():
    """With several DDP modules on a rank (interleaved stages), each PowerSGD state saves its
    own parameters' errors (others' would be zeros overwriting the real ones)."""
    keys = run_distributed(_powersgd_state_of_a_submodule, 2)[0]
    assert keys == ["0.bias.powersgd_error", "0.weight.powersgd_error", "powersgd.iter"]


def _powersgd_trains():
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from tp_ext.compression import register

    model = _model()
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.1)  # several buckets in flight
    state = register(ddp, "powersgd", dist.group.WORLD)
    assert register(ddp, None) is None
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    x = torch.randn(16, 37, generator=torch.Generator().manual_seed(dist.get_rank()))
    losses = []
    for _ in range(12):
        opt.zero_grad()
        loss = ddp(x).pow(2).sum()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.zeros_like(weights) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, weights)
    return type(state).__name__, losses, all(torch.equal(g, weights) for g in gathered)


@pytest.mark.parametrize("world", [2, 3])
def test_powersgd_through_the_same_switch(world):
    for name, losses, replicas_agree in run_distributed(_powersgd_trains, world):
        assert name == "PowerSGDCompression"
        assert replicas_agree  # the replicas take the same (compressed) averaged step
        assert losses[-1] < losses[0]


# ---- the Trainer: gradient_compression= --------------------------------------------------------


RESUME = [
    # dims (tp, pp, dp), schedule, method
    ((1, 2, 2), "1F1B", "int8"),  # DDP per pipeline stage
    ((2, 1, 2), "1F1B", "1bit"),  # TP inside, DP over the compressed hook
    ((1, 1, 3), "1F1B", "int8"),  # 3 ranks: uneven segments, DDP re-bucketing
    ((1, 1, 2), "ZBVZeroBubble", "1bit"),  # weight-split: tp_ext's own compressed average
]


def _onebit_adam(params):
    from tp_ext.compression import OneBitAdam

    return OneBitAdam(params, lr=1e-3, weight_decay=0.1, eps=1e-6, freeze_step=2)


def test_trainer_resume_with_onebit_adam_is_bitwise(tmp_path):
    """1-bit Adam saved at step 2, its last uncompressed one: the resumed run compresses the
    momentum from the frozen variance on, bitwise as the uninterrupted run."""
    from tests.test_training_state import _same_dims

    _same_dims(
        tmp_path, (1, 1, 2), "1F1B", "ddp", 0.0, False, False,
        gradient_compression="1bit", optimizer=_onebit_adam,
    )  # fmt: skip


def _powersgd_errors_through_checkpoint(path):
    import torch.distributed as dist

    import tp_ext
    from tests.test_pipeline import _config
    from tp_ext.models import Qwen2ForCausalLM
    from tp_ext.training import Trainer

    state = tp_ext.init_parallel(tp=1, pp=1, dp=dist.get_world_size())

    def trainer():
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(_config(2, False), parallel=state)
        return Trainer(model, parallel=state, gradient_compression="powersgd")

    g = torch.Generator().manual_seed(10 + state.dp_rank)
    first = trainer()
    batches = [torch.randint(0, 64, (2, 16), generator=g) for _ in range(2)]
    for _ in range(4):  # PowerSGD compresses from the third step
        first.step(batches)
    saved = {k: v.clone() for k, v in first.compression_residuals().items()}
    first.save_checkpoint(path)
    second = trainer()
    second.load_checkpoint(path)
    loaded = second.compression_residuals()
    errors = [k for k in saved if k.endswith("powersgd_error")]
    same = sorted(saved) == sorted(loaded) and all(torch.equal(saved[k], loaded[k]) for k in errors)
    nonzero = any(saved[k].abs().sum() > 0 for k in errors)
    # the step count resumes one step before compressing (DDP's buckets are new)
    return same, nonzero, int(saved["powersgd.iter"]), int(loaded["powersgd.iter"])


def test_trainer_checkpoint_restores_powersgd_errors(tmp_path):
    out = run_distributed(_powersgd_errors_through_checkpoint, 2, str(tmp_path))
    for same, nonzero, saved_iter, loaded_iter in out:
        assert nonzero  # the compressed steps left errors to restore
        assert same
        assert (saved_iter, loaded_iter) == (4, 1)


def test_trainer_resumes_powersgd(tmp_path):
    """PowerSGD through the Trainer's checkpoint: its error by parameter and step count are
    saved per rank and the run goes on (not bitwise: its first resumed step is uncompressed and
    its Q matrices are drawn again), its losses next to the uninterrupted run's."""
    from tests.test_training_state import STEPS, _run

    path = str(tmp_path / "ckpt")
    args = ((1, 1, 2), "1F1B", "ddp", 0.0, False)
    losses, _ = _run(*args, save=path, gradient_compression="powersgd")
    resumed, _ = _run(*args, load=path, gradient_compression="powersgd")
    assert sorted(resumed)[-1] == STEPS
    for step, loss in resumed.items():
        assert abs(loss - losses[step]) <= 0.02 * losses[step], (step, loss, losses[step])


@pytest.mark.parametrize("case", RESUME, ids=str)
def test_trainer_resume_with_compression_is_bitwise(tmp_path, case):
    """The residuals travel with the checkpoint: the resumed run's losses and gradient norms
    are bitwise the uninterrupted compressed run's."""
    from tests.test_training_state import _same_dims

    dims, schedule, method = case
    _same_dims(tmp_path, dims, schedule, "ddp", 0.0, False, False, gradient_compression=method)


def _compressed_losses(method, steps=6):
    import torch.distributed as dist

    import tp_ext
    from tests.test_pipeline import _config
    from tp_ext.models import Qwen2ForCausalLM
    from tp_ext.training import Trainer

    state = tp_ext.init_parallel(tp=1, pp=1, dp=dist.get_world_size())
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(_config(2, False), parallel=state)
    trainer = Trainer(
        model,
        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3),
        parallel=state,
        gradient_compression=method,
    )
    g = torch.Generator().manual_seed(10 + state.dp_rank)
    batches = [torch.randint(0, model.config.vocab_size, (2, 16), generator=g) for _ in range(2)]
    losses = [trainer.step(batches) for _ in range(steps)]
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.zeros_like(weights) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, weights)
    return losses, all(torch.equal(w, weights) for w in gathered)


@pytest.mark.parametrize("method", [None, "int8", "1bit", "powersgd"])
def test_trainer_trains_with_each_method(method):
    """Every method keeps the replicas equal and lowers the loss; int8 stays next to the
    uncompressed losses (the convergence at scale: benchmarks/bench_compression.py)."""
    out = run_distributed(_compressed_losses, 2, method)
    for losses, replicas_agree in out:
        assert replicas_agree
        assert losses == out[0][0]  # the loss is the same on every rank
        assert losses[-1] < losses[0]
    if method == "int8":
        base = run_distributed(_compressed_losses, 2, None)[0][0]
        assert abs(out[0][0][-1] - base[-1]) <= 0.01 * base[-1]


def _refusals():
    import tp_ext
    from tests.test_pipeline import _config
    from tp_ext.models import Qwen2ForCausalLM
    from tp_ext.training import Trainer

    state = tp_ext.init_parallel(tp=1, pp=2, dp=2)
    model = Qwen2ForCausalLM(_config(2, False), parallel=state)
    errors = []
    for kwargs in (
        dict(data_parallel="fsdp", gradient_compression="int8"),
        dict(gradient_compression="fp8"),
        dict(schedule="InterleavedZeroBubble", gradient_compression="powersgd"),
    ):
        try:
            Trainer(model, parallel=state, **kwargs)
        except ValueError as e:
            errors.append(str(e))
    try:  # a model without a ParallelState: its DP sum is tp_ext's own, no DDP hooks
        Trainer(Qwen2ForCausalLM(_config(2, False)), gradient_compression="int8")
    except ValueError as e:
        errors.append(str(e))
    return errors


def test_trainer_refuses_what_it_cannot_compress():
    errors = run_distributed(_refusals, 4)[0]
    assert len(errors) == 4, errors
    assert "needs data_parallel='ddp'" in errors[0]
    assert "must be one of ('int8', '1bit', 'powersgd') or None, got 'fp8'" in errors[1]
    # on a torch whose zero-bubble gradients are wrong, the schedule itself is refused first
    powersgd_refusal = (
        "gradient_compression='powersgd' with schedule 'InterleavedZeroBubble'"
        if weight_split_supported()
        else "schedule 'InterleavedZeroBubble' splits the backward"
    )
    assert powersgd_refusal in errors[2]
    assert "needs Trainer(parallel=...)" in errors[3]


# ---- 1-bit Adam: OneBitAdam with the 1-bit hook ------------------------------------------------


def test_onebit_adam_is_adamw_then_freezes_the_variance():
    """Up to freeze_step its steps are torch's AdamW's (to rounding); after, exp_avg_sq stays
    as it was and the update is m / bias1 / (sqrt(v / bias2(freeze)) + eps)."""
    from tp_ext.compression import OneBitAdam

    torch.manual_seed(0)
    ours, theirs = _model(), _model()
    theirs.load_state_dict(ours.state_dict())
    kwargs = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    opt = OneBitAdam(ours.parameters(), freeze_step=3, **kwargs)
    ref = torch.optim.AdamW(theirs.parameters(), foreach=False, **kwargs)
    x = torch.randn(8, 37)
    for step in range(1, 6):
        for model, o in ((ours, opt), (theirs, ref)):
            o.zero_grad()
            model(x * step).pow(2).mean().backward()
        frozen = [opt.state[p]["exp_avg_sq"].clone() for p in ours.parameters()] if step > 1 else []
        before = [p.detach().clone() for p in ours.parameters()]
        opt.step()
        ref.step()
        if step <= 3:
            for p, q in zip(ours.parameters(), theirs.parameters()):
                torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
            continue
        for p, v, w in zip(ours.parameters(), frozen, before):
            s = opt.state[p]
            assert torch.equal(s["exp_avg_sq"], v)  # frozen
            denom = (v.sqrt() / (1 - 0.99**3) ** 0.5) + 1e-8
            expected = w * (1 - 1e-2 * 0.1) - 1e-2 / (1 - 0.9**step) * s["exp_avg"] / denom
            torch.testing.assert_close(p.detach(), expected, rtol=1e-6, atol=1e-7)
    # the freeze step travels in the optimizer's state_dict (a parameter-group setting)
    again = OneBitAdam(_model().parameters(), freeze_step=50)
    again.load_state_dict(opt.state_dict())
    assert again.param_groups[0]["freeze_step"] == 3


def test_onebit_adam_refuses_bad_settings():
    from tp_ext.compression import CompressionState, OneBitAdam

    params = list(_model().parameters())
    with pytest.raises(ValueError, match="freeze_step must be an int >= 1"):
        OneBitAdam(params, freeze_step=0)
    with pytest.raises(ValueError, match=r"betas must be two numbers in \[0, 1\)"):
        OneBitAdam(params, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="OneBitAdam goes with method='1bit', not 'int8'"):
        CompressionState(None, "int8", optimizer=OneBitAdam(params))
    with pytest.raises(TypeError, match="must be a tp_ext.compression.OneBitAdam, got AdamW"):
        CompressionState(None, "1bit", optimizer=torch.optim.AdamW(params))


def _onebit_adam_steps(freeze, steps):
    """DDP + OneBitAdam + the 1-bit hook, every rank on its own data. Per step: the bus bytes
    (against fp32's), and after the warm-up the running sums of the optimizer's momentum (what
    the ranks agreed on) and of the ranks' true mean momentum beta1 m + (1 - beta1) g_r."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import tp_ext
    from tp_ext.compression import OneBitAdam, register

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model, plain = _model(), _model()
    plain.load_state_dict(model.state_dict())
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.1)
    opt = OneBitAdam(model.parameters(), lr=1e-3, betas=(0.9, 0.999), freeze_step=freeze)
    state = register(ddp, "1bit", dist.group.WORLD, optimizer=opt)
    params = list(model.parameters())
    sent = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    true = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    bus, warmup_exact = [], True
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(8, 37, generator=g) * (1 + rank)
        before = [opt.state[p]["exp_avg"].clone() if p in opt.state else None for p in params]
        plain.load_state_dict(model.state_dict())
        plain.zero_grad()
        plain(x).pow(2).sum().backward()
        ddp.zero_grad()
        with tp_ext.comm.track() as stats:
            ddp(x).pow(2).sum().backward()
        bus.append(stats.bus_bytes(world))
        local = [q.grad.clone() for q in plain.parameters()]
        if step < freeze:  # warm-up: the exact fp32 mean
            for p, gr in zip(params, local):
                dist.all_reduce(gr)
                warmup_exact &= torch.allclose(p.grad, gr / world, rtol=1e-6, atol=1e-7)
        opt.step()
        if step >= freeze:
            for s, t, p, m, gr in zip(sent, true, params, before, local):
                s += opt.state[p]["exp_avg"].double()
                mine = (0.9 * m + 0.1 * gr).double()
                dist.all_reduce(mine)
                t += mine / world
    numel = sum(p.numel() for p in params)
    weights = torch.cat([p.detach().flatten() for p in params])
    everyone = [torch.zeros_like(weights) for _ in range(world)]
    dist.all_gather(everyone, weights)
    return {
        "sent": sent,
        "true": true,
        "residuals": state.state_dict(),
        "bus": bus,
        "fp32_bus": 2 * (world - 1) / world * numel * 4,
        "warmup_exact": warmup_exact,
        "replicas_agree": all(torch.equal(w, weights) for w in everyone),
    }


@pytest.mark.parametrize("world", [2, 3, 4])
def test_onebit_adam_sends_momentum_with_exact_error_feedback(world):
    """Warm-up steps are the exact fp32 mean; after them the optimizer's momentum, summed over
    the steps, plus what the ranks hold back, is the sum of the true mean momenta (error
    feedback exact on the momentum), at 1-bit's bytes; the replicas stay equal."""
    freeze, steps = 2, 7
    out = run_distributed(_onebit_adam_steps, world, freeze, steps)
    names = [n for n, _ in _model().named_parameters()]
    for o in out:
        assert o["warmup_exact"] and o["replicas_agree"]
        ratios = [b / o["fp32_bus"] for b in o["bus"]]
        assert all(abs(r - 1) < 0.02 for r in ratios[:freeze]), ratios  # fp32 all-reduce
        assert max(ratios[freeze:]) <= 0.04, ratios
        for name, s, t in zip(names, o["sent"], o["true"]):
            # the division by (1 - beta1) and the optimizer's lerp round: 1e-5 of the scale
            err = (s + _unsent(out, name).view_as(s) - t).abs().max().item()
            assert err <= 1e-5 * (1 + t.abs().max().item()), (name, err)
    assert any(not torch.equal(s, t) for s, t in zip(out[0]["sent"], out[0]["true"]))


def _trainer_onebit_adam(optimizer_kind):
    import warnings

    import torch.distributed as dist

    import tp_ext
    from tests.test_pipeline import _config
    from tp_ext.compression import OneBitAdam
    from tp_ext.models import Qwen2ForCausalLM
    from tp_ext.training import Trainer

    state = tp_ext.init_parallel(tp=1, pp=1, dp=dist.get_world_size())
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(_config(2, False), parallel=state)
    kinds = {"onebit": lambda p: OneBitAdam(p, lr=3e-3, freeze_step=4),
             "adamw": lambda p: torch.optim.AdamW(p, lr=3e-3)}  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = Trainer(
            model, optimizer=kinds[optimizer_kind], parallel=state, gradient_compression="1bit"
        )
    attached = [s.optimizer is trainer.optimizer for s in trainer.compression_states]
    g = torch.Generator().manual_seed(10 + state.dp_rank)
    batches = [torch.randint(0, model.config.vocab_size, (2, 16), generator=g) for _ in range(2)]
    losses = [trainer.step(batches) for _ in range(6)]
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.zeros_like(weights) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, weights)
    warned = any("OneBitAdam (1-bit Adam)" in str(w.message) for w in caught)
    return attached, warned, losses, all(torch.equal(w, weights) for w in gathered)


def test_trainer_runs_onebit_adam_and_warns_about_adam():
    """Trainer(gradient_compression='1bit') with a OneBitAdam attaches it to every hook state
    (1-bit Adam), trains with equal replicas; with AdamW it warns and names OneBitAdam."""
    for attached, warned, losses, replicas_agree in run_distributed(
        _trainer_onebit_adam, 2, "onebit"
    ):
        assert attached and all(attached) and not warned
        assert replicas_agree and losses[-1] < losses[0]
    for attached, warned, _, _ in run_distributed(_trainer_onebit_adam, 2, "adamw"):
        assert not any(attached) and warned
