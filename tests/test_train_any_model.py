"""``Trainer(loss_fn=...)``: any model trained on dict micro-batches, the loss over its output:
BERT's masked LM (a loss that counts labels: ``num_items_in_batch``), sequence classification
(the model's own loss, ``loss_fn="model"``), ViT image classification, T5 and BART seq2seq.
At TP 1-4 composed with DDP, FSDP2 and ZeRO, three AdamW steps with clipping train like one process
training the unsharded model on every replica's micro-batches: the same losses and gradient
norms (1e-5 relative), the same weights after. Checkpoints written by ``fit`` resume to the
straight run's losses, bitwise; bad input is refused by name."""

from __future__ import annotations

import copy
import dataclasses
import functools
import json

import pytest
import torch
import torch.nn.functional as F
import transformers

import tp_ext
from tp_ext.layers import full_state_dict
from tp_ext.training import Trainer

from .dist_utils import run_distributed
from .test_encoders_hf import BART, IMAGE, T5
from .test_encoders_hf import SHAPE as ENCODER
from .test_pipeline import LR, MAX_NORM, assert_training_matches

STEPS = 3
VOCAB, SEQ, ROWS = 101, 10, 3  # rows per micro-batch
MICRO = 2  # micro-batches per replica


def masked_lm_loss(output, batch, num_items_in_batch):
    """Cross-entropy summed over the masked positions, divided by the step's count of them."""
    logits = output.logits.flatten(0, 1)
    return F.cross_entropy(logits, batch["labels"].flatten(), reduction="sum") / num_items_in_batch


def image_loss(output, batch):
    """A classifier's mean cross-entropy (an image's classes, or a sequence's)."""
    return F.cross_entropy(output.logits, batch["labels"])


LOSSES = {
    "bert-mlm": masked_lm_loss,
    "bert-cls": "model",
    "vit": image_loss,
    "t5": "model",
    "bart": "model",
}
CLIP = {"bert-cls": 0.1}  # below the first step's gradient norm, so that clipping acts


def _model(arch: str):
    torch.manual_seed(0)  # the same full weights on every rank
    if arch == "t5":
        model = transformers.T5ForConditionalGeneration(transformers.T5Config(**T5))
    elif arch == "bart":
        model = transformers.BartForConditionalGeneration(transformers.BartConfig(**BART))
    elif arch == "vit":
        config = transformers.ViTConfig(**ENCODER, **IMAGE)
        model = transformers.ViTForImageClassification(config)
    else:
        name = "BertForMaskedLM" if arch == "bert-mlm" else "BertForSequenceClassification"
        model = getattr(transformers, name)(transformers.BertConfig(**ENCODER))
    return model.float().train()


def _batches(arch: str, count: int) -> list[dict]:
    """``count`` micro-batches: padded token rows (a masked LM's labels at some of the real
    tokens, a different number in each), images, or seq2seq pairs."""
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(count):
        if arch == "vit":
            pixels = torch.randn(ROWS, 3, 16, 16, generator=g)
            out.append(
                {"pixel_values": pixels, "labels": torch.randint(0, 3, (ROWS,), generator=g)}
            )
            continue
        ids = torch.randint(2, VOCAB, (ROWS, SEQ), generator=g)
        mask = torch.ones_like(ids)
        mask[1, SEQ - 2 - i :] = 0  # padding, at a different length in each micro-batch
        if arch in ("t5", "bart"):
            labels = torch.randint(2, VOCAB, (ROWS, 6), generator=g)
            labels[0, 4:] = -100
            out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
        elif arch == "bert-cls":
            labels = torch.randint(0, 3, (ROWS,), generator=g)
            out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
        else:
            chosen = (torch.rand(ROWS, SEQ, generator=g) < 0.3 + 0.2 * i) & (mask == 1)
            labels = ids.masked_fill(~chosen, -100)
            out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def _optimizer(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.0, eps=1e-6)


@functools.lru_cache(maxsize=None)
def _reference(arch: str, total: int):
    """The unsharded model trained in one process on all ``total`` micro-batches: the masked
    LM's loss over every label of the step; the others the mean of the micro-batch means."""
    model = _model(arch)
    optimizer = _optimizer(model.parameters())
    batches = _batches(arch, total)
    losses, norms = [], []
    for _ in range(STEPS):
        step = 0.0
        for batch in batches:
            if arch == "bert-mlm":
                items = sum(int((b["labels"] != -100).sum()) for b in batches)
                inputs = {k: v for k, v in batch.items() if k != "labels"}
                loss = masked_lm_loss(model(**inputs), batch, items)
            elif arch == "vit":
                loss = image_loss(model(pixel_values=batch["pixel_values"]), batch) / total
            else:
                loss = model(**batch).loss / total
            loss.backward()
            step += loss.item()
        norms.append(
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP.get(arch, MAX_NORM)).item()
        )
        optimizer.step()
        optimizer.zero_grad()
        losses.append(step)
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


@dataclasses.dataclass(frozen=True)
class Case:
    arch: str
    tp: int = 1
    dp: int = 1
    data_parallel: str = "ddp"
    sp: bool = False
    pp: int = 1
    schedule: str = "1F1B"

    def __str__(self) -> str:
        sp = "-sp" if self.sp else ""
        pp = f"-pp{self.pp}-{self.schedule}" if self.pp > 1 else ""
        return f"{self.arch}-tp{self.tp}-dp{self.dp}{pp}{sp}-{self.data_parallel}"

    @property
    def world(self) -> int:
        return self.tp * self.dp * self.pp


def _loss_of(case: Case):
    """The case's loss; under pipelining the last stage gives logits, not the model's loss:
    the classifier's cross-entropy instead (what its own loss computes)."""
    loss = LOSSES[case.arch]
    return image_loss if loss == "model" and case.pp > 1 else loss


def _build(case: Case):
    state = tp_ext.init_parallel(tp=case.tp, dp=case.dp, pp=case.pp)
    model = _model(case.arch)
    if case.tp > 1 or case.pp > 1:  # at pp > 1: this rank's stages
        model = tp_ext.parallelize(model, "auto", parallel=state, sequence_parallel=case.sp)
    trainer = Trainer(
        model,
        optimizer=_optimizer,
        parallel=state,
        schedule=case.schedule,
        max_grad_norm=CLIP.get(case.arch, MAX_NORM),
        data_parallel=case.data_parallel,
        loss_fn=_loss_of(case),
    )
    return state, model, trainer


def _train(case: Case):
    state, model, trainer = _build(case)
    batches = _batches(case.arch, MICRO * case.dp)
    mine = batches[state.dp_rank * MICRO : (state.dp_rank + 1) * MICRO]
    losses, norms = [], []
    for _ in range(STEPS):
        losses.append(trainer.step(mine))
        norms.append(trainer.last_grad_norm)
    with trainer.whole_parameters():
        weights = full_state_dict(model)
    return losses, norms, weights


def check(case: Case) -> None:
    results = run_distributed(_train, case.world, case, timeout=600)
    ref_losses, ref_norms, ref_weights = _reference(case.arch, MICRO * case.dp)
    tied = {"cls.predictions.decoder.weight", "lm_head.weight"}  # the embedding's, not a copy
    held = {k for _, _, part in results for k in part}
    ref_weights = {k: v for k, v in ref_weights.items() if k not in tied or k in held}
    clip = CLIP.get(case.arch, MAX_NORM)
    assert_training_matches(results, ref_losses, ref_norms, ref_weights, clip)


CASES = [
    Case("bert-mlm", tp=2),
    Case("vit", dp=2, data_parallel="fsdp"),
    Case("t5", tp=2),
    Case("bert-mlm", tp=3),
    Case("bert-cls", dp=3, data_parallel="zero1"),
    Case("bert-mlm", tp=2, dp=2, data_parallel="fsdp"),
    Case("vit", tp=3, sp=True),  # 17 positions split unevenly along the sequence
    Case("bert-mlm", pp=2),  # the tied decoder weight's copies on the first and last stage
    Case("vit", pp=2, schedule="GPipe"),
]
MORE = [  # make test-all
    Case("bert-cls", tp=3),
    Case("vit", tp=2, dp=2, data_parallel="zero2"),
    Case("bert-cls", tp=2, dp=2, data_parallel="ddp"),
    Case("bert-mlm", tp=4),
    Case("t5", dp=4, data_parallel="fsdp"),
    Case("t5", tp=2, dp=2, data_parallel="zero2"),
    Case("bart", tp=3),
    Case("bart", tp=2, dp=2, data_parallel="fsdp"),
    Case("vit", tp=2, dp=2, sp=True, data_parallel="fsdp"),
    Case("bert-cls", tp=2, pp=2),
    Case("vit", pp=2, dp=2, data_parallel="fsdp"),
    Case("bert-mlm", pp=2, dp=2, data_parallel="zero1", schedule="GPipe"),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_any_model_trains_like_one_process(case):
    check(case)


@pytest.mark.full_matrix
@pytest.mark.parametrize("case", MORE, ids=str)
def test_any_model_trains_like_one_process_everywhere(case):
    check(case)


# ---- one process ---------------------------------------------------------------------------------


def test_one_process_counts_labels_over_the_step():
    """World size 1: the masked LM's step over two micro-batches that mask different numbers
    of tokens is the step over their concatenation (every label weighs alike), while a mean
    loss averages the two micro-batch means."""
    batches = _batches("bert-mlm", 2)
    assert int((batches[0]["labels"] != -100).sum()) != int((batches[1]["labels"] != -100).sum())
    whole = {k: torch.cat([b[k] for b in batches]) for k in batches[0]}
    model = _model("bert-mlm")
    split = Trainer(copy.deepcopy(model), _optimizer, loss_fn=masked_lm_loss)
    joined = Trainer(copy.deepcopy(model), _optimizer, loss_fn=masked_lm_loss)
    assert split.step(batches) == pytest.approx(joined.step([whole]), rel=1e-6)
    for (name, a), b in zip(split.model.named_parameters(), joined.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=name)

    def mean_loss(output, batch):
        logits = output.logits.flatten(0, 1)
        return F.cross_entropy(logits, batch["labels"].flatten())

    means = Trainer(copy.deepcopy(model), _optimizer, loss_fn=mean_loss)
    with torch.no_grad():
        inputs = [{k: v for k, v in b.items() if k != "labels"} for b in batches]
        want = sum(mean_loss(model(**x), b).item() for x, b in zip(inputs, batches)) / 2
    assert means.step(batches) == pytest.approx(want, rel=1e-6)
    assert means.last_step_tokens == sum(b["input_ids"].numel() for b in batches)


class _Regression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x, labels=None):
        y = self.linear(x).squeeze(-1)
        return {"y": y, "loss": None if labels is None else F.mse_loss(y, labels)}


def test_bad_input_is_refused_by_name():
    model = _model("bert-cls")
    batch = _batches("bert-cls", 1)[0]
    with pytest.raises(ValueError, match=r"loss_fn must be a callable .*got 'mean'"):
        Trainer(model, loss_fn="mean")
    with pytest.raises(ValueError, match=r"a dict micro-batch trains with Trainer\(loss_fn"):
        Trainer(model).step([batch])
    trainer = Trainer(model, loss_fn="model")
    with pytest.raises(ValueError, match=r"got one dict; pass \[batch\]"):
        trainer.step(batch)
    plain = Trainer(_Regression(), loss_fn="model")  # a forward without **kwargs
    with pytest.raises(ValueError, match=r"forward takes no \['weights'\].*loss_fn='model'"):
        plain.step([{"x": torch.ones(2, 4), "labels": torch.ones(2), "weights": torch.ones(2)}])
    unlabelled = {k: v for k, v in batch.items() if k != "labels"}
    with pytest.raises(ValueError, match=r"output \(SequenceClassifierOutput\) has no loss"):
        trainer.step([unlabelled])
    per_row = Trainer(
        model, loss_fn=lambda out, b: F.cross_entropy(out.logits, b["labels"], reduction="none")
    )
    with pytest.raises(
        ValueError, match=r"loss_fn must return a scalar tensor \(0-dim\), got \(3,\)"
    ):
        per_row.step([batch])
    counted = Trainer(model, loss_fn=masked_lm_loss)
    with pytest.raises(ValueError, match=r"num_items_in_batch.*no 'labels' tensor"):
        counted.step([unlabelled])


def _refused_with_pipelining():
    state = tp_ext.init_parallel(tp=1, pp=2)
    with pytest.raises(ValueError, match=r"at pp=2 trains an encoder's pipeline stages .*pp=1"):
        Trainer(_model("bert-cls"), parallel=state, loss_fn="model")
    staged = tp_ext.parallelize(_model("bert-cls"), "auto", parallel=state)
    with pytest.raises(ValueError, match=r"loss_fn='model' with pipeline stages"):
        Trainer(staged, parallel=state, loss_fn="model")
    with pytest.raises(ValueError, match=r"pass Trainer\(\.\.\., loss_fn=callable"):
        Trainer(staged, parallel=state)
    trainer = Trainer(staged, parallel=state, loss_fn=image_loss)
    batch = _batches("bert-cls", 1)[0]
    typed = {**batch, "token_type_ids": torch.zeros_like(batch["input_ids"])}
    with pytest.raises(ValueError, match=r"under pipelining the model gets 'input_ids'"):
        trainer.step([typed])
    return True


def test_what_pipelining_cannot_run_is_refused_by_name():
    assert run_distributed(_refused_with_pipelining, 2) == [True, True]


# ---- checkpoints ---------------------------------------------------------------------------------


def _fit(case: Case, directory: str, steps: int, stop: int):
    """``fit`` to ``stop`` with a checkpoint every step, then (a new Trainer, resuming from the
    directory) to ``steps``; rank 0's metrics' losses."""
    batches = _batches(case.arch, MICRO * case.dp * steps)
    for until in (stop, steps):
        state, _, trainer = _build(case)
        rank = state.dp_rank
        per_step = [
            batches[(s * case.dp + rank) * MICRO : (s * case.dp + rank + 1) * MICRO]
            for s in range(steps)
        ]
        metrics = f"{directory}/metrics.jsonl"
        trainer.fit(per_step, until, checkpoint_dir=directory, metrics=metrics)
    with open(metrics) as f:
        return [json.loads(line)["loss"] for line in f]


@pytest.mark.parametrize(
    "case",
    [Case("bert-mlm", tp=2), Case("vit", dp=2, data_parallel="fsdp"), Case("vit", pp=2)],
    ids=str,
)
def test_fit_resumes_a_dict_batch_run_bitwise(case, tmp_path):
    straight = run_distributed(_fit, 2, case, str(tmp_path / "straight"), 4, 4)[0]
    resumed = run_distributed(_fit, 2, case, str(tmp_path / "resumed"), 4, 2)[0]
    assert len(straight) == 4 and straight == resumed


def _mine(case: Case, state) -> list:
    """This rank's micro-batches of one global batch of four (a DP rank's share of them)."""
    batches = _batches(case.arch, 4)
    share = len(batches) // case.dp
    return batches[state.dp_rank * share : (state.dp_rank + 1) * share]


def _train_then_save(case: Case, path: str, steps: int):
    state, _, trainer = _build(case)
    losses = [trainer.step(_mine(case, state)) for _ in range(steps)]
    if path:
        trainer.save_checkpoint(path)
    return losses


def _load_then_train(case: Case, path: str):
    state, _, trainer = _build(case)
    trainer.load_checkpoint(path)
    return trainer.step(_mine(case, state))


RESHARDS = [
    (Case("bert-mlm", tp=2), Case("bert-mlm", dp=2, data_parallel="fsdp")),
    (Case("bert-mlm", pp=2), Case("bert-mlm", tp=2)),  # the tied copies back into one weight
]


@pytest.mark.parametrize("save, load", RESHARDS, ids=str)
def test_a_checkpoint_reshards_between_layouts(save, load, tmp_path):
    """Saved after two steps, loaded at other dims: its third step's loss is the one of a run
    that never stopped (the masked LM's loss counts every label of the step alike, so the same
    four micro-batches give the same step however they are spread)."""
    path = str(tmp_path / "ckpt")
    straight = run_distributed(_train_then_save, 2, save, "", 3)[0]
    run_distributed(_train_then_save, 2, save, path, 2)
    resumed = run_distributed(_load_then_train, 2, load, path)
    assert resumed[0] == resumed[1]
    assert resumed[0] == pytest.approx(straight[2], rel=1e-5)
