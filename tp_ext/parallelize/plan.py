"""Which style each module of a model gets: "auto", decided from a traced forward (how the
linears connect: :mod:`tp_ext.parallelize.dataflow`), or a user's plan of name patterns. The
styles themselves (classes, and the string aliases auto writes) are in
:mod:`tp_ext.parallelize.styles`."""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Optional, Union

from torch import nn

from tp_ext.parallelize.dataflow import trace_flow
from tp_ext.parallelize.modules import attention_heads, is_conv1d, is_fused_experts, is_norm
from tp_ext.parallelize.styles import (
    ALIASES,
    ParallelStyle,
    SequenceParallel,
    SharedInput,
    as_style,
)

__all__ = ["STYLES", "auto_plan", "resolve_plan", "is_norm"]

# The string aliases of the styles (a plan may also give ParallelStyle instances).
STYLES = tuple(ALIASES)


def is_plain(module: nn.Module, base: type) -> bool:
    """``module`` computes exactly what ``base`` computes (its class or a subclass that does not
    override forward): only then may auto swap it for a tp_ext layer."""
    return isinstance(module, base) and type(module).forward is base.forward


def is_linear(module: nn.Module) -> bool:
    """A plain nn.Linear, Falcon's FalconLinear (its forward is ``x @ W.T + b`` too, with the
    bias added separately) or GPT-2's Conv1D (the same with the weight stored transposed)."""
    return (
        is_plain(module, nn.Linear)
        or (isinstance(module, nn.Linear) and type(module).__name__ == "FalconLinear")
        or is_conv1d(module)
    )


def is_scaled_embedding(module: nn.Module) -> bool:
    """An embedding whose only change is multiplying its output by ``embed_scale`` (Gemma 3's
    ``...ScaledWordEmbedding``): converted with that scale."""
    return (
        isinstance(module, nn.Embedding)
        and hasattr(module, "embed_scale")
        and type(module).__name__.endswith("ScaledWordEmbedding")
    )


# Fused projections: named in the refusal when auto cannot split one (see _refuse_large_unsplit).
_FUSED = {"qkv_proj", "gate_up_proj", "query_key_value", "c_attn", "W_pack", "Wqkv", "c_fc"}


def auto_plan(
    module: nn.Module,
    sequence_parallel: bool = False,
    reasons: Optional[dict] = None,
    example_inputs=None,
    parts: Optional[dict] = None,
) -> dict[str, StyleLike]:
    """The split of every linear and embedding of ``module``, decided from one traced forward
    (:mod:`tp_ext.parallelize.dataflow`), not from names:

    - a linear whose input is computed only from other linears' outputs (not from the residual
      stream) is row-parallel, and those linears are column-parallel, when nothing between them
      combines all of a column's output features (a norm, a softmax), scales them by a parameter
      as wide, or adds them into the stream: the pair then costs one all-reduce, at the row's
      output. Attention projections are split by whole heads (the head counts come from the
      attention module); a column whose output the forward cuts into parts (``[gate | up]``) is
      split part by part (``parts`` is filled with those widths);
    - a linear that makes the model's logits over the vocabulary is split by vocabulary; one
      over anything else (sequence, token or image classes) stays whole, as does a masked-LM
      head's transform between the stream and the logits (BERT's ``cls.predictions.transform``);
    - ``nn.MultiheadAttention`` (its packed ``in_proj_weight``) is split by heads ("heads");
    - an embedding indexed by the token ids is split by vocabulary; one indexed by positions
      stays whole;
    - MoE experts stored as 3D parameters get the "experts" style;
    - any other linear stays whole, and why is said: splitting it alone would need its output
      gathered. One that holds a matmul of the model's width is refused (ValueError naming it),
      since replicating it would leave the model's work unsplit;
    - with ``sequence_parallel``, every norm over the model's width gets "sequence_parallel"
      (its output gathered for the linears it feeds), or "sequence_parallel_local" when the
      trace shows its output going back to the stream with no linear reading it (Gemma 2/3's
      norms of a row-parallel output before the residual add: they run on the shard) or read
      by a sparse-MoE block (which gathers the sequence itself);
    - without it, a norm whose output only column-parallel linears read (two or more: q, k, v;
      gate, up) gets :class:`~tp_ext.parallelize.styles.SharedInput` naming them: one
      all-reduce of their summed input gradient instead of one each.

    ``reasons``, when given, is filled with why each module got its style. ``example_inputs``:
    ``(args, kwargs)`` for the traced forward (default: 1 x T token ids)."""
    plan: dict[str, str] = {}
    why = {} if reasons is None else reasons
    width = _width(module)
    attentions = {n for n, c in module.named_modules() if is_plain(c, nn.MultiheadAttention)}
    inside = tuple(f"{n}." for n in attentions)  # their out_proj: part of the attention
    linears = {
        n: c for n, c in module.named_modules() if n and is_linear(c) and not n.startswith(inside)
    }
    heads = _attention_projections(module, linears)
    head_dims = {n: info.head_dim for n, (info, _, out) in heads.items() if not out}
    norms = {n: c for n, c in module.named_modules() if n and is_norm(c)}
    flow = trace_flow(module, linears, head_dims, example_inputs, norms)
    if sequence_parallel:
        _check_sequence_parallel_layout(module, flow)
    token_tables = _token_tables(module, flow)
    rows, blocked = _pairs(flow)
    pairs = (rows, _columns(rows), blocked, linears)
    _check_heads(heads, rows, pairs[1])

    for name, child in module.named_modules():
        if sequence_parallel and is_norm(child) and _norms_the_residual_stream(child, width):
            plan[name], why[name] = _sequence_parallel_norm(module, name, child, flow)
        elif name in attentions:
            plan[name], why[name] = "heads", _WHY_MHA
        elif name.startswith(inside):
            continue
        elif is_fused_experts(child):
            plan[name], why[name] = "experts", "MoE experts as 3D gate_up_proj/down_proj"
        elif name in token_tables and (is_plain(child, nn.Embedding) or is_scaled_embedding(child)):
            plan[name], why[name] = "vocab", token_tables[name]
        elif name in flow.other_embeddings:
            plan[name] = "replicate"
            why[name] = (
                "an embedding indexed by positions, not tokens: kept whole (a per-head table, "
                "T5's relative position bias, is split with its attention's heads)"
            )
        elif name in linears:
            plan[name], why[name] = _linear_style(module, flow, name, pairs, heads, parts)
    if not sequence_parallel:
        _share_norm_outputs(plan, flow, why)
    _refuse_large_unsplit(module, plan, flow, why)
    return _called_norms_first(plan, flow)


_WHY_MHA = (
    "nn.MultiheadAttention: its packed q/k/v projection split by heads, its output projection "
    "row-parallel over them"
)
_WHY_HEAD_TRANSFORM = (
    "the output head's transform (it reads the stream and feeds only the logits projection, "
    "through a norm): kept whole, one matmul of the model's width per token beside the layers' "
    "split ones"
)


def _token_tables(module: nn.Module, flow) -> dict[str, str]:
    """{embedding: why it is split by vocabulary}: those the token ids index, and those sharing
    their weight (T5's and BART's ``shared``, which the forward reaches through its encoder's
    and decoder's ``embed_tokens``). The others join ``flow.other_embeddings`` (kept whole)."""
    tables = {n: "an embedding indexed by the token ids" for n in flow.token_embeddings}
    weights = {id(module.get_submodule(n).weight): n for n in flow.token_embeddings}
    for name, child in module.named_modules():
        user = weights.get(id(getattr(child, "weight", None)))
        if isinstance(child, nn.Embedding) and name not in tables and user is not None:
            tables[name] = f"shares its weight with {user}, an embedding indexed by the token ids"
    # an embedding never looked up, whose weight is no token table's, is read as a table of
    # rows (DeBERTa's relative positions): kept whole, like positions
    flow.other_embeddings |= {
        n for n, c in module.named_modules() if isinstance(c, nn.Embedding) and n not in tables
    }
    return tables


def _columns(rows: dict) -> dict:
    """{column-parallel linear: the row-parallel ones it feeds}."""
    return {c: sorted(r for r in rows if c in rows[r]) for r in rows for c in rows[r]}


def _linear_style(module, flow, name: str, pairs: tuple, heads, parts) -> tuple[str, str]:
    """The style of linear ``name`` and why (see :func:`auto_plan`). ``pairs``: the row- and
    column-parallel linears (``(rows, columns)``), why the others could not pair, and every
    linear by name."""
    f = flow.linears[name]
    rows, columns, blocked, linears = pairs
    if name in rows:
        return "rowwise", _row_reason(name, rows[name], heads)
    if name in columns:
        if f.parts and len(f.parts) > 1 and name not in heads and parts is not None:
            parts[name] = list(f.parts)
        return "colwise", _column_reason(name, columns[name], heads, f)
    if _is_classifier(module, flow, name):
        return "replicate", (
            f"a classifier head ({f.out_features} outputs, not the vocabulary): kept whole, its "
            "matmul is small and its output whole on every rank"
        )
    if f.makes_logits:
        return "vocab", (
            f"makes the model's logits ({f.out_features} of them) from the residual stream: "
            "split by vocabulary, logits gathered"
        )
    if _is_head_transform(flow, name):
        return "replicate", _WHY_HEAD_TRANSFORM
    return "replicate", _whole_reason(flow, name, blocked, linears)


def _share_norm_outputs(plan: dict, flow, why: dict) -> None:
    """A norm whose output only column-parallel linears read (q, k and v; gate and up) gets
    :class:`SharedInput`: their input gradients are summed and all-reduced once, not once per
    linear (Megatron fuses QKV; Hugging Face models keep separate projections)."""
    for norm, readers in flow.norm_readers.items():
        if len(readers) < 2 or norm in flow.norms_read_elsewhere:
            continue
        if all(plan.get(r) == "colwise" for r in readers):
            plan[norm] = SharedInput(tuple(sorted(readers)))
            leaves = ", ".join(r.rpartition(".")[2] for r in sorted(readers))
            why[norm] = (
                f"its output is read only by the column-parallel {leaves}: one all-reduce of "
                "their summed input gradient"
            )


def _sequence_parallel_norm(module: nn.Module, name: str, norm: nn.Module, flow):
    """The sequence-parallel style of a norm over the model's width, and why."""
    if name in flow.norms_flat:
        raise ValueError(
            f"sequence_parallel=True: {name} ({type(norm).__name__}) normalises hidden "
            "states flattened to [tokens, hidden] in the traced forward, so there is no "
            "sequence dimension to split there; use sequence_parallel=False for "
            f"{type(module).__name__}"
        )
    blocks = flow.norm_moe_blocks.get(name)
    if blocks:
        outside = [
            r
            for r in flow.norm_readers.get(name, ())
            if not any(r.startswith(f"{b}.") for b in blocks)
        ]
        if outside:
            raise ValueError(
                f"sequence_parallel=True: {name} feeds the sparse-MoE block {min(blocks)}, which "
                f"takes its sequence shard, and also {outside[0]} outside it, which needs the "
                f"whole sequence; auto does not split that: use sequence_parallel=False for "
                f"{type(module).__name__}"
            )
        return "sequence_parallel_local", (
            f"a norm over the model's width read by the sparse-MoE block {min(blocks)}, which "
            "gathers the sequence itself (once for its router and experts): left split"
        )
    if name in flow.norms_feeding_linears or name not in flow.norms_called:
        return "sequence_parallel", "a norm over the model's width"
    if name == flow.norms_called[-1]:  # a pooler, a CLS token's classifier, the caller read it
        return SequenceParallel(whole_readers=True), (
            "the last norm the forward calls, read by no split linear: what reads its output "
            "after (a class token's classifier, a pooler, the caller) gets every position"
        )
    return "sequence_parallel_local", (
        "a norm over the model's width whose output goes back to the residual "
        "stream, read by no linear: it runs on the sequence shard, not gathered"
    )


def _check_sequence_parallel_layout(module: nn.Module, flow) -> None:
    """Sequence parallelism splits a pre-norm stack's residual stream (each norm's input; its
    output gathered for the linears): refuse the layouts where that is not the stream."""
    name = type(module).__name__
    if getattr(getattr(module, "config", None), "is_encoder_decoder", False):
        raise ValueError(
            f"sequence_parallel=True: {name} is an encoder-decoder, whose decoder layers read "
            "the encoder's whole output in cross-attention; tp_ext splits the sequence of one "
            f"pre-norm stack (decoders, ViT). Use sequence_parallel=False for {name}"
        )
    packed = [n for n, c in module.named_modules() if is_plain(c, nn.MultiheadAttention)]
    if packed:
        raise ValueError(
            f"sequence_parallel=True: {packed[0]} (nn.MultiheadAttention, split by heads as one "
            "layer) takes and gives the whole sequence, so the stream around it cannot stay "
            f"split; use sequence_parallel=False for {name}"
        )
    both = flow.norms_feeding_linears & flow.norms_read_elsewhere
    post = sorted(n for n in both if n not in flow.norm_moe_blocks)
    if post:
        raise ValueError(
            f"sequence_parallel=True: {post[0]}'s output is both the input of linears and the "
            f"residual stream added to the next sublayer's output (a post-norm model, as BERT "
            "and RoBERTa); tp_ext splits the sequence of pre-norm stacks (decoders, ViT). Use "
            f"sequence_parallel=False for {name}"
        )


def _called_norms_first(plan: dict[str, str], flow) -> dict[str, str]:
    """The plan with the sequence-parallel norms first, in the order the forward calls them: the
    stream is split at the block of the first one called (not of the first one defined: OPT's
    final norm)."""
    order = {n: i for i, n in enumerate(flow.norms_called)}
    first = sorted((n for n in plan if n in order), key=order.get)
    return {**{n: plan[n] for n in first}, **plan}


def _attention_projections(module: nn.Module, linears: dict) -> dict:
    """{linear name: (AttentionHeads, attention class name, is the output projection)} for the
    projections of the attention modules auto knows the heads of."""
    found = {}
    for name in linears:
        parent_name, _, leaf = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        info = attention_heads(parent)
        if info is None:
            continue
        if leaf in info.inputs:
            found[name] = (info, type(parent).__name__, False)
        elif leaf == info.out:
            found[name] = (info, type(parent).__name__, True)
    return found


def _pairs(flow) -> tuple[dict, dict]:
    """The row-parallel linears with the column-parallel ones feeding each, and for the linears
    that could not pair, why."""
    rows, blocked = {}, {}
    for name, f in flow.linears.items():
        if f.reads_stream or not f.sources:
            continue
        problems = {}
        for s in sorted(f.sources):
            src = flow.linears[s]
            if not src.reads_stream:
                problems[s] = "does not read the residual stream itself"
            elif s in f.mixed_sources or src.reduced:
                problems[s] = "has all its outputs combined by a reduction (a norm, softmax)"
            elif src.scaled_by:
                problems[s] = "has its output scaled by a parameter as wide"
            elif src.reaches_stream:
                problems[s] = "has its output added into the residual stream directly"
        if problems:
            blocked[name] = problems
        else:
            rows[name] = f.sources
    return rows, blocked


def _check_heads(heads: dict, rows: dict, columns: dict) -> None:
    """A head-split attention pair must be the attention's own: its inputs feed its output
    projection. Anything else means the model does what auto does not understand."""
    for name, (info, kind, is_out) in heads.items():
        parent = name.rpartition(".")[0]
        siblings = {
            n for n, (_, _, out) in heads.items() if n.rpartition(".")[0] == parent and not out
        }
        if is_out and name in rows and not set(rows[name]) <= siblings:
            raise ValueError(
                f"{name}: the output projection of attention {kind} also reads "
                f"{sorted(set(rows[name]) - siblings)} in the traced forward; auto splits "
                "attention by heads only when its output projection reads its own q/k/v. "
                "Pass a plan"
            )


def _row_reason(name: str, sources, heads: dict) -> str:
    listed = ", ".join(s.rpartition(".")[2] for s in sorted(sources))
    base = (
        f"reads only what {listed} computed (not the residual stream): row-parallel, one "
        "all-reduce of its output"
    )
    if name in heads:
        kind = heads[name][1]
        return f"the output projection of attention {kind} (writes the residual stream); {base}"
    return base


def _column_reason(name: str, rows: list, heads: dict, f) -> str:
    to = ", ".join(rows)
    base = (
        f"reads the residual stream; its output reaches {to} through per-feature "
        "or per-head ops only: column-parallel, output left split"
    )
    if name in heads:
        kind = heads[name][1]
        return f"an input projection of attention {kind}, split by heads; {base}"
    if f.parts and len(f.parts) > 1:
        return f"{base}; the forward cuts its output into {list(f.parts)}: each part split"
    return base


def _is_classifier(module: nn.Module, flow, name: str) -> bool:
    """A linear making the model's returned logits over something other than the vocabulary
    (sequence, token or image classes: as many outputs as no token embedding has rows)."""
    f = flow.linears[name]
    vocab = {module.get_submodule(n).num_embeddings for n in flow.token_embeddings}
    vocab.add(getattr(getattr(module, "config", None), "vocab_size", None))
    return f.makes_logits and f.out_features not in vocab


def _is_head_transform(flow, name: str) -> bool:
    """A linear between the stream and the logits projection only (BERT's and RoBERTa's masked-LM
    head: dense, activation, norm, then the vocabulary projection): its output is normalized
    before the logits, so it cannot be column-parallel, and it runs once, after the layers."""
    f = flow.linears[name]
    consumers = flow.consumers(name)
    return (
        f.reads_stream and bool(consumers) and all(flow.linears[c].makes_logits for c in consumers)
    )


def _whole_reason(flow, name: str, blocked: dict, linears: dict) -> str:
    f = flow.linears[name]
    weight = sum(p.numel() * p.element_size() for p in linears[name].parameters(recurse=False))
    cost = (
        f"split alone its output would need an all-gather of {f.out_features} values per "
        f"token; kept whole ({weight} bytes on every rank)"
    )
    if not f.called:
        return f"not called by the traced forward (example_inputs= can reach it); {cost}"
    for consumer in flow.consumers(name):
        if name in blocked.get(consumer, {}):
            return f"its output feeds {consumer}, but it {blocked[consumer][name]}; {cost}"
    if name in blocked:
        (src, problem), *_ = blocked[name].items()
        return f"its input comes from {src}, which {problem}; {cost}"
    if f.reduced:
        return f"a reduction over all its outputs follows (a softmax, top-k or norm); {cost}"
    if f.reaches_stream:
        return f"its output joins the residual stream with no linear after it; {cost}"
    consumers = flow.consumers(name)
    if consumers:
        return f"its output feeds {consumers[0]}, which cannot be row-parallel; {cost}"
    return f"no linear reads its output; {cost}"


def _norms_the_residual_stream(norm: nn.Module, width) -> bool:
    """A norm over the model's width (input/post-attention/final norms), not a per-head one
    (Qwen3's q_norm/k_norm run on attention heads, which sequence parallelism does not split)."""
    weight = getattr(norm, "weight", None)
    return width is None or weight is None or weight.numel() == width


def _width(module: nn.Module):
    hidden = getattr(getattr(module, "config", None), "hidden_size", None)
    if isinstance(hidden, int):
        return hidden
    dims = [m.embedding_dim for m in module.modules() if isinstance(m, nn.Embedding)]
    return max(dims, default=None)


def _refuse_large_unsplit(module: nn.Module, plan: dict[str, str], flow, why: dict) -> None:
    """Refuse when auto would leave a module with a model-width weight whole (see auto_plan)."""
    hidden = _width(module)
    if hidden is None:
        return
    big = max(2, hidden // 2)
    unsplit = []
    for name, child in module.named_modules():
        if plan.get(name, "replicate") != "replicate" or is_norm(child):
            continue
        if name in flow.linears and _is_head_transform(flow, name):
            continue  # the output head's transform: whole on purpose (see auto_plan)
        if any(name.startswith(f"{p}.") for p, style in plan.items() if style == "heads"):
            continue  # inside an attention converted whole (its out_proj)
        if name in flow.other_embeddings:
            continue  # learned positions: indexed by position, kept whole
        for param in child.parameters(recurse=False):
            if sum(1 for d in param.shape if d >= big) >= 2:
                unsplit.append((name, child))
                break
    if unsplit:
        listed = ", ".join(f"{n} ({type(c).__name__})" for n, c in unsplit[:4])
        more = f" and {len(unsplit) - 4} more" if len(unsplit) > 4 else ""
        first = unsplit[0][0]
        reason = why.get(first, "a module auto does not convert").split("; split alone")[0]
        fused = " (a fused projection)" if first.rpartition(".")[2] in _FUSED else ""
        raise ValueError(
            f"parallelize(plan='auto') does not know how to split {listed}{more}: in the traced "
            f"forward, {first}{fused}: {reason}. Left "
            "whole they would hold the model's large matmuls on every rank. Pass a plan of name "
            "patterns to styles instead, e.g. {'*.q_proj': 'colwise', '*.o_proj': 'rowwise', "
            "...} (styles: colwise, rowwise, vocab, sequence_parallel, replicate, or the classes "
            "tp_ext.parallelize.Colwise(), ... with options; 'replicate' keeps a module whole on "
            "purpose)"
        )


StyleLike = Union[str, ParallelStyle]


def resolve_plan(module: nn.Module, plan: Mapping[str, StyleLike]) -> dict[str, StyleLike]:
    """Exact module name -> style (as the plan gives it: a string alias or a ParallelStyle), from
    name patterns (fnmatch; the first matching pattern wins). A pattern that matches no module
    or a value that is not a style is refused."""
    names = [n for n, _ in module.named_modules() if n]
    exact = set(names)
    decided: dict[str, StyleLike] = {}
    for pattern, style in plan.items():
        if not isinstance(pattern, str):
            raise TypeError(
                f"plan key {pattern!r} is not a module name pattern; use strings such as "
                "'model.layers.*.mlp.down_proj'"
            )
        if not any(c in pattern for c in "*?["):  # a plain name (a traced plan's): itself
            matched = [pattern] if pattern in exact else []
        else:
            matched = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not matched:
            example = ", ".join(names[:6])
            raise ValueError(
                f"plan pattern {pattern!r} matches no module; names look like: {example}, ..."
            )
        more = f" and {len(matched) - 1} more" if len(matched) > 1 else ""
        as_style(style, f"plan[{pattern!r}] (for module {matched[0]}{more})")
        for name in matched:
            decided.setdefault(name, style)
    return decided
