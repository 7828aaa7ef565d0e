"""Generation under context parallelism (tp_ext/parallelize/context.py, context_cache.py,
tp_ext/layers/context_decode.py): the prompt's prefill runs over the CP group (ring or
all-to-all), each rank keeping its positions' keys and values; each decoded token attends every
rank's share of the cache, merged by log-sum-exp. transformers' own ``generate`` (greedy) and
``tp_ext.generate`` on Hugging Face decoders converted with cp > 1 give the unsplit model's
tokens exactly and its step logits to fp64 rounding, at cp 2 and 3 (uneven splits) and
tp2 x cp2, both modes, on left-padded prompts; the cache stays split (each position on one
rank). What generation under CP does not run is refused by name."""

import copy

import pytest
import torch

import tp_ext
from tp_ext.layers.context_decode import decode_owner, position_owner, split_kv_attention
from tp_ext.parallelize.transformers_names import cache_argument

from .dist_utils import run_distributed
from .test_context_hf import _model, _tolerances, cp_matrix
from .test_parallelize_models import VOCAB

WIDTH, NEW = 11, 6  # prompts padded to 11 positions (2C chunks uneven at cp 2, 3), 6 new tokens


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


# -- Hugging Face decoders --------------------------------------------------------------------


def _prompts(padded: bool):
    """3 prompts of 11, 7 and 4 tokens, left-padded (or all of 11)."""
    ids = torch.randint(1, VOCAB, (3, WIDTH), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :4] = 0
        mask[2, :7] = 0
        ids = ids.masked_fill(mask == 0, 0)
    return ids, mask


def _cache_bytes(cache) -> int:
    return sum(
        t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
    )


def _generate_case(arch, tp, cp, mode, padded=True):
    """transformers' greedy ``generate`` on the converted model and ``tp_ext.generate``: the
    unsplit model's tokens; transformers' step logits close to its; the cache split over CP."""
    reference = _model(arch).eval()
    state = tp_ext.init_parallel(tp=tp, cp=cp)
    model = tp_ext.parallelize(copy.deepcopy(reference), "auto", parallel=state, cp_mode=mode)
    ids, mask = _prompts(padded)
    settings = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    want = reference.generate(ids, **settings, output_logits=True, return_dict_in_generate=True)
    got = model.generate(ids, **settings, output_logits=True, return_dict_in_generate=True)
    assert torch.equal(got.sequences, want.sequences), (got.sequences, want.sequences)
    assert len(got.logits) == len(want.logits)
    tol, _ = _tolerances(arch)
    for step, (a, b) in enumerate(zip(got.logits, want.logits)):
        torch.testing.assert_close(a, b, **tol, msg=f"step {step}")
    # every position's keys on one CP rank: the prompt's and the decoded tokens' but the last
    cache = getattr(got, cache_argument())
    held = torch.tensor([len(cache.held)])
    assert all(layer.keys.size(2) == held for layer in cache.layers)
    covered = tp_ext.comm.all_reduce(held, group=state.cp_group)
    assert int(covered) == cache.get_seq_length() == got.sequences.size(1) - 1
    tokens, report = tp_ext.generate(
        model, ids, mask, max_new_tokens=NEW, pad_token_id=0, return_report=True
    )
    assert torch.equal(tokens, want.sequences), (tokens, want.sequences)
    assert report["kv_cache_bytes"] == _cache_bytes(cache)  # the same split
    return int(held)


# make test: each mode, cp 2 and 3, tp2 x cp2; learned positions (GPT-2) and windows
SUBSET = [
    ("llama", 1, 2, "ring"),
    ("gpt2", 1, 3, "all_to_all"),
    ("mistral_window", 1, 3, "ring"),
    ("qwen3", 2, 2, "all_to_all"),
]


@pytest.mark.parametrize("arch, tp, cp, mode", cp_matrix([(1, 2), (1, 3), (2, 2)], SUBSET))
def test_greedy_generation_under_cp_equals_transformers(arch, tp, cp, mode):
    """Left-padded prompts (Gemma 2: unpadded, its eager attention gives a padded query NaN in
    the reference, which its padded keys' values then carry into every row)."""
    held = run_distributed(_generate_case, tp * cp, arch, tp, cp, mode, arch != "gemma2")
    assert sum(held[::tp]) == WIDTH + NEW - 1


def _without_cache_case(mode):
    """generate(use_cache=False): each step a whole forward over CP, the last position's
    logits on every rank (logits_to_keep=1)."""
    reference = _model("llama").eval()
    state = tp_ext.init_parallel(tp=1, cp=2)
    model = tp_ext.parallelize(copy.deepcopy(reference), "auto", parallel=state, cp_mode=mode)
    ids, mask = _prompts(True)
    settings = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    want = reference.generate(ids, **settings)
    got = model.generate(ids, **settings, use_cache=False)
    assert torch.equal(got, want), (got, want)
    with torch.no_grad():  # a plain forward still gives this rank's positions
        logits = model(ids, attention_mask=mask).logits
    assert logits.size(1) == len(tp_ext.cp_positions(WIDTH, parallel=state))
    rows = [1, 0, 2] if state.cp_rank else [0, 1, 2]  # the CP ranks must pass the same prompts
    with pytest.raises(ValueError, match="different prompts"):
        tp_ext.generate(model, ids[rows], mask[rows], NEW)


def test_generation_without_a_cache_and_prompts_checked_over_cp():
    run_distributed(_without_cache_case, 2, "all_to_all")


def _sampling_case(tp, cp, mode):
    """Sampled tokens: the same logits and draws on every CP rank, the same tokens as the
    single-process rule (tests/test_generate.py's reference)."""
    from .test_generate import RULES, _reference_sample

    reference = _model("llama").eval()
    state = tp_ext.init_parallel(tp=tp, cp=cp)
    model = tp_ext.parallelize(copy.deepcopy(reference), "auto", parallel=state, cp_mode=mode)
    ids, mask = _prompts(True)
    for i, rule in enumerate(RULES[:2]):
        want = _reference_sample(reference, ids, mask, NEW, seed=3 + i, **rule)
        got = tp_ext.generate(model, ids, mask, NEW, do_sample=True, seed=3 + i, **rule)
        assert torch.equal(got, want), (rule, got, want)


@pytest.mark.full_matrix
@pytest.mark.parametrize("tp, cp, mode", [(1, 3, "ring"), (2, 2, "all_to_all")])
def test_sampling_under_cp_equals_the_reference_rule(tp, cp, mode):
    run_distributed(_sampling_case, tp * cp, tp, cp, mode)


def _moe_case(ep, mode):
    """Mixtral (fp32: its grouped GEMMs), with expert parallelism over the CP ranks' replicas."""
    import transformers

    from .test_parallelize_models import COMMON

    config = transformers.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    reference = transformers.MixtralForCausalLM(config).float().eval()
    state = tp_ext.init_parallel(tp=1, cp=2, ep=ep, dp=ep)
    model = tp_ext.parallelize(copy.deepcopy(reference), "auto", parallel=state, cp_mode=mode)
    ids, mask = _prompts(True)
    settings = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    want = reference.generate(ids, **settings)
    assert torch.equal(model.generate(ids, **settings), want)
    assert torch.equal(tp_ext.generate(model, ids, mask, NEW, pad_token_id=0), want)


@pytest.mark.full_matrix
@pytest.mark.parametrize("ep, mode", [(1, "ring"), (2, "all_to_all")])
def test_mixtral_generation_under_cp(ep, mode):
    run_distributed(_moe_case, 2 * ep, ep, mode)


def _sequence_parallel_case(mode):
    """tp2 x cp2 with sequence parallelism (a decoded token's one position split over the TP
    ranks too): transformers' generate gives the unsplit model's tokens."""
    reference = _model("qwen2").eval()
    state = tp_ext.init_parallel(tp=2, cp=2)
    model = tp_ext.parallelize(
        copy.deepcopy(reference), "auto", parallel=state, cp_mode=mode, sequence_parallel=True
    )
    ids, mask = _prompts(True)
    settings = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **settings), reference.generate(ids, **settings))


@pytest.mark.full_matrix
@pytest.mark.parametrize("mode", ["ring", "all_to_all"])
def test_generation_under_cp_with_sequence_parallelism(mode):
    run_distributed(_sequence_parallel_case, 4, mode)


def _refusals():
    state = tp_ext.init_parallel(tp=1, cp=2, pp=2)
    model = tp_ext.parallelize(_model("llama", num_hidden_layers=4), "auto", parallel=state)
    ids, mask = _prompts(True)
    with pytest.raises(ValueError) as error:
        tp_ext.generate(model, ids, mask, max_new_tokens=2)
    return str(error.value)


def test_generation_under_cp_in_pipeline_stages_is_refused_by_name():
    for error in run_distributed(_refusals, 4):
        assert "context parallelism (cp=2) inside pipeline stages (pp=2) does not decode" in error
