"""How a model's linears connect: one traced forward on a few tokens, for the "auto" plan.

A column-parallel linear leaves its output split over the ranks by features; that is only right
when every op between it and the next linear works feature by feature (or head by head), and the
next linear is row-parallel, whose all-reduce makes the result whole again. Names cannot tell
that (``w1``/``w2``/``fc_in``...); the forward can. So the model runs once, on 1 x T token ids,
under a dispatch mode that gives every tensor a provenance:

- ``stream``: computed from the token embeddings without a linear in between (the residual
  stream, the norms' outputs): a tensor every rank must hold whole;
- ``linears``: the linears whose outputs reach it through other ops only;
- ``mixed``: those of ``linears`` whose whole output a reduction has combined (a norm or a
  softmax over all their features): a split output would give another answer there.

Module hooks record, for each linear, its input's provenance and set its output's; for each
embedding, whether it is indexed by the token ids. What the ops do with a linear's output that
matters for splitting it is recorded too: cut into equal parts along features (a fused
``[gate | up]``), added into the residual stream. :mod:`tp_ext.parallelize.plan` decides from
this. The trace runs without gradients, in eval mode, with the random state put back after, so
the model and the ranks' generators are as they were.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tp_ext.layers.moe import is_sparse_moe_block

__all__ = ["LinearFlow", "Flow", "trace_flow"]

aten = torch.ops.aten


@dataclass(frozen=True)
class _Provenance:
    stream: bool = False
    linears: frozenset = frozenset()
    mixed: frozenset = frozenset()
    tokens: bool = False  # the token ids themselves (or views of them)
    param: bool = False  # a parameter of a module other than the linears (a norm's weight...)
    norm: Optional[str] = None  # the norm this stream tensor came out of (through 1-input ops)


_NONE = _Provenance()


@dataclass
class LinearFlow:
    """What the trace saw around one linear (``name`` as in ``named_modules``)."""

    name: str
    out_features: int
    reads_stream: bool = False  # its input is (computed from) the residual stream
    sources: frozenset = frozenset()  # the linears its input is computed from
    mixed_sources: frozenset = frozenset()  # of those, the ones a reduction combined on the way
    parts: Optional[tuple] = None  # its output cut along features into these widths
    reaches_stream: bool = False  # its output (not through another linear) enters the stream
    reduced: bool = False  # a reduction over all its output features follows (a softmax...)
    scaled_by: bool = False  # a parameter as wide as its output meets it (it would need a split)
    makes_logits: bool = False  # its output is the model's returned logits (through other ops)
    called: bool = False  # the forward used it


@dataclass
class Flow:
    """The traced forward: each linear's :class:`LinearFlow`, and the embeddings by what indexes
    them."""

    linears: dict = field(default_factory=dict)  # name -> LinearFlow
    token_embeddings: set = field(default_factory=set)  # indexed by the token ids
    other_embeddings: set = field(default_factory=set)  # indexed by positions or anything else
    norms_feeding_linears: set = field(default_factory=set)  # their output is a linear's input
    norms_called: list = field(default_factory=list)  # in the order the forward called them
    norms_flat: set = field(
        default_factory=set
    )  # called on [tokens, hidden], batch and sequence merged
    norm_readers: dict = field(default_factory=dict)  # norm -> the linears reading its output
    norm_moe_blocks: dict = field(default_factory=dict)  # norm -> sparse-MoE blocks reading it
    # norms whose output (through casts and views) also reaches an op outside the linears
    norms_read_elsewhere: set = field(default_factory=set)
    tokens: int = 0

    def consumers(self, name: str) -> list:
        """The linears whose input is computed from ``name``'s output (not through the stream)."""
        return sorted(n for n, f in self.linears.items() if name in f.sources)


# Ops that combine the elements along some dims: (function, how to find the reduced dims)
def _dims_arg(position, default=None):
    def dims(args, kwargs):
        value = args[position] if len(args) > position else kwargs.get("dim", default)
        if value is None:
            return None  # every dim
        return [value] if isinstance(value, int) else list(value)

    return dims


def _layer_norm_dims(args, kwargs):
    return [-(i + 1) for i in range(len(args[1]))]


_REDUCTIONS = {
    aten.mean.dim: _dims_arg(1),
    aten.sum.dim_IntList: _dims_arg(1),
    aten.var.correction: _dims_arg(1),
    aten.var_mean.correction: _dims_arg(1),
    aten.std.correction: _dims_arg(1),
    aten.amax.default: _dims_arg(1),
    aten.amin.default: _dims_arg(1),
    aten.max.dim: _dims_arg(1),
    aten.min.dim: _dims_arg(1),
    aten.argmax.default: _dims_arg(1),
    aten.logsumexp.default: _dims_arg(1),
    aten._softmax.default: _dims_arg(1),
    aten._log_softmax.default: _dims_arg(1),
    aten.topk.default: _dims_arg(2, -1),
    aten.sort.default: _dims_arg(1, -1),
    aten.sort.stable: _dims_arg(1, -1),
    aten.linalg_vector_norm.default: _dims_arg(2),
    aten.native_layer_norm.default: _layer_norm_dims,
    aten._fused_rms_norm.default: _layer_norm_dims,
}
_SPLITS = {aten.split.Tensor, aten.split_with_sizes.default, aten.unsafe_split.Tensor}
# Ops that read a tensor only for its shape, dtype and device: no data flows through them
_FACTORIES = {
    aten.new_ones,
    aten.new_zeros,
    aten.new_empty,
    aten.new_full,
    aten.new_empty_strided,
    aten.empty_like,
    aten.zeros_like,
    aten.ones_like,
    aten.full_like,
    aten.rand_like,
    aten.randn_like,
}


class _Tracer(TorchDispatchMode):
    def __init__(self, flow: Flow, head_dims: dict):
        super().__init__()
        self.flow = flow
        self.head_dims = head_dims  # linear name -> its attention's head_dim (per-head ops)
        self.prov: dict[int, _Provenance] = {}
        self.outputs: dict[int, str] = {}  # id of a linear's output tensor -> the linear
        self.alive: list = []  # every tagged tensor, so no id is reused during the trace
        self.inside_linears = 0  # > 0 while a linear's own forward runs
        # whether each lookup (aten.embedding) since an embedding module began was by token ids
        self.lookups: list[bool] = []

    def tag(self, tensor, prov: _Provenance) -> None:
        self.prov[id(tensor)] = prov
        self.alive.append(tensor)

    def get(self, tensor) -> Optional[_Provenance]:
        return self.prov.get(id(tensor)) if isinstance(tensor, torch.Tensor) else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        provs = [p for p in map(self.get, inputs) if p is not None]
        if func is aten.embedding.default:  # what indexes it: token ids, or positions
            self.lookups.append(bool((self.get(args[1]) or _NONE).tokens))
        if func in _SPLITS and args and id(args[0]) in self.outputs:
            self._note_split(self.outputs[id(args[0])], args, kwargs, out)
        if not provs or func.overloadpacket in _FACTORIES:
            return out
        stream = any(p.stream for p in provs)
        linears = frozenset().union(*(p.linears for p in provs))
        mixed = frozenset().union(*(p.mixed for p in provs))
        if func in _REDUCTIONS and inputs:
            mixed |= self._reduced(func, args, kwargs, self.get(args[0]))
        if linears and any(p.param for p in provs):
            self._note_parameters(linears, [t for t in inputs if (self.get(t) or _NONE).param])
        normed = [t for t in inputs if (self.get(t) or _NONE).norm is not None]
        # a norm's output keeps its name through casts and views, not through an addition
        passes = len(provs) == 1 and bool(normed) and _same_size(out, normed[0])
        if normed and not passes and not self.inside_linears:
            self.flow.norms_read_elsewhere.update(self.get(t).norm for t in normed)
        if stream:
            # whatever joins the stream must be whole there (e.g. a row-parallel output)
            for name in linears:
                self.flow.linears[name].reaches_stream = True
            merged = _Provenance(stream=True, norm=self.get(normed[0]).norm if passes else None)
        else:
            tokens = all(p.tokens for p in provs) and func not in _REDUCTIONS
            if linears or tokens:
                merged = _Provenance(False, linears, mixed & linears, tokens)
            elif any(p.param for p in provs):
                merged = _Provenance(param=True)  # a parameter's casts and views
            else:
                return out
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.tag(t, merged)
        return out

    def _reduced(self, func, args, kwargs, prov: Optional[_Provenance]) -> frozenset:
        """The linears whose whole output (all its features, or one fused part's) this
        reduction combines; one inside a head (size head_dim) is per head: a head split keeps it."""
        if prov is None or not prov.linears or not isinstance(args[0], torch.Tensor):
            return frozenset()
        x = args[0]
        dims = _REDUCTIONS[func](args, kwargs)
        sizes = list(x.shape) if dims is None else [x.shape[d] for d in dims if x.dim()]
        combined = set()
        for name in prov.linears:
            f = self.flow.linears[name]
            widths = {f.out_features, *(f.parts or ())}
            if any(s in widths and s != self.head_dims.get(name) for s in sizes):
                combined.add(name)
                f.reduced = True
        return frozenset(combined)

    def _note_parameters(self, linears, params) -> None:
        """A parameter with a dimension as wide as a linear's output (a per-feature scale) meets
        that output: split, the output would no longer line up with it."""
        for name in linears:
            f = self.flow.linears[name]
            widths = {f.out_features, *(f.parts or ())} - {self.head_dims.get(name)}
            if any(d in widths for p in params for d in p.shape):
                f.scaled_by = True

    def _note_split(self, name, args, kwargs, out) -> None:
        x = args[0]
        dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
        if dim % x.dim() == x.dim() - 1:
            self.flow.linears[name].parts = tuple(t.shape[-1] for t in out)


def _same_size(out, x: torch.Tensor) -> bool:
    return isinstance(out, torch.Tensor) and out.numel() == x.numel()


def _trace_length(model: nn.Module) -> int:
    """A sequence length equal to no linear's width, so a reduction over the tokens (attention's
    softmax over keys) is never taken for one over a linear's features."""
    widths = set()
    for m in model.modules():
        for p in m.parameters(recurse=False):
            widths.update(p.shape)
    t = 5
    while t in widths:
        t += 1
    return t


def example_token_inputs(model: nn.Module, tokens: int = 5):
    """``(args, kwargs)`` calling ``model`` on what its config describes: 1 x ``tokens`` token
    ids (from its vocabulary; an encoder-decoder's decoder gets them too), and a 1-image batch
    of ``pixel_values`` for a vision model (``config.num_channels`` x ``config.image_size``);
    None when it describes neither."""
    config = getattr(model, "config", None)
    params = inspect.signature(model.forward).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    kwargs = {}
    image = _example_image(config, device)
    if image is not None and "pixel_values" in params:
        kwargs["pixel_values"] = image
    vocab = _vocabulary(model, config)
    if vocab and ("input_ids" in params or takes_any or not kwargs):
        ids = (torch.arange(1, tokens + 1, device=device) * 7 % vocab).unsqueeze(0)
        if "input_ids" not in params and not takes_any:
            return (ids,), {}
        kwargs["input_ids"] = ids
        if "decoder_input_ids" in params:  # an encoder-decoder: its decoder reads ids too
            kwargs["decoder_input_ids"] = ids
    if not kwargs:
        return None
    if "use_cache" in params:
        kwargs["use_cache"] = False
    return (), kwargs


def _vocabulary(model: nn.Module, config) -> Optional[int]:
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    return getattr(config, "vocab_size", None) or max(
        (e.num_embeddings for e in embeddings), default=None
    )


def _example_image(config, device) -> Optional[torch.Tensor]:
    """One image of the size a vision config gives (values from a fixed generator)."""
    size, channels = getattr(config, "image_size", None), getattr(config, "num_channels", None)
    if not isinstance(channels, int) or size is None:
        return None
    height, width = (size, size) if isinstance(size, int) else tuple(size)
    g = torch.Generator().manual_seed(0)
    return torch.randn(1, channels, height, width, generator=g).to(device)


class _FlowHooks:
    """The module hooks that record, while the traced forward runs, which linears are called
    and what their inputs were computed from, which embeddings read the token ids, and which
    norms are called and feed a linear or a sparse-MoE block."""

    def __init__(self, flow: Flow, tracer: _Tracer, linears: dict) -> None:
        self.flow, self.tracer = flow, tracer
        self.by_module = {id(m): n for n, m in linears.items()}

    def install(self, model: nn.Module, linears: dict, norms: dict) -> list:
        handles = []
        for name, module in norms.items():
            handles.append(module.register_forward_hook(self.norm_after(name)))
        for module in linears.values():
            handles.append(module.register_forward_pre_hook(self.linear_before))
            handles.append(module.register_forward_hook(self.linear_after))
        for name, module in model.named_modules():
            if isinstance(module, nn.Embedding):
                handles.append(module.register_forward_pre_hook(self.embedding_before))
                handles.append(module.register_forward_hook(self.embedding_after(name)))
            elif is_sparse_moe_block(module):
                handles.append(module.register_forward_pre_hook(self.moe_block_before(name)))
        return handles

    def moe_block_before(self, name):
        def hook(module, inputs):
            prov = self.tracer.get(inputs[0]) if inputs else None
            if prov is not None and prov.norm is not None:
                self.flow.norm_moe_blocks.setdefault(prov.norm, set()).add(name)

        return hook

    def linear_before(self, module, inputs):
        name = self.by_module[id(module)]
        prov = self.tracer.get(inputs[0]) if inputs else None
        f = self.flow.linears[name]
        f.called = True
        self.tracer.inside_linears += 1
        if prov is not None:
            if prov.norm is not None:
                self.flow.norms_feeding_linears.add(prov.norm)
                self.flow.norm_readers.setdefault(prov.norm, set()).add(name)
            # a table's rows (DeBERTa's relative-position embeddings) are whole on every rank,
            # as the stream is: a linear reading them can be column-parallel
            f.reads_stream = f.reads_stream or prov.stream or (prov.param and not prov.linears)
            f.sources = f.sources | prov.linears
            f.mixed_sources = f.mixed_sources | prov.mixed

    def linear_after(self, module, inputs, output):
        name = self.by_module[id(module)]
        self.tracer.inside_linears -= 1
        if isinstance(output, torch.Tensor):
            self.tracer.tag(output, _Provenance(linears=frozenset([name])))
            self.tracer.outputs[id(output)] = name

    def embedding_before(self, module, inputs):
        self.tracer.lookups = []

    def embedding_after(self, name):
        flow, tracer = self.flow, self.tracer

        def hook(module, inputs, output):
            # by what its lookup read, not its argument: BART's learned positions take the ids
            # and look up positions made from their shape
            if any(tracer.lookups):
                flow.token_embeddings.add(name)
                tracer.tag(output, _Provenance(stream=True))
            else:  # positions, relative-position buckets: a table's rows, like a parameter
                flow.other_embeddings.add(name)
                tracer.tag(output, _Provenance(param=True))

        return hook

    def norm_after(self, name):
        flow, tracer = self.flow, self.tracer

        def hook(module, inputs, output):
            if name not in flow.norms_called:
                flow.norms_called.append(name)
            if inputs and isinstance(inputs[0], torch.Tensor) and inputs[0].dim() < 3:
                flow.norms_flat.add(name)
            prov = tracer.get(output)
            if isinstance(output, torch.Tensor) and prov is not None and prov.stream:
                tracer.tag(output, _Provenance(stream=True, norm=name))

        return hook


def trace_flow(
    model: nn.Module,
    linears: dict,
    head_dims: Optional[dict] = None,
    example_inputs=None,
    norms: Optional[dict] = None,
) -> Flow:
    """Run ``model`` once and return how its ``linears`` ({name: module}) connect, and which of
    its ``norms`` ({name: module}) feed a linear (the others' outputs go back to the stream).
    ``head_dims``: {linear name: head_dim} for attention input projections. ``example_inputs``:
    ``(args, kwargs)`` to call the model with; by default 1 x T token ids (T a few tokens)."""
    tokens = _trace_length(model)
    flow = Flow(tokens=tokens)
    for name, module in linears.items():
        flow.linears[name] = LinearFlow(name, _out_features(module))
    call = example_inputs if example_inputs is not None else example_token_inputs(model, tokens)
    if call is None:
        raise ValueError(
            f"parallelize(plan='auto') traces one forward of {type(model).__name__} to see how "
            "its linears connect, and could not make inputs for it (no config.vocab_size, no "
            "nn.Embedding, no config.image_size). Pass example_inputs=(args, kwargs) to call it "
            "with"
        )
    args, kwargs = call
    tracer = _Tracer(flow, head_dims or {})
    handles = _FlowHooks(flow, tracer, linears).install(model, linears, norms or {})
    for t in tree_leaves((args, kwargs)):
        if isinstance(t, torch.Tensor):
            # ids index embeddings; float inputs are whole on every rank, like the stream
            floating = t.is_floating_point()
            tracer.tag(t, _Provenance(stream=floating, tokens=not floating))
    own = {id(p) for m in linears.values() for p in m.parameters(recurse=False)}
    for p in model.parameters():
        if id(p) not in own:
            tracer.tag(p, _Provenance(param=True))

    modes = {m: m.training for m in model.modules()}
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.is_cuda})
    # torch's fused attention fast paths (nn.TransformerEncoderLayer in eval mode) would run the
    # layer as one op, hiding its linears from the trace
    fast_path = torch.backends.mha.get_fastpath_enabled()
    try:
        model.eval()
        torch.backends.mha.set_fastpath_enabled(False)
        with torch.random.fork_rng(devices=devices), torch.no_grad(), tracer:
            output = model(*args, **kwargs)
    except Exception as e:
        raise ValueError(
            f"parallelize(plan='auto') traces one forward of {type(model).__name__} to see how "
            f"its linears connect; calling it with {_describe(args, kwargs)} failed: "
            f"{type(e).__name__}: {e}. Pass example_inputs=(args, kwargs) that it accepts"
        ) from e
    finally:
        torch.backends.mha.set_fastpath_enabled(fast_path)
        for handle in handles:
            handle.remove()
        for module, training in modes.items():
            module.training = training
    logits = _logits(output)
    prov = tracer.get(logits)
    if prov is not None and not prov.stream:
        for name in prov.linears:
            flow.linears[name].makes_logits = True
    return flow


def _logits(output):
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return None


def _out_features(module: nn.Module) -> int:
    weight = module.weight
    # nn.Linear stores [out, in]; Hugging Face's Conv1D stores [in, out] (its ``nf`` = out)
    return int(getattr(module, "nf", None) or weight.shape[0])


def _describe(args, kwargs) -> str:
    def one(x):
        return f"tensor{list(x.shape)}" if isinstance(x, torch.Tensor) else repr(x)

    parts = [one(a) for a in args] + [f"{k}={one(v)}" for k, v in kwargs.items()]
    return f"({', '.join(parts)})"
