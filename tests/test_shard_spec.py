"""One layer contract for 1D and 2D: the ShardSpec protocol gives every rank the same blocks
as the 1D Partition and the 2D GridBlock always did (uneven splits, attention heads, replicated
KV heads, merged parts, grids), one ParallelModule base and one state-dict module serve both,
and the 2D model comes from a factory (the old constructor path warns)."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tp_ext.sharding import GridBlock, HeadLayout, Partition, ShardSpec, shard_range, shard_sizes

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _full(shape) -> torch.Tensor:
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape)


PARTITIONS = {
    "uneven 10 over 4": (Partition.split(10, 4), [[(0, 3)], [(3, 3)], [(6, 2)], [(8, 2)]]),
    "heads 6 q / 3 kv over 2": (
        HeadLayout(6, 3, 2).qkv_partition(2),
        [[(0, 8), (12, 4), (18, 4)], [(8, 4), (16, 2), (22, 2)]],
    ),
    "replicated kv 4 q / 1 kv over 3": (
        HeadLayout(4, 1, 3).qkv_partition(2),
        [[(0, 4), (8, 2), (10, 2)], [(4, 2), (8, 2), (10, 2)], [(6, 2), (8, 2), (10, 2)]],
    ),
    "merged gate/up 5+5 over 2": (
        Partition.merged([5, 5], 2),
        [[(0, 3), (5, 3)], [(3, 2), (8, 2)]],
    ),
}


@pytest.mark.parametrize("name", list(PARTITIONS))
@pytest.mark.parametrize("dim", [0, 1])
def test_partition_spec_gives_the_same_blocks(name, dim):
    partition, segments = PARTITIONS[name]
    assert [list(s) for s in partition.segments] == segments  # the layout itself is unchanged
    spec = partition.along(dim)
    assert isinstance(spec, ShardSpec) and spec == partition and spec.dim == dim
    shape = [3, 3]
    shape[dim] = partition.full
    full = _full(shape)
    rebuilt = torch.full_like(full, -1.0)
    for rank in range(partition.world_size):
        block = spec.take_block(full, rank)
        assert torch.equal(block, partition.local(full, dim, rank))  # what layers always took
        assert spec.full_shape_of(block.shape) == tuple(full.shape)
        other = 1 - dim
        assert spec.boxes(rank, block.shape) == [
            tuple((seg if d == dim else (0, full.size(other))) for d in range(2))
            for seg in segments[rank]
        ]
        spec.put_block(block, rebuilt, rank)
    assert torch.equal(rebuilt, full)


def test_partition_counts_each_replicated_row_once():
    spec = HeadLayout(4, 1, 3).kv_partition(2).along(0)  # one KV head over 3 ranks
    local = torch.ones(2, 5)
    assert torch.equal(spec.counted(local, 0), local)
    for rank in (1, 2):
        assert spec.counted(local, rank).shape == (0, 5)
    qkv = HeadLayout(4, 1, 3).qkv_partition(2).along(1)
    local = _full((2, qkv.local_size(1)))
    assert torch.equal(qkv.counted(local, 1), local[:, :2])  # its q rows; k and v are rank 0's
    plain = Partition.split(10, 4).along(0)
    assert plain.counted(local, 2) is local


def test_partition_holders_and_refusals():
    qkv = HeadLayout(4, 1, 3).qkv_partition(2)  # k and v rows 8..11 on all three ranks
    assert qkv.replicated and qkv.replicated_indices() == [8, 9, 10, 11]
    assert not Partition.split(10, 4).replicated
    overlap = Partition(10, [[(0, 6)], [(4, 6)]])
    assert overlap.replicated_indices() == [4, 5]
    with pytest.raises(ValueError, match="partition leaves index 4 of 10 on no rank"):
        Partition(10, [[(0, 4)], [(6, 4)]])
    with pytest.raises(ValueError, match=r"rank 1's segment \(offset 6, length 5\) lies outside"):
        Partition(10, [[(0, 6)], [(6, 5)]])


GRID_BLOCKS = {
    "weight 7x5 on 2x3": (
        GridBlock((7, 5), [("Q", shard_sizes(7, 3)), ("P", shard_sizes(5, 2))]),
        (2, 3),
    ),
    "embedding 11x4 on 3x2": (
        GridBlock((11, 4), [("P", shard_sizes(11, 3)), ("Q", shard_sizes(4, 2))]),
        (3, 2),
    ),
    "bias 7 on 2x3 (replicated over P)": (GridBlock((7,), [("Q", [3, 2, 2])]), (2, 3)),
}


@pytest.mark.parametrize("name", list(GRID_BLOCKS))
def test_grid_block_spec_gives_the_same_blocks(name):
    block, (rows, cols) = GRID_BLOCKS[name]
    assert isinstance(block, ShardSpec)
    full = _full(block.full_shape)
    rebuilt = torch.full_like(full, -1.0)
    counted = 0
    for row in range(rows):
        for col in range(cols):
            local = block.take_block(full, (row, col))
            assert torch.equal(local, block.take(full, row, col))  # what 2D layers always took
            assert block.boxes((row, col), local.shape) == [tuple(block.ranges(row, col))]
            assert block.full_shape_of(local.shape) == block.full_shape
            block.put_block(local, rebuilt, (row, col))
            mine = block.counted(local, (row, col))
            assert (mine is not None) == block.first_copy(row, col)
            counted += 0 if mine is None else mine.numel()
    assert torch.equal(rebuilt, full)
    assert counted == full.numel()  # every element counted exactly once over the grid


def test_partition_along_refuses_a_bad_dim():
    with pytest.raises(ValueError, match="dim must be an int >= 0"):
        Partition.split(4, 2).along(-1)


# ---- one base class, one state-dict module -----------------------------------------------------


def test_one_base_class_for_1d_and_2d_layers():
    from tp_ext.layers import ColumnParallelLinear, GridModule, Linear2D, ParallelModule
    from tp_ext.layers.summa_blocks import Embedding2D, RMSNorm2D

    for cls in (ColumnParallelLinear, Linear2D, Embedding2D, RMSNorm2D, GridModule):
        assert issubclass(cls, ParallelModule)


def test_state_dict_module_does_not_import_the_layers_base():
    """layers/base.py imports layers/state_dict.py; nothing points back, not even inside a
    function (the import circle of issue 34)."""
    tree = ast.parse((ROOT / "tp_ext/layers/state_dict.py").read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
            imported.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            imported.update(a.name for a in node.names)
    assert not any(m.startswith("tp_ext.layers") for m in imported), imported


def _specs_and_factory(rows: int, cols: int):
    import tp_ext
    from tp_ext.distributed.groups import ResolvedGroup
    from tp_ext.layers import Linear2D, full_state_dict, load_full_state_dict, tensor_specs
    from tp_ext.models import Qwen2Config, Qwen2ForCausalLM, Qwen2ForCausalLM2D

    state = tp_ext.init_parallel(tp=(rows, cols))
    grid = state.tp_grid
    lin = Linear2D(7, 5, True, grid)
    w, b = _full((5, 7)), _full((5,))
    load_full_state_dict(lin, {"weight": w, "bias": b})
    (name, tensor, spec, owner), _ = list(tensor_specs(lin))
    assert name == "weight" and owner is lin and isinstance(spec, GridBlock)
    assert owner.shard_coord == (grid.row, grid.col)
    out_start, out_n = shard_range(5, cols, grid.col)  # W's rows over the grid columns
    in_start, in_n = shard_range(7, rows, grid.row)  # its columns over the grid rows
    assert torch.equal(tensor, w[out_start : out_start + out_n, in_start : in_start + in_n])
    gathered = full_state_dict(lin)
    assert torch.equal(gathered["weight"], w) and torch.equal(gathered["bias"], b)
    assert [n for n, *_ in tensor_specs(lin)] == ["weight", "bias"]

    config = Qwen2Config(
        vocab_size=19,
        hidden_size=12,
        intermediate_size=10,
        num_hidden_layers=1,
        num_attention_heads=3,
        num_key_value_heads=3,  # whole KV heads on up to 3 grid columns
        max_position_embeddings=16,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM.from_config(config, parallel=state)
    assert type(model) is Qwen2ForCausalLM2D
    torch.manual_seed(0)
    direct = Qwen2ForCausalLM2D(config, parallel=state)
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), direct.parameters()))
    with pytest.raises(ValueError, match="from_config"):  # the 1D class does not build a grid
        Qwen2ForCausalLM(config, parallel=state)
    one_d = Qwen2ForCausalLM.from_config(config, tp_group=ResolvedGroup.local())
    assert type(one_d) is Qwen2ForCausalLM
    dist.barrier()
    return same


@pytest.mark.parametrize("rows, cols", [(1, 1), (1, 2), (2, 1), (1, 3), (2, 2)])
def test_unified_state_dict_and_the_model_factory(rows, cols):
    assert all(run_distributed(_specs_and_factory, rows * cols, rows, cols, timeout=300))
