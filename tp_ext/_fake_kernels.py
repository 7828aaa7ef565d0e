"""Fake (meta) kernels of tp_ext's fused compute ops (rms_norm, add_rms_norm, swiglu and their
backward ops), so torch.compile and torch.export can trace them. Outputs are contiguous, as the
real kernels'."""

from __future__ import annotations

import torch


def _norm_out(x, weight):
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))


@torch.library.register_fake("tp_ext::rms_norm")
def _rms_norm(x, weight, eps):
    return _norm_out(x, weight)


@torch.library.register_fake("tp_ext::add_rms_norm")
def _add_rms_norm(x, residual, weight, eps):
    return _norm_out(x, weight), x.new_empty(x.shape)


@torch.library.register_fake("tp_ext::rms_norm_backward")
def _rms_norm_backward(grad, x, weight, eps):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


@torch.library.register_fake("tp_ext::swiglu")
def _swiglu(gate_up):
    torch._check(gate_up.dim() >= 1 and gate_up.shape[-1] % 2 == 0,
                 lambda: f"tp_ext.swiglu: gate_up has shape {tuple(gate_up.shape)}; its last "
                         "dimension must be even (gate and up stacked: [..., 2 * I]).")
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


@torch.library.register_fake("tp_ext::swiglu_backward")
def _swiglu_backward(grad, gate_up):
    return gate_up.new_empty(gate_up.shape)
