"""The scripts in examples/ run under torchrun and pass their own checks (against the unsharded
model, or a falling loss), and the module paths the docs name import."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize(
    "script",
    [
        # make test-all (20 s): parallelize("auto") on transformers' decoders is
        # test_parallelize_models', in make test
        pytest.param("parallelize_hf_model.py", marks=pytest.mark.full_matrix),
        # make test-all (11 s): the Trainer on Qwen2 is test_training's and test_train_cli's
        pytest.param("train_qwen2.py", marks=pytest.mark.full_matrix),
        # make test-all (19 s): expert parallelism is test_moe's, in make test
        pytest.param("expert_parallel_moe.py", marks=pytest.mark.full_matrix),
    ],
)
def test_example_runs_and_checks_itself(script):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            os.path.join(ROOT, "examples", script),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "ok", done.stdout


def test_the_documented_module_paths_import():
    """The docs name `tp_ext.comm` and `tp_ext.random` as modules: both import statements a
    user writes from them work, in a fresh interpreter, and give the one module. Importing
    tp_ext loads none of the torch packages that cost a second or more per process and that
    only some jobs use (every rank of every launch would pay): DTensor (with sympy), DCP,
    pipelining (with dynamo)."""
    code = (
        "import sys\n"
        "import tp_ext.comm, tp_ext.random, tp_ext.distributed\n"
        "from tp_ext.comm import track, all_reduce\n"
        "from tp_ext.random import manual_seed\n"
        "assert tp_ext.comm is tp_ext.distributed.comm\n"
        "assert tp_ext.random is tp_ext.distributed.rng\n"
        "heavy = ('torch.distributed.tensor', 'torch.distributed.checkpoint',\n"
        "         'torch.distributed.pipelining', 'torch._dynamo', 'sympy')\n"
        "loaded = [m for m in heavy if m in sys.modules]\n"
        "assert not loaded, f'import tp_ext loaded {loaded}'\n"
        "print('imported')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "imported", proc.stderr[-2000:]
