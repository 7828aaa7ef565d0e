"""``tp_ext.serving.Engine``: continuous batching over a paged KV cache, for tp_ext's Qwen2 and
transformers decoders converted by ``parallelize`` (TP x PP; EP within TP for MoE models).

Every rank of the model runs the same engine on the same requests in the same order (the server
hands each step's new requests and cancellations to every rank first), so every rank schedules
the same rows, takes the same blocks and calls the same collectives. A step:

1. the scheduler picks rows: requests and how many of their tokens to compute
   (:mod:`tp_ext.serving.scheduler`);
2. the rows run through the model, decode rows (one token each) in one forward and prompt
   chunks in another, each left-padded to its longest row, their keys and values stored in and
   read from the paged cache (:mod:`tp_ext.serving.kv_cache`); at pp > 1 through the stages in
   turn (:class:`_Stages`);
3. each row that reached the end of its tokens gets its next token from this rank's vocabulary
   shard of the logits (:mod:`tp_ext.layers.sampling`: greedy, or drawn from the request's own
   seeded generator, so the same seed gives the same tokens at any TP);
4. requests that end (EOS, a stop token, ``max_tokens``, the context) free their blocks.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from tp_ext.generation.decoders import as_decoder
from tp_ext.layers.sampling import check_sampling, vocab_parallel_argmax, vocab_parallel_sample
from tp_ext.serving.kv_cache import BlockPool, PagedKV, PagedStep, StepSlots
from tp_ext.serving.scheduler import FinishReason, Request, SamplingParams, Scheduler
from tp_ext.sharding import shard_offsets, shard_sizes

__all__ = ["Engine", "StepOutput"]


@dataclasses.dataclass(frozen=True)
class StepOutput:
    """What one step gave one request: its new token (None when it only read prompt, or was
    cancelled) and, when it ended, why."""

    request_id: str
    token: Optional[int]
    finish_reason: Optional[FinishReason] = None


class Engine:
    """``model``: this rank's part of the model (tp_ext's Qwen2 or a converted transformers
    decoder). ``num_blocks`` blocks of ``block_size`` positions hold the KV cache (or
    ``kv_cache_memory`` bytes per rank decide how many); ``max_num_seqs`` requests run at once,
    ``max_num_batched_tokens`` tokens a step; ``max_model_len``: a request's prompt and output
    together (default: the model's context)."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        parallel=None,
        num_blocks: Optional[int] = None,
        kv_cache_memory: Optional[int] = None,
        block_size: int = 16,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 256,
        max_model_len: Optional[int] = None,
        prefix_caching: bool = True,
    ):
        self.decoder = as_decoder(model, parallel)
        self.stages = _Stages(self.decoder)
        _positive(block_size=block_size, max_num_seqs=max_num_seqs)
        _positive(max_num_batched_tokens=max_num_batched_tokens)
        self.max_model_len = max_model_len or self.decoder.max_positions
        if self.max_model_len is None:
            raise ValueError("Engine: give max_model_len (the model's config does not say)")
        if num_blocks is None:
            num_blocks = self._blocks_in(kv_cache_memory, block_size, max_num_seqs)
        _positive(num_blocks=num_blocks)
        self.pool = BlockPool(num_blocks, block_size, prefix_caching)
        self.cache = PagedKV(num_blocks, block_size, self.decoder.device)
        self.scheduler = Scheduler(self.pool, max_num_seqs, max_num_batched_tokens)
        self.requests: dict[str, Request] = {}
        eos, _ = self.decoder.generation_defaults()
        self.eos = tuple([eos] if isinstance(eos, int) else (eos or ()))
        self.generated_tokens = 0

    # -- requests ------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: Sequence[int], params: SamplingParams) -> None:
        """Queue ``prompt`` (token ids); a bad argument is a ValueError naming it."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already running")
        self.check_request(list(prompt), params)
        request = Request(request_id, prompt, params, self.eos)
        self.requests[request_id] = request
        self.scheduler.add(request)

    def check_request(self, prompt: list, params: SamplingParams) -> None:
        vocab = self.decoder.vocab_size
        if not prompt or any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt must be 1 or more token ids in [0, {vocab}), got {prompt!r}")
        if params.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {params.max_tokens}")
        if not params.greedy:
            check_sampling(params.temperature, params.top_k, params.top_p)
        total = len(prompt) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"this model's context is {self.max_model_len} tokens; the prompt's "
                f"{len(prompt)} tokens and max_tokens={params.max_tokens} need {total}: shorten "
                "the prompt or lower max_tokens"
            )
        blocks = self.scheduler.blocks_for(total)
        if blocks > self.pool.num_blocks:
            raise ValueError(
                f"the prompt and max_tokens need {blocks} KV-cache blocks, the cache has "
                f"{self.pool.num_blocks}: lower max_tokens or give the cache more memory"
            )

    def abort(self, request_id: str) -> Optional[StepOutput]:
        """Cancel a request (its blocks are free at once); None when it is not running."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self.scheduler.remove(request)
        request.finish_reason = FinishReason.ABORT
        return StepOutput(request_id, None, FinishReason.ABORT)

    @property
    def has_work(self) -> bool:
        return bool(self.requests)

    def stats(self) -> dict:
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "kv_cache_blocks_used": self.pool.used,
            "kv_cache_blocks_total": self.pool.num_blocks,
            "preemptions": self.scheduler.preemptions,
        }

    # -- one step ------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self) -> list[StepOutput]:
        """Run the next rows; every request's new token and, for those that ended, why."""
        rows = self.scheduler.schedule()
        if not rows:
            return []
        decode = [row for row in rows if row.new == 1]
        prefill = [row for row in rows if row.new > 1]
        outputs = []
        for group in (decode, prefill):
            if group:
                outputs += self._run(group)
        return outputs

    def _run(self, rows) -> list[StepOutput]:
        logits = self._forward(rows)  # [rows, V_r]: each row's last position (the last stage's)
        sampling = [i for i, row in enumerate(rows) if row.samples]
        for row in rows:
            before, size = row.request.computed, self.pool.block_size
            row.request.computed += row.new
            if row.request.computed // size > before // size:  # a block filled: findable now
                self.pool.remember(row.request.tokens, row.request.blocks, row.request.computed)
        requests = [rows[i].request for i in sampling]
        tokens = self._choose(requests, logits[sampling]) if logits is not None else None
        tokens = self.stages.share(tokens, len(sampling))
        return [self._advance(r, t) for r, t in zip(requests, tokens)]

    def _forward(self, rows) -> Optional[torch.Tensor]:
        requests = [row.request for row in rows]
        cached = [r.computed for r in requests]
        new = [row.new for row in rows]
        device = self.decoder.device
        slots = StepSlots(
            [r.blocks for r in requests], cached, new, self.pool.block_size,
            self.cache.scratch, device,
        )  # fmt: skip
        width = max(new)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        positions = torch.zeros(len(rows), width, dtype=torch.long)
        for i, (r, c, n) in enumerate(zip(requests, cached, new)):
            ids[i, width - n :] = torch.tensor(r.tokens[c : c + n])
            positions[i, width - n :] = torch.arange(c, c + n)
        return self.stages.run(ids.to(device), positions.to(device), slots, self.cache)

    def _choose(self, requests: list, logits: torch.Tensor) -> list[int]:
        """Each request's next token (greedy rows together; sampled rows by their rule)."""
        chosen = [0] * len(requests)
        by_rule: dict = {}
        for i, r in enumerate(requests):
            p = r.params
            by_rule.setdefault(None if p.greedy else (p.temperature, p.top_k, p.top_p), []).append(
                i
            )
        vocab, group = self.decoder.vocab_size, self.decoder.vocab_group
        for rule, members in sorted(by_rule.items(), key=lambda kv: str(kv[0])):
            shard = logits[members]
            if rule is None:
                tokens = vocab_parallel_argmax(shard, vocab, group)
            else:
                draws = [torch.rand(1, dtype=torch.float64, generator=requests[i].generator)
                         for i in members]  # fmt: skip
                uniform = torch.cat(draws).to(shard.device)
                tokens = vocab_parallel_sample(shard, uniform, vocab, *rule, group)
            for i, token in zip(members, tokens.tolist()):
                chosen[i] = token
        return chosen

    def _advance(self, request: Request, token: int) -> StepOutput:
        request.output.append(token)
        self.generated_tokens += 1
        if token in request.stops:
            request.finish_reason = FinishReason.STOP
        elif len(request.output) >= request.params.max_tokens:
            request.finish_reason = FinishReason.LENGTH
        if request.finished:
            self.scheduler.remove(request)
            del self.requests[request.request_id]
        return StepOutput(request.request_id, token, request.finish_reason)

    # -- sizing the cache ----------------------------------------------------------------------

    def _blocks_in(self, memory: Optional[int], block_size: int, max_num_seqs: int) -> int:
        """Blocks ``memory`` bytes per rank hold (default: every running request at the full
        context), measured by one step of one token through a probe cache."""
        if memory is None:
            return max_num_seqs * -(-self.max_model_len // block_size)
        per_position = self._bytes_per_position()
        blocks = int(memory) // (per_position * block_size)
        if blocks < 1:
            raise ValueError(
                f"kv_cache_memory={memory} bytes holds no block of {block_size} positions "
                f"({per_position * block_size} bytes a block on this rank)"
            )
        return blocks

    def _bytes_per_position(self) -> int:
        probe = PagedKV(1, 1, self.decoder.device)
        slots = StepSlots([[0]], [0], [1], 1, probe.scratch, self.decoder.device)
        zero = torch.zeros(1, 1, dtype=torch.long, device=self.decoder.device)
        with torch.no_grad():
            self.stages.run(zero, zero, slots, probe)
        return probe.nbytes() // 2  # two slots: the position and the scratch


class _Stages:
    """A step's rows through this rank's pipeline stages. At pp > 1 the rows go in ``pp``
    micro-batches, each rank running its stages' tasks in the order (micro-batch, stage): a
    stage's input from the previous stage's rank (or this rank), its output sent on without
    waiting, so each stage works on the next micro-batch while the next stage takes the last
    one (any such order is a topological order of the tasks, so it cannot deadlock; both sides
    of a link see the same order, as NCCL, which ignores tags, needs). The last stage's ranks
    choose the tokens and send them to the other stages' ranks (every rank's scheduler must see
    them). At pp = 1: the one stage, all rows at once."""

    def __init__(self, decoder):
        self.decoder, self.split = decoder, decoder.stage_split
        self.group = decoder.pp_group

    def _peer(self, stage: int) -> int:
        return dist.get_global_rank(self.group, self.split.rank_of(stage))

    def _moves(self, stage: int) -> bool:
        """Whether ``stage``'s output goes to another rank."""
        split = self.split
        return stage < split.last_stage and split.rank_of(stage + 1) != split.rank_of(stage)

    def run(self, ids, positions, slots: StepSlots, paged: PagedKV) -> Optional[torch.Tensor]:
        """This rank's vocabulary shard of each row's last logits (None off the last stage)."""
        rows = ids.size(0)
        groups = min(self.split.pp, rows)
        sizes, offsets = shard_sizes(rows, groups), shard_offsets(rows, groups)
        sends, outs = [], []
        for m, (o, n) in enumerate(zip(offsets, sizes)):
            part = slice(o, o + n)
            out = self._micro_batch(m, ids[part], positions[part], slots.rows(part), paged, sends)
            outs.append(out)
        for work, _ in sends:
            work.wait()
        return torch.cat(outs) if self.split.last_stage in self.decoder.stage_ids else None

    def _micro_batch(self, m: int, ids, positions, slots: StepSlots, paged: PagedKV, sends):
        decoder, mine, split = self.decoder, set(self.decoder.stage_ids), self.split
        where = torch.arange(slots.past, slots.length, device=ids.device)
        x = out = ids
        for stage in (s for s in range(split.num_stages) if s in mine):
            tag = m * split.num_stages + stage
            if stage > 0 and self._moves(stage - 1):
                shape = decoder.activation_shape(ids.size(0), ids.size(1))
                x = torch.empty(shape, dtype=decoder.dtype, device=ids.device)
                dist.recv(x, self._peer(stage - 1), self.group, tag=tag - 1)
            with decoder.paged_step(PagedStep(paged, slots)) as cache:
                out = decoder.run(stage, x, cache, slots.key_mask, positions, where)
            if self._moves(stage):
                out = out.contiguous()
                sends.append((dist.isend(out, self._peer(stage + 1), self.group, tag=tag), out))
            x = out
        return out

    def share(self, tokens: Optional[list], count: int) -> list:
        """The chosen tokens on every stage's ranks (from the last stage's rank)."""
        if self.group is None or count == 0:
            return tokens or []
        box = torch.zeros(count, dtype=torch.long, device=self.decoder.device)
        if tokens is not None:
            box.copy_(torch.tensor(tokens))
        dist.broadcast(box, self._peer(self.split.last_stage), self.group)
        return box.tolist()


def _positive(**values) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"Engine: {name} must be an int >= 1, got {value!r}")
