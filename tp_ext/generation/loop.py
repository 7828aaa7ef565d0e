"""``tp_ext.generate``: batched, left-padded, greedy or sampled decoding with a KV cache, for
tp_ext's Qwen2 and for Hugging Face causal LMs converted by ``parallelize``, under TP x PP
(and EP; and CP at pp = 1: each CP rank runs every step on its share of the KV cache, see
:mod:`tp_ext.parallelize.context`).

The batch is split into micro-batches that are in flight together: each rank runs its stages'
tasks in the order (step, micro-batch, stage), receiving a task's input from the previous
stage's rank (or, on the first stage after the prompt, the token the last stage chose) and
sending its output on without waiting. With as many micro-batches as stages, every stage works
while the others do; with one, each waits for the rest (a pipeline bubble per token). Any rank
order of tasks that is a topological order of their dependencies cannot deadlock, and
(step, micro-batch, stage) is one; each kind of message has its own tag, so messages between
two ranks pair up by tag (gloo). NCCL ignores tags and pairs messages by order alone: there one
micro-batch at a time keeps a single chain of messages per step. torch.distributed.pipelining's
schedules are for training (a fixed set of micro-batches through forward and backward); they
have no KV caches, no loop fed back from the last stage and no early stop, hence this loop.

The step is shared with the serving engine (:class:`tp_ext.serving.Engine`): both run a
stage through :meth:`Decoder.run <tp_ext.generation.decoders.Decoder.run>` and choose tokens
with the same vocabulary-parallel argmax and sampler; the engine hands the step a paged KV cache
(:meth:`Decoder.paged_step`) where this loop hands it one contiguous cache per micro-batch. What
this loop keeps of its own is what a fixed batch needs and a request queue does not: one
generator's draws per step for the whole batch (the same tokens however rows are split), rows
that end as transformers' ``generate`` pads them, and context parallelism's split cache.

A micro-batch stops when each of its sequences has produced an EOS (or at ``max_new_tokens``):
the first stage, which sees the tokens, sends a stop down the stages in place of the next
step's input. Under expert parallelism across data-parallel replicas every EP rank must run
every forward, so there the loop runs the full ``max_new_tokens`` and the output is cut where
transformers' would end.
"""

from __future__ import annotations

import functools
import time
import zlib
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist

from tp_ext.distributed import comm
from tp_ext.generation.decoders import Decoder, as_decoder
from tp_ext.layers.sampling import check_sampling, vocab_parallel_argmax, vocab_parallel_sample
from tp_ext.sharding import shard_offsets, shard_sizes

__all__ = ["generate"]

_STOP = object()  # what a stage hands the next in place of a micro-batch's input: it stopped


class _MicroBatch:
    """The state of one micro-batch of rows on this rank."""

    def __init__(self, rows: slice, prompt, mask, new: int, decoder: Decoder, stages, length):
        self.rows, self.prompt = rows, prompt
        batch, width = prompt.shape
        ones = torch.ones(batch, new, dtype=mask.dtype, device=mask.device)
        self.mask = torch.cat([mask, ones], dim=1)  # every step appends a real token
        self.positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # as transformers'
        self.cache = {s: decoder.new_cache(batch, length, s) for s in stages}  # per stage
        self.live = {s: True for s in stages}  # per stage of this rank: still running
        self.finished = torch.zeros(batch, dtype=torch.bool, device=prompt.device)
        self.tokens: list[torch.Tensor] = []  # each step's chosen tokens (first / last stage)
        self.steps = 0  # steps this rank ran of it
        self.handoff: dict = {}  # stage -> input from a stage on this rank

    def inputs(self, t: int):
        """``(key_mask, position_ids, cache_position)`` of step ``t``."""
        width = self.prompt.size(1)
        if t == 0:
            cache_position = torch.arange(width, device=self.prompt.device)
            return self.mask[:, :width], self.positions, cache_position
        position = self.positions[:, -1:] + t
        cache_position = torch.tensor([width + t - 1], device=self.prompt.device)
        return self.mask[:, : width + t], position, cache_position

    def advance(self, token: torch.Tensor, eos: Optional[torch.Tensor], pad: Optional[int]):
        """Record step's ``token`` ([rows]): a finished row's becomes ``pad``; a row whose token
        is an EOS is finished from now on (as transformers' generate)."""
        if pad is not None:
            token = torch.where(self.finished, torch.full_like(token, pad), token)
        if eos is not None:
            self.finished |= torch.isin(token, eos)
        self.tokens.append(token)


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None,
    max_new_tokens: Optional[int] = None,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    eos_token_id: Union[None, int, Sequence[int]] = None,
    pad_token_id: Optional[int] = None,
    seed: Optional[int] = None,
    *,
    micro_batches: Optional[int] = None,
    max_cache_len: Optional[int] = None,
    parallel=None,
    return_report: bool = False,
):
    """The prompts ``input_ids`` ``[batch, prompt_len]`` followed by up to ``max_new_tokens``
    new tokens each, ``[batch, prompt_len + new]``, the same tensor on every rank of the model.
    Every rank of the job calls it with the same arguments (data replicas may pass prompts of
    their own); a bad or mismatched argument is an error on every rank.

    ``model``: tp_ext's Qwen2 (``parallel=state``: TP x PP) or a Hugging Face causal LM converted
    by ``tp_ext.parallelize(..., parallel=state)`` (at pp > 1 this rank's stages; any (tp, pp,
    ep), or (tp, cp, ep) at pp = 1). ``attention_mask``: 1 at real tokens, 0 at the left
    padding of shorter prompts (as a tokenizer with ``padding_side="left"`` gives). An
    encoder-decoder (T5, BART; TP at pp = 1) reads the prompts with its encoder, once, padded at
    either end, and returns its decoder start token and the new tokens
    ``[batch, 1 + new]``, as transformers' generate does. The model's forced first and last
    tokens (``forced_bos_token_id`` / ``forced_eos_token_id``) are forced here too. Greedy, or
    with ``do_sample=True`` drawn by ``temperature``, ``top_k`` and ``top_p``
    (:mod:`tp_ext.layers.sampling`: the logits are never gathered); step t draws
    ``torch.rand(batch, dtype=float64)`` from a generator seeded with ``seed`` (None: a seed
    from global rank 0), one number per row. A sequence ends at any of
    ``eos_token_id`` (None: the model's generation config's, as transformers' generate reads
    it); after it its row holds ``pad_token_id`` (None: the model's, else the first EOS), and
    generation stops when every row has ended.

    ``micro_batches``: how many groups of rows are in flight through the pipeline (default: pp,
    at most the batch; 1 under NCCL, which cannot match several in flight, and when experts are
    spread over data replicas). ``max_cache_len``: the KV cache's positions (default
    prompt_len + max_new_tokens). ``parallel``: the ParallelState (default: the model's, else
    :func:`tp_ext.parallel_state`). ``return_report=True`` returns ``(tokens, report)``: this
    rank's KV-cache bytes, seconds, seconds to the first token and tokens per second.
    """
    arguments = dict(locals())  # every argument, checked on every rank before anything runs
    start = time.perf_counter()
    decoder = as_decoder(model, parallel)
    world = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    check = functools.partial(_checked, decoder, **arguments)
    args = comm.everywhere(world, "generate", check, ValueError)
    ids, mask, eos, pad, groups, length = args
    _check_agreement(decoder, world, ids, mask, arguments)
    if do_sample and seed is None:  # one seed for every rank
        drawn = torch.randint(0, 2**62, (1,)).to(decoder.device)  # NCCL has no CPU tensors
        seed = int(comm.broadcast(drawn, 0, group=world).item())
    generator = torch.Generator().manual_seed(seed) if do_sample else None
    mbs = _micro_batches(decoder, ids, mask, groups, max_new_tokens, length)
    runner = _Runner(decoder, mbs, max_new_tokens, eos, pad, _early_stop(decoder))
    choose = _chooser(decoder, ids.size(0), generator, temperature, top_k, top_p)
    choose = _forcing(decoder, choose, decoder.prefix(ids).size(1), max_new_tokens)
    with decoder.decoding():
        first_token_s = runner.run(choose, start)
    out = _collect(decoder, mbs, ids, eos, pad)
    if not return_report:
        return out
    width = decoder.prefix(ids).size(1)
    return out, _report(decoder, mbs, out, width, groups, start, first_token_s)


def _micro_batches(decoder: Decoder, ids, mask, groups: int, new: int, length: int) -> list:
    """The batch's rows in ``groups`` contiguous micro-batches (sizes by :func:`shard_sizes`)."""
    batch = ids.size(0)
    stages = decoder.stage_ids
    sizes, offsets = shard_sizes(batch, groups), shard_offsets(batch, groups)
    return [
        _MicroBatch(
            slice(o, o + n),
            ids[o : o + n],
            mask[o : o + n],
            new,
            decoder,
            stages,
            length,
        )
        for o, n in zip(offsets, sizes)
    ]


def _chooser(decoder: Decoder, batch: int, generator, temperature, top_k, top_p):
    """``choose(t, micro-batch, logits)``: the step's tokens of those rows, greedy when
    ``generator`` is None, else drawn from one uniform number per row of the whole batch (the
    same draws however the rows are split into micro-batches)."""
    draws: dict[int, torch.Tensor] = {}

    def choose(t: int, mb: _MicroBatch, logits: torch.Tensor) -> torch.Tensor:
        if generator is None:
            return vocab_parallel_argmax(logits, decoder.vocab_size, decoder.vocab_group)
        if t not in draws:  # steps come in order: the generator advances once per step
            draws[t] = torch.rand(batch, dtype=torch.float64, generator=generator)
        uniform = draws[t][mb.rows].to(logits.device)
        return vocab_parallel_sample(
            logits, uniform, decoder.vocab_size, temperature, top_k, top_p, decoder.vocab_group
        )

    return choose


def _forcing(decoder: Decoder, choose, width: int, max_new: int):
    """``choose`` with the model's forced tokens (transformers' ForcedBOS / ForcedEOS logits
    processors): the first token of an output that holds one token before it, and the token of
    the last step."""
    bos, eos = decoder.forced_tokens()
    eos = eos[0] if isinstance(eos, (list, tuple)) else eos
    if bos is None and eos is None:
        return choose

    def forced(t: int, mb: _MicroBatch, logits: torch.Tensor) -> torch.Tensor:
        token = choose(t, mb, logits)
        if bos is not None and width + t == 1:
            return torch.full_like(token, bos)
        if eos is not None and t == max_new - 1:
            return torch.full_like(token, eos)
        return token

    return forced


def _report(decoder: Decoder, mbs, out, width: int, groups: int, start: float, first_token_s):
    """What ``return_report=True`` returns beside the tokens (see :func:`generate`)."""
    seconds = time.perf_counter() - start
    if decoder.pp_group is not None and first_token_s is not None:  # the last stage's time
        first = torch.tensor([first_token_s], dtype=torch.float64, device=decoder.device)
        first_token_s = float(comm.all_reduce(first, "max", group=decoder.pp_group).item())
    new = (out.size(1) - width) * out.size(0)
    return {
        "kv_cache_bytes": sum(decoder.cache_bytes(c) for mb in mbs for c in mb.cache.values()),
        "seconds": seconds,
        "first_token_s": first_token_s,
        "new_tokens": new,
        "tokens_per_s": new / seconds if seconds > 0 else 0.0,
        "micro_batches": groups,
    }


def _early_stop(decoder: Decoder) -> bool:
    """Whether micro-batches may stop early: not when experts are shared out across data
    replicas, whose forwards must all run together."""
    parallel = decoder.parallel
    return not (parallel is not None and parallel.dims.ep_enabled and parallel.dp > 1)


class _Runner:
    """This rank's tasks, (step, micro-batch, stage) in order, and their messages."""

    def __init__(self, decoder: Decoder, mbs, max_new: int, eos, pad, early_stop: bool):
        self.decoder, self.mbs, self.max_new = decoder, mbs, max_new
        self.eos, self.pad, self.early_stop = eos, pad, early_stop
        self.split = decoder.stage_split
        self.me = decoder.pp_rank
        self.pending: list = []  # sends in flight: (work, the tensor it sends, kept alive)
        self.token_tag = self.split.num_stages + 1

    def _peer(self, stage: int) -> int:
        group = self.decoder.pp_group
        return dist.get_global_rank(group, self.split.rank_of(stage))

    def _local(self, stage: int) -> bool:
        return self.split.rank_of(stage) == self.me

    def _send(self, tensor: torch.Tensor, stage: int, tag: int) -> None:
        tensor = tensor.contiguous()
        work = dist.isend(tensor, self._peer(stage), self.decoder.pp_group, tag)
        self.pending.append((work, tensor))

    def _recv(self, shape, dtype, stage: int, tag: int) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype, device=self.decoder.device)
        dist.recv(out, self._peer(stage), self.decoder.pp_group, tag)
        return out

    def run(self, choose, start: float) -> Optional[float]:
        stages, t, first = self.decoder.stage_ids, 0, None
        while any(mb.live[s] for mb in self.mbs for s in stages):
            for mb in self.mbs:
                for stage in stages:
                    if mb.live[stage]:
                        self._task(t, mb, stage, choose)
            if t == 0:
                first = time.perf_counter() - start
            t += 1
            self.pending = [(w, x) for w, x in self.pending if not w.is_completed()]
        for work, _ in self.pending:
            work.wait()
        return first

    def _forward_to(self, mb: _MicroBatch, stage: int, out) -> None:
        """Hand ``out`` (or a stop) to ``stage`` of this micro-batch."""
        if self._local(stage):
            mb.handoff[stage] = out
            return
        flag = torch.tensor([0 if out is _STOP else 1], device=self.decoder.device)
        self._send(flag, stage, stage)
        if out is not _STOP:
            self._send(out, stage, stage)

    def _input(self, t: int, mb: _MicroBatch, stage: int):
        if stage == 0:
            last = self.split.last_stage
            if t > 0 and not self._local(last):  # the token the last stage chose
                token = self._recv((mb.prompt.size(0),), torch.long, last, self.token_tag)
                mb.advance(token, self.eos, self.pad)
            done = t >= self.max_new or (
                self.early_stop and self.eos is not None and bool(mb.finished.all())
            )
            if done:
                return _STOP
            return mb.prompt if t == 0 else mb.tokens[-1].unsqueeze(1)
        if self._local(stage - 1):
            return mb.handoff.pop(stage)
        header = self._recv((1,), torch.long, stage - 1, stage)
        if int(header.item()) == 0:
            return _STOP
        rows, width = mb.prompt.shape
        shape = self.decoder.activation_shape(rows, width if t == 0 else 1)
        return self._recv(shape, self.decoder.dtype, stage - 1, stage)

    def _task(self, t: int, mb: _MicroBatch, stage: int, choose) -> None:
        x = self._input(t, mb, stage)
        last = self.split.last_stage
        if x is _STOP:
            mb.live[stage] = False
            if stage < last:
                self._forward_to(mb, stage + 1, _STOP)
            return
        if stage == self.decoder.stage_ids[0]:
            mb.steps += 1
        key_mask, positions, cache_position = mb.inputs(t)
        out = self.decoder.run(stage, x, mb.cache[stage], key_mask, positions, cache_position)
        if stage < last:
            self._forward_to(mb, stage + 1, out)
            return
        token = choose(t, mb, out)
        mb.advance(token, self.eos, self.pad)
        if not self._local(0):
            self._send(mb.tokens[-1], 0, self.token_tag)


def _collect(decoder: Decoder, mbs, ids, eos, pad) -> torch.Tensor:
    """The prompts and every step's tokens, on every rank (broadcast from the last stage's
    rank), cut after the step at which every row had ended."""
    steps = max(mb.steps for mb in mbs)
    fill = 0 if pad is None else pad
    prefix = decoder.prefix(ids)  # the prompts (an encoder-decoder: its start token)
    batch, width = prefix.shape
    out = torch.full((batch, width + steps), fill, dtype=torch.long, device=ids.device)
    out[:, :width] = prefix
    split = decoder.stage_split
    if split.rank_of(split.last_stage) == decoder.pp_rank:
        for mb in mbs:
            if mb.tokens:
                out[mb.rows, width : width + len(mb.tokens)] = torch.stack(mb.tokens, dim=1)
    if decoder.pp_group is not None:
        src = dist.get_global_rank(decoder.pp_group, split.rank_of(split.last_stage))
        dist.broadcast(out, src, group=decoder.pp_group)
    if eos is not None and steps:  # where transformers' loop would have stopped
        ended = torch.isin(out[:, width:], eos)
        first = torch.where(
            ended.any(1),
            ended.int().argmax(1) + 1,
            torch.full_like(ended[:, 0], steps, dtype=torch.long),
        )
        out = out[:, : width + int(first.max())]
    return out


def _checked(
    decoder: Decoder,
    *,
    input_ids,
    attention_mask,
    max_new_tokens,
    do_sample,
    temperature,
    top_k,
    top_p,
    eos_token_id,
    pad_token_id,
    seed,
    micro_batches,
    max_cache_len,
    **_,
):
    """The arguments checked (a clear error naming the bad one): ``(ids, mask, eos, pad,
    micro-batches, cache length)``."""
    # in this order: of several bad arguments, the first checked is the one named
    ids = _checked_ids(decoder, input_ids)
    batch, width = ids.shape
    mask = _checked_mask(decoder, attention_mask, ids)
    length = _checked_lengths(decoder, width, max_new_tokens, max_cache_len)
    _check_sampling_settings(do_sample, temperature, top_k, top_p, seed)
    eos, pad = _checked_tokens(decoder, eos_token_id, pad_token_id)
    groups = _checked_micro_batches(decoder, batch, micro_batches)
    eos_tensor = None if eos is None else torch.tensor(eos, device=decoder.device)
    return ids, mask, eos_tensor, pad, groups, length


def _checked_ids(decoder: Decoder, input_ids) -> torch.Tensor:
    """The prompts: a 2-D tensor of integer ids in the vocabulary, as int64 on the model's
    device."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.numel() == 0:
        got = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids)
        raise ValueError(f"input_ids must be a [batch, prompt_len] tensor of token ids, got {got}")
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"input_ids must be int64 (or int32) token ids, got {input_ids.dtype}")
    vocab = decoder.vocab_size
    ids = input_ids.to(decoder.device, torch.long)
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        raise ValueError(
            f"input_ids must lie in [0, {vocab}) (the model's vocabulary), got values "
            f"{int(ids.min())}..{int(ids.max())}"
        )
    return ids


def _checked_mask(decoder: Decoder, attention_mask, ids: torch.Tensor) -> torch.Tensor:
    """The attention mask (all ones when None): 0s and 1s shaped like the prompts ``ids``, each
    row left padding then at least one token."""
    batch, width = ids.shape
    if attention_mask is None:
        return torch.ones_like(ids)
    if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != (
        batch,
        width,
    ):
        got = getattr(attention_mask, "shape", type(attention_mask))
        raise ValueError(
            f"attention_mask must be [batch, prompt_len] = [{batch}, {width}] like "
            f"input_ids, got {tuple(got) if isinstance(got, torch.Size) else got}"
        )
    mask = attention_mask.to(decoder.device, torch.long)
    if bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError("attention_mask must hold 0 (padding) and 1 (tokens) only")
    if decoder.left_padded_prompts and bool((mask[:, 1:] < mask[:, :-1]).any()):
        row = int((mask[:, 1:] < mask[:, :-1]).any(1).int().argmax())
        raise ValueError(
            f"attention_mask row {row} has padding after a token: generate takes left-padded "
            "prompts (a tokenizer with padding_side='left')"
        )
    if bool((mask.sum(1) == 0).any()):
        row = int((mask.sum(1) == 0).int().argmax())
        raise ValueError(f"attention_mask row {row} has no token: every prompt needs one")
    return mask


def _checked_lengths(decoder: Decoder, width: int, max_new_tokens, max_cache_len) -> int:
    """The KV cache's length: room for the prompts and ``max_new_tokens``, within the model's
    positions."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens}")
    length = width + max_new_tokens if max_cache_len is None else max_cache_len
    if isinstance(length, bool) or not isinstance(length, int) or length < width + max_new_tokens:
        raise ValueError(
            f"the prompts ({width} positions, padding included) and max_new_tokens="
            f"{max_new_tokens} need a KV cache of {width + max_new_tokens} positions; "
            f"max_cache_len={max_cache_len!r} is too short (raise it, or shorten the prompts "
            "or max_new_tokens)"
        )
    limit = decoder.max_positions
    if limit is not None and width + max_new_tokens > limit:
        raise ValueError(
            f"the prompts ({width} positions, padding included) and max_new_tokens="
            f"{max_new_tokens} need {width + max_new_tokens} positions, more than the model's "
            f"max_position_embeddings={limit}: shorten the prompts or max_new_tokens"
        )
    return length


def _check_sampling_settings(do_sample, temperature, top_k, top_p, seed) -> None:
    """Greedy or sampled; the sampling settings (checked only when sampling) and the seed."""
    if not isinstance(do_sample, bool):
        raise ValueError(f"do_sample must be True or False, got {do_sample!r}")
    if do_sample:
        check_sampling(temperature, top_k, top_p)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise ValueError(f"seed must be an int >= 0 (or None), got {seed!r}")


def _checked_tokens(decoder: Decoder, eos_token_id, pad_token_id) -> tuple:
    """``(eos ids or None, pad id or None)``: those given, else the model's (as transformers'
    generate reads them), the pad falling back to the first EOS."""
    vocab = decoder.vocab_size
    eos = _token_list("eos_token_id", eos_token_id, vocab)
    default_eos, default_pad = decoder.generation_defaults()
    if eos is None and default_eos is not None:  # the model's own, as transformers reads it
        # (a narrow copy may keep its family's EOS id past its small vocabulary: never emitted)
        ids_in_vocab = [e for e in _as_list(default_eos) if 0 <= e < vocab]
        eos = ids_in_vocab or None
    if pad_token_id is not None and (
        isinstance(pad_token_id, bool)
        or not isinstance(pad_token_id, int)
        or not 0 <= pad_token_id < vocab
    ):
        raise ValueError(
            f"pad_token_id must be an int in [0, {vocab}) (the vocabulary; None: the model's, "
            f"else the first EOS), got {pad_token_id!r}"
        )
    pad = pad_token_id
    if pad is None and default_pad is not None and 0 <= default_pad < vocab:
        pad = int(default_pad)
    if pad is None and eos is not None:
        pad = int(eos[0])
    return eos, pad


def _checked_micro_batches(decoder: Decoder, batch: int, micro_batches) -> int:
    """How many micro-batches are in flight (see :func:`generate` for the default)."""
    pipelined = decoder.stage_split.num_stages > 1
    # NCCL pairs point-to-point messages by their order alone (it ignores tags): one
    # micro-batch at a time keeps a single chain of messages per step, in the same order on
    # both sides; several in flight need gloo's tagged messages
    ordered_only = pipelined and dist.get_backend(decoder.pp_group) == "nccl"
    if micro_batches is None:
        in_flight = _early_stop(decoder) and not ordered_only
        groups = min(batch, decoder.stage_split.pp) if in_flight else 1
    else:
        groups = micro_batches
    if isinstance(groups, bool) or not isinstance(groups, int) or not 1 <= groups <= batch:
        raise ValueError(
            f"micro_batches must be an int in [1, batch={batch}], got {micro_batches!r} "
            f"(default: pp={decoder.stage_split.pp}, at most the batch; 1 with NCCL or with "
            "experts spread over data replicas)"
        )
    if groups > 1 and ordered_only:
        raise ValueError(
            f"micro_batches={groups}: several micro-batches in flight through pipeline stages "
            "need tagged point-to-point messages, which NCCL does not match by tag; use "
            "micro_batches=1 (the default under NCCL)"
        )
    return groups


def _as_list(value) -> list:
    return [value] if isinstance(value, int) else list(value)


def _check_agreement(decoder: Decoder, world, ids, mask, arguments: dict) -> None:
    """Every rank of one model replica (its TP and PP groups) passes the same prompts and
    arguments, and every rank the same settings (the loop's forwards and collectives must pair
    up): else a clear error on every rank, not a hang."""
    settings = {
        k: arguments[k]
        for k in ("max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "seed")
    }
    settings.update(micro_batches=arguments["micro_batches"], cache=arguments["max_cache_len"])
    prompts = zlib.crc32(ids.cpu().numpy().tobytes() + mask.cpu().numpy().tobytes())
    replica = zlib.crc32(repr((tuple(ids.shape), prompts, arguments["eos_token_id"])).encode())
    replica = zlib.crc32(repr((replica, arguments["pad_token_id"])).encode())
    everywhere = zlib.crc32(repr(sorted(settings.items())).encode())
    checks = [("generation settings", everywhere, world)]
    checks += [("prompts, EOS and pad ids", replica, decoder.tp_group)]
    for group in (decoder.pp_group, decoder.cp_group):
        if group is not None:
            checks.append(("prompts, EOS and pad ids", replica, group))
    for what, digest, group in checks:
        mine = torch.tensor([[digest]], dtype=torch.long, device=decoder.device)
        seen = comm.all_gather(mine, dim=0, group=group)
        if bool((seen != mine).any()):
            raise ValueError(
                f"generate: ranks passed different {what} (every rank of a model passes the same "
                "prompts and arguments; data replicas may pass their own prompts)"
            )


def _token_list(name: str, value, vocab: int) -> Optional[list[int]]:
    if value is None:
        return None
    values = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    try:
        values = list(values)
    except TypeError:
        values = None
    if not values or any(isinstance(v, bool) or not isinstance(v, int) for v in values):
        raise ValueError(f"{name} must be an int or a list of ints, got {value!r}")
    if any(not 0 <= v < vocab for v in values):
        raise ValueError(f"{name} must lie in [0, {vocab}) (the vocabulary), got {value!r}")
    return values
