"""Decoding under context parallelism (tp_ext/layers/context_decode.py): new queries attend a
KV cache split over the CP ranks, each rank its share, merged by log-sum-exp."""

import pytest
import torch

import tp_ext
from tp_ext.layers.context_decode import decode_owner, position_owner, split_kv_attention

from .dist_utils import run_distributed

# -- the decoding attention -------------------------------------------------------------------


def _reference_attention(q, k, v, q_pos, k_pos, key_mask, window, softcap):
    """Softmax attention of ``q`` over every key, by matmuls in fp64: zeros where none is seen."""
    groups = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = (q @ k.transpose(-1, -2)) / q.size(-1) ** 0.5
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    back = q_pos[:, None] - k_pos[None, :]
    seen = (back >= 0) & (back < (window or 10**9))
    seen = seen[None, None] & key_mask[:, None, None, :]
    return torch._safe_softmax(scores.masked_fill(~seen, float("-inf")), -1) @ v


def _check_split_kv(heads, kv_heads, dtype, window=None, softcap=None, prompt=9, decoded=4):
    """Keys of a ``prompt``-long prefill held as cp_positions says, then ``decoded`` tokens each
    on its round-robin rank; the queries of the last two positions (the same on every rank)."""
    g = tp_ext.comm.resolve_group(None)
    torch.manual_seed(0)
    total = prompt + decoded
    q = torch.randn(2, heads, 2, 8, dtype=dtype)
    k = torch.randn(2, kv_heads, total, 8, dtype=dtype)
    v = torch.randn(2, kv_heads, total, 8, dtype=dtype)
    key_mask = torch.ones(2, total, dtype=torch.bool)
    key_mask[0, :4] = False  # row 0 left-padded
    q_pos = torch.tensor([total - 2, total - 1])
    mine = tp_ext.cp_positions(prompt).tolist()
    mine += [p for p in range(prompt, total) if decode_owner(p, g.size) == g.rank]
    held = torch.tensor(mine, dtype=torch.long)
    out = split_kv_attention(
        q, k[:, :, held], v[:, :, held], q_pos, held, key_mask=key_mask[:, held], window=window,
        softcap=softcap,
    )  # fmt: skip
    expected = _reference_attention(
        *(t.double() for t in (q, k, v)), q_pos, torch.arange(total), key_mask, window, softcap
    )
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), expected, **tol)
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_split_kv_attention_equals_attention_over_every_key(world):
    """Each rank its share of the keys (at 4 ranks of 9 prompt positions, unevenly; one rank
    holding no key of a short prompt), GQA, a padding mask; every rank gets the same output."""
    outs = run_distributed(_check_split_kv, world, 6, 2, torch.float64)
    assert all(torch.equal(o, outs[0]) for o in outs)
    run_distributed(_check_split_kv, world, 4, 4, torch.float64, None, None, 2, 1)


@pytest.mark.parametrize("world", [2, 3])
def test_split_kv_attention_with_windows_and_soft_capping(world):
    run_distributed(_check_split_kv, world, 6, 2, torch.float64, 3)  # a window of the cache
    run_distributed(_check_split_kv, world, 4, 1, torch.float32, 5, 0.7)


def test_the_last_position_and_decoded_tokens_have_one_owner():
    # 11 positions over 2 ranks: chunks [3, 3, 3, 2], rank 0 holds 0-2 and 9-10
    assert position_owner(10, 11, 2) == (0, 4)
    assert position_owner(4, 11, 2) == (1, 1)
    assert position_owner(0, 1, 3) == (0, 0)  # a one-token prompt: rank 0's first chunk
    assert [decode_owner(p, 3) for p in range(11, 15)] == [2, 0, 1, 2]
