"""parallelize(model, "auto") on plain torch.nn transformers: nn.MultiheadAttention (its packed
in_proj_weight split by heads) in nn.TransformerEncoder and nn.Transformer (decoder
self-attention and cross-attention), batch_first either way, with key-padding and additive
float masks, at TP 2, 3 and 4 (6 heads: uneven at 4). Outputs, loss and every gradient equal the
unsharded model's; the full state is torch's own; an eval forward (where torch would take its
fused fast paths) gives the unsharded model's values; nn.MultiheadAttention alone returns the
same attention weights (averaged, or each head's), and takes a per-head mask."""

import copy

import pytest
import torch
from torch import nn

import tp_ext
from tp_ext.layers import ParallelMultiheadAttention, local_shards

from .dist_utils import run_distributed
from .test_layers import assert_rel

VOCAB, WIDTH, HEADS = 37, 48, 6


class EncoderLM(nn.Module):
    """Token embedding, an nn.TransformerEncoder, a vocabulary head."""

    def __init__(self, batch_first: bool):
        super().__init__()
        self.batch_first = batch_first
        self.embed = nn.Embedding(VOCAB, WIDTH)
        layer = nn.TransformerEncoderLayer(WIDTH, HEADS, 88, dropout=0.0, batch_first=batch_first)
        self.encoder = nn.TransformerEncoder(layer, 2)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids, padding=None, mask=None):
        x = self.embed(ids)
        x = x if self.batch_first else x.transpose(0, 1)
        y = self.encoder(x, mask=mask, src_key_padding_mask=padding)
        return self.head(y if self.batch_first else y.transpose(0, 1))


class Seq2Seq(nn.Module):
    """nn.Transformer between two embeddings, a vocabulary head: encoder, decoder
    self-attention (causal) and cross-attention."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.transformer = nn.Transformer(
            WIDTH, HEADS, 2, 2, 88, dropout=0.0, batch_first=True, norm_first=True
        )
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids, target, padding=None):
        causal = nn.Transformer.generate_square_subsequent_mask(target.size(1))
        y = self.transformer(
            self.embed(ids),
            self.embed(target),
            tgt_mask=causal,
            src_key_padding_mask=padding,
            memory_key_padding_mask=padding,
        )
        return self.head(y)


def _inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (3, 9), generator=g)
    padding = torch.zeros(3, 9, dtype=torch.bool)
    padding[1, 6:] = True
    padding[2, 3:] = True
    return ids, padding, torch.randint(0, VOCAB, (3, 5), generator=g)


def _same_training_step(reference: nn.Module, run, what: str, example=None):
    """Converted and unsharded: the same output, loss and gradients (train mode).
    ``example``: the traced forward's (args, kwargs) where token ids alone do not do."""
    model = tp_ext.parallelize(copy.deepcopy(reference), "auto", example_inputs=example)
    assert any(isinstance(m, ParallelMultiheadAttention) for m in model.modules()), what
    model.train(), reference.train()
    got, want = run(model), run(reference)
    assert_rel(got.detach(), want.detach(), f"{what}: output")
    target = torch.randint(0, VOCAB, got.shape[:-1], generator=torch.Generator().manual_seed(2))
    losses = [nn.functional.cross_entropy(o.flatten(0, 1), target.flatten()) for o in (got, want)]
    assert_rel(losses[0].detach(), losses[1].detach(), f"{what}: loss")
    for loss in losses:
        loss.backward()
    grads = local_shards(model, {n: p.grad for n, p in reference.named_parameters()})
    for name, p in model.named_parameters():
        assert_rel(p.grad, grads[name], f"{what}: gradient of {name}")
    full = tp_ext.layers.full_state_dict(model)
    expected = reference.state_dict()
    assert set(full) == set(expected), (what, set(full) ^ set(expected))
    for name, tensor in full.items():
        assert torch.equal(tensor, expected[name]), (what, name)
    return model


def _check_torch_transformers():
    ids, padding, target = _inputs()
    causal = nn.Transformer.generate_square_subsequent_mask(ids.size(1))  # additive floats
    for batch_first in (True, False):
        torch.manual_seed(0)
        reference = EncoderLM(batch_first)
        what = f"encoder batch_first={batch_first}"
        model = _same_training_step(reference, lambda m: m(ids, padding, causal), what)
        # eval and no_grad: torch's nested-tensor and fused paths for the unsharded model (it
        # leaves padded positions 0 there), the module path for the converted one
        model.eval(), reference.eval()
        with torch.no_grad():
            got, want = model(ids, padding), reference(ids, padding)
        assert_rel(got[~padding], want[~padding], f"{what}: eval output at the tokens")
        assert not model.encoder.use_nested_tensor
    torch.manual_seed(0)
    seq2seq = Seq2Seq()
    example = ((ids[:1], target[:1]), {})  # two token sequences: no default inputs do
    _same_training_step(seq2seq, lambda m: m(ids, target, padding), "nn.Transformer", example)
    return True


def _check_attention_alone():
    torch.manual_seed(0)
    reference = nn.MultiheadAttention(WIDTH, HEADS, batch_first=True)
    holder = nn.Module()
    holder.attn = copy.deepcopy(reference)
    model = tp_ext.parallelize(holder, {"attn": "heads"}).attn
    g = torch.Generator().manual_seed(3)
    query, memory = torch.randn(2, 5, WIDTH, generator=g), torch.randn(2, 7, WIDTH, generator=g)
    per_head = torch.randn(2 * HEADS, 5, 7, generator=g)  # an additive mask per (batch, head)
    padding = torch.tensor([[False] * 7, [False] * 4 + [True] * 3])
    for kwargs in ({}, {"attn_mask": per_head, "key_padding_mask": padding}):
        got, got_weights = model(query, memory, memory, **kwargs)
        want, want_weights = reference(query, memory, memory, **kwargs)
        assert_rel(got.detach(), want.detach(), f"attention {list(kwargs)}: output")
        assert_rel(
            got_weights.detach(), want_weights.detach(), f"attention {list(kwargs)}: weights"
        )
    got, got_weights = model(query, memory, memory, average_attn_weights=False)
    want, want_weights = reference(query, memory, memory, average_attn_weights=False)
    assert got_weights.shape == (2, HEADS, 5, 7)
    assert_rel(got_weights.detach(), want_weights.detach(), "attention: each head's weights")
    return True


@pytest.mark.parametrize("ws", [2, 3, 4])
def test_auto_on_torch_nn_transformers(ws):
    assert run_distributed(_check_torch_transformers, ws, timeout=600) == [True] * ws


@pytest.mark.parametrize("ws", [1, 4])  # 4: 6 heads split unevenly
def test_multihead_attention_alone_by_heads(ws):
    assert run_distributed(_check_attention_alone, ws) == [True] * ws


def _sequence_parallel_refusal():
    torch.manual_seed(0)
    with pytest.raises(ValueError, match=r"sequence_parallel=True: encoder\.layers\.0\.self_attn"):
        tp_ext.parallelize(EncoderLM(batch_first=True), "auto", sequence_parallel=True)
    return True


def test_sequence_parallelism_around_multihead_attention_is_refused_by_name():
    """nn.MultiheadAttention, split by heads as one layer, takes the whole sequence."""
    assert run_distributed(_sequence_parallel_refusal, 2) == [True, True]
