"""The fault suite: a rank killed (SIGKILL) during a collective, a save and a load; a rank that
never joins; a rank that raises in forward. Every other rank must exit within the timeout with an
error naming the dead (or missing) rank, nothing may be left in /dev/shm or the temp directory,
and the last committed checkpoint must still load."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from ..dist_utils import launch_once, rank

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MINI = os.path.join(ROOT, "configs", "qwen2-mini.yaml")
WORLD = 3  # uneven shards everywhere
VICTIM = 1
PG_TIMEOUT = 20.0  # the process group's own timeout; tp_ext's is set lower where it matters


def _die_now():
    os.kill(os.getpid(), signal.SIGKILL)


def _shm_segments_of(pid: int) -> list[str]:
    """Shared-memory segments of a group whose rank 0 is ``pid`` (named /tp_ext_<pid>_<nonce>)."""
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"tp_ext_{pid}_")]


def _survivors(outcome):
    """(rank, payload) of every rank but the victim; each must have answered."""
    got = {}
    for r in range(WORLD):
        if r == VICTIM:
            continue
        assert r in outcome, f"rank {r} never answered: {outcome}"
        ok, payload = outcome[r]
        assert ok, f"rank {r} failed instead of returning its error: {payload}"
        got[r] = payload
    return got


def _check_survivors(outcome, limit: float, named: str):
    for r, (pid, elapsed, message) in _survivors(outcome).items():
        assert elapsed is not None, f"rank {r} never saw an error"
        assert elapsed < limit, f"rank {r} raised only after {elapsed:.1f}s (limit {limit}s)"
        assert named in message, f"rank {r}'s error does not name {named!r}: {message}"
        if r == 0:
            assert _shm_segments_of(pid) == [], f"left in /dev/shm: {_shm_segments_of(pid)}"


@pytest.fixture
def private_tmp(monkeypatch, tmp_path):
    """The ranks' temp directory (TMPDIR is inherited by the spawned ranks): empty afterwards."""
    path = tmp_path / "ranks_tmp"
    path.mkdir()
    monkeypatch.setenv("TMPDIR", str(path))
    yield path
    # torch's own compile cache directory (torch 2.13 makes it when torch._inductor.config is
    # imported, which DTensor's import does) is not a file of ours
    left = sorted(n for n in os.listdir(path) if not n.startswith("torchinductor_"))
    assert left == [], f"left in the temp directory: {left}"


# ---- a rank killed during a collective ---------------------------------------------------------


def _killed_in_collective():
    from tp_ext import comm

    comm.set_consistency_checks(False)  # the default (the launcher turns them on for tests)
    comm.set_timeout(PG_TIMEOUT)
    x = torch.ones(1 << 16)
    comm.all_reduce(x)  # the channel is set up and working
    if rank() == VICTIM:
        threading.Timer(0.3, _die_now).start()
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < 3 * PG_TIMEOUT:
            comm.all_reduce(x)
    except RuntimeError as e:
        return os.getpid(), time.monotonic() - t0, str(e)
    return os.getpid(), None, ""


def test_rank_killed_during_a_collective(private_tmp):
    outcome, report = launch_once(_killed_in_collective, WORLD, timeout=90, pg_timeout=PG_TIMEOUT)
    _check_survivors(outcome, limit=10.0, named=f"rank {VICTIM}")


# ---- a rank that raises in forward ----------------------------------------------------------


def _raises_in_forward():
    from tp_ext import comm
    from tp_ext.layers import ParallelTransformerBlock

    comm.set_consistency_checks(False)
    comm.set_timeout(3.0)
    torch.manual_seed(0)
    block = ParallelTransformerBlock(32, 4, 2, 44)
    x = torch.randn(2, 5, 32)
    block(x)  # one good step first
    t0 = time.monotonic()
    try:
        if rank() == VICTIM:
            raise ValueError("bad batch on this rank")
        block(x)
    except ValueError:
        return os.getpid(), 0.0, "raised"
    except RuntimeError as e:
        return os.getpid(), time.monotonic() - t0, str(e)
    return os.getpid(), None, ""


def test_rank_raising_in_forward_fails_the_others_at_the_timeout(private_tmp):
    outcome, report = launch_once(_raises_in_forward, WORLD, timeout=90, pg_timeout=PG_TIMEOUT)
    ok, payload = outcome[VICTIM]
    assert ok and payload[2] == "raised", report
    _check_survivors(outcome, limit=10.0, named=f"rank {VICTIM}")


# ---- a rank killed during a save, and during a load ------------------------------------------


def _model(tp_group=None):
    from tp_ext.config import JobConfig
    from tp_ext.models import Qwen2ForCausalLM

    torch.manual_seed(7)  # the same full weights at any TP size
    return Qwen2ForCausalLM(JobConfig.from_file(MINI).model, tp_group=tp_group)


def _killed_in_save(path):
    import safetensors.torch
    import torch.distributed as dist

    from tp_ext import checkpoint

    model = _model(dist.group.WORLD)
    checkpoint.save_sharded(model, path, step=1)  # committed
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    if rank() == VICTIM:
        safetensors.torch.save = lambda *a, **k: _die_now()  # dies writing its shard
    t0 = time.monotonic()
    try:
        checkpoint.save_sharded(model, path, step=2)
    except Exception as e:  # noqa: BLE001 (any error is fine; it must come, and name the rank)
        return os.getpid(), time.monotonic() - t0, f"{type(e).__name__}: {e}"
    return os.getpid(), None, ""


def _killed_in_load(path):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from tp_ext import checkpoint

    model = _model(dist.group.WORLD)
    checkpoint.save_sharded(model, path, step=1)
    if rank() == VICTIM:
        dcp.load = lambda *a, **k: _die_now()  # dies once the load has started
    t0 = time.monotonic()
    try:
        checkpoint.load_sharded(_model(dist.group.WORLD), path)
    except Exception as e:  # noqa: BLE001
        return os.getpid(), time.monotonic() - t0, f"{type(e).__name__}: {e}"
    return os.getpid(), None, ""


def _assert_committed_checkpoint_loads(path):
    from tp_ext import checkpoint

    expected = _model().state_dict()
    fresh = _model()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    info = checkpoint.load_sharded(fresh, path)
    assert info["step"] == 1
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


@pytest.mark.parametrize("scenario", [_killed_in_save, _killed_in_load], ids=["save", "load"])
def test_rank_killed_during_checkpoint_io(tmp_path, private_tmp, scenario):
    path = str(tmp_path / "ckpt")
    outcome, report = launch_once(scenario, WORLD, path, timeout=120, pg_timeout=PG_TIMEOUT)
    for r, (pid, elapsed, message) in _survivors(outcome).items():
        assert elapsed is not None and elapsed < PG_TIMEOUT + 5, (r, elapsed, message)
        # gloo names the dead peer by address only; tp_ext adds which rank exited
        assert f"rank {VICTIM} (pid" in message and "exited" in message, message
    _assert_committed_checkpoint_loads(path)


# ---- a rank that never joins -------------------------------------------------------------------

_JOIN = r"""
import datetime, sys, time
import tp_ext
t0 = time.monotonic()
try:
    tp_ext.init_parallel(tp=3, timeout=datetime.timedelta(seconds=5))
except Exception as e:
    print(f"{time.monotonic() - t0:.1f}s {type(e).__name__}: {e}")
    sys.exit(3)
print("joined")
"""


def test_rank_that_never_joins_fails_the_others_at_the_timeout(tmp_path):
    port = 29000 + os.getpid() % 1000
    procs = []
    for r in (0, 2):  # rank 1 never starts
        env = dict(
            os.environ,
            RANK=str(r),
            WORLD_SIZE="3",
            LOCAL_RANK=str(r),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            TMPDIR=str(tmp_path),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", _JOIN],
                env=env,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    t0 = time.monotonic()
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert time.monotonic() - t0 < 60
    for r, p, out in zip((0, 2), procs, outputs):
        assert p.returncode == 3, out
        # torch's rendezvous says how many joined, not which rank is missing. Rank 0 hosts the
        # store: when it times out first (rank 2 started late), rank 2 sees the store close,
        # which init_parallel says in words.
        assert "timed out" in out.lower(), out
        if "lost the rendezvous store" in out:
            assert r == 2 and "at 127.0.0.1:" in out, out
    assert [n for n in os.listdir(tmp_path) if n.startswith("tp_ext")] == []


def test_a_rank_that_finds_the_store_gone_says_why():
    """Rank 0 hosts the rendezvous store and gives up at its timeout (5 s) while rank 2, with a
    longer one, waits in the rendezvous: rank 2 fails as the store closes, at once, saying what
    the closed connection means."""
    port = 29500 + os.getpid() % 400

    def start(rank, seconds):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="3", LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
        code = _JOIN.replace("seconds=5", f"seconds={seconds}")
        return subprocess.Popen([sys.executable, "-c", code], env=env, cwd=ROOT, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip

    host, waiting = start(0, 5), start(2, 60)
    t0 = time.monotonic()
    host_out, waiting_out = host.communicate(timeout=90)[0], waiting.communicate(timeout=90)[0]
    assert time.monotonic() - t0 < 30  # not rank 2's 60 s
    assert host.returncode == 3 and "timed out" in host_out.lower(), host_out
    assert waiting.returncode == 3, waiting_out
    assert f"rank 2 of 3 lost the rendezvous store at 127.0.0.1:{port}" in waiting_out, waiting_out
    assert "timed out waiting for a rank that never started" in waiting_out, waiting_out
