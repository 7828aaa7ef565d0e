"""Tensor-parallelise an existing model in place: swap its nn.Linear and nn.Embedding modules for
tp_ext layers by a plan, keeping each rank's slice of the existing weights.

    model = transformers.Qwen2ForCausalLM(config)       # same weights on every rank
    tp_ext.parallelize(model, "auto")    # or {"model.layers.*.self_attn.q_proj": "colwise", ...}
    logits = model(input_ids).logits                    # equal to the unsharded model's

Styles (classes in :mod:`tp_ext.parallelize.styles`, each with its options there; a plan may
give an instance or its string alias):
    Colwise()          "colwise"    nn.Linear -> ColumnParallelLinear (output features split,
                                    output left split)
    Rowwise()          "rowwise"    nn.Linear -> RowParallelLinear (input features split,
                                    output all-reduced)
    VocabParallel()    "vocab"      nn.Embedding -> VocabParallelEmbedding; nn.Linear ->
                                    ParallelLMHead with the full logits gathered
    Experts()          "experts"    MoE experts with 3D gate_up_proj/down_proj (Mixtral,
                                    Qwen2-MoE): each expert's intermediate dim split. With
                                    ``parallel=state`` where ``state.ep > 1`` the whole
                                    sparse-MoE block becomes tp_ext.layers.ExpertParallelMoE
    SequenceParallel() "sequence_parallel"  norms: Megatron's sequence parallelism (the norm
                                    on this rank's sequence shard, its output all-gathered)
    SequenceParallel(gather_output=False)  "sequence_parallel_local"  its output left split
    SharedInput(readers)  (no alias)  norms read only by column-parallel linears (q, k, v):
                                    their input gradients all-reduced once, summed ("auto"
                                    gives it without sequence parallelism)
    Replicate()        "replicate"  left as it is (every rank computes it in full)

Attention projections are split by whole heads (HeadLayout) whenever their parent module looks
like Hugging Face attention (``q_proj``/``k_proj``/``v_proj``/``o_proj`` and a ``head_dim``, with
head counts in ``config``); the parent's ``num_key_value_groups`` is then set to this rank's
ratio, so its own attention code runs on the local heads.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Union

from torch import nn

from tp_ext.distributed.groups import resolve_group
from tp_ext.layers import ColumnParallelLinear, ParallelModule
from tp_ext.layers.moe import ExpertParallelMoE, is_sparse_moe_block
from tp_ext.parallelize.context import check_context_parallel, use_context_parallel
from tp_ext.parallelize.dataflow import example_token_inputs
from tp_ext.parallelize.decoder_parts import default_pipeline_split, find_decoder_parts
from tp_ext.parallelize.encoder_stages import StagedEncoder, is_encoder
from tp_ext.parallelize.modules import attention_heads, fuse_rms_norms, localize_attention
from tp_ext.parallelize.plan import StyleLike, auto_plan, resolve_plan
from tp_ext.parallelize.sequence_parallel import (
    SequenceShards,
    gather_in_moe_blocks,
    sum_gradients_over,
)
from tp_ext.parallelize.stages import StagedCausalLM
from tp_ext.parallelize.styles import (
    Colwise,
    ParallelStyle,
    Replicate,
    SequenceParallel,
    SharedInput,
    StyleTarget,
    VocabParallel,
    as_style,
)
from tp_ext.sharding import StageSplit

__all__ = ["parallelize"]

_NORM_STYLES = (SequenceParallel, SharedInput, Replicate)  # given a fused norm, they work alike


def parallelize(
    module: nn.Module,
    plan: Union[str, Mapping[str, StyleLike]] = "auto",
    tp_group=None,
    verbose: bool = False,
    explain: bool = False,
    sequence_parallel: bool = False,
    return_report: bool = False,
    example_inputs=None,
    parallel=None,
    capacity_factor=None,
    virtual_stages: int = 1,
    pipeline_split=None,
    stage_order: str = "loop",
    decoder_parts=None,
    fused_norms: bool = True,
    cp_mode: str = "ring",
):
    """Tensor-parallelise ``module`` in place (every rank holds the same full model on entry) and
    return it; with ``return_report=True``, ``(module, report)`` where ``report`` maps each
    module name to what was done to it (style and this rank's shard). Nothing is stored on the
    user's modules beyond the replaced children, the hooks of sequence and shared-input
    parallelism and, under context parallelism, what it says below.

    ``plan``: "auto" (:func:`auto_plan`) or ``{name pattern: style}``, each style a
    :class:`~tp_ext.parallelize.styles.ParallelStyle` (``Colwise()``, ``Rowwise()``, ... with
    keyword options) or its string alias ("colwise", ...). ``tp_group``: the TP group
    (default: the one from :func:`tp_ext.init_parallel`). ``verbose`` prints the decisions on
    TP rank 0; ``explain=True`` adds to each decision why it was taken (in the report too) and
    prints them. ``sequence_parallel=True`` with "auto" adds the "sequence_parallel" style for every
    norm. "auto" runs the model once on a few tokens to see how its linears connect;
    ``example_inputs=(args, kwargs)`` is what to call it with when token ids are not its input.
    ``parallel``: a :func:`tp_ext.init_parallel` state; its TP group is used (unless
    ``tp_group`` is given) and, with ``ep > 1``, every sparse-MoE block becomes an
    :class:`~tp_ext.layers.ExpertParallelMoE` over its EP group (``capacity_factor`` as there;
    None is dropless).

    With ``parallel.pp > 1`` (a Hugging Face causal LM) the result is this rank's pipeline
    stages, a :class:`~tp_ext.parallelize.stages.StagedCausalLM` for
    :class:`tp_ext.training.Trainer`: ``virtual_stages`` stages per rank in ``stage_order``
    ("loop" or "v"), the decoder layers split by ``pipeline_split`` (layers per stage) or, by
    default, by cost: the split whose costliest stage (the LM head counted on the last) is
    cheapest (:func:`~tp_ext.parallelize.decoder_parts.default_pipeline_split`), as the planner
    and ``tp-ext plan`` place them. The model passed in keeps only those stages. Which modules
    run before and after the decoder layers is seen by running the model once;
    ``decoder_parts`` (:func:`~tp_ext.parallelize.decoder_parts.decoder_parts_by_name`) gives
    them instead, for a model on the meta device (which cannot run).

    With ``parallel.cp > 1`` (a Hugging Face Qwen2, Llama, Mistral, Qwen3, GPT-2 or Gemma 2, or
    their MoE kin) every CP rank is called with the whole sequence (and its padding mask) and
    computes its positions (:func:`tp_ext.cp_positions`), each attention over the CP group by
    ``cp_mode`` ("ring" or "all_to_all"); the model returns
    the logits of this rank's positions, in that order (:mod:`tp_ext.parallelize.context`), and
    gets ``cp_group``, as the native model has, for :class:`tp_ext.training.Trainer`.

    ``fused_norms`` (default True): RMSNorms that compute Llama's formula run through the fused
    ``rms_norm`` op (:func:`~tp_ext.parallelize.modules.fuse_rms_norms`; same weights, names
    and roundings, about 6x faster on CPU); False leaves them as they are.
    """
    options = dict(
        virtual_stages=virtual_stages, pipeline_split=pipeline_split, stage_order=stage_order
    )
    stages = _check_before_changes(
        module, parallel, cp_mode, sequence_parallel, example_inputs, options, decoder_parts
    )
    tp, ep_group = _groups(parallel, tp_group)
    decided, reasons, parts = _decide(module, plan, sequence_parallel, example_inputs)
    fused = _fuse_norms(module, decided, fused_norms)
    report, sequence_shards = _convert(module, decided, parts, tp, ep_group, capacity_factor)
    if parallel is not None and parallel.dims.cp_enabled:
        _use_context_parallel(module, parallel, cp_mode, report)
    _finish_report(report, fused, reasons, tp, verbose, explain)
    if stages is not None:
        decoder, options = stages
        staged = StagedEncoder if is_encoder(module) else StagedCausalLM
        module = staged(decoder, parallel, sequence_shards=sequence_shards, **options)
    return (module, report) if return_report else module


def _check_before_changes(
    module, parallel, cp_mode, sequence_parallel, example_inputs, options, decoder_parts
):
    """What ``parallelize`` refuses, refused before ``module`` changes: a model parallelized
    before, context parallelism it cannot take, a pipeline it cannot split. Returns what
    pipelining needs, ``(decoder parts, stage options)`` (:func:`_pipeline_parts`: traced now),
    or None without it."""
    _check_not_parallelized(module)
    if parallel is not None and parallel.dims.cp_enabled:
        check_context_parallel(module, parallel, cp_mode)
    if parallel is not None and parallel.pp > 1:
        return _pipeline_parts(
            module, parallel, sequence_parallel, example_inputs, options, decoder_parts
        )
    return None


def _groups(parallel, tp_group):
    """``(TP group, resolved; EP group or None)``: ``tp_group``, else ``parallel``'s (else the
    default one, :func:`~tp_ext.distributed.groups.resolve_group`); ``parallel``'s EP group
    under expert parallelism."""
    if parallel is not None and tp_group is None:
        tp_group = parallel.tp_group
    experts = parallel is not None and parallel.dims.ep_enabled
    ep_group = parallel.ep_group if experts else None
    return resolve_group(tp_group), ep_group


def _fuse_norms(module, decided: dict, fused_norms) -> list[str]:
    """The names of the RMSNorms now run through the fused op (none with ``fused_norms=False``)."""
    if not isinstance(fused_norms, bool):
        raise TypeError(f"parallelize: fused_norms must be True or False, got {fused_norms!r}")
    # a norm given a user's own style reaches it as it was
    own_styles = [n for n, s in decided.items() if not isinstance(s, _NORM_STYLES)]
    return fuse_rms_norms(module, keep=own_styles) if fused_norms else []


def _convert(module, decided, parts, tp, ep_group, capacity_factor):
    """Apply the decided styles: experts spread over EP, the residual stream split where the
    first sequence-parallel norm's block begins, every planned module replaced, attention run on
    its local heads. Returns ``(report, the sequence shards or None without sequence
    parallelism)``."""
    report: dict[str, str] = {}
    sp_norms = [
        n for n, s in decided.items() if isinstance(s, SequenceParallel) and s.gather_output
    ]
    sp = bool(sp_norms) and tp.size > 1
    shards = SequenceShards(tp)
    blocks = [n for n, m in module.named_modules() if is_sparse_moe_block(m)]
    if ep_group is not None:
        spread = shards if sp else None
        _spread_experts(module, blocks, decided, report, ep_group, tp, spread, capacity_factor)
    if sp:
        _split_sequence_from(module, sp_norms[0], shards, report)
    _apply_styles(module, decided, tp, shards if sp else None, parts, report, blocks)
    if sp:
        gather_in_moe_blocks(module, blocks, shards, report)
    _run_attention_on_local_heads(module, tp, report)
    return report, shards if sp else None


def _use_context_parallel(module, parallel, cp_mode: str, report: dict) -> None:
    """Every attention module of the converted ``module`` runs over ``parallel``'s CP group
    (:mod:`tp_ext.parallelize.context`); what was done goes to ``report[""]``."""
    attentions = [m for m in module.modules() if attention_heads(m) is not None]
    report[""] = use_context_parallel(module, parallel, cp_mode, attentions)


def _finish_report(report: dict, fused, reasons: dict, tp, verbose: bool, explain: bool) -> None:
    """Mark the fused norms in ``report``, add why each decision was taken (``explain``), and
    print it on TP rank 0 when asked."""
    for name in fused:
        report[name] = (
            f"{report[name]}; fused rms_norm op" if name in report else "fused rms_norm op"
        )
    if explain:
        report.update(
            {n: f"{what}  [why: {reasons[n]}]" for n, what in report.items() if n in reasons}
        )
    if (verbose or explain) and tp.rank == 0:
        _print_report(report, tp)


def _apply_styles(module, decided, tp, shards, parts, report, blocks) -> None:
    """Replace every module the plan covers by its style's layer (this rank's slice).
    ``shards``: the sequence shards under sequence parallelism, else None; ``blocks``: the
    names of the sparse-MoE blocks (which gather the sequence for the modules in them)."""
    sp = shards is not None
    shared = _shared_parameters(module)
    _check_ties(module, decided, shared)
    _check_shared_readers(decided)
    ancestor_ties = _ancestor_ties(module, decided, shared)
    converted: dict[int, nn.Module] = {}  # id of a replaced module's weight -> its tp_ext layer
    # Embeddings first, so an LM head tied to one finds it converted.
    order = sorted(decided.items(), key=lambda item: not _is_embedding(module, item[0]))
    for name, style in order:
        parent_name, _, leaf = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        child = getattr(parent, leaf)
        tie_to = _tied_embedding(child, shared, converted)
        block = next((b for b in blocks if name.startswith(f"{b}.")), None) if sp else None
        target = StyleTarget(name, parent, tp, sp, shards, tie_to, parts.get(name), block)
        new, what = style.apply(child, target)
        if new is not child:
            for param in child.parameters(recurse=False):
                converted[id(param)] = new
            setattr(parent, leaf, new)
        report[name] = f"{style.name}: {what}"
    for ancestor, attr, split, leaf in ancestor_ties:  # the tie follows the split parameter
        setattr(module.get_submodule(ancestor), attr, getattr(module.get_submodule(split), leaf))
    for style in {type(s): s for s in decided.values()}.values():
        style.finish(module)
    for name, style in decided.items():  # their readers are converted now
        if isinstance(style, SharedInput) and tp.size > 1:
            style.share(module.get_submodule(name), module)


def _check_shared_readers(decided: dict) -> None:
    """The readers of every :class:`SharedInput` norm are in the plan as column-parallel linears
    whose output stays split (checked before anything is converted)."""
    for norm, style in decided.items():
        if not isinstance(style, SharedInput):
            continue
        for reader in style.readers:
            got = decided.get(reader)
            if not isinstance(got, Colwise) or got.gather_output:
                raise ValueError(
                    f"{norm}: SharedInput names {reader!r} as a reader of its output, but the "
                    f"plan gives it {got!r}; every reader must be Colwise() (output left split), "
                    "or leave the norm out of the plan"
                )


def _pipeline_parts(
    module, parallel, sequence_parallel, example_inputs, options: dict, decoder_parts=None
):
    """What pipelining ``module`` needs, checked before anything is converted: its decoder
    parts (:func:`find_decoder_parts`) and the stage ``options`` (virtual_stages,
    pipeline_split, stage_order)."""
    config = getattr(module, "config", None)
    refusal = None
    if getattr(config, "output_router_logits", False):
        refusal = (
            "the router's load-balancing loss (config.output_router_logits=True), which spans "
            "the layers of every stage,"
        )
    if refusal is not None:
        raise ValueError(
            f"parallelize: pp={parallel.pp} with {refusal} is not supported yet; use pp=1 "
            "for this model, or drop that option"
        )
    layers = getattr(config, "num_hidden_layers", None)
    if isinstance(layers, int):  # a bad split is refused before the model is touched
        stages = parallel.pp * options["virtual_stages"]
        # by cost (the LM head's on the last stage)
        default = default_pipeline_split(module, stages) if layers >= stages else None
        split = StageSplit(
            layers,
            parallel.pp,
            options["virtual_stages"],
            options["pipeline_split"],
            options["stage_order"],
            default=default,
        )
        options["pipeline_split"] = split.layer_counts
    if decoder_parts is not None:
        return decoder_parts, options
    if example_inputs is None:
        example_inputs = example_token_inputs(module)
    if example_inputs is None:
        raise ValueError(
            f"parallelize: pp={parallel.pp} runs {type(module).__name__} once to see which "
            "modules come before and after its decoder layers, and could not make token ids "
            "for it; pass example_inputs=(args, kwargs)"
        )
    return find_decoder_parts(module, example_inputs), options


def _print_report(report: dict[str, str], tp) -> None:
    width = max((len(n) for n in report), default=0)
    print(f"tp_ext.parallelize over {tp.size} ranks (rank 0's shards):")
    for name, what in report.items():
        print(f"  {name:<{width}}  {what}")


def _check_not_parallelized(module) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"parallelize: module must be a torch.nn.Module (the model to shard in place), got "
            f"{type(module).__name__} {module!r:.60}"
        )
    done = [n for n, m in module.named_modules() if isinstance(m, ParallelModule)]
    if done:
        raise ValueError(
            f"{type(module).__name__} already holds tp_ext layers ({done[0]!r}, ...): it was "
            "parallelized before (or built from tp_ext layers); parallelize each model once"
        )


def _decide(module, plan, sequence_parallel, example_inputs):
    """``({module name: style}, {module name: why}, {module name: part widths})``: the style of
    every module the plan covers, why it got it (for ``explain``), and the widths auto traced a
    fused column's output being cut into."""
    reasons: dict[str, str] = {}
    parts: dict[str, list] = {}
    if isinstance(plan, str):
        if plan != "auto":
            raise ValueError(
                f"plan must be 'auto' or a dict of name pattern -> style, got {plan!r}"
            )
        decided = auto_plan(module, sequence_parallel, reasons, example_inputs, parts)
    elif isinstance(plan, Mapping):
        decided = resolve_plan(module, plan)
        reasons = {name: "given by the plan" for name in decided}
    else:
        raise TypeError(f"plan must be 'auto' or a dict, got {type(plan).__name__}")
    styles = {name: as_style(style, f"the style of {name}") for name, style in decided.items()}
    return styles, reasons, {name: tuple(widths) for name, widths in parts.items()}


def _split_sequence_from(module, first_norm: str, shards: SequenceShards, report) -> None:
    """The residual stream is split where the first sequence-parallel norm's block (decoder
    layer) begins."""
    first_block = first_norm.rpartition(".")[0]
    if not first_block:
        raise ValueError(f"sequence-parallel norm {first_norm!r} must sit inside a block")
    module.get_submodule(first_block).register_forward_pre_hook(shards.split, with_kwargs=True)
    report[first_block] = "sequence parallel from here: hidden states split along the sequence"


def _run_attention_on_local_heads(module: nn.Module, tp, report: dict) -> None:
    """Hugging Face attention whose input projections were split by heads: run its own code on
    this rank's heads."""
    for name, child in module.named_modules():
        info = attention_heads(child)
        first = None if info is None else getattr(child, info.inputs[0], None)
        if isinstance(first, ColumnParallelLinear):
            q, kv, split = localize_attention(child, info, tp)
            per_head = _sum_gradients_over_heads(child, tp)
            notes = split + (
                [f"{', '.join(per_head)} gradients summed over TP"] if per_head else []
            )
            report[name] = "; ".join(
                [f"attention: {q} query heads, {kv} KV heads on this rank"] + notes
            )


def _spread_experts(module, blocks, decided, report, ep_group, tp, shards, capacity_factor):
    """Swap every sparse-MoE block (``blocks``: their names) for an ExpertParallelMoE (this
    rank's experts, split over TP inside; ``shards``: the sequence shards under sequence
    parallelism, else None); the plan's entries for the experts go, the shared expert keeps its
    styles (its modules keep their names under the new block)."""
    if not blocks:
        raise ValueError(
            f"parallelize: parallel.ep={resolve_group(ep_group).size} asks for expert "
            f"parallelism, but {type(module).__name__} has no sparse-MoE block (a `gate` router "
            "and `experts` with 3-D gate_up_proj / down_proj); use ep=1 for a dense model"
        )
    for name in blocks:
        block = module.get_submodule(name)
        for key in [k for k in decided if k == name or k.startswith(f"{name}.experts")]:
            del decided[key]
        layer = ExpertParallelMoE.from_block(block, ep_group, tp, capacity_factor, shards)
        parent_name, _, leaf = name.rpartition(".")
        setattr(module.get_submodule(parent_name) if parent_name else module, leaf, layer)
        report[name] = f"expert parallel: {layer.extra_repr()}"


def _is_embedding(module: nn.Module, name: str) -> bool:
    return isinstance(module.get_submodule(name), nn.Embedding)


def _shared_parameters(module: nn.Module) -> dict[int, list[str]]:
    """For each parameter owned by more than one module: the names of its owners."""
    owners: dict[int, list[str]] = {}
    for name, child in module.named_modules(remove_duplicate=False):
        for param in child.parameters(recurse=False):
            owners.setdefault(id(param), []).append(name)
    return {pid: names for pid, names in owners.items() if len(set(names)) > 1}


def _check_ties(module: nn.Module, decided: dict[str, ParallelStyle], shared) -> None:
    """Every shared parameter stays shared: either no owner's weights are split, or it is an
    embedding and an LM head both given the 'vocab' style (the head is then tied to the new
    embedding). Anything else would be silently untied, so it is refused."""
    for owner_names in shared.values():
        owners = sorted(set(owner_names))
        styles = {n: decided.get(n, Replicate()) for n in owners}
        if not any(style.shards_weights for style in styles.values()):
            continue
        if _held_by_an_ancestor(module, owners, styles) is not None:
            continue
        kinds = [type(module.get_submodule(n)).__name__ for n in owners]
        tables = [n for n in owners if isinstance(module.get_submodule(n), nn.Embedding)]
        heads = [n for n in owners if isinstance(module.get_submodule(n), nn.Linear)]
        embeddings_and_head = (
            all(isinstance(style, VocabParallel) for style in styles.values())
            and tables
            and len(heads) <= 1
            and len(tables) + len(heads) == len(owners)
        )
        if not embeddings_and_head:
            raise ValueError(
                f"modules {owners} share a parameter and would be split differently "
                f"({styles}; {kinds}): parallelize keeps a tie only between embeddings and an "
                "LM head all given the 'vocab' style; give them that style or untie them first"
            )


def _held_by_an_ancestor(module: nn.Module, owners: list, styles: dict):
    """``(ancestor name, attribute, splitting module name, its parameter's name)`` when a
    parameter of one split module is also a plain attribute of a module above it that is not
    converted (BERT's masked-LM head holds its decoder's bias as ``cls.predictions.bias``): the
    attribute then follows the split parameter, and the tie holds. Else None."""
    split = [n for n in owners if styles[n].shards_weights]
    if len(split) != 1 or len(owners) != 2:
        return None
    (ancestor,) = [n for n in owners if n != split[0]]
    if ancestor and not split[0].startswith(f"{ancestor}."):
        return None
    holder, child = module.get_submodule(ancestor), module.get_submodule(split[0])
    mine = {id(p): n for n, p in child.named_parameters(recurse=False)}
    for attr, param in holder.named_parameters(recurse=False):
        if id(param) in mine:
            return ancestor, attr, split[0], mine[id(param)]
    return None


def _ancestor_ties(module: nn.Module, decided: dict, shared) -> list:
    """Every :func:`_held_by_an_ancestor` tie of the model, found before conversion."""
    ties = []
    for owner_names in shared.values():
        owners = sorted(set(owner_names))
        styles = {n: decided.get(n, Replicate()) for n in owners}
        held = _held_by_an_ancestor(module, owners, styles)
        if held is not None:
            ties.append(held)
    return ties


def _tied_embedding(child: nn.Module, shared, converted):
    """The converted embedding an LM head or another embedding shares its weight with (see
    _check_ties), or None."""
    weight = getattr(child, "weight", None)
    if isinstance(child, (nn.Linear, nn.Embedding)) and weight is not None and id(weight) in shared:
        return converted.get(id(weight))
    return None


def _sum_gradients_over_heads(attention: nn.Module, tp) -> list[str]:
    """Replicated parameters inside head-split attention (Qwen3's and Gemma 3's per-head
    ``q_norm``/``k_norm``) see only this rank's heads, so their gradients are partial sums: a
    hook adds them up over the TP group (replicated KV heads are right too: each replica's
    gradient comes from different query heads). Returns the parameters' names."""
    hooked = []
    for sub_name, sub in attention.named_modules():
        if isinstance(sub, ParallelModule) or any(
            isinstance(m, ParallelModule) for m in sub.modules()
        ):
            continue
        for param_name in sum_gradients_over(sub, tp):
            hooked.append(f"{sub_name}.{param_name}" if sub_name else param_name)
    return hooked
