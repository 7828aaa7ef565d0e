"""Around 3D training: the stage split, generation under TP x PP against transformers, bf16 and
fp16 (one rank's overflow skips the step on every rank), per-layer recompute exact with
dropout, and clear errors at construction for what cannot run (never a hang)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

import tp_ext
from tp_ext.models import Qwen2ForCausalLM, hf_to_tp_ext_names
from tp_ext.pipeline.schedules import (
    SCHEDULES,
    check_weight_split_supported,
    weight_split_supported,
)
from tp_ext.sharding import StageSplit, balanced_layer_split, shard_sizes
from tp_ext.training import Trainer

from .dist_utils import run_distributed
from .reference import hf_qwen2
from .test_pipeline import MAX_NORM, _config, _micro_batches, _optimizer, _reference

# ---- the stage split ----------------------------------------------------------------------------


def test_stage_split_divides_layers_by_the_shard_policy():
    split = StageSplit(10, pp=4)
    assert split.layer_counts == [3, 3, 2, 2]
    assert [list(split.layers_of(s)) for s in range(4)] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert [split.stages_of(r) for r in range(4)] == [[0], [1], [2], [3]]


def test_stage_split_orders():
    loop = StageSplit(8, pp=2, virtual_stages=2)
    assert [loop.stages_of(r) for r in range(2)] == [[0, 2], [1, 3]]
    v = StageSplit(8, pp=2, virtual_stages=2, order="v")
    assert [v.stages_of(r) for r in range(2)] == [[0, 3], [1, 2]]
    for stage_split in (loop, v, StageSplit(9, pp=3, virtual_stages=3)):
        for stage in range(stage_split.num_stages):
            assert stage in stage_split.stages_of(stage_split.rank_of(stage))
    split = StageSplit(5, pp=2, split=[1, 4])
    assert [list(split.layers_of(s)) for s in range(2)] == [[0], [1, 2, 3, 4]]


def test_balanced_split_with_equal_costs_is_the_shard_policy():
    for layers in range(1, 13):
        for stages in range(1, layers + 1):
            assert balanced_layer_split([7] * layers, stages) == shard_sizes(layers, stages)


def _compositions(total: int, parts: int):
    """Every list of ``parts`` ints >= 1 summing to ``total``."""
    for cuts in itertools.combinations(range(1, total), parts - 1):
        edges = (0, *cuts, total)
        yield [b - a for a, b in zip(edges, edges[1:])]


def test_balanced_split_makes_the_costliest_stage_cheapest():
    """Against every split of up to 8 layers: the least bottleneck, then the least sum of
    squared stage costs, then the most layers early."""
    rng = random.Random(0)
    for _ in range(300):
        layers, stages = rng.randint(1, 8), rng.randint(1, 4)
        if stages > layers:
            continue
        costs = [rng.randint(1, 9) for _ in range(layers)]
        first, last = rng.randint(0, 9), rng.randint(0, 30)

        def stage_costs(counts):
            starts = [sum(counts[:s]) for s in range(stages)]
            out = [sum(costs[a : a + c]) for a, c in zip(starts, counts)]
            out[0] += first
            out[-1] += last
            return out

        def rank(counts):
            cost = stage_costs(counts)
            return max(cost), sum(c * c for c in cost), [-c for c in counts]

        best = min(_compositions(layers, stages), key=rank)
        assert balanced_layer_split(costs, stages, first, last) == best, (costs, first, last)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_layers": 3, "pp": 4}, "3 decoder layers cannot fill 4 pipeline stages"),
        ({"num_layers": 4, "pp": 2, "virtual_stages": 3}, "cannot fill 6 pipeline stages"),
        ({"num_layers": 5, "pp": 2, "split": [2, 2]}, "summing to num_layers=5"),
        ({"num_layers": 5, "pp": 2, "split": [5, 0]}, "each >= 1"),
        ({"num_layers": 5, "pp": 2, "split": [1, 2, 2]}, "each of the 2 stages"),
        ({"num_layers": 8, "pp": 2, "order": "v"}, "needs virtual_stages=2"),
        ({"num_layers": 8, "pp": 2, "order": "zigzag"}, "stage_order must be one of"),
    ],
)
def test_stage_split_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StageSplit(**kwargs)


# ---- generation ---------------------------------------------------------------------------------


def _generate(tp, pp, order, tie):
    config = _config(4, tie)
    state = tp_ext.init_parallel(tp=tp, pp=pp)
    hf = hf_qwen2(config)
    model = Qwen2ForCausalLM(
        config, parallel=state, virtual_stages=2 if order == "v" else 1, stage_order=order
    )
    model.load_full_state_dict(hf_to_tp_ext_names(hf.state_dict(), config), strict=False)
    ids = _micro_batches(config, 1, seed=11)[0]
    with torch.no_grad():
        logits = model(ids)
    tokens = model.generate(ids, max_new_tokens=6)
    return logits, tokens


@pytest.mark.parametrize("tp, pp, order, tie", [(2, 2, "loop", False), (1, 2, "v", True)])
def test_generation_under_tp_x_pp_equals_transformers(tp, pp, order, tie):
    results = run_distributed(_generate, tp * pp, tp, pp, order, tie)
    hf = hf_qwen2(_config(4, tie))
    ids = _micro_batches(_config(4, tie), 1, seed=11)[0]
    with torch.no_grad():
        ref_logits = hf(ids).logits
    ref_tokens = hf.generate(ids, max_new_tokens=6, do_sample=False)
    for rank, (logits, tokens) in enumerate(results):
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5, msg=f"rank {rank}")
        assert torch.equal(tokens, ref_tokens), f"rank {rank}: {tokens} != {ref_tokens}"


def _forward_with_grad():
    state = tp_ext.init_parallel(tp=1, pp=2)
    model = Qwen2ForCausalLM(_config(4, False), parallel=state)
    model(torch.zeros(1, 4, dtype=torch.long))


def test_pipelined_forward_with_autograd_is_refused():
    with pytest.raises(Exception, match="inference only"):
        run_distributed(_forward_with_grad, 2)


# ---- mixed precision ----------------------------------------------------------------------------


def _train_mixed(dtype, overflow_rank=None):
    config = _config(4, False)
    state = tp_ext.init_parallel(tp=1, pp=2, dp=1)
    hf = hf_qwen2(config)
    model = Qwen2ForCausalLM(config, parallel=state)
    model.load_full_state_dict(hf_to_tp_ext_names(hf.state_dict(), config), strict=False)
    trainer = Trainer(
        model, optimizer=_optimizer, parallel=state, max_grad_norm=MAX_NORM, autocast_dtype=dtype
    )
    if overflow_rank == state.rank:  # one rank's gradient overflows in the first step only
        param = next(model.parameters())
        fired = []

        def poison(p):
            if not fired:
                fired.append(True)
                p.grad.fill_(float("inf"))

        param.register_post_accumulate_grad_hook(poison)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batches = _micro_batches(config, 2)
    losses = [trainer.step(batches)]
    unchanged = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    losses += [trainer.step(batches) for _ in range(3)]
    scaler = trainer.scaler
    return losses, unchanged, trainer.skipped_steps, None if scaler is None else scaler.get_scale()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mixed_precision_follows_fp32(dtype):
    results = run_distributed(_train_mixed, 2, dtype)
    ref_losses = _reference(4, False, 2)[0][:4]
    losses, unchanged, skipped, _ = results[0]
    assert results[1][0] == losses, "ranks disagree on the loss"
    assert not unchanged and skipped == 0
    torch.testing.assert_close(losses, ref_losses, rtol=2e-2, atol=0)
    assert losses[-1] < losses[0], f"the loss did not fall: {losses}"


@pytest.mark.parametrize("overflow_rank", [0, 1])
def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(overflow_rank):
    results = run_distributed(_train_mixed, 2, torch.float16, overflow_rank)
    clean = run_distributed(_train_mixed, 2, torch.float16)[0]
    for rank, (losses, unchanged, skipped, scale) in enumerate(results):
        assert unchanged, f"rank {rank} applied the overflowing step"
        assert skipped == 1, f"rank {rank} skipped {skipped} steps"
        assert scale == clean[3] / 2, f"rank {rank}'s loss scale {scale} was not backed off"
        assert losses[0] == clean[0][0], "the skipped step's loss is still reported"
        # the next steps start from the untouched weights: one step behind the clean run
        torch.testing.assert_close(losses[2:], clean[0][1:3], rtol=1e-2, atol=0)


# ---- activation recompute -----------------------------------------------------------------------


def _train_dropout(recompute: bool, dropout: float):
    config = _config(4, False, dropout)
    state = tp_ext.init_parallel(tp=2, pp=2, dp=1)
    hf = hf_qwen2(_config(4, False))
    model = Qwen2ForCausalLM(config, parallel=state)
    model.load_full_state_dict(hf_to_tp_ext_names(hf.state_dict(), config), strict=False)
    tp_ext.random.manual_seed(1234, state.tp_group)
    trainer = Trainer(
        model,
        optimizer=_optimizer,
        parallel=state,
        max_grad_norm=MAX_NORM,
        activation_checkpointing=recompute,
    )
    batches = _micro_batches(config, 2)
    losses = [trainer.step(batches) for _ in range(3)]
    full = model.full_state_dict()
    return losses, full if state.tp_rank == 0 else None


def test_activation_recompute_is_exact_with_dropout():
    plain = run_distributed(_train_dropout, 4, False, 0.1)
    recomputed = run_distributed(_train_dropout, 4, True, 0.1)
    without_dropout = run_distributed(_train_dropout, 4, False, 0.0)[0][0]
    assert plain[0][0] != without_dropout, "dropout did not act"
    for rank in range(4):
        assert recomputed[rank][0] == plain[rank][0], f"rank {rank}: losses differ"
        if plain[rank][1] is not None:
            for name, tensor in plain[rank][1].items():
                assert torch.equal(recomputed[rank][1][name], tensor), f"{name} differs"


# ---- errors at construction ---------------------------------------------------------------------


def _expect_error(build, message):
    try:
        build()
    except (ValueError, TypeError) as e:
        assert message in str(e), f"{message!r} not in {e}"
        return str(e)
    raise AssertionError(f"no error; expected one containing {message!r}")


def _errors_pp2():
    config = _config(4, False)
    state = tp_ext.init_parallel(tp=1, pp=2)
    model = Qwen2ForCausalLM(config, parallel=state)
    messages = [
        _expect_error(
            lambda: Qwen2ForCausalLM(_config(1, False), parallel=state),
            "1 decoder layers cannot fill 2 pipeline stages",
        ),
        _expect_error(lambda: Trainer(model, parallel=state, schedule="Bogus"), "'1F1B'"),
        _expect_error(
            lambda: Trainer(model, parallel=state, schedule="ZBVZeroBubble"),
            "virtual_stages=2, stage_order='v'",
        ),
        _expect_error(
            lambda: Trainer(Qwen2ForCausalLM(config), parallel=state),
            "built without parallel=",
        ),
        _expect_error(
            lambda: Trainer(model, parallel=state, dp_group=state.dp_group), "drop dp_group="
        ),
        _expect_error(
            lambda: Trainer(model, parallel=state, optimizer=lambda params: None),
            "must return a torch.optim.Optimizer",
        ),
    ]
    trainer = Trainer(model, parallel=state, schedule="1F1B")
    batches = _micro_batches(config, 2)
    messages.append(
        _expect_error(lambda: trainer.step(batches[:1]), "needs at least 2 (one per stage)")
    )
    messages.append(
        _expect_error(lambda: trainer.step([batches[0], batches[1][:1]]), "must have one shape")
    )
    # after refusing, the pipeline still trains
    loss = trainer.step(batches)
    return messages, loss


def test_impossible_combinations_fail_at_construction():
    results = run_distributed(_errors_pp2, 2, timeout=60)
    assert results[0][1] == results[1][1]


def _errors_dp2():
    state = tp_ext.init_parallel(tp=1, pp=1, dp=2)
    config = _config(4, False)
    model = Qwen2ForCausalLM(config, parallel=state)
    _expect_error(
        lambda: Trainer(model, parallel=state, data_parallel=None), "replicas would drift"
    )
    _expect_error(lambda: Trainer(model, parallel=state, data_parallel="zero"), "'ddp'")
    v = Qwen2ForCausalLM(_config(4, False), parallel=state, virtual_stages=2, stage_order="v")
    _expect_error(
        lambda: Trainer(v, parallel=state, schedule="ZBVZeroBubble", data_parallel="fsdp"),
        # on a torch whose zero-bubble gradients are wrong, that refusal comes first
        "FSDP2's reduce-scatter never sees" if weight_split_supported() else "needs torch >= 2.13",
    )


def test_data_parallel_errors():
    run_distributed(_errors_dp2, 2, timeout=60)


def test_zero_bubble_schedules_are_refused_on_a_torch_that_gets_them_wrong(monkeypatch):
    """torch 2.11's split backward gave weight gradients 4-10% off in norm (measured against
    one-process training); the schedules that use it are refused there, the others run."""
    plain = r"\['GPipe', '1F1B', 'Interleaved1F1B'\]"
    for name in ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"):
        schedule = SCHEDULES[name]
        with pytest.raises(
            ValueError,
            match=rf"^schedule '{name}' splits the backward into input and weight gradients, "
            rf"which gives wrong weight gradients with torch 2\.11\.0\+cu130 .* needs torch >= "
            rf"2\.13\. Upgrade torch, or use one of {plain}$",
        ):
            check_weight_split_supported(schedule, "2.11.0+cu130")
        for fine in ("2.13.0", "2.13.0a0+git1234", "3.0.0"):
            check_weight_split_supported(schedule, fine)
    for name in ("GPipe", "1F1B", "Interleaved1F1B"):
        check_weight_split_supported(SCHEDULES[name], "2.11.0")
    # a config names the field; the planner stops offering the V schedule
    from tp_ext.config import ConfigError, check_pipeline_fields
    from tp_ext.planner.search import _schedules

    monkeypatch.setattr(torch, "__version__", "2.12.1")
    values = {"schedule": "DualPipeV", "virtual_stages": 2, "pp": 2, "micro_batches": None}
    with pytest.raises(ConfigError, match=r"^parallel\.schedule: schedule 'DualPipeV' splits"):
        check_pipeline_fields(values, lambda f: f"parallel.{f}")
    assert ("ZBVZeroBubble", 2) not in _schedules(_config(4, False), 2, 4)
    monkeypatch.setattr(torch, "__version__", "2.13.0")
    check_pipeline_fields(values, lambda f: f"parallel.{f}")
    assert ("ZBVZeroBubble", 2) in _schedules(_config(4, False), 2, 4)


# ---- memory: each rank holds only its stages ---------------------------------------------------


EMBED = "model.embed_tokens.weight"


def _held(tp, pp, tie):
    config = _config(5, tie)
    state = tp_ext.init_parallel(tp=tp, pp=pp)
    model = Qwen2ForCausalLM(config, parallel=state)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}, model.stage_ids


@pytest.mark.parametrize("tp, pp, tie", [(1, 4, False), (2, 2, True)])
def test_each_rank_holds_only_its_stages(tp, pp, tie):
    config = _config(5, tie)
    full = {n: tuple(p.shape) for n, p in Qwen2ForCausalLM(config).named_parameters()}
    split = StageSplit(5, pp)
    held = run_distributed(_held, tp * pp, tp, pp, tie)
    union = set()
    for rank, (names, stages) in enumerate(held):
        pp_rank = rank // tp
        assert stages == [pp_rank]
        layers = {f"model.layers.{i}." for i in split.layers_of(pp_rank)}
        for name in names:
            first, last = name.startswith("model.embed_tokens"), not name.startswith("model.")
            assert (
                any(name.startswith(prefix) for prefix in layers)
                or (first and pp_rank == 0)
                or ((last or name == "model.norm.weight") and pp_rank == pp - 1)
            ), f"rank {rank} (stage {pp_rank}) holds {name}"
        union |= set(names)
        shard_elems = sum(torch.Size(s).numel() for s in names.values())
        shapes = dict(full, **{"lm_head.weight": full.get("lm_head.weight", full[EMBED])})
        full_elems = sum(torch.Size(shapes[n]).numel() for n in names)
        assert shard_elems <= full_elems // tp + 2 * config.vocab_size, "more than its TP slice"
    # a tied head keeps its own copy on the last stage under pipelining
    assert union == set(full) | ({"lm_head.weight"} if tie else set())


# ---- inference after FSDP2 training -------------------------------------------------------------


def _train_then_generate(data_parallel):
    config = _config(4, False)
    state = tp_ext.init_parallel(tp=1, pp=2, dp=2)
    hf = hf_qwen2(config)
    model = Qwen2ForCausalLM(config, parallel=state)
    model.load_full_state_dict(hf_to_tp_ext_names(hf.state_dict(), config), strict=False)
    trainer = Trainer(model, optimizer=_optimizer, parallel=state, data_parallel=data_parallel)
    batches = _micro_batches(config, 4)
    trainer.step(batches[state.dp_rank * 2 : state.dp_rank * 2 + 2])
    ids = _micro_batches(config, 1, seed=11)[0]
    with trainer.whole_parameters(), torch.no_grad():
        return model(ids), model.generate(ids, max_new_tokens=4)


def test_generation_after_fsdp_training_equals_ddp():
    fsdp = run_distributed(_train_then_generate, 4, "fsdp")
    ddp = run_distributed(_train_then_generate, 4, "ddp")
    for rank in range(4):
        torch.testing.assert_close(fsdp[rank][0], ddp[rank][0], rtol=1e-5, atol=1e-6)
        assert torch.equal(fsdp[rank][1], ddp[rank][1])
