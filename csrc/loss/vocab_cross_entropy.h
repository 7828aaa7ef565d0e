// Shared by the vocab-parallel cross-entropy's local kernels and its communicating op.
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

namespace tp_ext::loss {

// dtype of the per-token statistics and of the loss: fp64 for fp64 logits, else fp32 (bf16 and
// half logits accumulate in fp32).
inline at::ScalarType stats_dtype(at::ScalarType logits) {
  return logits == at::kDouble ? at::kDouble : at::kFloat;
}

// Checks that name the argument, its value and what would work: logits floating point with a
// vocabulary dim, target int64 of shape logits.shape[:-1] on the same device. Works on symbolic
// shapes too (the communicating op runs it while torch.compile traces).
void check_logits(const at::Tensor& logits, const char* op);
void check_logits_target(const at::Tensor& logits, const at::Tensor& target, const char* op);
void check_label_smoothing(double label_smoothing, const char* op);

// Registers, at the CUDA key, a kernel that raises NotImplementedError for op `name`: the loss
// has CPU kernels only for now.
void register_cuda_not_implemented(torch::Library& m, const char* name);

}  // namespace tp_ext::loss
