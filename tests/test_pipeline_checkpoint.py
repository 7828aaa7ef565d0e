"""Merged Hugging Face saves of pipelined models: every stage's tensors and every TP slice,
from models built with ``parallel=`` (TP x PP x DP, virtual stages, V order, tied embeddings,
FSDP2's DTensors), written once by global rank 0 as one checkpoint that transformers loads.

Untrained, the export is bit-equal to the transformers checkpoint it was loaded from, and its
files are planned as the non-pipelined save plans them; after one training step it holds the
weights of transformers trained the same way. A failure on one rank raises on every rank."""

import json
import os
import time

import pytest
import torch
from safetensors import safe_open

from .dist_utils import rank, run_distributed
from .reference import hf_qwen2
from .test_training import CONFIG

LR = 0.5  # plain SGD: the update is linear in the gradient, so weights compare tightly
MAX_NORM = 1.0
SHARD_BYTES = 150_000  # several files for the mini model (~0.5 MB)


def _config(layers, tie):
    return CONFIG.replace(num_hidden_layers=layers, tie_word_embeddings=tie)


def _micro_batches(config, n):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, config.vocab_size, (2, 9), generator=g) for _ in range(n)]


def _source(tmp_path, config):
    """A transformers checkpoint of hf_qwen2(config), and that model."""
    hf = hf_qwen2(config)
    path = str(tmp_path / "source")
    hf.save_pretrained(path)
    return path, hf


# ---- on the ranks --------------------------------------------------------------------------------


def _load_train_save(source, out, dims, build, train, max_shard_bytes):
    """Load ``source`` into this rank's stages, optionally train one step, save to ``out``."""
    import tp_ext
    from tp_ext.models import Qwen2ForCausalLM
    from tp_ext.training import Trainer

    tp, pp, dp = dims
    state = tp_ext.init_parallel(tp=tp, pp=pp, dp=dp)
    model = Qwen2ForCausalLM.from_pretrained(source, parallel=state, progress=False, **build)
    assert model.is_pipelined and model.pipeline_group is not None
    if train is not None:
        schedule, data_parallel, n = train
        trainer = Trainer(
            model,
            optimizer=lambda params: torch.optim.SGD(params, lr=LR),
            parallel=state,
            schedule=schedule,
            max_grad_norm=MAX_NORM,
            data_parallel=data_parallel,
        )
        batches = _micro_batches(model.config, n * dp)
        trainer.step(batches[state.dp_rank * n : (state.dp_rank + 1) * n])
        if data_parallel == "fsdp":  # the case this covers: parameters sharded over DP
            from torch.distributed.tensor import DTensor

            assert any(isinstance(p, DTensor) for p in model.parameters())
    model.save_pretrained(out, max_shard_bytes=max_shard_bytes)
    return sorted(model.state_dict())


# ---- in the parent -------------------------------------------------------------------------------


def _hf_trained(config, train, dp):
    """transformers' model after the step the ranks took: mean token loss over every
    micro-batch of every DP rank, clipped, SGD."""
    _, _, n = train
    hf = hf_qwen2(config)
    optimizer = torch.optim.SGD(hf.parameters(), lr=LR)
    batches = _micro_batches(config, n * dp)
    for ids in batches:
        (hf(ids, labels=ids).loss / len(batches)).backward()
    torch.nn.utils.clip_grad_norm_(hf.parameters(), MAX_NORM)
    optimizer.step()
    return hf


def _saved_tensors(path):
    """Every tensor in the export's safetensors files, and the file holding each."""
    tensors, where = {}, {}
    for file in sorted(os.listdir(path)):
        if file.endswith(".safetensors"):
            with safe_open(os.path.join(path, file), "pt") as f:
                for name in f.keys():
                    assert name not in tensors, f"{name} written twice"
                    tensors[name], where[name] = f.get_tensor(name), file
    return tensors, where


def _check_export(out, expected_hf, exact, tie):
    import transformers

    tensors, where = _saved_tensors(out)
    expected = expected_hf.state_dict()
    # The whole model, every tensor once; a tied head has no tensor of its own.
    assert sorted(tensors) == sorted(n for n in expected if not (tie and n == "lm_head.weight"))
    loaded = transformers.Qwen2ForCausalLM.from_pretrained(out).float()
    got = loaded.state_dict()
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        if exact:
            assert torch.equal(got[name], tensor), name
        else:
            torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    if tie:
        assert torch.equal(got["lm_head.weight"], got["model.embed_tokens.weight"])
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["tie_word_embeddings"] is tie
    return where


CASES = {
    # id: (world size, (tp, pp, dp), layers, tie, build kwargs, training or None, shard bytes)
    "tp1-pp2": (2, (1, 2, 1), 2, False, {}, None, None),
    "tp1-pp3-uneven-sharded": (3, (1, 3, 1), 5, False, {}, None, SHARD_BYTES),
    "tp2-pp2-tied-trained": (4, (2, 2, 1), 3, True, {}, ("1F1B", "ddp", 2), None),
    "tp1-pp2-dp2-ddp-sharded": (4, (1, 2, 2), 3, False, {}, None, SHARD_BYTES),
    "tp1-pp2-dp2-fsdp-trained": (4, (1, 2, 2), 3, True, {}, ("1F1B", "fsdp", 2), SHARD_BYTES),
    "tp1-pp4": (4, (1, 4, 1), 4, False, {}, None, None),
    "tp1-pp2-v2-ZBVZeroBubble-tied-trained": (
        2,
        (1, 2, 1),
        4,
        True,
        {"virtual_stages": 2, "stage_order": "v"},
        ("ZBVZeroBubble", "ddp", 4),
        SHARD_BYTES,
    ),
    "tp2-pp2-dp2-v2-tied-trained": (
        8,
        (2, 2, 2),
        4,
        True,
        {"virtual_stages": 2},
        ("Interleaved1F1B", "ddp", 2),
        SHARD_BYTES,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_pipelined_save_is_the_whole_model(tmp_path, case):
    ws, dims, layers, tie, build, train, shard_bytes = CASES[case]
    config = _config(layers, tie)
    source, hf = _source(tmp_path, config)
    out = str(tmp_path / "export")
    shard_bytes = shard_bytes or 5 * 1024**3
    names = run_distributed(
        _load_train_save, ws, source, out, dims, build, train, shard_bytes, timeout=180
    )
    # Published once, by one writer: one version behind the path.
    versions = os.listdir(out + ".versions")
    assert [v for v in versions if not v.endswith(".lock")] == [os.path.basename(os.readlink(out))]
    # Each rank held only its own stages' tensors, yet the export has them all.
    assert all(len(n) < len(hf.state_dict()) for n in names)
    expected = hf if train is None else _hf_trained(config, train, dims[2])
    where = _check_export(out, expected, exact=train is None, tie=tie)
    if train is not None:  # the step changed the weights: the export holds the new ones
        moved = expected.state_dict()["model.norm.weight"] - hf.state_dict()["model.norm.weight"]
        assert moved.abs().max() > 1e-3
    # The files are planned as the non-pipelined save plans them (the same file per tensor).
    from tp_ext.models import Qwen2ForCausalLM

    reference = str(tmp_path / "reference")
    whole = Qwen2ForCausalLM.from_pretrained(out, progress=False)
    whole.save_pretrained(reference, max_shard_bytes=shard_bytes)
    assert where == _saved_tensors(reference)[1]
    assert (len(set(where.values())) > 1) == (shard_bytes == SHARD_BYTES)
    if shard_bytes == SHARD_BYTES:
        with open(os.path.join(out, "model.safetensors.index.json")) as f:
            assert json.load(f)["weight_map"] == where


# ---- failures raise on every rank, promptly ------------------------------------------------------


def _save_failing(source, out, fault):
    """Every rank saves; ``fault`` breaks it on one rank only. Returns (error text, seconds)."""
    import safetensors.torch

    import tp_ext
    from tp_ext.models import Qwen2ForCausalLM

    state = tp_ext.init_parallel(tp=1, pp=_world_size(), dp=1)
    model = Qwen2ForCausalLM.from_pretrained(source, parallel=state, progress=False)
    max_shard_bytes = SHARD_BYTES
    if fault == "unwritable" and rank() == 0:
        out = os.path.join(source, "config.json", "export")  # under a file: cannot be made
    if fault == "bad-shard-bytes" and rank() == 2:
        max_shard_bytes = 0
    if fault == "write" and rank() == 0:  # the disk fills after the first file
        real, calls = safetensors.torch.save_file, []

        def save_file(tensors, path, metadata=None):
            calls.append(path)
            if len(calls) > 1:
                raise OSError(28, "No space left on device")
            real(tensors, path, metadata=metadata)

        safetensors.torch.save_file = save_file
    start = time.monotonic()
    try:
        model.save_pretrained(out, max_shard_bytes=max_shard_bytes)
    except Exception as e:  # noqa: BLE001 (what each rank saw is the result)
        return f"{type(e).__name__}: {e}", time.monotonic() - start
    finally:
        if fault == "write" and rank() == 0:
            safetensors.torch.save_file = real
    return None, time.monotonic() - start


def _world_size():
    import torch.distributed as dist

    return dist.get_world_size()


@pytest.mark.parametrize(
    "fault,says",
    [
        ("unwritable", "cannot save a checkpoint"),
        ("bad-shard-bytes", "max_shard_bytes must be an int >= 1"),
        ("write", "No space left on device"),
    ],
)
def test_a_failure_on_one_rank_raises_on_every_rank(tmp_path, fault, says):
    config = _config(3, False)
    source, _ = _source(tmp_path, config)
    out = str(tmp_path / "export")
    results = run_distributed(_save_failing, 3, source, out, fault, timeout=60)
    for r, (error, seconds) in enumerate(results):
        assert error is not None, f"rank {r} did not raise"
        assert says in error or "failed on rank" in error, (r, error)
        assert seconds < 20, (r, seconds)
    assert any(says in error for error, _ in results)
    assert not os.path.exists(out)  # nothing was published
