"""Training batches from a token file, per data-parallel rank, with a resumable position.

- Sequences: sample ``i`` is ids ``[i * (S - 1), i * (S - 1) + S)`` of the file: windows of the
  model's sequence length ``S`` overlapping by one id, so every id but the first is a prediction
  target exactly once (the Trainer predicts ``ids[:, t + 1]`` from position ``t``).
- Order: an endless stream of epochs, epoch ``e`` a permutation of the samples drawn from a
  generator seeded with ``seed + e`` (the same on every machine and rank).
- Steps: a step takes the next ``global_batch`` samples of the stream; DP rank ``r`` of ``d``
  takes the ``r``-th of ``d`` equal contiguous parts and cuts it into micro-batches. A step is
  therefore the same sequences whatever ``d`` is, which is what lets a checkpoint saved at one
  data-parallel degree resume at another with the same data.
- State: the number of samples consumed (plus what must match to continue), JSON-able, through
  ``state_dict()`` / ``load_state_dict()``: the Stateful protocol of
  torch.distributed.checkpoint and torchdata's StatefulDataLoader.
"""

from __future__ import annotations

import torch

from tp_ext.data.tokens import TokenFile
from tp_ext.validation import check_int, is_number

__all__ = ["TokenBatches"]

# What must be equal for a saved position to mean the same data.
_SAME_DATA = ("seed", "seq_len", "global_batch", "num_samples", "file_tokens")


class TokenBatches:
    """This DP rank's micro-batches of every training step, from a :class:`TokenFile`::

    batches = TokenBatches(TokenFile("train.bin"), seq_len=1024, global_batch=64,
                           micro_batch_size=4, dp_rank=state.dp_rank, dp_size=state.dp)
    trainer.step(next(batches))     # global_batch / (dp_size * micro_batch_size)
                                    # int64 tensors [micro_batch_size, seq_len]
    """

    def __init__(
        self,
        tokens: TokenFile,
        *,
        seq_len: int,
        global_batch: int,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 1234,
        vocab_size=None,
    ) -> None:
        if not isinstance(tokens, TokenFile):
            raise TypeError(f"tokens must be a tp_ext.data.TokenFile, got {type(tokens).__name__}")
        self.tokens = tokens
        self.seq_len = check_int("seq_len", seq_len, 2)
        self.global_batch = check_int("global_batch", global_batch)
        self.micro_batch_size = check_int("micro_batch_size", micro_batch_size)
        self.dp_size = check_int("dp_size", dp_size)
        if isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be an int in [0, {dp_size}), got {dp_rank!r}")
        self.dp_rank = dp_rank
        self.seed = check_int("seed", seed, 0)
        if vocab_size is not None:
            check_int("vocab_size", vocab_size)
        self.vocab_size = vocab_size
        per_step = dp_size * micro_batch_size
        if global_batch % per_step:
            works = [b for b in range(per_step, 4 * per_step + 1, per_step)]
            raise ValueError(
                f"global_batch {global_batch} must be divisible by dp_size x micro_batch_size = "
                f"{dp_size} x {micro_batch_size} = {per_step} (every DP rank takes whole "
                f"micro-batches of the same step); values that work: {works}"
            )
        self.num_samples = (len(tokens) - 1) // (seq_len - 1)
        if self.num_samples < 1:
            raise ValueError(
                f"{tokens.path} has {len(tokens)} tokens, too few for one sequence of seq_len "
                f"{seq_len} (needs {seq_len})"
            )
        self.consumed_samples = 0
        self._orders: dict[int, torch.Tensor] = {}

    @property
    def micro_batches(self) -> int:
        """Micro-batches per step on this rank."""
        return self.global_batch // (self.dp_size * self.micro_batch_size)

    @property
    def epoch(self) -> int:
        """The epoch the next sample comes from."""
        return self.consumed_samples // self.num_samples

    def _sample(self, k: int) -> int:
        """The file sample at place ``k`` of the stream."""
        epoch, place = divmod(k, self.num_samples)
        order = self._orders.get(epoch)
        if order is None:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            order = torch.randperm(self.num_samples, generator=generator)
            self._orders = {e: o for e, o in self._orders.items() if e == epoch - 1}
            self._orders[epoch] = order  # a step spans at most two epochs' orders
        return int(order[place])

    def __iter__(self):
        return self

    def __next__(self) -> list[torch.Tensor]:
        per_rank = self.global_batch // self.dp_size
        first = self.consumed_samples + self.dp_rank * per_rank
        samples = [self._sample(k) for k in range(first, first + per_rank)]
        rows = torch.stack(
            [self.tokens.read(i * (self.seq_len - 1), self.seq_len) for i in samples]
        )
        if self.vocab_size is not None:
            self._check_vocab(rows, samples)
        self.consumed_samples += self.global_batch
        return list(rows.split(self.micro_batch_size))

    def _check_vocab(self, rows: torch.Tensor, samples: list[int]) -> None:
        too_big = rows >= self.vocab_size
        if bool(too_big.any()):
            row, col = (int(i) for i in too_big.nonzero()[0])
            position = samples[row] * (self.seq_len - 1) + col
            raise ValueError(
                f"{self.tokens.path}: token id {int(rows[row, col])} at position {position} is "
                f"outside the model's vocabulary (vocab_size {self.vocab_size}): a token file "
                "of another tokenizer?"
            )

    def state_dict(self) -> dict:
        """The position, and what must match to continue from it (plain ints: JSON-able)."""
        return {
            "consumed_samples": self.consumed_samples,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "global_batch": self.global_batch,
            "num_samples": self.num_samples,
            "file_tokens": len(self.tokens),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (of any DP degree: the stream does not depend on it)."""
        if not isinstance(state, dict) or "consumed_samples" not in state:
            raise ValueError(
                f"state must be a dict from TokenBatches.state_dict(), got {state!r:.100}"
            )
        mine = self.state_dict()
        for key in _SAME_DATA:
            if key in state and state[key] != mine[key]:
                raise ValueError(
                    f"the saved data position has {key}={state[key]}, these batches "
                    f"{key}={mine[key]}: it would continue over other data"
                    + (
                        "; keep the global batch of the saved run (the DP degree may change)"
                        if key == "global_batch"
                        else ""
                    )
                )
        consumed = state["consumed_samples"]
        if not is_number(consumed) or consumed < 0 or consumed % self.global_batch:
            raise ValueError(
                f"consumed_samples must be a multiple of global_batch {self.global_batch} (whole "
                f"steps), got {consumed!r}"
            )
        self.consumed_samples = int(consumed)

    def __repr__(self) -> str:
        return (
            f"TokenBatches({self.tokens!r}, seq_len={self.seq_len}, global_batch="
            f"{self.global_batch}, micro_batch_size={self.micro_batch_size}, dp {self.dp_rank}/"
            f"{self.dp_size}, consumed_samples={self.consumed_samples})"
        )
