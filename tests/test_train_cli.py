"""``tp-ext train``: flags and config sections checked before torch.distributed starts, the LR
schedule, the checkpoint directory (only published checkpoints count), and the command under
torchrun: a run stopped and resumed (``--resume``) equals a straight run bitwise at the same
dims and within 1e-5 at other dims; under ``torchrun --max-restarts 3`` a worker SIGKILLed in the
middle of training is restarted with its group and the whole run's losses equal an uninterrupted
run's, bitwise."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from tp_ext.checkpoint import save_sharded
from tp_ext.cli import main
from tp_ext.models import Qwen2Config, Qwen2ForCausalLM
from tp_ext.training import OptimizerSettings, build_lr_scheduler
from tp_ext.training.checkpointer import (
    keep_newest,
    newest,
    published,
    remove_unpublished,
    step_path,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "train-tiny.yaml")


# ---- flags and config, before torch.distributed -------------------------------------------------


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--steps", "2", "--checkpoint-dir", "{tmp}/c"], "no token file: give --data"),
        (["--steps", "2", "--data", "{tokens}"], "no checkpoint directory: give --checkpoint-dir"),
        (["--steps", "2", "--data", "{tmp}/none.bin", "--checkpoint-dir", "{tmp}/c"], "none.bin"),
        (
            ["--steps", "2", "--data", "{tokens}", "--checkpoint-dir", "{tmp}/c", "--dp", "3"],
            "data.global_batch 8 must be divisible by dp x data.micro_batch_size = 3 x 2 = 6",
        ),
        (
            ["--steps", "2", "--data", "{tokens}", "--checkpoint-dir", "{tmp}/c"]
            + ["--micro-batches", "3"],
            "--micro-batches 3 disagrees with the data section: data.global_batch 8 / "
            r"\(dp 1 x data.micro_batch_size 2\) = 4",
        ),
        (
            ["--steps", "2", "--data", "{tokens}", "--checkpoint-dir", "{tmp}/c", "--pp", "2"]
            + ["--dp", "1", "--schedule", "ZBVZeroBubble"],
            "ZBVZeroBubble' needs virtual_stages=2",
        ),
    ],
)
def test_bad_flags_are_refused_before_anything_starts(
    tmp_path, tokens, flags, message, capsys, monkeypatch
):
    args = [f.format(tmp=tmp_path, tokens=tokens) for f in flags]
    dp = flags[flags.index("--dp") + 1] if "--dp" in flags else "1"
    pp = flags[flags.index("--pp") + 1] if "--pp" in flags else "1"
    monkeypatch.setenv("WORLD_SIZE", str(int(dp) * int(pp)))  # as torchrun would set it
    assert main(["train", TINY, *args]) == 2
    assert re.search(message, capsys.readouterr().err)
    assert not os.path.exists(tmp_path / "c"), "nothing is created for a refused run"


def test_flag_types_are_checked_by_argparse(capsys):
    for flags, says in [
        (["--steps", "0"], "--steps: must be an integer in [1"),
        (["--steps", "3", "--save-every", "0"], "--save-every: must be an integer in [1"),
        (["--steps", "3", "--keep-last", "x"], "--keep-last: must be an integer"),
    ]:
        with pytest.raises(SystemExit) as e:
            main(["train", TINY, *flags])
        assert e.value.code == 2 and says in capsys.readouterr().err


# ---- the learning-rate schedule ------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["constant", "cosine", "linear"])
def test_lr_schedule(schedule):
    settings = OptimizerSettings(
        lr=1e-3, lr_schedule=schedule, warmup_steps=4, min_lr=1e-4, decay_steps=14
    )
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=settings.lr)
    scheduler = build_lr_scheduler(optimizer, settings, total_steps=100)
    lrs = []
    for _ in range(20):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    warmup = [1e-3 * (s + 1) / 4 for s in range(4)]

    def after(step):
        progress = min(1.0, (step - 4) / 10)
        if schedule == "constant":
            return 1e-3
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1 - progress
        return 1e-4 + (1e-3 - 1e-4) * shape

    expected = warmup + [after(s) for s in range(4, 20)]
    assert lrs == pytest.approx(expected, rel=1e-12, abs=0)
    if schedule != "constant":
        assert lrs[14:] == pytest.approx([1e-4] * 6), "flat at min_lr after decay_steps"


def test_lr_settings_errors():
    from tp_ext.validation import ConfigError

    with pytest.raises(ConfigError, match="optimizer.min_lr 0.1 is above optimizer.lr 0.001"):
        OptimizerSettings(lr=1e-3, min_lr=0.1)
    with pytest.raises(ConfigError, match="optimizer.decay_steps 3 must be above"):
        OptimizerSettings(warmup_steps=5, decay_steps=3)
    with pytest.raises(ConfigError, match="optimizer.lr_schedule must be one of constant"):
        OptimizerSettings(lr_schedule="exp")


# ---- the checkpoint directory -------------------------------------------------------------------


def test_only_published_checkpoints_count(tmp_path):
    config = Qwen2Config.from_dict(
        dict(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=16,
            rope_theta=10000.0,
            rms_norm_eps=1e-6,
        )
    )
    model = Qwen2ForCausalLM(config)
    directory = str(tmp_path)
    for step in (2, 4, 6):
        save_sharded(model, step_path(directory, step), step=step)
    # a save killed before it was published: its version directory, no link
    os.makedirs(os.path.join(directory, "step-00000008.versions", "v-x"))
    # a link to a version that lost its manifest
    os.makedirs(os.path.join(directory, "step-00000010.versions", "v-y"))
    os.symlink("step-00000010.versions/v-y", os.path.join(directory, "step-00000010"))
    # a save killed between making its new symlink and swapping it in
    os.symlink("step-00000012.versions/v-z", os.path.join(directory, ".step-00000012.v-z.link"))
    assert [s for s, _ in published(directory)] == [2, 4, 6]
    assert newest(directory) == (6, step_path(directory, 6))
    assert remove_unpublished(directory) == [".step-00000012.v-z.link", "step-00000008.versions"]
    assert keep_newest(directory, 2) == [step_path(directory, 2)]
    assert [s for s, _ in published(directory)] == [4, 6]
    assert sorted(os.listdir(directory)) == [
        "step-00000004",
        "step-00000004.versions",
        "step-00000006",
        "step-00000006.versions",
        "step-00000010",
        "step-00000010.versions",
    ]


# ---- the command under torchrun -----------------------------------------------------------------


def _torchrun(nproc: int, flags: list[str], restarts: int = 0) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", str(nproc), "--max-restarts", str(restarts)]
    return subprocess.Popen(
        [*command, "-m", "tp_ext", "train", TINY, *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=env,
        start_new_session=True,  # a test that times out kills the whole group
    )


def _finish(proc: subprocess.Popen, timeout: float = 300, refused: bool = False) -> str:
    """The run's stderr once it exits: 0, or (``refused``) not 0. A run still going after
    ``timeout`` s is killed with its workers and fails the test with what it printed."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_all(proc)
        out, err = proc.communicate()
        raise AssertionError(f"tp-ext train did not finish in {timeout} s:\n{err[-3000:]}")
    if refused:
        assert proc.returncode != 0, f"expected a refusal, got exit 0:\n{err[-4000:]}"
    else:
        assert proc.returncode == 0, f"exit {proc.returncode}:\n{out[-2000:]}\n{err[-4000:]}"
    return err


def _train(nproc, tokens, directory, steps, *extra, restarts=0, timeout=300) -> str:
    """A run of ``nproc`` ranks under torchrun (``nproc=0``: one rank in this process, as
    ``tp-ext train`` runs outside torchrun, without a worker start); its stderr."""
    flags = ["--data", tokens, "--checkpoint-dir", str(directory), "--steps", str(steps)]
    flags += ["--save-every", "2", *extra]
    if nproc == 0:
        with contextlib.redirect_stderr(io.StringIO()) as err:
            assert main(["train", TINY, *flags]) == 0, err.getvalue()[-4000:]
        return err.getvalue()
    return _finish(_torchrun(nproc, flags, restarts), timeout)


def _metrics(directory) -> dict[int, dict]:
    lines = [json.loads(line) for line in open(os.path.join(directory, "metrics.jsonl"))]
    steps = [entry["step"] for entry in lines]
    assert steps == sorted(set(steps)), f"each step once, in order: {steps}"
    return {entry["step"]: entry for entry in lines}


def _train_here(capsys, *flags) -> tuple[int, str]:
    """`tp-ext train` in this process, as one rank outside torchrun runs it: its exit status and
    what it printed on stderr. An error found once the job started is raised (under torchrun
    the worker prints its traceback and exits 1): here that is status 1 and the message. One
    rank's runs go through here, saving a torchrun and a worker start (seconds each) apiece."""
    capsys.readouterr()
    try:
        status = main(["train", TINY, *flags])
    except ValueError as e:
        return 1, capsys.readouterr().err + str(e)
    return status, capsys.readouterr().err


DIMS = {  # name: (ranks, flags); 0 ranks: one rank in this process
    "here": (0, []),
    "single": (1, []),
    "tp2": (2, ["--tp", "2"]),
    "pp2-dp2": (4, ["--tp", "1", "--pp", "2", "--dp", "2"]),
    "dp2": (2, ["--tp", "1", "--dp", "2"]),
}


# The interrupted runs (stopped and resumed, or a worker killed) train 8 steps, the cosine decay
# running from step 2 to step 8 in every run (a stopped run's --steps 4 would otherwise end it
# at step 4), and must equal the straight run bitwise.
STEPS = 8
SCHEDULE = ["--warmup-steps", "2", "--decay-steps", str(STEPS)]


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory, tokens):
    """The metrics of the uninterrupted run at the given dims, trained once for all the tests that
    compare with it (each run is a torchrun of its own: ~10 s on 2 cores)."""
    runs = {}

    def metrics_of(dims: str) -> dict[int, dict]:
        if dims not in runs:
            nproc, flags = DIMS[dims]
            directory = tmp_path_factory.mktemp(f"straight-{dims}")
            _train(nproc, tokens, directory, STEPS, *flags, *SCHEDULE)
            runs[dims] = _metrics(directory)
        return runs[dims]

    return metrics_of


# `make test` stops and resumes the command in this process (the killed-worker test resumes it
# under torchrun at tp2, and the pipeline's resume is bitwise in Python at all dims:
# test_fit, test_training_state); `make test-all` also under torchrun, at tp2 and pp2 x dp2
@pytest.mark.parametrize(
    "dims",
    ["here"] + [pytest.param(name, marks=pytest.mark.full_matrix) for name in ("tp2", "pp2-dp2")],
)
def test_stop_and_resume_is_the_straight_run_bitwise(tmp_path, tokens, straight_run, dims):
    nproc, flags = DIMS[dims]
    flags = [*flags, *SCHEDULE]
    _train(nproc, tokens, tmp_path / "stopped", 4, *flags, "--async-save")
    err = _train(nproc, tokens, tmp_path / "stopped", STEPS, *flags, "--resume", "--async-save")
    assert "resumed from" in err and "(step 4," in err
    straight, resumed = straight_run(dims), _metrics(tmp_path / "stopped")
    assert sorted(straight) == sorted(resumed) == list(range(1, 9))
    for step in straight:
        assert resumed[step]["loss"] == straight[step]["loss"], f"step {step} (bitwise)"
        assert resumed[step]["grad_norm"] == straight[step]["grad_norm"], f"step {step}"
        assert resumed[step]["lr"] == straight[step]["lr"]
    # it starts at the loss of a uniform guess over the 300 tokens (transformers' initial scale)
    # and learns
    assert abs(straight[1]["loss"] - math.log(300)) < 0.1, straight[1]["loss"]
    assert straight[8]["loss"] < straight[1]["loss"] - 0.5, "it learns"
    assert [s for s, _ in published(str(tmp_path / "stopped"))] == [4, 6, 8], "keep_last 3"


# make test: ZeRO-2 with overlapped gathers through the command (the Trainer's bfloat16 sums are
# in test_zero); make test-all: ZeRO-1 with a bfloat16 gradient sum through it too
@pytest.mark.parametrize(
    "name, extra, tolerance",
    [
        ("zero2", ["--data-parallel", "zero2", "--overlap-param-gather"], 1e-5),
        pytest.param(
            "zero1-bf16",
            ["--data-parallel", "zero1", "--grad-reduce-dtype", "bfloat16"],
            5e-3,
            marks=pytest.mark.full_matrix,
        ),
    ],
)
def test_zero_and_a_bfloat16_gradient_sum_train_as_ddp(
    tmp_path, tokens, straight_run, name, extra, tolerance
):
    """--data-parallel zero2 (its parameter gathers overlapped with the next forward) gives
    DDP's losses; zero1 with --grad-reduce-dtype bfloat16 stays within 0.5% of them."""
    ddp = straight_run("dp2")
    nproc, flags = DIMS["dp2"]
    _train(nproc, tokens, tmp_path / name, STEPS, *flags, *extra, *SCHEDULE)
    got = _metrics(tmp_path / name)
    for step in ddp:
        assert abs(got[step]["loss"] - ddp[step]["loss"]) <= tolerance * ddp[step]["loss"], step


# in `make test-all` (a 4-rank torchrun, 23 s on 2 cores): `make test` resumes the CLI's runs at
# their own dims here, and the Trainer's at other dims in test_training_state
@pytest.mark.full_matrix
def test_resume_at_other_dims(tmp_path, tokens, capsys):
    for name, steps in (("straight", 6), ("moved", 4)):
        flags = ["--data", tokens, "--checkpoint-dir", str(tmp_path / name), "--save-every", "2"]
        assert _train_here(capsys, *flags, "--steps", str(steps))[0] == 0
    _, flags = DIMS["pp2-dp2"]
    err = _train(4, tokens, tmp_path / "moved", 6, *flags, "--resume")
    assert "saved at tp=1 pp=1 dp=1" in err
    straight, moved = _metrics(tmp_path / "straight"), _metrics(tmp_path / "moved")
    for step in (5, 6):
        assert moved[step]["loss"] == pytest.approx(straight[step]["loss"], rel=1e-5, abs=0)


def test_existing_checkpoints_need_resume_and_enough_steps(tmp_path, tokens, capsys):
    flags = ["--data", tokens, "--checkpoint-dir", str(tmp_path)]
    assert _train_here(capsys, *flags, "--steps", "2", "--save-every", "2")[0] == 0
    saved = os.readlink(step_path(str(tmp_path), 2))
    status, err = _train_here(capsys, *flags, "--steps", "4")
    assert status != 0 and "holds checkpoints (the newest after step 2): pass --resume" in err
    assert newest(str(tmp_path)) == (2, step_path(str(tmp_path), 2))
    assert os.readlink(step_path(str(tmp_path), 2)) == saved, "nothing was overwritten"
    status, err = _train_here(capsys, *flags, "--steps", "1", "--resume")
    assert status != 0 and "--steps 1 is below the step of the newest checkpoint" in err
    assert "give --steps 3 or more" in err
    status, err = _train_here(capsys, *flags, "--steps", "2", "--resume")
    assert status == 0 and "already holds the checkpoint after step 2; nothing to train" in err
    # the checkpoint's schedule goes on: another LR is refused, not silently ignored
    status, err = _train_here(capsys, *flags, "--steps", "4", "--resume", "--lr", "1e-3")
    assert status != 0
    assert "the checkpoint's LR schedule differs from this run's: lr 0.003 there, 0.001 here" in err
    assert "give --lr 0.003, or start a new run" in err
    assert sorted(_metrics(tmp_path)) == [1, 2]


# the refusal under torchrun, with a restart (~15 s): torchrun's restart is refused too
@pytest.mark.full_matrix
def test_a_restarted_run_without_resume_is_refused_again(tmp_path, tokens, capsys):
    flags = ["--data", tokens, "--checkpoint-dir", str(tmp_path)]
    assert _train_here(capsys, *flags, "--steps", "2", "--save-every", "2")[0] == 0
    saved = os.readlink(step_path(str(tmp_path), 2))
    err = _finish(_torchrun(1, [*flags, "--steps", "4"], restarts=1), refused=True)
    assert err.count("holds checkpoints (the newest after step 2): pass --resume") == 2, err
    assert os.readlink(step_path(str(tmp_path), 2)) == saved, "nothing was overwritten"


def test_a_resumed_run_keeps_its_lr_schedule(tmp_path, tokens, capsys):
    # cosine after one warmup step, decaying until --steps 2; --steps 4 would move the end
    flags = ["--data", tokens, "--checkpoint-dir", str(tmp_path), "--warmup-steps", "1"]
    assert _train_here(capsys, *flags, "--steps", "2", "--save-every", "2")[0] == 0
    flags += ["--steps", "4", "--resume"]

    def refused(*extra) -> str:
        status, err = _train_here(capsys, *flags, *extra)
        assert status != 0, f"expected a refusal, got exit 0:\n{err[-4000:]}"
        return err

    err = refused()
    assert "decay_end 2 there, 4 here (the decay ends at --steps unless --decay-steps" in err, err
    assert "give --decay-steps 2, or start a new run" in err
    err = refused("--decay-steps", "2", "--lr-schedule", "linear")
    assert "lr_schedule cosine there, linear here" in err and "give --lr-schedule cosine," in err
    err = refused("--lr-schedule", "constant")
    assert "give --lr-schedule cosine --min-lr 0.0003 --decay-steps 2, or" in err, err[-2000:]
    err = refused("--decay-steps", "2", "--min-lr", "1e-4")
    assert "min_lr 0.0003 there, 0.0001 here" in err and "give --min-lr 0.0003," in err
    assert sorted(_metrics(tmp_path)) == [1, 2], "nothing trained by the refused runs"
    # as a checkpoint from before the schedule was saved: only the base lr can be checked
    manifest = os.path.join(step_path(str(tmp_path), 2), "tp_ext_checkpoint.json")
    with open(manifest) as f:
        info = json.load(f)
    info["lr_scheduler"]["lr_lambdas"] = [None] * len(info["lr_scheduler"]["lr_lambdas"])
    with open(manifest, "w") as f:
        json.dump(info, f)
    status, err = _train_here(capsys, *flags, "--decay-steps", "2")
    assert status == 0
    assert "was saved before checkpoints held their LR schedule, so only its base lr" in err
    lrs = {step: entry["lr"] for step, entry in _metrics(tmp_path).items()}
    # the saved schedule: full LR for the warmup step and the decay's first, min_lr after
    assert lrs == pytest.approx({1: 3e-3, 2: 3e-3, 3: 3e-4, 4: 3e-4}, rel=1e-12)


def test_the_lr_schedule_travels_in_the_scheduler_state():
    settings = OptimizerSettings(lr=1e-3, lr_schedule="linear", warmup_steps=2, min_lr=1e-4)
    first = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    saved = build_lr_scheduler(first, settings, total_steps=6)
    for _ in range(3):
        first.step()
        saved.step()
    state = json.loads(json.dumps(saved.state_dict()))  # as in a checkpoint's manifest
    assert state["lr_lambdas"][0]["decay_end"] == 6
    second = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    resumed = build_lr_scheduler(second, settings, total_steps=12)
    resumed.load_state_dict(state)
    assert resumed.lr_lambdas[0].settings() == saved.lr_lambdas[0].settings()
    for _ in range(5):
        saved.step()
        resumed.step()
        assert resumed.get_last_lr() == pytest.approx(saved.get_last_lr(), rel=1e-12)
    assert saved.get_last_lr() == pytest.approx([1e-4]), "flat at min_lr after step 6"


def test_sequences_longer_than_the_model_are_refused(tmp_path, tokens, capsys, monkeypatch):
    import yaml

    with open(TINY) as f:
        config = yaml.safe_load(f)
    config["data"]["seq_len"] = 257
    path = tmp_path / "long.yaml"
    path.write_text(yaml.safe_dump(config))
    monkeypatch.setenv("WORLD_SIZE", "1")
    flags = ["--data", tokens, "--checkpoint-dir", str(tmp_path / "c"), "--steps", "2"]
    assert main(["train", str(path), *flags]) == 2
    assert "data.seq_len 257 is above the model's max_position_embeddings 256" in (
        capsys.readouterr().err
    )
    assert not os.path.exists(tmp_path / "c")


def _workers(torchrun_pid: int) -> list[int]:
    """The worker processes torchrun started (its children running tp_ext)."""
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        parent = int(stat[stat.rindex(")") + 2 :].split()[1])
        if parent == torchrun_pid and b"tp_ext" in cmdline:
            children.append(int(entry))
    return children


def _kill_all(proc: subprocess.Popen) -> None:
    """torchrun and its workers (each in a process group of its own)."""
    for pid in _workers(proc.pid):
        os.kill(pid, signal.SIGKILL)
    os.killpg(proc.pid, signal.SIGKILL)


def _kill_a_worker_after(proc, directory, step: int, timeout: float = 120) -> int:
    deadline = time.monotonic() + timeout
    metrics = os.path.join(directory, "metrics.jsonl")
    while time.monotonic() < deadline:
        if os.path.exists(metrics) and sum(1 for _ in open(metrics)) >= step:
            workers = _workers(proc.pid)
            if workers:
                os.kill(workers[-1], signal.SIGKILL)
                return workers[-1]
        if proc.poll() is not None:
            break
        time.sleep(0.02)
    _kill_all(proc)
    raise AssertionError(f"training never reached step {step}: {proc.communicate()[1][-3000:]}")


# killed after step 3: the restarted group resumes from the checkpoint of step 2 and trains
# steps 3 to 8 again
@pytest.mark.parametrize("dims", ["tp2", pytest.param("pp2-dp2", marks=pytest.mark.full_matrix)])
def test_a_killed_worker_is_restarted_and_the_run_is_bitwise_the_same(
    tmp_path, tokens, straight_run, dims
):
    nproc, flags = DIMS[dims]
    directory = tmp_path / "elastic"
    proc = _torchrun(
        nproc,
        ["--data", tokens, "--checkpoint-dir", str(directory), "--steps", str(STEPS)]
        + ["--save-every", "2", *flags, *SCHEDULE],
        restarts=3,
    )
    _kill_a_worker_after(proc, directory, 3)
    err = _finish(proc)
    assert "resumed from" in err, "the restarted group continued from a checkpoint"
    straight, elastic = straight_run(dims), _metrics(directory)
    assert sorted(elastic) == list(range(1, STEPS + 1))
    assert [elastic[s]["loss"] for s in elastic] == [straight[s]["loss"] for s in elastic]


@pytest.mark.full_matrix  # make test: test_train_hf's CP run covers the command's CP path
def test_context_parallel_training_matches_one_rank(tmp_path, tokens, capsys):
    """`tp-ext train --cp 2` (each sequence's 30 positions over 2 ranks, ring attention) trains
    as one rank does: the same losses, step by step."""
    flags = ["--data", tokens, "--seq-len", "30"]
    one = tmp_path / "one"
    assert _train_here(capsys, *flags, "--steps", "3", "--checkpoint-dir", str(one))[0] == 0
    _train(2, tokens, tmp_path / "cp", 3, "--seq-len", "30", "--tp", "1", "--cp", "2")
    single, split = _metrics(one), _metrics(tmp_path / "cp")
    for step in (1, 2, 3):
        assert split[step]["loss"] == pytest.approx(single[step]["loss"], rel=1e-5, abs=0)


# make test: --auto's choice at cp 1 (test_planner) and the planner at a given cp (test_plan_hf)
@pytest.mark.full_matrix
def test_auto_keeps_the_cp_given(tmp_path, tokens, capsys):
    """--auto with --cp: the planner keeps the cp given and places the rest (here tp = dp = 1;
    the gradient sync over the 2 CP ranks is its choice); one rank's loss."""
    one = tmp_path / "one"
    flags = ["--data", tokens, "--seq-len", "30", "--steps", "1"]
    assert _train_here(capsys, *flags, "--checkpoint-dir", str(one))[0] == 0
    err = _train(2, tokens, tmp_path / "auto", 1, "--seq-len", "30", "--auto", "--cp", "2")
    chosen = re.search(r"--auto chose tp=1 pp=1 dp=1 cp=2 (\w+ )?ring ", err)
    assert chosen, err[-2000:]
    assert _metrics(tmp_path / "auto")[1]["loss"] == pytest.approx(_metrics(one)[1]["loss"])


@pytest.mark.full_matrix
def test_context_parallel_inside_pipeline_stages_matches_one_rank(tmp_path, tokens, capsys):
    """`tp-ext train --pp 2 --cp 2` (4 ranks): each stage's layers on its CP rank's positions;
    the losses of one rank."""
    flags = ["--data", tokens, "--seq-len", "30"]
    one = tmp_path / "one"
    assert _train_here(capsys, *flags, "--steps", "2", "--checkpoint-dir", str(one))[0] == 0
    _train(4, tokens, tmp_path / "ppcp", 2, "--seq-len", "30", "--tp", "1", "--pp", "2",
           "--cp", "2")  # fmt: skip
    single, split = _metrics(one), _metrics(tmp_path / "ppcp")
    for step in (1, 2):
        assert split[step]["loss"] == pytest.approx(single[step]["loss"], rel=1e-5, abs=0)


# `make test-all` only: a 4-rank run of 32,768-token sequences, about 90 s on 2 cores
@pytest.mark.full_matrix
def test_long_sequences_train_over_four_context_parallel_ranks(tmp_path, tokens):
    """The issue's long-sequence run: configs/train-tiny-long.yaml at cp=4, one 32,768-token
    sequence per step, starting at a uniform guess's loss."""
    long = tmp_path / "long.bin"
    from tp_ext.data import byte_tokens, write_token_file

    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        write_token_file(str(long), byte_tokens(f.read() * 4))  # over 32,768 tokens
    flags = ["--data", str(long), "--checkpoint-dir", str(tmp_path / "c"), "--steps", "1"]
    flags += ["--tp", "1", "--cp", "4", "--seq-len", "32768"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    config = os.path.join(ROOT, "configs", "train-tiny-long.yaml")
    proc = subprocess.Popen(
        [*command, "4", "-m", "tp_ext", "train", config, *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=env,
        start_new_session=True,
    )
    _finish(proc, timeout=600)
    assert abs(_metrics(tmp_path / "c")[1]["loss"] - math.log(300)) < 0.1


def test_auto_keeps_the_configs_cp(monkeypatch):
    """--auto with a job whose parallel section says cp: 2 (no --cp flag): the planner places
    the rest around that cp, and the mode comes along."""
    import types

    from tp_ext.cli.auto import auto_overrides
    from tp_ext.config import JobConfig

    monkeypatch.setenv("WORLD_SIZE", "4")
    job = JobConfig.from_file(TINY)
    parallel = types.SimpleNamespace(cp=2, cp_mode="all_to_all")
    chosen = auto_overrides(job.model, job.data, {}, "float32", parallel)
    assert (chosen["cp"], chosen["cp_mode"]) == (2, "all_to_all"), chosen
    assert chosen["tp"] * chosen["pp"] * chosen["dp"] * chosen["cp"] == 4
    flag = auto_overrides(job.model, job.data, {"cp": 4}, "float32", parallel)
    assert flag["cp"] == 4 and flag["tp"] == flag["pp"] == flag["dp"] == 1  # the flag wins
