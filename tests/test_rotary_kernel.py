"""tp_ext::rotary_embedding (fused HF rotate_half RoPE on q and k) against the pure-PyTorch
apply_rotary: forward and backward in fp32/bf16/fp16, GQA head counts, odd multiples of 2 for
head_dim, position offsets, the attention layer's transposed layout, opcheck, torch.compile, and
bad input. A CUDA-marked test compares the CUDA kernel with the CPU one."""

import functools

import pytest
import torch

import tp_ext  # noqa: F401  (registers the op)
from tp_ext.layers.rotary import RotaryEmbedding, apply_rotary, rotary_embedding

# bf16/fp16: the op rounds once (fp32 math), the reference after every op, so they differ by a
# few ulps of the output dtype.
TOL = {torch.float32: (1e-6, 1e-6), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}


def _inputs(batch, hq, hk, seq, dim, dtype, offset=0, layer_layout=True, seed=0):
    g = torch.Generator().manual_seed(seed)

    def heads(h):
        if layer_layout:  # as ParallelAttention: [B, S, H, D] storage viewed as [B, H, S, D]
            return torch.randn(batch, seq, h, dim, generator=g).to(dtype).transpose(1, 2)
        return torch.randn(batch, h, seq, dim, generator=g).to(dtype)

    pos = (torch.arange(seq) + offset).expand(batch, seq).clone()
    pos[-1] += 7  # rows of one batch at different positions
    cos, sin = RotaryEmbedding(dim)(pos, dtype)
    return heads(hq), heads(hk), cos, sin


def _reference(q, k, cos, sin):
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


# (batch, q heads, kv heads, seq, head_dim): GQA, head_dim 2 / 6 / 130 (odd multiples of 2)
SHAPES = [(2, 4, 2, 5, 6), (1, 3, 1, 4, 2), (2, 2, 2, 3, 130), (1, 8, 2, 7, 64)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("offset", [0, 1000])
def test_matches_reference_forward_and_backward(dtype, shape, offset):
    batch, hq, hk, seq, dim = shape
    q, k, cos, sin = _inputs(batch, hq, hk, seq, dim, dtype, offset)
    q.requires_grad_()
    k.requires_grad_()
    out = rotary_embedding(q, k, cos, sin)
    ref = _reference(q, k, cos, sin)
    atol, rtol = TOL[dtype]
    for o, r in zip(out, ref):
        assert o.shape == r.shape and o.dtype == r.dtype
        torch.testing.assert_close(o, r, atol=atol, rtol=rtol)
    assert out[0].stride() == q.stride(), "output keeps the input's (transposed) layout"
    g = [torch.randn_like(o) for o in out]
    got = torch.autograd.grad(out, (q, k), g)
    want = torch.autograd.grad(ref, (q, k), g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol)


def test_fp32_matches_apply_rotary_and_layer_rotate_to_rounding():
    # Not bitwise: with AVX2/FMA builds the kernel fuses multiply-adds (one rounding fewer).
    same = functools.partial(torch.testing.assert_close, rtol=2e-7, atol=2e-7)
    q, k, cos, sin = _inputs(2, 4, 2, 9, 128, torch.float32, offset=3)
    out = rotary_embedding(q, k, cos, sin)
    ref = _reference(q, k, cos, sin)
    same(out[0], ref[0])
    same(out[1], ref[1])
    rope = RotaryEmbedding(128)
    pos = torch.arange(9).expand(2, 9) + 5
    a = rope.rotate(q, k, pos)  # the attention layer's path: q and k in one fused op
    b = rope.rotate(q, k, pos, use_kernel=False)
    same(a[0], b[0])
    same(a[1], b[1])
    # one row of positions for every sequence, as ParallelAttention passes [1, seq]
    c = rope.rotate(q, k, pos[:1])
    same(c[0], a[0])
    same(c[1], a[1])


def test_gradcheck_including_cos_sin():
    q, k, cos, sin = _inputs(1, 3, 1, 4, 6, torch.float64, layer_layout=False)
    args = [t.clone().requires_grad_() for t in (q, k, cos, sin)]
    assert torch.autograd.gradcheck(torch.ops.tp_ext.rotary_embedding, args)
    assert torch.autograd.gradgradcheck(torch.ops.tp_ext.rotary_embedding, args)


def test_only_one_output_used():
    q, k, cos, sin = _inputs(1, 2, 1, 3, 8, torch.float32)
    q.requires_grad_()
    k.requires_grad_()
    qo, _ = rotary_embedding(q, k, cos, sin)
    qo.sum().backward()
    torch.testing.assert_close(
        q.grad, torch.autograd.grad(_reference(q, k, cos, sin)[0].sum(), q)[0]
    )
    assert k.grad is None or not k.grad.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(dtype):
    for layer_layout in (True, False):
        q, k, cos, sin = _inputs(2, 4, 2, 5, 6, dtype, layer_layout=layer_layout)
        torch.library.opcheck(
            torch.ops.tp_ext.rotary_embedding, (q.requires_grad_(), k.requires_grad_(), cos, sin)
        )
        torch.library.opcheck(torch.ops.tp_ext.rotary_embedding, (q.detach(), k.detach(), cos, sin))


def test_compile_fullgraph_forward_and_backward():
    rope = RotaryEmbedding(16)

    def step(q, k, pos):
        qo, ko = rope.rotate(q, k, pos)
        return (qo * 2).sum() + ko.square().sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    q, k, _, _ = _inputs(2, 4, 2, 5, 16, torch.float32)
    pos = torch.arange(5).expand(2, 5) + 2
    qa, ka = q.clone().requires_grad_(), k.clone().requires_grad_()
    qb, kb = q.clone().requires_grad_(), k.clone().requires_grad_()
    compiled(qa, ka, pos).backward()
    step(qb, kb, pos).backward()
    torch.testing.assert_close(qa.grad, qb.grad)
    torch.testing.assert_close(ka.grad, kb.grad)


def test_bad_inputs_raise_clear_errors():
    q, k, cos, sin = _inputs(2, 4, 2, 5, 6, torch.float32)
    with pytest.raises(ValueError, match=r"cos has shape \[2, 5, 4\].*q has shape \[2, 4, 5, 6\]"):
        rotary_embedding(q, k, cos[..., :4], sin)
    with pytest.raises(ValueError, match=r"sin has shape \[2, 4, 6\]"):
        rotary_embedding(q, k, cos, sin[:, :4])
    with pytest.raises(ValueError, match=r"head_dim must be even.*\[2, 4, 5, 5\]"):
        rotary_embedding(q[..., :5], k[..., :5], cos[..., :5], sin[..., :5])
    with pytest.raises(ValueError, match=r"k of shape \[2, 2, 4, 6\] does not match q"):
        rotary_embedding(q, k[:, :, :4], cos, sin)
    with pytest.raises(ValueError, match=r"cos has dtype BFloat16 but q has dtype Float"):
        rotary_embedding(q, k, cos.bfloat16(), sin)
    with pytest.raises(ValueError, match=r"q must be \[batch, heads, seq, head_dim\]"):
        rotary_embedding(q[0], k, cos, sin)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_matches_cpu(dtype):
    for shape in [(2, 4, 2, 5, 6), (2, 28, 4, 33, 128), (1, 3, 1, 4, 130)]:
        q, k, cos, sin = _inputs(*shape, dtype=dtype, offset=11)
        out_cpu = rotary_embedding(q, k, cos, sin)
        qc, kc = q.cuda().requires_grad_(), k.cuda().requires_grad_()
        out = rotary_embedding(qc, kc, cos.cuda(), sin.cuda())
        for a, b in zip(out, out_cpu):
            torch.testing.assert_close(a.cpu(), b, atol=TOL[dtype][0], rtol=TOL[dtype][1])
        g = [torch.randn_like(o) for o in out]
        got = torch.autograd.grad(out, (qc, kc), g)
        qr, kr = q.cuda().requires_grad_(), k.cuda().requires_grad_()
        want = torch.autograd.grad(_reference(qr, kr, cos.cuda(), sin.cuda()), (qr, kr), g)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=TOL[dtype][0], rtol=TOL[dtype][1])
        torch.library.opcheck(torch.ops.tp_ext.rotary_embedding, (qc, kc, cos.cuda(), sin.cuda()))
