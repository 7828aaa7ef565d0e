"""Expert-parallel groups (init_parallel(ep=E)): the EP and expert-DP groups against the rule
written out here rank by rank, at (tp, pp, dp, ep) dims from 3 to 8 ranks, and the error for
a degree that does not fit."""

import pytest
import torch
import torch.distributed as dist

import tp_ext
from tp_ext.distributed.mesh import expert_groups

from .dist_utils import run_distributed


def _expected(rank, tp, pp, dp, ep):
    """This rank's (EP group, expert-DP group), from its (p, d, t) coordinates."""
    p, rest = divmod(rank, dp * tp)
    d, t = divmod(rest, tp)
    at = lambda dd, tt: p * dp * tp + dd * tp + tt  # noqa: E731
    if dp % ep == 0:  # E consecutive DP ranks at one TP position
        k, j = divmod(d, ep)
        group = [at(k * ep + jj, t) for jj in range(ep)]
        replicas = [at(kk * ep + j, t) for kk in range(dp // ep)]
    else:  # all DP ranks and ep // dp consecutive TP ranks
        width = ep // dp
        m, u = divmod(t, width)
        group = [at(dd, m * width + uu) for dd in range(dp) for uu in range(width)]
        replicas = [at(d, mm * width + u) for mm in range(tp // width)]
    return group, sorted(replicas)


def _groups(tp, pp, dp, ep):
    state = tp_ext.init_parallel(tp=tp, pp=pp, dp=dp, ep=ep)
    return (
        dist.get_process_group_ranks(state.ep_group),
        sorted(dist.get_process_group_ranks(state.expert_dp_group)),
        state.ep_rank,
        state.ep,
    )


# (world, tp, pp, dp, ep). Every case makes process groups that live as long as the test
# pool's processes (and keep costing them a little CPU), so `make test` takes one of each path
# and `make test-all` the rest.
DIMS = [
    (4, 1, 1, 4, 2),  # from the DP ranks, replicas over DP
    (4, 2, 1, 2, 4),  # ep > dp: the TP ranks join the expert group
    (3, 1, 1, 3, 3),  # every rank its own experts
]
DIMS_FULL = [
    (4, 1, 1, 4, 4),
    (4, 2, 1, 2, 2),
    (4, 1, 1, 4, 1),
    (8, 2, 2, 2, 2),
    (8, 4, 1, 2, 4),
]


@pytest.mark.parametrize("case", DIMS, ids=str)
def test_expert_groups_follow_the_rule(case):
    _check_dims(case)


@pytest.mark.full_matrix
@pytest.mark.parametrize("case", DIMS_FULL, ids=str)
def test_expert_groups_follow_the_rule_full(case):
    _check_dims(case)


def _check_dims(case):
    world, tp, pp, dp, ep = case
    for rank, (group, replicas, ep_rank, degree) in enumerate(
        run_distributed(_groups, world, tp, pp, dp, ep)
    ):
        want_group, want_replicas = _expected(rank, tp, pp, dp, ep)
        assert group == want_group, (rank, group, want_group)
        assert replicas == want_replicas, (rank, replicas, want_replicas)
        assert ep_rank == want_group.index(rank) and degree == ep


def test_every_rank_is_in_one_group_of_each_kind():
    ranks = torch.arange(16).view(2, 4, 2)  # pp 2, dp 4, tp 2
    for ep in tp_ext.ParallelDims(tp=2, dp=4).ep_choices():
        ep_groups, edp_groups = expert_groups(ranks, ep)
        for groups in (ep_groups, edp_groups):
            assert sorted(r for g in groups for r in g) == list(range(16))
        assert all(len(g) == ep for g in ep_groups)
        # one rank of each EP group that holds the same expert shards: dp / ep of them at one
        # TP position, or (ep > dp, experts not split by TP) dp * tp / ep
        replicas = 4 // ep if 4 % ep == 0 else 4 * 2 // ep
        assert all(len(g) == replicas for g in edp_groups), (ep, edp_groups)


def _bad_ep():
    try:
        tp_ext.init_parallel(tp=1, dp=4, ep=3)
    except ValueError as e:
        return str(e)
    return None


def test_a_degree_that_does_not_fit_is_refused_with_what_would():
    message = run_distributed(_bad_ep, 4)[0]
    assert message == (
        "ep=3 does not fit a pipeline stage of dp=4 x tp=1 ranks: the expert group is taken from "
        "the DP ranks (ep dividing dp), then from the TP ranks too (dp times a divisor of tp); "
        "these work: [1, 2, 4]"
    )
    with pytest.raises(ValueError, match="ep must be an int >= 1, got 0"):
        tp_ext.init_parallel(tp=1, ep=0)
