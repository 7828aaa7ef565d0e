"""parallelize(model, "auto") decides each linear's split from a traced forward, not from names: a
model whose modules have names no table knows is split exactly (column/row pairs found from the
data flow, a fused projection split by the parts its forward cuts it into, a router kept whole,
the logits' linear split by vocabulary) at TP 1-4, and models where a split would be wrong (a
norm over a linear's whole output, a per-feature scale, a linear output added straight into the
residual stream) are refused naming the module and the reason."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tp_ext
from tp_ext.layers import local_shards
from tp_ext.parallelize.plan import auto_plan
from tp_ext.parallelize.styles import SharedInput

from .dist_utils import run_distributed
from .test_layers import assert_rel

VOCAB, WIDTH, INNER = 37, 24, 19  # uneven at 2, 3 and 4 ranks


class _Block(nn.Module):
    """Names on purpose unlike any model's: alpha/beta/omega a gated MLP, w12/w3 one with a fused
    [gate | up] cut by chunk, score a 3-way router scaling the two branches."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.alpha = nn.Linear(WIDTH, INNER, bias=False)
        self.beta = nn.Linear(WIDTH, INNER, bias=True)
        self.omega = nn.Linear(INNER, WIDTH, bias=True)
        self.w12 = nn.Linear(WIDTH, 2 * INNER, bias=False)
        self.w3 = nn.Linear(INNER, WIDTH, bias=False)
        self.score = nn.Linear(WIDTH, 3, bias=False)

    def forward(self, x):
        h = self.norm(x)
        route = torch.softmax(self.score(h), dim=-1)
        a = self.omega(F.silu(self.alpha(h)) * self.beta(h))
        gate, up = self.w12(h).chunk(2, dim=-1)
        b = self.w3(F.gelu(gate) * up)
        return x + route[..., :1] * a + route[..., 1:2] * b


class _ToyLM(nn.Module):
    def __init__(self, block=_Block, layers=2):
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, WIDTH)
        self.places = nn.Embedding(16, WIDTH)
        self.stack = nn.ModuleList(block() for _ in range(layers))
        self.final = nn.LayerNorm(WIDTH)
        self.to_vocab = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, ids):
        x = self.tokens(ids) + self.places(torch.arange(ids.shape[-1], device=ids.device))
        for block in self.stack:
            x = block(x)
        return self.to_vocab(self.final(x))


def _toy(block=_Block):
    torch.manual_seed(0)
    return _ToyLM(block)


def test_decisions_come_from_the_data_flow():
    reasons, parts = {}, {}
    plan = auto_plan(_toy(), reasons=reasons, parts=parts)
    b = "stack.0."
    assert plan[b + "alpha"] == plan[b + "beta"] == plan[b + "w12"] == "colwise", plan
    assert plan[b + "omega"] == plan[b + "w3"] == "rowwise", plan
    assert plan[b + "score"] == "replicate", plan
    assert plan["to_vocab"] == plan["tokens"] == "vocab", plan
    assert plan["places"] == "replicate", plan
    assert parts[b + "w12"] == [INNER, INNER], parts
    assert "reaches stack.0.omega" in reasons[b + "alpha"], reasons[b + "alpha"]
    assert "reads only what alpha, beta computed" in reasons[b + "omega"], reasons[b + "omega"]
    assert "cuts its output into [19, 19]" in reasons[b + "w12"], reasons[b + "w12"]
    assert "reduction over all its outputs" in reasons[b + "score"], reasons[b + "score"]
    assert "indexed by positions" in reasons["places"], reasons["places"]
    assert "logits" in reasons["to_vocab"], reasons["to_vocab"]


def test_the_trace_leaves_the_model_and_random_state_as_they_were():
    model = _toy()
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = torch.random.get_rng_state()
    auto_plan(model)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(m.training for m in model.modules())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not model._forward_hooks and not model.stack[0].alpha._forward_pre_hooks


def _check_toy_exact(block=_Block):
    reference = _toy(block)
    model, report = tp_ext.parallelize(copy.deepcopy(reference), "auto", return_report=True)
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
    target = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(2))
    out, ref = model(ids), reference(ids)
    assert_rel(out, ref, "logits")
    loss = F.cross_entropy(out.flatten(0, 1), target.flatten())
    ref_loss = F.cross_entropy(ref.flatten(0, 1), target.flatten())
    assert_rel(loss, ref_loss, "loss")
    with tp_ext.comm.track() as backward:
        loss.backward()
    ref_loss.backward()
    expected = local_shards(model, {n: p.grad for n, p in reference.named_parameters()})
    for name, p in model.named_parameters():
        assert_rel(p.grad, expected[name], f"gradient of {name}")
    return report, sum(r.count for r in backward.records)


@pytest.mark.parametrize("ws", [1, 2, 3, 4])
def test_a_model_with_unknown_names_is_split_exactly(ws):
    report, _ = run_distributed(_check_toy_exact, ws)[0]
    if ws > 1:
        assert report["stack.1.w12"].startswith("colwise: column-parallel by parts [19, 19]")
        assert report["stack.1.omega"].startswith("rowwise"), report


class _SharedNorm(_Block):
    """No router: the norm's output is read only by the column-parallel alpha, beta and w12."""

    def __init__(self):
        super().__init__()
        del self.score

    def forward(self, x):
        h = self.norm(x)
        a = self.omega(F.silu(self.alpha(h)) * self.beta(h))
        gate, up = self.w12(h).chunk(2, dim=-1)
        return x + a + self.w3(F.gelu(gate) * up)


class _NormAlsoElsewhere(_SharedNorm):
    """The same, with the norm's output also added into the stream, where its gradient is whole
    on every rank: an all-reduce of the sum would count that part once per rank."""

    def forward(self, x):
        return super().forward(x) + 0.5 * self.norm(x)


def test_a_norm_read_only_by_column_linears_hands_them_its_output_once():
    plan = auto_plan(_toy(_SharedNorm))
    readers = ("stack.0.alpha", "stack.0.beta", "stack.0.w12")
    assert plan["stack.0.norm"] == SharedInput(readers), plan
    assert "final" not in plan  # one reader (the logits' linear): nothing to share
    for block in (_Block, _NormAlsoElsewhere):  # a replicated router reads it; the stream does
        assert "stack.0.norm" not in auto_plan(_toy(block)), block.__name__
    sp = auto_plan(_toy(_SharedNorm), sequence_parallel=True)  # its norms gather once already
    assert sp["stack.0.norm"] == "sequence_parallel", sp


@pytest.mark.parametrize("ws", [1, 2, 3, 4])
def test_linears_sharing_a_norms_output_all_reduce_their_input_gradient_once(ws):
    """Exact at every size; the backward's collectives: one all-reduce per shared norm and the
    logits' linear's, where each of alpha, beta and w12 had its own."""
    shared, calls = run_distributed(_check_toy_exact, ws, _SharedNorm)[0]
    _, separate = run_distributed(_check_toy_exact, ws, _NormAlsoElsewhere)[0]
    if ws == 1:
        assert calls == separate == 0
        return
    assert shared["stack.0.norm"].startswith("shared_input: output read by alpha, beta, w12 as one")
    assert calls == 2 + 1, calls  # 2 blocks
    assert separate == 2 * 3 + 1, separate


def test_shared_input_misuse_is_refused_clearly():
    with pytest.raises(ValueError, match=r"SharedInput\(readers=...\) must name"):
        SharedInput(())
    with pytest.raises(ValueError, match="two or more"):
        SharedInput(("stack.0.alpha",))
    plan = {
        "stack.0.norm": SharedInput(("stack.0.beta", "stack.0.alpha")),
        "stack.0.alpha": "replicate",
        "stack.0.beta": "colwise",
    }
    with pytest.raises(ValueError, match="names 'stack.0.alpha'.*must be Colwise"):
        tp_ext.parallelize(_toy(_SharedNorm), plan)


class _NormInside(_Block):
    """alpha's whole output is normalised before omega: split, the norm would see a slice."""

    def __init__(self):
        super().__init__()
        del self.beta, self.w12, self.w3, self.score
        self.inner_norm = nn.LayerNorm(INNER)

    def forward(self, x):
        h = self.norm(x)
        return x + self.omega(self.inner_norm(self.alpha(h)))


class _ScaledInside(_Block):
    """alpha's output is scaled by a parameter as wide: split, it would not line up."""

    def __init__(self):
        super().__init__()
        del self.beta, self.w12, self.w3, self.score
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, INNER))

    def forward(self, x):
        h = self.norm(x)
        return x + self.omega(self.alpha(h) * self.gain)


class _StraightIntoStream(nn.Module):
    """``up`` feeds ``down`` but is also added to the residual stream as it is."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, WIDTH, bias=False)
        self.down = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x):
        u = self.up(self.norm(x))
        return x + u + self.down(F.relu(u))


@pytest.mark.parametrize(
    "block, why",
    [
        (_NormInside, "feeds stack.0.omega, but it has all its outputs combined by a reduction"),
        (_ScaledInside, "feeds stack.0.omega, but it has its output scaled by a parameter as wide"),
        (_StraightIntoStream, "feeds stack.0.down, but it has its output added into the residual"),
    ],
    ids=["norm", "per-feature-scale", "into-stream"],
)
def test_a_split_that_would_be_wrong_is_refused_with_the_reason(block, why):
    with pytest.raises(ValueError, match="does not know how to split stack.0.") as info:
        auto_plan(_toy(block))
    first = str(info.value).split("does not know how to split ")[1].split(" ")[0]
    assert f"{first}: its output {why}" in str(info.value), str(info.value)


def test_a_model_that_does_not_take_token_ids_needs_example_inputs():
    class Tabular(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(WIDTH, 64)
            self.down = nn.Linear(64, WIDTH)

        def forward(self, features):
            return self.down(torch.relu(self.up(features)))

    with pytest.raises(ValueError, match="could not make inputs for it.*example_inputs"):
        auto_plan(Tabular())
    # given an input (whole on every rank, like the residual stream), the pair is found
    plan = auto_plan(Tabular(), example_inputs=((torch.randn(3, WIDTH),), {}))
    assert plan == {"up": "colwise", "down": "rowwise"}, plan


def test_the_traced_forward_takes_what_the_config_describes():
    import transformers

    from tp_ext.parallelize.dataflow import example_token_inputs

    small = dict(d_model=16, encoder_layers=1, decoder_layers=1, encoder_ffn_dim=16)
    small.update(decoder_ffn_dim=16, encoder_attention_heads=2, decoder_attention_heads=2)
    bart = transformers.BartModel(transformers.BartConfig(vocab_size=50, **small))
    args, kwargs = example_token_inputs(bart, tokens=4)
    assert args == () and set(kwargs) == {"input_ids", "decoder_input_ids", "use_cache"}
    assert kwargs["input_ids"].shape == (1, 4) and int(kwargs["input_ids"].max()) < 50
    vit = transformers.ViTModel(
        transformers.ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=16, image_size=8, patch_size=4, num_channels=3)
    )  # fmt: skip
    args, kwargs = example_token_inputs(vit)
    assert set(kwargs) == {"pixel_values"} and kwargs["pixel_values"].shape == (1, 3, 8, 8)
    assert example_token_inputs(torch.nn.Linear(3, 3)) is None
