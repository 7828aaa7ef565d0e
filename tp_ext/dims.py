"""The parallel degrees of a job: one frozen record that every layer above reads.

``ParallelDims`` is the only class that holds degrees. The config's ``parallel:`` section, the
CLI's flags, the planner's candidates, :func:`tp_ext.init_parallel`, the checkpoint manifest and
the Trainer all take or give one, and :meth:`ParallelDims.resolve` is the one place that fills
the degrees left open from the world size and says which values fit when a degree does not::

    dims = ParallelDims(tp=2, pp=2).resolve(8)   # dp = 8 / (2 * 2) = 2
    dims.describe()                              # 'tp=2 pp=2 dp=2'
    ParallelDims(tp=(2, 2)).resolve(4)           # a 2 x 2 grid of 2D tensor parallelism

Degrees left None are the ones :meth:`resolve` fills: ``dp`` takes the ranks TP and PP leave
(at least one); ``tp`` (when None) takes the ranks PP and DP leave.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional, Union

from tp_ext.sharding import divisors
from tp_ext.validation import check_int

__all__ = ["ParallelDims", "grid_shape_of"]

# Degrees up to 2**16 ranks, far beyond any cluster tp_ext targets.
MAX_DEGREE = 2**16
# More pipeline stages per rank than this is never faster: each adds a send per micro-batch.
MAX_VIRTUAL_STAGES = 64

TPDegree = Union[int, tuple[int, int]]


def grid_shape_of(tp) -> tuple[int, int]:
    """``tp`` as the shape (P, Q) of a 2D grid of tensor parallelism, both ints >= 1."""
    ok = isinstance(tp, (tuple, list)) and len(tp) == 2
    ok = ok and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in tp)
    if not ok:
        raise ValueError(
            f"tp must be an int >= 1 (1D tensor parallelism) or a pair (P, Q) of ints >= 1 "
            f"(a P x Q grid of 2D tensor parallelism), got {tp!r}"
        )
    return int(tp[0]), int(tp[1])


def _plain(field: str) -> str:
    return field


@dataclasses.dataclass(frozen=True)
class ParallelDims:
    """How many ranks each form of parallelism takes.

    - ``tp``: ranks per tensor-parallel group (an int), or ``(P, Q)``: a P x Q grid of 2D tensor
      parallelism (P * Q ranks); None: the ranks the others leave (:meth:`resolve`).
    - ``pp``: pipeline ranks, each holding ``virtual_stages`` stages.
    - ``dp``: data-parallel replicas; None: the ranks TP and PP leave.
    - ``ep``: expert-parallel ranks, taken from the DP ranks of a stage (``ep`` dividing dp),
      then also from its TP ranks (dp times a divisor of tp).
    - ``cp``: context-parallel ranks, each holding a part of every sequence's positions
      (:mod:`tp_ext.layers.context`); next to TP in the rank order (TP innermost, then CP).
    """

    tp: Optional[TPDegree] = None
    pp: int = 1
    dp: Optional[int] = None
    ep: int = 1
    virtual_stages: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        if self.tp is not None and not (isinstance(self.tp, int) and not isinstance(self.tp, bool)):
            object.__setattr__(self, "tp", grid_shape_of(self.tp))
        elif self.tp is not None and self.tp < 1:
            grid_shape_of(self.tp)  # the message that names both forms
        check_int("pp", self.pp, 1, MAX_DEGREE)
        if self.dp is not None:
            check_int("dp", self.dp, 1, MAX_DEGREE)
        check_int("ep", self.ep, 1, MAX_DEGREE)
        check_int("virtual_stages", self.virtual_stages, 1, MAX_VIRTUAL_STAGES)
        check_int("cp", self.cp, 1, MAX_DEGREE)
        if self.tp_size is not None:
            check_int("tp", self.tp_size, 1, MAX_DEGREE)

    # ---- what the degrees give ------------------------------------------------------------

    @property
    def grid(self) -> Optional[tuple[int, int]]:
        """The (P, Q) shape of 2D tensor parallelism, or None for 1D."""
        return self.tp if isinstance(self.tp, tuple) else None

    @property
    def tp_size(self) -> Optional[int]:
        """Ranks per TP group (P * Q for a grid); None until resolved."""
        return None if self.tp is None else math.prod(self.grid or (self.tp,))

    @property
    def resolved(self) -> bool:
        return self.tp is not None and self.dp is not None

    @property
    def world_size(self) -> int:
        self._need_resolved("world_size")
        return self.tp_size * self.cp * self.pp * self.dp

    @property
    def stages(self) -> int:
        """Pipeline stages in all: pp x virtual_stages."""
        return self.pp * self.virtual_stages

    @property
    def pp_enabled(self) -> bool:
        """Whether a step runs on a pipeline: several stages (over ranks, or virtual ones)."""
        return self.stages > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def replicas(self) -> int:
        """The ranks that hold the same (dense) weights: dp x cp (unresolved: None)."""
        return None if self.dp is None else self.dp * self.cp

    def _need_resolved(self, what: str) -> None:
        if not self.resolved:
            raise ValueError(
                f"ParallelDims.{what}: {self} leaves degrees open; call resolve(world_size) first"
            )

    def replace(self, **changes) -> "ParallelDims":
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict:
        """The degrees as plain values (a grid as a list), for JSON and manifests."""
        out = dataclasses.asdict(self)
        if self.grid is not None:
            out["tp"] = list(self.grid)
        return out

    @classmethod
    def from_dict(cls, values: dict) -> "ParallelDims":
        """The inverse of :meth:`as_dict` (unknown keys, e.g. an old manifest's, are ignored)."""
        known = {f.name for f in dataclasses.fields(cls)}
        given = {k: v for k, v in values.items() if k in known}
        if isinstance(given.get("tp"), list):
            given["tp"] = tuple(given["tp"])
        return cls(**given)

    def describe(self) -> str:
        """``tp=2 pp=2 dp=2`` (a grid as ``tp=2x2``; ep and virtual stages when not 1)."""
        tp = "?" if self.tp is None else ("x".join(map(str, self.grid)) if self.grid else self.tp)
        parts = [f"tp={tp}", f"pp={self.pp}", f"dp={'?' if self.dp is None else self.dp}"]
        if self.cp > 1:
            parts.append(f"cp={self.cp}")
        if self.ep > 1:
            parts.append(f"ep={self.ep}")
        if self.virtual_stages > 1:
            parts.append(f"v={self.virtual_stages}")
        return " ".join(parts)

    # ---- the one resolver -----------------------------------------------------------------

    def resolve(
        self,
        world_size: int,
        name: Callable[[str], str] = _plain,
        world_name: str = "world_size",
    ) -> "ParallelDims":
        """These degrees over ``world_size`` ranks, every degree filled: dp (None) takes the
        ranks TP, CP and PP leave; tp (None) the ranks CP, PP and DP leave (dp then defaults
        to 1).

        An error names the first degree that does not fit, and the values of it that would;
        ``name`` spells a degree in it (``--pp`` for a flag, ``parallel.pp`` for a config
        field), ``world_name`` the world size (``WORLD_SIZE`` under torchrun)."""
        check_int(world_name, world_size, 1, None)
        fixed = {k: v for k, v in (("pp", self.pp), ("dp", self.dp), ("tp", self.tp_size))
                 if v is not None}  # fmt: skip
        if self.cp > 1:
            fixed["cp"] = self.cp
        free = self.dp is None or self.tp is None
        product = 1
        for i, (key, value) in enumerate(fixed.items()):
            product *= value
            last = i == len(fixed) - 1
            if world_size % product == 0 and (free or not last or product == world_size):
                continue
            raise ValueError(self._misfit(key, value, fixed, free, world_size, name, world_name))
        tp, dp = self.tp, self.dp
        if tp is None:
            dp = dp or 1
            tp = world_size // (self.pp * dp * self.cp)
        elif dp is None:
            dp = world_size // (self.tp_size * self.pp * self.cp)
        dims = self.replace(tp=tp, dp=dp)
        dims.check_ep(name)
        return dims

    @staticmethod
    def _misfit(key, value, fixed, free, world_size, name, world_name) -> str:
        others = {k: v for k, v in fixed.items() if k != key}
        rest = math.prod(others.values())
        works = [d for d in divisors(world_size) if world_size % (d * rest) == 0]
        if not free:
            works = [d for d in works if d * rest == world_size]
        given = ", ".join(f"{k}={v}" for k, v in others.items())
        product = "tp x cp x pp x dp" if "cp" in fixed else "tp x pp x dp"
        return (
            f"{name(key)} {value} does not fit the {world_size} ranks ({world_name}): {product} "
            f"must equal {world_size}{f' (with {given})' if given else ''}; "
            + (
                f"{name(key)} values that work: {works}"
                if works
                else f"no value of {name(key)} works with {given}"
            )
        )

    def ep_choices(self) -> list[int]:
        """Expert-parallel degrees that fit a stage of these dp x tp ranks: the divisors of dp,
        and dp times a divisor of tp."""
        self._need_resolved("ep_choices")
        return sorted(set(divisors(self.dp)) | {self.dp * t for t in divisors(self.tp_size)})

    def check_ep(self, name: Callable[[str], str] = _plain) -> None:
        if self.ep in self.ep_choices():
            return
        raise ValueError(
            f"{name('ep')}={self.ep} does not fit a pipeline stage of dp={self.dp} x "
            f"tp={self.tp_size} ranks: the expert group is taken from the DP ranks (ep dividing "
            f"dp), then from the TP ranks too (dp times a divisor of tp); these work: "
            f"{self.ep_choices()}"
        )

    @staticmethod
    def tp_choices(world_size: int, pp: int = 1) -> list[int]:
        """TP degrees that fit ``world_size`` ranks with pipeline degree ``pp``."""
        return [] if world_size % pp else divisors(world_size // pp)
