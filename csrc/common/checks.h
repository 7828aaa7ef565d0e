// Argument checks shared by every tp_ext op: each error names the op, the argument, its value and
// what would work.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>

namespace tp_ext {

// x is defined and dense (strided).
void check_tensor(const at::Tensor& x, const char* arg, const char* op);

// `dim` (argument `arg`) wrapped into [0, ndim); ndim must be >= 1.
int64_t wrap_dim(int64_t dim, int64_t ndim, const char* arg, const char* op);

// logits defined, dense, floating point (fp32, fp64, bf16, fp16), with a vocabulary dim [..., V].
// Works on symbolic shapes too (an op that communicates runs it while torch.compile traces).
void check_logits(const at::Tensor& logits, const char* op);

// The arguments of y = x W^T + b: x [..., in] and weight [out, in] dense, of one dtype; bias, when
// given, [out].
void check_linear(const at::Tensor& x, const at::Tensor& weight,
                  const std::optional<at::Tensor>& bias, const char* op);

// "[a, b, c]", for error messages.
std::string shape_str(at::IntArrayRef s);

}  // namespace tp_ext
