"""ParallelDims: the one record of the parallel degrees, and its one resolver."""

import pytest

from tp_ext import ParallelDims


@pytest.mark.parametrize(
    "dims, world, want",
    [
        (ParallelDims(tp=2), 8, (2, 1, 4)),
        (ParallelDims(tp=2, pp=2), 8, (2, 2, 2)),
        (ParallelDims(pp=2, dp=2), 8, (2, 2, 2)),  # tp: the ranks PP and DP leave
        (ParallelDims(), 6, (6, 1, 1)),  # nothing given: all TP
        (ParallelDims(tp=3, dp=1), 3, (3, 1, 1)),
        (ParallelDims(tp=(2, 2)), 8, ((2, 2), 1, 2)),
    ],
)
def test_resolve_fills_the_open_degrees(dims, world, want):
    out = dims.resolve(world)
    assert (out.tp, out.pp, out.dp) == want
    assert out.world_size == world and out.resolved


def test_a_degree_that_does_not_fit_names_itself_and_what_works():
    with pytest.raises(ValueError) as e:
        ParallelDims(tp=2, pp=3).resolve(8, name=lambda f: f"--{f}", world_name="WORLD_SIZE")
    assert str(e.value) == (
        "--pp 3 does not fit the 8 ranks (WORLD_SIZE): tp x pp x dp must equal 8 (with tp=2); "
        "--pp values that work: [1, 2, 4]"
    )
    with pytest.raises(ValueError, match=r"dp 3 does not fit the 4 ranks .* work: \[2\]"):
        ParallelDims(tp=2, pp=1, dp=3).resolve(4)
    with pytest.raises(ValueError, match=r"tp 3 does not fit the 4 ranks .*\[1, 2, 4\]"):
        ParallelDims(tp=3).resolve(4)


def test_ep_must_fit_the_stage():
    assert ParallelDims(tp=2, ep=4).resolve(4).ep_choices() == [1, 2, 4]
    with pytest.raises(ValueError, match=r"ep=3 does not fit a pipeline stage of dp=4 x tp=1"):
        ParallelDims(tp=1, ep=3).resolve(4)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"tp": 0}, "tp must be an int >= 1 (1D tensor parallelism) or a pair (P, Q)"),
        ({"tp": (2, 0)}, "a pair (P, Q) of ints >= 1"),
        ({"pp": "2"}, "pp must be an int >= 1, got '2'"),
        ({"dp": True}, "dp must be an int >= 1, got True"),
        ({"ep": 0}, "ep must be an int >= 1, got 0"),
        ({"pp": 2**17}, "pp must be an int in [1, 65,536], got 131072"),
        ({"virtual_stages": 65}, "virtual_stages must be an int in [1, 64], got 65"),
    ],
)
def test_bad_degrees_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError) as e:
        ParallelDims(**kwargs)
    assert message in str(e.value)


def test_describe_and_round_trip():
    dims = ParallelDims(tp=(2, 3), pp=2, dp=1, ep=1, virtual_stages=2)
    assert dims.describe() == "tp=2x3 pp=2 dp=1 v=2"
    assert ParallelDims.from_dict(dims.as_dict()) == dims
    assert ParallelDims.from_dict({"tp": 2, "pp": 1, "dp": 2, "world": 4}) == ParallelDims(2, 1, 2)
    with pytest.raises(ValueError, match="call resolve"):
        ParallelDims(tp=2).world_size
    assert ParallelDims.tp_choices(8, pp=2) == [1, 2, 4]
