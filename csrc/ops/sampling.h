// Shared by the CPU (sampling.cpp) and CUDA (sampling_cuda.cu) kernels of the vocab-parallel
// sampling ops: the accumulation dtype, the argument checks and the setup of inputs and outputs,
// so both devices raise the same errors.
#pragma once

#include <ATen/core/Tensor.h>

namespace tp_ext::ops {

// The accumulation dtype of the scaled logits s = logits.to(acc) / temperature and of every sum
// over them: fp64 for fp64 logits, else fp32 (bf16 and half logits accumulate in fp32).
inline at::ScalarType sampling_acc_dtype(at::ScalarType logits) {
  return logits == at::kDouble ? at::kDouble : at::kFloat;
}

// logits: a dense 2-d floating tensor [B, V_local] (fp16, bf16, fp32, fp64; V_local may be 0).
void check_sampling_logits(const at::Tensor& logits, const char* op);
// temperature: finite and > 0, also once converted to the accumulation dtype `acc`.
void check_temperature(double temperature, at::ScalarType acc, const char* op);
// x: a dense 1-d tensor [B] of the accumulation dtype `acc`, on `device`.
void check_row_values(const at::Tensor& x, const char* arg, int64_t rows, at::ScalarType acc,
                      const at::Device& device, const char* op);

// Checked, contiguous inputs and the allocated output of sampling_kept_mass and sampling_pick
// (target undefined for kept_mass). out: [B], acc dtype (kept_mass) or int64 (pick).
struct SamplingRowArgs {
  at::Tensor logits;                      // [B, V] contiguous
  at::Tensor threshold, row_max, target;  // [B] contiguous, acc dtype
  at::Tensor out;
  int64_t rows, vocab;
};
SamplingRowArgs prepare_kept_mass(const at::Tensor& logits, double temperature,
                                  const at::Tensor& threshold, const at::Tensor& row_max);
SamplingRowArgs prepare_pick(const at::Tensor& logits, double temperature,
                             const at::Tensor& threshold, const at::Tensor& row_max,
                             const at::Tensor& target);

}  // namespace tp_ext::ops
