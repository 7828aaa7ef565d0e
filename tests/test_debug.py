"""tp_ext.debug: check_determinism (clean models at 1-4 ranks, with and without sequence
parallelism; a rank-dependent and a run-dependent fault each found and named), shard_balance (exact
per-rank counts of an uneven split, the flag), comm_share (against track()'s records), trace (the
Chrome trace holds tp_ext's ops and tag ranges), doctor and `tp-ext doctor`."""

import gc
import json
import os

import pytest
import torch

import tp_ext
from tp_ext import comm

from .common import WORLD_SIZES, full
from .dist_utils import run_distributed


def _tiny_model(sp: bool):
    """A Qwen2 at TP = world size, or (sp) a Qwen2 block with sequence parallelism and its
    input's sequence shard."""
    from tests.test_pipeline import _config
    from tp_ext.layers import ParallelTransformerBlock
    from tp_ext.models import Qwen2ForCausalLM

    w = torch.distributed.get_world_size()
    state = tp_ext.init_parallel(tp=w)
    torch.manual_seed(0)
    if sp:
        block = ParallelTransformerBlock(64, 4, 2, 128, sequence_parallel=True)
        x = full((2, 8, 64), 1)
        return block, tp_ext.split_tensor(x, 1, w)[torch.distributed.get_rank()].contiguous()
    config = _config(2, False)
    model = Qwen2ForCausalLM(config, parallel=state)
    ids = torch.randint(0, config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    return model, ids


def _determinism(sp, fault):
    from tp_ext.debug import check_determinism

    model, ids = _tiny_model(sp)
    rank = torch.distributed.get_rank()
    calls = [0]
    target = None if sp else model.model.layers["1"].post_attention_layernorm
    if fault == "rank":  # a replicated activation that differs on one rank
        target.register_forward_hook(lambda m, a, out: out + 1e-3 * (rank == 1))
    if fault == "run":  # an output that changes from one forward to the next

        def drift(m, a, out):
            calls[0] += 1
            return out + 1e-3 * calls[0]

        target.register_forward_hook(drift)
    report = check_determinism(model, ids)
    return (
        report.ok,
        report.first_run_difference,
        report.first_rank_difference,
        report.compared_ranks,
        str(report),
    )


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_clean_models_are_deterministic(world):
    for ok, run_diff, rank_diff, compared, text in run_distributed(
        _determinism, world, False, None
    ):
        assert ok and run_diff is None and rank_diff is None, text
        assert compared > 10  # norms, attention and MLP outputs, layers, the logits
        assert text.startswith("deterministic:")


def test_sequence_parallel_shards_are_not_compared_across_ranks():
    for ok, _, rank_diff, compared, text in run_distributed(_determinism, 2, True, None):
        assert ok, text
        assert compared >= 1  # the rotary tables, replicated inside the attention


def test_a_rank_dependent_activation_is_found_and_named():
    for ok, run_diff, rank_diff, _, text in run_distributed(_determinism, 3, False, "rank"):
        assert not ok and run_diff is None
        # the first replicated output that differs, in forward order: the faulty norm
        assert rank_diff.startswith("model.layers.1.post_attention_layernorm#0"), rank_diff
        assert "NOT deterministic" in text


def test_a_run_dependent_output_is_found_and_named():
    for ok, run_diff, _, _, _ in run_distributed(_determinism, 2, False, "run"):
        assert not ok
        assert run_diff.startswith("model.layers.1.post_attention_layernorm output 0"), run_diff


def _balance():
    from tp_ext.debug import shard_balance
    from tp_ext.layers import ColumnParallelLinear

    layer = ColumnParallelLinear(4, 4)  # rows 4 over 3 ranks: 2, 1, 1
    x = full((3, 4), 1)
    report = shard_balance(layer, step=lambda: layer(x).sum().backward())
    return [(r.parameters, r.bytes, r.peak_bytes) for r in report.ranks], report.flagged


def test_shard_balance_counts_each_rank_and_flags_the_heavy_one():
    for ranks, flagged in run_distributed(_balance, 3):
        assert [(p, b) for p, b, _ in ranks] == [(10, 40), (5, 20), (5, 20)]
        assert all(peak > 0 for _, _, peak in ranks)
        assert flagged[0] == "rank 0: parameters 10 is 50% above the mean 7"
        assert flagged[1] == "rank 0: bytes 40 is 50% above the mean 27"


def _fsdp_peaks():
    """PeakMemory and torch's MemTracker over the same FSDP2 Trainer step (one micro-batch:
    MemTracker refuses a module called twice). FSDP2 frees each unit's gathered parameters by
    resizing their storage to 0 after its forward and backward."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from tp_ext.debug.memory import PeakMemory
    from tp_ext.models import Qwen2ForCausalLM
    from tp_ext.training import Trainer

    from .test_planner import _config

    state = tp_ext.init_parallel(tp=1, pp=1, dp=2)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM.from_config(_config(), parallel=state)
    adamw = lambda params: torch.optim.AdamW(params, lr=1e-3)  # noqa: E731
    trainer = Trainer(model, optimizer=adamw, parallel=state, data_parallel="fsdp")
    batches = [torch.randint(0, 1000, (2, 64), generator=torch.Generator().manual_seed(1))]
    trainer.step(batches)  # the optimizer state and FSDP2's buffers exist from here on
    # both count over the same step (two steps, one each, differed by a few hundred KB now and
    # then: a free landing a little later in one), with the cycle collector off during it
    gc.collect()
    gc.disable()
    try:
        tracker = MemTracker()
        tracker.track_external(model, trainer.optimizer)
        with tracker, PeakMemory(model.parameters(), trainer.optimizer) as memory:
            trainer.step(batches)
    finally:
        gc.enable()
    return memory.peak, tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def test_peak_memory_sees_fsdp2_free_its_gathered_parameters():
    """A storage resized in place counts at its new size (UntypedStorage.resize_ is not
    dispatched): on an FSDP2 step the peak equals MemTracker's, which tracks resizes too."""
    from tp_ext.debug.memory import PeakMemory

    for peak, tracked in run_distributed(_fsdp_peaks, 2):
        assert peak == tracked
    t = torch.empty(1000)
    with PeakMemory() as memory:
        t.untyped_storage().resize_(0)
        t.untyped_storage().resize_(4000)
        u = torch.empty(500)
    assert memory.peak == 4000 + 2000 and memory.live == 6000
    del u
    assert memory.live == 4000
    assert torch.UntypedStorage.resize_ is type(t.untyped_storage()).resize_  # restored


def _share():
    from tp_ext.debug import comm_share
    from tp_ext.layers import ParallelMLP

    torch.manual_seed(0)
    mlp = ParallelMLP(32, 64)
    x = full((4, 16, 32), 1).requires_grad_()

    def step():
        with comm.tag("mlp"):
            mlp(x).sum().backward()

    share = comm_share(step)
    return share.step_seconds, share.comm_seconds, share.by_tag, share.share, str(share)


def test_comm_share_is_the_tracked_seconds_over_the_step():
    for step_s, comm_s, by_tag, share, text in run_distributed(_share, 2):
        assert 0 < comm_s < step_s
        assert set(by_tag) == {"mlp"} and by_tag["mlp"] == pytest.approx(comm_s)
        assert share == pytest.approx(comm_s / step_s)
        assert "(measured)" in text


def _trace(directory):
    from tp_ext.debug import trace
    from tp_ext.layers import ParallelMLP

    mlp = ParallelMLP(32, 64)
    x = full((4, 16, 32), 1).requires_grad_()
    with trace(directory):
        with comm.tag("mlp_step"):
            mlp(x).sum().backward()
    with open(os.path.join(directory, f"trace_rank{torch.distributed.get_rank()}.json")) as f:
        names = {e.get("name", "") for e in json.load(f)["traceEvents"]}
    return "tp_ext.tag:mlp_step" in names, sorted(n for n in names if n.startswith("tp_ext::"))


def test_trace_shows_tags_and_tp_ext_ops(tmp_path):
    for has_tag, tp_ops in run_distributed(_trace, 2, str(tmp_path)):
        assert has_tag
        assert "tp_ext::reduce_from_tp" in tp_ops  # the row-parallel all-reduce


def test_doctor_reports_and_fails_on_a_version_mismatch(monkeypatch, capsys):
    from tp_ext import ops
    from tp_ext.cli import main
    from tp_ext.debug import doctor

    checks = {c.name: c for c in doctor()}
    assert checks["torch version"].status == "ok"
    assert checks["backends"].status == "ok" and "gloo" in checks["backends"].detail
    assert main(["doctor", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["name"] for r in rows} >= {"python", "torch version", "CUDA", "shared memory"}
    monkeypatch.setattr(ops._C, "_built_with_torch", lambda: "1.0.0")
    failed = [c for c in doctor() if c.status == "fail"]
    assert failed[0].name == "torch version"
    assert f"built with torch 1.0.0, this is torch {torch.__version__}" in failed[0].detail
    assert main(["doctor"]) == 1


@pytest.mark.parametrize(
    "name, value",
    [("TP_EXT_SHM", "maybe"), ("TP_EXT_SHM_SLOT_BYTES", "100"), ("TP_EXT_CHECK_COLLECTIVES", "2")],
)
def test_doctor_fails_on_a_tp_ext_variable_the_first_collective_would_refuse(
    monkeypatch, capsys, name, value
):
    from tp_ext.cli import main
    from tp_ext.debug import doctor

    for key in [k for k in os.environ if k.startswith("TP_EXT_")]:  # a developer's own too
        monkeypatch.delenv(key)
    monkeypatch.setenv("TP_EXT_SHM", "0")
    checks = {c.name: c for c in doctor()}
    assert checks["TP_EXT_* variables"].status == "ok"
    assert checks["TP_EXT_* variables"].detail == "TP_EXT_SHM"
    monkeypatch.setenv(name, value)
    failed = [c for c in doctor() if c.status == "fail"]
    assert [c.name for c in failed] == ["TP_EXT_* variables"]
    assert f"{name}='{value}' is not valid; use" in failed[0].detail
    assert main(["doctor"]) == 1
    assert f"{name}='{value}' is not valid" in capsys.readouterr().out
