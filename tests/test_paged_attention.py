"""tp_ext.ops.paged_attention (the serving engine's attention over its paged KV cache) against
scaled dot-product attention on the gathered keys with tp_ext's decoding mask: float32, float64
and bfloat16, grouped-query heads, one query or several after cached columns, padding (a query
with no real key attends to itself), empty batches; opcheck (schema, fake kernel, autograd
registration); bad arguments named; the dense rule with sliding windows and soft-capping
(tp_ext.generation.decoders.paged_attention_dense) against its own reference; and the CUDA
composition against the CPU kernel (skipped without a GPU)."""

import pytest
import torch

from tp_ext import ops
from tp_ext.generation.decoders import paged_attention_dense
from tp_ext.layers.attention import decoding_mask

TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-6),
    torch.float64: dict(rtol=1e-12, atol=1e-13),
    torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
}


def _inputs(rows=3, heads=4, kv_heads=2, queries=1, length=9, dim=16, slots=50, dtype=torch.float32,
            seed=0, device="cpu"):  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, heads, queries, dim, generator=g).to(dtype)
    k = torch.randn(slots, kv_heads, dim, generator=g).to(dtype)
    v = torch.randn(slots, kv_heads, dim, generator=g).to(dtype)
    where = torch.randint(0, slots, (rows, length), generator=g)
    mask = torch.rand(rows, length, generator=g) > 0.3
    return [t.to(device) for t in (q, k, v, where, mask)]


def _reference(q, k, v, where, mask, past, scale, window=None, softcap=None):
    group = q.size(1) // k.size(1)
    keys = k[where].transpose(1, 2).repeat_interleave(group, 1).double()
    values = v[where].transpose(1, 2).repeat_interleave(group, 1).double()
    allowed, _ = decoding_mask(q, keys, past, mask)
    if allowed is None:
        allowed = torch.ones(q.size(2), keys.size(2), dtype=torch.bool).tril(past)
    if window is not None:  # a query sees the `window` latest columns up to its own
        own = torch.arange(q.size(2)).unsqueeze(1) + past
        allowed = allowed & (own - torch.arange(keys.size(2)) < window)
    scores = q.double() @ keys.transpose(-1, -2) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (torch.softmax(scores, -1) @ values).to(q.dtype)


CASES = [  # (queries, length): decode rows, and several queries after cached columns
    (1, 9),
    (1, 1),
    (3, 9),
    (5, 5),
]


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("queries,length", CASES)
def test_equals_attention_on_the_gathered_keys(dtype, queries, length):
    q, k, v, where, mask = _inputs(queries=queries, length=length, dtype=dtype)
    mask[0] = False  # a row whose queries see no real key: each attends to itself alone
    past = length - queries
    got = ops.paged_attention(q, k, v, where, mask, past, 0.3)
    want = _reference(q, k, v, where, mask, past, 0.3)
    torch.testing.assert_close(got, want, **TOL[dtype])


def test_heads_without_grouping_and_an_empty_batch():
    q, k, v, where, mask = _inputs(heads=2, kv_heads=2, dim=40)  # 40: not a multiple of a vector
    torch.testing.assert_close(
        ops.paged_attention(q, k, v, where, mask, 8, 0.25),
        _reference(q, k, v, where, mask, 8, 0.25),
        **TOL[torch.float32],
    )
    q, k, v, where, mask = _inputs(rows=0)
    assert ops.paged_attention(q, k, v, where, mask, 8, 0.25).shape == (0, 4, 1, 16)


def test_opcheck():
    q, k, v, where, mask = _inputs(queries=2)
    torch.library.opcheck(ops.paged_attention, (q, k, v, where, mask, 7, 0.5))


BAD = [  # (change, message)
    (lambda a: {**a, "q": a["q"][0]}, "q must be a floating [rows, heads, queries, head_dim]"),
    (lambda a: {**a, "k": a["k"][:, :1]}, "k_cache and v_cache must both be"),
    (lambda a: {**a, "k": a["k"].double(), "v": a["v"].double()}, "must share a dtype"),
    (lambda a: {**a, "q": a["q"][:, :3]}, "heads are not a multiple of the cache's 2 KV heads"),
    (lambda a: {**a, "where": a["where"].int()}, "slots must be int64 [rows, length]"),
    (lambda a: {**a, "mask": a["mask"][:, :4]}, "key_mask must have slots' shape"),
    (lambda a: {**a, "past": 3}, "past (3) + queries (1) must equal the key columns (9)"),
    (lambda a: {**a, "where": a["where"] + 100}, "slots must lie in [0, 50)"),
]


@pytest.mark.parametrize("change,message", BAD)
def test_bad_arguments_are_named(change, message):
    q, k, v, where, mask = _inputs()
    a = change(dict(q=q, k=k, v=v, where=where, mask=mask, past=8))
    with pytest.raises(ValueError, match=None) as caught:
        ops.paged_attention(a["q"], a["k"], a["v"], a["where"], a["mask"], a["past"], 1.0)
    assert message in str(caught.value), str(caught.value)


class _Step:
    def __init__(self, where, mask, past):
        self.read, self.key_mask, self.past, self.length = where, mask, past, where.size(1)


@pytest.mark.parametrize("window,softcap", [(None, None), (3, None), (None, 2.0), (4, 1.5)])
def test_the_dense_rule_with_windows_and_soft_capping(window, softcap):
    q, k, v, where, mask = _inputs(queries=4, length=10, dtype=torch.float64)
    got = paged_attention_dense(q, k, v, _Step(where, mask, 6), 0.3, window, softcap)
    want = _reference(q, k, v, where, mask, 6, 0.3, window, softcap)
    torch.testing.assert_close(got, want, **TOL[torch.float64])
    if window is None and softcap is None:  # the kernel's rule, too
        torch.testing.assert_close(ops.paged_attention(q, k, v, where, mask, 6, 0.3), want)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_equals_cpu(dtype):
    cpu = _inputs(queries=3, dtype=dtype)
    gpu = [t.cuda() for t in cpu]
    got = ops.paged_attention(*gpu, 6, 0.3).cpu()
    torch.testing.assert_close(got, ops.paged_attention(*cpu, 6, 0.3), **TOL[dtype])
