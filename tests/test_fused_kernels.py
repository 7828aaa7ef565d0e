"""tp_ext.rms_norm / add_rms_norm / swiglu: opcheck, parity with the PyTorch reference (forward and
backward, fp32 / bf16 / fp16), odd sizes, non-contiguous inputs, errors, torch.compile."""

import pytest
import torch
import torch.nn.functional as F

import tp_ext  # noqa: F401  (registers torch.ops.tp_ext)

ops = torch.ops.tp_ext
EPS = 1e-6
TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
}


def ref_rms_norm(x, w, eps=EPS):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def ref_swiglu(gu):
    gate, up = gu.chunk(2, dim=-1)
    return F.silu(gate) * up


def leaves(*ts):
    return [t.detach().clone().requires_grad_(True) for t in ts]


def grads(out, inputs, g):
    return torch.autograd.grad(out, inputs, g)


def close(a, b, dtype, scale=1.0):
    tol = TOL[dtype]
    torch.testing.assert_close(
        a.float(), b.float(), atol=tol["atol"] * scale, rtol=tol["rtol"] * scale
    )


# ---- opcheck ----


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(dtype):
    torch.manual_seed(0)
    x = torch.randn(3, 5, 16, dtype=dtype, requires_grad=True)
    r = torch.randn(3, 5, 16, dtype=dtype, requires_grad=True)
    w = torch.randn(16, dtype=dtype, requires_grad=True)
    gu = torch.randn(3, 5, 24, dtype=dtype, requires_grad=True)
    # The gradient is checked against our own parity tests (bf16 finite differences are too noisy).
    tests = (
        "test_schema",
        "test_autograd_registration",
        "test_faketensor",
        "test_aot_dispatch_dynamic",
    )
    torch.library.opcheck(ops.rms_norm, (x, w, EPS), test_utils=tests)
    torch.library.opcheck(ops.add_rms_norm, (x, r, w, EPS), test_utils=tests)
    torch.library.opcheck(ops.swiglu, (gu,), test_utils=tests)
    torch.library.opcheck(
        ops.rms_norm_backward,
        (torch.randn_like(x), x.detach(), w.detach(), EPS),
        test_utils=tests[:1] + tests[2:3],
    )
    torch.library.opcheck(
        ops.swiglu_backward,
        (torch.randn(3, 5, 12, dtype=dtype), gu.detach()),
        test_utils=tests[:1] + tests[2:3],
    )


# ---- parity: forward and backward ----


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [1, 7, 64, 8193])
def test_rms_norm_parity(dtype, hidden):
    torch.manual_seed(hidden)
    x0 = torch.randn(2, 3, hidden, dtype=dtype)
    w0 = (1 + 0.1 * torch.randn(hidden)).to(dtype)
    x, w = leaves(x0, w0)
    xr, wr = leaves(x0, w0)
    y, yr = ops.rms_norm(x, w, EPS), ref_rms_norm(xr, wr)
    assert y.dtype == yr.dtype and y.shape == yr.shape
    close(y, yr, dtype)
    g = torch.randn_like(yr)
    gx, gw = grads(y, (x, w), g)
    gxr, gwr = grads(yr, (xr, wr), g)
    close(gx, gxr, dtype, scale=2)
    # The weight gradient sums over rows: the reference rounds its products in low precision.
    close(gw, gwr, dtype, scale=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [1, 7, 8193])
def test_add_rms_norm_parity(dtype, hidden):
    torch.manual_seed(hidden)
    x0, r0 = torch.randn(4, hidden, dtype=dtype), torch.randn(4, hidden, dtype=dtype)
    w0 = (1 + 0.1 * torch.randn(hidden)).to(dtype)
    x, r, w = leaves(x0, r0, w0)
    xr, rr, wr = leaves(x0, r0, w0)
    y, h = ops.add_rms_norm(x, r, w, EPS)
    hr = xr + rr
    yr = ref_rms_norm(hr, wr)
    assert torch.equal(h, hr)
    close(y, yr, dtype)
    gy, gh = torch.randn_like(yr), torch.randn_like(hr)
    got = grads((y, h), (x, r, w), (gy, gh))
    want = grads((yr, hr), (xr, rr, wr), (gy, gh))
    close(got[0], want[0], dtype, scale=2)
    close(got[1], want[1], dtype, scale=2)
    close(got[2], want[2], dtype, scale=4)
    # Only one of the outputs used.
    (gx,) = grads(ops.add_rms_norm(x, r, w, EPS)[1].sum(), (x,), None)
    assert torch.equal(gx, torch.ones_like(gx))
    gx, gw = grads(ops.add_rms_norm(x, r, w, EPS)[0].sum(), (x, w), None)
    gxr, gwr = grads(ref_rms_norm(xr + rr, wr).sum(), (xr, wr), None)
    close(gx, gxr, dtype, scale=2)


def test_rms_norm_fp32_is_tight_and_mixed_dtypes_promote():
    torch.manual_seed(0)
    x = torch.randn(64, 256)
    w = torch.randn(256)
    torch.testing.assert_close(ops.rms_norm(x, w, EPS), ref_rms_norm(x, w), atol=1e-6, rtol=1e-6)
    # bf16 activations with an fp32 weight: result fp32, as torch promotion gives the reference
    xb = x.bfloat16()
    y = ops.rms_norm(xb, w, EPS)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, ref_rms_norm(xb, w), atol=1e-5, rtol=1e-5)
    # fp64 follows the reference too (computed in fp32, cast back)
    xd, wd = x.double(), w.double()
    torch.testing.assert_close(
        ops.rms_norm(xd, wd, EPS), ref_rms_norm(xd, wd), atol=1e-6, rtol=1e-6
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("inter", [1, 7, 8193])
def test_swiglu_parity(dtype, inter):
    torch.manual_seed(inter)
    gu0 = torch.randn(3, 2, 2 * inter, dtype=dtype) * 3
    (gu,), (gur,) = leaves(gu0), leaves(gu0)
    y, yr = ops.swiglu(gu), ref_swiglu(gur)
    assert y.shape == yr.shape and y.dtype == dtype
    close(y, yr, dtype)
    g = torch.randn_like(yr)
    close(grads(y, (gu,), g)[0], grads(yr, (gur,), g)[0], dtype, scale=2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_swiglu_rounds_once(dtype):
    """bf16/fp16: the kernel is the fp64 truth rounded once (an ulp off at most, the rare tie that
    the approximate exp tips over), and never less accurate than the unfused composite, which
    rounds silu(gate) and grad * up on the way. 1000 columns: the vector loop and its tail."""
    torch.manual_seed(0)
    gu = (torch.randn(64, 2 * 1000) * 4).to(dtype)
    dy = torch.randn(64, 1000).to(dtype)
    gd = gu.double().requires_grad_(True)
    truth = ref_swiglu(gd)
    (truth_grad,) = torch.autograd.grad(truth, gd, dy.double())
    mine = ops.swiglu(gu)
    mine_grad = ops.swiglu_backward(dy, gu)
    (gl,) = leaves(gu)
    composite = ref_swiglu(gl)
    (composite_grad,) = grads(composite, (gl,), dy)
    eps = torch.finfo(dtype).eps
    for got, want, unfused in ((mine, truth, composite), (mine_grad, truth_grad, composite_grad)):
        rounded = want.to(dtype)
        assert (got != rounded).float().mean() < 0.005
        torch.testing.assert_close(got.double(), rounded.double(), rtol=eps, atol=1e-30)
        assert (got.double() - want).abs().max() <= (unfused.double() - want).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_swiglu_extreme_inputs(dtype):
    """Huge, tiny, infinite and NaN gates give what the unfused composite gives (no inf / inf where
    exp(-g) overflows), on the vector path (48 columns) and its tail."""
    special = [
        float("inf"),
        float("-inf"),
        float("nan"),
        100.0,
        -100.0,
        80.0,
        -80.0,
        0.0,
        -0.0,
        1e-30,
        -1e-30,
        3e4,
        -3e4,
        3e38,
        -3e38,
        11.0,
    ]
    gate = torch.tensor(special * 3, dtype=torch.float64).to(dtype)
    gu = torch.cat([gate, torch.full_like(gate, 1.5)]).unsqueeze(0)
    dy = torch.ones_like(gate).unsqueeze(0)
    (gl,) = leaves(gu)
    want = ref_swiglu(gl)
    (want_grad,) = grads(want, (gl,), dy)
    torch.testing.assert_close(
        ops.swiglu(gu), want, atol=1e-30, rtol=TOL[dtype]["rtol"], equal_nan=True
    )
    torch.testing.assert_close(
        ops.swiglu_backward(dy, gu), want_grad, atol=1e-30, rtol=TOL[dtype]["rtol"], equal_nan=True
    )


def test_swiglu_fp32_accuracy():
    """fp32 forward within ~8 ulp of the fp64 truth over a wide range of gates (the kernel's own
    exp and reciprocal; eager's g / (1 + exp(-g)) loses more at |g| ~ 30)."""
    torch.manual_seed(0)
    for scale in (1.0, 5.0, 30.0):
        gu = torch.randn(64, 2 * 1000) * scale
        gd = gu.double()
        truth = ref_swiglu(gd)
        rel = (ops.swiglu(gu).double() - truth).abs() / truth.abs().clamp_min(1e-30)
        assert rel.max().item() < 8 * 2.0**-24, (scale, rel.max().item())


def test_swiglu_double_is_double():
    """float64 is computed in float64 (gradcheck needs it)."""
    torch.manual_seed(0)
    gu = torch.randn(4, 2 * 37, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(ops.swiglu(gu), ref_swiglu(gu), atol=1e-14, rtol=1e-14)
    assert torch.autograd.gradcheck(ops.swiglu, (gu,))


def test_empty_batch():
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(0, 5, 8, dtype=dtype, requires_grad=True)
        w = torch.ones(8, dtype=dtype, requires_grad=True)
        y = ops.rms_norm(x, w, EPS)
        assert y.shape == (0, 5, 8)
        gx, gw = grads(y.sum(), (x, w), None)
        assert gx.shape == x.shape and torch.equal(gw, torch.zeros_like(gw))
        y, h = ops.add_rms_norm(x, x, w, EPS)
        assert y.shape == h.shape == (0, 5, 8)
        gu = torch.randn(0, 6, dtype=dtype, requires_grad=True)
        out = ops.swiglu(gu)
        assert out.shape == (0, 3)
        assert grads(out.sum(), (gu,), None)[0].shape == (0, 6)


def test_non_contiguous_inputs():
    torch.manual_seed(0)
    x = torch.randn(16, 6).t()  # [6, 16], non-contiguous
    w = torch.randn(32)[::2]  # strided weight
    r = torch.randn(16, 6).t()
    assert not x.is_contiguous() and not w.is_contiguous()
    torch.testing.assert_close(ops.rms_norm(x, w, EPS), ref_rms_norm(x, w))
    y, h = ops.add_rms_norm(x, r, w, EPS)
    torch.testing.assert_close(h, x + r)
    torch.testing.assert_close(y, ref_rms_norm(x + r, w))
    gu = torch.randn(10, 4).t()
    torch.testing.assert_close(ops.swiglu(gu), ref_swiglu(gu))
    # non-contiguous incoming gradient
    xl = x.clone().requires_grad_(True)
    g = torch.randn(16, 6).t()
    gx = grads(ops.rms_norm(xl, w, EPS), (xl,), g)[0]
    xr = x.clone().requires_grad_(True)
    torch.testing.assert_close(gx, grads(ref_rms_norm(xr, w), (xr,), g)[0])


def test_errors():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match=r"weight has shape \[7\].*x has shape \[2, 8\]"):
        ops.rms_norm(x, torch.ones(7), EPS)
    with pytest.raises(ValueError, match="weight has shape"):
        ops.add_rms_norm(x, x, torch.ones(2, 8), EPS)
    with pytest.raises(ValueError, match="residual"):
        ops.add_rms_norm(x, torch.randn(2, 9), torch.ones(8), EPS)
    with pytest.raises(ValueError, match="residual"):
        ops.add_rms_norm(x, x.bfloat16(), torch.ones(8), EPS)
    with pytest.raises(ValueError, match="last dimension must be even"):
        ops.swiglu(torch.randn(2, 7))
    with pytest.raises(ValueError, match="floating point"):
        ops.swiglu(torch.ones(2, 4, dtype=torch.long))


def test_compile_fullgraph_aot_eager():
    torch.manual_seed(0)

    def f(x, r, w1, w2, gu):
        normed, h = ops.add_rms_norm(x, r, w1, EPS)
        return (ops.rms_norm(h, w2, EPS) * normed).sum() + ops.swiglu(gu).sum()

    def f_ref(x, r, w1, w2, gu):
        h = x + r
        return (ref_rms_norm(h, w2) * ref_rms_norm(h, w1)).sum() + ref_swiglu(gu).sum()

    args = [
        torch.randn(3, 4, 16),
        torch.randn(3, 4, 16),
        torch.randn(16),
        torch.randn(16),
        torch.randn(3, 4, 10),
    ]
    a, b = leaves(*args), leaves(*args)
    out = torch.compile(f, fullgraph=True, backend="aot_eager")(*a)
    ref = f_ref(*b)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-5)
    for ga, gb in zip(torch.autograd.grad(out, a), torch.autograd.grad(ref, b)):
        torch.testing.assert_close(ga, gb, atol=1e-4, rtol=1e-4)
