"""``tp-ext train --model DIR_OR_CONFIG``: any transformers decoder parallelize("auto") converts,
trained by the command with no job config (or a job config whose ``model:`` names it): from a
config alone (random weights equal at all dims), or from a checkpoint directory (each rank
reading its slices), with checkpoints that resume and a merged export transformers loads."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import subprocess
import sys

import pytest
import torch
import transformers

from tp_ext.cli import main
from tp_ext.data import TokenBatches, TokenFile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = dict(
    vocab_size=300,
    hidden_size=48,
    intermediate_size=44,
    num_hidden_layers=4,
    num_attention_heads=6,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def _model_dir(tmp_path, weights: bool) -> str:
    path = str(tmp_path / ("checkpoint" if weights else "config-only"))
    config = transformers.LlamaConfig(**CONFIG)
    if weights:
        torch.manual_seed(7)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    else:
        config.save_pretrained(path)
    return path


def _train_here(*argv) -> str:
    """`tp-ext train` in this process (one rank, as outside torchrun); its stderr."""
    with contextlib.redirect_stderr(io.StringIO()) as err:
        assert main(["train", *map(str, argv)]) == 0, err.getvalue()[-4000:]
    return err.getvalue()


def _losses(directory) -> list[float]:
    with open(os.path.join(directory, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f]


def test_from_a_config_trains_resumes_and_exports(tmp_path, tokens):
    model = _model_dir(tmp_path, weights=False)
    run = ["--model", model, "--data", tokens, "--save-every", "2"]
    _train_here(*run, "--steps", "4", "--checkpoint-dir", tmp_path / "straight")
    _train_here(*run, "--steps", "2", "--checkpoint-dir", tmp_path / "stopped")
    err = _train_here(*run, "--steps", "4", "--checkpoint-dir", tmp_path / "stopped", "--resume")
    assert "resumed from" in err
    straight = _losses(tmp_path / "straight")
    assert straight == _losses(tmp_path / "stopped"), "resumed = straight, bitwise"
    assert abs(straight[0] - math.log(300)) < 0.1  # transformers' initial scale: a uniform guess
    assert straight[-1] < straight[0]
    # the export: a checkpoint transformers loads, every tensor in place and trained
    export = tmp_path / "straight" / "export"
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        export, output_loading_info=True
    )
    assert type(loaded).__name__ == "LlamaForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"]
    torch.manual_seed(1234)  # the job's seed: the initial weights
    initial = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**CONFIG))
    for name, tensor in initial.state_dict().items():
        assert not torch.equal(tensor, loaded.state_dict()[name]) or "norm" in name, name


def _expected_first_loss(model_dir, tokens) -> float:
    """The loaded checkpoint's loss on the job's first batch, by transformers alone."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    batches = TokenBatches(
        TokenFile(tokens, "uint16"),
        seq_len=16,
        global_batch=4,
        micro_batch_size=2,
        dp_rank=0,
        dp_size=1,
        seed=1234,
        vocab_size=300,
    )
    micro = next(iter(batches))
    with torch.no_grad():
        losses = [model(ids, labels=ids).loss for ids in micro]
    return float(torch.stack(losses).mean())


def _build_from_checkpoint(path, tp, pp):
    """(the peak bytes of tensors alive while this rank builds and loads its part, what that
    part holds, its logits on a few tokens)."""
    import tp_ext
    from tp_ext.debug.memory import PeakMemory
    from tp_ext.models.hf.source import HFModelSource

    state = tp_ext.init_parallel(tp=tp, pp=pp)
    source = HFModelSource.from_path(path)
    # the first build also traces a narrow copy of the architecture for the plan (a fixed few
    # hundred KB, the size of this test's model): measured on the second
    source.build_and_load(state, dtype=torch.float32, seed=0)
    with PeakMemory() as memory:
        model, report = source.build_and_load(state, dtype=torch.float32, seed=0)
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    ids = torch.arange(12).view(2, 6) * 7 % CONFIG["vocab_size"]
    with torch.no_grad():
        logits = model(ids)
    return memory.peak, held, getattr(logits, "logits", logits), report.get("read_whole", False)


def test_a_checkpoint_build_never_holds_the_whole_model(tmp_path):
    """From a checkpoint directory at tp=2 x pp=2 each rank builds its part on the meta device
    and allocates only its shards, which its slices fill (one tensor read at a time): the
    logits of transformers' model, and no rank's peak near the whole model's bytes."""
    from .dist_utils import run_distributed

    path = _model_dir(tmp_path, weights=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    ids = torch.arange(12).view(2, 6) * 7 % CONFIG["vocab_size"]
    with torch.no_grad():
        expected = model(ids).logits
    for peak, held, logits, read_whole in run_distributed(_build_from_checkpoint, 4, path, 2, 2):
        assert not read_whole
        assert held <= peak <= held + largest + 4096, (held, peak, largest)
        assert peak < 0.6 * whole, (peak, whole)
        torch.testing.assert_close(logits, expected)


def _norm_grads_from_checkpoint(path):
    """The gradients of the replicated norm weights of the model built from ``path`` at tp=2
    (per-head q/k norms included, whose gradients parallelize sums over TP by hooks)."""
    import tp_ext
    from tp_ext.models.hf.source import HFModelSource

    state = tp_ext.init_parallel(tp=2)
    model, _ = HFModelSource.from_path(path).build_and_load(state, dtype=torch.float32, seed=0)
    ids = torch.arange(12).view(2, 6) * 7 % CONFIG["vocab_size"]
    model(ids, labels=ids).loss.backward()
    return {n: p.grad for n, p in model.named_parameters() if "norm" in n}


def test_a_checkpoint_build_keeps_the_gradient_hooks(tmp_path):
    """Qwen3 from a checkpoint at tp=2 (built on the meta device, then materialised): every
    norm's gradient, q_norm and k_norm included, is the unsharded model's."""
    from .dist_utils import run_distributed

    path = str(tmp_path / "qwen3")
    torch.manual_seed(7)
    reference = transformers.AutoModelForCausalLM.from_config(
        transformers.Qwen3Config(**CONFIG, head_dim=8)
    )
    reference.save_pretrained(path)
    ids = torch.arange(12).view(2, 6) * 7 % CONFIG["vocab_size"]
    reference(ids, labels=ids).loss.backward()
    expected = {n: p.grad for n, p in reference.named_parameters() if "norm" in n}
    for grads in run_distributed(_norm_grads_from_checkpoint, 2, path):
        assert sorted(grads) == sorted(expected) and any("q_norm" in n for n in grads)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-6, msg=name)


def test_a_job_config_naming_a_checkpoint_loads_its_weights(tmp_path, tokens):
    model = _model_dir(tmp_path, weights=True)
    job = tmp_path / "job.yaml"
    job.write_text(
        "model: checkpoint\n"  # relative to the job file
        f"data: {{path: {tokens}, seq_len: 16, global_batch: 4, micro_batch_size: 2}}\n"
    )
    _train_here(job, "--steps", "1", "--checkpoint-dir", tmp_path / "run")
    first = _losses(tmp_path / "run")[0]
    assert abs(first - _expected_first_loss(model, tokens)) < 1e-5


def _torchrun(nproc, *argv) -> str:
    """`tp-ext train` under torchrun on ``nproc`` ranks; its stderr."""
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         str(nproc), "-m", "tp_ext", "train", *map(str, argv)],
        capture_output=True, text=True, timeout=400, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stderr


@pytest.mark.full_matrix
def test_all_dims_train_the_same_model(tmp_path, tokens):
    """From a config alone: tp=2 x pp=2 under torchrun equals one rank (losses and the export
    within 1e-5): the random weights are equal at all dims."""
    model = _model_dir(tmp_path, weights=False)
    run = ["--model", model, "--data", tokens, "--steps", "3"]
    _train_here(*run, "--checkpoint-dir", tmp_path / "one")
    _torchrun(4, *run, "--checkpoint-dir", tmp_path / "four", "--tp", "2", "--pp", "2")
    _same_run(tmp_path / "one", tmp_path / "four", 3)


MOE = dict(CONFIG, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2)


def _mixtral_dir(tmp_path) -> str:
    path = str(tmp_path / "mixtral")
    transformers.MixtralConfig(**MOE).save_pretrained(path)
    return path


def _same_exports(a, b) -> None:
    one = transformers.AutoModelForCausalLM.from_pretrained(a)
    other = transformers.AutoModelForCausalLM.from_pretrained(b)
    for name, tensor in one.state_dict().items():
        torch.testing.assert_close(other.state_dict()[name], tensor, rtol=1e-4, atol=1e-5)


def _same_run(one, other, steps: int) -> None:
    """Two checkpoint directories' runs: the same ``steps`` losses (1e-5) and exports."""
    losses, others = _losses(one), _losses(other)
    assert len(losses) == len(others) == steps
    for a, b in zip(losses, others):
        assert abs(a - b) < 1e-5 * abs(a)
    _same_exports(one / "export", other / "export")


# make test: straight through (the EP checkpoint is saved, as every run's last step); test-all:
# stopped at step 2 and resumed too
@pytest.mark.parametrize("resume", [False, pytest.param(True, marks=pytest.mark.full_matrix)])
def test_expert_parallel_trains_and_exports_like_one_rank(tmp_path, tokens, resume):
    """Mixtral from a config with --dp 2 --ep 2 (each rank two of the four experts): the losses
    and the export of one rank."""
    model = _mixtral_dir(tmp_path)
    run = ["--model", model, "--data", tokens, "--save-every", "2"]
    _train_here(*run, "--steps", "3", "--checkpoint-dir", tmp_path / "one")
    ep = [*run, "--checkpoint-dir", tmp_path / "ep", "--dp", "2", "--ep", "2"]
    if resume:
        _torchrun(2, *ep, "--steps", "2")
    err = _torchrun(2, *ep, "--steps", "3", *(["--resume"] if resume else []))
    if resume:  # the message names every degree the checkpoint was saved at
        assert "(step 2, saved at tp=1 pp=1 dp=2 ep=2)" in err, err[-3000:]
    _same_run(tmp_path / "one", tmp_path / "ep", 3)


@pytest.mark.full_matrix
def test_expert_parallel_with_tensor_parallel_trains_like_one_rank(tmp_path, tokens):
    """tp=2 x dp=2 x ep=2 (experts split over TP inside each EP rank) equals one rank."""
    model = _mixtral_dir(tmp_path)
    run = ["--model", model, "--data", tokens, "--steps", "2"]
    _train_here(*run, "--checkpoint-dir", tmp_path / "one")
    _torchrun(4, *run, "--checkpoint-dir", tmp_path / "four", "--tp", "2", "--dp", "2", "--ep", "2")
    _same_run(tmp_path / "one", tmp_path / "four", 2)


@pytest.mark.full_matrix
def test_expert_parallel_inside_pipeline_stages_trains_like_one_rank(tmp_path, tokens):
    """pp=2 x dp=2 x ep=2 (each stage's experts over two ranks) for two steps, resumed from its
    checkpoint at pp=1 x dp=2 x ep=2 for a third: one rank's losses and export."""
    model = _mixtral_dir(tmp_path)
    run = ["--model", model, "--data", tokens, "--save-every", "2"]
    _train_here(*run, "--steps", "3", "--checkpoint-dir", tmp_path / "one")
    staged = [*run, "--checkpoint-dir", tmp_path / "ep"]
    _torchrun(4, *staged, "--steps", "2", "--pp", "2", "--dp", "2", "--ep", "2")
    err = _torchrun(2, *staged, "--steps", "3", "--dp", "2", "--ep", "2", "--resume")
    assert "(step 2, saved at tp=1 pp=2 dp=2 ep=2)" in err, err[-3000:]
    _same_run(tmp_path / "one", tmp_path / "ep", 3)


@pytest.mark.parametrize(
    "moe,world,flags,message",
    [
        (False, 2, ["--dp", "2", "--ep", "2"], "--ep 2: Llama has no experts to split"),
        (True, 3, ["--dp", "3", "--ep", "2"], "--ep=2 does not fit a pipeline stage of dp=3"),
        (True, 8, ["--dp", "8", "--ep", "8"], "--ep 8: more expert ranks than Mixtral's 4 experts"),
    ],
)
def test_bad_expert_parallel_is_refused_by_name(
    tmp_path, tokens, monkeypatch, moe, world, flags, message
):
    """Checked before any process group starts (WORLD_SIZE as torchrun would set it)."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    model = _mixtral_dir(tmp_path) if moe else _model_dir(tmp_path, weights=False)
    argv = ["train", "--model", model, "--data", tokens, "--steps", "1", *flags]
    with contextlib.redirect_stderr(io.StringIO()) as err:
        assert main([*map(str, argv), "--checkpoint-dir", str(tmp_path / "x")]) == 2
    assert message in err.getvalue(), err.getvalue()


def test_context_parallel_trains_a_transformers_model_like_one_rank(tmp_path, tokens):
    """`tp-ext train --model DIR --cp 2` (a Llama checkpoint, each 30-token sequence over 2 ranks
    by all-to-all): the losses and the export of one rank."""
    model = _model_dir(tmp_path, weights=True)
    run = ["--model", model, "--data", tokens, "--steps", "2", "--seq-len", "30"]
    _train_here(*run, "--checkpoint-dir", tmp_path / "one")
    flags = ["--tp", "1", "--cp", "2", "--cp-mode", "all_to_all"]
    _torchrun(2, *run, "--checkpoint-dir", tmp_path / "cp", *flags)
    _same_run(tmp_path / "one", tmp_path / "cp", 2)


@pytest.mark.full_matrix  # make test: the native model's checkpoints across CP (test_context)
def test_a_context_parallel_checkpoint_resumes_at_other_dims(tmp_path, tokens):
    """`tp-ext train --model DIR --cp 2` stopped after 2 steps (its checkpoint saved) and
    resumed with --dp 2 instead: the 3rd step's loss and the export equal one rank's straight
    run (the CP ranks hold the same parameters; the checkpoint reshards like any other)."""
    model = _model_dir(tmp_path, weights=False)
    run = ["--model", model, "--data", tokens, "--save-every", "2", "--seq-len", "30"]
    _train_here(*run, "--steps", "3", "--checkpoint-dir", tmp_path / "one")
    stopped = tmp_path / "stopped"
    _torchrun(2, *run, "--steps", "2", "--checkpoint-dir", stopped, "--tp", "1", "--cp", "2")
    err = _torchrun(2, *run, "--steps", "3", "--checkpoint-dir", stopped, "--resume",
                    "--tp", "1", "--dp", "2")  # fmt: skip
    assert "resumed from" in err
    _same_run(tmp_path / "one", stopped, 3)


@pytest.mark.full_matrix
def test_context_parallel_inside_pipeline_stages_trains_like_one_rank(tmp_path, tokens):
    """`tp-ext train --model DIR --pp 2 --cp 2` (4 ranks, ring): the losses and export of one."""
    model = _model_dir(tmp_path, weights=False)
    run = ["--model", model, "--data", tokens, "--steps", "2", "--seq-len", "30"]
    _train_here(*run, "--checkpoint-dir", tmp_path / "one")
    flags = ["--tp", "1", "--pp", "2", "--cp", "2"]
    _torchrun(4, *run, "--checkpoint-dir", tmp_path / "ppcp", *flags)
    _same_run(tmp_path / "one", tmp_path / "ppcp", 2)


@pytest.mark.full_matrix
def test_expert_and_context_parallel_train_like_one_rank(tmp_path, tokens):
    """Mixtral from a config with --cp 2 --dp 2 --ep 2: the losses and the export of one rank."""
    model = _mixtral_dir(tmp_path)
    run = ["--model", model, "--data", tokens, "--steps", "2", "--seq-len", "30"]
    _train_here(*run, "--checkpoint-dir", tmp_path / "one")
    flags = ["--tp", "1", "--cp", "2", "--dp", "2", "--ep", "2"]
    _torchrun(4, *run, "--checkpoint-dir", tmp_path / "cpep", *flags)
    _same_run(tmp_path / "one", tmp_path / "cpep", 2)


def test_context_parallel_refuses_other_architectures_by_name(tmp_path, tokens, monkeypatch):
    """Checked before any process group starts (WORLD_SIZE as torchrun would set it)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    path = str(tmp_path / "gemma")
    transformers.GemmaConfig(**CONFIG, head_dim=8).save_pretrained(path)
    argv = ["train", "--model", path, "--data", tokens, "--steps", "1", "--cp", "2"]
    argv += ["--tp", "1", "--checkpoint-dir", str(tmp_path / "out")]
    with contextlib.redirect_stderr(io.StringIO()) as out:
        assert main(argv) == 2
    err = out.getvalue()
    assert "--cp 2: context parallelism runs transformers' qwen2, llama, mistral, qwen3" in err
    assert "this model is 'gemma'" in err, err
