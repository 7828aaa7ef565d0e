// Shared by the CPU (attention_merge.cpp) and CUDA (attention_merge_cuda.cu) kernels of
// attention_merge and attention_merge_backward: the argument checks and the setup of inputs and
// outputs, so both devices raise the same errors.
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>
#include <vector>

namespace tp_ext::ops {

// Checked, contiguous inputs of attention_merge, viewed as rows: out_* [N, D] and lse_* [N], and
// the outputs (out [N, D] in out_a's dtype, lse [N] in lse_a's). `shape` is out_a's shape.
struct MergeArgs {
  at::Tensor out_a, lse_a, out_b, lse_b, out, lse;
  std::vector<int64_t> shape;
};
MergeArgs attention_merge_args(const at::Tensor& out_a, const at::Tensor& lse_a,
                               const at::Tensor& out_b, const at::Tensor& lse_b, const char* op);

// attention_merge_backward's inputs as rows, and its outputs (grad_out_a, grad_lse_a,
// grad_out_b, grad_lse_b).
struct MergeBackwardArgs {
  MergeArgs merge;  // out_a, lse_a, out_b, lse_b and the merged out, lse (inputs here)
  at::Tensor grad_out, grad_lse, grad_out_a, grad_lse_a, grad_out_b, grad_lse_b;
};
MergeBackwardArgs attention_merge_backward_args(const at::Tensor& grad_out,
                                                const at::Tensor& grad_lse, const at::Tensor& out_a,
                                                const at::Tensor& lse_a, const at::Tensor& out_b,
                                                const at::Tensor& lse_b, const at::Tensor& out,
                                                const at::Tensor& lse);

// The ops' results in the inputs' shapes: (out, lse) and (grad_out_a, grad_lse_a, grad_out_b,
// grad_lse_b).
std::tuple<at::Tensor, at::Tensor> attention_merge_results(const MergeArgs& a);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_merge_backward_results(
    const MergeBackwardArgs& b);

}  // namespace tp_ext::ops
