"""Every parallel form composes with every other (issue 56): tensor parallelism (1D, or a 2D
grid), sequence parallelism, pipelining under a schedule, DDP / FSDP2 / ZeRO-1 / ZeRO-2, expert
and context parallelism, on tp_ext's native Qwen2 and transformers' Llama, GPT-2, Gemma 2 and
Mixtral. Each combination trains three AdamW steps with clipping like one process training the
unsharded model on every replica's micro-batches: the same losses and gradient norms at every
step (1e-5 relative), the same weights after.

The combinations are the pairwise cover of the forms (:func:`pairwise_cases`: every value of
every form meets every value of every other form in some case, on a model that runs both), at
most 8 ranks each. ``make test`` runs :data:`SAMPLED` (every runner, every gradient-sync row,
every loss kind, each family); ``make test-all`` (``--full-matrix``) the whole cover.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Optional, Union

import pytest
import torch

import tp_ext
from tp_ext.layers import full_state_dict
from tp_ext.models import Qwen2ForCausalLM, hf_to_tp_ext_names
from tp_ext.training import Trainer

from .dist_utils import run_distributed
from .reference import hf_qwen2, train_in_one_process
from .test_pipeline import (
    LR,
    MAX_NORM,
    MULTI_SCHEDULES,
    V_SCHEDULES,
    ZERO_BUBBLE,
    assert_training_matches,
)
from .test_pipeline import _config as native_config
from .test_pipeline_hf import _hf_model

STEPS = 3
MICRO_BATCH, SEQ = 2, 12  # rows per micro-batch, tokens per row
VOCAB = 101


@dataclasses.dataclass(frozen=True)
class Case:
    """One combination: ``tp`` an int (1D) or (P, Q) (a 2D grid, tp_ext's Qwen2 only)."""

    arch: str  # "qwen2" (tp_ext's own), "llama", "gpt2", "gemma2", "mixtral"
    tp: Union[int, tuple] = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    sp: bool = False
    schedule: str = "1F1B"
    data_parallel: str = "ddp"

    @property
    def pipeline_weight_split(self) -> bool:
        """A zero-bubble schedule: it writes weight gradients outside autograd."""
        return self.pp > 1 and self.schedule in ZERO_BUBBLE

    @property
    def micro_batches(self) -> int:
        """Per replica: 2, or one per stage where the schedule needs that many."""
        return max(2, self.pp * _stages(self.schedule)["virtual_stages"])

    @property
    def world(self) -> int:
        return math.prod(self.tp if isinstance(self.tp, tuple) else (self.tp,)) * (
            self.pp * self.dp * self.cp
        )

    def __str__(self) -> str:
        tp = "x".join(map(str, self.tp)) if isinstance(self.tp, tuple) else self.tp
        parts = [self.arch, f"tp{tp}", f"pp{self.pp}", f"dp{self.dp}"]
        parts += [f"cp{self.cp}"] if self.cp > 1 else []
        parts += [f"ep{self.ep}"] if self.ep > 1 else []
        parts += ["sp"] if self.sp else []
        parts += [self.schedule] if self.pp > 1 else []
        return "-".join(parts + [self.data_parallel])


def _stages(schedule: str) -> dict:
    return dict(
        virtual_stages=2 if schedule in V_SCHEDULES + MULTI_SCHEDULES else 1,
        stage_order="v" if schedule in V_SCHEDULES else "loop",
    )


def _micro_batches(count: int):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=g) for _ in range(count)]


def _optimizer(params):
    # eps 1e-6 in both runs (as tests/test_pipeline.py): near-zero gradients' rounding stays small
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.0, eps=1e-6)


def _native_config():
    return native_config(4, False).replace(vocab_size=VOCAB)


def _reference_model(arch: str):
    return hf_qwen2(_native_config()) if arch == "qwen2" else _hf_model(arch)


@functools.lru_cache(maxsize=None)
def _reference(arch: str, grid: bool, total: int):
    """The unsharded model trained in one process on every replica's micro-batches: losses,
    norms before clipping, and the weights after under the tested model's names."""
    model = _reference_model(arch)
    optimizer = _optimizer(model.parameters())
    losses, norms = train_in_one_process(model, _micro_batches(total), STEPS, optimizer, MAX_NORM)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if arch == "qwen2" and not grid:  # the 1D model fuses q, k, v and gate, up
        weights = hf_to_tp_ext_names(weights, _native_config())
    return losses, norms, weights


def _model(case: Case, state):
    if case.arch == "qwen2":
        config = _native_config()
        model = Qwen2ForCausalLM.from_config(config, parallel=state, **_stages(case.schedule))
        full = _reference_model("qwen2").state_dict()
        grid = isinstance(case.tp, tuple)
        model.load_full_state_dict(full if grid else hf_to_tp_ext_names(full, config), strict=False)
        return model
    return tp_ext.parallelize(
        _reference_model(case.arch),
        "auto",
        parallel=state,
        sequence_parallel=case.sp,
        **_stages(case.schedule),
    )


def _train(case: Case):
    state = tp_ext.init_parallel(tp=case.tp, pp=case.pp, dp=case.dp, cp=case.cp, ep=case.ep)
    model = _model(case, state)
    trainer = Trainer(
        model,
        optimizer=_optimizer,
        parallel=state,
        schedule=case.schedule,
        max_grad_norm=MAX_NORM,
        data_parallel=case.data_parallel,
    )
    micro = case.micro_batches
    batches = _micro_batches(micro * case.dp)
    mine = batches[state.dp_rank * micro : (state.dp_rank + 1) * micro]
    losses, norms = [], []
    for _ in range(STEPS):
        losses.append(trainer.step(mine))
        norms.append(trainer.last_grad_norm)
    with trainer.whole_parameters():
        weights = full_state_dict(model)  # this rank's stages, gathered over TP (and DP shards)
    tied = [n for n in weights if n == "lm_head.weight"] if _tied(case) else []
    return losses, norms, {k: v for k, v in weights.items() if k not in tied}


def _tied(case: Case) -> bool:
    return case.arch == "gpt2"  # the head's copy of the embedding is not a weight of its own


def check(case: Case) -> None:
    results = run_distributed(_train, case.world, case, timeout=900)
    ref_losses, ref_norms, ref_weights = _reference(
        case.arch, isinstance(case.tp, tuple), case.micro_batches * case.dp
    )
    if _tied(case):
        ref_weights = {k: v for k, v in ref_weights.items() if k != "lm_head.weight"}
    assert_training_matches(results, ref_losses, ref_norms, ref_weights)


# ---- the cases -----------------------------------------------------------------------------------

SAMPLED = [
    Case("qwen2", tp=2, dp=2, data_parallel="fsdp"),
    Case("qwen2", tp=(2, 1), dp=2, data_parallel="fsdp"),
    Case("qwen2", tp=2, cp=2, data_parallel="fsdp"),
    Case("qwen2", pp=2, cp=2, schedule="Interleaved1F1B", data_parallel="zero2"),
    Case("llama", tp=2, pp=2, sp=True),
    Case("mixtral", dp=2, ep=2, cp=2, data_parallel="zero2"),
    Case("mixtral", tp=2, pp=2, ep=2),
    Case("mixtral", dp=4, ep=2, data_parallel="fsdp"),  # experts' FSDP2 units on their mesh
    Case("gpt2", pp=2, dp=2, data_parallel="fsdp"),
    Case("gemma2", tp=2, dp=2, sp=True, data_parallel="zero1"),
    Case("mixtral", pp=2, dp=2, cp=2, ep=2, schedule="GPipe"),
    # CP through sliding windows and soft-capped scores
    Case("gemma2", pp=2, cp=2, schedule="Interleaved1F1B", data_parallel="fsdp"),
]


@pytest.mark.parametrize("case", SAMPLED, ids=str)
def test_sampled_combinations_train_like_one_process(case):
    check(case)


# ---- the whole cover (make test-all) -------------------------------------------------------------

# every value of each form
FORMS = {
    "arch": ("qwen2", "llama", "gpt2", "gemma2", "mixtral"),
    "tp": (1, 2, (2, 1), (1, 2)),
    "pipeline": (
        (1, "1F1B"),
        (2, "GPipe"),
        (2, "1F1B"),
        (2, "Interleaved1F1B"),
        (2, "InterleavedZeroBubble"),
        (2, "ZBVZeroBubble"),
        (2, "DualPipeV"),
    ),
    "dp": (1, 2),
    "cp": (1, 2),
    "ep": (1, 2),
    "sp": (False, True),
    "data_parallel": ("ddp", "fsdp", "zero1", "zero2"),
}


def refusal(case: Case) -> Optional[str]:
    """Why ``case`` does not run (the error tp_ext gives, in short), or None: it runs."""
    grid, hf = isinstance(case.tp, tuple), case.arch != "qwen2"
    tp = math.prod(case.tp) if grid else case.tp
    rules = [
        (case.world > 8, "more than 8 ranks"),
        (grid and hf, "2D grids are tp_ext's Qwen2's"),
        (case.sp and (not hf or tp == 1), "sequence parallelism: parallelize's, at tp > 1"),
        (case.ep > 1 and case.arch != "mixtral", "expert parallelism needs experts"),
        (case.ep > 1 and case.ep not in _ep_choices(case.dp, tp), "ep does not fit dp x tp"),
        (case.dp * case.cp == 1 and case.data_parallel != "ddp", "one replica: no DP engine"),
        (
            case.pipeline_weight_split and case.data_parallel == "fsdp",
            "FSDP2 never sees a zero-bubble schedule's weight gradients",
        ),
    ]
    return next((why for refused, why in rules if refused), None)


def _ep_choices(dp: int, tp: int) -> list:
    return tp_ext.ParallelDims(tp=tp, dp=dp).ep_choices()


def _case(values: dict) -> Case:
    pp, schedule = values["pipeline"]
    rest = {k: v for k, v in values.items() if k != "pipeline"}
    return Case(pp=pp, schedule=schedule, **rest)


def _pairs(values: dict) -> set:
    items = sorted(values.items(), key=lambda kv: kv[0])
    return {(a, repr(x), b, repr(y)) for (a, x), (b, y) in itertools.combinations(items, 2)}


@functools.lru_cache(maxsize=None)
def pairwise_cases() -> tuple:
    """A pairwise cover of :data:`FORMS`: every pair of values of two forms that some running
    case holds is held by a case here (greedy: each next case holds the most pairs not yet
    held; ties go to the first in FORMS's order, so the list is the same on every run)."""
    candidates = []
    for combo in itertools.product(*FORMS.values()):
        values = dict(zip(FORMS, combo))
        case = _case(values)
        if refusal(case) is None:
            candidates.append((case, _pairs(values)))
    uncovered = set().union(*(pairs for _, pairs in candidates))
    chosen = []
    while uncovered:
        case, pairs = max(candidates, key=lambda c: len(c[1] & uncovered))
        chosen.append(case)
        uncovered -= pairs
    return tuple(chosen)


@pytest.mark.full_matrix
@pytest.mark.parametrize("case", pairwise_cases(), ids=str)
def test_every_pair_of_forms_trains_like_one_process(case):
    check(case)


def test_the_cover_holds_every_pair_and_the_sampled_cases_run():
    """The cover holds every pair of form values that any running case holds, and every sampled
    case is one that runs (so a refusal that comes back is caught here first)."""
    cover = pairwise_cases()
    held = set().union(*(_pairs(_values(c)) for c in cover))
    for combo in itertools.product(*FORMS.values()):
        values = dict(zip(FORMS, combo))
        if refusal(_case(values)) is None:
            assert _pairs(values) <= held, values
    assert all(refusal(c) is None for c in SAMPLED)
    assert len(cover) < 80, len(cover)


def _values(case: Case) -> dict:
    fields = dataclasses.asdict(case)
    fields["pipeline"] = (fields.pop("pp"), fields.pop("schedule"))
    return fields
