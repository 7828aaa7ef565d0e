"""Trainer checkpoints: model, optimizer state, LR schedule, loss scale, step, data position and
random streams, saved at one (tp, pp, dp) and resumed at the same (losses bitwise those of the
uninterrupted run, dropout included) or another (within 1e-5 relative: only reduction order
differs); asynchronous saves; a rank SIGKILLed during a save, an asynchronous save or a load
leaves the last committed checkpoint loadable; clear errors for what cannot be restored.

``make test`` runs a subset covering every path; ``make test-all`` (``--full-matrix``) adds the
other pairs of dims.
"""

from __future__ import annotations

import json
import os
import re
import signal

import pytest
import torch

from tp_ext.checkpoint import MANIFEST, CheckpointError, complete_checkpoint, load_sharded
from tp_ext.data import TokenBatches, TokenFile, write_token_file
from tp_ext.models import Qwen2ForCausalLM
from tp_ext.training import Trainer, build_optimizer

from .dist_utils import launch_once, run_distributed
from .test_pipeline import MAX_NORM, MICRO_BATCH, SEQ, _build, _config

STEPS, SAVE_AT = 5, 2
GLOBAL_MICRO_BATCHES = 6  # micro-batches per step over every DP rank (1, 2 and 3 divide it)
RTOL = 1e-5


TOKEN_SEED = 3


def _tokens(checkpoint: str) -> str:
    """The token file of a test: next to its checkpoint, written once by the test process
    (random ids over the test model's vocabulary)."""
    path = os.path.join(os.path.dirname(checkpoint), "tokens.bin")
    if not os.path.exists(path) and not torch.distributed.is_initialized():
        ids = torch.randint(
            0, _config(4, False).vocab_size, (4000,), generator=torch.Generator().manual_seed(1)
        )
        write_token_file(path, ids)
    return path


def _batches(checkpoint: str, dp_rank: int, dp: int, vocab: int) -> TokenBatches:
    """Step s is the same GLOBAL_MICRO_BATCHES micro-batches whatever the DP degree (what
    resharding relies on); DP rank r takes its share."""
    return TokenBatches(
        TokenFile(_tokens(checkpoint)),
        seq_len=SEQ,
        global_batch=GLOBAL_MICRO_BATCHES * MICRO_BATCH,
        micro_batch_size=MICRO_BATCH,
        dp_rank=dp_rank,
        dp_size=dp,
        seed=TOKEN_SEED,
        vocab_size=vocab,
    )


def _optimizer(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, eps=1e-6)


def _warmup(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))


def _trainer(
    checkpoint, dims, schedule="1F1B", data_parallel="ddp", dropout=0.0, tie=False, **kwargs
):
    tp, pp, dp = dims
    config = _config(4, tie, dropout)
    state, model = _build(config, tp, pp, dp, schedule)
    torch.manual_seed(11)  # dropout's streams, the same at all dims
    import tp_ext

    tp_ext.random.manual_seed(11)
    return Trainer(
        model,
        optimizer=kwargs.pop("optimizer", _optimizer),
        parallel=state,
        schedule=schedule,
        max_grad_norm=MAX_NORM,
        data_parallel=data_parallel,
        lr_scheduler=_warmup,
        data=_batches(checkpoint, state.dp_rank, dp, config.vocab_size),
        **kwargs,
    )


def _train(
    dims,
    schedule="1F1B",
    data_parallel="ddp",
    dropout=0.0,
    tie=False,
    *,
    save=None,
    async_save=False,
    load=None,
    steps=STEPS,
    **kwargs,
):
    """Losses and norms per step of a run that saves at SAVE_AT (``save``) or starts from a
    checkpoint (``load``)."""
    trainer = _trainer(save or load, dims, schedule, data_parallel, dropout, tie, **kwargs)
    if load is not None:
        info = trainer.load_checkpoint(load)
        assert info["step"] == trainer.steps == SAVE_AT
    losses, norms = {}, {}
    while trainer.steps < steps:
        step = trainer.steps + 1
        losses[step] = trainer.step(next(trainer.data))
        norms[step] = trainer.last_grad_norm
        if save is not None and trainer.steps == SAVE_AT:
            trainer.save_checkpoint(save, async_save=async_save)
    trainer.wait_for_checkpoint()
    return losses, norms


def _world(dims) -> int:
    return dims[0] * dims[1] * dims[2]


def _run(dims, *args, **kwargs):
    _tokens(kwargs.get("save") or kwargs["load"])
    results = run_distributed(_train, _world(dims), dims, *args, timeout=300, **kwargs)
    for rank, result in enumerate(results):
        assert result == results[0], f"rank {rank}'s losses differ from rank 0's"
    return results[0]


# ---- the same dims: bitwise ---------------------------------------------------------------------

SAME = [
    # dims, schedule, data parallel, dropout, tied, async
    ((1, 1, 1), "1F1B", "ddp", 0.1, True, False),
    ((2, 2, 1), "1F1B", "ddp", 0.1, True, True),  # TP streams, tied across stages
    ((1, 2, 2), "1F1B", "fsdp", 0.1, False, True),  # FSDP2's sharded optimizer state
    ((1, 2, 1), "Interleaved1F1B", "ddp", 0.1, False, False),
    ((1, 1, 3), "1F1B", "ddp", 0.1, False, False),  # DDP's re-bucketing, 3 ranks
    ((1, 2, 1), "ZBVZeroBubble", "ddp", 0.1, True, True),  # both tied copies on rank 0
]
SAME_FULL = [
    ((3, 1, 1), "1F1B", "ddp", 0.1, False, True),
    ((1, 2, 2), "1F1B", "ddp", 0.1, True, False),
    ((2, 2, 2), "GPipe", "fsdp", 0.1, False, False),
]


def _same_dims(tmp_path, dims, schedule, data_parallel, dropout, tie, async_save, **kwargs):
    path = str(tmp_path / "ckpt")
    args = (dims, schedule, data_parallel, dropout, tie)
    losses, norms = _run(*args, save=path, async_save=async_save, **kwargs)
    assert complete_checkpoint(path)
    resumed, resumed_norms = _run(*args, load=path, **kwargs)
    assert sorted(resumed) == list(range(SAVE_AT + 1, STEPS + 1))
    for step, loss in resumed.items():
        assert loss == losses[step], f"step {step}: {loss!r} != {losses[step]!r} (bitwise)"
        assert resumed_norms[step] == norms[step], f"step {step}'s gradient norm differs"


@pytest.mark.parametrize("case", SAME, ids=str)
def test_resume_at_the_same_dims_is_bitwise(tmp_path, case):
    _same_dims(tmp_path, *case)


@pytest.mark.full_matrix
@pytest.mark.parametrize("case", SAME_FULL, ids=str)
def test_resume_at_the_same_dims_is_bitwise_full(tmp_path, case):
    _same_dims(tmp_path, *case)


def test_the_loss_scale_is_restored(tmp_path):
    """fp16 autocast: the dynamic loss scale (and its growth tracker) continue where they were;
    another scale rounds the fp16 gradients differently, so the losses would not be bitwise."""
    _same_dims(tmp_path, (1, 2, 1), "1F1B", "ddp", 0.0, False, False, autocast_dtype=torch.float16)


def _train_1d(path: str, load: bool):
    """The Trainer without a pipeline: a TP model with a DP group (tp=2, dp=2)."""
    import tp_ext

    from .test_training import OPTIMIZER, _model

    state = tp_ext.init_parallel(tp=2, dp=2)
    model, _ = _model(state.tp_group)
    trainer = Trainer(
        model,
        build_optimizer(model, OPTIMIZER),
        max_grad_norm=MAX_NORM,
        dp_group=state.dp_group,
        lr_scheduler=_warmup,
        data=_batches(path, state.dp_rank, 2, model.config.vocab_size),
    )
    if load:
        trainer.load_checkpoint(path)
        fresh, _ = _model(state.tp_group)
        load_sharded(fresh, path)  # a training checkpoint's model, read alone
        assert all(
            torch.equal(a, b)
            for a, b in zip(fresh.state_dict().values(), model.state_dict().values())
        )
    losses = {}
    while trainer.steps < STEPS:
        step = trainer.steps + 1
        losses[step] = trainer.step(next(trainer.data))
        if not load and trainer.steps == SAVE_AT:
            trainer.save_checkpoint(path)
    return losses


def test_resume_without_a_pipeline(tmp_path):
    path = str(tmp_path / "ckpt")
    _tokens(path)
    losses = run_distributed(_train_1d, 4, path, False)[0]
    resumed = run_distributed(_train_1d, 4, path, True)[0]
    assert resumed == {s: losses[s] for s in range(SAVE_AT + 1, STEPS + 1)}


# ---- other dims: within 1e-5 --------------------------------------------------------------------

# saved at, data parallel there, resumed at
RESHARD = [
    ((2, 2, 2), "fsdp", [(1, 1, 1), (4, 1, 2), (1, 4, 1)]),
    ((1, 2, 1), "ddp", [(3, 1, 1), (1, 1, 3)]),  # uneven TP; tied across stages into one
]
RESHARD_FULL = [
    ((1, 1, 1), "ddp", [(2, 2, 2), (1, 2, 2), (3, 1, 1)]),
    ((3, 1, 1), "ddp", [(1, 2, 2), (2, 1, 2)]),
    ((2, 2, 2), "ddp", [(1, 2, 1)]),
]


def _reshard(tmp_path, saved_at, data_parallel, resumed_at, tie):
    path = str(tmp_path / "ckpt")
    losses, norms = _run(saved_at, "1F1B", data_parallel, 0.0, tie, save=path)
    for dims in resumed_at:
        kind = data_parallel if dims[2] > 1 else "ddp"
        resumed, resumed_norms = _run(dims, "1F1B", kind, 0.0, tie, load=path)
        assert sorted(resumed) == list(range(SAVE_AT + 1, STEPS + 1))
        torch.testing.assert_close(
            [resumed[s] for s in sorted(resumed)],
            [losses[s] for s in sorted(resumed)],
            rtol=RTOL,
            atol=0,
            msg=lambda m, dims=dims: f"resumed at {dims}: {m}",
        )
        torch.testing.assert_close(
            [resumed_norms[s] for s in sorted(resumed)],
            [norms[s] for s in sorted(resumed)],
            rtol=RTOL,
            atol=0,
        )


@pytest.mark.parametrize("case", RESHARD, ids=str)
def test_resume_at_other_dims(tmp_path, case):
    saved_at, data_parallel, resumed_at = case
    _reshard(tmp_path, saved_at, data_parallel, resumed_at, tie=saved_at[1] > 1)


@pytest.mark.full_matrix
@pytest.mark.parametrize("case", RESHARD_FULL, ids=str)
def test_resume_at_other_dims_full(tmp_path, case):
    saved_at, data_parallel, resumed_at = case
    _reshard(tmp_path, saved_at, data_parallel, resumed_at, tie=True)


# ---- a rank killed during a save, an asynchronous save or a load --------------------------------

KILL_DIMS = (1, 2, 1)


def _die_after(cls, method: str) -> None:
    """Rank 1 SIGKILLs itself once ``cls.method`` has run (its files written or read)."""
    original = getattr(cls, method)

    def dying(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if torch.distributed.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    setattr(cls, method, dying)


def _killed(path: str, where: str):
    """Train to step 4 with a committed save at step 2, then die (rank 1) in the middle of
    ``where``: a save of step 4 over the same path, an asynchronous one, or a load."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter

    trainer = _trainer(path, KILL_DIMS, dropout=0.1)
    for _ in range(SAVE_AT):
        trainer.step(next(trainer.data))
    trainer.save_checkpoint(path)
    if where == "load":
        _die_after(HuggingFaceStorageReader, "read_data")
        trainer.load_checkpoint(path)
    for _ in range(2):
        trainer.step(next(trainer.data))
    _die_after(HuggingFaceStorageWriter, "write_data")  # in DCP's writer thread when async
    trainer.save_checkpoint(path, async_save=where == "async save")
    for _ in range(20):  # training goes on while an asynchronous save is written
        trainer.step(next(trainer.data))
    trainer.wait_for_checkpoint()


# a rank killed in a load (11 s) in `make test-all`: faults/test_faults kills one mid-load in
# `make test`, and the Trainer loads through the same tp_ext.checkpoint path
@pytest.mark.parametrize(
    "where", ["save", "async save", pytest.param("load", marks=pytest.mark.full_matrix)]
)
def test_a_rank_killed_mid_checkpoint_leaves_the_last_committed_one(tmp_path, where):
    path = str(tmp_path / "ckpt")
    _tokens(path)
    outcome, report = launch_once(_killed, _world(KILL_DIMS), path, where, timeout=120)
    assert outcome[1] == (False, "process died (exit code -9)"), report
    assert outcome[0][0] is False, f"rank 0 went on without rank 1:\n{report}"
    directory = complete_checkpoint(path)  # the save of step 2, complete
    assert json.load(open(os.path.join(directory, MANIFEST)))["step"] == SAVE_AT
    losses, _ = _run(KILL_DIMS, "1F1B", "ddp", 0.1, save=str(tmp_path / "reference"))
    resumed, _ = _run(KILL_DIMS, "1F1B", "ddp", 0.1, load=path)
    assert resumed == {s: losses[s] for s in resumed}, "the resumed run is not bitwise the same"


# ---- what cannot be restored gets a clear error -------------------------------------------------


def _load_with(path: str, change: str):
    trainer = _trainer(path, (1, 1, 1))
    if change == "optimizer":
        trainer = Trainer(
            trainer.model,
            optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
            parallel=trainer.parallel,
        )
    elif change == "no data":
        trainer.data = None
    elif change == "global batch":
        trainer.data = TokenBatches(
            TokenFile(_tokens(path)),
            seq_len=SEQ,
            global_batch=6,
            micro_batch_size=1,
            seed=TOKEN_SEED,
        )
    elif change == "no schedule":
        trainer.lr_scheduler = None
    elif change == "model":
        load_sharded_path = path + "-model"
        from tp_ext.checkpoint import save_sharded

        save_sharded(trainer.model, load_sharded_path)
        path = load_sharded_path
    elif change == "config":
        import tp_ext

        state = tp_ext.init_parallel(tp=1, pp=1, dp=1)
        model = Qwen2ForCausalLM(_config(3, False), parallel=state)
        trainer = Trainer(model, optimizer=_optimizer, parallel=state)
    try:
        trainer.load_checkpoint(path)
    except CheckpointError as e:
        return str(e)
    return None


@pytest.mark.parametrize(
    "change, message",
    [
        ("optimizer", "holds the state of a AdamW optimizer; this Trainer's is a SGD"),
        ("no data", "has data state, and this Trainer was given none"),
        ("no schedule", "has lr_scheduler state, and this Trainer was given none"),
        ("global batch", "has global_batch=12, these batches global_batch=6: it would continue"),
        (
            "model",
            "is a 'tp_ext-dcp-v1' checkpoint, not one of \\['tp_ext-train-v2', "
            "'tp_ext-train-v1'\\]",
        ),
        ("config", "num_hidden_layers=4; this model has num_hidden_layers=3"),
    ],
)
def test_what_cannot_be_restored_is_refused(tmp_path, change, message):
    path = str(tmp_path / "ckpt")
    _run((1, 1, 1), save=path)
    (error,) = run_distributed(_load_with, 1, path, change)
    assert error is not None and re.search(message, error), error


# ---- a Hugging Face model sharded by tp_ext.parallelize (no declared checkpoint map) ------------


def _hf_dense_resumed_unsharded(path):
    """transformers' Qwen2 sharded in place at TP=2: its Trainer checkpoint (saved under the
    model's own names) loads into the unsharded model, and the next step's loss and weights equal
    the TP=2 run's."""
    import transformers

    import tp_ext
    from tp_ext.layers import ResolvedGroup, full_state_dict

    config = transformers.Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip

    def unsharded():
        torch.manual_seed(0)
        return transformers.Qwen2ForCausalLM(config).float()

    def trainer(model, tp_group):
        def sgd(params):
            return torch.optim.SGD(params, lr=0.5, momentum=0.9)

        return Trainer(model, optimizer=sgd, tp_group=tp_group, max_grad_norm=MAX_NORM)

    state = tp_ext.init_parallel(tp=2)
    sharded = tp_ext.parallelize(unsharded(), "auto", tp_group=state.tp_group)
    run = trainer(sharded, state.tp_group)
    seeds = (torch.Generator().manual_seed(s) for s in (1, 2))
    batch = [torch.randint(0, 64, (2, 9), generator=g) for g in seeds]
    run.step([batch[0]])
    run.save_checkpoint(path)
    loss = run.step([batch[1]])
    want = full_state_dict(sharded)

    model = unsharded()
    again = trainer(model, ResolvedGroup.local())
    assert again.load_checkpoint(path)["step"] == 1
    resumed = again.step([batch[1]])
    assert abs(resumed - loss) <= 1e-6 * abs(loss), (resumed, loss)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, want[name], rtol=1e-5, atol=1e-6, msg=name)


def test_hugging_face_model_sharded_by_parallelize_resumes_unsharded(tmp_path):
    run_distributed(_hf_dense_resumed_unsharded, 2, str(tmp_path / "ckpt"))


# ---- the dims in the manifest ---------------------------------------------------------------


def test_the_manifest_records_the_dims_and_a_v1_manifest_still_resumes_bitwise(tmp_path):
    """The manifest holds ``dims`` (ParallelDims.as_dict(): virtual stages included), the
    pipeline ``stages`` and one entry per Stateful part; a checkpoint written by the first
    format (its entries at the top level) resumes at the same dims, its random streams carried
    over (dropout: bitwise)."""
    from tp_ext import ParallelDims

    path = str(tmp_path / "ckpt")
    args = ((1, 2, 1), "Interleaved1F1B", "ddp", 0.1, False)
    losses, _ = _run(*args, save=path)
    with open(os.path.join(path, MANIFEST)) as f:
        info = json.load(f)
    assert info["format"] == "tp_ext-train-v2" and info["step"] == SAVE_AT
    assert info["dims"] == ParallelDims(tp=1, pp=2, dp=1, virtual_stages=2).as_dict()
    assert info["stages"] == {
        "stage_layers": [1, 1, 1, 1],
        "stage_order": "loop",
        "schedule": "Interleaved1F1B",
    }
    assert info["trainer"] == {"steps": SAVE_AT, "skipped_steps": 0, "loss_scale": None}
    assert set(info) >= {"config", "optimizer", "rng", "compression", "lr_scheduler", "data"}
    old = {k: v for k, v in info.items() if k not in ("stages", "trainer", "rng", "compression")}
    old.update(
        format="tp_ext-train-v1",
        layout={**info["stages"], "tp": 1, "pp": 2, "dp": 1, "world": 2},
        master_weights=info["optimizer"].pop("master_weights"),
        cuda_rng_devices=info["rng"]["cuda_devices"],
        gradient_compression=None,
        compression_state=2,
        skipped_steps=0,
        loss_scale=None,
    )
    with open(os.path.join(path, MANIFEST), "w") as f:
        json.dump(old, f)
    resumed, _ = _run(*args, load=path)
    assert resumed == {s: losses[s] for s in range(SAVE_AT + 1, STEPS + 1)}
