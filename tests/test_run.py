"""The main job (``tp-ext run``) end to end under torchrun at 8 ranks, and its flags."""

import os
import subprocess
import sys

import pytest

from tp_ext.config import JobConfig
from tp_ext.models import ConfigError, Qwen2Config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "configs")


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
    with pytest.raises(ConfigError, match="optimizer.lr must be a number > 0, got -1"):
        config.with_overrides(lr=-1)
    with pytest.raises(ConfigError, match="parallel.tp must be an int >= 1, got 0"):
        config.with_overrides(tp=0)
    with pytest.raises(ConfigError, match="unknown override 'momentum'"):
        config.with_overrides(momentum=0.9)
    tiny = config.model.tiny()
    assert (tiny.architecture, tiny.rope_theta, tiny.rms_norm_eps) == ("qwen2", 1e6, 1e-6)
    assert (tiny.num_attention_heads, tiny.num_key_value_heads, tiny.vocab_size) == (8, 2, 1001)
    original = Qwen2Config.from_file(os.path.join(CONFIGS, "qwen-72b.yaml")).tiny()
    assert original.num_key_value_heads == original.num_attention_heads == 8  # no GQA


def test_run_rejects_bad_flags_before_starting():
    for flags, message in (
        (["--lr", "-1"], "optimizer.lr"),
        (["--tp", "0"], "parallel.tp must be an int >= 1"),
        (["--steps", "0"], "--steps must be an int >= 1"),
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
