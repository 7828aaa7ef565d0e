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
            # sent + the ranks' mean residual = the sum of the true means, to fp32 rounding
            mean_residual = sum(x["residuals"][name] for x in out).double() / world
            err = (s + mean_residual.view_as(s) - t).abs().max().item()
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
            residual = sum(o["residuals"][name] for o in after).double() / world
            worst = max(worst, (sent + residual.view_as(sent) - true).abs().max().item())
        return worst

    assert error(second) < 1e-5
    lost = max((sum(o["residuals"][n] for o in first) / world).abs().max().item() for n in names)
    assert error(fresh) > 0.5 * lost > 0


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
        assert name == "PowerSGDState"
        assert replicas_agree  # the replicas take the same (compressed) averaged step
        assert losses[-1] < losses[0]


# ---- the Trainer: gradient_compression= --------------------------------------------------------


RESUME = [
    # layout (tp, pp, dp), schedule, method
    ((1, 2, 2), "1F1B", "int8"),  # DDP per pipeline stage
    ((2, 1, 2), "1F1B", "1bit"),  # TP inside, DP over the compressed hook
    ((1, 1, 3), "1F1B", "int8"),  # 3 ranks: uneven segments, DDP re-bucketing
    ((1, 1, 2), "ZBVZeroBubble", "1bit"),  # weight-split: tp_ext's own compressed average
]


@pytest.mark.parametrize("case", RESUME, ids=str)
def test_trainer_resume_with_compression_is_bitwise(tmp_path, case):
    """The residuals travel with the checkpoint: the resumed run's losses and gradient norms
    are bitwise the uninterrupted compressed run's."""
    from tests.test_training_state import _same_layout

    layout, schedule, method = case
    _same_layout(tmp_path, layout, schedule, "ddp", 0.0, False, False, gradient_compression=method)


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

    state = tp_ext.init_parallel(tp=1, pp=1, dp=2)
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
    try:
        Trainer(model, gradient_compression="int8")
    except ValueError as e:
        errors.append(str(e))
    return errors


def test_trainer_refuses_what_it_cannot_compress():
    errors = run_distributed(_refusals, 2)[0]
    assert len(errors) == 4, errors
    assert "needs data_parallel='ddp'" in errors[0]
    assert "must be one of ('int8', '1bit', 'powersgd') or None, got 'fp8'" in errors[1]
    assert "gradient_compression='powersgd' with schedule 'InterleavedZeroBubble'" in errors[2]
    assert "needs Trainer(parallel=...)" in errors[3]
