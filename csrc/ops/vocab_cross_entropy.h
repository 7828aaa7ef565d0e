// Shared by the vocab-parallel cross-entropy's local kernels (CPU: vocab_cross_entropy.cpp, CUDA:
// vocab_cross_entropy_cuda.cu) and its communicating op (vocab_parallel_cross_entropy.cpp).
#pragma once

#include <ATen/core/Tensor.h>

namespace tp_ext::ops {

// dtype of the per-token statistics and of the loss: fp64 for fp64 logits, else fp32 (bf16 and
// half logits accumulate in fp32).
inline at::ScalarType stats_dtype(at::ScalarType logits) {
  return logits == at::kDouble ? at::kDouble : at::kFloat;
}

// Checks that name the argument, its value and what would work: logits floating point with a
// vocabulary dim, target int64 of shape logits.shape[:-1] on the same device. Works on symbolic
// shapes too (the communicating op runs it while torch.compile traces).
void check_logits_target(const at::Tensor& logits, const at::Tensor& target, const char* op);
void check_label_smoothing(double label_smoothing, const char* op);

// Logits as a contiguous [N, V_r] matrix (a copy only when the input is not contiguous).
struct Rows {
  at::Tensor logits;
  int64_t n;
  int64_t v;
};
Rows rows_of(const at::Tensor& logits);

// Where this rank's shard sits in the vocabulary, read (on the host) from the max all-reduced
// `max_sizes` of `tokens` tokens; checks that this rank's slot says `shard` entries.
struct Layout {
  int64_t vocab_start;
  int64_t vocab;
};
Layout read_layout(const at::Tensor& max_sizes, int64_t tokens, int64_t shard, int64_t group_rank,
                   at::ScalarType logits_dtype, const char* op);
void check_targets(const at::Tensor& target, int64_t ignore_index, int64_t vocab);

// Checked, contiguous arguments and the allocated output of each local op, shared by the CPU
// and CUDA kernels so both raise the same errors.
struct LocalStatsArgs {
  Rows rows;
  at::Tensor max_sizes;  // [N + W], this rank's size already written; kernels fill the N maxima
  at::Tensor sums;       // [N, 2]
};
LocalStatsArgs prepare_local_stats(const at::Tensor& logits, int64_t group_size,
                                   int64_t group_rank);

struct GradArgs {
  Rows rows;
  Layout layout;
  at::Tensor target, g, lse;  // g: [N] in the stats dtype
  at::Tensor out;             // contiguous, logits' shape
};
GradArgs prepare_grad(const at::Tensor& grad_loss, const at::Tensor& logits,
                      const at::Tensor& target, const at::Tensor& max_sizes, const at::Tensor& lse,
                      double label_smoothing, int64_t group_rank);

}  // namespace tp_ext::ops
