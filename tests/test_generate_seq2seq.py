"""``tp_ext.generate`` on encoder-decoders (T5, BART) converted by ``parallelize``: the encoder runs
once, the decoder keeps its self- and cross-attention caches, and greedy output equals
transformers' own ``generate`` on the unsharded model, at TP 1-4 (uneven heads at 3 and 4),
with prompts of several lengths (padded at either end), rows that end early, and the batch in
one or two micro-batches."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

import tp_ext

from .dist_utils import run_distributed
from .test_encoders_hf import BART as BART_SHAPE
from .test_encoders_hf import T5 as T5_SHAPE
from .test_encoders_hf import VOCAB

# the encoder tests' shapes, with EOS ids the greedy rows do not produce (the early end in
# the test is chosen); BART forces its EOS at the last step, as its checkpoints do
T5 = {**T5_SHAPE, "eos_token_id": VOCAB - 1, "pad_token_id": 0}
BART = {**BART_SHAPE, "eos_token_id": VOCAB - 1, "forced_eos_token_id": VOCAB - 1}


def _model(arch: str):
    torch.manual_seed(0)
    if arch == "t5":
        model = transformers.T5ForConditionalGeneration(transformers.T5Config(**T5))
    else:
        model = transformers.BartForConditionalGeneration(transformers.BartConfig(**BART))
    return model.float().eval()


def _prompts(right_padded: bool):
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(3, VOCAB, (3, 8), generator=g)
    mask = torch.ones_like(ids)
    if right_padded:  # a tokenizer's default for T5
        mask[1, 5:] = 0
        mask[2, 2:] = 0
    else:
        mask[1, :3] = 0
        mask[2, :6] = 0
    return ids.masked_fill(mask == 0, 0), mask


def _eos_early(model, ids, mask) -> int:
    """An EOS id that ends some rows of the unsharded greedy output early: a token the first
    row produces midway."""
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert out.size(1) == 9, "the model's own EOS ended every row: pick another"
    return int(out[0, 4])


def _check(arch: str):
    tp = torch.distributed.get_world_size()
    state = tp_ext.init_parallel(tp=tp)
    reference = _model(arch)
    model = tp_ext.parallelize(copy.deepcopy(reference), "auto", parallel=state)
    for right in (False, True):
        ids, mask = _prompts(right)
        for eos in (None, _eos_early(reference, ids, mask)):
            options = dict(max_new_tokens=8, do_sample=False)
            if eos is not None:
                options.update(eos_token_id=eos, pad_token_id=0)
            want = reference.generate(input_ids=ids, attention_mask=mask, **options)
            got = tp_ext.generate(model, ids, mask, **options)
            assert torch.equal(got, want), (arch, right, eos, got, want)
            split = tp_ext.generate(model, ids, mask, micro_batches=2, **options)
            assert torch.equal(split, want), (arch, right, eos, "two micro-batches")
    calls = []
    hook = model.get_encoder().register_forward_hook(lambda *_: calls.append(1))
    _, report = tp_ext.generate(model, ids, mask, max_new_tokens=4, return_report=True)
    hook.remove()
    assert len(calls) == 1, "the encoder runs once"
    assert report["kv_cache_bytes"] > 0 and report["new_tokens"] == 3 * 4
    return True


@pytest.mark.parametrize("arch", ["t5", "bart"])
@pytest.mark.parametrize("ws", [1, 2, 3, pytest.param(4, marks=pytest.mark.full_matrix)])
def test_greedy_equals_transformers(arch, ws):
    assert run_distributed(_check, ws, arch, timeout=300) == [True] * ws
