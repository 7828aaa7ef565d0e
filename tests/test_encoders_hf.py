"""parallelize(model, "auto") on transformers' bidirectional encoders with their task heads
(BERT, RoBERTa and DeBERTa-v2: masked LM, sequence and token classification; ViT: image
classification, traced on an image its config describes) and encoder-decoders (T5: its per-head
relative position bias split with the heads, uneven at TP 3 and 4; BART: learned positions, one
scaled embedding shared by the encoder, the decoder and the LM head; both with cross-attention)
at TP 2, 3 and 4: logits (padded rows included), loss, every gradient and the weights after an
optimizer step equal the unsharded model's; the masked-LM head's ties (decoder weight to the
word embeddings, decoder bias to the head's own) hold; the full state is transformers' own, and
its save_pretrained export loads back in transformers with equal logits. ViT also with sequence
parallelism (its 17 positions split unevenly); the layouts sequence parallelism does not split
(post-norm encoders, encoder-decoders) are refused by name."""

import copy

import pytest
import torch
import transformers

import tp_ext
from tp_ext.layers import local_shards

from .dist_utils import rank, run_distributed
from .test_layers import assert_rel

VOCAB = 101  # not divisible by 2 or 3
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    intermediate_size=88,
    num_hidden_layers=2,
    num_attention_heads=12,  # 12 heads: every TP of 2, 3 and 4 splits them
    max_position_embeddings=64,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
    num_labels=3,
)
CASES = [  # (config class, model class, labels: "tokens" or "sequence")
    ("BertConfig", "BertForMaskedLM", "tokens"),
    ("BertConfig", "BertForSequenceClassification", "sequence"),
    ("BertConfig", "BertForTokenClassification", "tokens"),
    ("RobertaConfig", "RobertaForMaskedLM", "tokens"),
    # DeBERTa-v2: disentangled attention, its relative-position projections split by heads too
    ("DebertaV2Config", "DebertaV2ForMaskedLM", "tokens"),
    ("DebertaV2Config", "DebertaV2ForSequenceClassification", "sequence"),
    ("ViTConfig", "ViTForImageClassification", "image"),
    ("T5Config", "T5ForConditionalGeneration", "seq2seq"),
    ("BartConfig", "BartForConditionalGeneration", "seq2seq"),
    # T5 v1.1 / Flan-T5: gated MLP (wi_0, wi_1), LM head untied from the embedding
    (
        "T5Config",
        "T5ForConditionalGeneration",
        "seq2seq",
        {"feed_forward_proj": "gated-gelu", "tie_word_embeddings": False},
    ),
]
IMAGE = dict(image_size=16, patch_size=4, num_channels=3)
DEBERTA = dict(  # relative attention both ways (c2p, p2c), its own position projections
    relative_attention=True, pos_att_type=["p2c", "c2p"], position_buckets=16,
    max_relative_positions=16, share_att_key=False,
)  # fmt: skip
T5 = dict(  # 10 heads (uneven at TP 3, 4), a relative bias per head, a tied and scaled head
    vocab_size=VOCAB, d_model=48, d_kv=4, d_ff=88, num_layers=2, num_heads=10,
    dropout_rate=0.0, decoder_start_token_id=0,
)  # fmt: skip
BART = dict(  # learned positions, scaled embeddings shared by encoder, decoder and LM head
    vocab_size=VOCAB, d_model=48, encoder_layers=2, decoder_layers=2, encoder_attention_heads=12,
    decoder_attention_heads=12, encoder_ffn_dim=88, decoder_ffn_dim=88,
    max_position_embeddings=64, dropout=0.0, attention_dropout=0.0, scale_embedding=True,
)  # fmt: skip


def _build(config_name: str, model_name: str, options=None):
    own = {"T5Config": T5, "BartConfig": BART}
    extra = {
        "RobertaConfig": {"pad_token_id": 1},
        "ViTConfig": IMAGE,
        "DebertaV2Config": DEBERTA,
    }.get(config_name, {})
    shape = {**(own.get(config_name) or {**SHAPE, **extra}), **(options or {})}
    config = getattr(transformers, config_name)(**shape)
    torch.manual_seed(0)  # the same full weights on every rank
    return getattr(transformers, model_name)(config).float().eval()


def _inputs(labels_kind: str, classes: int) -> tuple[dict, torch.Tensor]:
    """The forward's inputs (token ids with a padding mask, or images) and its labels."""
    g = torch.Generator().manual_seed(1)
    if labels_kind == "image":
        pixels = torch.randn(3, IMAGE["num_channels"], 16, 16, generator=g)
        return {"pixel_values": pixels}, torch.randint(0, 3, (3,), generator=g)
    ids = torch.randint(2, VOCAB, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # a padded row
    mask[2, 3:] = 0
    if labels_kind == "sequence":
        labels = torch.randint(0, 3, (3,), generator=g)
    elif labels_kind == "seq2seq":  # the decoder's own ids, and its targets
        decoder = torch.randint(2, VOCAB, (3, 7), generator=g)
        labels = torch.randint(2, VOCAB, (3, 7), generator=g)
        labels[2, 5:] = -100
        return {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": decoder}, labels
    else:
        labels = torch.randint(0, classes, (3, 9), generator=g)
        labels[mask == 0] = -100
    return {"input_ids": ids, "attention_mask": mask}, labels


def _close(got, want, tensors: dict, name: str, what: str) -> None:
    """Within 1e-5 relative; a key projection's bias against its weight's scale (softmax
    ignores a bias on every key alike: its true gradient is 0, both sides hold rounding noise,
    and after a step so does the bias, which starts at 0)."""
    if not name.endswith(("key.bias", "k_proj.bias", "key_proj.bias")):
        assert_rel(got, want, what)
        return
    scale = tensors[name.replace(".bias", ".weight")].abs().max()
    err = ((got - want).abs().max() / scale).item()
    assert err <= 1e-5, f"{what}: error {err:.3g} of the weight's scale"


def _check_encoders(directory: str, cases=CASES, sequence_parallel: bool = False):
    for index, (config_name, model_name, labels_kind, *options) in enumerate(cases):
        what = f"{model_name} {options[0]}" if options else model_name
        reference = _build(config_name, model_name, *options)
        model = tp_ext.parallelize(
            copy.deepcopy(reference), "auto", sequence_parallel=sequence_parallel
        )
        classes = VOCAB if "MaskedLM" in model_name or labels_kind == "seq2seq" else 3
        inputs, labels = _inputs(labels_kind, classes)
        out = model(**inputs, labels=labels)
        want = reference(**inputs, labels=labels)
        assert_rel(out.logits.detach(), want.logits.detach(), f"{what}: logits")
        assert_rel(out.loss.detach(), want.loss.detach(), f"{what}: loss")
        out.loss.backward()
        want.loss.backward()
        grads = local_shards(model, {n: p.grad for n, p in reference.named_parameters()})
        for name, p in model.named_parameters():
            _close(p.grad, grads[name], grads, name, f"{what}: gradient of {name}")
        if "MaskedLM" in model_name:  # the head's ties hold after conversion
            head = model.cls.predictions if hasattr(model, "cls") else model.lm_head
            assert head.decoder.weight is model.get_input_embeddings().weight, what
            assert head.decoder.bias is head.bias, what
        for m in (model, reference):  # one optimizer step on each
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
            opt.step()
        full = tp_ext.layers.full_state_dict(model)
        expected = reference.state_dict()
        assert set(full) == set(expected), (what, set(full) ^ set(expected))
        for name, tensor in full.items():
            _close(tensor, expected[name], expected, name, f"{what}: {name} after a step")
        with torch.no_grad():
            logits = reference(**inputs).logits
        if rank() == 0:  # transformers reads the export back
            path = f"{directory}/{index}-{model_name}"
            reference.save_pretrained(path, state_dict=full)
            loaded = getattr(transformers, model_name).from_pretrained(path).float().eval()
            with torch.no_grad():
                got = loaded(**inputs).logits
            assert_rel(got, logits, f"{what}: logits of the export, read by transformers")
    return True


# 4 in test-all: 12 heads split evenly at 2, 3 and 4 alike (the uneven split of heads is
# test_torch_transformers' at 4)
@pytest.mark.parametrize("ws", [2, 3, pytest.param(4, marks=pytest.mark.full_matrix)])
def test_auto_on_encoders_with_their_task_heads(ws, tmp_path):
    assert run_distributed(_check_encoders, ws, str(tmp_path), timeout=600) == [True] * ws


VIT = [c for c in CASES if c[1] == "ViTForImageClassification"]


# ViT's 17 positions (16 patches and the class token) split unevenly at 2 and 3; the final norm
# gathers them for the class token's classifier
@pytest.mark.parametrize("ws", [2, 3])
def test_sequence_parallel_vit(ws, tmp_path):
    results = run_distributed(_check_encoders, ws, str(tmp_path), VIT, True, timeout=600)
    assert results == [True] * ws


def _refusals():
    refused = {}
    for config_name, model_name, *_ in CASES:
        if model_name == "ViTForImageClassification":
            continue
        try:
            tp_ext.parallelize(_build(config_name, model_name), "auto", sequence_parallel=True)
        except ValueError as e:
            refused[model_name] = str(e)
    return refused


def test_sequence_parallel_is_refused_where_the_stream_is_not_split_by_it():
    """Post-norm encoders (a norm's output is the stream) and encoder-decoders: refused by name
    before anything changes (torch.nn's MultiheadAttention: tests/test_torch_transformers.py)."""
    refused = run_distributed(_refusals, 2)[0]
    assert set(refused) == {c[1] for c in CASES if c[1] != "ViTForImageClassification"}
    for name, message in refused.items():
        assert message.startswith("sequence_parallel=True:") and name in message, message
        kind = "encoder-decoder" if "Conditional" in name else "post-norm"
        assert kind in message, message
