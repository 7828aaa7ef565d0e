"""The README's main job: the demo under torchrun (env:// rendezvous, init_parallel from the
environment) passes its own reference checks."""

import os
import subprocess
import sys

import pytest


# make test-all (19 s at 3 ranks): make test runs the demo in one process (below) and other
# commands under torchrun (test_run, test_run_3d, test_examples)
@pytest.mark.full_matrix
@pytest.mark.parametrize("nproc", [2, 3])
def test_demo_under_torchrun(nproc):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            "-m",
            "tp_ext",
            "demo",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"all checks passed on {nproc} ranks" in proc.stdout
    assert "FAIL" not in proc.stdout


def test_init_parallel_without_torchrun_env_says_how_to_launch():
    code = (
        "import os, tp_ext\n"
        "for v in ('RANK','WORLD_SIZE','MASTER_ADDR','MASTER_PORT'): os.environ.pop(v, None)\n"
        "try:\n    tp_ext.init_parallel(tp=2)\nexcept RuntimeError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set" in out.stdout
    assert "torchrun" in out.stdout


def _tp_ext(args, nproc=None, **env):
    """`python -m tp_ext ARGS` as a user types it (no torchrun variables), or under torchrun."""
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    base = {k: v for k, v in base.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    launch = [sys.executable, "-m", "tp_ext"]
    if nproc is not None:
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        launch += [f"--nproc-per-node={nproc}", "-m", "tp_ext"]
    return subprocess.run(
        [*launch, *args],
        capture_output=True,
        text=True,
        timeout=180,
        env=dict(base, OMP_NUM_THREADS="1", **env),
    )


def test_demo_without_torchrun_runs_as_one_process():
    proc = _tp_ext(["demo"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "not under torchrun, so one process" in proc.stderr
    assert "all checks passed on 1 ranks" in proc.stdout


def test_a_bad_tp_ext_variable_stops_a_command_with_one_line():
    # the variable is read as the command starts, launched or not: here without torchrun
    proc = _tp_ext(["demo"], TP_EXT_SHM="maybe")
    assert proc.returncode != 0
    said = {line for line in proc.stderr.splitlines() if line.startswith("tp-ext demo:")}
    assert said == {
        "tp-ext demo: TP_EXT_SHM='maybe' is not valid; use 1 (on) or 0 (off) (also true/false, "
        "on/off, yes/no), or unset it."
    }, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


# under torchrun (~10 s): each rank says its one line and no rank prints a traceback
@pytest.mark.full_matrix
def test_a_bad_tp_under_torchrun_stops_every_rank_with_one_line():
    proc = _tp_ext(["demo", "--tp", "3"], nproc=2)
    assert proc.returncode != 0
    assert (
        proc.stderr.count("tp-ext demo: --tp 3 does not divide the 2 ranks; use one of [1, 2]") >= 1
    ), "said by the ranks that ran before torchrun stopped them"
    assert _only_torchruns_traceback(proc.stderr)


def _only_torchruns_traceback(stderr: str) -> bool:
    """No rank printed a traceback: the one there is torchrun's report of the failed ranks."""
    return stderr.count("Traceback") == 1 and "ChildFailedError" in stderr


def test_one_process_variables_are_undone_after_the_command(monkeypatch, capsys):
    from tp_ext.cli.launch import launch_variables_restored, one_process_unless_launched

    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    for name in names:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LOCAL_RANK", "7")  # a variable of the caller's own: kept as it was
    with launch_variables_restored():
        one_process_unless_launched("run")
        assert os.environ["WORLD_SIZE"] == "1" and os.environ["LOCAL_RANK"] == "0"
        assert int(os.environ["MASTER_PORT"]) > 0
    assert {n: os.environ.get(n) for n in names} == {n: None for n in names} | {"LOCAL_RANK": "7"}
    assert "tp-ext run: not under torchrun, so one process" in capsys.readouterr().err
