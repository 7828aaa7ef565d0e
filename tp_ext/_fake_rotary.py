"""Fake (meta) kernel of tp_ext::rotary_embedding: outputs shaped and strided like q and k."""

import torch


@torch.library.register_fake("tp_ext::rotary_embedding")
def _rotary_embedding(q, k, cos, sin):
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"tp_ext.rotary_embedding: q and k must be 4-d, got shapes "
                         f"{tuple(q.shape)} and {tuple(k.shape)}.")
    want = (q.shape[0], q.shape[2], q.shape[3])
    for name, t in (("cos", cos), ("sin", sin)):
        if tuple(t.shape) != want:
            raise ValueError(f"tp_ext.rotary_embedding: {name} has shape {tuple(t.shape)} but q "
                             f"has shape {tuple(q.shape)}; {name} must be [batch, seq, head_dim]"
                             f" = {list(want)}.")
    return _out_like(q), _out_like(k)


def _out_like(x):
    # As the kernels: x's strides when head_dim has unit stride, else contiguous.
    out = torch.empty_like(x)
    return out if out.stride(-1) == 1 else torch.empty(x.shape, dtype=x.dtype, device=x.device)
