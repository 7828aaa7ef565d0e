"""The README's main job: the demo under torchrun (env:// rendezvous, init_parallel from the
environment) passes its own reference checks."""

import os
import subprocess
import sys

import pytest


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
