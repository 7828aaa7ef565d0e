"""The main job (``tp-ext run``) end to end under torchrun (8 ranks with --workdir, 2 ranks with
the private temporary one), its flags, and its work directory."""

import json
import os
import stat
import subprocess
import sys
import tempfile

import pytest

from tp_ext.cli import main
from tp_ext.cli.workdir import MARKER, check_workdir, make_workdir, share_path
from tp_ext.config import JobConfig
from tp_ext.models import ConfigError, Qwen2Config

from .dist_utils import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "configs")
MINI = os.path.join(CONFIGS, "qwen2-mini.yaml")


def test_main_job_on_8_ranks(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "8",
            "-m",
            "tp_ext",
            "run",
            os.path.join(CONFIGS, "qwen2-72b.yaml"),
            "--steps",
            "4",
            "--workdir",
            str(tmp_path / "work"),
        ],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=ROOT,
    )  # this checkout's tp_ext
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]
    assert "72,706,203,648 parameters" in out and "9,089,429,504" in out  # the full-size plan
    for line in (
        "ok   logits equal the single-process model",
        "ok   greedy tokens equal the single-process model",
        "ok   training loss goes down at every step",
        "ok   sharded DCP checkpoint reloads bitwise",
        "all checks passed on 8 ranks",
    ):
        assert line in out, out
    assert "FAIL" not in out
    assert os.path.isfile(tmp_path / "work" / "export" / "config.json")


def test_flags_override_the_config():
    config = JobConfig.from_file(os.path.join(CONFIGS, "qwen2-72b.yaml"))
    changed = config.with_overrides(
        tp=4, dtype="float32", seed=7, lr=1e-3, betas=[0.8, 0.9], weight_decay=None
    )
    assert (changed.parallel.tp, changed.parallel.dtype, changed.parallel.seed) == (4, "float32", 7)
    assert (changed.optimizer.lr, changed.optimizer.betas) == (1e-3, (0.8, 0.9))
    assert changed.optimizer.weight_decay == config.optimizer.weight_decay  # None: kept
    assert changed.model == config.model
    with pytest.raises(
        ConfigError, match=r"optimizer.lr must be a finite number in \(0, 1\], got -1"
    ):
        config.with_overrides(lr=-1)
    with pytest.raises(
        ConfigError, match=r"parallel.tp must be an integer in \[1, 65,536\], got 0"
    ):
        config.with_overrides(tp=0)
    with pytest.raises(ConfigError, match="unknown override 'momentum'"):
        config.with_overrides(momentum=0.9)
    tiny = config.model.tiny()
    assert (tiny.architecture, tiny.rope_theta, tiny.rms_norm_eps) == ("qwen2", 1e6, 1e-6)
    assert (tiny.num_attention_heads, tiny.num_key_value_heads, tiny.vocab_size) == (8, 2, 1001)
    original = Qwen2Config.from_file(os.path.join(CONFIGS, "qwen-72b.yaml")).tiny()
    assert original.num_key_value_heads == original.num_attention_heads == 8  # no GQA


def test_run_rejects_bad_flags_before_starting():
    """Through the real entry point (`python -m tp_ext`): exit status 2 and the message; every
    flag's message is checked in-process by test_bad_flag_values_exit_2_naming_the_flag."""
    for flags, message in (
        (["--lr", "-1"], "argument --lr: must be a finite number in (0, 1], got '-1'"),
    ):
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "tp_ext",
                "run",
                os.path.join(CONFIGS, "qwen2-72b.yaml"),
                *flags,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 2 and message in done.stderr, (flags, done.stderr)


DEGREE = "an integer in [1, 65,536]"
# (command line after the config, the flag, what the message says is allowed)
BAD_FLAGS = [
    (["--tp", "0"], "--tp", DEGREE),
    (["--tp", "2.5"], "--tp", DEGREE),
    (["--tp", "99999999"], "--tp", DEGREE),
    (["--dp", "x"], "--dp", DEGREE),
    (["--dp", "-1"], "--dp", DEGREE),
    (["--seed", "-3"], "--seed", "an integer in [0, 4,611,686,018,427,387,904]"),
    (["--seed", "1.5"], "--seed", "an integer in [0, 4,611,686,018,427,387,904]"),
    (["--lr", "-1"], "--lr", "a finite number in (0, 1]"),
    (["--lr", "nan"], "--lr", "a finite number in (0, 1]"),
    (["--lr", "inf"], "--lr", "a finite number in (0, 1]"),
    (["--weight-decay", "-0.1"], "--weight-decay", "a finite number in [0, 1]"),
    (["--betas", "0.9", "1"], "--betas", "a finite number in [0, 1)"),
    (["--betas", "nan", "0.9"], "--betas", "a finite number in [0, 1)"),
    (["--steps", "0"], "--steps", "an integer in [1, 100,000]"),
    (["--steps", "1e9"], "--steps", "an integer in [1, 100,000]"),
    (["--micro-batches", "0"], "--micro-batches", "an integer in [1, 1,024]"),
    (["--micro-batches", "2.0"], "--micro-batches", "an integer in [1, 1,024]"),
    (["--max-new-tokens", "-1"], "--max-new-tokens", "an integer in [1, 1,048,576]"),
    (["--max-new-tokens", "10000000"], "--max-new-tokens", "an integer in [1, 1,048,576]"),
    (["--max-grad-norm", "0"], "--max-grad-norm", "a finite number > 0"),
    (["--max-grad-norm", "inf"], "--max-grad-norm", "a finite number > 0"),
]


@pytest.mark.parametrize("flags, flag, allowed", BAD_FLAGS, ids=lambda x: " ".join(x))
def test_bad_flag_values_exit_2_naming_the_flag(flags, flag, allowed, capsys):
    with pytest.raises(SystemExit) as e:  # argparse: before torch.distributed is touched
        main(["run", MINI, *flags])
    assert e.value.code == 2
    value = flags[1] if flag != "--betas" or flags[1] == "nan" else flags[2]
    assert f"tp-ext run: error: argument {flag}: must be {allowed}, got {value!r}" in (
        capsys.readouterr().err
    )


def test_dtype_flags_are_choices(capsys):
    for command in (["run", MINI], ["plan", MINI]):
        with pytest.raises(SystemExit) as e:
            main([*command, "--dtype", "fp8"])
        assert e.value.code == 2
        assert "argument --dtype: invalid choice: 'fp8' (choose from 'float32', 'bfloat16'" in (
            capsys.readouterr().err
        )
    for command in (["plan", MINI, "--tp", "0"], ["demo", "--tp", "-2"]):
        with pytest.raises(SystemExit) as e:
            main(command)
        assert e.value.code == 2 and f"argument --tp: must be {DEGREE}" in capsys.readouterr().err


def test_flags_checked_against_the_config_before_starting(tmp_path, capsys):
    """Values each flag allows alone, wrong for this config: exit 2 before torch.distributed
    (which would fail here without torchrun's environment)."""
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("a user's file")
    cases = [
        (
            ["--max-new-tokens", "300"],
            "--max-new-tokens 300 plus the 8-token prompt exceeds the small model's "
            "max_position_embeddings 256",
        ),
        (["--tp", "9"], "tp=9 cannot split 8 attention heads / 2 KV heads"),
        (
            ["--workdir", str(foreign)],
            f"--workdir {str(foreign)!r} is not empty (notes.txt) and was not made by tp-ext "
            f"run (no {MARKER} in it); give a new or empty directory",
        ),
        (
            ["--workdir", str(foreign / "notes.txt")],
            f"--workdir {str(foreign / 'notes.txt')!r} is a file, not a directory",
        ),
    ]
    binary = tmp_path / "weights.yaml"
    binary.write_bytes(b"\x80\x81 not text")
    broken = tmp_path / "broken.yaml"
    broken.write_text("model: [unclosed\n")
    cases += [
        (
            ["--small", str(tmp_path / "nope.yaml")],
            f"config file {str(tmp_path / 'nope.yaml')!r} does not exist",
        ),
        (["--small", str(binary)], f"config file {str(binary)!r} cannot be read as UTF-8 text"),
        (["--small", str(broken)], f"{broken}: not valid YAML: while parsing a flow sequence"),
    ]
    for flags, message in cases:
        assert main(["run", MINI, *flags]) == 2
        assert f"tp-ext run: {message}" in capsys.readouterr().err
    assert os.listdir(foreign) == ["notes.txt"]  # nothing written into the user's directory


def test_workdir_rules(tmp_path, monkeypatch):
    assert check_workdir(str(tmp_path / "new")) == str(tmp_path / "new")  # absent: created
    empty = tmp_path / "empty"
    empty.mkdir()
    assert make_workdir(str(empty)) == str(empty)
    assert sorted(os.listdir(empty)) == [MARKER]
    (empty / "hf").mkdir()
    assert check_workdir(str(empty)) == str(empty)  # an earlier run's: reused
    # The default: fresh, private, unpredictable, under the temp directory.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    first, second = make_workdir(None), make_workdir(None)
    assert first != second and os.path.dirname(first) == str(tmp_path)
    assert os.path.basename(first).startswith("tp_ext_run_") and first != "tp_ext_run_local"
    assert stat.S_IMODE(os.stat(first).st_mode) == 0o700
    assert os.listdir(first) == [MARKER]


def _share(path):
    import torch.distributed as dist

    return share_path(path if dist.get_rank() == 0 else None, dist.group.WORLD)


def test_rank_0_shares_the_workdir_path():
    path = "/tmp/tp_ext_run_ü é/" + "x" * 3000  # non-ASCII, spaces, long: bytes, not pickle
    assert run_distributed(_share, 2, path) == [path, path]


def test_two_rank_run_uses_and_removes_a_private_workdir(tmp_path):
    env = dict(os.environ, TMPDIR=str(tmp_path), OMP_NUM_THREADS="1")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "tp_ext",
            "run",
            MINI,
            "--tp",
            "2",
            "--steps",
            "1",
            "--profile",
            str(tmp_path / "trace"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env,
    )
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]
    assert "all checks passed on 2 ranks" in out
    assert f"written to {tmp_path}{os.sep}tp_ext_run_" in out  # mkdtemp's name in TMPDIR
    assert not [n for n in os.listdir(tmp_path) if n.startswith("tp_ext_run_")]  # removed
    # --profile (here, not in the 8-rank job, where it cost ~50 s): a Chrome trace per rank,
    # with the Trainer's tags as ranges beside tp_ext's ops
    for rank in range(2):
        with open(tmp_path / "trace" / f"trace_rank{rank}.json") as f:
            names = {e.get("name", "") for e in json.load(f)["traceEvents"]}
        assert "tp_ext.tag:train.compute" in names
        assert any(n.startswith("tp_ext::") for n in names)
