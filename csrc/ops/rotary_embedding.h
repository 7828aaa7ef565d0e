// Shared by the CPU and CUDA kernels of tp_ext::rotary_embedding.
#pragma once

#include <ATen/core/Tensor.h>

namespace tp_ext::ops {

// Checks q [B, Hq, S, D], k [B, Hk, S, D], cos/sin [B, S, D] (D even, same dtype/device) and
// raises errors naming the argument and the shapes.
void check_rotary_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                       const at::Tensor& sin);

// Output for x: x's strides when dense with unit head_dim stride, else contiguous.
at::Tensor rotary_out_like(const at::Tensor& x);

}  // namespace tp_ext::ops
