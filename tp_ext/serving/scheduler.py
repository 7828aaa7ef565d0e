"""Which requests run in the engine's next step, and how many of their tokens (continuous
batching with chunked prefill, as vLLM's scheduler does it).

Each step has a budget of tokens. Running requests come first: a decoding request takes one
token; one still reading its prompt takes the rest of it, up to the budget (the prompt is read
in chunks between decode steps, so a long prompt never stalls the others for long). Then waiting
requests join, oldest first, while the budget, ``max_num_seqs`` and the free blocks allow,
first reusing the cached blocks of a prompt prefix they share with an earlier request. When a
running request needs a block and none is free, the request that joined last is preempted: its
blocks are freed and it waits at the head of the queue, to be recomputed from its prompt and
the tokens it has produced so far (its output is kept).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import math
import time
from typing import Optional

import torch

from tp_ext.serving.kv_cache import BlockPool

__all__ = ["SamplingParams", "Request", "Scheduler", "FinishReason"]


class FinishReason(str, enum.Enum):
    STOP = "stop"  # an EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens, or the model's context
    ABORT = "abort"  # cancelled (the client went away, or the server stops)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """One request's decoding: greedy at ``temperature`` 0, else sampled with ``top_k`` and
    ``top_p`` from a generator seeded with ``seed`` (one uniform draw per token, so the same
    seed gives the same tokens at any TP size). ``stop_token_ids`` end it besides the model's
    EOS (unless ``ignore_eos``); stop strings are matched on the text by the server."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    seed: int = 0
    stop_token_ids: tuple = ()
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Request:
    """A prompt, what it has produced, and where its keys are."""

    def __init__(self, request_id: str, prompt: list, params: SamplingParams, eos: tuple):
        self.request_id, self.prompt, self.params = request_id, list(prompt), params
        self.output: list[int] = []
        self.blocks: list[int] = []  # its block table
        self.computed = 0  # tokens whose keys are in its blocks
        self.stops = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else frozenset(eos)
        )
        self.generator = torch.Generator().manual_seed(params.seed)
        self.finish_reason: Optional[FinishReason] = None
        self.arrival = time.monotonic()

    @property
    def tokens(self) -> list:
        return self.prompt + self.output

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class ScheduledRow:
    request: Request
    new: int  # tokens of it this step computes

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of its tokens (its last logits give the next)."""
        return self.request.computed + self.new == len(self.request.tokens)


class Scheduler:
    def __init__(self, pool: BlockPool, max_num_seqs: int, max_num_batched_tokens: int):
        self.pool = pool
        self.max_num_seqs, self.token_budget = max_num_seqs, max_num_batched_tokens
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.preemptions = 0

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.pool.block_size)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Take a finished or cancelled request out, freeing its blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.pool.release(request.blocks)
        request.blocks = []

    def schedule(self) -> list[ScheduledRow]:
        budget = self.token_budget
        rows: list[ScheduledRow] = []
        for request in list(self.running):
            if budget == 0:
                break
            if request not in self.running:  # preempted by an earlier row of this step
                continue
            new = min(len(request.tokens) - request.computed, budget)
            if not self._grow(request, request.computed + new, rows):
                continue  # it preempted itself
            rows.append(ScheduledRow(request, new))
            budget -= new
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            row = self._admit(self.waiting[0], budget)
            if row is None:
                break
            self.waiting.popleft()
            self.running.append(row.request)
            rows.append(row)
            budget -= row.new
        return rows

    def _admit(self, request: Request, budget: int) -> Optional[ScheduledRow]:
        """The first chunk of a waiting request, its cached prefix reused; None when its blocks
        do not fit now."""
        tokens = request.tokens
        cached = self.pool.cached_prefix(tokens)
        request.blocks, request.computed = cached, len(cached) * self.pool.block_size
        new = min(len(tokens) - request.computed, budget)
        more = self.blocks_for(request.computed + new) - len(cached)
        blocks = self.pool.allocate(more)
        if blocks is None:
            self.pool.release(cached)
            request.blocks, request.computed = [], 0
            return None
        request.blocks += blocks
        return ScheduledRow(request, new)

    def _grow(self, request: Request, tokens: int, rows: list) -> bool:
        """Blocks for ``tokens`` of a running request, preempting the latest-joined others (or
        itself, False) until they fit."""
        more = self.blocks_for(tokens) - len(request.blocks)
        while more > 0:
            blocks = self.pool.allocate(more)
            if blocks is not None:
                request.blocks += blocks
                return True
            victim = self.running[-1]
            self._preempt(victim)
            rows[:] = [row for row in rows if row.request is not victim]
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.pool.release(request.blocks)
        request.blocks, request.computed = [], 0
        self.waiting.appendleft(request)
        self.preemptions += 1
