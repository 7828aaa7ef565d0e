// Shared by the CPU (moe_permute.cpp) and CUDA (moe_permute_cuda.cu) kernels of the token
// permutation for mixture-of-experts routing: the argument checks and the setup of inputs and
// outputs, so both devices raise the same errors.
#pragma once

#include <ATen/core/Tensor.h>

namespace tp_ext::ops {

// expert_ids: a 2-d integer tensor [tokens, top_k]; returns it as contiguous int64.
at::Tensor checked_expert_ids(const at::Tensor& expert_ids, int64_t num_experts, const char* op);

// The weights' gradient dtype (and the dtype kernels read weights in): fp64 for fp64 rows, else
// fp32.
at::ScalarType weight_grad_dtype(const at::Tensor& rows);

// Checked, contiguous inputs of each op on any device. weights: fp32 (fp64 for fp64 rows), or
// undefined when there are none. Range checks of row_map's entries that read its data are the
// CPU kernels' own (the CUDA kernels assert on the device).
struct PermuteArgs {
  at::Tensor x, row_map, weights;
};
PermuteArgs permute_args(const at::Tensor& x, const at::Tensor& row_map,
                         const c10::optional<at::Tensor>& weights, int64_t num_rows);
struct UnpermuteArgs {
  at::Tensor y, row_map, weights;
};
UnpermuteArgs unpermute_args(const at::Tensor& y, const at::Tensor& row_map,
                             const c10::optional<at::Tensor>& weights);
struct WeightGradArgs {
  at::Tensor tokens, rows, row_map;
};
WeightGradArgs weight_grad_args(const at::Tensor& tokens, const at::Tensor& rows,
                                const at::Tensor& row_map);

}  // namespace tp_ext::ops
