"""The command modules (add_arguments/main), flags made from the config fields' rules, the
commands' logging, and which errors are one-line configuration errors (exit 2) and which keep
their traceback."""

import json
import logging
import os
import subprocess
import sys

import pytest

from tp_ext.cli import COMMANDS, main
from tp_ext.cli.logs import LOG, REPORT, configure
from tp_ext.config import CHECKPOINT_FIELDS, DATA_FIELDS, PARALLEL_FIELDS
from tp_ext.training.optimizer import OPTIMIZER_FIELDS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MINI = os.path.join(ROOT, "configs", "qwen2-mini.yaml")
Q72 = os.path.join(ROOT, "configs", "qwen2-72b.yaml")


@pytest.fixture(autouse=True)
def _default_logging():
    yield
    configure("info", rank=0)  # as the next command would find it


def test_every_command_is_a_module_with_add_arguments_and_main():
    assert set(COMMANDS) == {
        "demo",
        "plan",
        "run",
        "doctor",
        "train",
        "generate",
        "serve",
        "tokenize",
    }
    for module in COMMANDS.values():
        assert callable(module.add_arguments) and callable(module.main) and module.HELP


def _refused(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_planner_flags_have_their_own_bounds(tmp_path, capsys):
    """--seq-len, --global-batch, --top and --gpus once had --tp's bounds (1..65,536), so a
    128K-token context could not be planned."""
    long_context = tmp_path / "qwen2-72b-128k.yaml"
    text = open(Q72).read()
    long_context.write_text(
        text.replace("max_position_embeddings: 32768", "max_position_embeddings: 131072")
    )
    argv = ["plan", str(long_context), "--auto", "--gpus", "8", "--seq-len", "131072"]
    argv += ["--global-batch", "8"]
    assert main([*argv, "--top", "100000", "--json"]) == 0
    ranked = json.loads(capsys.readouterr().out)
    assert ranked and all(r["reason"] for r in ranked)  # ranked, none refused
    err = _refused([*argv[:-4], "--seq-len", str(2**20 + 1)], capsys)
    assert f"argument --seq-len: must be {DATA_FIELDS['seq_len'].allowed()}, got '1048577'" in err
    assert "[2, 1,048,576]" in err
    err = _refused([*argv[:-4], "--global-batch", "0"], capsys)
    assert f"argument --global-batch: must be {DATA_FIELDS['global_batch'].allowed()}" in err
    err = _refused(["plan", Q72, "--auto", "--gpus", str(2**20 + 1)], capsys)
    assert "argument --gpus: must be an integer in [1, 1,048,576] (a million devices)" in err
    err = _refused(["plan", Q72, "--auto", "--gpus", "8", "--top", "0"], capsys)
    assert "argument --top: must be an integer >= 1, got '0'" in err
    # plan's --virtual-stages is the config field's (1..64), not --pp's
    err = _refused(["plan", Q72, "--pp", "2", "--virtual-stages", "65"], capsys)
    assert "argument --virtual-stages: must be an integer in [1, 64], got '65'" in err


@pytest.mark.parametrize("command", ["run", "train"])
def test_override_flags_take_help_and_bounds_from_the_fields(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    fields = {**PARALLEL_FIELDS, **OPTIMIZER_FIELDS}
    names = ["pp", "schedule", "virtual_stages", "data_parallel", "micro_batches", "lr", "betas"]
    if command == "train":
        names += ["warmup_steps", "decay_steps"]
        fields.update(CHECKPOINT_FIELDS)
        names += ["save_every", "async_save"]
    for name in names:
        help_text = " ".join(fields[name].help.split())
        assert help_text and help_text in text, (name, help_text)
    assert "--log-level {debug,info,warning,error,critical}" in text
    # a bound: the field's, under the flag's name
    flags = ["--steps", "1"] if command == "train" else []
    err = _refused([command, MINI, *flags, "--virtual-stages", "65"], capsys)
    assert "argument --virtual-stages: must be an integer in [1, 64], got '65'" in err


def test_rank_0_logs_at_the_level_and_the_others_warnings_only(capsys):
    configure("info", rank=0)
    LOG.getChild("cli.test").info("progress")
    REPORT.info("a report line")
    out = capsys.readouterr()
    assert out.err == "progress\n" and out.out == "a report line\n"
    configure("info", rank=1)
    LOG.getChild("cli.test").info("progress")
    REPORT.info("a report line")
    LOG.getChild("cli.test").warning("careful")
    out = capsys.readouterr()
    assert out.err == "careful\n" and out.out == ""
    configure("warning", rank=0)
    REPORT.info("a report line")
    LOG.error("wrong")
    out = capsys.readouterr()
    assert out.err == "wrong\n" and out.out == ""
    configure("debug", rank=0)
    assert LOG.isEnabledFor(logging.DEBUG)
    configure("info", rank=0)
    configure("info", rank=0)  # configuring again replaces the handlers, never adds
    LOG.info("once")
    assert capsys.readouterr().err == "once\n"


def test_log_level_flag(capsys):
    assert main(["doctor", "--json", "--log-level", "warning"]) in (0, 1)
    assert LOG.getEffectiveLevel() == logging.WARNING
    assert json.loads(capsys.readouterr().out)
    err = _refused(["doctor", "--log-level", "loud"], capsys)
    assert "argument --log-level: invalid choice: 'loud'" in err


def _python(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env = {k: v for k, v in env.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=dict(env, OMP_NUM_THREADS="1"),
    )


def test_an_error_in_the_job_keeps_its_traceback_and_exits_1():
    """A ValueError once the job has started (here in the training stage) is no usage error:
    its traceback is printed and the exit status is 1, not 2."""
    code = (
        "import sys\n"
        "from tp_ext.cli import main, self_check\n"
        "def boom(self, model):\n"
        "    raise ValueError('boom in the training stage')\n"
        "self_check.SelfCheck.train = boom\n"
        f"sys.exit(main(['run', {MINI!r}, '--steps', '1']))\n"
    )
    proc = _python(code)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback (most recent call last)" in proc.stderr
    assert "ValueError: boom in the training stage" in proc.stderr
    assert "tp-ext run: boom" not in proc.stderr
    assert "[3] loaded across" in proc.stdout  # the stages before it ran and reported


def test_a_configuration_error_before_the_job_is_one_line_and_exit_2(capsys):
    assert main(["run", MINI, "--tp", "9"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tp-ext run: ") and len(err.strip().splitlines()) == 1
    assert "Traceback" not in err
    assert main(["train", os.path.join(ROOT, "configs", "nope.yaml"), "--steps", "1"]) == 2
    assert "does not exist" in capsys.readouterr().err
