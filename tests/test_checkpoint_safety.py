"""Checkpoints that must load exactly or fail clearly: concurrent saves and loads, killed saves,
symlinked paths, files outside the checkpoint or added to it, edited headers and bytes, dtype
conversions, and DCP's own errors. Every load is compared bitwise with one of the saved states."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import save_file

from tp_ext import checkpoint
from tp_ext.checkpoint import CheckpointError
from tp_ext.models import Qwen2Config, Qwen2ForCausalLM

from .dist_utils import rank, run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MINI = os.path.join(ROOT, "configs", "qwen2-mini.yaml")
MANIFEST = checkpoint.MANIFEST


def _model(seed, dtype=torch.float32):
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config.from_file(MINI), dtype=dtype)


def _state(seed, dtype=torch.float32):
    return _model(seed, dtype).full_state_dict()


def _fresh(dtype=torch.float32):
    return _model(99, dtype)  # weights that every load must overwrite


def _loaded_hf(path, dtype=torch.float32, **kwargs):
    model = _fresh(dtype)
    checkpoint.load_hf_checkpoint(model, path, progress=False, **kwargs)
    return model.full_state_dict()


def _loaded_sharded(path, dtype=torch.float32):
    model = _fresh(dtype)
    checkpoint.load_sharded(model, path)
    return model.full_state_dict()


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _versions(path):
    return sorted(os.listdir(path + ".versions"))


# ---- concurrent saves and loads ------------------------------------------------------------------

_WRITER = r"""
import sys, torch
from tp_ext import checkpoint
from tp_ext.models import Qwen2Config, Qwen2ForCausalLM
path, seed, rounds, kind, config = sys.argv[1:]
seed, rounds = int(seed), int(rounds)
torch.manual_seed(seed)
model = Qwen2ForCausalLM(Qwen2Config.from_file(config))
for _ in range(rounds):
    if kind == "hf":
        checkpoint.save_hf_checkpoint(model, path, max_shard_bytes=200_000)
    else:
        checkpoint.save_sharded(model, path, step=seed)
"""


@pytest.mark.parametrize("kind", ["hf", "sharded"])
def test_concurrent_saves_and_loads_see_one_save_entirely(tmp_path, kind):
    """Two processes save different weights to one path in a loop while this one loads it in a
    loop: both saves succeed every time, and every load is bitwise one of the two states."""
    path = str(tmp_path / "ckpt")
    states = {seed: _state(seed) for seed in (1, 2)}
    load = _loaded_hf if kind == "hf" else _loaded_sharded

    def save(seed):
        if kind == "hf":
            checkpoint.save_hf_checkpoint(_model(seed), path, max_shard_bytes=200_000)
        else:
            checkpoint.save_sharded(_model(seed), path)

    save(1)
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", _WRITER, path, str(seed), "6", kind, MINI],
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in (1, 2)
    ]
    loads = 0
    while any(w.poll() is None for w in writers) or loads < 3:
        loaded = load(path)
        matches = [seed for seed, state in states.items() if _same(loaded, state)]
        assert matches, f"load {loads} is a mix of the saves"
        loads += 1
    for w in writers:
        assert w.wait(timeout=120) == 0, w.stderr.read()
    assert any(_same(load(path), s) for s in states.values())
    # versions still read during the last publish are removed by the next save
    save(2)
    assert _same(load(path), states[2])
    assert len([v for v in _versions(path) if not v.endswith(".lock")]) == 1, _versions(path)


# ---- killed saves --------------------------------------------------------------------------------


def _killed_save(path, where, seed):
    """Save in a forked child that SIGKILLs itself at ``where``; returns its wait status."""
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    from tp_ext.checkpoint import atomic

    model = _model(seed)
    pid = os.fork()
    if pid:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return status
            time.sleep(0.05)
        os.kill(pid, signal.SIGKILL)
        raise AssertionError(f"the save killed at {where} did not end in 120 s")

    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    if where == "data":  # while the shard files are written
        HuggingFaceStorageWriter.write_data = die
    elif where == "manifest":  # data written and hashed, the manifest not yet
        atomic.write_manifest = die
    elif where == "publish":  # complete, its symlink made, not yet swapped in
        replace, target = os.replace, atomic.checkpoint_target(path)
        atomic.os.replace = lambda a, b: die() if b == target else replace(a, b)
    elif where == "cleanup":  # published, old versions not yet removed
        atomic.remove_unused_versions = die
    try:
        checkpoint.save_sharded(model, path, step=seed)
    finally:
        os._exit(0)


def test_saves_killed_anywhere_in_a_row_keep_the_last_published(tmp_path):
    path = str(tmp_path / "ckpt")
    checkpoint.save_sharded(_model(1), path)
    last = 1
    for seed, where in enumerate(["data", "manifest", "publish", "publish", "cleanup", "data"], 2):
        status = _killed_save(path, where, seed)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, where
        if where == "cleanup":  # killed after publishing: the new save is the checkpoint
            last = seed
        assert _same(_loaded_sharded(path), _state(last)), where
    checkpoint.save_sharded(_model(20), path)  # removes every killed save's leftovers
    assert _same(_loaded_sharded(path), _state(20))
    versions = _versions(path)
    assert len(versions) == 2 and versions[1] == versions[0] + ".lock", versions
    assert [n for n in os.listdir(tmp_path) if not n.startswith("ckpt")] == []


def test_rename_format_checkpoints_still_load_and_are_replaced(tmp_path):
    """A plain directory with a manifest (the rename format), and its ``.old`` fallback."""
    path = str(tmp_path / "ckpt")
    checkpoint.save_sharded(_model(1), path)
    plain = str(tmp_path / "plain")
    shutil.copytree(os.path.realpath(path), plain)
    assert _same(_loaded_sharded(plain), _state(1))
    os.rename(plain, plain + ".old")  # a rename-format save killed between its renames
    assert _same(_loaded_sharded(plain), _state(1))
    os.rename(plain + ".old", plain)
    checkpoint.save_sharded(_model(2), plain)
    assert os.path.islink(plain) and _same(_loaded_sharded(plain), _state(2))


# ---- symlinked and unusual paths -----------------------------------------------------------------


@pytest.mark.parametrize("kind", ["hf", "sharded"])
def test_saving_through_a_symlinked_path(tmp_path, kind):
    real = tmp_path / "disk" / "ckpt"
    real.mkdir(parents=True)
    link = str(tmp_path / "ckpt")
    os.symlink(real, link)
    for seed in (1, 2):
        if kind == "hf":
            checkpoint.save_hf_checkpoint(_model(seed), link)
        else:
            checkpoint.save_sharded(_model(seed), link)
        load = _loaded_hf if kind == "hf" else _loaded_sharded
        assert _same(load(link), _state(seed))
    # the user's link is kept, and the data went where it points
    assert os.readlink(link) == str(real)
    assert os.path.realpath(link).startswith(str(real) + ".versions" + os.sep)


def test_saving_over_a_directory_that_is_not_a_checkpoint_is_refused(tmp_path):
    path = tmp_path / "notes"
    path.mkdir()
    (path / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match=r"notes is a directory that is not a tp_ext"):
        checkpoint.save_sharded(_model(1), str(path))
    assert (path / "keep.txt").read_text() == "mine"
    with pytest.raises(CheckpointError, match=r"cannot save .* at .*keep.txt/x: .*Not a directory"):
        checkpoint.save_sharded(_model(1), str(path / "keep.txt" / "x"))
    with pytest.raises(CheckpointError, match=r"nowhere does not exist"):
        checkpoint.load_sharded(_fresh(), str(tmp_path / "nowhere"))


# ---- only the checkpoint's own files -------------------------------------------------------------


def _hf_without_manifest(path, seed, dtype=torch.float32, shard_bytes=200_000):
    """A Hugging Face checkpoint as others make it: no tp_ext manifest, a plain directory."""
    checkpoint.save_hf_checkpoint(_model(seed, dtype), path + ".src", max_shard_bytes=shard_bytes)
    shutil.copytree(os.path.realpath(path + ".src"), path)
    os.remove(os.path.join(path, MANIFEST))
    return path


@pytest.mark.parametrize("outside", ["dotdot", "absolute", "symlink"])
def test_index_naming_a_file_outside_the_directory_is_refused(tmp_path, outside):
    path = _hf_without_manifest(str(tmp_path / "hf"), 1)
    index_path = os.path.join(path, "model.safetensors.index.json")
    index = json.load(open(index_path))
    victim = sorted(set(index["weight_map"].values()))[0]
    elsewhere = str(tmp_path / "elsewhere.safetensors")
    shutil.copy(os.path.join(path, victim), elsewhere)
    if outside == "symlink":
        os.remove(os.path.join(path, victim))
        os.symlink(elsewhere, os.path.join(path, victim))
    else:
        name = "../elsewhere.safetensors" if outside == "dotdot" else elsewhere
        index["weight_map"] = {
            k: name if v == victim else v for k, v in index["weight_map"].items()
        }
        json.dump(index, open(index_path, "w"))
    with pytest.raises(CheckpointError, match=r"outside the checkpoint directory"):
        _loaded_hf(path)


def test_hub_snapshot_symlinks_into_blobs_load(tmp_path):
    """The Hugging Face hub cache: snapshots/<rev>/<file> are symlinks to ../../blobs/<hash>."""
    src = _hf_without_manifest(str(tmp_path / "hf"), 1)
    snapshot = tmp_path / "models--x" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (tmp_path / "models--x" / "blobs").mkdir()
    for name in os.listdir(src):
        shutil.copy(os.path.join(src, name), tmp_path / "models--x" / "blobs" / f"h-{name}")
        os.symlink(f"../../blobs/h-{name}", snapshot / name)
    assert _same(_loaded_hf(str(snapshot)), _state(1))


def test_an_added_safetensors_file_is_never_a_source_of_weights(tmp_path):
    path = str(tmp_path / "ckpt")
    checkpoint.save_sharded(_model(1), path)
    version = os.path.realpath(path)
    # the same tensors, other values, under a name DCP's reader would also take
    (shard,) = [n for n in os.listdir(version) if n.endswith(".safetensors")]
    from safetensors import safe_open

    with safe_open(os.path.join(version, shard), "pt") as f:
        other = {k: torch.full_like(f.get_tensor(k), 7.0) for k in f.keys()}
        meta = f.metadata()
    save_file(other, os.path.join(version, "zz-added.safetensors"), metadata=meta)
    assert _same(_loaded_sharded(path), _state(1))
    # a merged checkpoint: its index may only name listed files
    hf = str(tmp_path / "hf")
    checkpoint.save_hf_checkpoint(_model(1), hf, max_shard_bytes=200_000)
    index_path = os.path.join(hf, "model.safetensors.index.json")
    index = json.load(open(index_path))
    name = "model.embed_tokens.weight"
    save_file({name: torch.zeros(1001, 64)}, os.path.join(hf, "added.safetensors"))
    index["weight_map"][name] = "added.safetensors"
    json.dump(index, open(index_path, "w"))
    with pytest.raises(CheckpointError, match=r"added.safetensors would be read, but .* not list"):
        _loaded_hf(hf)


# ---- edited bytes and dtypes ---------------------------------------------------------------------


def _edit_header(path, old: bytes, new: bytes):
    """Replace the first ``old`` in the safetensors header of ``path`` by ``new`` (same length)."""
    assert len(old) == len(new)
    data = bytearray(open(path, "rb").read())
    header_len = int.from_bytes(data[:8], "little")
    at = data.index(old, 8, 8 + header_len)
    data[at : at + len(old)] = new
    open(path, "wb").write(bytes(data))


def _first_file(path):
    return os.path.join(path, sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))[0])


def test_edited_files_of_a_tp_ext_checkpoint_are_refused(tmp_path):
    hf = str(tmp_path / "hf")
    checkpoint.save_hf_checkpoint(_model(1, torch.bfloat16), hf, max_shard_bytes=200_000)
    assert _same(_loaded_hf(hf, torch.bfloat16), _state(1, torch.bfloat16))
    victim = _first_file(os.path.realpath(hf))
    original = open(victim, "rb").read()
    _edit_header(victim, b'"BF16"', b'"F16" ')  # same size, other dtype
    with pytest.raises(CheckpointError, match=r"is stored as F16, the manifest says BF16"):
        _loaded_hf(hf, torch.bfloat16)
    data = bytearray(original)
    data[-3] ^= 0x40  # one bit of one weight
    open(victim, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{os.path.basename(victim)} has sha256 .*modified"):
        _loaded_hf(hf, torch.bfloat16)
    sharded = str(tmp_path / "sharded")
    checkpoint.save_sharded(_model(1), sharded)
    _edit_header(_first_file(os.path.realpath(sharded)), b'"F32"', b'"I32"')
    with pytest.raises(CheckpointError, match=r"is stored as I32, the manifest says F32"):
        _loaded_sharded(sharded)


def test_dtypes_of_checkpoints_without_a_manifest(tmp_path):
    bf16 = _hf_without_manifest(str(tmp_path / "bf16"), 1, torch.bfloat16)
    victim = _first_file(bf16)
    _edit_header(victim, b'"BF16"', b'"F16" ')
    with pytest.raises(
        CheckpointError, match=r"stored as torch.float16, .*bfloat16, and its values"
    ):
        _loaded_hf(bf16, torch.bfloat16)
    _edit_header(victim, b'"F16" ', b'"I16" ')
    with pytest.raises(CheckpointError, match=r"no conversion between integer and floating"):
        _loaded_hf(bf16, torch.bfloat16)
    # float32 into bfloat16 rounds (the model's dtype is the caller's choice); into float64 exact
    f32 = _hf_without_manifest(str(tmp_path / "f32"), 2)
    expected = {k: v.to(torch.bfloat16) for k, v in _state(2).items()}
    assert _same(_loaded_hf(f32, torch.bfloat16), expected)
    expected = {k: v.double() for k, v in _state(2).items()}
    assert _same(_loaded_hf(f32, torch.float64), expected)
    # bfloat16 into float16 only where exact, or rounded when asked (lossy_dtypes)
    with pytest.raises(CheckpointError, match=r"do not convert exactly.*lossy_dtypes=True"):
        _loaded_hf(bf16 + ".src", torch.float16)
    assert _same(_loaded_hf(bf16 + ".src", torch.float16, lossy_dtypes=True), _rounded(1))
    # float32 beyond float16's range: an error, not inf
    big = str(tmp_path / "big")
    shutil.copytree(f32, big)
    weights = _first_file(big)
    from safetensors.torch import load_file

    tensors = load_file(weights)
    name = sorted(tensors)[0]
    tensors[name][0, 0] = 1e6
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"{name}.*1000000.0, beyond the range"):
        _loaded_hf(big, torch.float16)


def _rounded(seed):
    return {k: v.to(torch.float16) for k, v in _state(seed, torch.bfloat16).items()}


def test_sharded_dtype_must_convert_exactly(tmp_path):
    path = str(tmp_path / "ckpt")
    checkpoint.save_sharded(_model(1, torch.bfloat16), path)
    expected = {k: v.float() for k, v in _state(1, torch.bfloat16).items()}
    assert _same(_loaded_sharded(path, torch.float32), expected)
    with pytest.raises(
        CheckpointError, match=r"stored as torch.bfloat16, the model's is .*float16"
    ):
        _loaded_sharded(path, torch.float16)


# ---- DCP's errors, on every rank -----------------------------------------------------------------


def _dcp_fails_on_rank_1(path, op):
    from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter

    cls = HuggingFaceStorageWriter if op == "save" else HuggingFaceStorageReader
    method = "write_data" if op == "save" else "read_data"
    original = getattr(cls, method)

    def fail(*args, **kwargs):
        raise OSError("No space left on device (simulated)")

    if rank() == 1:
        setattr(cls, method, fail)
    model = _model(5) if op == "save" else _fresh()
    try:
        if op == "save":
            checkpoint.save_sharded(model, path)
        else:
            checkpoint.load_sharded(model, path)
    except CheckpointError as e:
        return str(e)
    finally:
        setattr(cls, method, original)
    raise AssertionError("no error")


def test_dcp_errors_are_checkpoint_errors_on_every_rank(tmp_path):
    path = str(tmp_path / "ckpt")
    run_distributed(_save_sharded, 2, path, 1)
    for op in ("save", "load"):
        messages = run_distributed(_dcp_fails_on_rank_1, 2, path, op)
        for m in messages:
            assert path in m and "No space left" in m, m
    assert _same(_loaded_sharded(path), _state(1))  # the failed save changed nothing
    assert len(_versions(path)) == 2, _versions(path)


def _save_sharded(path, seed):
    checkpoint.save_sharded(_model(seed), path)


def _load_sharded_bitwise(path, seed):
    return _same(_loaded_sharded(path), _state(seed))


def test_distributed_save_and_load_through_versions(tmp_path):
    path = str(tmp_path / "ckpt")
    for seed in (1, 2):
        run_distributed(_save_sharded, 3, path, seed)
        assert all(run_distributed(_load_sharded_bitwise, 2, path, seed))
    assert len(_versions(path)) == 2
