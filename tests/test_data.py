"""tp_ext.data: token files (uint16, uint32) read through a memory map, sequences cut as
overlapping windows, a seeded order per epoch, each DP rank's share of a step, and a position
that resumes exactly, at any DP degree (world sizes 1-4: the ranks' shares of a step
concatenate to the single-rank step)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tp_ext.data import TokenBatches, TokenFile, byte_tokens, write_token_file

from .dist_utils import run_distributed


def _file(tmp_path, n=1000, dtype="uint16", high=50000, seed=0):
    ids = np.random.default_rng(seed).integers(0, high, n)
    path = str(tmp_path / f"tokens-{dtype}.bin")
    write_token_file(path, ids, dtype)
    return path, ids


@pytest.mark.parametrize("dtype, high", [("uint16", 65536), ("uint32", 2**32)])
def test_windows_are_slices_of_the_file(tmp_path, dtype, high):
    path, ids = _file(tmp_path, n=301, dtype=dtype, high=high)
    tokens = TokenFile(path, dtype)
    assert len(tokens) == 301
    batches = TokenBatches(tokens, seq_len=11, global_batch=30, micro_batch_size=5, seed=3)
    assert batches.num_samples == 30  # (301 - 1) // 10
    order = torch.randperm(30, generator=torch.Generator().manual_seed(3))
    rows = torch.cat(next(batches))
    for row, sample in zip(rows, order.tolist()):
        assert row.tolist() == ids[sample * 10 : sample * 10 + 11].tolist()
    if dtype == "uint32":
        assert int(rows.max()) > 65535, "ids above uint16's range come through"
    # each id but the first is a target exactly once over an epoch
    targets = sorted(i for s in range(30) for i in range(s * 10 + 1, s * 10 + 11))
    assert targets == list(range(1, 301))


def test_order_is_seeded_and_each_epoch_a_permutation(tmp_path):
    path, _ = _file(tmp_path, n=401)
    a = TokenBatches(TokenFile(path), seq_len=9, global_batch=10, micro_batch_size=2, seed=7)
    b = TokenBatches(TokenFile(path), seq_len=9, global_batch=10, micro_batch_size=2, seed=7)
    c = TokenBatches(TokenFile(path), seq_len=9, global_batch=10, micro_batch_size=2, seed=8)
    steps = [torch.cat(next(a)) for _ in range(5)]  # exactly one epoch of 50 samples
    assert all(torch.equal(s, torch.cat(next(b))) for s in steps)
    assert not torch.equal(steps[0], torch.cat(next(c)))
    epoch = torch.cat(steps)
    assert len({tuple(r) for r in epoch.tolist()}) == 50, "every sample once per epoch"
    second = torch.cat([torch.cat(next(a)) for _ in range(5)])
    assert sorted(map(tuple, second.tolist())) == sorted(map(tuple, epoch.tolist()))
    assert not torch.equal(second, epoch), "the next epoch has its own order"


def _continuation(batches, steps):
    return [torch.cat(next(batches)) for _ in range(steps)]


def test_state_resumes_exactly_across_epochs_and_dp_degrees(tmp_path):
    path, _ = _file(tmp_path, n=131)  # 16 samples of seq 9: a step of 6 straddles epochs
    make = lambda **kw: TokenBatches(  # noqa: E731
        TokenFile(path), seq_len=9, global_batch=6, micro_batch_size=1, seed=5, **kw
    )
    straight = make()
    _continuation(straight, 2)
    state = json.loads(json.dumps(straight.state_dict()))  # JSON round trip
    expected = _continuation(straight, 4)
    resumed = make()
    resumed.load_state_dict(state)
    assert all(torch.equal(x, y) for x, y in zip(_continuation(resumed, 4), expected))
    for dp in (2, 3):  # another DP degree: the ranks' shares make up the same steps
        ranks = [make(dp_rank=r, dp_size=dp) for r in range(dp)]
        for r in ranks:
            r.load_state_dict(state)
        for step in expected:
            assert torch.equal(torch.cat([torch.cat(next(r)) for r in ranks]), step)


def _rank_steps(path, steps):
    import torch.distributed as dist

    batches = TokenBatches(
        TokenFile(path),
        seq_len=7,
        global_batch=12,
        micro_batch_size=1,
        dp_rank=dist.get_rank(),
        dp_size=dist.get_world_size(),
        seed=2,
    )
    return [torch.cat(next(batches)) for _ in range(steps)]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_dp_ranks_share_each_step(tmp_path, world):
    path, _ = _file(tmp_path, n=200)
    single = TokenBatches(TokenFile(path), seq_len=7, global_batch=12, micro_batch_size=1, seed=2)
    expected = [torch.cat(next(single)) for _ in range(3)]
    per_rank = run_distributed(_rank_steps, world, path, 3)
    for step, want in enumerate(expected):
        assert torch.equal(torch.cat([r[step] for r in per_rank]), want)


def test_byte_tokens():
    ids = byte_tokens("héllo")
    assert ids.dtype == np.uint16 and ids.tolist() == list("héllo".encode())


@pytest.mark.parametrize(
    "make, error, message",
    [
        (lambda p: TokenFile(p + ".missing"), FileNotFoundError, "does not exist"),
        (lambda p: TokenFile(p, "int8"), ValueError, "dtype must be one of"),
        (lambda p: TokenFile(p + ".odd", "uint32"), ValueError, "not a multiple of 4"),
        (lambda p: TokenFile(p + ".empty"), ValueError, "is empty"),
        (
            lambda p: TokenBatches(TokenFile(p), seq_len=8, global_batch=6, micro_batch_size=4),
            ValueError,
            r"global_batch 6 must be divisible by .* = 4 .*values that work: \[4, 8",
        ),
        (
            lambda p: TokenBatches(TokenFile(p), seq_len=1, global_batch=4, micro_batch_size=1),
            ValueError,
            "seq_len must be an int >= 2",
        ),
        (
            lambda p: TokenBatches(TokenFile(p), seq_len=99, global_batch=4, micro_batch_size=1),
            ValueError,
            "has 10 tokens, too few for one sequence of seq_len 99",
        ),
        (
            lambda p: TokenBatches(
                TokenFile(p), seq_len=4, global_batch=2, micro_batch_size=1, dp_rank=2, dp_size=2
            ),
            ValueError,
            r"dp_rank must be an int in \[0, 2\)",
        ),
        (lambda p: write_token_file(p, [70000]), ValueError, "token id 70000 does not fit uint16"),
        (lambda p: write_token_file(p, [[1, 2]]), ValueError, "1-d sequence of integer"),
    ],
)
def test_errors(tmp_path, make, error, message):
    path = str(tmp_path / "t.bin")
    write_token_file(path, list(range(10)))
    (tmp_path / "t.bin.odd").write_bytes(b"\0" * 6)
    (tmp_path / "t.bin.empty").write_bytes(b"")
    with pytest.raises(error, match=message):
        make(path)


def test_position_and_vocabulary_errors(tmp_path):
    path = str(tmp_path / "t.bin")
    write_token_file(path, [1, 2, 3, 900, 5, 6, 7])
    batches = TokenBatches(TokenFile(path), seq_len=3, global_batch=3, micro_batch_size=1)
    with pytest.raises(ValueError, match="global_batch=4, these batches global_batch=3"):
        batches.load_state_dict({**batches.state_dict(), "global_batch": 4})
    with pytest.raises(ValueError, match="seed=1, these batches seed=1234"):
        batches.load_state_dict({**batches.state_dict(), "seed": 1})
    with pytest.raises(ValueError, match="must be a multiple of global_batch 3"):
        batches.load_state_dict({**batches.state_dict(), "consumed_samples": 4})
    checked = TokenBatches(
        TokenFile(path), seq_len=3, global_batch=3, micro_batch_size=1, vocab_size=512
    )
    with pytest.raises(ValueError, match="token id 900 at position 3 is outside .*vocab_size 512"):
        next(checked)
